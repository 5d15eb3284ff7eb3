// Point-to-point links between two workers' devices: the "link" transfer
// path (worker/link_transfer.h). A link joins exactly two ranks: rank 0 made
// its id (Device::NewLinkId) and handed it to rank 1 through the worker
// service; both then call Device::ConnectLink with it at the same time.
//
// Backends:
//   nccl  two CUDA devices, through NCCL point-to-point send/receive on the
//         link's own stream (worker/link_nccl.h); NCCL picks the transport
//         (NVLink, PCIe, InfiniBand, sockets);
//   tcp   two CPU workers, one TCP connection (Boost.Asio) between them
//         (worker/link_tcp.h).
//
// Operations complete in the order they were posted; each send must be
// matched by the peer's receive of the same length, in the same order.
// Nothing on a link ever waits without a bound: every Wait has a deadline,
// and a link that misses one is aborted (the watchdog: ncclCommAbort for
// NCCL, a socket shutdown for TCP), which fails every pending and later
// operation with UNAVAILABLE. A link is not reused after any error.
//
// Thread contract: Post* and Wait are called by one thread at a time (the
// transfer that holds the link); Abort and aborted() from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace triax::worker {

class DeviceLink {
 public:
  virtual ~DeviceLink() = default;

  // "nccl" or "tcp".
  virtual const char* backend() const = 0;

  // Queue a send of `bytes` device bytes at `src`, or a receive of `bytes`
  // into `dst`; the memory must stay valid until the operation's Wait
  // returns (or the link is destroyed). Returns the operation's ticket.
  // Queuing itself may wait (NCCL connects to the peer on the first
  // operation), at most until `deadline`: DEADLINE_EXCEEDED then, the link
  // aborted. UNAVAILABLE once the link is aborted; INVALID_ARGUMENT for 0
  // bytes.
  virtual absl::StatusOr<uint64_t> PostSend(const uint8_t* src, size_t bytes,
                                            absl::Time deadline) = 0;
  virtual absl::StatusOr<uint64_t> PostRecv(uint8_t* dst, size_t bytes,
                                            absl::Time deadline) = 0;

  // Waits until operation `ticket` and every one posted before it
  // completed. At `deadline` the link is aborted and the result is
  // DEADLINE_EXCEEDED; when `cancelled` (may be empty; polled) turns true,
  // the link is aborted and the result is CANCELLED. UNAVAILABLE when the
  // link failed (the peer went away, NCCL reported an error) or was
  // aborted. INVALID_ARGUMENT for a ticket never issued.
  virtual absl::Status Wait(uint64_t ticket, absl::Time deadline,
                            const std::function<bool()>& cancelled) = 0;

  // Aborts the link: pending operations end, later ones fail UNAVAILABLE
  // with `why`. Idempotent.
  virtual void Abort(absl::string_view why) = 0;
  virtual bool aborted() const = 0;
};

}  // namespace triax::worker
