// Unix-domain sockets for clients on a daemon's own host (docs/security.md
// "Local socket").
//
// A kvworker or kvmanager started with --local_listen=unix:/PATH serves the
// same service on that socket as on its TCP --listen, with gRPC's local
// credentials: the bytes never leave the host, so they are not encrypted
// (no TLS records, no AES-GCM, no frame protector copies), and who may
// connect is the socket file's mode (--local_listen_mode) and its
// directory's. Bearer tokens and capabilities apply as on TCP; a call over
// the socket carries no client certificate, so the methods only the
// manager's or a worker's certificate may call (mutual TLS) are refused
// there.
//
// Channels: an address "unix:/PATH" dials with local credentials whatever
// the TLS configuration of TCP addresses is (ChannelCredentialsFor).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace triax {

// True for "unix:PATH" addresses (gRPC's Unix-domain socket scheme).
bool IsUnixAddress(absl::string_view address);

// The socket file's path of a "unix:" address ("unix:///a" and "unix:/a"
// both name /a).
std::string UnixSocketPath(absl::string_view address);

// Checks --<flag>=`value` before a listener starts: "unix:" and an absolute
// path that fits a socket address (at most 107 bytes), whose directory
// exists, and where no other process serves already (a file there that is
// not a socket, or a socket someone accepts on, is refused; a stale socket
// of a process gone is left for gRPC to replace). INVALID_ARGUMENT or
// FAILED_PRECONDITION naming the flag and the value.
absl::Status CheckLocalListen(absl::string_view flag, absl::string_view value);

// Parses an octal file mode such as "0660" (at most 0777): INVALID_ARGUMENT
// naming the flag and the value otherwise.
absl::StatusOr<mode_t> ParseSocketMode(absl::string_view flag,
                                       absl::string_view value);

// Once the server listens: sets the socket file's mode (chmod), so that only
// those the mode lets in may connect.
absl::Status RestrictSocket(absl::string_view address, mode_t mode);

// Removes the socket file of a "unix:" address when the daemon stops (a
// missing file is fine).
void RemoveSocket(absl::string_view address);

// gRPC's local credentials for Unix-domain sockets.
std::shared_ptr<grpc::ServerCredentials> LocalSocketServerCredentials();

// Local credentials for a "unix:" address; `tcp` (TLS or plaintext, from
// ChannelCredentials in common/tls.h; null: plaintext) for any other.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(
    absl::string_view address,
    const std::shared_ptr<grpc::ChannelCredentials>& tcp);

}  // namespace triax
