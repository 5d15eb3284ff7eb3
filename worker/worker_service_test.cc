#include "worker/worker_service.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/health_check.h"
#include "common/status_matchers.h"
#include "kernels/numeric.h"
#include "triax/v1/manager.grpc.pb.h"
#include "worker/convert.h"
#include "worker/health_reporter.h"
#include "worker/manager_link.h"
#include "worker/recording_device.h"
#include "worker/tier_store.h"

namespace triax::worker {
namespace {

using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

constexpr char kTenant[] = "tenant-a";

// Expects `s` to have `code` and a message containing `field`.
#define EXPECT_CODE(s, code, field)                         \
  do {                                                      \
    const grpc::Status _s = (s);                            \
    EXPECT_EQ(_s.error_code(), code) << _s.error_message(); \
    EXPECT_THAT(_s.error_message(), HasSubstr(field));      \
  } while (0)

v1::ModelShape Model(uint32_t layers = 2, uint32_t kv = 2, uint32_t q = 4,
                     uint32_t d = 32) {
  v1::ModelShape m;
  m.set_name("test");
  m.set_n_layers(layers);
  m.set_n_kv_heads(kv);
  m.set_n_q_heads(q);
  m.set_head_dim(d);
  return m;
}

v1::AllocatePagesRequest AllocRequest(const std::string& seq, uint32_t tokens,
                                      v1::Format format = v1::FORMAT_INT4,
                                      const std::string& request_id = "") {
  v1::AllocatePagesRequest r;
  r.set_request_id(request_id);
  r.set_tenant_id(kTenant);
  r.set_sequence_id(seq);
  *r.mutable_model() = Model();
  r.set_block_tokens(16);
  uint32_t i = 0;
  for (uint32_t first = 0; first < tokens; first += 16, ++i) {
    v1::BlockPlan* b = r.add_blocks();
    b->set_index(i);
    b->set_lineage_id(1000 + i);
    b->set_first_token(first);
    b->set_num_tokens(std::min(16u, tokens - first));
    b->set_capacity(16);
    b->set_format(format);
  }
  return r;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (float& f : x) f = dist(rng);
  return x;
}

std::string F32Bytes(const float* p, size_t n) {
  return std::string(reinterpret_cast<const char*>(p), n * 4);
}

v1::KvChunk F32Chunk(uint32_t layer, uint64_t first, uint32_t n,
                     const std::vector<float>& k, const std::vector<float>& v,
                     size_t per_token = 64) {
  v1::KvChunk c;
  c.set_layer(layer);
  c.set_first_token(first);
  c.set_num_tokens(n);
  c.set_dtype(v1::KV_DTYPE_F32);
  c.set_k(F32Bytes(k.data() + first * per_token, n * per_token));
  c.set_v(F32Bytes(v.data() + first * per_token, n * per_token));
  return c;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = PageAllocator::Create(&device_, 4 << 20);
    ASSERT_TRUE(a.ok());
    alloc_ = *std::move(a);
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get(), Options());
    core_ = std::make_unique<WorkerCore>(store_.get(), &device_);
    service_ = std::make_unique<WorkerService>(core_.get());
    // As kvworker's main does: the server then serves grpc.health.v1.Health.
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Worker::NewStub(channel_);
  }
  void TearDown() override {
    server_->Shutdown();
    server_.reset();
    service_.reset();
    core_.reset();
    store_.reset();
    alloc_.reset();
  }
  virtual StoreOptions Options() { return StoreOptions{4}; }

  grpc::Status Allocate(const v1::AllocatePagesRequest& r,
                        v1::AllocatePagesResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::AllocatePagesResponse local;
    return stub_->AllocatePages(&ctx, r, resp ? resp : &local);
  }
  std::string Inventory() {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    EXPECT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    return inv.SerializeAsString();
  }
  grpc::Status Write(const std::vector<v1::WriteKVRequest>& msgs,
                     v1::WriteKVResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::WriteKVResponse local;
    auto writer = stub_->WriteKV(&ctx, resp ? resp : &local);
    for (const auto& m : msgs) {
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
  v1::WriteKVRequest WriteMsg(const std::string& seq, v1::KvChunk chunk,
                              const std::string& request_id = "",
                              const std::string& tenant = kTenant) {
    v1::WriteKVRequest m;
    m.set_request_id(request_id);
    m.set_tenant_id(tenant);
    m.set_sequence_id(seq);
    *m.mutable_chunk() = std::move(chunk);
    return m;
  }
  grpc::Status Read(const v1::ReadKVRequest& r, std::vector<v1::KvChunk>* out) {
    grpc::ClientContext ctx;
    auto reader = stub_->ReadKV(&ctx, r);
    v1::KvChunk c;
    while (reader->Read(&c)) out->push_back(c);
    return reader->Finish();
  }
  grpc::Status Free(const std::string& seq, const std::string& request_id = "",
                    const std::string& tenant = kTenant,
                    v1::FreePagesResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::FreePagesRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    v1::FreePagesResponse local;
    return stub_->FreePages(&ctx, r, resp ? resp : &local);
  }
  grpc::Status Fork(const v1::WorkerForkRequest& r,
                    v1::WorkerForkResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::WorkerForkResponse local;
    return stub_->ForkSequence(&ctx, r, resp ? resp : &local);
  }

  // A sequence "s" of 40 int4 tokens with the first `written` written.
  void MakeWritten(uint64_t written, std::vector<float>* k,
                   std::vector<float>* v) {
    ASSERT_TRUE(Allocate(AllocRequest("s", 40)).ok());
    *k = Random(40 * 64, 1);
    *v = Random(40 * 64, 2);
    for (uint32_t l = 0; l < 2; ++l) {
      ASSERT_TRUE(Write({WriteMsg("s", F32Chunk(l, 0, written, *k, *v))}).ok());
    }
  }

  RecordingDevice device_;  // CPU compute, records batches
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<WorkerCore> core_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(ServiceTest, AllocatePagesRejectsBadInputWithoutStateChange) {
  ASSERT_TRUE(Allocate(AllocRequest("s", 20)).ok());
  const std::string before = Inventory();

  auto r = AllocRequest("t", 20);
  r.set_tenant_id("");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT, "tenant_id");
  r = AllocRequest("t", 20);
  r.set_sequence_id("bad id");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT, "sequence_id");
  r = AllocRequest("t", 20, v1::FORMAT_INT4, "bad request id");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT, "request_id");
  r = AllocRequest("t", 20);
  r.mutable_model()->set_n_layers(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "model.n_layers=0");
  r = AllocRequest("t", 20);
  r.mutable_model()->set_head_dim(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "model.head_dim=0");
  r = AllocRequest("t", 20);
  r.set_block_tokens(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "block_tokens=0");
  r = AllocRequest("t", 20);
  r.mutable_blocks(1)->set_num_tokens(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[1].num_tokens=0");
  r = AllocRequest("t", 20, v1::FORMAT_UNSPECIFIED);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0].format=0");
  r = AllocRequest("t", 20);
  r.mutable_blocks(1)->set_first_token(15);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[1].first_token=15");
  // The 4 MiB arena cannot hold 12800 bf16 tokens x 2 layers (6.25 MiB).
  r = AllocRequest("t", 12800, v1::FORMAT_BF16);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::RESOURCE_EXHAUSTED, "bytes free");
  // Existing sequence: other tenant, other lineage.
  r = AllocRequest("s", 20);
  r.set_tenant_id("tenant-b");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  r = AllocRequest("s", 20);
  r.mutable_blocks(0)->set_lineage_id(7);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::FAILED_PRECONDITION,
              "lineage_id=7");
  EXPECT_EQ(Inventory(), before);
}

TEST_F(ServiceTest, AllocatePagesIsIdempotentByRequestId) {
  v1::AllocatePagesResponse first, second, third;
  ASSERT_TRUE(
      Allocate(AllocRequest("s", 20, v1::FORMAT_INT4, "req-1"), &first).ok());
  EXPECT_EQ(first.pages_allocated(), 4u);  // 2 blocks x 2 layers
  EXPECT_GT(first.bytes_allocated(), 0u);
  const std::string after_first = Inventory();
  ASSERT_TRUE(
      Allocate(AllocRequest("s", 20, v1::FORMAT_INT4, "req-1"), &second).ok());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(Inventory(), after_first);
  // Same id, even with another plan: the first reply, nothing applied.
  ASSERT_TRUE(
      Allocate(AllocRequest("s", 40, v1::FORMAT_INT4, "req-1"), &third).ok());
  EXPECT_EQ(third.pages_allocated(), 4u);
  EXPECT_EQ(Inventory(), after_first);
}

// New encodings travel through the proto: format_v, group_size, scale_dtype;
// window_tokens per sequence; Demote with idempotency and error mapping.
TEST_F(ServiceTest, EncodingsWindowTokensAndDemote) {
  auto r = AllocRequest("s", 32, v1::FORMAT_TQ3);
  r.mutable_blocks(1)->set_format(v1::FORMAT_INT4);
  r.mutable_blocks(1)->set_format_v(v1::FORMAT_INT2);
  r.mutable_blocks(1)->set_group_size(64);
  r.mutable_blocks(1)->set_scale_dtype(v1::SCALE_DTYPE_FP8_E4M3);
  r.set_window_tokens(0);
  ASSERT_TRUE(Allocate(r).ok());
  // A different window for the installed sequence is refused.
  auto again = AllocRequest("s", 32, v1::FORMAT_TQ3);
  again.set_window_tokens(4);
  EXPECT_CODE(Allocate(again), grpc::StatusCode::FAILED_PRECONDITION,
              "window_tokens=4");
  // TQ on head_dim 48 is not valid.
  auto tq = AllocRequest("t", 16, v1::FORMAT_TQ2);
  tq.mutable_model()->set_head_dim(48);
  EXPECT_CODE(Allocate(tq), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0]: encoding tq2");

  const std::vector<float> k = Random(32 * 64, 3), v = Random(32 * 64, 4);
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(Write({WriteMsg("s", F32Chunk(l, 0, 32, k, v))}).ok());
  }
  // window_tokens 0: both blocks sealed; the inventory reports by K format.
  {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    ASSERT_TRUE(stub_->GetInventory(&ctx, {}, &inv).ok());
    EXPECT_EQ(inv.window_bytes(), 0u);
    ASSERT_EQ(inv.formats_size(), 2);
    EXPECT_EQ(inv.formats(0).format(), v1::FORMAT_INT4);
    EXPECT_EQ(inv.formats(1).format(), v1::FORMAT_TQ3);
    EXPECT_EQ(inv.formats(1).pages_used(), 2u);
  }

  auto demote = [&](const v1::DemoteRequest& req, v1::DemoteResponse* resp) {
    grpc::ClientContext ctx;
    return stub_->Demote(&ctx, req, resp);
  };
  v1::DemoteRequest d;
  d.set_request_id("dem-1");
  d.set_tenant_id(kTenant);
  d.set_sequence_id("s");
  v1::BlockPlan* b = d.add_blocks();
  b->set_index(0);
  b->set_lineage_id(1000);
  b->set_format(v1::FORMAT_TQ2);
  const std::string before = Inventory();
  v1::DemoteResponse first, second;
  ASSERT_TRUE(demote(d, &first).ok());
  EXPECT_EQ(first.pages_reencoded(), 2u);
  EXPECT_LT(first.bytes_delta(), 0);
  const std::string after = Inventory();
  EXPECT_NE(after, before);
  // Same request id, even naming another encoding: the first reply, nothing
  // applied.
  d.mutable_blocks(0)->set_format(v1::FORMAT_BF16);
  ASSERT_TRUE(demote(d, &second).ok());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(Inventory(), after);

  // Errors map to canonical codes and change nothing.
  d.set_request_id("dem-2");
  d.mutable_blocks(0)->set_lineage_id(77);
  v1::DemoteResponse unused;
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::FAILED_PRECONDITION,
              "lineage_id=77");
  d.mutable_blocks(0)->set_lineage_id(1000);
  d.mutable_blocks(0)->set_index(5);
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::NOT_FOUND,
              "blocks[0].index=5");
  d.mutable_blocks(0)->set_index(0);
  d.set_tenant_id("tenant-b");
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::PERMISSION_DENIED,
              "tenant_id");
  d.set_tenant_id(kTenant);
  d.set_sequence_id("nope");
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::NOT_FOUND,
              "sequence_id=\"nope\"");
  d.set_sequence_id("s");
  d.mutable_blocks(0)->set_group_size(7);
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0].group_size=7");
  d.set_request_id("bad id");
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::INVALID_ARGUMENT,
              "request_id");
  EXPECT_EQ(Inventory(), after);

  // Attention still runs over the demoted pages.
  v1::AttendRequest ar;
  ar.set_tenant_id(kTenant);
  v1::AttendItem* item = ar.add_items();
  item->set_sequence_id("s");
  item->set_layer(1);
  item->set_num_queries(1);
  const std::vector<float> q = Random(4 * 32, 9);
  item->set_queries(F32Bytes(q.data(), q.size()));
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  ASSERT_TRUE(stub_->Attend(&ctx, ar, &resp).ok());
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0).status().code(), 0)
      << resp.results(0).status().message();
  EXPECT_EQ(resp.results(0).output().size(), q.size() * 4);
}

TEST_F(ServiceTest, WriteKVRejectsBadInputWithoutStateChange) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  const std::string before = Inventory();
  std::vector<v1::KvChunk> read_before;
  v1::ReadKVRequest rr;
  rr.set_tenant_id(kTenant);
  rr.set_sequence_id("s");
  rr.set_dtype(v1::KV_DTYPE_F32);
  ASSERT_TRUE(Read(rr, &read_before).ok());

  EXPECT_CODE(Write({WriteMsg("nope", F32Chunk(0, 5, 2, k, v))}),
              grpc::StatusCode::NOT_FOUND, "sequence_id=\"nope\"");
  EXPECT_CODE(Write({WriteMsg("s", F32Chunk(0, 5, 2, k, v), "", "tenant-b")}),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id=\"tenant-b\"");
  EXPECT_CODE(Write({WriteMsg("s", F32Chunk(0, 7, 2, k, v))}),
              grpc::StatusCode::FAILED_PRECONDITION, "first_token=7");
  EXPECT_CODE(Write({WriteMsg("s", F32Chunk(0, 5, 36, k, v))}),
              grpc::StatusCode::OUT_OF_RANGE, "planned total of 40");
  auto c = F32Chunk(0, 5, 2, k, v);
  c.set_layer(2);
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "layer=2");
  c = F32Chunk(0, 5, 2, k, v);
  c.mutable_v()->pop_back();
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "v has 511 bytes");
  c = F32Chunk(0, 5, 2, k, v);
  c.set_num_tokens(0);
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "num_tokens=0");
  c = F32Chunk(0, 5, 2, k, v);
  c.set_dtype(v1::KV_DTYPE_UNSPECIFIED);
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "dtype=0");
  c = F32Chunk(0, 5, 2, k, v);
  c.set_dtype(v1::KV_DTYPE_BF16);  // f32-sized bytes for bf16
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "k has 512 bytes; expected 256");
  v1::WriteKVRequest empty;
  empty.set_tenant_id(kTenant);
  empty.set_sequence_id("s");
  EXPECT_CODE(Write({empty}), grpc::StatusCode::INVALID_ARGUMENT,
              "chunk is missing");

  EXPECT_EQ(Inventory(), before);
  std::vector<v1::KvChunk> read_after;
  ASSERT_TRUE(Read(rr, &read_after).ok());
  ASSERT_EQ(read_after.size(), 1u);
  EXPECT_EQ(read_after[0].SerializeAsString(),
            read_before[0].SerializeAsString());
}

TEST_F(ServiceTest, WriteKVIsIdempotentPerStream) {
  ASSERT_TRUE(Allocate(AllocRequest("s", 40)).ok());
  auto k = Random(40 * 64, 3), v = Random(40 * 64, 4);
  std::vector<v1::WriteKVRequest> msgs = {
      WriteMsg("s", F32Chunk(0, 0, 10, k, v), "w-1"),
      WriteMsg("s", F32Chunk(0, 10, 10, k, v))};
  v1::WriteKVResponse first, second;
  ASSERT_TRUE(Write(msgs, &first).ok());
  EXPECT_EQ(first.tokens_written(), 20u);
  EXPECT_EQ(first.bytes_received(), 2u * 20 * 64 * 4);
  // A retry of the same stream is not applied again (it would otherwise be
  // an out-of-order write).
  ASSERT_TRUE(Write(msgs, &second).ok());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  auto d = store_->Describe("s");
  EXPECT_EQ(d->written[0], 20u);
}

TEST_F(ServiceTest, StreamedWriteAttendReadRoundTrip) {
  // 300 bf16 tokens: ReadKV must split into chunks of <= 256 tokens.
  auto req = AllocRequest("s", 300, v1::FORMAT_BF16);
  ASSERT_TRUE(Allocate(req).ok());
  auto k = Random(300 * 64, 5), v = Random(300 * 64, 6);
  std::vector<v1::WriteKVRequest> msgs;
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t t = 0; t < 299; t += 23) {
      msgs.push_back(
          WriteMsg("s", F32Chunk(l, t, std::min(23u, 299 - t), k, v)));
    }
  }
  v1::WriteKVResponse wr;
  ASSERT_TRUE(Write(msgs, &wr).ok());
  EXPECT_EQ(wr.tokens_written(), 2u * 299);

  // Decode step for layer 1: append token 299 and attend in one RPC, plus a
  // second item on layer 0 at position 100 and a bad third item.
  const size_t per_q = 4 * 32;
  auto q = Random(2 * per_q, 7);
  v1::AttendRequest ar;
  ar.set_tenant_id(kTenant);
  v1::AttendItem* a = ar.add_items();
  a->set_sequence_id("s");
  a->set_layer(1);
  a->set_num_queries(1);
  a->set_queries(F32Bytes(q.data(), per_q));
  *a->mutable_append() = F32Chunk(1, 299, 1, k, v);
  v1::AttendItem* b = ar.add_items();
  b->set_sequence_id("s");
  b->set_layer(0);
  b->set_num_queries(2);
  b->add_positions(100);
  b->add_positions(0);
  b->set_queries(F32Bytes(q.data(), 2 * per_q));
  b->set_scale(0.5f);
  v1::AttendItem* bad = ar.add_items();
  bad->set_sequence_id("s");
  bad->set_layer(0);
  bad->set_num_queries(1);
  bad->set_queries("abc");
  v1::AttendResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, ar, &resp).ok());
  }
  ASSERT_EQ(resp.results_size(), 3);
  ASSERT_EQ(resp.results(0).status().code(), 0)
      << resp.results(0).status().message();
  ASSERT_EQ(resp.results(1).status().code(), 0)
      << resp.results(1).status().message();
  EXPECT_EQ(resp.results(2).status().code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(resp.results(2).status().message(),
              HasSubstr("items[2]: queries has 3 bytes"));
  ASSERT_EQ(resp.results(0).output().size(), per_q * 4);
  ASSERT_EQ(resp.results(1).output().size(), 2 * per_q * 4);
  // Query at position 0 attends to token 0 only: output = V[0] per KV head.
  std::vector<float> out(2 * per_q);
  std::memcpy(out.data(), resp.results(1).output().data(), out.size() * 4);
  for (uint32_t h = 0; h < 4; ++h) {
    for (uint32_t d = 0; d < 32; ++d) {
      const float want =
          kernels::Bf16ToFloat(kernels::FloatToBf16(v[(h / 2) * 32 + d]));
      EXPECT_NEAR(out[per_q + h * 32 + d], want, 1e-6);
    }
  }
  // And the layer-1 item equals the store's own answer after the append.
  std::vector<float> out0(per_q);
  std::memcpy(out0.data(), resp.results(0).output().data(), per_q * 4);
  double norm = 0;
  for (float x : out0) norm += x * x;
  EXPECT_GT(norm, 0.0);
  EXPECT_EQ(store_->Describe("s")->written[1], 300u);

  // Read back all 300 tokens of layer 1 as BF16: chunks of 256 + 44.
  v1::ReadKVRequest rr;
  rr.set_tenant_id(kTenant);
  rr.set_sequence_id("s");
  rr.set_layer(1);
  rr.set_dtype(v1::KV_DTYPE_BF16);
  std::vector<v1::KvChunk> chunks;
  ASSERT_TRUE(Read(rr, &chunks).ok());
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].num_tokens(), 256u);
  EXPECT_EQ(chunks[1].first_token(), 256u);
  EXPECT_EQ(chunks[1].num_tokens(), 44u);
  for (const auto& c : chunks) {
    ASSERT_EQ(c.k().size(), c.num_tokens() * 64 * 2u);
    for (size_t i = 0; i < c.num_tokens() * 64; ++i) {
      uint16_t kb, vb;
      std::memcpy(&kb, c.k().data() + 2 * i, 2);
      std::memcpy(&vb, c.v().data() + 2 * i, 2);
      const size_t at = c.first_token() * 64 + i;
      ASSERT_EQ(kb, kernels::FloatToBf16(k[at])) << at;
      ASSERT_EQ(vb, kernels::FloatToBf16(v[at])) << at;
    }
  }
  // F32 of a sub-range.
  rr.set_dtype(v1::KV_DTYPE_F32);
  rr.set_first_token(10);
  rr.set_num_tokens(5);
  chunks.clear();
  ASSERT_TRUE(Read(rr, &chunks).ok());
  ASSERT_EQ(chunks.size(), 1u);
  ASSERT_EQ(chunks[0].k().size(), 5 * 64 * 4u);
  float first;
  std::memcpy(&first, chunks[0].k().data(), 4);
  EXPECT_EQ(first, kernels::Bf16ToFloat(kernels::FloatToBf16(k[10 * 64])));
}

TEST_F(ServiceTest, ReadKVRejectsBadInput) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  auto base = [] {
    v1::ReadKVRequest r;
    r.set_tenant_id(kTenant);
    r.set_sequence_id("s");
    r.set_dtype(v1::KV_DTYPE_F32);
    return r;
  };
  std::vector<v1::KvChunk> out;
  auto r = base();
  r.set_dtype(v1::KV_DTYPE_UNSPECIFIED);
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::INVALID_ARGUMENT, "dtype=0");
  r = base();
  r.set_sequence_id("nope");
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::NOT_FOUND, "sequence_id");
  r = base();
  r.set_tenant_id("tenant-b");
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  r = base();
  r.set_layer(5);
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::INVALID_ARGUMENT, "layer=5");
  r = base();
  r.set_first_token(3);
  r.set_num_tokens(3);
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::OUT_OF_RANGE,
              "first_token=3 num_tokens=3");
  EXPECT_TRUE(out.empty());
}

TEST_F(ServiceTest, AttendReportsPerItemErrorsWithoutStateChange) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  const std::string before = Inventory();
  const size_t per_q = 4 * 32;
  auto q = Random(per_q, 9);
  auto item = [&](v1::AttendRequest* r) {
    v1::AttendItem* i = r->add_items();
    i->set_sequence_id("s");
    i->set_num_queries(1);
    i->set_queries(F32Bytes(q.data(), per_q));
    return i;
  };
  v1::AttendRequest r;
  r.set_tenant_id(kTenant);
  item(&r)->set_sequence_id("nope");
  item(&r)->set_layer(2);
  item(&r)->add_positions(5);
  item(&r)->set_num_queries(0);
  item(&r)->set_queries(std::string(per_q * 4 - 4, '\0'));
  *item(&r)->mutable_append() = F32Chunk(0, 6, 1, k, v);  // out of order
  auto* zero = item(&r);
  *zero->mutable_append() = F32Chunk(0, 5, 1, k, v);
  zero->mutable_append()->set_num_tokens(0);
  item(&r);  // a good one
  v1::AttendResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, r, &resp).ok());
  }
  ASSERT_EQ(resp.results_size(), 8);
  const std::vector<std::pair<grpc::StatusCode, std::string>> want = {
      {grpc::StatusCode::NOT_FOUND, "items[0]: sequence_id=\"nope\""},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[1]: layer=2"},
      {grpc::StatusCode::OUT_OF_RANGE, "items[2]: positions[0]=5"},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[3]: num_queries=0"},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[4]: queries has 508 bytes"},
      {grpc::StatusCode::FAILED_PRECONDITION, "items[5]: append.first_token=6"},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[6]: append.num_tokens=0"},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(resp.results(i).status().code(), want[i].first) << i;
    EXPECT_THAT(resp.results(i).status().message(), HasSubstr(want[i].second));
    EXPECT_TRUE(resp.results(i).output().empty());
  }
  EXPECT_EQ(resp.results(7).status().code(), 0);
  EXPECT_EQ(Inventory(), before);
  EXPECT_EQ(store_->Describe("s")->written[0], 5u);
  // Other tenant and a malformed tenant id.
  r.set_tenant_id("tenant-b");
  resp.Clear();
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, r, &resp).ok());
  }
  EXPECT_EQ(resp.results(7).status().code(),
            grpc::StatusCode::PERMISSION_DENIED);
  r.set_tenant_id("");
  {
    grpc::ClientContext ctx;
    EXPECT_CODE(stub_->Attend(&ctx, r, &resp),
                grpc::StatusCode::INVALID_ARGUMENT, "tenant_id");
  }
}

// Given three sequences (INT4, BF16, INT2) twice over with the same data,
// when one Attend request carries a decode-step batch of items (a bad one,
// the same sequence twice, appends) for the first copy and the same items go
// one request each to the second copy, then every item's status and output
// bytes agree, and the batch ran as few device batches as its appends allow.
TEST_F(ServiceTest, BatchedAttendMatchesItemByItem) {
  const v1::Format formats[3] = {v1::FORMAT_INT4, v1::FORMAT_BF16,
                                 v1::FORMAT_INT2};
  const uint32_t written[3] = {30, 20, 10};
  std::vector<std::vector<float>> k(3), v(3);
  for (int s = 0; s < 3; ++s) {
    k[s] = Random(40 * 64, 100 + s);
    v[s] = Random(40 * 64, 200 + s);
    for (const char* copy : {"a", "b"}) {
      const std::string id = absl::StrCat(copy, "-", s);
      ASSERT_TRUE(Allocate(AllocRequest(id, 40, formats[s])).ok());
      for (uint32_t l = 0; l < 2; ++l) {
        ASSERT_TRUE(
            Write({WriteMsg(id, F32Chunk(l, 0, written[s], k[s], v[s]))}).ok());
      }
    }
  }
  const size_t per_q = 4 * 32;
  const std::vector<float> q = Random(8 * 2 * per_q, 7);
  struct Item {
    std::string seq;  // suffix after "<copy>-", or a missing id
    uint32_t layer;
    std::vector<uint64_t> positions;
    int append_at;  // token appended first, -1: none
  };
  const std::vector<Item> plan = {
      {"0", 0, {3, 29}, -1}, {"1", 1, {}, 20}, {"nope", 0, {}, -1},
      {"2", 0, {}, -1},      {"0", 0, {}, -1}, {"1", 1, {}, 21},
      {"1", 5, {}, -1},      {"2", 0, {}, 10},
  };
  auto add = [&](v1::AttendRequest* r, const std::string& copy, size_t i) {
    const Item& it = plan[i];
    v1::AttendItem* item = r->add_items();
    item->set_sequence_id(it.seq == "nope" ? "nope"
                                           : absl::StrCat(copy, "-", it.seq));
    item->set_layer(it.layer);
    const uint32_t nq = it.positions.empty() ? 1 : it.positions.size();
    item->set_num_queries(nq);
    for (uint64_t p : it.positions) item->add_positions(p);
    item->set_queries(F32Bytes(q.data() + i * 2 * per_q, nq * per_q));
    if (it.append_at >= 0) {
      const int s = it.seq[0] - '0';
      *item->mutable_append() = F32Chunk(it.layer, it.append_at, 1, k[s], v[s]);
    }
  };
  v1::AttendRequest batch;
  batch.set_tenant_id(kTenant);
  for (size_t i = 0; i < plan.size(); ++i) add(&batch, "a", i);
  v1::AttendResponse batched;
  device_.ClearRecord();
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, batch, &batched).ok());
  }
  // Items 0, 1, 3, 4 (5 queries) run together; item 5 appends to "a-1",
  // which item 1 reads, so they run first; items 5 and 7 make the second.
  EXPECT_THAT(device_.attention_batches(), ::testing::ElementsAre(5, 2));
  ASSERT_EQ(batched.results_size(), static_cast<int>(plan.size()));
  for (size_t i = 0; i < plan.size(); ++i) {
    v1::AttendRequest one;
    one.set_tenant_id(kTenant);
    add(&one, "b", i);
    v1::AttendResponse alone;
    {
      grpc::ClientContext ctx;
      ASSERT_TRUE(stub_->Attend(&ctx, one, &alone).ok());
    }
    const v1::AttendResult& got = batched.results(i);
    const v1::AttendResult& want = alone.results(0);
    EXPECT_EQ(got.status().code(), want.status().code())
        << i << ": " << got.status().message();
    EXPECT_EQ(got.output(), want.output()) << "item " << i;
    if (want.status().code() != 0) {
      EXPECT_THAT(got.status().message(),
                  HasSubstr(absl::StrCat("items[", i, "]")));
    } else {
      const uint32_t nq =
          plan[i].positions.empty() ? 1 : plan[i].positions.size();
      EXPECT_EQ(got.output().size(), nq * per_q * 4) << i;
    }
  }
  EXPECT_EQ(batched.results(2).status().code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(batched.results(6).status().code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Both copies took the same appends.
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(store_->Describe(absl::StrCat("a-", s))->written,
              store_->Describe(absl::StrCat("b-", s))->written);
  }
  EXPECT_EQ(store_->Describe("a-1")->written[1], 22u);
  EXPECT_EQ(store_->Describe("a-2")->written[0], 11u);

  // Without repeats a request is exactly one device batch; the outputs
  // differ per sequence (not one result copied around).
  v1::AttendRequest step;
  step.set_tenant_id(kTenant);
  for (size_t i : {0, 1, 3}) add(&step, "a", i);
  for (v1::AttendItem& it : *step.mutable_items()) it.clear_append();
  device_.ClearRecord();
  v1::AttendResponse stepped;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, step, &stepped).ok());
  }
  EXPECT_THAT(device_.attention_batches(), ::testing::ElementsAre(4));
  for (const v1::AttendResult& r : stepped.results()) {
    EXPECT_EQ(r.status().code(), 0) << r.status().message();
  }
  EXPECT_NE(stepped.results(1).output(), stepped.results(2).output());
}

// A device that reports itself unhealthy (as a poisoned CUDA context does):
// the inventory carries its message, attention answers UNAVAILABLE for
// every item of the batch, and healing clears device_error.
TEST_F(ServiceTest, DeviceErrorReachesInventoryAndAttend) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    ASSERT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    EXPECT_EQ(inv.device_error(), "");
  }
  device_.SetUnhealthy("cuda backend unhealthy (restart the worker) since: X");
  {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    ASSERT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    EXPECT_EQ(inv.device_error(),
              "cuda backend unhealthy (restart the worker) since: X");
  }
  const std::vector<float> q = Random(4 * 32, 3);
  v1::AttendRequest r;
  r.set_tenant_id(kTenant);
  for (int i = 0; i < 2; ++i) {
    v1::AttendItem* item = r.add_items();
    item->set_sequence_id("s");
    item->set_layer(i);
    item->set_num_queries(1);
    item->set_queries(F32Bytes(q.data(), q.size()));
  }
  v1::AttendResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, r, &resp).ok());
  }
  ASSERT_EQ(resp.results_size(), 2);
  for (const v1::AttendResult& res : resp.results()) {
    EXPECT_EQ(res.status().code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(res.status().message(), HasSubstr("unhealthy"));
    EXPECT_TRUE(res.output().empty());
  }
  device_.SetUnhealthy("");
  v1::Inventory inv;
  ToProto(core_->Inventory(), &inv);
  EXPECT_EQ(inv.device_error(), "");
}

// The gRPC health service follows the device: the server ("") and
// triax.v1.Worker are SERVING while it is healthy, NOT_SERVING while it
// reports an error (as a poisoned CUDA context does), SERVING again once it
// heals; a service the worker does not serve is NOT_FOUND.
TEST_F(ServiceTest, HealthServiceFollowsTheDevice) {
  ASSERT_NE(server_->GetHealthCheckService(), nullptr);
  HealthReporter health(core_.get(), server_->GetHealthCheckService());
  const auto status = [this](const std::string& service) {
    absl::StatusOr<ServingStatus> s = CheckHealth(channel_, service);
    EXPECT_TRUE(s.ok()) << service << ": " << s.status();
    return s.value_or(ServingStatus::kUnknown);
  };
  EXPECT_THAT(health.Check(), IsOk());
  EXPECT_EQ(status(""), ServingStatus::kServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kServing);

  device_.SetUnhealthy("cuda backend unhealthy (restart the worker) since: X");
  EXPECT_THAT(health.Check(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("since: X")));
  EXPECT_EQ(status(""), ServingStatus::kNotServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kNotServing);

  device_.SetUnhealthy("");
  EXPECT_THAT(health.Check(), IsOk());
  EXPECT_EQ(status(""), ServingStatus::kServing);
  EXPECT_EQ(status("triax.v1.Worker"), ServingStatus::kServing);
  EXPECT_THAT(CheckHealth(channel_, "triax.v1.Manager"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// Started, the reporter notices a device turning unhealthy on its own
// thread (no RPC waits for the device); stopped, it leaves the last status.
TEST_F(ServiceTest, HealthReporterPollsTheDevice) {
  HealthReporter health(core_.get(), server_->GetHealthCheckService());
  health.Start(absl::Milliseconds(2));
  EXPECT_EQ(CheckHealth(channel_, "triax.v1.Worker")
                .value_or(ServingStatus::kUnknown),
            ServingStatus::kServing);
  device_.SetUnhealthy("device poisoned: test");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ServingStatus seen = ServingStatus::kServing;
  while (seen != ServingStatus::kNotServing && absl::Now() < deadline) {
    seen = CheckHealth(channel_, "").value_or(ServingStatus::kUnknown);
  }
  EXPECT_EQ(seen, ServingStatus::kNotServing);
  health.Stop();
  device_.SetUnhealthy("");
  EXPECT_EQ(CheckHealth(channel_, "").value_or(ServingStatus::kUnknown),
            ServingStatus::kNotServing);
}

TEST_F(ServiceTest, ForkAndFreeRejectBadInputAndAreIdempotent) {
  std::vector<float> k, v;
  MakeWritten(20, &k, &v);
  const std::string before = Inventory();
  auto fork = [&] {
    v1::WorkerForkRequest f;
    f.set_tenant_id(kTenant);
    f.set_parent_sequence_id("s");
    f.set_child_sequence_id("c");
    f.set_num_tokens(20);
    auto plan = AllocRequest("c", 24);
    *f.mutable_blocks() = plan.blocks();
    f.mutable_blocks(1)->set_lineage_id(77);  // the partial block is copied
    return f;
  };
  auto f = fork();
  f.set_parent_sequence_id("nope");
  EXPECT_CODE(Fork(f), grpc::StatusCode::NOT_FOUND, "parent_sequence_id");
  f = fork();
  f.set_tenant_id("tenant-b");
  EXPECT_CODE(Fork(f), grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  f = fork();
  f.set_num_tokens(0);
  EXPECT_CODE(Fork(f), grpc::StatusCode::INVALID_ARGUMENT, "num_tokens=0");
  f = fork();
  f.set_child_sequence_id("s");
  EXPECT_CODE(Fork(f), grpc::StatusCode::INVALID_ARGUMENT, "child_sequence_id");
  f = fork();
  f.mutable_blocks(0)->set_format(v1::FORMAT_UNSPECIFIED);
  EXPECT_CODE(Fork(f), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0].format=0");
  f = fork();
  f.mutable_blocks(0)->set_lineage_id(1001);  // the parent's block 1
  EXPECT_CODE(Fork(f), grpc::StatusCode::FAILED_PRECONDITION, "blocks[0]");
  EXPECT_EQ(Inventory(), before);

  f = fork();
  f.set_request_id("fork-1");
  v1::WorkerForkResponse fr1, fr2;
  ASSERT_TRUE(Fork(f, &fr1).ok());
  EXPECT_EQ(fr1.pages_shared(), 2u);
  EXPECT_EQ(fr1.pages_copied(), 2u);
  ASSERT_TRUE(Fork(f, &fr2).ok());  // replay, not ALREADY_EXISTS
  EXPECT_EQ(fr2.SerializeAsString(), fr1.SerializeAsString());
  f.set_request_id("fork-2");
  EXPECT_CODE(Fork(f), grpc::StatusCode::ALREADY_EXISTS, "child_sequence_id");

  const std::string with_child = Inventory();
  EXPECT_CODE(Free("nope"), grpc::StatusCode::NOT_FOUND, "sequence_id");
  EXPECT_CODE(Free("c", "", "tenant-b"), grpc::StatusCode::PERMISSION_DENIED,
              "tenant_id");
  EXPECT_CODE(Free("c", "bad id"), grpc::StatusCode::INVALID_ARGUMENT,
              "request_id");
  EXPECT_EQ(Inventory(), with_child);
  v1::FreePagesResponse a, b;
  ASSERT_TRUE(Free("c", "free-1", kTenant, &a).ok());
  // The copied block's target and window pages on both layers; the shared
  // block's pages live on in the parent.
  EXPECT_EQ(a.pages_freed(), 4u);
  ASSERT_TRUE(Free("c", "free-1", kTenant, &b).ok());
  EXPECT_EQ(b.SerializeAsString(), a.SerializeAsString());
  EXPECT_EQ(Inventory(), before);
  ASSERT_TRUE(Free("s").ok());
  grpc::ClientContext ctx;
  v1::Inventory inv;
  ASSERT_TRUE(stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
  EXPECT_EQ(inv.used_bytes(), 0u);
  EXPECT_EQ(inv.capacity_bytes(), 4u << 20);
  EXPECT_EQ(inv.sequence_ids_size(), 0);
}

// A manager that answers the first heartbeat NOT_FOUND and fails the first
// two registrations UNAVAILABLE.
class FakeManager final : public v1::Manager::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*,
                              const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse* resp) override {
    absl::MutexLock lock(&mu_);
    if (++register_calls_ <= 2) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "starting");
    }
    last_register_ = *req;
    resp->set_heartbeat_interval_ms(10);
    if (register_calls_ == 3) resp->add_lost_sequence_ids("lost-seq");
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu_);
    if (++heartbeat_calls_ == 1) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker");
    }
    last_inventory_ = req->inventory();
    return grpc::Status::OK;
  }
  absl::Mutex mu_;
  int register_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeat_calls_ ABSL_GUARDED_BY(mu_) = 0;
  v1::RegisterWorkerRequest last_register_ ABSL_GUARDED_BY(mu_);
  v1::Inventory last_inventory_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ServiceTest, ManagerLinkRegistersRetriesAndReregisters) {
  ASSERT_TRUE(Allocate(AllocRequest("lost-seq", 16)).ok());
  ASSERT_TRUE(Allocate(AllocRequest("kept", 16)).ok());
  FakeManager manager;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&manager);
  auto server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  ManagerLinkOptions opts;
  opts.manager_address = "127.0.0.1:" + std::to_string(port);
  opts.worker_id = "worker-test";
  opts.advertise_address = "127.0.0.1:9999";
  opts.backend = "cpu";
  opts.capacity_bytes = 4 << 20;
  opts.host_capacity_bytes = 1 << 20;
  opts.disk_capacity_bytes = 3 << 20;
  opts.retry_ms = 20;
  std::unique_ptr<ManagerLink> link = NewManagerLink(opts, core_.get());
  device_.SetUnhealthy("device poisoned: test");
  link->Start();
  EXPECT_TRUE(link->WaitForCounts(2, 2, absl::Seconds(10)));
  link->Stop();
  EXPECT_EQ(link->registrations(), 2);  // first, then after NOT_FOUND
  EXPECT_GE(link->heartbeats(), 2);
  absl::MutexLock lock(&manager.mu_);
  EXPECT_GE(manager.register_calls_, 4);  // two UNAVAILABLE retried
  EXPECT_EQ(manager.last_register_.worker_id(), "worker-test");
  EXPECT_EQ(manager.last_register_.address(), "127.0.0.1:9999");
  EXPECT_EQ(manager.last_register_.backend(), "cpu");
  EXPECT_EQ(manager.last_register_.capacity_bytes(), 4u << 20);
  EXPECT_EQ(manager.last_register_.host_capacity_bytes(), 1u << 20);
  EXPECT_EQ(manager.last_register_.disk_capacity_bytes(), 3u << 20);
  EXPECT_EQ(manager.last_inventory_.capacity_bytes(), 4u << 20);
  // Tier inventory rides along (this store has no tiers: capacity 0).
  ASSERT_EQ(manager.last_inventory_.tiers_size(), 2);
  EXPECT_EQ(manager.last_inventory_.tiers(0).tier(), v1::TIER_HOST);
  EXPECT_EQ(manager.last_inventory_.tiers(1).tier(), v1::TIER_DISK);
  EXPECT_EQ(manager.last_inventory_.tiers(0).capacity_bytes(), 0u);
  // The device's health rides in every heartbeat.
  EXPECT_EQ(manager.last_inventory_.device_error(), "device poisoned: test");
  // The sequence the manager declared lost was dropped; the other is kept.
  ASSERT_EQ(manager.last_inventory_.sequence_ids_size(), 1);
  EXPECT_EQ(manager.last_inventory_.sequence_ids(0), "kept");
  server->Shutdown();
}

// The same service over a store with spill tiers (host 256 KiB, disk under a
// temp directory), restore on attend off and the prefetch queue served by
// the test.
class TierServiceTest : public ServiceTest {
 protected:
  StoreOptions Options() override {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl =
        std::string(base != nullptr && *base ? base : "/tmp") + "/svc.XXXXXX";
    char* made = ::mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    dir_ = made != nullptr ? made : "";
    TierStoreOptions to;
    to.host_capacity_bytes = 256 << 10;
    to.disk_dir = dir_;
    to.disk_capacity_bytes = 1 << 20;
    to.owner = "svc";
    auto t = TierStore::Create(&device_, to);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) tiers_ = *std::move(t);
    StoreOptions o;
    o.window_tokens = 4;
    o.tiers = tiers_.get();
    o.restore_on_attend = false;
    o.retry_after_ms = 35;
    o.prefetch_thread = false;
    return o;
  }
  void TearDown() override {
    ServiceTest::TearDown();
    tiers_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  grpc::Status Spill(const std::string& seq, std::vector<uint64_t> ids,
                     v1::Tier tier, const std::string& request_id = "",
                     const std::string& tenant = kTenant,
                     v1::SpillResponse* resp = nullptr) {
    v1::SpillRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    for (uint64_t id : ids) r.add_lineage_ids(id);
    r.set_tier(tier);
    grpc::ClientContext ctx;
    v1::SpillResponse local;
    return stub_->Spill(&ctx, r, resp ? resp : &local);
  }
  grpc::Status Restore(const std::string& seq, std::vector<uint64_t> ids,
                       bool background, const std::string& request_id = "",
                       const std::string& tenant = kTenant,
                       v1::RestoreResponse* resp = nullptr) {
    v1::RestoreRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    for (uint64_t id : ids) r.add_lineage_ids(id);
    r.set_background(background);
    grpc::ClientContext ctx;
    v1::RestoreResponse local;
    return stub_->Restore(&ctx, r, resp ? resp : &local);
  }
  grpc::Status Evict(const std::string& seq, std::vector<uint64_t> ids,
                     const std::string& request_id = "",
                     const std::string& tenant = kTenant,
                     v1::EvictResponse* resp = nullptr) {
    v1::EvictRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    for (uint64_t id : ids) r.add_lineage_ids(id);
    grpc::ClientContext ctx;
    v1::EvictResponse local;
    return stub_->Evict(&ctx, r, resp ? resp : &local);
  }
  v1::AttendResponse AttendAt(uint64_t position) {
    v1::AttendRequest req;
    req.set_tenant_id(kTenant);
    v1::AttendItem* item = req.add_items();
    item->set_sequence_id("s");
    item->set_layer(1);
    item->set_num_queries(1);
    item->add_positions(position);
    const std::vector<float> q = Random(4 * 32, 9);
    item->set_queries(F32Bytes(q.data(), q.size()));
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    EXPECT_TRUE(stub_->Attend(&ctx, req, &resp).ok());
    return resp;
  }
  v1::Inventory Inv() {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    EXPECT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    return inv;
  }

  std::string dir_;
  std::unique_ptr<TierStore> tiers_;
};

TEST_F(TierServiceTest, SpillRestoreEvictRoundTripAndIdempotency) {
  std::vector<float> k, v;
  MakeWritten(40, &k, &v);  // blocks 1000 (0-15), 1001 (16-31), 1002; window 4
  const v1::AttendResponse before = AttendAt(30);
  ASSERT_EQ(before.results(0).status().code(), 0);

  v1::SpillResponse a, b;
  ASSERT_TRUE(
      Spill("s", {1000, 1001}, v1::TIER_DISK, "sp-1", kTenant, &a).ok());
  EXPECT_EQ(a.pages_moved(), 4u);
  EXPECT_GT(a.bytes_moved(), 0u);
  EXPECT_EQ(a.device_bytes_freed(), a.bytes_moved());
  // The same request id answers the first reply and does nothing more.
  ASSERT_TRUE(
      Spill("s", {1000, 1001}, v1::TIER_DISK, "sp-1", kTenant, &b).ok());
  EXPECT_EQ(b.SerializeAsString(), a.SerializeAsString());
  v1::Inventory inv = Inv();
  EXPECT_EQ(inv.spills(), 2u);
  ASSERT_EQ(inv.tiers_size(), 2);
  EXPECT_EQ(inv.tiers(1).tier(), v1::TIER_DISK);
  EXPECT_EQ(inv.tiers(1).capacity_bytes(), 1u << 20);
  EXPECT_EQ(inv.tiers(1).used_bytes(), a.bytes_moved());
  EXPECT_EQ(inv.tiers(1).blocks(), 2u);
  EXPECT_EQ(inv.tiers(0).capacity_bytes(), 256u << 10);

  // Restore on attend is off: UNAVAILABLE with retry_after_ms, then served
  // once the background restore ran.
  const v1::AttendResponse refused = AttendAt(30);
  EXPECT_EQ(refused.results(0).status().code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.results(0).status().message(),
              HasSubstr("lineage_id=1001"));
  EXPECT_EQ(refused.results(0).retry_after_ms(), 35u);
  EXPECT_EQ(store_->ServePrefetchQueue(), 1u);
  const v1::AttendResponse served = AttendAt(30);
  ASSERT_EQ(served.results(0).status().code(), 0);
  EXPECT_EQ(served.results(0).retry_after_ms(), 0u);
  EXPECT_EQ(served.results(0).output(), before.results(0).output());

  // Restore: explicit, idempotent; background answers blocks_queued.
  ASSERT_TRUE(Spill("s", {1000}, v1::TIER_HOST, "sp-2").ok());
  v1::RestoreResponse r1, r2;
  ASSERT_TRUE(Restore("s", {}, false, "rs-1", kTenant, &r1).ok());
  EXPECT_EQ(r1.pages_restored(), 2u);
  ASSERT_TRUE(Restore("s", {}, false, "rs-1", kTenant, &r2).ok());
  EXPECT_EQ(r2.SerializeAsString(), r1.SerializeAsString());
  ASSERT_TRUE(Spill("s", {1000}, v1::TIER_HOST, "sp-3").ok());
  v1::RestoreResponse q;
  ASSERT_TRUE(Restore("s", {1000}, true, "rs-2", kTenant, &q).ok());
  EXPECT_EQ(q.blocks_queued(), 1u);
  EXPECT_EQ(q.pages_restored(), 0u);
  store_->ServePrefetchQueue();
  EXPECT_EQ(Inv().restores(), 4u);

  // Evict: idempotent; the block's tokens are skipped from then on.
  v1::EvictResponse e1, e2;
  ASSERT_TRUE(Evict("s", {1001}, "ev-1", kTenant, &e1).ok());
  EXPECT_EQ(e1.pages_freed(), 2u);
  ASSERT_TRUE(Evict("s", {1001}, "ev-1", kTenant, &e2).ok());
  EXPECT_EQ(e2.SerializeAsString(), e1.SerializeAsString());
  EXPECT_EQ(Inv().evictions(), 1u);
  const v1::AttendResponse skipped = AttendAt(30);
  ASSERT_EQ(skipped.results(0).status().code(), 0);
  EXPECT_NE(skipped.results(0).output(), before.results(0).output());
  std::vector<v1::KvChunk> chunks;
  v1::ReadKVRequest read;
  read.set_tenant_id(kTenant);
  read.set_sequence_id("s");
  read.set_layer(0);
  read.set_first_token(16);
  read.set_num_tokens(4);
  read.set_dtype(v1::KV_DTYPE_F32);
  EXPECT_CODE(Read(read, &chunks), grpc::StatusCode::FAILED_PRECONDITION,
              "lineage_id=1001");
}

TEST_F(TierServiceTest, BadInputsAreRefusedWithoutStateChange) {
  std::vector<float> k, v;
  MakeWritten(40, &k, &v);
  const std::string before = Inventory();
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_DEVICE),
              grpc::StatusCode::INVALID_ARGUMENT, "tier=1");
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_UNSPECIFIED),
              grpc::StatusCode::INVALID_ARGUMENT, "tier=0");
  EXPECT_CODE(Spill("s", {}, v1::TIER_HOST), grpc::StatusCode::INVALID_ARGUMENT,
              "lineage_ids");
  EXPECT_CODE(Evict("s", {}), grpc::StatusCode::INVALID_ARGUMENT,
              "lineage_ids");
  EXPECT_CODE(Spill("s", {1000, 4242}, v1::TIER_HOST),
              grpc::StatusCode::NOT_FOUND, "4242");
  EXPECT_CODE(Restore("s", {4242}, false), grpc::StatusCode::NOT_FOUND, "4242");
  EXPECT_CODE(Evict("s", {4242}), grpc::StatusCode::NOT_FOUND, "4242");
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_HOST, "", "tenant-b"),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  EXPECT_CODE(Restore("s", {}, false, "", "tenant-b"),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  EXPECT_CODE(Evict("s", {1000}, "", "tenant-b"),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  EXPECT_CODE(Spill("nope", {1000}, v1::TIER_HOST), grpc::StatusCode::NOT_FOUND,
              "sequence_id");
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_HOST, "bad id"),
              grpc::StatusCode::INVALID_ARGUMENT, "request_id");
  // Block 1002 is still in the window.
  EXPECT_CODE(Spill("s", {1002}, v1::TIER_HOST),
              grpc::StatusCode::FAILED_PRECONDITION, "not sealed");
  EXPECT_CODE(Evict("s", {1002}), grpc::StatusCode::FAILED_PRECONDITION,
              "not sealed");
  EXPECT_EQ(Inventory(), before);
  // A failed request is not remembered: the same id runs once fixed.
  EXPECT_CODE(Spill("s", {1002}, v1::TIER_HOST, "sp-x"),
              grpc::StatusCode::FAILED_PRECONDITION, "not sealed");
  EXPECT_TRUE(Spill("s", {1000}, v1::TIER_HOST, "sp-x").ok());
}

}  // namespace
}  // namespace triax::worker
