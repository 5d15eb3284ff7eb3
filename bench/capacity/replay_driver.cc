#include "bench/capacity/replay_driver.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <queue>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/status_macros.h"
#include "kvmanager/reclaim_round.h"

namespace triax::bench::capacity {
namespace {

using manager::AdmissionShortfall;
using manager::ManagerCore;
using manager::ReclaimReport;
using manager::Span;
using manager::TierCommand;
using manager::TierPlan;
using manager::TierPlanOutcome;

enum class Kind { kArrive, kTurn, kResponse, kGiveUp, kTick };

struct Ev {
  int64_t t = 0;
  uint64_t order = 0;  // FIFO among events of one time
  Kind kind = Kind::kTick;
  uint32_t session = 0;
  uint64_t wait_id = 0;
  bool operator>(const Ev& o) const {
    return t != o.t ? t > o.t : order > o.order;
  }
};

enum class Phase { kPending, kWaitOpen, kBusy, kIdle, kWaitStep, kDone };

// A session's state during the replay.
struct Live {
  Phase phase = Phase::kPending;
  size_t tenant = 0;
  std::string sequence_id;
  size_t turn = 0;
  bool response = false;  // the step to play is the turn's response
  int64_t wait_since = 0;
  uint64_t wait_id = 0;
  uint64_t tokens = 0;  // admitted so far
};

uint64_t Tokens(const std::vector<Span>& spans) {
  uint64_t n = 0;
  for (const Span& s : spans) n += s.num_tokens;
  return n;
}

class Replayer {
 public:
  Replayer(const Trace& trace, const ReplayConfig& config)
      : trace_(trace), config_(config), base_ms_(clock_.NowMs()) {}

  absl::Status Setup();
  absl::Status Run();
  ReplayResult& result() { return result_; }

 private:
  int64_t Now() const { return clock_.NowMs() - base_ms_; }
  void Push(int64_t t, Kind kind, uint32_t session = 0, uint64_t wait_id = 0) {
    events_.push(Ev{t, next_order_++, kind, session, wait_id});
  }
  // Moves the clock to `t`: open-session time and the samples of (now, t).
  void AdvanceTo(int64_t t);
  void Sample();
  // Device bytes per tenant now: peaks (after every admitted call; the
  // other calls only free device bytes, restores aside, which the step
  // after them observes).
  void Observe();

  absl::Status Handle(const Ev& e);
  // Opens session i (turn 0's prompt). OK: admitted; RESOURCE_EXHAUSTED:
  // wait; else fatal.
  absl::Status TryOpen(uint32_t i);
  // Plays session i's pending step (restore, then the Extend).
  absl::Status TryStep(uint32_t i);
  // The step of session i succeeded: schedule what follows.
  absl::Status AfterPrompt(uint32_t i);
  absl::Status AfterResponse(uint32_t i);
  // Tries session i's open or step; queues it when refused for room.
  absl::Status Attempt(uint32_t i, bool waiting);
  void Wait(uint32_t i, Phase phase);
  absl::Status GiveUp(uint32_t i);
  absl::Status Close(uint32_t i);
  // Retries the waiting sessions (see replay_driver.h).
  absl::Status Pass();
  bool Eligible(size_t t) const {
    return release_gen_ > failed_gen_[t] ||
           Now() - failed_at_[t] >= config_.retry_ms;
  }
  // Drops the waiters at the front of `q` that no longer wait.
  void PurgeFront(std::deque<uint32_t>* q) const {
    while (!q->empty() && !Waiting(q->front())) q->pop_front();
  }
  bool Waiting(uint32_t i) const {
    const Live& l = live_[i];
    return l.wait_id != 0 &&
           (l.phase == Phase::kWaitOpen || l.phase == Phase::kWaitStep);
  }
  absl::Status BackgroundRound();
  TierPlanOutcome RunPlan(const TierPlan& plan);
  // Runs `call` (an Open or Extend) and, refused for room with `reclaim`,
  // one reclaim round retrying it after each stage (as the service's
  // AdmitAfterReclaim). Its result; RESOURCE_EXHAUSTED with a shortfall
  // (wait); any other error named for session i.
  template <typename T>
  absl::StatusOr<T> Admit(
      uint32_t i,
      const std::function<absl::StatusOr<T>(AdmissionShortfall*)>& call);
  // An admission after reclaiming, retrying `call` after each stage.
  absl::Status Reclaim(
      const absl::Status& refused, AdmissionShortfall* sf,
      const std::function<absl::Status(AdmissionShortfall*)>& retry);
  absl::Status Fatal(uint32_t i, const absl::Status& s) const {
    return absl::Status(
        s.code(),
        absl::StrCat("session ", trace_.sessions[i].id, ": ", s.message()));
  }
  ReplayCounts& Counts(const std::string& tenant) {
    return result_.by_tenant[tenant_index_.at(tenant)];
  }
  bool HasTiers() const {
    return config_.host_bytes > 0 || config_.disk_bytes > 0;
  }

  const Trace& trace_;
  const ReplayConfig& config_;
  FakeClock clock_;
  const int64_t base_ms_;
  std::unique_ptr<ManagerCore> core_;
  ReplayResult result_;
  absl::flat_hash_map<std::string, size_t> tenant_index_;
  std::vector<Live> live_;
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> events_;
  uint64_t next_order_ = 0;
  uint64_t next_wait_id_ = 1;
  // Per tenant: waiting steps and Opens (FIFO), retry bookkeeping.
  std::vector<std::deque<uint32_t>> wait_steps_, wait_opens_;
  std::vector<uint64_t> failed_gen_;
  std::vector<int64_t> failed_at_;
  std::vector<uint32_t> open_now_;
  std::vector<uint64_t> tokens_now_;  // the open sessions' tokens
  uint32_t open_total_ = 0;
  uint64_t release_gen_ = 0;  // device bytes released so far (count)
  size_t done_ = 0;
  int64_t next_sample_ = 0;
  int64_t last_arrival_ = 0;
  bool changed_ = true;  // state changed since the last idle round
  absl::Status fatal_;
};

absl::Status Replayer::Setup() {
  const ReplayConfig& c = config_;
  for (const auto& [name, v] :
       {std::pair<const char*, int64_t>{"workers", c.workers},
        {"tick_ms", c.tick_ms},
        {"patience_ms", c.patience_ms},
        {"retry_ms", c.retry_ms},
        {"sample_ms", c.sample_ms},
        {"max_background_stages", c.max_background_stages}}) {
    if (v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "=", v, " is not positive"));
    }
  }
  if (c.device_bytes == 0) {
    return absl::InvalidArgumentError("device_bytes=0 is not positive");
  }
  manager::ManagerOptions o = c.manager;
  o.default_block_tokens = c.block_tokens;
  o.event_retention = 4096;
  o.closed_retention = 1024;
  TRIAX_ASSIGN_OR_RETURN(core_, ManagerCore::Create(o, &clock_));
  for (int w = 0; w < c.workers; ++w) {
    manager::RegisterWorkerRequest reg;
    reg.worker_id = absl::StrCat("w", w);
    reg.address = absl::StrCat("replay-", w, ":1");
    reg.backend = "replay";
    reg.capacity_bytes = c.device_bytes;
    reg.host_capacity_bytes = c.host_bytes;
    reg.disk_capacity_bytes = c.disk_bytes;
    TRIAX_RETURN_IF_ERROR(core_->RegisterWorker(reg).status());
  }
  result_.device_capacity = c.device_bytes * static_cast<uint64_t>(c.workers);
  result_.values_per_token =
      2ull * c.model.n_layers * c.model.n_kv_heads * c.model.head_dim;
  if (c.calibration) {
    manager::PutCalibrationRequest put;
    put.table = *c.calibration;
    TRIAX_RETURN_IF_ERROR(core_->PutCalibration(put).status());
  }
  for (const manager::PolicyInfo& p : c.put_policies) {
    manager::PutPolicyRequest put;
    put.policy = p;
    TRIAX_RETURN_IF_ERROR(core_->PutPolicy(put).status());
  }
  // Tenants: the configured ones (with budgets), then the trace's others.
  std::map<std::string, const ReplayTenant*> budgets;
  for (const ReplayTenant& t : c.tenants) {
    if (!budgets.emplace(t.tenant, &t).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenants: ", t.tenant, " is listed twice"));
    }
  }
  result_.tenants = trace_.Tenants();
  for (const ReplayTenant& t : c.tenants) {
    if (std::find(result_.tenants.begin(), result_.tenants.end(), t.tenant) ==
        result_.tenants.end()) {
      result_.tenants.push_back(t.tenant);
    }
  }
  for (size_t i = 0; i < result_.tenants.size(); ++i) {
    const std::string& id = result_.tenants[i];
    tenant_index_[id] = i;
    manager::CreateTenantRequest req;
    req.tenant_id = id;
    req.default_policy = c.policy;
    auto b = budgets.find(id);
    if (b != budgets.end() &&
        (b->second->ceiling_bytes > 0 || b->second->floor_bytes > 0)) {
      const uint64_t ceiling = b->second->ceiling_bytes > 0
                                   ? b->second->ceiling_bytes
                                   : result_.device_capacity;
      req.budgets.push_back({Tier::kDevice, b->second->floor_bytes, ceiling});
    }
    TRIAX_RETURN_IF_ERROR(core_->CreateTenant(req).status());
  }
  const size_t n = result_.tenants.size();
  result_.by_tenant.assign(n, ReplayCounts{});
  wait_steps_.assign(n, {});
  wait_opens_.assign(n, {});
  failed_gen_.assign(n, 0);
  failed_at_.assign(n, 0);
  open_now_.assign(n, 0);
  tokens_now_.assign(n, 0);
  live_.assign(trace_.sessions.size(), Live{});
  for (size_t i = 0; i < trace_.sessions.size(); ++i) {
    const TraceSession& s = trace_.sessions[i];
    live_[i].tenant = tenant_index_.at(s.tenant);
    ++result_.by_tenant[live_[i].tenant].sessions;
    ++result_.total.sessions;
    Push(s.arrive_ms, Kind::kArrive, static_cast<uint32_t>(i));
  }
  return absl::OkStatus();
}

void Replayer::AdvanceTo(int64_t t) {
  const int64_t now = Now();
  if (t <= now) return;
  // The state of [now, t) is the state of the samples in it.
  for (; next_sample_ < t; next_sample_ += config_.sample_ms) Sample();
  const auto dt = static_cast<double>(t - now);
  const auto arriving = static_cast<double>(
      std::max<int64_t>(0, std::min(t, last_arrival_) - now));
  result_.total.open_ms += dt * open_total_;
  result_.total.open_ms_arriving += arriving * open_total_;
  for (size_t k = 0; k < open_now_.size(); ++k) {
    result_.by_tenant[k].open_ms += dt * open_now_[k];
    result_.by_tenant[k].open_ms_arriving += arriving * open_now_[k];
  }
  clock_.AdvanceMs(t - now);
}

void Replayer::Sample() {
  ReplaySample s;
  s.t_ms = next_sample_;
  s.device_bytes.assign(result_.tenants.size(), 0);
  for (const manager::TenantInfo& t : core_->ListTenants()) {
    for (const manager::TierUsage& u : t.usage) {
      if (u.tier == Tier::kDevice) {
        s.device_bytes[tenant_index_.at(t.tenant_id)] = u.used_bytes;
      }
    }
  }
  s.open = open_now_;
  s.tokens = tokens_now_;
  result_.samples.push_back(std::move(s));
}

void Replayer::Observe() {
  uint64_t total = 0;
  for (const manager::TenantInfo& t : core_->ListTenants()) {
    for (const manager::TierUsage& u : t.usage) {
      if (u.tier != Tier::kDevice) continue;
      ReplayCounts& c = Counts(t.tenant_id);
      c.peak_device_bytes = std::max(c.peak_device_bytes, u.used_bytes);
      total += u.used_bytes;
    }
  }
  result_.total.peak_device_bytes =
      std::max(result_.total.peak_device_bytes, total);
}

TierPlanOutcome Replayer::RunPlan(const TierPlan& plan) {
  TierPlanOutcome out;
  if (plan.token == 0) return out;
  const std::vector<absl::Status> ok(plan.commands.size(), absl::OkStatus());
  if (absl::Status st = core_->FinishTierPlan(plan.token, ok, &out); !st.ok()) {
    if (fatal_.ok()) fatal_ = st;
    return out;
  }
  ++result_.plans;
  uint64_t planned = 0;
  for (const TierCommand& c : plan.commands) {
    const uint64_t n = c.blocks.size();
    planned += n;
    ReplayCounts& t = Counts(c.tenant_id);
    uint64_t ReplayCounts::*field = &ReplayCounts::demotions;
    switch (c.kind) {
      case TierCommand::Kind::kDemote:
        field = &ReplayCounts::demotions;
        break;
      case TierCommand::Kind::kSpill:
        field = &ReplayCounts::spills;
        break;
      case TierCommand::Kind::kRestore:
        field = &ReplayCounts::restores;
        break;
      case TierCommand::Kind::kEvict:
        field = &ReplayCounts::evictions;
        break;
    }
    t.*field += n;
    result_.total.*field += n;
  }
  result_.unapplied += planned - std::min<uint64_t>(planned, out.applied());
  if (out.device_bytes_freed > 0) ++release_gen_;
  changed_ = true;
  return out;
}

absl::Status Replayer::Reclaim(
    const absl::Status& refused, AdmissionShortfall* sf,
    const std::function<absl::Status(AdmissionShortfall*)>& retry) {
  ++result_.reclaim_rounds;
  ReclaimReport report;
  absl::Status st = manager::ReclaimRound(
      core_.get(), refused, sf, absl::InfiniteFuture(),
      [this](const TierPlan& p) { return RunPlan(p); }, retry, &report);
  if (!fatal_.ok()) return fatal_;
  return st;
}

template <typename T>
absl::StatusOr<T> Replayer::Admit(
    uint32_t i,
    const std::function<absl::StatusOr<T>(AdmissionShortfall*)>& call) {
  AdmissionShortfall sf;
  absl::StatusOr<T> r = call(&sf);
  if (!r.ok() && absl::IsResourceExhausted(r.status()) &&
      sf.request_bytes > 0 && config_.reclaim) {
    const absl::Status st =
        Reclaim(r.status(), &sf, [&](AdmissionShortfall* again) {
          r = call(again);
          return r.status();
        });
    if (!fatal_.ok()) return fatal_;
    if (!st.ok() && r.ok()) return Fatal(i, st);
  }
  if (r.ok()) return r;
  if (absl::IsResourceExhausted(r.status()) && sf.request_bytes > 0) {
    return r.status();  // refused for room: the caller waits
  }
  return Fatal(i, r.status());
}

absl::Status Replayer::TryOpen(uint32_t i) {
  const TraceSession& s = trace_.sessions[i];
  manager::OpenSequenceRequest req;
  req.tenant_id = s.tenant;
  req.model = config_.model;
  req.spans = s.turns[0].prompt;
  req.block_tokens = config_.block_tokens;
  req.policy = config_.policy;
  absl::StatusOr<manager::SequenceInfo> r = Admit<manager::SequenceInfo>(
      i, [&](AdmissionShortfall* sf) { return core_->OpenSequence(req, sf); });
  if (!r.ok()) return r.status();
  Live& l = live_[i];
  l.sequence_id = r->sequence_id;
  ReplayCounts& c = result_.by_tenant[l.tenant];
  for (ReplayCounts* x : {&c, &result_.total}) {
    ++x->admitted;
    x->tokens += Tokens(req.spans);
  }
  l.tokens = Tokens(req.spans);
  tokens_now_[l.tenant] += l.tokens;
  ++open_now_[l.tenant];
  ++open_total_;
  c.peak_open = std::max(c.peak_open, open_now_[l.tenant]);
  result_.total.peak_open = std::max(result_.total.peak_open, open_total_);
  changed_ = true;
  Observe();
  return absl::OkStatus();
}

absl::Status Replayer::TryStep(uint32_t i) {
  const TraceSession& s = trace_.sessions[i];
  Live& l = live_[i];
  const TraceTurn& turn = s.turns[l.turn];
  if (HasTiers()) {
    // The session's next call attends its KV: its spilled blocks come back
    // first (reclaiming room from other sessions when needed).
    uint32_t blocks = 0;
    ReclaimReport report;
    const absl::Status st = manager::RestoreRound(
        core_.get(), l.sequence_id, absl::InfiniteFuture(),
        [this](const TierPlan& p) { return RunPlan(p); }, &blocks, &report);
    if (report.stages > 0) ++result_.reclaim_rounds;
    if (!fatal_.ok()) return fatal_;
    if (!st.ok()) {
      return absl::IsResourceExhausted(st) ? st : Fatal(i, st);
    }
  }
  manager::ExtendSequenceRequest req;
  req.tenant_id = s.tenant;
  req.sequence_id = l.sequence_id;
  req.spans = l.response ? turn.response : turn.prompt;
  req.new_turn = !l.response || turn.prompt.empty();
  absl::StatusOr<manager::ExtendSequenceResult> r =
      Admit<manager::ExtendSequenceResult>(i, [&](AdmissionShortfall* sf) {
        return core_->ExtendSequence(req, sf);
      });
  if (!r.ok()) return r.status();
  ReplayCounts& c = result_.by_tenant[l.tenant];
  if (r->demotion) {
    // The worker's Demote of the blocks the re-allocation shrank: done.
    auto fin =
        core_->FinishExtendDemotion(r->demotion->token, absl::OkStatus());
    if (!fin.ok()) return Fatal(i, fin.status());
    c.policy_demotions += fin->demoted_blocks.size();
    result_.total.policy_demotions += fin->demoted_blocks.size();
  }
  c.tokens += Tokens(req.spans);
  result_.total.tokens += Tokens(req.spans);
  l.tokens += Tokens(req.spans);
  tokens_now_[l.tenant] += Tokens(req.spans);
  changed_ = true;
  Observe();
  return absl::OkStatus();
}

absl::Status Replayer::AfterPrompt(uint32_t i) {
  Live& l = live_[i];
  const TraceTurn& turn = trace_.sessions[i].turns[l.turn];
  if (turn.response.empty()) return AfterResponse(i);
  l.phase = Phase::kBusy;
  l.response = true;
  Push(Now() + turn.decode_ms, Kind::kResponse, i);
  return absl::OkStatus();
}

absl::Status Replayer::AfterResponse(uint32_t i) {
  Live& l = live_[i];
  const TraceSession& s = trace_.sessions[i];
  ++result_.by_tenant[l.tenant].turns;
  ++result_.total.turns;
  if (l.turn + 1 == s.turns.size()) {
    TRIAX_RETURN_IF_ERROR(Close(i));
    ++result_.by_tenant[l.tenant].completed;
    ++result_.total.completed;
    return absl::OkStatus();
  }
  l.phase = Phase::kIdle;
  Push(Now() + s.turns[l.turn + 1].think_ms, Kind::kTurn, i);
  return absl::OkStatus();
}

absl::Status Replayer::Close(uint32_t i) {
  Live& l = live_[i];
  const TraceSession& s = trace_.sessions[i];
  manager::CloseSequenceRequest req;
  req.tenant_id = s.tenant;
  req.sequence_id = l.sequence_id;
  if (auto r = core_->CloseSequence(req); !r.ok()) return Fatal(i, r.status());
  --open_now_[l.tenant];
  --open_total_;
  tokens_now_[l.tenant] -= l.tokens;
  l.phase = Phase::kDone;
  ++done_;
  ++release_gen_;
  changed_ = true;
  return absl::OkStatus();
}

void Replayer::Wait(uint32_t i, Phase phase) {
  Live& l = live_[i];
  l.phase = phase;
  l.wait_since = Now();
  l.wait_id = next_wait_id_++;
  (phase == Phase::kWaitOpen ? wait_opens_ : wait_steps_)[l.tenant].push_back(
      i);
  Push(Now() + config_.patience_ms, Kind::kGiveUp, i, l.wait_id);
}

absl::Status Replayer::Attempt(uint32_t i, bool waiting) {
  Live& l = live_[i];
  const bool open = l.phase == Phase::kPending || l.phase == Phase::kWaitOpen;
  const absl::Status st = open ? TryOpen(i) : TryStep(i);
  if (absl::IsResourceExhausted(st)) {
    failed_gen_[l.tenant] = release_gen_;
    failed_at_[l.tenant] = Now();
    if (!waiting) Wait(i, open ? Phase::kWaitOpen : Phase::kWaitStep);
    return st;
  }
  TRIAX_RETURN_IF_ERROR(st);
  if (waiting) {
    const int64_t waited = Now() - l.wait_since;
    ReplayCounts& c = result_.by_tenant[l.tenant];
    for (ReplayCounts* x : {&c, &result_.total}) {
      if (open) {
        ++x->admitted_after_wait;
        x->open_wait_ms += waited;
        x->open_wait_max_ms = std::max(x->open_wait_max_ms, waited);
      } else {
        ++x->turn_waits;
        x->turn_wait_ms += waited;
      }
    }
  }
  l.wait_id = 0;
  if (open) {
    l.turn = 0;
    return AfterPrompt(i);
  }
  return l.response ? AfterResponse(i) : AfterPrompt(i);
}

absl::Status Replayer::GiveUp(uint32_t i) {
  Live& l = live_[i];
  const int64_t waited = Now() - l.wait_since;
  ReplayCounts& c = result_.by_tenant[l.tenant];
  const bool open = l.phase == Phase::kWaitOpen;
  for (ReplayCounts* x : {&c, &result_.total}) {
    if (open) {
      ++x->refused;
      x->open_wait_ms += waited;
      x->open_wait_max_ms = std::max(x->open_wait_max_ms, waited);
    } else {
      ++x->dropped;
      ++x->turn_waits;
      x->turn_wait_ms += waited;
    }
  }
  l.wait_id = 0;
  if (open) {
    l.phase = Phase::kDone;
    ++done_;
    return absl::OkStatus();
  }
  return Close(i);
}

absl::Status Replayer::Pass() {
  while (true) {
    // The oldest head of the tenants that may retry (a tenant's head: its
    // oldest in-flight step, else its oldest Open), so that no tenant is
    // served first by rule: ordering every in-flight step before every
    // Open across tenants starved a tenant that arrives when another's
    // sessions fill the pool (none of its Opens ever went first).
    std::deque<uint32_t>* best = nullptr;
    std::tuple<int64_t, bool, uint32_t> best_key;
    for (size_t t = 0; t < wait_opens_.size(); ++t) {
      if (!Eligible(t)) continue;
      PurgeFront(&wait_steps_[t]);
      PurgeFront(&wait_opens_[t]);
      std::deque<uint32_t>* q = !wait_steps_[t].empty()   ? &wait_steps_[t]
                                : !wait_opens_[t].empty() ? &wait_opens_[t]
                                                          : nullptr;
      if (q == nullptr) continue;
      const uint32_t i = q->front();
      const auto key =
          std::make_tuple(live_[i].wait_since, q == &wait_opens_[t], i);
      if (best == nullptr || key < best_key) {
        best = q;
        best_key = key;
      }
    }
    if (best == nullptr) return absl::OkStatus();
    const absl::Status st = Attempt(best->front(), /*waiting=*/true);
    // Refused: Attempt marked the tenant, which waits for the next release
    // or retry_ms.
    if (absl::IsResourceExhausted(st)) continue;
    TRIAX_RETURN_IF_ERROR(st);
    best->pop_front();
  }
}

absl::Status Replayer::BackgroundRound() {
  if (!config_.reclaim || !changed_ || !core_->NeedsReclaim()) {
    return absl::OkStatus();
  }
  ++result_.background_rounds;
  core_->RefreshRanking();
  bool applied = false;
  TierPlanOutcome out = RunPlan(core_->PlanPressure());
  for (int stage = 1; out.applied() > 0; ++stage) {
    applied = true;
    if (stage >= config_.max_background_stages || !core_->NeedsReclaim()) {
      break;
    }
    core_->RefreshRanking();
    out = RunPlan(core_->PlanPressure());
  }
  TRIAX_RETURN_IF_ERROR(fatal_);
  // A round that took nothing is not repeated until something changes.
  changed_ = applied;
  return absl::OkStatus();
}

absl::Status Replayer::Handle(const Ev& e) {
  const uint32_t i = e.session;
  Live& l = live_[i];
  switch (e.kind) {
    case Kind::kArrive:
      PurgeFront(&wait_opens_[l.tenant]);
      if (!wait_opens_[l.tenant].empty()) {
        Wait(i, Phase::kWaitOpen);  // behind the tenant's waiting Opens
        return absl::OkStatus();
      }
      break;
    case Kind::kTurn:
      l.turn += 1;
      l.response = trace_.sessions[i].turns[l.turn].prompt.empty();
      {
        // The session is active again (as a frontend reports it).
        manager::ReportAccessRequest req;
        req.tenant_id = trace_.sessions[i].tenant;
        req.sequence_id = l.sequence_id;
        req.active = true;
        auto plan = core_->ReportAccess(req);
        if (!plan.ok()) return Fatal(i, plan.status());
        RunPlan(*plan);
        TRIAX_RETURN_IF_ERROR(fatal_);
      }
      break;
    case Kind::kResponse:
      break;
    case Kind::kGiveUp:
      if (l.wait_id != e.wait_id) return absl::OkStatus();
      TRIAX_RETURN_IF_ERROR(GiveUp(i));
      return Pass();
    case Kind::kTick:
      TRIAX_RETURN_IF_ERROR(BackgroundRound());
      if (done_ < live_.size()) Push(Now() + config_.tick_ms, Kind::kTick);
      return Pass();
  }
  const uint64_t gen = release_gen_;
  const absl::Status st = Attempt(i, /*waiting=*/false);
  if (!st.ok() && !absl::IsResourceExhausted(st)) return st;
  return release_gen_ != gen ? Pass() : absl::OkStatus();
}

absl::Status Replayer::Run() {
  const auto wall0 = std::chrono::steady_clock::now();
  // Samples and the span start at the first arrival.
  const int64_t start = trace_.sessions.front().arrive_ms;
  last_arrival_ = trace_.sessions.back().arrive_ms;
  result_.arrival_span_ms = last_arrival_ - start;
  next_sample_ = start;
  AdvanceTo(start);
  Push(start, Kind::kTick);
  while (!events_.empty()) {
    const Ev e = events_.top();
    events_.pop();
    if (e.kind == Kind::kTick && done_ == live_.size()) continue;
    AdvanceTo(e.t);
    TRIAX_RETURN_IF_ERROR(Handle(e));
  }
  result_.span_ms = Now() - start;
  // The last sample: the state at the end.
  if (next_sample_ <= Now()) Sample();
  for (ReplaySample& s : result_.samples) s.t_ms -= start;
  const manager::PressureState p = core_->GetPressure(0);
  result_.core_demotions = p.demotions;
  result_.core_spills = p.spills;
  result_.core_restores = p.restores;
  result_.core_evictions = p.evictions;
  result_.wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0)
          .count();
  return absl::OkStatus();
}

}  // namespace

double ReplayResult::HeldBitsPerValue() const {
  double bytes = 0, tokens = 0;
  for (const ReplaySample& s : samples) {
    if (s.t_ms > arrival_span_ms) break;
    for (uint64_t b : s.device_bytes) bytes += static_cast<double>(b);
    for (uint64_t t : s.tokens) tokens += static_cast<double>(t);
  }
  if (tokens <= 0 || values_per_token == 0) return 0;
  return bytes * 8.0 / (tokens * static_cast<double>(values_per_token));
}

absl::StatusOr<ReplayResult> RunReplay(const Trace& trace,
                                       const ReplayConfig& config) {
  if (trace.sessions.empty()) {
    return absl::InvalidArgumentError("the trace has no sessions");
  }
  Replayer r(trace, config);
  TRIAX_RETURN_IF_ERROR(r.Setup());
  TRIAX_RETURN_IF_ERROR(r.Run());
  return std::move(r.result());
}

}  // namespace triax::bench::capacity
