#include "common/local_socket.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/ids.h"

namespace triax {
namespace {

constexpr absl::string_view kScheme = "unix:";

// True when a process accepts connections on the socket at `path`.
bool SomeoneListens(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const bool connected =
      connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return connected;
}

}  // namespace

bool IsUnixAddress(absl::string_view address) {
  return absl::StartsWith(address, kScheme);
}

std::string UnixSocketPath(absl::string_view address) {
  absl::string_view rest = address.substr(kScheme.size());
  // unix:///abs/path is the URI form of unix:/abs/path.
  if (absl::StartsWith(rest, "//")) rest.remove_prefix(2);
  return std::string(rest);
}

absl::Status CheckLocalListen(absl::string_view flag, absl::string_view value) {
  const std::string what = absl::StrCat("--", flag, "=", Quote(value));
  if (!IsUnixAddress(value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        " is not a Unix-domain socket address; want unix:/ABSOLUTE/PATH"));
  }
  const std::string path = UnixSocketPath(value);
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " names no absolute path; want unix:/ABSOLUTE/PATH"));
  }
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the path is ", path.size(),
                     " bytes; a socket path holds at "
                     "most ",
                     sizeof(sockaddr_un::sun_path) - 1));
  }
  const std::string dir = path.substr(0, path.rfind('/'));
  struct stat st {};
  if (!dir.empty() && (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the directory ", Quote(dir), " does not exist"));
  }
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": ", Quote(path), " exists and is not a socket"));
    }
    if (SomeoneListens(path)) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": another process serves on ", Quote(path)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<mode_t> ParseSocketMode(absl::string_view flag,
                                       absl::string_view value) {
  const absl::string_view v = absl::StripAsciiWhitespace(value);
  uint32_t mode = 0;
  bool ok = !v.empty() && v.size() <= 4;
  for (char c : v) {
    ok = ok && c >= '0' && c <= '7';
    mode = mode * 8 + static_cast<uint32_t>(c - '0');
  }
  if (!ok || mode > 0777) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", Quote(value),
                     " is not an octal file mode of at most 0777 (e.g. 0660)"));
  }
  return static_cast<mode_t>(mode);
}

absl::Status RestrictSocket(absl::string_view address, mode_t mode) {
  const std::string path = UnixSocketPath(address);
  if (chmod(path.c_str(), mode) != 0) {
    return absl::InternalError(absl::StrFormat("chmod \"%s\" to %04o: %s", path,
                                               mode, std::strerror(errno)));
  }
  return absl::OkStatus();
}

void RemoveSocket(absl::string_view address) {
  if (!IsUnixAddress(address)) return;
  const std::string path = UnixSocketPath(address);
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    unlink(path.c_str());
  }
}

std::shared_ptr<grpc::ServerCredentials> LocalSocketServerCredentials() {
  return grpc::experimental::LocalServerCredentials(UDS);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(
    absl::string_view address,
    const std::shared_ptr<grpc::ChannelCredentials>& tcp) {
  if (IsUnixAddress(address)) return grpc::experimental::LocalCredentials(UDS);
  return tcp != nullptr ? tcp : grpc::InsecureChannelCredentials();
}

}  // namespace triax
