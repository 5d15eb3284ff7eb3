// NCCL links between two CUDA workers (worker/link.h), part of the CUDA
// backend.
//
// NCCL is loaded at run time (dlopen of LinkOptions::nccl_library), so a
// worker built with CUDA runs where NCCL is not installed and the transfer
// path falls back (auto) or fails naming the reason (link).
//
// A link is a two-rank communicator made non-blocking
// (ncclConfig_t.blocking = 0): no NCCL call ever blocks, so every wait is a
// poll of ncclCommGetAsyncError and the operation's CUDA event with a
// deadline — the watchdog — and a link that misses one is torn down with
// ncclCommAbort (which ends its kernels), never left hanging. Rank 0 makes
// the id (ncclGetUniqueId, which starts NCCL's bootstrap root in that
// process); rank 1 gets it through the worker service. Sends and receives
// run on the link's own stream, one event per operation.
//
// Two workers on one GPU cannot share a communicator (NCCL refuses a
// duplicate GPU) unless each runs with its own NCCL_HOSTID, which makes
// NCCL treat them as two hosts (its socket transport): how the link path
// is tested on a one-GPU machine.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/link.h"

namespace triax::worker {

class NcclLinks {
 public:
  // Loads NCCL from `library` for CUDA device `ordinal`.
  // FAILED_PRECONDITION when it cannot be loaded or lacks a symbol.
  static absl::StatusOr<std::unique_ptr<NcclLinks>> Load(
      const std::string& library, int ordinal);
  ~NcclLinks();
  NcclLinks(const NcclLinks&) = delete;
  NcclLinks& operator=(const NcclLinks&) = delete;

  // "2.28.9" — the loaded library's ncclGetVersion.
  std::string version() const;

  absl::StatusOr<std::string> NewLinkId();
  absl::StatusOr<std::unique_ptr<DeviceLink>> Connect(
      absl::string_view id, int rank, absl::Time deadline,
      const std::function<bool()>& cancelled);

  struct Api;  // the loaded entry points

 private:
  NcclLinks(void* handle, std::unique_ptr<Api> api, int ordinal);
  void* const handle_;
  const std::unique_ptr<Api> api_;
  const int ordinal_;
};

}  // namespace triax::worker
