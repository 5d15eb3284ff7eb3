// KvStore backed by the KV service: a sequence opened through
// triax::client::Client holds the K/V on a worker, which also runs attention.
//
// One Attend RPC per layer per chunk: Write() only stages the chunk's K/V and
// the following Attend() for the same layer sends them in the RPC's append
// fields, before the queries. The caller keeps the sequence's plan ahead of
// the tokens it writes (Client::Open / Client::Extend).
//
// Errors: whatever the client returns (the service's canonical codes);
// FAILED_PRECONDITION when Attend() comes for another layer than the staged
// write, or a write is staged twice.
// Thread contract: thread-compatible, like the Client it uses.
#pragma once

#include <cstdint>
#include <vector>

#include "client/frontend/forward.h"
#include "client/kv_client.h"

namespace triax::frontend {

class ServiceKvStore : public KvStore {
 public:
  // `client` and `seq` are not owned and must outlive this object.
  ServiceKvStore(client::Client* client, const client::SequenceHandle* seq,
                 int n_kv_heads, int head_dim);

  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override;
  absl::Status Attend(int layer, int n_queries, const int64_t* positions,
                      const float* q, float* out) override;

  int64_t rpcs() const { return rpcs_; }

 private:
  client::Client* client_;
  const client::SequenceHandle* seq_;
  int kv_dim_;
  bool staged_ = false;
  int staged_layer_ = -1;
  int64_t staged_first_ = 0;
  int staged_n_ = 0;
  std::vector<float> staged_k_, staged_v_;
  std::vector<uint64_t> positions_;
  int64_t rpcs_ = 0;
};

}  // namespace triax::frontend
