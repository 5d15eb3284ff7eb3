// A live kvworker's grpc.health.v1.Health as Kubernetes' probes see it:
// standalone, "" (readiness) and "triax.v1.Worker" (liveness) are SERVING as
// soon as it listens (its pools are allocated before the server starts);
// with --manager, "" stays NOT_SERVING while the manager does not answer
// (paused with SIGSTOP, so registration cannot succeed) and turns SERVING
// once the worker has registered, while "triax.v1.Worker" is SERVING all
// along; on SIGTERM a Watch stream sees NOT_SERVING before the stream ends.
//
// Check goes through common/health_check.h; Watch (a server stream) is
// encoded here the same way, over a generic stub: Debian's grpc++ ships no
// generated health proto, and the two messages are one field each.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/health_check.h"
#include "common/ids.h"
#include "common/status_matchers.h"
#include "tests/integration/process.h"

namespace triax::testing {
namespace {

std::shared_ptr<grpc::Channel> Dial(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

ServingStatus StatusOf(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& service) {
  absl::StatusOr<ServingStatus> s = CheckHealth(channel, service);
  EXPECT_THAT(s, IsOk()) << "service " << Quote(service);
  return s.value_or(ServingStatus::kUnknown);
}

// Polls until `service` reports `want`; false when `timeout` passed first.
bool WaitForStatus(const std::shared_ptr<grpc::Channel>& channel,
                   const std::string& service, ServingStatus want,
                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    absl::StatusOr<ServingStatus> s =
        CheckHealth(channel, service, absl::Seconds(2));
    if (s.ok() && *s == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// One grpc.health.v1.Health/Watch stream on a completion queue.
class HealthWatch {
 public:
  // Starts the stream for `service` (at most 127 bytes).
  static absl::StatusOr<std::unique_ptr<HealthWatch>> Start(
      const std::shared_ptr<grpc::Channel>& channel,
      const std::string& service) {
    auto w = std::unique_ptr<HealthWatch>(new HealthWatch(channel));
    w->ctx_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    w->call_ =
        w->stub_.PrepareCall(&w->ctx_, "/grpc.health.v1.Health/Watch", &w->cq_);
    w->call_->StartCall(w->Tag(1));
    if (!w->Await(1)) return absl::UnavailableError("Watch did not start");
    std::string request;
    if (!service.empty()) {
      request.push_back('\x0a');  // field 1, length-delimited
      request.push_back(static_cast<char>(service.size()));
      request += service;
    }
    grpc::Slice slice(request);
    grpc::ByteBuffer buffer(&slice, 1);
    w->call_->Write(buffer, w->Tag(2));
    if (!w->Await(2)) return absl::UnavailableError("Watch request not sent");
    w->call_->WritesDone(w->Tag(3));
    if (!w->Await(3)) return absl::UnavailableError("Watch WritesDone failed");
    return w;
  }

  ~HealthWatch() {
    ctx_.TryCancel();
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // The next status the server sends; NOT_FOUND once the stream has ended.
  absl::StatusOr<ServingStatus> Next() {
    grpc::ByteBuffer buffer;
    call_->Read(&buffer, Tag(4));
    if (!Await(4)) return absl::NotFoundError("the Watch stream ended");
    std::vector<grpc::Slice> slices;
    if (!buffer.Dump(&slices).ok()) {
      return absl::InternalError("cannot read the Watch response");
    }
    std::string response;
    for (const grpc::Slice& s : slices) {
      response.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    if (response.empty()) return ServingStatus::kUnknown;
    if (response.size() != 2 || response[0] != '\x08') {
      return absl::InternalError(absl::StrCat("unexpected Watch response of ",
                                              response.size(), " bytes"));
    }
    return static_cast<ServingStatus>(response[1]);
  }

 private:
  explicit HealthWatch(const std::shared_ptr<grpc::Channel>& channel)
      : stub_(channel) {}
  static void* Tag(intptr_t i) { return reinterpret_cast<void*>(i); }
  // Waits for the operation tagged `want`; its ok bit.
  bool Await(intptr_t want) {
    void* tag = nullptr;
    bool ok = false;
    if (!cq_.Next(&tag, &ok)) return false;
    EXPECT_EQ(tag, Tag(want));
    return ok;
  }

  grpc::GenericStub stub_;
  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
};

TEST(WorkerHealthTest, StandaloneWorkerIsServingOnceListening) {
  auto dir = TempDir::Create("worker_health");
  ASSERT_THAT(dir, IsOk());
  auto worker = Process::Start(
      "w", "kvworker", {"--listen=127.0.0.1:0", "--backend=cpu", "--pool_mb=8"},
      (*dir)->path());
  ASSERT_THAT(worker, IsOk());
  auto channel = Dial((*worker)->address());
  EXPECT_EQ(StatusOf(channel, ""), ServingStatus::kServing);
  EXPECT_EQ(StatusOf(channel, "triax.v1.Worker"), ServingStatus::kServing);
  EXPECT_THAT(CheckHealth(channel, "triax.v1.Manager"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST(WorkerHealthTest, ReadyOnlyOnceRegisteredWithTheManager) {
  auto dir = TempDir::Create("worker_health");
  ASSERT_THAT(dir, IsOk());
  auto manager = Process::Start("m", "kvmanager", {"--listen=127.0.0.1:0"},
                                (*dir)->path());
  ASSERT_THAT(manager, IsOk());
  // Frozen, the manager's socket still accepts connections but nothing
  // answers, so every RegisterWorker runs into its deadline.
  ASSERT_THAT((*manager)->Pause(), IsOk());
  auto worker =
      Process::Start("w", "kvworker",
                     {"--listen=127.0.0.1:0", "--backend=cpu", "--pool_mb=8",
                      "--worker_id=health-w0",
                      absl::StrCat("--manager=", (*manager)->address())},
                     (*dir)->path());
  ASSERT_THAT(worker, IsOk());
  auto channel = Dial((*worker)->address());
  EXPECT_EQ(StatusOf(channel, ""), ServingStatus::kNotServing)
      << (*worker)->Log();
  EXPECT_EQ(StatusOf(channel, "triax.v1.Worker"), ServingStatus::kServing);

  ASSERT_THAT((*manager)->Resume(), IsOk());
  EXPECT_TRUE(
      WaitForStatus(channel, "", ServingStatus::kServing, absl::Seconds(30)))
      << (*worker)->Log() << "\nmanager:\n"
      << (*manager)->Log();
  EXPECT_EQ(StatusOf(channel, "triax.v1.Worker"), ServingStatus::kServing);

  // Registration counts once: a manager gone later leaves the worker ready
  // (and alive), so its pods are neither unrouted nor restarted meanwhile.
  (*manager)->Stop();
  EXPECT_EQ(StatusOf(channel, ""), ServingStatus::kServing);
  EXPECT_EQ(StatusOf(channel, "triax.v1.Worker"), ServingStatus::kServing);
}

TEST(WorkerHealthTest, WatchersSeeNotServingOnSigterm) {
  auto dir = TempDir::Create("worker_health");
  ASSERT_THAT(dir, IsOk());
  auto worker = Process::Start(
      "w", "kvworker", {"--listen=127.0.0.1:0", "--backend=cpu", "--pool_mb=8"},
      (*dir)->path());
  ASSERT_THAT(worker, IsOk());
  auto channel = Dial((*worker)->address());
  for (const std::string service : {"", "triax.v1.Worker"}) {
    SCOPED_TRACE(Quote(service));
    auto watch = HealthWatch::Start(channel, service);
    ASSERT_THAT(watch, IsOk());
    auto first = (*watch)->Next();
    ASSERT_THAT(first, IsOk());
    EXPECT_EQ(*first, ServingStatus::kServing);
    if (!service.empty()) {
      // The second stream: SIGTERM now, and its next update is the drain.
      ASSERT_EQ(::kill((*worker)->pid(), SIGTERM), 0);
      auto next = (*watch)->Next();
      ASSERT_THAT(next, IsOk()) << (*worker)->Log();
      EXPECT_EQ(*next, ServingStatus::kNotServing);
    }
  }
  auto code = (*worker)->Wait(absl::Seconds(30));
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 0) << (*worker)->Log();
}

}  // namespace
}  // namespace triax::testing
