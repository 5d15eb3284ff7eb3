// The destination's side of a worker-to-worker transfer over gRPC: opens
// the source worker's ExportPages stream for an ImportRequest and hands
// every page to the import as it arrives (WorkerCore's PageFetcher).
//
// Channels are cached by address (one per source worker, reused by later
// transfers); their maximum receive message size is raised above the
// largest batch a source sends (kMaxReceiveBytes). The call's deadline is
// the import's; a stalled source (SIGSTOP) ends it DEADLINE_EXCEEDED, a
// dead or unreachable one UNAVAILABLE (no wait-for-ready: a source that is
// not there fails the call at once). The source's error keeps its
// canonical code; its message names the source ("source worker-a at
// 127.0.0.1:1234: ..."). An error of `install` cancels the stream and is
// returned unchanged.
//
// Thread contract: thread-safe; fetches run concurrently.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/worker_core.h"

namespace triax::worker {

class TransferClient {
 public:
  static constexpr int kMaxReceiveBytes = 64 << 20;

  absl::Status Fetch(
      const ImportRequest& req, absl::Time deadline,
      absl::FunctionRef<absl::Status(const TransferPage&)> install);

  // A PageFetcher bound to this client (which must outlive it).
  PageFetcher AsFetcher();

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
