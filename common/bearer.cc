#include "common/bearer.h"

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace triax {

absl::StatusOr<std::string> ReadBearerToken(absl::string_view flag,
                                            const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": cannot be read"));
  }
  std::stringstream text;
  text << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(text.str()));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": holds no token"));
  }
  return token;
}

void AddBearer(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

}  // namespace triax
