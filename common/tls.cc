#include "common/tls.h"

#include <grpcpp/security/auth_context.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_status.h"

namespace triax {

namespace {

absl::StatusOr<std::string> ReadFile(absl::string_view flag,
                                     const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path,
                     ": cannot read the file: ", std::strerror(errno)));
  }
  std::ostringstream s;
  s << in.rdbuf();
  if (s.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": the file is empty"));
  }
  return s.str();
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioDeleter>;
using Cert = std::unique_ptr<X509, X509Deleter>;
using Key = std::unique_ptr<EVP_PKEY, KeyDeleter>;

Bio MemBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM file; null when it holds none. gRPC only
// says "handshake failed" later, so a wrong file is caught here, naming it.
Cert FirstCert(const std::string& pem) {
  Bio bio = MemBio(pem);
  return Cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

}  // namespace

absl::StatusOr<TlsConfig> LoadTls(const TlsOptions& options) {
  const std::string f = options.flag_prefix + "_";
  TlsConfig config;
  config.require_client_cert = options.require_client_cert;
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        options.cert_file.empty()
            ? absl::StrCat("--", f, "key=", options.key_file, " needs --", f,
                           "cert (empty)")
            : absl::StrCat("--", f, "cert=", options.cert_file, " needs --", f,
                           "key (empty)"));
  }
  if (options.require_client_cert && options.ca_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", f, "require_client_cert needs --", f,
                     "ca (empty) to verify the client certificates with"));
  }
  if (!options.cert_file.empty()) {
    auto cert = ReadFile(f + "cert", options.cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadFile(f + "key", options.key_file);
    if (!key.ok()) return key.status();
    Cert x509 = FirstCert(*cert);
    if (x509 == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", f, "cert=", options.cert_file, ": holds no PEM certificate"));
    }
    Bio bio = MemBio(*key);
    Key pkey(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    if (pkey == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", f, "key=", options.key_file,
                       ": holds no PEM private key (or it is encrypted)"));
    }
    if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", f, "key=", options.key_file,
                       " is not the key of --", f, "cert=", options.cert_file));
    }
    config.cert_pem = *std::move(cert);
    config.key_pem = *std::move(key);
  }
  if (!options.ca_file.empty()) {
    auto ca = ReadFile(f + "ca", options.ca_file);
    if (!ca.ok()) return ca.status();
    if (FirstCert(*ca) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", f, "ca=", options.ca_file, ": holds no PEM certificate"));
    }
    config.ca_pem = *std::move(ca);
  }
  if (!config.ca_pem.empty() && config.cert_pem.empty() &&
      options.require_client_cert) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", f, "require_client_cert needs --", f, "cert and --", f,
        "key (empty): client certificates are only asked for "
        "over TLS"));
  }
  return config;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
    const TlsConfig& config) {
  if (!config.server_enabled()) return grpc::InsecureServerCredentials();
  // Without roots there is nothing to verify a client certificate with; with
  // them every client is asked, so that handlers can tell a worker from a
  // frontend even where certificates are optional.
  grpc::SslServerCredentialsOptions options(
      config.ca_pem.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : (config.require_client_cert
                 ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                 : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY));
  options.pem_root_certs = config.ca_pem;
  options.pem_key_cert_pairs.push_back({config.key_pem, config.cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(
    const TlsConfig& config) {
  if (!config.client_enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = config.ca_pem;
  options.pem_private_key = config.key_pem;
  options.pem_cert_chain = config.cert_pem;
  return grpc::SslCredentials(options);
}

std::string PeerIdentity(const grpc::AuthContext& context) {
  if (!context.IsPeerAuthenticated()) return "";
  for (const char* property :
       {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
    const std::vector<grpc::string_ref> values =
        context.FindPropertyValues(property);
    if (!values.empty()) {
      return std::string(values.front().data(), values.front().size());
    }
  }
  return "";
}

bool IdentityMatches(absl::string_view identity,
                     const std::vector<std::string>& names) {
  if (identity.empty()) return false;
  for (const std::string& name : names) {
    if (absl::EndsWith(name, "*")) {
      if (absl::StartsWith(
              identity, absl::string_view(name).substr(0, name.size() - 1))) {
        return true;
      }
    } else if (identity == name) {
      return true;
    }
  }
  return false;
}

absl::Status CheckPeerIdentity(const grpc::AuthContext& context,
                               absl::string_view method,
                               const std::vector<std::string>& names) {
  const std::string identity = PeerIdentity(context);
  if (identity.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat(method,
                     " needs a client certificate signed by the server's "
                     "--tls_ca; the call came without one"));
  }
  if (!IdentityMatches(identity, names)) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, " is refused to client certificate \"", identity,
                     "\": only ", absl::StrJoin(names, ", "), " may call it"));
  }
  return absl::OkStatus();
}

}  // namespace triax
