// Output-effect calibration of per-tag KV quantization (kvcalibrate
// --metric=output): D_k(f) as the effect on the model's next-token
// distribution when tag k's blocks alone are held in encoding f, measured by
// teacher-forced forward passes through a KvStore that quantizes sealed
// blocks the way the service does. No gRPC or protobuf here.
//
// Blocks and tags are calibration.h's (PlanBlocks / TagBlocks): a query in
// turn t sees the tags of the plan the manager holds while turn t runs.
//
// Schedule (as policy_bench feeds the service): each turn is prefilled in
// chunks of `chunk` tokens starting at the turn's first token. A block is
// sealed once all its tokens are written (the worker with window_tokens 0
// seals a block as soon as its last token arrives), so a query in a chunk
// reads, for every block whose end is <= the chunk's end, the block's
// encoded form, and BF16 for the others.
//
// FakeQuantKvStore keeps every written K/V rounded to BF16 (what a BF16 page
// holds) and, for each sealed block, its kernels::EncodePage / DecodePage
// round trip (one page of the block's tokens, shape {block_tokens,
// n_kv_heads, head_dim}) in every encoding the allocation may ask of it. A
// query at position p of turn t reads, per block, the round trip in
// allocation[tag of the block relative to t] when the block is sealed and
// the tag is in the allocation, BF16 otherwise. Later layers and tokens see
// the perturbed activations, as in the service.
//
// Measurement per logit position p (0 <= p < n - 1, predicting token p + 1):
//   KL(p)   = KL(P_ref(.|p) || P_alloc(.|p)) in nats,
//   dNLL(p) = NLL_alloc(token p+1) - NLL_ref(token p+1),
//   share_k(p) = (tokens of sealed tag-k blocks in [0, p]) / (p + 1),
// P_ref from the same store with an empty allocation (all BF16). Answer
// positions: token p + 1 has role ASSISTANT or TOOL_CALL.
// Entry (k, f): distortion = sum_p KL / sum_p share_k over all positions of
// all conversations, where only tag k is held in f; distortion_answer the
// same over answer positions; dnll / dnll_answer = sum dNLL / sum share_k.
// So sum_k mean(share_k) * D_k(f_k) predicts the mean KL of an allocation
// that holds several tags in several encodings.
//
// Errors: INVALID_ARGUMENT for bad options or inputs (field and value
// named); the KvStore's OUT_OF_RANGE / INVALID_ARGUMENT like LocalKvStore's.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/calibrate/calibration.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/forward.h"
#include "common/model.h"
#include "kernels/layout.h"

namespace triax::calibrate {

// Tag -> encoding; tags not listed stay BF16 (a BF16 entry is the same).
using Allocation = std::map<Tag, kernels::Encoding>;

// One conversation with its block plan and the per-position bookkeeping
// the passes need. Immutable after PrepareOutputConversation; share freely.
struct OutputConversation {
  struct Chunk {
    int64_t first = 0;
    int tokens = 0;
    uint32_t turn = 0;
    int sealed_blocks = 0;  // blocks with end <= first + tokens
  };
  std::string id;
  std::vector<int> tokens;       // BOS + bytes
  std::vector<CalBlock> blocks;  // cover tokens exactly, in order
  std::vector<Chunk> chunks;     // the prefill schedule, in order
  uint32_t recent_turns = 2;
  int block_tokens = 16;
  // Tags present at some position (sorted), and per logit position p in
  // [0, n - 1): share[p * tags.size() + i] = share of tags[i] (see above).
  std::vector<Tag> tags;
  std::vector<double> share;
  std::vector<uint8_t> answer;  // [n - 1]: token p + 1 is ASSISTANT/TOOL_CALL
  std::vector<int> chunk_of;    // [n]: index into chunks

  int64_t positions() const { return static_cast<int64_t>(tokens.size()) - 1; }
  // Tag of block b for a query in turn `turn`.
  Tag TagOf(int b, uint32_t turn) const;
  // First token of the first chunk in which some query reads a block in a
  // non-BF16 encoding under `alloc` (tokens.size() when none does): every
  // pass agrees with the reference before it.
  int64_t FirstPerturbed(const Allocation& alloc) const;
};

// Plans `tokens` (bos_tokens leading BOS, then one token per byte of
// conv.text) into blocks, chunks, per-position shares and answer positions.
// INVALID_ARGUMENT for block_tokens outside 1..4096, chunk < 1, fewer than 2
// tokens, or a conversation whose spans do not cover the tokens.
absl::StatusOr<OutputConversation> PrepareOutputConversation(
    const frontend::RenderedConversation& conv, const std::vector<int>& tokens,
    int bos_tokens, int block_tokens, uint32_t recent_turns, int chunk);

// See the file comment. Thread-compatible; `conv` must outlive the store.
class FakeQuantKvStore : public frontend::KvStore {
 public:
  // INVALID_ARGUMENT when an encoding of `alloc` is invalid for the shape.
  static absl::StatusOr<std::unique_ptr<FakeQuantKvStore>> Create(
      const frontend::ModelConfig& config, const OutputConversation* conv,
      const Allocation& alloc);

  // Copies the BF16 K/V of tokens [0, n) of every layer from `other` (same
  // conversation and shape, all layers written past n) and seals what is
  // complete; then writes continue at n.
  absl::Status CopyPrefix(const FakeQuantKvStore& other, int64_t n);

  // INVALID_ARGUMENT: bad layer, n < 1, a hole, or a write past the
  // conversation's tokens.
  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override;
  // OUT_OF_RANGE: a position not yet written; INVALID_ARGUMENT: bad layer.
  absl::Status Attend(int layer, int n_queries, const int64_t* positions,
                      const float* q, float* out) override;

  int64_t written(int layer) const { return written_[layer]; }
  int sealed_blocks(int layer) const { return sealed_[layer]; }
  // Encoded reads so far (block reads by one query head), for tests.
  int64_t quantized_reads() const { return quantized_reads_; }

 private:
  FakeQuantKvStore(const frontend::ModelConfig& config,
                   const OutputConversation* conv)
      : config_(config), conv_(conv) {}
  void Seal(int layer);

  frontend::ModelConfig config_;
  const OutputConversation* conv_;
  std::vector<kernels::Encoding> encodings_;  // distinct non-BF16 encodings
  // enc_[turn * blocks + b]: index into encodings_, -1 for BF16.
  std::vector<int> enc_;
  std::vector<std::vector<int>> block_encs_;  // per block: encodings needed
  std::vector<std::vector<float>> k_, v_;     // [layer][pos][kv_dim], BF16
  // [encoding][layer][pos][kv_dim]: round trips of sealed blocks.
  std::vector<std::vector<std::vector<float>>> dk_, dv_;
  std::vector<int64_t> written_;
  std::vector<int> sealed_;
  std::vector<float> scores_;
  std::vector<uint16_t> kb_, vb_;
  std::vector<uint8_t> page_;
  int64_t quantized_reads_ = 0;
};

// Logits of one pass: [n][vocab].
struct PassResult {
  std::vector<float> logits;
  double seconds = 0;
  int64_t first_computed = 0;  // first token run through the model
};

// One teacher-forced pass of `conv` under `alloc`. With `reference` (the
// all-BF16 pass's store and logits), tokens before alloc's FirstPerturbed
// chunk are copied from it instead of recomputed (the results are the same).
absl::StatusOr<PassResult> RunPass(frontend::Transformer* tf,
                                   const OutputConversation& conv,
                                   const Allocation& alloc,
                                   const FakeQuantKvStore* reference_store,
                                   const std::vector<float>* reference_logits,
                                   std::unique_ptr<FakeQuantKvStore>* store);

// Per logit position: KL(ref || test) in nats and the dNLL of the next
// token. Sizes conv.positions().
struct PositionEffects {
  std::vector<double> kl, dnll;
};
PositionEffects CompareLogits(const OutputConversation& conv, int vocab,
                              const std::vector<float>& ref_logits,
                              const std::vector<float>& logits);

// Means over a conversation's positions (all, and answer positions).
struct EffectMeans {
  double kl = 0, dnll = 0, kl_answer = 0, dnll_answer = 0;
  int64_t positions = 0, answer_positions = 0;
};

struct OutputCalibratorOptions {
  int block_tokens = 16;
  uint32_t recent_turns = 2;
  int chunk = 64;
  std::vector<kernels::Encoding> encodings;  // candidates (BF16 skipped)
  int threads = 1;                           // 1..64
};

// Progress of one pass: conversation id, tag, encoding, pass seconds,
// passes done and total for the conversation. The reference pass reports
// done = 0 with an unspecified tag and BF16.
using PassProgress = std::function<void(const std::string& id, const Tag& tag,
                                        const kernels::Encoding& e,
                                        double seconds, int done, int total)>;

// Accumulates output-effect distortions over conversations.
// Thread-compatible; AddConversation runs its passes on `threads` threads,
// each with its own Transformer and store (`model` is shared read-only).
class OutputCalibrator {
 public:
  // INVALID_ARGUMENT: block_tokens outside 1..4096, chunk < 1, threads
  // outside 1..64, no encodings, a duplicate, or one invalid for the shape.
  static absl::StatusOr<OutputCalibrator> Create(
      const frontend::ModelConfig& config, OutputCalibratorOptions options);

  // The reference pass and one pass per (tag present, non-BF16 encoding).
  // `conv` must be planned with the same block_tokens, recent_turns, chunk,
  // and not measured already (INVALID_ARGUMENT naming its id).
  absl::Status AddConversation(const frontend::Model& model,
                               const OutputConversation& conv,
                               const PassProgress& progress = nullptr);

  // One entry per (tag with tokens, encoding), tags in Tag order and
  // encodings in option order; BF16 entries are 0. tokens = tag tokens over
  // conversations (each counted once); queries = positions with share > 0.
  std::vector<CalibrationResultEntry> Entries() const;
  int64_t positions() const { return positions_; }
  // Conversations measured (AddConversation or AddSums), in order, and
  // their tokens.
  const std::vector<std::string>& conversation_ids() const { return ids_; }
  int64_t tokens() const { return tokens_; }

  // The accumulated sums as text, so that conversations measured by
  // separate runs (e.g. one per device call) merge into one table:
  //   kvcalibrate-output-sums 1
  //   options <block_tokens> <recent_turns> <chunk>
  //   encodings <name> ...            (kernels::EncodingName, option order)
  //   positions <n>
  //   conversation <id> <tokens>      (one per conversation)
  //   tag <temporal> <modality> <role> <share> <share_answer> <tokens>
  //       <queries> then per encoding kl, then kl_answer, dnll, dnll_answer
  // (one line per tag; enums as their proto numbers, doubles with 17
  // significant digits, so a merge reproduces a single run's table).
  std::string SaveSums() const;
  // Adds sums written by SaveSums. INVALID_ARGUMENT naming `name` and the
  // line for a malformed line, other options or encodings than this
  // calibrator's, or a conversation already measured; nothing is added
  // then.
  absl::Status AddSums(absl::string_view text, absl::string_view name);
  const OutputCalibratorOptions& options() const { return options_; }

 private:
  struct TagAcc {
    double share = 0, share_answer = 0;
    uint64_t tokens = 0, queries = 0;
    // Per encoding: sums of KL and dNLL (all and answer positions).
    std::vector<double> kl, kl_answer, dnll, dnll_answer;
  };
  OutputCalibrator(const frontend::ModelConfig& config,
                   OutputCalibratorOptions options)
      : config_(config), options_(std::move(options)) {}

  frontend::ModelConfig config_;
  OutputCalibratorOptions options_;
  std::map<Tag, TagAcc> acc_;
  int64_t positions_ = 0;
  std::vector<std::string> ids_;
  std::vector<int64_t> conv_tokens_;  // per entry of ids_
  int64_t tokens_ = 0;
};

// Means of `effects` over the conversation's positions (all and answer).
EffectMeans MeanEffects(const OutputConversation& conv,
                        const PositionEffects& effects);

}  // namespace triax::calibrate
