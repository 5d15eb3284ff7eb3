// Calibration of per-tag KV quantization sensitivity (the triaxial policy's
// D_k(f)): for each tag k = (temporal, modality, role) and each candidate
// encoding f, the attention-output distortion when only tag k's tokens are
// held in f and every other token in BF16. No gRPC or protobuf here
// (calibration_proto.h builds the CalibrationTable).
//
// Tags mirror the manager (kvmanager/manager_core.cc, docs/manager.md):
//   - Each turn's spans are cut into ceil(n / T) blocks (T = block_tokens);
//     a block never mixes spans, so a span's last block may be partial. The
//     BOS token joins the first span (as kvdemo opens its sequences).
//   - Block index 0 is TEMPORAL_SINK; blocks of the current turn are
//     CURRENT_TURN; of the `recent_turns` turns before it RECENT_TURNS; the
//     rest OLDER (TemporalFor, common/model.h).
//   - The current turn is the turn of the query being measured: a query in
//     turn t sees the plan the manager holds while turn t is processed.
//   - Role = the span's role; modality is always text here.
//
// Measurement (one conversation, after an exact fp32 forward pass whose K/V
// and sampled queries were captured by CaptureKvStore):
//   Reference K/V = the captured K/V rounded to BF16 (what a BF16 page
//   holds). For every block and candidate encoding f, the block's K/V go
//   through kernels::EncodePage / DecodePage (one page of `block.tokens`
//   tokens, shape {T, n_kv_heads, head_dim}). For every sampled query
//   position p, every layer and every query head, attention is computed over
//   tokens [0, p] with the reference K/V (o) and, for each tag k present and
//   each f, with tag k's tokens replaced by their round trip (o_kf). Softmax
//   is linear in the per-token terms, so o_kf is obtained from per-tag sums
//   of exp-weights and weighted values (double precision), in one pass per
//   encoding instead of one per (tag, encoding); calibration_test checks it
//   against kernels::DecodeAttentionRef over mixed-encoding pages.
//   Per (query, layer): err_kf = sum_heads ||o_kf - o||^2 / sum_heads ||o||^2
//   and share_k = (tokens of tag k in [0, p]) / (p + 1).
//   distortion_kf = sum err_kf / sum share_k, both sums over every measured
//   (query, layer) of every conversation (= mean error / mean share). The
//   reference is BF16, so BF16 has distortion 0 and the error of f is its
//   increase over BF16.
//
// Errors: INVALID_ARGUMENT for bad options (stride, encodings invalid for the
// shape, naming the field and value), for blocks that do not cover the
// captured tokens, or held-out ids; FAILED_PRECONDITION when a conversation
// has no sampled query.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "common/model.h"
#include "kernels/layout.h"

namespace triax::calibrate {

// One planned block: tokens [first, first + tokens), one span's role.
struct CalBlock {
  int64_t first = 0;
  int tokens = 0;
  Role role = Role::kUnspecified;
  Modality modality = Modality::kText;
  uint32_t turn = 0;
};

// The manager's blocks for `conv` rendered with `bos_tokens` leading BOS
// tokens (joined to the first span), cut per turn and span into blocks of
// at most `block_tokens` (1..4096) tokens. Token index = byte offset +
// bos_tokens. INVALID_ARGUMENT for block_tokens out of range or a
// conversation without turns.
absl::StatusOr<std::vector<CalBlock>> PlanBlocks(
    const frontend::RenderedConversation& conv, int bos_tokens,
    int block_tokens);

// The tag of every block when the current turn is `current`.
std::vector<Tag> TagBlocks(const std::vector<CalBlock>& blocks,
                           uint32_t current, uint32_t recent_turns);

// Encodings named as kernels::EncodingName writes them ("tq4",
// "k=tq4,v=tq3", "k=int4,v=int4,g=64"), separated by ';'. Empty text:
// DefaultEncodings(). INVALID_ARGUMENT naming the unknown or repeated name.
absl::StatusOr<std::vector<kernels::Encoding>> ParseEncodings(
    absl::string_view text);

// The model a calibration runs on: DATA_DIR/models/<name>/model.bin, a
// llama2.c checkpoint that reads the BFCL rendering's byte tokens (vocab >=
// ByteTokenizer's 260, as kvproxy-18m) with a context of at least
// `max_tokens`. INVALID_ARGUMENT naming --model for a name that is not an id
// ([A-Za-z0-9._:-]{1,128}: no path), FAILED_PRECONDITION for a vocabulary
// or context too small, the loader's NOT_FOUND / DATA_LOSS otherwise.
struct CalibrationModel {
  std::string name;
  std::string path;
  std::unique_ptr<frontend::Model> model;
};
absl::StatusOr<CalibrationModel> LoadCalibrationModel(
    const std::string& data_dir, const std::string& name, int max_tokens);

// BFCL conversations kept for evaluation (models/kvproxy-18m/README.md): the
// multi-turn base and long-context pairs 3, 8, 15, 17, 42, 46, 50, 59, 121,
// 177, 181 and memory_25, memory_98, memory_143, memory_154.
const std::vector<std::string>& HeldOutIds();
// INVALID_ARGUMENT when `ids` is empty, holds a duplicate or a held-out id
// (the message names the id and says why).
absl::Status CheckCalibrationIds(const std::vector<std::string>& ids);

// A KvStore that forwards everything to an inner store (normally
// LocalKvStore: activations stay exact) and keeps a copy of every written
// K/V (fp32, [pos][kv_dim] per layer) and of the queries at sampled
// positions: p >= first_query and (p - first_query) % query_stride == 0.
// Thread-compatible (one forward pass at a time); `inner` is not owned.
class CaptureKvStore : public frontend::KvStore {
 public:
  CaptureKvStore(frontend::KvStore* inner, const frontend::ModelConfig& config,
                 int64_t first_query, int query_stride);

  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override;
  absl::Status Attend(int layer, int n_queries, const int64_t* positions,
                      const float* q, float* out) override;

  int64_t tokens() const { return static_cast<int64_t>(positions_.size()); }
  const std::vector<float>& k(int layer) const { return k_[layer]; }
  const std::vector<float>& v(int layer) const { return v_[layer]; }
  // Sampled positions in increasing order (recorded from layer 0).
  const std::vector<int64_t>& query_positions() const { return qpos_; }
  // [query_positions().size()][q_dim] for `layer`.
  const std::vector<float>& queries(int layer) const { return q_[layer]; }

 private:
  bool Sampled(int64_t p) const {
    return p >= first_query_ && (p - first_query_) % stride_ == 0;
  }
  frontend::KvStore* inner_;
  int kv_dim_, q_dim_;
  int64_t first_query_;
  int stride_;
  std::vector<std::vector<float>> k_, v_, q_;
  std::vector<int64_t> qpos_;
  std::vector<int64_t> positions_;  // written positions of layer 0
};

struct CalibratorOptions {
  int block_tokens = 16;
  uint32_t recent_turns = 2;
  std::vector<kernels::Encoding> encodings;  // candidates (BF16 included)
  int threads = 1;                           // 1..64
};

// INVALID_ARGUMENT (naming the field and value) unless block_tokens is in
// 1..4096, threads in 1..64, and `encodings` is non-empty, without
// duplicates and valid for {block_tokens, n_kv_heads, head_dim}. Shared by
// Calibrator and OutputCalibrator.
absl::Status ValidateCalibrationOptions(
    const frontend::ModelConfig& config, int block_tokens, int threads,
    const std::vector<kernels::Encoding>& encodings);

// The default candidates (20): bf16, fp8, int8, int4, int2, tq4, tq3, tq2,
// k=int4/v=int2, k=int8/v=int4 (INT groups 32, FP16 scales), the six TQ K/V
// pairs (k=tq4/v=tq3, k=tq4/v=tq2, k=tq3/v=tq4, k=tq3/v=tq2, k=tq2/v=tq4,
// k=tq2/v=tq3) and INT4 and INT2 with groups 64 and 128.
std::vector<kernels::Encoding> DefaultEncodings();

struct CalibrationResultEntry {
  Tag tag;
  kernels::Encoding encoding;
  double distortion = 0;  // see the file comment
  // Output metric only (output_calibration.h): KL per share over answer
  // positions, and dNLL per share over all / answer positions.
  double distortion_answer = 0;
  double dnll = 0;
  double dnll_answer = 0;
  double mean_error = 0;  // sum err / measured (query, layer) samples
  double mean_share = 0;  // sum share / measured (query, layer) samples
  uint64_t tokens = 0;    // token positions that carried the tag
  uint64_t queries = 0;   // query positions that attended to the tag
};

// Accumulates distortions over conversations. Thread-compatible; each
// AddConversation spreads its work over `threads` std::threads internally.
class Calibrator {
 public:
  // INVALID_ARGUMENT: block_tokens outside 1..4096, threads outside 1..64,
  // no encodings, a duplicate encoding, or one invalid for the shape
  // ({block_tokens, n_kv_heads, head_dim}; message names it and why).
  static absl::StatusOr<Calibrator> Create(const frontend::ModelConfig& config,
                                           CalibratorOptions options);

  // Measures one conversation captured by `capture` (all layers written)
  // with its planned `blocks` (which must cover exactly tokens
  // [0, capture.tokens()) in order: INVALID_ARGUMENT otherwise).
  // FAILED_PRECONDITION when no query position was sampled.
  absl::Status AddConversation(const std::vector<CalBlock>& blocks,
                               const CaptureKvStore& capture);

  // One entry per (tag with tokens, encoding), tags in Tag order and
  // encodings in option order.
  std::vector<CalibrationResultEntry> Entries() const;
  int64_t measured_queries() const { return measured_queries_; }
  const CalibratorOptions& options() const { return options_; }

 private:
  struct TagAcc {
    double sum_share = 0;
    uint64_t tokens = 0;
    uint64_t queries = 0;
    std::vector<double> sum_err;  // per encoding
  };
  Calibrator(const frontend::ModelConfig& config, CalibratorOptions options)
      : config_(config), options_(std::move(options)) {}

  frontend::ModelConfig config_;
  CalibratorOptions options_;
  std::map<Tag, TagAcc> acc_;
  int64_t measured_queries_ = 0;  // query positions
  int64_t measured_samples_ = 0;  // (query, layer) pairs
};

}  // namespace triax::calibrate
