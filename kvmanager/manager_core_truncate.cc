// ManagerCore::TruncateSequence (manager_core.h "Sequences"): drops the
// tokens of an open sequence from a point on in the manager's plan. The
// client library calls it to undo an ExtendSequence whose AllocatePages the
// worker refused, so that the manager never holds blocks the worker does not
// (reclaim would pick them and fail on the worker).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

absl::StatusOr<TruncateSequenceResult> ManagerCore::TruncateSequence(
    const TruncateSequenceRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequestId(req.request_id));
  if (req.num_tokens == 0) {
    return absl::InvalidArgumentError(
        "num_tokens is 0; a sequence keeps at least one token (close it "
        "with CloseSequence instead)");
  }
  JournaledLock lock(this);
  const std::string cache_key =
      absl::StrCat("TruncateSequence/", req.tenant_id);
  TRIAX_ASSIGN_OR_RETURN(
      auto hit, truncate_cache_.Lookup(cache_key, req.request_id,
                                       req.fingerprint, "TruncateSequence"));
  if (hit) return hit->reply;
  // A plan change only: allowed while the worker is SUSPECT, like Close.
  TRIAX_ASSIGN_OR_RETURN(
      SequenceRecord * s,
      FindOpenSequenceLocked(req.tenant_id, "sequence_id", req.sequence_id,
                             /*needs_worker=*/false));
  if (req.num_tokens > s->num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens ", req.num_tokens, " exceeds the ",
                     s->num_tokens, " tokens of sequence_id ", Quote(s->id)));
  }
  TruncateSequenceResult result;
  if (req.num_tokens == s->num_tokens) {
    result.sequence = SequenceTable::Info(*s, /*with_blocks=*/true);
    truncate_cache_.Put(cache_key, req.request_id, req.fingerprint,
                        absl::OkStatus(), result);
    return result;
  }
  // Blocks [0, kept) stay; the last of them may be cut.
  size_t kept = 0;
  while (kept < s->blocks.size() &&
         s->blocks[kept]->first_token < req.num_tokens) {
    ++kept;
  }
  BlockRecord* last = s->blocks[kept - 1];
  const uint64_t last_end = last->first_token + last->num_tokens;
  const bool cut = last_end > req.num_tokens;
  if (cut && last->refcount > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "num_tokens ", req.num_tokens, " cuts blocks[", kept - 1,
        "] (lineage_id ", last->lineage_id, ", tokens ", last->first_token,
        "..", last_end - 1, ") which is shared with a fork (", last->refcount,
        " sequences); shared blocks are immutable"));
  }
  for (size_t i = kept; i < s->blocks.size(); ++i) {
    if (s->blocks[i]->busy != 0) {
      return absl::AbortedError(
          absl::StrCat("blocks[", i, "] (lineage_id ", s->blocks[i]->lineage_id,
                       ") is being moved by the pressure manager; retry"));
    }
  }

  // Commit: every check passed.
  Touch(s);  // pending demotes of this sequence abort at commit
  s->last_access_ms = clock_->NowMs();
  const uint64_t from_tokens = s->num_tokens;
  const size_t from_blocks = s->blocks.size();
  std::vector<Event> ev;
  ev.reserve(2 * (from_blocks - kept) + kept + 1);
  std::vector<EventLog::LastPlan> forgotten;
  for (size_t i = kept; i < from_blocks; ++i) {
    BlockRecord* b = s->blocks[i];
    result.released_lineage_ids.push_back(b->lineage_id);
    if (!b->evicted) {
      if (b->tier == Tier::kDevice) {
        s->bytes -= b->bytes;
      } else if (s->spilled > 0) {
        --s->spilled;
      }
    }
    if (s->last_tool_call == b->lineage_id) s->last_tool_call = 0;
    ReleaseBlockLocked(s, b, /*lost=*/false, &result.freed_lineage_ids,
                       s->last_access_ms, &ev, &forgotten);
  }
  s->blocks.resize(kept);
  if (cut)
    last->num_tokens =
        static_cast<uint32_t>(req.num_tokens - last->first_token);
  s->num_tokens = req.num_tokens;
  TruncateChainLocked(s);

  // Turns: those starting at a kept block stay; a turn that only grew the
  // last block stays when that block keeps all its tokens. A cut block takes
  // the newest kept turn (which turn its kept tokens came in is not
  // recorded).
  uint32_t turn = 0;
  while (turn + 1 < s->turn_start.size() &&
         s->turn_start[turn + 1] < static_cast<uint32_t>(kept)) {
    ++turn;
  }
  if (!cut) turn = std::max(turn, std::min(last->turn, s->current_turn));
  if (cut) last->turn = std::min(last->turn, turn);
  s->turn_start.resize(turn + 1);
  s->current_turn = turn;
  for (BlockRecord* b : s->blocks) {
    const Temporal next = planner_.TemporalOf(*b, turn);
    if (next == b->tag.temporal) continue;
    Event e = MakeEvent(*clock_, EventKind::kBlockRetagged, s, b);
    e.detail = absl::StrCat("from=", TemporalName(b->tag.temporal),
                            " to=", TemporalName(next), " turn=", turn,
                            " truncated=true");
    b->tag.temporal = next;
    e.tag = b->tag;
    ev.push_back(std::move(e));
  }
  Event e = MakeEvent(*clock_, EventKind::kSequenceTruncated, s, nullptr);
  e.detail =
      absl::StrCat("from_tokens=", from_tokens, " tokens=", s->num_tokens,
                   " released_blocks=", from_blocks - kept,
                   " freed=", result.freed_lineage_ids.size(), " turn=", turn);
  ev.push_back(std::move(e));
  result.sequence = SequenceTable::Info(*s, /*with_blocks=*/true);
  events_.Append(&ev, &forgotten);
  truncate_cache_.Put(cache_key, req.request_id, req.fingerprint,
                      absl::OkStatus(), result);
  return result;
}

}  // namespace triax::manager
