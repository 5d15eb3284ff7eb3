// Metrics and configurations of the KV quality benchmark (quality_bench).
// Plain C++: no gRPC or protobuf.
//
// Next-token metrics compare a configuration's logits with the reference
// logits (the BF16-KV run) at the same positions:
//   NLL    -log softmax(logits)[target], nats, mean over predicted tokens;
//   top-1  fraction of positions where argmax(logits) == argmax(reference)
//          (first index on ties, as run.c);
//   KL     KL(P_ref || P_cfg) = sum_i p_i (log p_i - log q_i), nats, mean.
// All computed in double from float logits.
//
// Thread contract: free functions are thread-safe; NextTokenStats is a plain
// value (thread-compatible).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/layout.h"

namespace triax::bench {

// KL(softmax(p) || softmax(q)) in nats over `vocab` logits.
double KlDivergence(const float* p_logits, const float* q_logits, int vocab);

struct NextTokenStats {
  double nll_sum = 0;
  int64_t count = 0;
  int64_t top1_agree = 0;
  double kl_sum = 0;
  // The same NLL restricted to "focus" positions (BFCL tool-call tokens).
  double focus_nll_sum = 0;
  int64_t focus_count = 0;

  // One predicted position: `logits` (this configuration) and `ref_logits`
  // (the reference), both [vocab]; `target` is the true next token.
  void Add(const float* ref_logits, const float* logits, int vocab, int target,
           bool focus);
  // Every predicted position of one forward pass from position 0: token t
  // (t >= 1) is predicted by row t - 1 of `ref_logits` and `logits`
  // ([rows][vocab], at least tokens.size() - 1 rows each) and counts as
  // focus when focus[t]. INVALID_ARGUMENT (nothing added) when vocab < 1,
  // focus.size() != tokens.size() or a logits vector is short.
  absl::Status AddSequence(const std::vector<float>& ref_logits,
                           const std::vector<float>& logits, int vocab,
                           const std::vector<int>& tokens,
                           const std::vector<bool>& focus);
  void Merge(const NextTokenStats& o);
  double nll() const { return count ? nll_sum / count : 0.0; }
  double top1() const {
    return count ? static_cast<double>(top1_agree) / count : 0.0;
  }
  double kl() const { return count ? kl_sum / count : 0.0; }
  double focus_nll() const {
    return focus_count ? focus_nll_sum / focus_count : 0.0;
  }
};

// Stored bits per K/V value: bytes * 8 / (2 * tokens * layers * heads *
// head_dim); 0 when any count is 0.
double BitsPerValue(uint64_t bytes, uint64_t tokens, int layers, int heads,
                    int head_dim);

// One KV configuration: the bulk encoding, an optional BF16 recent window
// (the worker keeps the last `window` tokens in BF16 pages, KIVI's residual)
// and optional BF16 sink tokens (the sequence's first block, via a
// `temporal=SINK -> bf16` policy rule ahead of the catch-all rule).
struct QualityConfig {
  std::string name;  // e.g. "int4", "k-int4.v-int2", "int2.w32.sink"
  kernels::Encoding enc;
  uint32_t window = 0;
  bool sink = false;
  bool core = false;       // in the "core" set (the default on kvproxy-18m)
  std::string group_note;  // which family of the report it belongs to

  // "q-" + name: a valid policy name ([A-Za-z0-9._:-]{1,128}).
  std::string policy() const { return "q-" + name; }
};

// Every configuration the benchmark knows, in report order. The first is
// "bf16" (the reference). Names are unique.
const std::vector<QualityConfig>& AllConfigs();

// Selects configurations by `spec`: "all", "core", or a comma-separated list
// of names. "bf16" is always included (first) since every metric is relative
// to it. INVALID_ARGUMENT naming `flag` and the unknown name otherwise.
absl::StatusOr<std::vector<QualityConfig>> SelectConfigs(
    const std::string& flag, const std::string& spec);

}  // namespace triax::bench
