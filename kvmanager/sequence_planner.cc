#include "kvmanager/sequence_planner.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/allocator.h"

namespace triax::manager {

namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Fallback order of calibration tags for a block tag of role r: same role
// only; nearest temporal first (ties to the older), then the same modality,
// then TEXT, then the smaller modality.
std::tuple<int, int, int, int, int> SourceRank(const Tag& want,
                                               const Tag& have) {
  const int tw = static_cast<int>(want.temporal);
  const int th = static_cast<int>(have.temporal);
  const Modality mw = NormalizeModality(want.modality);
  const Modality mh = NormalizeModality(have.modality);
  return {std::abs(tw - th), -th, mh == mw ? 0 : 1,
          mh == Modality::kText ? 0 : 1, static_cast<int>(mh)};
}

}  // namespace

// --- Spans -------------------------------------------------------------------

absl::StatusOr<uint64_t> SequencePlanner::ValidateSpans(
    const std::vector<Span>& spans) {
  if (spans.empty()) return absl::InvalidArgumentError("spans is empty");
  uint64_t total = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (!IsValid(s.role)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "].role is ", RoleName(s.role), "; a role is required"));
    }
    if (!IsValid(s.modality)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "].modality is ", ModalityName(s.modality)));
    }
    if (s.num_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("spans[", i, "].num_tokens is 0; it must be >= 1"));
    }
    if (i > 0 && s.turn_offset < spans[i - 1].turn_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "].turn_offset ", s.turn_offset, " is below spans[",
          i - 1, "].turn_offset ", spans[i - 1].turn_offset));
    }
    total += s.num_tokens;
  }
  // At most one turn per token (the tagger never makes more).
  if (spans.back().turn_offset > total) {
    return absl::InvalidArgumentError(
        absl::StrCat("spans end in turn_offset ", spans.back().turn_offset,
                     ", more than their ", total, " tokens"));
  }
  return total;
}

absl::StatusOr<const std::vector<Span>*> SequencePlanner::RequestSpans(
    const std::vector<Span>& spans, const std::optional<RenderedText>& rendered,
    TurnNumbering numbering, std::vector<Span>* storage) {
  if (!rendered.has_value() && spans.empty()) {
    return absl::InvalidArgumentError(
        "spans is empty and rendered is not set; exactly one of spans and "
        "rendered must be given");
  }
  if (rendered.has_value() && !spans.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spans has ", spans.size(),
        " entries and rendered is set; exactly one of spans and rendered "
        "must be given"));
  }
  if (!rendered.has_value()) return &spans;
  TRIAX_ASSIGN_OR_RETURN(std::vector<TaggedSpan> tagged,
                         TagRendered(*rendered, numbering));
  *storage = ToSpans(tagged);
  return storage;
}

// --- Plans -------------------------------------------------------------------

absl::StatusOr<OpenPlan> SequencePlanner::PlanOpen(
    const std::vector<Span>& spans, uint64_t total, uint32_t T) const {
  if (T > kMaxBlockTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_tokens ", T, " is outside 1..", kMaxBlockTokens));
  }
  if (total > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spans hold ", total, " tokens; the limit is ", kMaxSequenceTokens));
  }
  uint64_t num_blocks = 0;
  for (const Span& s : spans) num_blocks += CeilDiv(s.num_tokens, T);
  if (num_blocks > kMaxSequenceBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("spans need ", num_blocks, " blocks of ", T,
                     " tokens; the limit is ", kMaxSequenceBlocks));
  }
  OpenPlan plan;
  // Spans of several turns (rendered text): the last one is current.
  plan.last_turn = spans.back().turn_offset;
  plan.blocks.reserve(num_blocks);
  plan.tags.reserve(num_blocks);
  uint64_t pos = 0;
  for (const Span& sp : spans) {
    const Modality modality = NormalizeModality(sp.modality);
    for (uint32_t done = 0; done < sp.num_tokens;) {
      const uint32_t n = std::min(T, sp.num_tokens - done);
      plan.blocks.push_back(
          PlannedBlock{pos, n, sp.role, modality, sp.turn_offset});
      plan.tags.emplace_back(
          Tag{TemporalFor(static_cast<uint32_t>(plan.blocks.size() - 1),
                          sp.turn_offset, plan.last_turn, recent_turns_),
              modality, sp.role},
          n);
      pos += n;
      done += n;
    }
  }
  return plan;
}

absl::StatusOr<ExtendPlan> SequencePlanner::PlanExtend(
    const SequenceRecord& s, const std::vector<Span>& spans, uint64_t total,
    bool new_turn, bool continue_last_span) const {
  const uint32_t T = s.block_tokens;
  ExtendPlan p;
  // The turn of the first span; spans of rendered text may start later ones.
  p.prev_turn = s.current_turn;
  const uint32_t base = new_turn ? p.prev_turn + 1 : p.prev_turn;
  p.first_turn = base + spans.front().turn_offset;
  p.turn = base + spans.back().turn_offset;  // the new current

  // How many of the first span's tokens fill the last block's free slots.
  const BlockRecord* last = s.blocks.back();
  if (continue_last_span && last->refcount == 1 &&
      last->tier == Tier::kDevice && !last->evicted && last->busy == 0 &&
      last->tag.role == spans[0].role &&
      last->tag.modality == NormalizeModality(spans[0].modality)) {
    p.fill = std::min(last->capacity - last->num_tokens, spans[0].num_tokens);
  }
  if (s.num_tokens + total > kMaxSequenceTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spans bring sequence_id ", Quote(s.id), " to ", s.num_tokens + total,
        " tokens; the limit is ", kMaxSequenceTokens));
  }
  // Plan the new blocks (never the sink: the sequence already has its first
  // block); the temporal class is taken against the new current turn.
  uint64_t pos = s.num_tokens + p.fill;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& sp = spans[i];
    const Modality modality = NormalizeModality(sp.modality);
    const uint32_t sp_turn = base + sp.turn_offset;
    uint32_t done = i == 0 ? p.fill : 0;
    while (done < sp.num_tokens) {
      const uint32_t n = std::min(T, sp.num_tokens - done);
      p.blocks.push_back(PlannedBlock{pos, n, sp.role, modality, sp_turn});
      p.tags.emplace_back(
          Tag{TemporalFor(
                  static_cast<uint32_t>(s.blocks.size() + p.blocks.size() - 1),
                  sp_turn, p.turn, recent_turns_),
              modality, sp.role},
          n);
      pos += n;
      done += n;
    }
    if (s.blocks.size() + p.blocks.size() > kMaxSequenceBlocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("spans bring sequence_id ", Quote(s.id), " past ",
                       kMaxSequenceBlocks, " blocks"));
    }
  }
  return p;
}

void SequencePlanner::AdvanceTurns(SequenceRecord* s,
                                   const ExtendPlan& p) const {
  if (p.turn > p.prev_turn) {
    s->current_turn = p.turn;
    // Turn t starts at the first new block of a turn >= t.
    size_t k = 0;
    for (uint32_t t = p.prev_turn + 1; t <= p.turn; ++t) {
      while (k < p.blocks.size() && p.blocks[k].turn < t) ++k;
      s->turn_start.push_back(static_cast<uint32_t>(s->blocks.size() + k));
    }
  }
  if (p.fill > 0) {
    BlockRecord* last = s->blocks.back();
    last->num_tokens += p.fill;
    last->turn = p.first_turn;
  }
}

void SequencePlanner::ForEachRetag(
    const SequenceRecord& s, uint32_t prev, uint32_t turn,
    absl::FunctionRef<void(BlockRecord*, Temporal)> f) const {
  if (turn <= prev) return;
  // Only turns whose class changes are visited: the previous current turn
  // (now recent or older) and the turns that fall out of the recent window
  // (prev-R .. turn-R-1), so the cost is O(changed).
  const uint32_t R = recent_turns_;
  std::vector<uint32_t> aged = {prev};
  if (prev > 0 && turn >= R + 1) {
    const uint32_t lo = prev >= R ? prev - R : 0;
    const uint32_t hi = std::min(prev - 1, turn - R - 1);
    for (uint32_t t = lo; t <= hi; ++t) aged.push_back(t);
  }
  for (uint32_t t : aged) {
    uint32_t begin = s.turn_start[t];
    if (begin > 0) --begin;  // a block grown into turn t sits just before it
    // Existing blocks only: the new ones are created with their final tag.
    const uint32_t end = std::min<uint32_t>(
        s.turn_start[t + 1], static_cast<uint32_t>(s.blocks.size()));
    for (uint32_t i = begin; i < end; ++i) {
      BlockRecord* b = s.blocks[i];
      if (b->turn != t) continue;
      const Temporal next = TemporalOf(*b, turn);
      if (next == b->tag.temporal) continue;
      f(b, next);
    }
  }
}

absl::StatusOr<ForkPlan> SequencePlanner::PlanFork(const SequenceRecord& parent,
                                                   uint64_t num_tokens) {
  ForkPlan p;
  const uint64_t n = num_tokens == 0 ? parent.num_tokens : num_tokens;
  if (n > parent.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_tokens ", num_tokens, " exceeds the ", parent.num_tokens,
        " tokens of parent_sequence_id ", Quote(parent.id)));
  }
  p.num_tokens = n;
  // Whole blocks below n are shared; the block holding token n-1 is copied
  // when n cuts it.
  while (p.shared < parent.blocks.size() &&
         parent.blocks[p.shared]->first_token +
                 parent.blocks[p.shared]->num_tokens <=
             n) {
    ++p.shared;
  }
  if (p.shared < parent.blocks.size() &&
      parent.blocks[p.shared]->first_token < n) {
    p.cut = parent.blocks[p.shared];
  }
  for (size_t i = 0; i < p.kept(); ++i) {
    const BlockRecord* b = parent.blocks[i];
    if (b->evicted || b->tier != Tier::kDevice || b->busy != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parent_sequence_id ", Quote(parent.id), " block ", i, " (lineage ",
          b->lineage_id, ") is ",
          b->evicted
              ? "evicted"
              : (b->busy != 0 ? "being moved by the pressure manager"
                              : absl::StrCat("spilled to ", TierName(b->tier))),
          "; forks share device blocks only (ReportAccess with active=true "
          "restores spilled blocks)"));
    }
  }
  return p;
}

// --- Encodings ---------------------------------------------------------------

BlockTags SequencePlanner::TagsAfterExtend(const SequenceRecord& s,
                                           const ExtendPlan& p) const {
  const BlockRecord* last = s.blocks.back();
  BlockTags all;
  all.reserve(s.blocks.size() + p.tags.size());
  for (const BlockRecord* b : s.blocks) {
    const bool grown = p.fill > 0 && b == last;
    all.emplace_back(Tag{TemporalFor(b->index, grown ? p.first_turn : b->turn,
                                     p.turn, recent_turns_),
                         b->tag.modality, b->tag.role},
                     b->num_tokens + (grown ? p.fill : 0));
  }
  all.insert(all.end(), p.tags.begin(), p.tags.end());
  return all;
}

std::vector<TagTokens> SequencePlanner::GroupTags(const BlockTags& tags) {
  std::map<int, TagTokens> by_key;
  for (const auto& [tag, n] : tags) {
    by_key.try_emplace(TagKey(tag), TagTokens{tag, 0}).first->second.tokens +=
        n;
  }
  std::vector<TagTokens> out;
  out.reserve(by_key.size());
  for (auto& [k, g] : by_key) out.push_back(g);
  return out;
}

absl::StatusOr<TagAllocation> SequencePlanner::Allocate(
    const Policy& policy, const CalibrationTable& table,
    const ModelShape& model, uint32_t block_tokens,
    const std::vector<TagTokens>& groups, bool allow_infeasible,
    bool* infeasible) {
  const kernels::PageShape shape = PageShapeOf(model, block_tokens);
  // Usable entries: candidates valid for the sequence's shape.
  std::vector<size_t> usable;
  for (size_t i = 0; i < table.encodings.size(); ++i) {
    const Encoding& e = table.encodings[i];
    if (!policy.IsCandidate(e)) continue;
    if (kernels::ValidateEncoding(e, shape) != nullptr) continue;
    usable.push_back(i);
  }
  TRIAX_ASSIGN_OR_RETURN(
      const AllocOption bf16,
      MakeAllocOption(Encoding(Format::kBF16), shape, /*distortion=*/0));
  const bool dnll = policy.objective == Policy::Objective::kDnll;
  if (dnll && !absl::StartsWith(table.info.source.metric, "output-kl")) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy ", Quote(policy.name),
        " has objective OBJECTIVE_DNLL but calibration ",
        Quote(table.info.model), " has metric ",
        Quote(table.info.source.metric),
        "; dnll needs an output-metric table (kvcalibrate --metric=output)"));
  }
  AllocProblem problem;
  problem.budget_bits = policy.budget_bits;
  problem.groups.reserve(groups.size());
  // Per option: the calibration's all-token and answer-position measure (KL,
  // or the NLL increase for OBJECTIVE_DNLL; the objective weighs them by
  // policy.answer_weight).
  std::array<std::vector<std::vector<double>>, 2> metrics;
  for (const TagTokens& g : groups) {
    AllocGroup group;
    group.tag = g.tag;
    group.tokens = g.tokens;
    std::vector<double> all, answer;
    if (!policy.IsPinned(g.tag)) {
      // The calibration tag to take options from (see the header).
      const Tag* source = nullptr;
      std::tuple<int, int, int, int, int> best;
      for (size_t i : usable) {
        const Tag& have = table.info.entries[i].tag;
        if (have.role != g.tag.role) continue;
        const auto rank = SourceRank(g.tag, have);
        if (source == nullptr || rank < best) {
          source = &have;
          best = rank;
        }
      }
      if (source != nullptr) {
        std::vector<size_t> entries;
        std::vector<double> objective;
        for (size_t i : usable) {
          const CalibrationEntryInfo& entry = table.info.entries[i];
          if (!(entry.tag == *source)) continue;
          const double a = dnll ? entry.dnll : entry.distortion;
          const double b = dnll ? entry.dnll_answer : entry.distortion_answer;
          entries.push_back(i);
          objective.push_back(a + policy.answer_weight * b);
          all.push_back(a);
          answer.push_back(b);
        }
        // The NLL increase may be negative; the allocator takes D >= 0. One
        // shift per group adds the same N_k x shift to every choice, so the
        // optimum is the same.
        double shift = 0;
        for (double d : objective) shift = std::min(shift, d);
        for (size_t j = 0; j < entries.size(); ++j) {
          TRIAX_ASSIGN_OR_RETURN(
              AllocOption o, MakeAllocOption(table.encodings[entries[j]], shape,
                                             objective[j] - shift));
          group.options.push_back(o);
        }
      }
    }
    if (group.options.empty()) {
      group.options.push_back(bf16);
      group.pinned = true;
      all.assign(1, 0.0);
      answer.assign(1, 0.0);
    }
    problem.groups.push_back(std::move(group));
    metrics[0].push_back(std::move(all));
    metrics[1].push_back(std::move(answer));
  }
  std::vector<int> choice;
  auto solved = Solve(problem);
  if (solved.ok()) {
    // Never an allocation a uniform one of no more bits beats on both the
    // all-token and the answer-position prediction (the exact solver's
    // optimum never is; a greedy or node-limited one may be).
    TRIAX_ASSIGN_OR_RETURN(
        choice,
        PreferDominatingUniform(problem, metrics, std::move(solved->choice)));
  } else if (solved.status().code() == absl::StatusCode::kResourceExhausted &&
             allow_infeasible) {
    *infeasible = true;
    choice.reserve(problem.groups.size());
    for (const AllocGroup& g : problem.groups) {
      int cheapest = 0;
      for (size_t i = 1; i < g.options.size(); ++i) {
        const AllocOption& o = g.options[i];
        const AllocOption& c = g.options[cheapest];
        if (o.bits < c.bits ||
            (o.bits == c.bits && o.distortion < c.distortion))
          cheapest = static_cast<int>(i);
      }
      choice.push_back(g.pinned ? 0 : cheapest);
    }
  } else {
    return absl::Status(
        solved.status().code(),
        absl::StrCat("policy ", Quote(policy.name), " (calibration ",
                     Quote(table.info.model), ", budget_bits ",
                     policy.budget_bits, "): ", solved.status().message()));
  }
  TagAllocation out;
  out.reserve(problem.groups.size());
  for (size_t k = 0; k < problem.groups.size(); ++k) {
    out.emplace_back(problem.groups[k].tag,
                     problem.groups[k].options[choice[k]].encoding);
  }
  return out;
}

}  // namespace triax::manager
