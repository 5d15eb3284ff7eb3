// TransferSequence over real gRPC with fake in-process workers on loopback:
// a destination whose ImportSequence succeeds, fails DATA_LOSS or stalls past
// the timeout; the manager answers within the bound, the reservations come
// back, FreePages reaches the right side; bad input for every field.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kvmanager/manager_service.h"
#include "kvmanager/manager_service_test_util.h"

namespace triax::manager {
namespace {

// A worker that records ImportSequence and FreePages calls.
class FakeWorker final : public v1::Worker::Service {
 public:
  enum class Mode { kOk, kDataLoss, kStall };

  grpc::Status ImportSequence(grpc::ServerContext* ctx,
                              const v1::ImportSequenceRequest* req,
                              v1::ImportSequenceResponse* resp) override {
    absl::MutexLock lock(&mu);
    imports.push_back(*req);
    switch (mode) {
      case Mode::kDataLoss:
        return grpc::Status(grpc::StatusCode::DATA_LOSS,
                            "page 3 crc32c mismatch");
      case Mode::kStall:
        // Until the manager's deadline cancels the call (or the test ends).
        while (!ctx->IsCancelled() && !unstall) {
          mu.AwaitWithTimeout(absl::Condition(&unstall), absl::Milliseconds(5));
        }
        return grpc::Status(grpc::StatusCode::CANCELLED, "stalled");
      case Mode::kOk:
        break;
    }
    uint64_t pages = 0;
    for (const auto& b : req->blocks()) {
      if (!b.evicted()) pages += req->model().n_layers();
    }
    resp->set_pages(pages);
    resp->set_wire_bytes(pages * 1000);
    resp->set_bf16_bytes(pages * 4000);
    resp->set_page_bytes(pages * 1024);
    resp->set_seconds(0.5);
    resp->set_data_path("ipc");
    return grpc::Status::OK;
  }
  grpc::Status FreePages(grpc::ServerContext*, const v1::FreePagesRequest* req,
                         v1::FreePagesResponse*) override {
    absl::MutexLock lock(&mu);
    frees.push_back(*req);
    return grpc::Status::OK;
  }

  // Waits (up to 10 s) until FreePages has been called n times.
  bool WaitFrees(size_t n) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return frees.size() >= n;
    };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }
  size_t Frees() {
    absl::MutexLock lock(&mu);
    return frees.size();
  }

  absl::Mutex mu;
  Mode mode ABSL_GUARDED_BY(mu) = Mode::kOk;
  bool unstall ABSL_GUARDED_BY(mu) = false;
  std::vector<v1::ImportSequenceRequest> imports ABSL_GUARDED_BY(mu);
  std::vector<v1::FreePagesRequest> frees ABSL_GUARDED_BY(mu);
};

class TransferServiceTest : public ServiceTest {
 protected:
  void SetUp() override {
    ServiceTest::SetUp();
    // src has the most room (Opens go there), then dst, then w1.
    StartWorker("src", &src_, 1ull << 42, &src_server_, &src_address_);
    StartWorker("dst", &dst_, 1ull << 41, &dst_server_, &dst_address_);
    v1::OpenSequenceResponse o;
    ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &o).ok());
    ASSERT_EQ(o.sequence().worker_id(), "src");
    seq_ = o.sequence().sequence_id();
    bytes_ = o.sequence().bytes();
  }
  void TearDown() override {
    {
      absl::MutexLock lock(&dst_.mu);
      dst_.unstall = true;
    }
    ServiceTest::TearDown();
    if (src_server_) src_server_->Shutdown();
    if (dst_server_) dst_server_->Shutdown();
  }

  void StartWorker(const std::string& id, FakeWorker* fake, uint64_t capacity,
                   std::unique_ptr<grpc::Server>* server,
                   std::string* address) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(fake);
    *server = builder.BuildAndStart();
    ASSERT_NE(*server, nullptr);
    *address = "127.0.0.1:" + std::to_string(port);
    v1::RegisterWorkerRequest reg;
    reg.set_worker_id(id);
    reg.set_address(*address);
    reg.set_backend("cpu");
    reg.set_capacity_bytes(capacity);
    v1::RegisterWorkerResponse resp;
    ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, reg, &resp).ok());
  }

  v1::TransferSequenceRequest Req(const std::string& dest = "dst") {
    v1::TransferSequenceRequest r;
    r.set_tenant_id("acme");
    r.set_sequence_id(seq_);
    r.set_destination_worker_id(dest);
    return r;
  }

  // The sequence's placement and the reservations of the tenant and workers.
  std::string Accounting() {
    v1::GetSequenceRequest g;
    g.set_tenant_id("acme");
    g.set_sequence_id(seq_);
    v1::GetSequenceResponse s;
    EXPECT_TRUE(Call(&v1::Manager::Stub::GetSequence, g, &s).ok());
    v1::ListTenantsResponse t;
    EXPECT_TRUE(
        Call(&v1::Manager::Stub::ListTenants, v1::ListTenantsRequest(), &t)
            .ok());
    v1::ListWorkersResponse w;
    EXPECT_TRUE(
        Call(&v1::Manager::Stub::ListWorkers, v1::ListWorkersRequest(), &w)
            .ok());
    std::string out = s.sequence().DebugString() + t.DebugString();
    for (const auto& worker : w.workers()) {
      out += worker.worker_id() + "=" +
             std::to_string(worker.reserved_bytes()) + " ";
    }
    return out;
  }

  uint64_t ReservedOn(const std::string& id) {
    v1::ListWorkersResponse w;
    EXPECT_TRUE(
        Call(&v1::Manager::Stub::ListWorkers, v1::ListWorkersRequest(), &w)
            .ok());
    for (const auto& worker : w.workers()) {
      if (worker.worker_id() == id) return worker.reserved_bytes();
    }
    return ~uint64_t{0};
  }

  FakeWorker src_, dst_;
  std::unique_ptr<grpc::Server> src_server_, dst_server_;
  std::string src_address_, dst_address_;
  std::string seq_;
  uint64_t bytes_ = 0;
};

TEST_F(TransferServiceTest, TransferGoesThroughTheDestination) {
  v1::TransferSequenceRequest req = Req("");  // placement picks dst
  req.set_request_id("xfer-req-1");
  req.set_follow_writes(true);
  v1::TransferSequenceResponse r;
  grpc::Status st = Call(&v1::Manager::Stub::TransferSequence, req, &r);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(r.transfer_id(), "xfer-1");
  EXPECT_EQ(r.source_worker_id(), "src");
  EXPECT_EQ(r.destination_worker_id(), "dst");
  EXPECT_EQ(r.sequence().worker_id(), "dst");
  EXPECT_EQ(r.sequence().worker_address(), dst_address_);
  EXPECT_TRUE(r.sequence().transfer_id().empty());
  EXPECT_EQ(r.blocks(), 3u);
  EXPECT_EQ(r.pages(), 6u);  // 3 blocks x 2 layers
  EXPECT_EQ(r.wire_bytes(), 6000u);
  EXPECT_EQ(r.bf16_bytes(), 24000u);
  EXPECT_EQ(r.source_bytes(), bytes_);
  EXPECT_DOUBLE_EQ(r.pull_seconds(), 0.5);
  EXPECT_EQ(r.data_path(), "ipc");  // the destination's, passed through
  {
    absl::MutexLock lock(&dst_.mu);
    ASSERT_EQ(dst_.imports.size(), 1u);
    const v1::ImportSequenceRequest& w = dst_.imports[0];
    EXPECT_EQ(w.request_id(), "xfer-1");
    EXPECT_EQ(w.transfer_id(), "xfer-1");
    EXPECT_EQ(w.tenant_id(), "acme");
    EXPECT_EQ(w.sequence_id(), seq_);
    EXPECT_EQ(w.model().n_layers(), 2u);
    EXPECT_EQ(w.model().head_dim(), 64u);
    EXPECT_EQ(w.block_tokens(), 16u);
    EXPECT_EQ(w.blocks_size(), 3);
    EXPECT_EQ(w.source_address(), src_address_);
    EXPECT_EQ(w.timeout_ms(), 10000u);
    EXPECT_TRUE(w.follow_writes());
  }
  // The source frees its copy; the destination is not told to free.
  ASSERT_TRUE(src_.WaitFrees(1));
  {
    absl::MutexLock lock(&src_.mu);
    EXPECT_EQ(src_.frees[0].sequence_id(), seq_);
    EXPECT_EQ(src_.frees[0].tenant_id(), "acme");
  }
  EXPECT_EQ(dst_.Frees(), 0u);
  EXPECT_EQ(ReservedOn("src"), 0u);
  EXPECT_EQ(ReservedOn("dst"), bytes_);

  // The same request id again: the same reply, no second import.
  v1::TransferSequenceResponse again;
  ASSERT_TRUE(Call(&v1::Manager::Stub::TransferSequence, req, &again).ok());
  EXPECT_EQ(again.SerializeAsString(), r.SerializeAsString());
  absl::MutexLock lock(&dst_.mu);
  EXPECT_EQ(dst_.imports.size(), 1u);
}

TEST_F(TransferServiceTest, ImportDataLossAbortsAndFreesTheDestination) {
  {
    absl::MutexLock lock(&dst_.mu);
    dst_.mode = FakeWorker::Mode::kDataLoss;
  }
  const std::string before = Accounting();
  v1::TransferSequenceRequest req = Req();
  req.set_request_id("dl-1");
  v1::TransferSequenceResponse r;
  grpc::Status st = Call(&v1::Manager::Stub::TransferSequence, req, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(st.error_message(),
            "transfer xfer-1 of \"" + seq_ +
                "\" from \"src\" to \"dst\": destination ImportSequence: page "
                "3 crc32c mismatch");
  EXPECT_EQ(Accounting(), before);  // on the source, reservations back
  ASSERT_TRUE(dst_.WaitFrees(1));
  {
    absl::MutexLock lock(&dst_.mu);
    EXPECT_EQ(dst_.frees[0].sequence_id(), seq_);
  }
  EXPECT_EQ(src_.Frees(), 0u);
  // The request id's final reply is that error, with no second import.
  {
    absl::MutexLock lock(&dst_.mu);
    dst_.mode = FakeWorker::Mode::kOk;
  }
  grpc::Status again = Call(&v1::Manager::Stub::TransferSequence, req, &r);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(again.error_message(), st.error_message());
  {
    absl::MutexLock lock(&dst_.mu);
    EXPECT_EQ(dst_.imports.size(), 1u);
  }
  // A retry (a new request id) succeeds.
  st = Call(&v1::Manager::Stub::TransferSequence, Req(), &r);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(r.transfer_id(), "xfer-2");
  EXPECT_EQ(r.sequence().worker_id(), "dst");
}

TEST_F(TransferServiceTest, StalledImportAnswersWithinTheTimeout) {
  {
    absl::MutexLock lock(&dst_.mu);
    dst_.mode = FakeWorker::Mode::kStall;
  }
  const std::string before = Accounting();
  v1::TransferSequenceRequest req = Req();
  req.set_timeout_ms(300);
  v1::TransferSequenceResponse r;
  const auto start = std::chrono::steady_clock::now();
  grpc::Status st = Call(&v1::Manager::Stub::TransferSequence, req, &r);
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << st.error_message();
  EXPECT_THAT(st.error_message(),
              HasSubstr("transfer xfer-1 of \"" + seq_ +
                        "\" from \"src\" to \"dst\": destination "
                        "ImportSequence: "));
  EXPECT_GE(ms, 290.0);
  EXPECT_LT(ms, 2300.0) << "the bound is the timeout plus a small margin";
  EXPECT_EQ(Accounting(), before);
  ASSERT_TRUE(dst_.WaitFrees(1));
  EXPECT_EQ(src_.Frees(), 0u);
}

TEST_F(TransferServiceTest, BadInputNamesTheField) {
  struct Case {
    const char* field;
    std::function<void(v1::TransferSequenceRequest*)> edit;
    grpc::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"request_id", [](auto* r) { r->set_request_id("a b"); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"tenant_id", [](auto* r) { r->set_tenant_id(""); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"sequence_id", [](auto* r) { r->set_sequence_id(""); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"destination_worker_id",
       [](auto* r) { r->set_destination_worker_id("d/st"); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"destination_policy", [](auto* r) { r->set_destination_policy("p q"); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"timeout_ms", [](auto* r) { r->set_timeout_ms(4'000'000); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"\"ghost\"", [](auto* r) { r->set_tenant_id("ghost"); },
       grpc::StatusCode::NOT_FOUND},
      {"seq-77", [](auto* r) { r->set_sequence_id("seq-77"); },
       grpc::StatusCode::NOT_FOUND},
      {"\"other\"", [](auto* r) { r->set_tenant_id("other"); },
       grpc::StatusCode::PERMISSION_DENIED},
      {"\"nowhere\"", [](auto* r) { r->set_destination_worker_id("nowhere"); },
       grpc::StatusCode::NOT_FOUND},
      {"\"src\"", [](auto* r) { r->set_destination_worker_id("src"); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"\"no-policy\"", [](auto* r) { r->set_destination_policy("no-policy"); },
       grpc::StatusCode::NOT_FOUND},
  };
  const std::string before = StateSnapshot();
  for (const Case& c : cases) {
    v1::TransferSequenceRequest req = Req();
    c.edit(&req);
    v1::TransferSequenceResponse r;
    grpc::Status st = Call(&v1::Manager::Stub::TransferSequence, req, &r);
    EXPECT_EQ(st.error_code(), c.code) << c.field << ": " << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr(c.field));
  }
  EXPECT_EQ(StateSnapshot(), before);
  absl::MutexLock lock(&dst_.mu);
  EXPECT_TRUE(dst_.imports.empty());
}

TEST_F(TransferServiceTest, ReplayOnlyWatchEndsAfterTheHistory) {
  {
    absl::MutexLock lock(&dst_.mu);
    dst_.mode = FakeWorker::Mode::kDataLoss;
  }
  v1::TransferSequenceResponse r;
  ASSERT_FALSE(Call(&v1::Manager::Stub::TransferSequence, Req(), &r).ok());
  {
    absl::MutexLock lock(&dst_.mu);
    dst_.mode = FakeWorker::Mode::kOk;
  }
  ASSERT_TRUE(Call(&v1::Manager::Stub::TransferSequence, Req(), &r).ok());
  v1::WatchEventsRequest w;
  w.set_from_id(1);
  w.set_sequence_id(seq_);
  w.set_replay_only(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = stub_->WatchEvents(&ctx, w);
  std::vector<v1::EventKind> kinds;
  v1::Event e;
  while (reader->Read(&e)) {
    if (e.kind() == v1::EVENT_TRANSFER_STARTED ||
        e.kind() == v1::EVENT_TRANSFER_FAILED ||
        e.kind() == v1::EVENT_SEQUENCE_TRANSFERRED) {
      kinds.push_back(e.kind());
      EXPECT_EQ(e.source_worker_id(), "src");
      EXPECT_EQ(e.worker_id(), "dst");
    }
  }
  grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();  // ended, not the deadline
  EXPECT_EQ(kinds,
            (std::vector<v1::EventKind>{
                v1::EVENT_TRANSFER_STARTED, v1::EVENT_TRANSFER_FAILED,
                v1::EVENT_TRANSFER_STARTED, v1::EVENT_SEQUENCE_TRANSFERRED}));
}

}  // namespace
}  // namespace triax::manager
