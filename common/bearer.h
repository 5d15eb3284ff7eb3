// Bearer tokens on the client side (docs/security.md): the file a token is
// kept in, and the metadata a call carries it in.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class ClientContext;
}

namespace triax {

// The token in `path` (surrounding whitespace ignored): INVALID_ARGUMENT
// naming `flag` and the path when it cannot be read or is empty. The token
// itself is never in a message.
absl::StatusOr<std::string> ReadBearerToken(absl::string_view flag,
                                            const std::string& path);

// Adds "authorization: Bearer <token>" to the call; nothing when empty.
void AddBearer(grpc::ClientContext* ctx, const std::string& token);

}  // namespace triax
