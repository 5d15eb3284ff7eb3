// TCP links between two CPU workers (worker/link.h), on Boost.Asio.
//
// Rendezvous: rank 0's NewLinkId opens a listener on an ephemeral port of
// the factory's host and returns "tcp <host> <port> <token>" (the token: 16
// random bytes, hex). Rank 1 connects and sends the token first; rank 0
// accepts until a connection presents it (others are closed), so a stray
// connection cannot take the link, and answers one byte; rank 1's link is
// made only when that byte came. A listener that no ConnectLink claims
// is closed after kListenerTtl.
//
// Data: the link's own thread runs the posted operations in order with
// blocking writes and reads of exactly the posted lengths (the CPU
// backend's device memory is host memory). Abort shuts the socket down,
// which ends an operation blocked on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/link.h"

namespace triax::worker {

class TcpLinkFactory {
 public:
  static constexpr absl::Duration kListenerTtl = absl::Seconds(60);

  // INVALID_ARGUMENT unless `host` is an IP address other than a wildcard
  // (0.0.0.0, ::), which a peer could not connect to.
  static absl::Status CheckHost(const std::string& host);

  explicit TcpLinkFactory(std::string host);
  ~TcpLinkFactory();
  TcpLinkFactory(const TcpLinkFactory&) = delete;
  TcpLinkFactory& operator=(const TcpLinkFactory&) = delete;

  // UNAVAILABLE when no listener can be opened on the host.
  absl::StatusOr<std::string> NewLinkId();
  // Device::ConnectLink. Rank 0 must name an id this factory made.
  absl::StatusOr<std::unique_ptr<DeviceLink>> Connect(
      absl::string_view id, int rank, absl::Time deadline,
      const std::function<bool()>& cancelled);

 private:
  struct Listener;
  const std::string host_;
  absl::Mutex mu_;
  // Token -> its listener, until rank 0 claims it.
  absl::flat_hash_map<std::string, std::unique_ptr<Listener>> listeners_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
