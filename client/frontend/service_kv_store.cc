#include "client/frontend/service_kv_store.h"

#include "absl/strings/str_cat.h"

namespace triax::frontend {

ServiceKvStore::ServiceKvStore(client::Client* client,
                               const client::SequenceHandle* seq,
                               int n_kv_heads, int head_dim)
    : client_(client), seq_(seq), kv_dim_(n_kv_heads * head_dim) {}

absl::Status ServiceKvStore::Write(int layer, int64_t first_pos, int n,
                                   const float* k, const float* v) {
  if (staged_) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV for layer ", staged_layer_,
                     " is staged and not yet sent; write for "
                     "layer ",
                     layer, " must follow an Attend"));
  }
  if (n < 1 || first_pos < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("write of n = ", n, " tokens at first_pos = ", first_pos));
  }
  staged_ = true;
  staged_layer_ = layer;
  staged_first_ = first_pos;
  staged_n_ = n;
  staged_k_.assign(k, k + static_cast<size_t>(n) * kv_dim_);
  staged_v_.assign(v, v + static_cast<size_t>(n) * kv_dim_);
  return absl::OkStatus();
}

absl::Status ServiceKvStore::Attend(int layer, int n_queries,
                                    const int64_t* positions, const float* q,
                                    float* out) {
  client::Client::AttendArgs args;
  args.layer = static_cast<uint32_t>(layer);
  args.num_queries = static_cast<uint32_t>(n_queries);
  positions_.assign(positions, positions + n_queries);
  args.positions = positions_.data();
  args.q = q;
  args.out = out;
  if (staged_) {
    if (staged_layer_ != layer) {
      return absl::FailedPreconditionError(
          absl::StrCat("attend on layer ", layer, " while KV of layer ",
                       staged_layer_, " is staged"));
    }
    args.append_k = staged_k_.data();
    args.append_v = staged_v_.data();
    args.append_first = static_cast<uint64_t>(staged_first_);
    args.append_tokens = static_cast<uint32_t>(staged_n_);
  }
  staged_ = false;
  ++rpcs_;
  return client_->Attend(*seq_, args);
}

}  // namespace triax::frontend
