#include "kvmanager/manager_state.h"

#include "absl/strings/str_cat.h"

namespace triax::manager {

absl::Status ValidateModel(const ModelShape& m, absl::string_view f) {
  if (m.n_layers < 1 || m.n_layers > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ".n_layers ", m.n_layers, " is outside 1..1024"));
  }
  if (m.n_kv_heads < 1 || m.n_kv_heads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ".n_kv_heads ", m.n_kv_heads, " is outside 1..1024"));
  }
  if (m.n_q_heads == 0 || m.n_q_heads % m.n_kv_heads != 0 ||
      m.n_q_heads / m.n_kv_heads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        f, ".n_q_heads ", m.n_q_heads,
        " is not a positive multiple (at most 1024x) of n_kv_heads ",
        m.n_kv_heads));
  }
  if (m.head_dim < 2 || m.head_dim > 512 || m.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        f, ".head_dim ", m.head_dim, " is not an even number in 2..512"));
  }
  if (m.name.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        f, ".name is ", m.name.size(), " bytes long; the limit is 256"));
  }
  return absl::OkStatus();
}

}  // namespace triax::manager
