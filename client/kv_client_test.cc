// Client behaviour that needs no server: option checks, local argument
// checks, error prefixes, and UNAVAILABLE from an unreachable manager; and,
// against in-process fake servers, the memory-pressure calls (ReportAccess,
// GetPressure), Attend's waiting on spilled blocks (retry_after_ms), and
// Extend taking the manager's plan back when the worker refuses it.
#include "client/kv_client.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/attend_stream.h"
#include "common/status_matchers.h"

namespace triax::client {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using triax::testing::IsOk;
using triax::testing::StatusIs;

ClientOptions Unreachable() {
  ClientOptions o;
  o.manager_address = "127.0.0.1:1";  // nothing listens on port 1
  o.tenant_id = "acme";
  o.rpc_timeout_ms = 2000;
  return o;
}

SequenceHandle Handle() {
  SequenceHandle h;
  h.sequence_id = "s1";
  h.worker_address = "127.0.0.1:1";
  h.model.set_n_layers(1);
  h.model.set_n_kv_heads(2);
  h.model.set_n_q_heads(4);
  h.model.set_head_dim(8);
  h.block_tokens = 16;
  return h;
}

TEST(Connect, ValidatesOptions) {
  ClientOptions o = Unreachable();
  o.manager_address = "";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("manager_address")));
  o = Unreachable();
  o.tenant_id = "bad tenant";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("tenant_id")));
  o = Unreachable();
  o.rpc_timeout_ms = 0;
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("rpc_timeout_ms=0")));
  EXPECT_THAT(Client::Connect(Unreachable()), IsOk());
}

TEST(Client, RequestIdsAreUniqueAndValid) {
  auto a = Client::Connect(Unreachable());
  auto b = Client::Connect(Unreachable());
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  std::set<std::string> ids;
  for (int i = 0; i < 100; ++i) {
    ids.insert((*a)->NewRequestId());
    ids.insert((*b)->NewRequestId());
  }
  EXPECT_EQ(ids.size(), 200u);
  for (const auto& id : ids) {
    EXPECT_LE(id.size(), 128u);
    EXPECT_EQ(id.find_first_not_of("abcdefABCDEF0123456789c-"),
              std::string::npos)
        << id;
  }
}

TEST(Client, UnreachableManagerIsUnavailableAndNamesTheCall) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  triax::v1::Span span;
  span.set_role(triax::v1::ROLE_USER);
  span.set_num_tokens(4);
  EXPECT_THAT(
      (*c)->Open(Handle().model, {span}),
      StatusIs(absl::StatusCode::kUnavailable, StartsWith("OpenSequence: ")));
  EXPECT_THAT((*c)->GetSequence("s1"), StatusIs(absl::StatusCode::kUnavailable,
                                                StartsWith("GetSequence: ")));
  // Close tells the manager even though the worker is unreachable.
  EXPECT_THAT((*c)->Close(Handle()), StatusIs(absl::StatusCode::kUnavailable,
                                              StartsWith("CloseSequence: ")));
}

TEST(Client, LocalArgumentChecks) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  const SequenceHandle h = Handle();
  std::vector<float> buf(1024);
  EXPECT_THAT(
      (*c)->WriteKV(h, 0, 0, 0, buf.data(), buf.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_tokens=0")));
  EXPECT_THAT(
      (*c)->WriteKV(h, 0, 0, 1, nullptr, buf.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-null")));
  SequenceHandle no_shape = h;
  no_shape.model.set_head_dim(0);
  EXPECT_THAT(
      (*c)->WriteKV(no_shape, 0, 0, 1, buf.data(), buf.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim=0")));
  Client::AttendArgs a;
  a.q = buf.data();
  a.out = buf.data();
  a.num_queries = 0;
  EXPECT_THAT((*c)->Attend(h, a), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("num_queries=0")));
  a.num_queries = 1;
  a.append_k = buf.data();
  EXPECT_THAT((*c)->Attend(h, a), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("append")));
  SequenceHandle no_worker = h;
  no_worker.worker_address = "";
  std::vector<float> k, v;
  EXPECT_THAT(
      (*c)->ReadKV(no_worker, 0, 0, 1, &k, &v),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("worker")));
  EXPECT_THAT((*c)->Extend(nullptr, {}, false, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("seq")));
}

TEST(Client, WorkerStubsAreCached) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  auto a = (*c)->worker("127.0.0.1:5");
  auto b = (*c)->worker("127.0.0.1:5");
  auto d = (*c)->worker("127.0.0.1:6");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *d);
}

}  // namespace
}  // namespace triax::client

namespace triax::client {
namespace {

// Batched Attends: items checked before anything is sent, each error
// naming the item; responses checked against the items.
TEST(Client, AttendBatchAndStreamCheckItemsLocally) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  SequenceHandle h = Handle();
  SequenceHandle elsewhere = Handle();
  elsewhere.worker_address = "127.0.0.1:2";
  std::vector<float> q(size_t{4} * 8, 1.f), out(size_t{4} * 8),
      kv(size_t{2} * 8, 1.f);
  std::vector<Client::BatchItem> items;
  EXPECT_THAT((*c)->AttendBatch(items),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("AttendBatch: no items")));
  items.resize(2);
  for (Client::BatchItem& it : items) {
    it.seq = &h;
    it.args.q = q.data();
    it.args.out = out.data();
  }
  items[1].seq = &elsewhere;
  EXPECT_THAT((*c)->AttendBatch(items),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("AttendBatch: items[1]: sequence s1 is on "
                                 "worker 127.0.0.1:2, items[0]'s on "
                                 "127.0.0.1:1")));
  items[1].seq = nullptr;
  EXPECT_THAT((*c)->AttendBatch(items),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("items[1]: seq is null")));
  items.resize(1);
  items[0].args.num_queries = 0;
  EXPECT_THAT((*c)->AttendBatch(items),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("items[0]: num_queries=0")));
  items[0].args.num_queries = 1;
  items[0].args.out = nullptr;
  EXPECT_THAT((*c)->AttendBatch(items),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("items[0]: q and out must be non-null")));
  items[0].args.out = out.data();
  items[0].args.append_k = kv.data();
  EXPECT_THAT((*c)->AttendBatch(items),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("items[0]: an append needs append_k, "
                                 "append_v and append_tokens >= 1")));
  items[0].args.append_k = nullptr;

  AttendStreamOptions bad;
  bad.timeout_ms = -1;
  EXPECT_THAT(
      AttendStream::Open(static_cast<triax::v1::Worker::Stub*>(nullptr), "acme",
                         {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stub is null")));
  EXPECT_THAT(
      AttendStream::Open(c->get(), h.worker_address, {&h}, bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout_ms=-1")));
  EXPECT_THAT(AttendStream::Open(c->get(), "", {&h}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  // Nothing listens on the handle's worker: the first Attend says so, and
  // the stream stays ended.
  auto stream = AttendStream::Open(c->get(), h.worker_address, {&h});
  ASSERT_THAT(stream, IsOk());
  EXPECT_THAT((*stream)->Attend(items), StatusIs(absl::StatusCode::kUnavailable,
                                                 StartsWith("AttendStream: ")));
  EXPECT_THAT((*stream)->Finish(),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  // Items on another worker than the stream's.
  auto other = AttendStream::Open(c->get(), "127.0.0.1:2", {&h});
  ASSERT_THAT(other, IsOk());
  EXPECT_THAT((*other)->Attend(items),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the stream goes to 127.0.0.1:2")));

  // Responses: the item count, the output size, an item's error with its
  // retry delay.
  triax::v1::AttendResponse resp;
  EXPECT_THAT(TakeAttendResponse("X", items, AttendWire::kF32, resp),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("X: worker returned 0 results for 1 items")));
  resp.add_results()->set_output(std::string(12, '\0'));
  EXPECT_THAT(TakeAttendResponse("X", items, AttendWire::kBF16, resp),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("items[0]: output has 12 bytes; want 64")));
  triax::v1::AttendResult* r = resp.mutable_results(0);
  r->mutable_status()->set_code(14);
  r->mutable_status()->set_message("items[0]: blocks spilled");
  r->set_retry_after_ms(20);
  auto taken = TakeAttendResponse("X", items, AttendWire::kF32, resp);
  ASSERT_THAT(taken, IsOk());
  EXPECT_THAT((*taken)[0],
              StatusIs(absl::StatusCode::kUnavailable,
                       ::testing::Eq(
                           "X: items[0]: blocks spilled (retry after 20 ms)")));
}

TEST(EncodingLabel, NamesUniformAndMixedEncodings) {
  EXPECT_EQ(EncodingLabel(kernels::Encoding(kernels::Format::kINT4)), "int4");
  EXPECT_EQ(EncodingLabel(kernels::Encoding(kernels::Format::kINT4,
                                            kernels::Format::kINT2, 64,
                                            kernels::ScaleDtype::kFP8)),
            "k=int4,v=int2,g=64,scale=fp8");
}

}  // namespace
}  // namespace triax::client

namespace triax::client {
namespace {

// A manager that answers ReportAccess and GetPressure (everything else is
// UNIMPLEMENTED) and records the last requests.
class FakeManager final : public triax::v1::Manager::Service {
 public:
  grpc::Status ReportAccess(grpc::ServerContext*,
                            const triax::v1::ReportAccessRequest* req,
                            triax::v1::ReportAccessResponse* resp) override {
    absl::MutexLock lock(&mu_);
    last_report_ = *req;
    ++reports_;
    if (req->sequence_id() == "gone") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "sequence \"gone\" is not open");
    }
    resp->set_blocks_prefetching(req->active() ? 3 : 0);
    return grpc::Status::OK;
  }
  grpc::Status GetPressure(grpc::ServerContext*,
                           const triax::v1::GetPressureRequest* req,
                           triax::v1::GetPressureResponse* resp) override {
    absl::MutexLock lock(&mu_);
    last_top_ = req->top();
    resp->set_mode("graph-evict");
    resp->set_evictions(7);
    for (uint32_t i = 0; i < std::min<uint32_t>(req->top(), 2); ++i) {
      triax::v1::RankedAction* a = resp->add_ranked();
      a->set_lineage_id(100 + i);
      a->set_action(triax::v1::PRESSURE_ACTION_EVICT);
    }
    return grpc::Status::OK;
  }

  // ExtendSequence plans the spans after `tokens_` planned tokens;
  // TruncateSequence records its target (or fails, see SetTruncateFails).
  grpc::Status ExtendSequence(
      grpc::ServerContext*, const triax::v1::ExtendSequenceRequest* req,
      triax::v1::ExtendSequenceResponse* resp) override {
    absl::MutexLock lock(&mu_);
    for (const auto& span : req->spans()) tokens_ += span.num_tokens();
    resp->mutable_sequence()->set_sequence_id(req->sequence_id());
    resp->mutable_sequence()->set_worker_address(worker_address_);
    resp->mutable_sequence()->set_num_tokens(tokens_);
    return grpc::Status::OK;
  }
  grpc::Status TruncateSequence(
      grpc::ServerContext*, const triax::v1::TruncateSequenceRequest* req,
      triax::v1::TruncateSequenceResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++truncates_;
    if (truncate_fails_) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "sequence_id \"s1\" is closed");
    }
    tokens_ = req->num_tokens();
    resp->mutable_sequence()->set_num_tokens(tokens_);
    return grpc::Status::OK;
  }
  void SetTokens(uint64_t tokens, bool truncate_fails,
                 const std::string& worker_address) {
    absl::MutexLock lock(&mu_);
    worker_address_ = worker_address;
    tokens_ = tokens;
    truncate_fails_ = truncate_fails;
  }
  uint64_t tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  int truncates() {
    absl::MutexLock lock(&mu_);
    return truncates_;
  }

  triax::v1::ReportAccessRequest last_report() {
    absl::MutexLock lock(&mu_);
    return last_report_;
  }
  int reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  uint32_t last_top() {
    absl::MutexLock lock(&mu_);
    return last_top_;
  }

 private:
  absl::Mutex mu_;
  triax::v1::ReportAccessRequest last_report_ ABSL_GUARDED_BY(mu_);
  int reports_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t last_top_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tokens_ ABSL_GUARDED_BY(mu_) = 0;
  std::string worker_address_ ABSL_GUARDED_BY(mu_);
  bool truncate_fails_ ABSL_GUARDED_BY(mu_) = false;
  int truncates_ ABSL_GUARDED_BY(mu_) = 0;
};

// A worker whose Attend answers UNAVAILABLE with retry_after_ms for the
// first `spilled_answers` calls (as a worker restoring spilled blocks with
// restore-on-attend off), then the queries back as the output.
class FakeWorker final : public triax::v1::Worker::Service {
 public:
  grpc::Status Attend(grpc::ServerContext*, const triax::v1::AttendRequest* req,
                      triax::v1::AttendResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++calls_;
    for (const auto& item : req->items()) {
      if (item.has_append() && item.append().num_tokens() == 1) ++appends_;
      triax::v1::AttendResult* r = resp->add_results();
      if (spilled_answers_ > 0) {
        --spilled_answers_;
        r->mutable_status()->set_code(
            static_cast<int>(absl::StatusCode::kUnavailable));
        r->mutable_status()->set_message("items[0]: 2 blocks are spilled");
        r->set_retry_after_ms(retry_after_ms_);
        continue;
      }
      r->mutable_status()->set_code(0);
      r->set_output(item.queries());
    }
    return grpc::Status::OK;
  }

  // Every AllocatePages is refused, as by a worker whose arena is full.
  grpc::Status AllocatePages(grpc::ServerContext*,
                             const triax::v1::AllocatePagesRequest* req,
                             triax::v1::AllocatePagesResponse*) override {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "AllocatePages sequence_id=\"" + req->sequence_id() +
                            "\" needs 2 new pages; the arena is full");
  }

  void Set(int spilled_answers, uint32_t retry_after_ms) {
    absl::MutexLock lock(&mu_);
    spilled_answers_ = spilled_answers;
    retry_after_ms_ = retry_after_ms;
    calls_ = 0;
    appends_ = 0;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  int appends() {
    absl::MutexLock lock(&mu_);
    return appends_;
  }

 private:
  absl::Mutex mu_;
  int spilled_answers_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t retry_after_ms_ ABSL_GUARDED_BY(mu_) = 0;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int appends_ ABSL_GUARDED_BY(mu_) = 0;
};

// Both fakes on one in-process server at 127.0.0.1:<free port>.
class FakeServers : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&manager_);
    b.RegisterService(&worker_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  std::unique_ptr<Client> Connect(int attend_retries = 50,
                                  int64_t rpc_timeout_ms = 5000,
                                  bool manager_stream = false) {
    ClientOptions o;
    o.manager_address = address_;
    o.manager_stream = manager_stream;
    o.tenant_id = "acme";
    o.rpc_timeout_ms = rpc_timeout_ms;
    o.attend_retries = attend_retries;
    auto c = Client::Connect(o);
    EXPECT_THAT(c, IsOk());
    return c.ok() ? std::move(*c) : nullptr;
  }
  SequenceHandle OnFake() {
    SequenceHandle h = Handle();
    h.worker_address = address_;
    return h;
  }

  FakeManager manager_;
  FakeWorker worker_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST(Connect, RejectsNegativeAttendRetries) {
  ClientOptions o = Unreachable();
  o.attend_retries = -1;
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("attend_retries=-1")));
}

TEST_F(FakeServers, ReportAccessSendsEverything) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  auto n = c->ReportAccess(OnFake(), {4, 5, 9}, {0.5f, 0.25f, 0.25f},
                           /*active=*/true);
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(*n, 3u);
  const triax::v1::ReportAccessRequest req = manager_.last_report();
  EXPECT_EQ(req.tenant_id(), "acme");
  EXPECT_EQ(req.sequence_id(), "s1");
  EXPECT_THAT(req.lineage_ids(), ::testing::ElementsAre(4, 5, 9));
  EXPECT_THAT(req.weights(), ::testing::ElementsAre(0.5f, 0.25f, 0.25f));
  EXPECT_TRUE(req.active());

  // Active with no ids: a prefetch only. Inactive with equal shares.
  EXPECT_THAT(c->ReportAccess(OnFake(), {}, {}, true), IsOk());
  n = c->ReportAccess(OnFake(), {7}, {}, false);
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(*n, 0u);
  EXPECT_FALSE(manager_.last_report().active());
  EXPECT_EQ(manager_.last_report().weights_size(), 0);

  // The manager's error, named.
  SequenceHandle gone = OnFake();
  gone.sequence_id = "gone";
  EXPECT_THAT(c->ReportAccess(gone, {1}, {}, false),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(StartsWith("ReportAccess: "), HasSubstr("gone"))));
}

// A client set to use SequenceCalls against a manager without it (the fake
// implements no SequenceCalls: UNIMPLEMENTED) falls back to the unary RPCs,
// answers and errors alike, and stays on them.
TEST_F(FakeServers, ManagerStreamFallsBackToUnaryOnAnOlderManager) {
  auto c = Connect(/*attend_retries=*/50, /*rpc_timeout_ms=*/5000,
                   /*manager_stream=*/true);
  ASSERT_NE(c, nullptr);
  auto n = c->ReportAccess(OnFake(), {4, 5}, {}, /*active=*/true);
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(*n, 3u);  // the fake's unary answer
  EXPECT_EQ(manager_.reports(), 1);
  EXPECT_THAT(manager_.last_report().lineage_ids(),
              ::testing::ElementsAre(4, 5));
  // The manager's own errors come through the fallback unchanged.
  SequenceHandle gone = OnFake();
  gone.sequence_id = "gone";
  EXPECT_THAT(c->ReportAccess(gone, {1}, {}, false),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(StartsWith("ReportAccess: "), HasSubstr("gone"))));
  EXPECT_EQ(manager_.reports(), 2);
  // An RPC the fake does not implement either is UNIMPLEMENTED, named.
  EXPECT_THAT(c->GetSequence("s1"), StatusIs(absl::StatusCode::kUnimplemented,
                                             HasSubstr("GetSequence")));
  n = c->ReportAccess(OnFake(), {7}, {}, false);
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(manager_.reports(), 3);
}

TEST_F(FakeServers, ReportAccessBadInputNeverReachesTheManager) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  SequenceHandle no_id = OnFake();
  no_id.sequence_id = "";
  EXPECT_THAT(c->ReportAccess(no_id, {1}, {}, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sequence_id is empty")));
  EXPECT_THAT(
      c->ReportAccess(OnFake(), {}, {}, false),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("active=false")));
  EXPECT_THAT(c->ReportAccess(OnFake(), {3, 0}, {}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lineage_ids[1]=0")));
  EXPECT_THAT(c->ReportAccess(OnFake(), {1, 2}, {1.0f}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("weights has 1 entries")));
  EXPECT_THAT(c->ReportAccess(OnFake(), {1, 2}, {0.5f, 1.5f}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("weights[1]=1.5")));
  EXPECT_THAT(
      c->ReportAccess(OnFake(), {1}, {std::numeric_limits<float>::quiet_NaN()},
                      false),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weights[0]")));
  std::vector<uint64_t> many(4097);
  for (size_t i = 0; i < many.size(); ++i) many[i] = i + 1;
  EXPECT_THAT(c->ReportAccess(OnFake(), many, {}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("4097 entries; at most 4096")));
  many.pop_back();
  EXPECT_THAT(c->ReportAccess(OnFake(), many, {}, false), IsOk());
  EXPECT_EQ(manager_.reports(), 1);
}

TEST_F(FakeServers, GetPressure) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  auto p = c->GetPressure(5);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(manager_.last_top(), 5u);
  EXPECT_EQ(p->mode(), "graph-evict");
  EXPECT_EQ(p->evictions(), 7u);
  ASSERT_EQ(p->ranked_size(), 2);
  EXPECT_EQ(p->ranked(1).lineage_id(), 101u);
  EXPECT_THAT(
      c->GetPressure(10001),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top=10001")));
  EXPECT_THAT(c->GetPressure(10000), IsOk());
}

TEST(Client, PressureCallsNameTheCallWhenUnreachable) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  EXPECT_THAT((*c)->GetPressure(0), StatusIs(absl::StatusCode::kUnavailable,
                                             StartsWith("GetPressure: ")));
  EXPECT_THAT(
      (*c)->ReportAccess(Handle(), {1}, {}, true),
      StatusIs(absl::StatusCode::kUnavailable, StartsWith("ReportAccess: ")));
  EXPECT_THAT((*c)->RefreshPlan(nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
}

// One query of Handle()'s shape (4 q heads x 8 dims).
struct OneQuery {
  std::vector<float> q = std::vector<float>(32), out = std::vector<float>(32);
  uint64_t pos = 0;
  OneQuery() {
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0.5f * i;
  }
  Client::AttendArgs Args() {
    Client::AttendArgs a;
    a.num_queries = 1;
    a.positions = &pos;
    a.q = q.data();
    a.out = out.data();
    return a;
  }
};

TEST_F(FakeServers, AttendWaitsForSpilledBlocks) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  worker_.Set(/*spilled_answers=*/3, /*retry_after_ms=*/5);
  OneQuery one;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_THAT(c->Attend(OnFake(), one.Args()), IsOk());
  EXPECT_GE(std::chrono::steady_clock::now() - t0,
            std::chrono::milliseconds(15));
  EXPECT_EQ(worker_.calls(), 4);
  EXPECT_EQ(one.out, one.q);  // the fake echoes the queries
}

TEST_F(FakeServers, AttendRetriesAreBounded) {
  auto c = Connect(/*attend_retries=*/2);
  ASSERT_NE(c, nullptr);
  worker_.Set(/*spilled_answers=*/100, /*retry_after_ms=*/1);
  OneQuery one;
  EXPECT_THAT(c->Attend(OnFake(), one.Args()),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(StartsWith("Attend: "), HasSubstr("spilled"),
                             HasSubstr("gave up after 2 retries"))));
  EXPECT_EQ(worker_.calls(), 3);

  // The deadline bounds the waiting too: a 1 s delay does not fit in 300 ms.
  auto quick = Connect(/*attend_retries=*/50, /*rpc_timeout_ms=*/300);
  ASSERT_NE(quick, nullptr);
  worker_.Set(/*spilled_answers=*/100, /*retry_after_ms=*/1000);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THAT(quick->Attend(OnFake(), one.Args()),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("retry after 1000 ms")));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_EQ(worker_.calls(), 1);

  // attend_retries = 0: never.
  auto never = Connect(/*attend_retries=*/0);
  ASSERT_NE(never, nullptr);
  worker_.Set(/*spilled_answers=*/1, /*retry_after_ms=*/1);
  EXPECT_THAT(never->Attend(OnFake(), one.Args()),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("gave up after 0 retries")));
  EXPECT_EQ(worker_.calls(), 1);
}

TEST_F(FakeServers, AttendWithAppendWaitsForSpilledBlocksToo) {
  // The worker refuses before it writes, so the append is resent as is.
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  worker_.Set(/*spilled_answers=*/2, /*retry_after_ms=*/1);
  OneQuery one;
  std::vector<float> kv(16, 1.0f);  // 1 token x 2 kv heads x 8 dims
  Client::AttendArgs a = one.Args();
  a.append_k = kv.data();
  a.append_v = kv.data();
  a.append_tokens = 1;
  EXPECT_THAT(c->Attend(OnFake(), a), IsOk());
  EXPECT_EQ(worker_.calls(), 3);
  EXPECT_EQ(worker_.appends(), 3);  // the same append each time
  worker_.Set(/*spilled_answers=*/100, /*retry_after_ms=*/1);
  auto few = Connect(/*attend_retries=*/1);
  ASSERT_NE(few, nullptr);
  EXPECT_THAT(few->Attend(OnFake(), a),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("gave up after 1 retries")));
  EXPECT_EQ(worker_.calls(), 2);
}

TEST_F(FakeServers, UnavailableWithoutRetryAfterIsReturnedAtOnce) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  worker_.Set(/*spilled_answers=*/1, /*retry_after_ms=*/0);
  OneQuery one;
  EXPECT_THAT(c->Attend(OnFake(), one.Args()),
              StatusIs(absl::StatusCode::kUnavailable, StartsWith("Attend: ")));
  EXPECT_EQ(worker_.calls(), 1);
}

TEST_F(FakeServers, ExtendRefusedByTheWorkerTakesTheManagersPlanBack) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  // Given a sequence of 30 planned tokens,
  manager_.SetTokens(30, /*truncate_fails=*/false, address_);
  SequenceHandle h = OnFake();
  h.num_tokens = 30;
  triax::v1::Span span;
  span.set_role(triax::v1::ROLE_USER);
  span.set_num_tokens(12);
  // when the worker refuses the Extend's pages,
  EXPECT_THAT(c->Extend(&h, {span, span}, /*new_turn=*/true,
                        /*continue_last_span=*/false),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("the arena is full")));
  // expect the manager's plan truncated back to 30 and the handle unchanged.
  EXPECT_EQ(manager_.truncates(), 1);
  EXPECT_EQ(manager_.tokens(), 30u);
  EXPECT_EQ(h.num_tokens, 30u);
}

TEST_F(FakeServers, ExtendSaysWhenItCouldNotTakeThePlanBack) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  manager_.SetTokens(30, /*truncate_fails=*/true, address_);
  SequenceHandle h = OnFake();
  triax::v1::Span span;
  span.set_role(triax::v1::ROLE_USER);
  span.set_num_tokens(5);
  EXPECT_THAT(
      c->Extend(&h, {span}, /*new_turn=*/false, /*continue_last_span=*/false),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("the arena is full"),
                     HasSubstr("undoing the manager's extend of \"s1\" "
                               "failed too"),
                     HasSubstr("is closed"), HasSubstr("close the sequence"))));
  EXPECT_EQ(manager_.truncates(), 1);
}

// A manager that answers TransferSequence only, recording the request.
class TransferManager final : public triax::v1::Manager::Service {
 public:
  grpc::Status TransferSequence(
      grpc::ServerContext*, const triax::v1::TransferSequenceRequest* req,
      triax::v1::TransferSequenceResponse* resp) override {
    absl::MutexLock lock(&mu);
    requests.push_back(*req);
    if (fail) return grpc::Status(grpc::StatusCode::DATA_LOSS, "crc mismatch");
    resp->set_transfer_id("xfer-1");
    resp->set_destination_worker_id("wb");
    resp->set_wire_bytes(100);
    triax::v1::SequenceInfo* s = resp->mutable_sequence();
    s->set_sequence_id(req->sequence_id());
    s->set_worker_id("wb");
    s->set_worker_address("127.0.0.1:2");
    s->set_block_tokens(16);
    s->set_num_tokens(5);
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  bool fail ABSL_GUARDED_BY(mu) = false;
  std::vector<triax::v1::TransferSequenceRequest> requests ABSL_GUARDED_BY(mu);
};

TEST(Client, TransferSequenceRefreshesTheHandle) {
  TransferManager fake;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&fake);
  auto server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ClientOptions o = Unreachable();
  o.manager_address = "127.0.0.1:" + std::to_string(port);
  auto c = Client::Connect(o);
  ASSERT_THAT(c, IsOk());
  EXPECT_THAT((*c)->TransferSequence(nullptr, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));

  SequenceHandle h = Handle();
  h.window_tokens = 64;
  Client::TransferOptions t;
  t.destination_worker_id = "wb";
  t.destination_policy = "triaxial-static";
  t.timeout_ms = 500;
  t.follow_writes = true;
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = true;
  }
  EXPECT_THAT((*c)->TransferSequence(&h, t),
              StatusIs(absl::StatusCode::kDataLoss,
                       StartsWith("TransferSequence: crc mismatch")));
  EXPECT_EQ(h.worker_address, "127.0.0.1:1");  // unchanged
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = false;
  }
  auto r = (*c)->TransferSequence(&h, t);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->transfer_id(), "xfer-1");
  EXPECT_EQ(r->wire_bytes(), 100u);
  EXPECT_EQ(h.worker_address, "127.0.0.1:2");
  EXPECT_EQ(h.num_tokens, 5u);
  EXPECT_EQ(h.window_tokens, std::optional<uint32_t>(64));
  absl::MutexLock lock(&fake.mu);
  ASSERT_EQ(fake.requests.size(), 2u);
  const auto& req = fake.requests[1];
  EXPECT_EQ(req.tenant_id(), "acme");
  EXPECT_EQ(req.sequence_id(), "s1");
  EXPECT_EQ(req.destination_worker_id(), "wb");
  EXPECT_EQ(req.destination_policy(), "triaxial-static");
  EXPECT_EQ(req.timeout_ms(), 500u);
  EXPECT_TRUE(req.follow_writes());
  EXPECT_FALSE(req.request_id().empty());
  EXPECT_NE(req.request_id(), fake.requests[0].request_id());
  server->Shutdown();
}

// A manager that pages ListSequences (tokens "p<next index>") over five
// sequences and QueryTrace over three events, recording the requests;
// `unavailable_once` fails the next page once, `stuck` answers every page
// with the token it was given.
class PagingManager final : public triax::v1::Manager::Service {
 public:
  grpc::Status ListSequences(grpc::ServerContext*,
                             const triax::v1::ListSequencesRequest* req,
                             triax::v1::ListSequencesResponse* resp) override {
    absl::MutexLock lock(&mu);
    requests.push_back(*req);
    if (unavailable_once) {
      unavailable_once = false;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "try again");
    }
    size_t from = 0;
    if (!req->page_token().empty())
      from = std::stoul(req->page_token().substr(1));
    const size_t size = req->page_size() == 0 ? 1000 : req->page_size();
    size_t i = from;
    for (; i < 5 && i < from + size; ++i) {
      resp->add_sequences()->set_sequence_id("seq-" + std::to_string(i + 1));
    }
    if (stuck) {
      resp->set_next_page_token(req->page_token().empty() ? "p0"
                                                          : req->page_token());
    } else if (i < 5) {
      resp->set_next_page_token("p" + std::to_string(i));
    }
    return grpc::Status::OK;
  }
  grpc::Status QueryTrace(grpc::ServerContext*,
                          const triax::v1::QueryTraceRequest* req,
                          triax::v1::QueryTraceResponse* resp) override {
    const uint64_t from =
        req->page_token().empty() ? 1 : std::stoul(req->page_token());
    resp->mutable_block()->set_lineage_id(req->lineage_id());
    resp->set_sequence_id("seq-1");
    resp->add_events()->set_id(from);
    if (from < 3) resp->set_next_page_token(std::to_string(from + 1));
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  bool unavailable_once ABSL_GUARDED_BY(mu) = false;
  bool stuck ABSL_GUARDED_BY(mu) = false;
  std::vector<triax::v1::ListSequencesRequest> requests ABSL_GUARDED_BY(mu);
};

TEST(Client, ListsFollowEveryPage) {
  PagingManager fake;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&fake);
  auto server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ClientOptions o = Unreachable();
  o.manager_address = "127.0.0.1:" + std::to_string(port);
  auto c = Client::Connect(o);
  ASSERT_THAT(c, IsOk());

  auto ids = [](const triax::v1::ListSequencesResponse& r) {
    std::vector<std::string> out;
    for (const auto& s : r.sequences()) out.push_back(s.sequence_id());
    return out;
  };
  auto all = (*c)->ListSequences("acme", true, 2);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(ids(*all),
              ElementsAre("seq-1", "seq-2", "seq-3", "seq-4", "seq-5"));
  EXPECT_TRUE(all->next_page_token().empty());
  {
    absl::MutexLock lock(&fake.mu);
    ASSERT_EQ(fake.requests.size(), 3u);
    EXPECT_EQ(fake.requests[0].page_token(), "");
    EXPECT_EQ(fake.requests[1].page_token(), "p2");
    EXPECT_EQ(fake.requests[2].page_token(), "p4");
    for (const auto& r : fake.requests) {
      EXPECT_EQ(r.tenant_id(), "acme");
      EXPECT_TRUE(r.include_closed());
      EXPECT_EQ(r.page_size(), 2);
    }
    fake.requests.clear();
    fake.unavailable_once = true;
  }
  // An UNAVAILABLE page is asked once more, the same page.
  all = (*c)->ListSequences("", false, 3);
  ASSERT_THAT(all, IsOk());
  EXPECT_EQ(ids(*all).size(), 5u);
  {
    absl::MutexLock lock(&fake.mu);
    ASSERT_EQ(fake.requests.size(), 3u);
    EXPECT_EQ(fake.requests[0].page_token(), "");
    EXPECT_EQ(fake.requests[1].page_token(), "");
    EXPECT_EQ(fake.requests[2].page_token(), "p3");
    fake.requests.clear();
    fake.stuck = true;
  }
  // A manager answering the token it was given would never end.
  EXPECT_THAT((*c)->ListSequences("", false, 2),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(StartsWith("ListSequences: "),
                             HasSubstr("same next_page_token"))));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_EQ(fake.requests.size(), 2u);
    fake.requests.clear();
  }
  EXPECT_THAT(
      (*c)->ListSequences("", false, -1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_size -1")));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_TRUE(fake.requests.empty());  // refused before any RPC
  }

  auto trace = (*c)->QueryTrace(9, 1);
  ASSERT_THAT(trace, IsOk());
  EXPECT_EQ(trace->block().lineage_id(), 9u);
  EXPECT_EQ(trace->sequence_id(), "seq-1");
  ASSERT_EQ(trace->events_size(), 3);
  EXPECT_EQ(trace->events(0).id(), 1u);
  EXPECT_EQ(trace->events(2).id(), 3u);
  server->Shutdown();
}

}  // namespace
}  // namespace triax::client
