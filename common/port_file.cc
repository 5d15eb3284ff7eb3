#include "common/port_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace triax {

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat("port file ", tmp, ": ", std::strerror(errno)));
  }
  const bool written = std::fprintf(f, "%d\n", port) > 0;
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat(
        "port file ", tmp, ": ", std::strerror(written ? errno : write_errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("port file ", path, ": rename: ", std::strerror(e)));
  }
  return absl::OkStatus();
}

}  // namespace triax
