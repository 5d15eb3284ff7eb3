// Bad inputs over the wire against real kvmanager and kvworker processes:
// each gets its canonical code and a message naming the field, and leaves
// the cluster as it was.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/kv_client.h"
#include "common/grpc_status.h"
#include "common/status_matchers.h"
#include "kernels/numeric.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using absl::StatusCode;
using ::testing::_;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

std::string Bf16Zeros(size_t n) { return std::string(n * 2, '\0'); }

// One cluster for the suite: tenant "alpha" owns a written sequence that
// every test tries to disturb; "beta" is the other tenant.
class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto c = Cluster::Start(ClusterOptions{});
    ASSERT_THAT(c, IsOk());
    cluster_ = c->release();
    ASSERT_THAT(cluster_->CreateTenant("alpha"), IsOk());
    ASSERT_THAT(cluster_->CreateTenant("beta"), IsOk());
    auto a = cluster_->NewClient("alpha");
    ASSERT_THAT(a, IsOk());
    alpha_ = a->release();
    auto b = cluster_->NewClient("beta");
    ASSERT_THAT(b, IsOk());
    beta_ = b->release();
    auto h = alpha_->Open(SmallModel(),
                          {MakeSpan(ROLE_SYSTEM, 16), MakeSpan(ROLE_USER, 5)},
                          "bf16", 16);
    ASSERT_THAT(h, IsOk());
    seq_ = new client::SequenceHandle(*h);
    std::mt19937 rng(7);
    const size_t n =
        size_t{21} * SmallModel().n_kv_heads() * SmallModel().head_dim();
    for (uint32_t l = 0; l < SmallModel().n_layers(); ++l) {
      k_.push_back(RandomVector(n, &rng));
      v_.push_back(RandomVector(n, &rng));
      ASSERT_THAT(alpha_->WriteKV(*seq_, l, 0, 21, k_[l].data(), v_[l].data()),
                  IsOk());
    }
  }
  static void TearDownTestSuite() {
    delete seq_;
    delete alpha_;
    delete beta_;
    delete cluster_;
  }

  void SetUp() override {
    if (cluster_ == nullptr || seq_ == nullptr) GTEST_SKIP() << "no cluster";
    before_ = Snapshot();
  }
  // No test may change alpha's sequence, its data, or the tenants' usage.
  void TearDown() override {
    if (cluster_ == nullptr || seq_ == nullptr) return;
    const std::string after = Snapshot();
    EXPECT_EQ(before_, after);
    std::vector<float> k, v;
    ASSERT_THAT(alpha_->ReadKV(*seq_, 1, 0, 21, &k, &v), IsOk());
    EXPECT_EQ(k, RoundToBf16(k_[1]));
    EXPECT_EQ(v, RoundToBf16(v_[1]));
  }

  // Alpha's sequence and the tenants alpha and beta, as text.
  static std::string Snapshot() {
    auto s = alpha_->GetSequence(seq_->sequence_id);
    EXPECT_THAT(s, IsOk());
    triax::v1::ListTenantsResponse tenants;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    EXPECT_TRUE(cluster_->manager()->ListTenants(&ctx, {}, &tenants).ok());
    std::string out = s.ok() ? s->DebugString() : "";
    for (const auto& t : tenants.tenants()) {
      if (t.tenant_id() == "alpha" || t.tenant_id() == "beta") {
        absl::StrAppend(&out, t.DebugString());
      }
    }
    return out;
  }

  static absl::Status Attend(const std::string& tenant,
                             const triax::v1::AttendItem& item) {
    auto w = alpha_->worker(seq_->worker_address);
    if (!w.ok()) return w.status();
    triax::v1::AttendRequest req;
    req.set_tenant_id(tenant);
    *req.add_items() = item;
    triax::v1::AttendResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    absl::Status s = FromGrpcStatus((*w)->Attend(&ctx, req, &resp));
    if (!s.ok()) return s;
    if (resp.results_size() != 1) {
      return absl::InternalError(
          absl::StrCat(resp.results_size(), " results for 1 item"));
    }
    return absl::Status(
        static_cast<StatusCode>(resp.results(0).status().code()),
        resp.results(0).status().message());
  }

  static triax::v1::AttendItem GoodItem() {
    triax::v1::AttendItem item;
    item.set_sequence_id(seq_->sequence_id);
    item.set_layer(0);
    item.set_num_queries(1);
    item.add_positions(20);
    item.set_queries(std::string(
        sizeof(float) * SmallModel().n_q_heads() * SmallModel().head_dim(),
        '\0'));
    return item;
  }

  static absl::Status WriteRaw(const std::string& tenant,
                               const triax::v1::KvChunk& chunk) {
    auto w = alpha_->worker(seq_->worker_address);
    if (!w.ok()) return w.status();
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::WriteKVResponse resp;
    auto writer = (*w)->WriteKV(&ctx, &resp);
    triax::v1::WriteKVRequest m;
    m.set_request_id(alpha_->NewRequestId());
    m.set_tenant_id(tenant);
    m.set_sequence_id(seq_->sequence_id);
    *m.mutable_chunk() = chunk;
    writer->Write(m);
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  }

  static Cluster* cluster_;
  static client::Client* alpha_;
  static client::Client* beta_;
  static client::SequenceHandle* seq_;
  static std::vector<std::vector<float>> k_, v_;
  std::string before_;
};

Cluster* BadInputTest::cluster_ = nullptr;
client::Client* BadInputTest::alpha_ = nullptr;
client::Client* BadInputTest::beta_ = nullptr;
client::SequenceHandle* BadInputTest::seq_ = nullptr;
std::vector<std::vector<float>> BadInputTest::k_, BadInputTest::v_;

TEST_F(BadInputTest, UnknownSequence) {
  EXPECT_THAT(alpha_->GetSequence("no-such-seq"),
              StatusIs(StatusCode::kNotFound, HasSubstr("no-such-seq")));
  client::SequenceHandle ghost = *seq_;
  ghost.sequence_id = "no-such-seq";
  EXPECT_THAT(alpha_->Extend(&ghost, {MakeSpan(ROLE_USER, 3)}, false, false),
              StatusIs(StatusCode::kNotFound, HasSubstr("ExtendSequence")));
  std::vector<float> k, v;
  EXPECT_THAT(alpha_->ReadKV(ghost, 0, 0, 1, &k, &v),
              StatusIs(StatusCode::kNotFound, HasSubstr("no-such-seq")));
  triax::v1::AttendItem item = GoodItem();
  item.set_sequence_id("no-such-seq");
  EXPECT_THAT(Attend("alpha", item),
              StatusIs(StatusCode::kNotFound, HasSubstr("no-such-seq")));
  // Close reports the manager's NOT_FOUND (the worker's is not a real error).
  EXPECT_THAT(alpha_->Close(ghost),
              StatusIs(StatusCode::kNotFound, HasSubstr("CloseSequence")));
}

TEST_F(BadInputTest, AnotherTenantsSequenceIsDenied) {
  // Manager side.
  EXPECT_THAT(beta_->GetSequence(seq_->sequence_id),
              StatusIs(StatusCode::kPermissionDenied, HasSubstr("beta")));
  client::SequenceHandle stolen = *seq_;
  EXPECT_THAT(
      beta_->Extend(&stolen, {MakeSpan(ROLE_USER, 3)}, false, false),
      StatusIs(StatusCode::kPermissionDenied, HasSubstr("ExtendSequence")));
  EXPECT_THAT(beta_->Fork(*seq_, 0),
              StatusIs(StatusCode::kPermissionDenied, _));
  {
    triax::v1::CloseSequenceRequest req;
    req.set_request_id(beta_->NewRequestId());
    req.set_tenant_id("beta");
    req.set_sequence_id(seq_->sequence_id);
    triax::v1::CloseSequenceResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    EXPECT_THAT(
        FromGrpcStatus(cluster_->manager()->CloseSequence(&ctx, req, &resp)),
        StatusIs(StatusCode::kPermissionDenied, _));
  }
  // Worker side.
  std::vector<float> k, v;
  EXPECT_THAT(beta_->ReadKV(*seq_, 0, 0, 1, &k, &v),
              StatusIs(StatusCode::kPermissionDenied, _));
  EXPECT_THAT(Attend("beta", GoodItem()),
              StatusIs(StatusCode::kPermissionDenied, _));
  std::vector<float> zeros(size_t{21} * 64, 0.f);
  EXPECT_THAT(beta_->WriteKV(*seq_, 0, 0, 1, zeros.data(), zeros.data()),
              StatusIs(StatusCode::kPermissionDenied, HasSubstr("WriteKV")));
  auto w = beta_->worker(seq_->worker_address);
  ASSERT_THAT(w, IsOk());
  {
    triax::v1::FreePagesRequest req;
    req.set_request_id(beta_->NewRequestId());
    req.set_tenant_id("beta");
    req.set_sequence_id(seq_->sequence_id);
    triax::v1::FreePagesResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    EXPECT_THAT(FromGrpcStatus((*w)->FreePages(&ctx, req, &resp)),
                StatusIs(StatusCode::kPermissionDenied, _));
  }
  // And Close through the client stops at the worker's real error.
  EXPECT_THAT(beta_->Close(*seq_),
              StatusIs(StatusCode::kPermissionDenied, HasSubstr("FreePages")));
}

TEST_F(BadInputTest, WrongShapes) {
  // Manager: a model whose query heads are not a multiple of KV heads, and
  // an odd head_dim.
  triax::v1::ModelShape m = SmallModel();
  m.set_n_q_heads(3);
  EXPECT_THAT(alpha_->Open(m, {MakeSpan(ROLE_USER, 4)}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("n_q_heads")));
  m = SmallModel();
  m.set_head_dim(33);
  EXPECT_THAT(alpha_->Open(m, {MakeSpan(ROLE_USER, 4)}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("head_dim")));
  EXPECT_THAT(
      alpha_->Open(SmallModel(), {MakeSpan(ROLE_USER, 4)}, "no-such-policy"),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("no-such-policy")));

  // Worker: K bytes that do not match num_tokens x heads x head_dim.
  triax::v1::KvChunk chunk;
  chunk.set_layer(0);
  chunk.set_first_token(21);
  chunk.set_num_tokens(1);
  chunk.set_dtype(triax::v1::KV_DTYPE_BF16);
  chunk.set_k(Bf16Zeros(63));
  chunk.set_v(Bf16Zeros(64));
  EXPECT_THAT(WriteRaw("alpha", chunk),
              StatusIs(StatusCode::kInvalidArgument, _));
  // A layer past the model.
  chunk.set_layer(2);
  chunk.set_k(Bf16Zeros(64));
  EXPECT_THAT(WriteRaw("alpha", chunk),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("layer")));
  // Queries of the wrong size.
  triax::v1::AttendItem item = GoodItem();
  item.set_queries(std::string(100, '\0'));
  EXPECT_THAT(Attend("alpha", item),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("queries")));
  // A position past the written tokens.
  item = GoodItem();
  item.set_positions(0, 21);
  const absl::Status past = Attend("alpha", item);
  EXPECT_THAT(past.code(),
              AnyOf(StatusCode::kInvalidArgument, StatusCode::kOutOfRange,
                    StatusCode::kFailedPrecondition))
      << past;
  EXPECT_THAT(std::string(past.message()), HasSubstr("21"));
}

TEST_F(BadInputTest, ZeroSizes) {
  EXPECT_THAT(alpha_->Open(SmallModel(), {MakeSpan(ROLE_USER, 0)}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("num_tokens")));
  EXPECT_THAT(alpha_->Open(SmallModel(), {}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("spans")));
  triax::v1::ModelShape m = SmallModel();
  m.set_n_layers(0);
  EXPECT_THAT(alpha_->Open(m, {MakeSpan(ROLE_USER, 4)}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("n_layers")));
  client::SequenceHandle h = *seq_;
  EXPECT_THAT(alpha_->Extend(&h, {MakeSpan(ROLE_USER, 0)}, false, false),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("num_tokens")));
  triax::v1::AttendItem item = GoodItem();
  item.set_num_queries(0);
  item.clear_positions();
  item.clear_queries();
  EXPECT_THAT(Attend("alpha", item),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("num_queries")));
  triax::v1::KvChunk chunk;
  chunk.set_layer(0);
  chunk.set_first_token(21);
  chunk.set_num_tokens(0);
  chunk.set_dtype(triax::v1::KV_DTYPE_BF16);
  EXPECT_THAT(WriteRaw("alpha", chunk),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("num_tokens")));
}

TEST_F(BadInputTest, OverBudgetNamesTheBytes) {
  // One BF16 block of this model is 16 tokens x 2 heads x 32 dims x K,V x
  // 2 bytes x 2 layers = 8192 bytes; the tenant may hold 10000.
  ASSERT_THAT(cluster_->CreateTenant("small", 10000), IsOk());
  auto c = cluster_->NewClient("small");
  ASSERT_THAT(c, IsOk());
  auto first = (*c)->Open(SmallModel(), {MakeSpan(ROLE_USER, 16)}, "bf16", 16);
  ASSERT_THAT(first, IsOk());
  auto info = (*c)->GetSequence(first->sequence_id);
  ASSERT_THAT(info, IsOk());
  ASSERT_GT(info->bytes(), 0u);
  auto before = cluster_->GetTenant("small");
  ASSERT_THAT(before, IsOk());

  EXPECT_THAT((*c)->Open(SmallModel(), {MakeSpan(ROLE_USER, 16)}, "bf16", 16),
              StatusIs(StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("10000"),
                             HasSubstr(absl::StrCat(info->bytes())))));
  client::SequenceHandle h = *first;
  EXPECT_THAT((*c)->Extend(&h, {MakeSpan(ROLE_USER, 16)}, false, false),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("10000")));
  EXPECT_EQ(h.num_tokens, 16u);

  auto after = cluster_->GetTenant("small");
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(before->DebugString(), after->DebugString());
  EXPECT_THAT((*c)->Close(*first), IsOk());
}

TEST_F(BadInputTest, CreateTenantIsIdempotent) {
  triax::v1::CreateTenantRequest req;
  req.set_request_id("idem-1");
  req.set_tenant_id("gamma");
  triax::v1::CreateTenantResponse r1, r2, r3;
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ASSERT_TRUE(cluster_->manager()->CreateTenant(&ctx, req, &r1).ok());
  }
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ASSERT_TRUE(cluster_->manager()->CreateTenant(&ctx, req, &r2).ok());
  }
  EXPECT_EQ(r1.DebugString(), r2.DebugString());
  // The same tenant with other settings and a new request id is a conflict.
  req.set_request_id("idem-2");
  auto* b = req.add_budgets();
  b->set_tier(triax::v1::TIER_DEVICE);
  b->set_ceiling_bytes(1);
  grpc::ClientContext ctx;
  Deadline(&ctx);
  EXPECT_THAT(FromGrpcStatus(cluster_->manager()->CreateTenant(&ctx, req, &r3)),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("gamma")));
}

// The manager receives rendered prompts up to the tagger's 16 MiB
// (docs/manager.md, "Tagger"): a 10 MiB ChatML prompt opens; 16 MiB + 1
// bytes of text is INVALID_ARGUMENT from the tagger; a request above the
// server's receive limit (kMaxRequestBytes, 64 MiB) is RESOURCE_EXHAUSTED.
TEST_F(BadInputTest, RenderedPromptsUpToTheDocumentedSize) {
  ASSERT_THAT(cluster_->CreateTenant("delta"), IsOk());
  const auto open = [](size_t content_bytes, uint32_t token_bytes,
                       triax::v1::OpenSequenceResponse* resp) {
    triax::v1::OpenSequenceRequest req;
    req.set_tenant_id("delta");
    *req.mutable_model() = SmallModel();
    req.set_policy("bf16");
    req.set_block_tokens(16);
    triax::v1::RenderedText* r = req.mutable_rendered();
    std::string* text = r->mutable_text();
    text->reserve(content_bytes + 32);
    text->append("<|im_start|>user\n");
    text->append(content_bytes, 'a');
    text->append("<|im_end|>\n");
    r->set_chat_template(triax::v1::CHAT_TEMPLATE_CHATML);
    for (size_t at = 0; at < text->size(); at += token_bytes) {
      r->add_token_offsets(static_cast<uint32_t>(at));
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    return FromGrpcStatus(cluster_->manager()->OpenSequence(&ctx, req, resp));
  };
  triax::v1::OpenSequenceResponse opened;
  ASSERT_THAT(open(size_t{10} << 20, 4096, &opened), IsOk());
  EXPECT_EQ(opened.sequence().num_tokens(),
            ((size_t{10} << 20) + 28) / 4096 + 1);
  {
    triax::v1::CloseSequenceRequest close;
    close.set_tenant_id("delta");
    close.set_sequence_id(opened.sequence().sequence_id());
    triax::v1::CloseSequenceResponse closed;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ASSERT_TRUE(cluster_->manager()->CloseSequence(&ctx, close, &closed).ok());
  }
  triax::v1::OpenSequenceResponse unused;
  // 16 MiB + 1 bytes of text in all.
  EXPECT_THAT(open((size_t{16} << 20) + 1 - 28, 4096, &unused),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("rendered.text is 16777217 bytes; the limit "
                                 "is 16777216")));
  EXPECT_THAT(
      open(size_t{65} << 20, 4096, &unused),
      StatusIs(StatusCode::kResourceExhausted, HasSubstr("larger than max")));
}

// A string field's bytes on the wire: tag (wire type 2), length, bytes.
std::string WireString(int field, absl::string_view bytes) {
  std::string out;
  for (uint64_t v : {uint64_t(field) << 3 | 2, uint64_t{bytes.size()}}) {
    while (v >= 0x80) {
      out.push_back(static_cast<char>(v | 0x80));
      v >>= 7;
    }
    out.push_back(static_cast<char>(v));
  }
  absl::StrAppend(&out, bytes);
  return out;
}

// `wire` sent as the request of the unary `method` with no client-side
// serialization, as a client in another language could send it.
absl::Status RawUnary(const std::string& address, const std::string& method,
                      const std::string& wire) {
  grpc::GenericStub stub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::Slice slice(wire);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  return FromGrpcStatus(done.get_future().get());
}

// proto3 string fields must hold UTF-8: protobuf refuses the request while
// parsing it, before any handler runs. The daemons answer INVALID_ARGUMENT
// naming the field (common/parse_errors.h), not gRPC's bare UNIMPLEMENTED
// (callback services) or INTERNAL (sync services).
TEST_F(BadInputTest, InvalidUtf8InStringFieldNamesTheField) {
  triax::v1::OpenSequenceRequest open;
  *open.mutable_model() = SmallModel();
  *open.add_spans() = MakeSpan(ROLE_USER, 4);
  open.set_policy("bf16");
  // tenant_id is field 2 of OpenSequenceRequest and of AllocatePagesRequest.
  const std::string bad_tenant = WireString(2, "alpha\xff\xfe");
  EXPECT_THAT(
      RawUnary(cluster_->manager_address(), "/triax.v1.Manager/OpenSequence",
               open.SerializeAsString() + bad_tenant),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("request triax.v1.OpenSequenceRequest: string field "
                         "triax.v1.OpenSequenceRequest.tenant_id is not "
                         "valid UTF-8")));
  // A nested message's field: model (field 3) .name (field 1); the model
  // fields are merged into the model already there.
  EXPECT_THAT(
      RawUnary(cluster_->manager_address(), "/triax.v1.Manager/OpenSequence",
               open.SerializeAsString() + WireString(3, WireString(1, "\xc3"))),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("triax.v1.ModelShape.name")));

  triax::v1::AllocatePagesRequest alloc;
  alloc.set_sequence_id("s-utf8");
  *alloc.mutable_model() = SmallModel();
  EXPECT_THAT(
      RawUnary(seq_->worker_address, "/triax.v1.Worker/AllocatePages",
               alloc.SerializeAsString() + bad_tenant),
      StatusIs(StatusCode::kInvalidArgument,
               AllOf(HasSubstr("triax.v1.AllocatePagesRequest.tenant_id"),
                     HasSubstr("UTF-8"))));
}

// A client stream: the worker's WriteKV handler sees its first Read fail,
// and the status says why.
TEST_F(BadInputTest, InvalidUtf8InStreamedMessageNamesTheField) {
  auto w = alpha_->worker(seq_->worker_address);
  ASSERT_THAT(w, IsOk());
  triax::v1::WriteKVRequest req;
  // The C++ client only logs a string that is not UTF-8 and sends it.
  req.set_tenant_id("alpha\xff");
  req.set_sequence_id(seq_->sequence_id);
  triax::v1::WriteKVResponse resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  auto writer = (*w)->WriteKV(&ctx, &resp);
  writer->Write(req);
  writer->WritesDone();
  EXPECT_THAT(FromGrpcStatus(writer->Finish()),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("triax.v1.WriteKVRequest.tenant_id")));
}

// Bytes that are not a protobuf message at all (a length past the end).
TEST_F(BadInputTest, MalformedRequestBytesAreInvalidArgument) {
  // tenant_id (field 2) of 64 bytes, 5 sent.
  const std::string truncated = std::string("\x12\x40") + "alpha";
  EXPECT_THAT(RawUnary(cluster_->manager_address(),
                       "/triax.v1.Manager/OpenSequence", truncated),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("request triax.v1.OpenSequenceRequest: the "
                                 "bytes are not a valid protobuf message")));
  EXPECT_THAT(RawUnary(seq_->worker_address, "/triax.v1.Worker/AllocatePages",
                       truncated),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("triax.v1.AllocatePagesRequest")));
}

}  // namespace
}  // namespace triax::testing
