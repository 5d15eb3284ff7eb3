// TLS for every gRPC listener and channel of the daemons and clients, and
// the peer-identity check of mutual TLS (docs/security.md).
//
// One process has one identity: the certificate and key it serves with are
// also the client certificate it presents on its own calls (a worker's
// certificate carries both serverAuth and clientAuth). `ca_file` holds the
// roots that verify the peer: the server a channel dials, and the client
// certificates a listener asks for.
//
// Listeners: TLS when cert_file is set. With ca_file they ask every client
// for a certificate and verify the one sent (so a handler can tell who
// calls); with require_client_cert a client without a valid one is refused
// at the handshake. Channels: TLS when ca_file is set, presenting
// cert_file/key_file when those are set. Workers advertise addresses (pod
// IPs) that no shared certificate can name, so channels to workers may
// verify one agreed name instead (--tls_worker_server_name, set on the
// channel as gRPC's SSL target name override).
//
// Flags-free: the daemons' flags (--tls_cert, --tls_key, --tls_ca,
// --tls_require_client_cert) fill TlsOptions, and errors name those flags.
#pragma once

#include <grpcpp/security/auth_context.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace triax {

struct TlsOptions {
  std::string cert_file;  // PEM certificate chain of this process
  std::string key_file;   // PEM private key of cert_file
  std::string ca_file;    // PEM roots that verify peers
  // Listener: refuse clients without a certificate signed by ca_file.
  bool require_client_cert = false;
  // The flags' names in messages: --<prefix>_cert, --<prefix>_key, ...
  std::string flag_prefix = "tls";
};

// TlsOptions with the files read and checked.
struct TlsConfig {
  std::string cert_pem;
  std::string key_pem;
  std::string ca_pem;
  bool require_client_cert = false;

  bool server_enabled() const { return !cert_pem.empty(); }
  bool client_enabled() const { return !ca_pem.empty(); }
};

// Reads and parses the files (OpenSSL): INVALID_ARGUMENT naming the flag and
// the path for a file that cannot be read, holds no PEM certificate (or
// key), a key that does not match the certificate, a cert without its key
// (or the reverse), and --tls_require_client_cert without --tls_ca. All
// fields empty: TLS off, OK.
absl::StatusOr<TlsConfig> LoadTls(const TlsOptions& options);

// Insecure credentials when the config's side is off (see the file comment).
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
    const TlsConfig& config);
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(
    const TlsConfig& config);

// The verified client certificate's identity on a call: its common name
// when it has one, else its first subject alternative name; "" for a
// plaintext or certificate-less call.
std::string PeerIdentity(const grpc::AuthContext& context);

// True when `identity` is one of `names`; a name ending in '*' matches
// every identity starting with what comes before it ("kvworker-*", "*").
bool IdentityMatches(absl::string_view identity,
                     const std::vector<std::string>& names);

// The check of a call to `method` that only client certificates named in
// `names` may make (IdentityMatches): UNAUTHENTICATED without a verified
// certificate, PERMISSION_DENIED with one of another name; both name the
// method. A service calls it in the handlers of its guarded methods, so
// that other calls pay nothing and every listener is covered alike
// (kvmanager's RegisterWorker and Heartbeat; kvworker's plan, tier and
// page-pull methods, WorkerServiceOptions::certificate_names).
absl::Status CheckPeerIdentity(const grpc::AuthContext& context,
                               absl::string_view method,
                               const std::vector<std::string>& names);

}  // namespace triax
