// ManagerCore's durable metadata (manager_core.h "Durable metadata",
// metadata_journal.h): the journaled lock, Restore, and the reconciliation
// of a recovered worker's first report.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

namespace {

// The newest ticket of this thread's calls (DeferDurableWaits).
thread_local uint64_t t_durable_ticket = 0;

// The cores this process may run on: its affinity mask (a manager pinned
// with taskset to 2 of 16 cores has 2), else hardware_concurrency.
int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
    return CPU_COUNT(&set);
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

ManagerCore::JournaledLock::~JournaledLock() {
  uint64_t ticket = 0;
  MetadataJournal* journal = core_->journal_;
  if (journal != nullptr && !core_->changes_.empty()) {
    ticket = journal->Write(core_->changes_, core_->ViewLocked());
    core_->changes_.Clear();
  }
  core_->mu_.Unlock();
  if (ticket == 0) return;
  if (core_->defer_waits_.load(std::memory_order_relaxed)) {
    t_durable_ticket = std::max(t_durable_ticket, ticket);
  } else {
    journal->Wait(ticket);
  }
}

uint64_t ManagerCore::TakeDurableTicket() {
  const uint64_t t = t_durable_ticket;
  t_durable_ticket = 0;
  return t;
}

void ManagerCore::WhenDurable(uint64_t ticket, std::function<void()> fn,
                              bool may_wait) {
  MetadataJournal* journal = ticket != 0 ? reply_journal_.load() : nullptr;
  if (journal == nullptr) {
    fn();
    return;
  }
  // A few callers wait in their own thread: the reply then leaves from the
  // thread that computed it, the fastest path when calls are few (replies
  // finished from the journal's writer thread take gRPC longer to send).
  // Past that, the rest hand their reply to the writer thread, so that
  // gRPC's few callback threads never all block on the disk (measured:
  // bench/results/manager.md "Durable metadata").
  static std::atomic<int> waiting{0};
  static const int limit = std::max(1, UsableCores() / 2);
  if (may_wait && waiting.fetch_add(1) < limit) {
    journal->Wait(ticket);
    waiting.fetch_sub(1);
    fn();
    return;
  }
  if (may_wait) waiting.fetch_sub(1);
  journal->OnDurable(ticket, std::move(fn));
}

StateView ManagerCore::ViewLocked() const {
  return StateView{tenants_,      workers_, sequences_,     policies_,
                   calibrations_, tokens_,  capability_key_};
}

void ManagerCore::SetJournal(MetadataJournal* journal) {
  uint64_t ticket = 0;
  {
    absl::MutexLock lock(&mu_);
    journal_ = journal;
    reply_journal_ = journal;
    changes_.Clear();
    changes_.enabled = journal != nullptr;
    if (journal == nullptr) return;
    ticket = journal->Snapshot(ViewLocked());
  }
  journal->Wait(ticket);
}

ManagerCore::Counts ManagerCore::GetCounts() const {
  absl::MutexLock lock(&mu_);
  Counts c;
  c.tenants = tenants_.all().size();
  c.workers = workers_.all().size();
  c.sequences = sequences_.all().size();
  c.blocks = sequences_.num_blocks();
  return c;
}

absl::Status ManagerCore::Restore(RecoveredState state) {
  absl::MutexLock lock(&mu_);
  if (!sequences_.all().empty() || !tenants_.all().empty() ||
      !workers_.all().empty() || policies_.size() != 0 ||
      calibrations_.size() != 0) {
    return absl::FailedPreconditionError(
        "Restore needs a manager that holds nothing yet");
  }
  // Restoring is not a change to journal: SetJournal snapshots afterwards.
  const bool enabled = changes_.enabled;
  changes_.enabled = false;
  sequences_.RestoreCounters(state.next_sequence, state.next_lineage);
  for (const TenantRecord& t : state.tenants) {
    TRIAX_ASSIGN_OR_RETURN(TenantRecord * r,
                           tenants_.Create(t.id, t.budgets, t.default_policy));
    r->prefix_salt = t.prefix_salt;
  }
  for (std::shared_ptr<const Policy>& p : state.operator_policies) {
    TRIAX_RETURN_IF_ERROR(policies_.Put(std::move(p)));
  }
  for (std::shared_ptr<const CalibrationTable>& c : state.calibrations) {
    TRIAX_RETURN_IF_ERROR(calibrations_.Put(std::move(c)).status());
  }
  for (TokenRecord& t : state.tokens) tokens_.Put(std::move(t));
  capability_key_ = std::move(state.capability_key);
  const int64_t now = clock_->NowMs();
  for (const RegisterWorkerRequest& r : state.workers) {
    WorkerRecord* w = workers_.Register(r, now);
    // Not heard from yet: nothing is placed on it until it reports, and it
    // goes DOWN as usual if it never does.
    w->info.state = WorkerState::kSuspect;
    w->info.capacity_bytes = r.capacity_bytes;
    w->recovered = true;
  }
  for (RecoveredSequence& rs : state.sequences) {
    TenantRecord* t = tenants_.FindOrNull(rs.tenant_id);
    WorkerRecord* w = workers_.Find(rs.worker_id);
    if (t == nullptr || w == nullptr) {
      return absl::DataLossError(
          absl::StrCat("stored sequence ", Quote(rs.record.id), " names ",
                       t == nullptr ? "tenant " : "worker ",
                       Quote(t == nullptr ? rs.tenant_id : rs.worker_id),
                       ", which is not stored"));
    }
    auto seq = std::make_unique<SequenceRecord>(std::move(rs.record));
    SequenceRecord* s = seq.get();
    s->tenant = t;
    s->worker = w;
    s->blocks.clear();
    // A transfer in flight rolls back: the source stays authoritative.
    s->transfer_id.clear();
    s->transfer_destination = nullptr;
    s->parked = false;
    s->parked_blocks.clear();
    s->parked_turn_start.clear();
    s->last_access_ms = now;
    const uint64_t bytes = s->bytes;
    sequences_.Insert(std::move(seq));
    if (s->state != SequenceState::kOpen) {
      s->bytes = 0;
      sequences_.RetireRecovered(s);
      continue;
    }
    for (const uint64_t id : rs.lineage_ids) {
      BlockRecord* b = sequences_.FindBlock(id);
      if (b != nullptr) {  // held by an earlier sequence too (a fork's)
        SequenceTable::Share(s, b);
        continue;
      }
      auto it = state.blocks.find(id);
      TenantRecord* charged =
          it == state.blocks.end()
              ? nullptr
              : tenants_.FindOrNull(it->second.charged_tenant);
      if (charged == nullptr || it->second.record.index != s->blocks.size()) {
        return absl::DataLossError(
            absl::StrCat("stored sequence ", Quote(s->id), " lists block ", id,
                         " at index ", s->blocks.size(),
                         it == state.blocks.end() ? ", which is not stored"
                                                  : ", stored inconsistently"));
      }
      BlockRecord copy = it->second.record;
      const bool indexed = copy.prefix_indexed;
      copy.prefix_indexed = false;
      b = sequences_.RestoreBlock(s, copy, charged);
      b->creator = it->second.record.creator;
      pressure_.BlockCreated(s, *b);
      if (indexed && !b->prefix_hash.empty()) prefix_.Add(b);
    }
    s->bytes = bytes;
    t->open_sequences++;
    w->open.insert(s);
    // A demote or tier plan was in flight: its worker may have applied it.
    if (s->in_doubt > 0) w->verify.push_back(s->id);
    s->in_doubt = 0;
  }
  // Owners as stored, where that sequence still holds the block.
  for (const auto& [id, rb] : state.blocks) {
    BlockRecord* b = sequences_.FindBlock(id);
    SequenceRecord* o = sequences_.Find(rb.owner);
    if (b != nullptr && o != nullptr && o->state == SequenceState::kOpen &&
        b->index < o->blocks.size() && o->blocks[b->index] == b) {
      b->owner = o;
    }
  }
  changes_.enabled = enabled;
  return absl::OkStatus();
}

std::vector<std::string> ManagerCore::ReconcileRecoveredLocked(
    WorkerRecord* w, const Inventory& inventory, std::vector<Event>* ev,
    std::vector<EventLog::LastPlan>* forgotten) {
  const absl::flat_hash_set<std::string> held(inventory.sequence_ids.begin(),
                                              inventory.sequence_ids.end());
  std::vector<SequenceRecord*> lost;
  for (SequenceRecord* s : w->open) {
    if (!held.contains(s->id)) lost.push_back(s);
  }
  std::sort(lost.begin(), lost.end(),
            [](const SequenceRecord* a, const SequenceRecord* b) {
              return SequenceIdBefore(a->id, b->id);
            });
  for (SequenceRecord* s : lost) {
    MarkLostLocked(s, "not_on_worker", ev, forgotten);
  }
  std::vector<std::string> verify;
  for (const std::string& id : w->verify) {
    const SequenceRecord* s = sequences_.Find(id);
    if (s != nullptr && s->state == SequenceState::kOpen && s->worker == w) {
      verify.push_back(id);
    }
  }
  w->verify.clear();
  return verify;
}

void ManagerCore::AwaitDurable() {
  const uint64_t ticket = TakeDurableTicket();
  MetadataJournal* journal = ticket != 0 ? reply_journal_.load() : nullptr;
  if (journal != nullptr) journal->Wait(ticket);
}

absl::Status ManagerCore::AdoptWorkerBlocks(const std::string& worker_id,
                                            const Inventory& described) {
  JournaledLock lock(this);
  WorkerRecord* w = workers_.Find(worker_id);
  if (w == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("worker_id ", Quote(worker_id), " is not registered"));
  }
  std::vector<Event> ev;
  for (const Inventory::Described& d : described.described) {
    SequenceRecord* s = sequences_.Find(d.sequence_id);
    if (s == nullptr || s->state != SequenceState::kOpen || s->worker != w ||
        !s->transfer_id.empty()) {
      continue;
    }
    bool changed = false;
    for (const BlockSpec& held : d.blocks) {
      BlockRecord* b = sequences_.BlockOf(*s, held.lineage_id);
      // Shared blocks are never re-encoded or moved; busy ones belong to a
      // plan of this run.
      if (b == nullptr || b->refcount != 1 || b->busy != 0) continue;
      const Tier tier = held.evicted || held.tier == Tier::kUnspecified
                            ? Tier::kDevice
                            : held.tier;
      const bool same_encoding =
          CanonicalEncoding(b->encoding) == CanonicalEncoding(held.encoding);
      if (same_encoding && b->tier == tier && b->evicted == held.evicted) {
        continue;
      }
      // Take the block off its current charges, then charge what the
      // worker holds.
      const int from = static_cast<int>(b->tier);
      if (!b->evicted) {
        b->charged->used[from] -= b->bytes;
        if (b->tier == Tier::kDevice) {
          w->reserved -= std::min(w->reserved, b->bytes);
          s->bytes -= std::min(s->bytes, b->bytes);
        } else {
          w->tier_used[from] -= std::min(w->tier_used[from], b->bytes);
          if (s->spilled > 0) --s->spilled;
        }
      }
      const Encoding old = b->encoding;
      const Tier old_tier = b->tier;
      if (!same_encoding) {
        b->encoding = held.encoding;
        b->bytes = BlockBytes(s->model, s->block_tokens, held.encoding);
      }
      b->tier = tier;
      b->evicted = held.evicted;
      if (!b->evicted) {
        const int to = static_cast<int>(b->tier);
        b->charged->used[to] += b->bytes;
        if (b->tier == Tier::kDevice) {
          w->Reserve(b->bytes);
          s->bytes += b->bytes;
        } else {
          w->tier_used[to] += b->bytes;
          ++s->spilled;
        }
      }
      EventKind kind = EventKind::kBlockDemoted;
      if (b->evicted) {
        kind = EventKind::kBlockEvicted;
      } else if (b->tier != old_tier) {
        kind = b->tier == Tier::kDevice ? EventKind::kBlockRestored
                                        : EventKind::kBlockSpilled;
      }
      Event e = MakeEvent(*clock_, kind, s, b);
      e.detail =
          absl::StrCat("by=reconcile from=", EncodingString(old), "/",
                       TierName(old_tier), " to=", EncodingString(b->encoding),
                       "/", TierName(b->tier), " bytes=", b->bytes);
      ev.push_back(std::move(e));
      changed = true;
    }
    if (changed) Touch(s);
  }
  if (!ev.empty()) events_.Append(&ev);
  return absl::OkStatus();
}

}  // namespace triax::manager
