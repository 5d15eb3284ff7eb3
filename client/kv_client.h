// C++ client library for inference frontends: one object that talks to the
// manager (plans, budgets) and to the worker a sequence is placed on (KV
// bytes, attention). Thread-compatible: use one Client per thread, or guard it.
//
// Every method returns absl::Status / StatusOr with the server's canonical
// code and message. Mutating calls get a fresh request id per call and are
// retried once on UNAVAILABLE with the same id (safe: servers are idempotent).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "triax/v1/manager.grpc.pb.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::client {

struct ClientOptions {
  std::string manager_address;  // host:port
  std::string tenant_id;
  int64_t rpc_timeout_ms = 30000;
};

// A sequence opened through the client: its plan and the worker it lives on.
struct SequenceHandle {
  std::string sequence_id;
  std::string worker_address;
  triax::v1::ModelShape model;
  uint32_t block_tokens = 0;
  std::vector<triax::v1::BlockPlan> blocks;  // current plan
  uint64_t num_tokens = 0;                   // planned tokens
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // Manager-side plan + worker-side page allocation, in one call.
  absl::StatusOr<SequenceHandle> Open(const triax::v1::ModelShape& model,
                                      const std::vector<triax::v1::Span>& spans,
                                      const std::string& policy = "",
                                      uint32_t block_tokens = 0);
  // Plans more tokens (a new turn, or decoded tokens) and allocates them.
  absl::Status Extend(SequenceHandle* seq, const std::vector<triax::v1::Span>& spans,
                      bool new_turn, bool continue_last_span);
  absl::StatusOr<SequenceHandle> Fork(const SequenceHandle& parent, uint64_t num_tokens);
  absl::Status Close(const SequenceHandle& seq);

  // Writes K/V for tokens [first_token, first_token + num_tokens) of `layer`.
  // k, v: float32 [num_tokens][n_kv_heads][head_dim]; sent as BF16.
  absl::Status WriteKV(const SequenceHandle& seq, uint32_t layer, uint64_t first_token,
                       uint32_t num_tokens, const float* k, const float* v);
  // Attention for `num_queries` queries of `layer`; query i attends to tokens
  // [0, positions[i]]. q, out: float32 [num_queries][n_q_heads][head_dim].
  // When append_k/append_v are given, tokens [append_first, append_first +
  // append_tokens) are written first in the same RPC.
  struct AttendArgs {
    uint32_t layer = 0;
    uint32_t num_queries = 1;
    const uint64_t* positions = nullptr;
    const float* q = nullptr;
    float* out = nullptr;
    const float* append_k = nullptr;
    const float* append_v = nullptr;
    uint64_t append_first = 0;
    uint32_t append_tokens = 0;
  };
  absl::Status Attend(const SequenceHandle& seq, const AttendArgs& args);
  // Reads back K/V as float32 [num_tokens][n_kv_heads][head_dim].
  absl::Status ReadKV(const SequenceHandle& seq, uint32_t layer, uint64_t first_token,
                      uint32_t num_tokens, std::vector<float>* k, std::vector<float>* v);

  triax::v1::Manager::Stub* manager() { return manager_.get(); }
  // Stub for a worker address (cached).
  absl::StatusOr<triax::v1::Worker::Stub*> worker(const std::string& address);
  const ClientOptions& options() const { return options_; }

 private:
  // ... implementation-defined members
  ClientOptions options_;
  std::unique_ptr<triax::v1::Manager::Stub> manager_;
};

}  // namespace triax::client
