// SequencePlanner: how a sequence's tokens become blocks, and which tag and
// encoding each block gets. Plans only: ManagerCore creates the blocks.
//
// Blocks. With block_tokens = T, each span is cut into ceil(n/T) blocks; a
// block never mixes spans, so a span's last block may be partial (the free
// slots are the "partial-block waste"). Extend with continue_last_span puts
// the first span's tokens into the last block's free slots when role and
// modality match and the block is exclusively held, idle and on the device
// (shared blocks are immutable; moved ones belong to the pressure path).
//
// Tags. Temporal class (TemporalFor): the sequence's first block is SINK,
// blocks of the newest turn CURRENT_TURN, of the `recent_turns` turns before
// it RECENT_TURNS, the rest OLDER. Open is turn 0 (rendered text may start
// later turns: its last span's turn is current); Extend with new_turn starts
// the next one. A block grown by continue_last_span joins the turn of the
// span that grew it. When the current turn moves from prev to turn, only
// blocks of turn prev and of the turns leaving the recent window change
// class, so retagging visits O(changed) blocks (ForEachRetag).
//
// Encodings. Rule policies: the first matching rule of the sequence's
// policy (policy.h). Allocation policies: the allocator (allocator.h Solve)
// picks one encoding per tag over the sequence's tags (Allocate; see
// manager_core.h "Allocation policies").
//
// Error codes: INVALID_ARGUMENT naming the field and value (spans, rendered
// text through the tagger, block_tokens, the kMaxSequence* limits,
// num_tokens of a fork, an allocation candidate), FAILED_PRECONDITION (a
// fork of blocks that are not all in the device pool), RESOURCE_EXHAUSTED
// (an allocation whose cheapest options exceed the budget, unless
// allow_infeasible).
//
// Thread contract: immutable after construction, so thread-safe; Plan*
// functions that read a SequenceRecord need ManagerCore::mu_ held for that
// record (PlanOpen reads none and runs before the lock).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/policy.h"
#include "kvmanager/tagger.h"
#include "kvmanager/types.h"

namespace triax::manager {

// One block to create.
struct PlannedBlock {
  uint64_t first_token;
  uint32_t num_tokens;
  Role role;
  Modality modality;
  uint32_t turn = 0;  // absolute turn
};

// A block's tag at creation and its tokens, one per planned block.
using BlockTags = std::vector<std::pair<Tag, uint32_t>>;

// A distinct tag and its tokens (an allocation group).
struct TagTokens {
  Tag tag;
  int64_t tokens = 0;
};

struct OpenPlan {
  std::vector<PlannedBlock> blocks;
  BlockTags tags;
  uint32_t last_turn = 0;  // the current turn after Open
};

struct ExtendPlan {
  uint32_t prev_turn = 0;   // the current turn before the Extend
  uint32_t first_turn = 0;  // the turn of the first span
  uint32_t turn = 0;        // the current turn after it
  uint32_t fill = 0;  // tokens of the first span that go into the last block
  std::vector<PlannedBlock> blocks;  // new blocks
  BlockTags tags;                    // of the new blocks
};

struct ForkPlan {
  size_t shared = 0;           // whole blocks shared with the parent
  BlockRecord* cut = nullptr;  // the block num_tokens cuts: copied
  uint64_t num_tokens = 0;     // of the child
  uint32_t kept() const {
    return static_cast<uint32_t>(shared + (cut ? 1 : 0));
  }
};

class SequencePlanner {
 public:
  explicit SequencePlanner(uint32_t recent_turns)
      : recent_turns_(recent_turns) {}

  // --- Spans ---------------------------------------------------------------
  // Checks spans (non-empty; each with a role, a valid modality, >= 1
  // token; turn offsets non-decreasing and at most one turn per token) and
  // returns their total token count.
  static absl::StatusOr<uint64_t> ValidateSpans(const std::vector<Span>& spans);
  // The spans of a request: its explicit spans, or the tagger's spans of its
  // rendered text (into *storage). Exactly one of them must be given.
  static absl::StatusOr<const std::vector<Span>*> RequestSpans(
      const std::vector<Span>& spans,
      const std::optional<RenderedText>& rendered, TurnNumbering numbering,
      std::vector<Span>* storage);

  // --- Plans ---------------------------------------------------------------
  // The blocks of a new sequence of `total` tokens (ValidateSpans) at
  // block_tokens T. INVALID_ARGUMENT: T above kMaxBlockTokens, total above
  // kMaxSequenceTokens, more than kMaxSequenceBlocks blocks.
  absl::StatusOr<OpenPlan> PlanOpen(const std::vector<Span>& spans,
                                    uint64_t total, uint32_t T) const;
  // The new blocks of an Extend of `s` by spans of `total` tokens.
  // INVALID_ARGUMENT past kMaxSequenceTokens or kMaxSequenceBlocks.
  absl::StatusOr<ExtendPlan> PlanExtend(const SequenceRecord& s,
                                        const std::vector<Span>& spans,
                                        uint64_t total, bool new_turn,
                                        bool continue_last_span) const;
  // Applies the turn bookkeeping of `p` to `s`: the new current turn and
  // its turn starts (the new blocks are appended next), and the grown last
  // block's tokens and turn. Tags are left to ForEachRetag.
  void AdvanceTurns(SequenceRecord* s, const ExtendPlan& p) const;
  // Calls f(block, new class) for every existing block of `s` whose
  // temporal class changes when the current turn moves from `prev` to
  // `turn` (blocks of turn prev and of turns leaving the recent window).
  void ForEachRetag(const SequenceRecord& s, uint32_t prev, uint32_t turn,
                    absl::FunctionRef<void(BlockRecord*, Temporal)> f) const;
  // The temporal class of `b` when `current` is the newest turn.
  Temporal TemporalOf(const BlockRecord& b, uint32_t current) const {
    return TemporalFor(b.index, b.turn, current, recent_turns_);
  }
  // A fork of `parent` at num_tokens (0: all): whole blocks below it are
  // shared, the block it cuts is copied. INVALID_ARGUMENT past the parent's
  // tokens; FAILED_PRECONDITION when a kept block is evicted, spilled or
  // being moved.
  static absl::StatusOr<ForkPlan> PlanFork(const SequenceRecord& parent,
                                           uint64_t num_tokens);

  // --- Encodings -------------------------------------------------------------
  // The encoding a new block of `tag` gets in `s`: the policy's rule, or the
  // sequence's allocation (BF16 for a tag it lacks, the side that never
  // loses precision).
  static Encoding EncodingOf(const SequenceRecord& s, const Tag& tag) {
    if (!s.policy->IsAllocation()) return s.policy->EncodingFor(tag);
    for (const auto& [t, e] : s.allocation) {
      if (t == tag) return e;
    }
    return Encoding(Format::kBF16);
  }
  // The tags and tokens of every block of `s` after Extend `p` (the grown
  // block with its new tokens and turn), then p's new blocks: the groups an
  // allocation is solved over.
  BlockTags TagsAfterExtend(const SequenceRecord& s, const ExtendPlan& p) const;
  // Distinct tags of `tags` with their token counts, ordered by TagKey.
  static std::vector<TagTokens> GroupTags(const BlockTags& tags);
  // Solves the allocation of `groups` (distinct tags) for a sequence of
  // `model` / block_tokens under allocation policy `policy` and `table`.
  // allow_infeasible: over budget -> the cheapest option per tag
  // (*infeasible set); else RESOURCE_EXHAUSTED naming the policy.
  static absl::StatusOr<TagAllocation> Allocate(
      const Policy& policy, const CalibrationTable& table,
      const ModelShape& model, uint32_t block_tokens,
      const std::vector<TagTokens>& groups, bool allow_infeasible,
      bool* infeasible);

  uint32_t recent_turns() const { return recent_turns_; }

 private:
  const uint32_t recent_turns_;
};

}  // namespace triax::manager
