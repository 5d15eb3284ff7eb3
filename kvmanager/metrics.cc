#include "kvmanager/metrics.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "kernels/layout.h"

namespace triax::manager {
namespace {

using prometheus::MetricFamily;
using Labels = std::vector<prometheus::ClientMetric::Label>;

constexpr char kP[] = "triaxkv_manager_";
constexpr char kOther[] = "_other";

std::string Name(absl::string_view suffix) { return absl::StrCat(kP, suffix); }

// "EVENT_BLOCK_SPILLED" -> "block_spilled".
std::string KindLabel(EventKind k) {
  std::string name = EventKindName(k);
  absl::string_view v = name;
  absl::ConsumePrefix(&v, "EVENT_");
  return absl::AsciiStrToLower(v);
}

std::string EncodingLabel(const Encoding& e) {
  char buf[64];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

// The value of `key` in a "k=v k=v" event detail; 0 when absent.
uint64_t DetailValue(absl::string_view detail, absl::string_view key) {
  for (absl::string_view kv : absl::StrSplit(detail, ' ')) {
    if (absl::ConsumePrefix(&kv, key) && absl::ConsumePrefix(&kv, "=")) {
      uint64_t v = 0;
      return absl::SimpleAtoi(kv, &v) ? v : 0;
    }
  }
  return 0;
}

// The RPCs that admit device bytes, whose RESOURCE_EXHAUSTED answers are
// admission refusals.
constexpr const char* kAdmittingMethods[] = {"OpenSequence", "ExtendSequence",
                                             "ForkSequence", "TransferSequence",
                                             "DemoteBlocks"};

}  // namespace

ManagerMetrics::ManagerMetrics(ManagerCore* core, const RpcMetrics* rpc,
                               ManagerMetricsOptions options)
    : core_(core),
      rpc_(rpc),
      options_(options),
      events_before_(core->events().AppendedByKind()) {
  EventFilter transfers;
  transfers.kind = EventKind::kSequenceTransferred;
  sub_ = core_->events().Subscribe(transfers, /*from_id=*/0);
  sub_->SetNotify([this] { Drain(); });
  Drain();  // arms the notification
}

ManagerMetrics::~ManagerMetrics() { sub_->Cancel(); }

void ManagerMetrics::Drain() {
  Event e;
  absl::Status end;
  for (;;) {
    const EventSubscription::Result r = sub_->Next(&e, &end);
    if (r == EventSubscription::Result::kEmpty) return;
    absl::MutexLock lock(&mu_);
    if (r == EventSubscription::Result::kEnded) {
      if (!stream_ended_ && end.code() != absl::StatusCode::kCancelled) {
        Log(LogLevel::kWarn, "metrics", "transfer byte counting stopped",
            Kv("error", end.ToString()));
      }
      stream_ended_ = true;
      return;
    }
    transfer_wire_bytes_ += DetailValue(e.detail, "wire_bytes");
    transfer_bytes_ += DetailValue(e.detail, "bytes");
  }
}

std::vector<MetricFamily> ManagerMetrics::Collect() const {
  std::vector<MetricFamily> out;
  CollectWorkers(&out);
  CollectTenants(&out);
  CollectBlocks(&out);
  CollectEvents(&out);
  return out;
}

void ManagerMetrics::CollectWorkers(std::vector<MetricFamily>* out) const {
  MetricFamily workers = GaugeFamily(
      Name("workers"), "Registered workers by state (up, suspect, down).");
  MetricFamily capacity = GaugeFamily(
      Name("worker_capacity_bytes"),
      "A worker's capacity by tier (device pool, host and disk spill tiers).");
  MetricFamily used = GaugeFamily(
      Name("worker_used_bytes"),
      "Bytes a worker reports in use by tier (device: target and window "
      "pages), as of its last heartbeat.");
  MetricFamily reserved = GaugeFamily(
      Name("worker_reserved_bytes"),
      "Device bytes the manager has charged to a worker (the blocks placed "
      "on it).");
  MetricFamily window =
      GaugeFamily(Name("worker_window_bytes"),
                  "Device bytes of a worker's BF16 recent-window pages.");
  MetricFamily format_pages =
      GaugeFamily(Name("worker_pages"),
                  "Target pages a worker holds by K format (last heartbeat).");
  MetricFamily format_bytes =
      GaugeFamily(Name("worker_format_bytes"),
                  "Bytes of the target pages a worker holds by K format.");
  MetricFamily tier_blocks =
      GaugeFamily(Name("worker_tier_blocks"),
                  "Blocks in a worker's host and disk spill tiers.");
  MetricFamily frag = GaugeFamily(
      Name("worker_fragmentation_ratio"),
      "Fraction of a worker's free arena bytes not in whole free frames.");
  MetricFamily frames =
      GaugeFamily(Name("worker_frames"), "A worker's arena frames by state.");
  MetricFamily sequences = GaugeFamily(Name("worker_sequences"),
                                       "Open sequences placed on a worker.");
  MetricFamily spills = CounterFamily(
      Name("worker_spills_total"),
      "Blocks a worker spilled (device to tier, or between tiers), as it "
      "reports them.");
  MetricFamily restores =
      CounterFamily(Name("worker_restores_total"), "Blocks a worker restored.");
  MetricFamily evictions =
      CounterFamily(Name("worker_evictions_total"), "Blocks a worker evicted.");
  MetricFamily checksum =
      CounterFamily(Name("worker_checksum_failures_total"),
                    "Restores a worker refused for a bad CRC32C.");
  MetricFamily compactions = CounterFamily(Name("worker_compactions_total"),
                                           "Arena compactions of a worker.");
  std::map<std::string, int> by_state = {
      {"up", 0}, {"suspect", 0}, {"down", 0}};
  for (const WorkerInfo& w : core_->ListWorkers()) {
    ++by_state[WorkerStateName(w.state)];
    const Labels id = {{"worker", w.worker_id}};
    auto with = [&id](const char* k, std::string v) {
      Labels l = id;
      l.push_back({k, std::move(v)});
      return l;
    };
    const Inventory& inv = w.inventory;
    AddSample(&capacity, with("tier", "device"),
              static_cast<double>(w.capacity_bytes));
    AddSample(&used, with("tier", "device"),
              static_cast<double>(inv.used_bytes));
    for (const TierInventory& t : inv.tiers) {
      AddSample(&capacity, with("tier", TierLabel(t.tier)),
                static_cast<double>(t.capacity_bytes));
      AddSample(&used, with("tier", TierLabel(t.tier)),
                static_cast<double>(t.used_bytes));
      AddSample(&tier_blocks, with("tier", TierLabel(t.tier)),
                static_cast<double>(t.blocks));
    }
    AddSample(&reserved, id, static_cast<double>(w.reserved_bytes));
    AddSample(&window, id, static_cast<double>(inv.window_bytes));
    for (const FormatInventory& f : inv.formats) {
      AddSample(&format_pages, with("format", kernels::FormatName(f.format)),
                static_cast<double>(f.pages_used));
      AddSample(&format_bytes, with("format", kernels::FormatName(f.format)),
                static_cast<double>(f.bytes_used));
    }
    AddSample(&frag, id, inv.fragmentation);
    AddSample(&frames, with("state", "total"), static_cast<double>(inv.frames));
    AddSample(&frames, with("state", "free"),
              static_cast<double>(inv.free_frames));
    AddSample(&sequences, id, w.sequences);
    AddSample(&spills, id, static_cast<double>(inv.spills));
    AddSample(&restores, id, static_cast<double>(inv.restores));
    AddSample(&evictions, id, static_cast<double>(inv.evictions));
    AddSample(&checksum, id, static_cast<double>(inv.checksum_failures));
    AddSample(&compactions, id, static_cast<double>(inv.compactions));
  }
  for (const auto& [state, n] : by_state) {
    AddSample(&workers, {{"state", state}}, n);
  }

  // Pools against their watermarks, and the pressure manager's counters.
  const PressureState p = core_->GetPressure(/*top=*/0);
  MetricFamily pool_cap = GaugeFamily(
      Name("pool_capacity_bytes"),
      "Capacity of a worker's pool (device) or spill tier (host, disk) as "
      "the pressure manager sees it.");
  MetricFamily pool_used = GaugeFamily(
      Name("pool_used_bytes"),
      "Bytes the manager accounts in a worker's pool or spill tier.");
  MetricFamily high =
      GaugeFamily(Name("pool_high_watermark_bytes"),
                  "Above this the pressure manager reclaims from the pool.");
  MetricFamily low = GaugeFamily(Name("pool_low_watermark_bytes"),
                                 "A reclaim brings the pool down to this.");
  for (const PoolState& pool : p.pools) {
    const Labels l = {{"worker", pool.worker_id},
                      {"tier", TierLabel(pool.tier)}};
    AddSample(&pool_cap, l, static_cast<double>(pool.capacity_bytes));
    AddSample(&pool_used, l, static_cast<double>(pool.used_bytes));
    AddSample(&high, l, static_cast<double>(pool.high_watermark_bytes));
    AddSample(&low, l, static_cast<double>(pool.low_watermark_bytes));
  }
  MetricFamily actions = CounterFamily(
      Name("pressure_actions_total"),
      "Tier-plan actions the manager applied (pressure, admission, prefetch), "
      "by action.");
  AddSample(&actions, {{"action", "demote"}}, static_cast<double>(p.demotions));
  AddSample(&actions, {{"action", "spill"}}, static_cast<double>(p.spills));
  AddSample(&actions, {{"action", "restore"}}, static_cast<double>(p.restores));
  AddSample(&actions, {{"action", "evict"}}, static_cast<double>(p.evictions));
  MetricFamily ranked =
      GaugeFamily(Name("pressure_snapshot_blocks"),
                  "Blocks in the pressure manager's last ranking snapshot.");
  AddSample(&ranked, {}, static_cast<double>(p.snapshot_blocks));
  MetricFamily ranking =
      GaugeFamily(Name("pressure_ranking_seconds"),
                  "Time the last ranking of the snapshot took.");
  AddSample(&ranking, {}, p.ranking_ms / 1000.0);
  MetricFamily prefix_blocks = GaugeFamily(Name("prefix_index_blocks"),
                                           "Blocks in the prefix-reuse index.");
  AddSample(&prefix_blocks, {}, static_cast<double>(p.prefix_index_blocks));
  MetricFamily prefix_hits = CounterFamily(
      Name("prefix_hits_total"), "Opens that reused a cached prefix.");
  AddSample(&prefix_hits, {}, static_cast<double>(p.prefix_hits));
  MetricFamily prefix_reused =
      CounterFamily(Name("prefix_reused_blocks_total"),
                    "Blocks shared by Opens that reused a prefix.");
  AddSample(&prefix_reused, {}, static_cast<double>(p.prefix_reused_blocks));

  for (MetricFamily* f :
       {&workers,     &capacity,     &used,         &reserved,
        &window,      &format_pages, &format_bytes, &tier_blocks,
        &frag,        &frames,       &sequences,    &spills,
        &restores,    &evictions,    &checksum,     &compactions,
        &pool_cap,    &pool_used,    &high,         &low,
        &actions,     &ranked,       &ranking,      &prefix_blocks,
        &prefix_hits, &prefix_reused}) {
    out->push_back(std::move(*f));
  }
}

std::string ManagerMetrics::TenantLabel(
    const std::string& tenant_id,
    const std::vector<std::string>& tenants) const {
  auto it = std::lower_bound(tenants.begin(), tenants.end(), tenant_id);
  if (it == tenants.end() || *it != tenant_id ||
      static_cast<size_t>(it - tenants.begin()) >= options_.max_tenants) {
    return kOther;
  }
  return tenant_id;
}

void ManagerMetrics::CollectTenants(std::vector<MetricFamily>* out) const {
  std::vector<TenantInfo> tenants = core_->ListTenants();
  std::sort(tenants.begin(), tenants.end(),
            [](const TenantInfo& a, const TenantInfo& b) {
              return a.tenant_id < b.tenant_id;
            });
  MetricFamily count = GaugeFamily(Name("tenants"), "Tenants.");
  AddSample(&count, {}, static_cast<double>(tenants.size()));
  MetricFamily used =
      GaugeFamily(Name("tenant_used_bytes"),
                  "Bytes charged to a tenant by tier (tenants past "
                  "--metrics_max_tenants summed as tenant=\"_other\").");
  MetricFamily floor = GaugeFamily(Name("tenant_floor_bytes"),
                                   "A tenant's guaranteed bytes by tier.");
  MetricFamily ceiling = GaugeFamily(
      Name("tenant_ceiling_bytes"),
      "A tenant's admission limit by tier (tiers with a budget only).");
  MetricFamily open =
      GaugeFamily(Name("tenant_open_sequences"), "A tenant's open sequences.");
  std::map<std::pair<std::string, std::string>, double> used_sum;
  std::map<std::string, double> open_sum;
  for (size_t i = 0; i < tenants.size(); ++i) {
    const TenantInfo& t = tenants[i];
    const bool own = i < options_.max_tenants;
    const std::string label = own ? t.tenant_id : kOther;
    for (const TierUsage& u : t.usage) {
      used_sum[{label, TierLabel(u.tier)}] += static_cast<double>(u.used_bytes);
    }
    open_sum[label] += t.open_sequences;
    if (!own) continue;
    for (const Budget& b : t.budgets) {
      const Labels l = {{"tenant", label}, {"tier", TierLabel(b.tier)}};
      AddSample(&floor, l, static_cast<double>(b.floor_bytes));
      AddSample(&ceiling, l, static_cast<double>(b.ceiling_bytes));
    }
  }
  for (const auto& [key, v] : used_sum) {
    AddSample(&used, {{"tenant", key.first}, {"tier", key.second}}, v);
  }
  for (const auto& [tenant, v] : open_sum) {
    AddSample(&open, {{"tenant", tenant}}, v);
  }
  for (MetricFamily* f : {&count, &used, &floor, &ceiling, &open}) {
    out->push_back(std::move(*f));
  }
}

void ManagerMetrics::CollectBlocks(std::vector<MetricFamily>* out) const {
  std::vector<std::string> tenant_ids;
  for (const TenantInfo& t : core_->ListTenants()) {
    tenant_ids.push_back(t.tenant_id);
  }
  std::sort(tenant_ids.begin(), tenant_ids.end());
  // (tier, encoding, tenant) -> blocks, bytes. A block shared by forks is
  // counted once, for the tenant of the first sequence listing it.
  std::map<std::tuple<std::string, std::string, std::string>,
           std::pair<double, double>>
      sums;
  absl::flat_hash_set<uint64_t> seen;
  auto sequences = core_->ListSequences("", /*include_closed=*/false);
  if (sequences.ok()) {
    for (const SequenceInfo& brief : *sequences) {
      auto s = core_->GetSequence("", brief.sequence_id);
      if (!s.ok()) continue;  // closed since the listing
      const std::string tenant = TenantLabel(s->tenant_id, tenant_ids);
      for (const BlockPlan& b : s->blocks) {
        if (!seen.insert(b.lineage_id).second) continue;
        const std::string tier = b.evicted ? "evicted" : TierLabel(b.tier);
        auto& [blocks, bytes] = sums[{tier, EncodingLabel(b.encoding), tenant}];
        blocks += 1;
        if (!b.evicted) {
          bytes += static_cast<double>(s->model.n_layers) *
                   static_cast<double>(kernels::PageBytes(
                       b.encoding, PageShapeOf(s->model, s->block_tokens)));
        }
      }
    }
  }
  MetricFamily blocks = GaugeFamily(
      Name("blocks"),
      "Live blocks of open sequences by tier (device, host, disk, evicted), "
      "encoding and tenant.");
  MetricFamily bytes = GaugeFamily(
      Name("block_bytes"),
      "Bytes of live blocks of open sequences by tier, encoding and tenant "
      "(all layers; evicted blocks hold none).");
  for (const auto& [key, v] : sums) {
    const Labels l = {{"tier", std::get<0>(key)},
                      {"encoding", std::get<1>(key)},
                      {"tenant", std::get<2>(key)}};
    AddSample(&blocks, l, v.first);
    AddSample(&bytes, l, v.second);
  }
  out->push_back(std::move(blocks));
  out->push_back(std::move(bytes));
}

void ManagerMetrics::CollectEvents(std::vector<MetricFamily>* out) const {
  MetricFamily events = CounterFamily(
      Name("events_total"),
      "Lifecycle events appended to the event log since start, by kind "
      "(block_spilled, block_restored, block_evicted, block_demoted, "
      "transfer_failed, ...).");
  MetricFamily wire = CounterFamily(
      Name("transfer_wire_bytes_total"),
      "Bytes committed transfers moved between workers, as sent.");
  MetricFamily moved = CounterFamily(
      Name("transfer_bytes_total"),
      "Device bytes of the sequences committed transfers placed on their "
      "destinations.");
  const std::array<uint64_t, EventLog::kKinds> appended =
      core_->events().AppendedByKind();
  for (int k = static_cast<int>(EventKind::kBlockCreated);
       k <= static_cast<int>(EventKind::kLastEventKind); ++k) {
    AddSample(&events, {{"kind", KindLabel(static_cast<EventKind>(k))}},
              static_cast<double>(appended[k] - events_before_[k]));
  }
  {
    absl::MutexLock lock(&mu_);
    AddSample(&wire, {}, static_cast<double>(transfer_wire_bytes_));
    AddSample(&moved, {}, static_cast<double>(transfer_bytes_));
  }
  out->push_back(std::move(events));
  out->push_back(std::move(wire));
  out->push_back(std::move(moved));
  if (rpc_ != nullptr) {
    MetricFamily refusals = CounterFamily(
        Name("admission_refusals_total"),
        "Calls that admit device bytes answered RESOURCE_EXHAUSTED (over a "
        "tenant's ceiling or a worker's room after reclaiming), by method.");
    for (const char* m : kAdmittingMethods) {
      AddSample(
          &refusals, {{"method", m}},
          static_cast<double>(rpc_->Requests(
              m, static_cast<int>(absl::StatusCode::kResourceExhausted))));
    }
    out->push_back(std::move(refusals));
  }
}

void ManagerReadiness::SetLeaderCheck(std::function<absl::Status()> check) {
  absl::MutexLock lock(&mu_);
  leader_check_ = std::move(check);
}

HttpResponse ManagerReadiness::Ready() const {
  if (!serving_.load()) return ProbeResponse(false, "not serving");
  std::function<absl::Status()> check;
  {
    absl::MutexLock lock(&mu_);
    check = leader_check_;
  }
  if (check) {
    if (absl::Status s = check(); !s.ok()) {
      return ProbeResponse(false,
                           absl::StrCat("not the leader: ", s.message()));
    }
  }
  return ProbeResponse(true, "");
}

}  // namespace triax::manager
