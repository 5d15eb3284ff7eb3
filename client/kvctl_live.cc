#include "client/kvctl_live.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvctl_format.h"

namespace triax::kvctl {
namespace {

std::string Percent(uint64_t part, uint64_t whole) {
  if (whole == 0) return "-";
  return absl::StrFormat(
      "%.1f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

// Per second over `seconds`; "-" without a previous sample. A counter that
// went down (the worker or manager restarted) counts from zero.
std::string Rate(uint64_t now, const uint64_t* prev, double seconds) {
  if (prev == nullptr || seconds <= 0) return "-";
  const uint64_t delta = now >= *prev ? now - *prev : now;
  return absl::StrFormat("%.1f", static_cast<double>(delta) / seconds);
}

std::string SignedBytes(uint64_t now, uint64_t prev) {
  if (now == prev) return "0";
  return now > prev ? absl::StrCat("+", HumanBytes(now - prev))
                    : absl::StrCat("-", HumanBytes(prev - now));
}

uint64_t TierUsed(const triax::v1::TenantInfo& t, triax::v1::Tier tier) {
  for (const auto& u : t.usage()) {
    if (u.tier() == tier) return u.used_bytes();
  }
  return 0;
}

uint64_t TierUsed(const triax::v1::Inventory& inv, triax::v1::Tier tier) {
  for (const auto& t : inv.tiers()) {
    if (t.tier() == tier) return t.used_bytes();
  }
  return 0;
}

const triax::v1::Budget* DeviceBudget(const triax::v1::TenantInfo& t) {
  for (const auto& b : t.budgets()) {
    if (b.tier() == triax::v1::TIER_DEVICE) return &b;
  }
  return nullptr;
}

}  // namespace

std::string TopFrame(const TopSample& now, const TopSample* prev) {
  const double seconds =
      prev == nullptr
          ? 0
          : static_cast<double>(now.unix_ms - prev->unix_ms) / 1000.0;
  std::string out = absl::StrCat(
      "kvctl top  ", UnixMsString(now.unix_ms), "  ",
      prev == nullptr ? std::string("rates: - (first frame)")
                      : absl::StrFormat("rates over %.2f s", seconds),
      "\n");

  std::map<std::string, const triax::v1::WorkerInfo*> before;
  if (prev != nullptr) {
    for (const auto& w : prev->workers.workers()) before[w.worker_id()] = &w;
  }
  std::vector<const triax::v1::WorkerInfo*> workers;
  for (const auto& w : now.workers.workers()) workers.push_back(&w);
  std::sort(workers.begin(), workers.end(),
            [](auto* a, auto* b) { return a->worker_id() < b->worker_id(); });
  Table wt({"WORKER", "STATE", "SEQS", "RESERVED", "USED", "CAPACITY", "USE",
            "HOST", "DISK", "SPILLS/S", "RESTORES/S", "EVICTIONS/S"});
  Table et({"WORKER", "ENCODING", "PAGES", "BYTES"});
  for (const triax::v1::WorkerInfo* w : workers) {
    const triax::v1::Inventory& inv = w->inventory();
    auto it = before.find(w->worker_id());
    const triax::v1::Inventory* p =
        it == before.end() ? nullptr : &it->second->inventory();
    const uint64_t spills = p ? p->spills() : 0;
    const uint64_t restores = p ? p->restores() : 0;
    const uint64_t evictions = p ? p->evictions() : 0;
    wt.AddRow({w->worker_id(), WorkerStateName(w->state()),
               absl::StrCat(w->sequences()), HumanBytes(w->reserved_bytes()),
               HumanBytes(inv.used_bytes()), HumanBytes(w->capacity_bytes()),
               Percent(inv.used_bytes(), w->capacity_bytes()),
               HumanBytes(TierUsed(inv, triax::v1::TIER_HOST)),
               HumanBytes(TierUsed(inv, triax::v1::TIER_DISK)),
               Rate(inv.spills(), p ? &spills : nullptr, seconds),
               Rate(inv.restores(), p ? &restores : nullptr, seconds),
               Rate(inv.evictions(), p ? &evictions : nullptr, seconds)});
    for (const auto& f : inv.formats()) {
      et.AddRow({w->worker_id(), FormatName(f.format()),
                 absl::StrCat(f.pages_used()), HumanBytes(f.bytes_used())});
    }
    if (inv.window_bytes() > 0) {
      et.AddRow(
          {w->worker_id(), "window", "-", HumanBytes(inv.window_bytes())});
    }
  }

  std::map<std::string, const triax::v1::TenantInfo*> tenants_before;
  if (prev != nullptr) {
    for (const auto& t : prev->tenants.tenants()) {
      tenants_before[t.tenant_id()] = &t;
    }
  }
  Table tt({"TENANT", "SEQS", "DEVICE", "DEVICE_DELTA", "HOST", "DISK",
            "CEILING", "USE"});
  for (const auto& t : now.tenants.tenants()) {
    const uint64_t device = TierUsed(t, triax::v1::TIER_DEVICE);
    auto it = tenants_before.find(t.tenant_id());
    const triax::v1::Budget* b = DeviceBudget(t);
    const uint64_t ceiling = b ? b->ceiling_bytes() : 0;
    tt.AddRow({t.tenant_id(), absl::StrCat(t.open_sequences()),
               HumanBytes(device),
               it == tenants_before.end()
                   ? "-"
                   : SignedBytes(device,
                                 TierUsed(*it->second, triax::v1::TIER_DEVICE)),
               HumanBytes(TierUsed(t, triax::v1::TIER_HOST)),
               HumanBytes(TierUsed(t, triax::v1::TIER_DISK)),
               ceiling ? HumanBytes(ceiling) : "-", Percent(device, ceiling)});
  }

  const triax::v1::GetPressureResponse& r = now.pressure;
  const triax::v1::GetPressureResponse* q =
      prev == nullptr ? nullptr : &prev->pressure;
  const uint64_t demotions = q ? q->demotions() : 0;
  const uint64_t spills = q ? q->spills() : 0;
  const uint64_t restores = q ? q->restores() : 0;
  const uint64_t evictions = q ? q->evictions() : 0;
  const uint64_t hits = q ? q->prefix_hits() : 0;
  absl::StrAppend(
      &out, "\nWORKERS\n", wt.Render(), "\nENCODINGS\n", et.Render(),
      "\nTENANTS\n", tt.Render(), "\nPRESSURE\n",
      "mode=", r.mode().empty() ? "-" : r.mode(),
      " snapshot_blocks=", r.snapshot_blocks(),
      " demotions/s=", Rate(r.demotions(), q ? &demotions : nullptr, seconds),
      " spills/s=", Rate(r.spills(), q ? &spills : nullptr, seconds),
      " restores/s=", Rate(r.restores(), q ? &restores : nullptr, seconds),
      " evictions/s=", Rate(r.evictions(), q ? &evictions : nullptr, seconds),
      " prefix_hits/s=", Rate(r.prefix_hits(), q ? &hits : nullptr, seconds),
      "\n");
  return out;
}

std::string PressureFrame(int64_t unix_ms,
                          const triax::v1::GetPressureResponse& resp) {
  return absl::StrCat("kvctl pressure  ", UnixMsString(unix_ms), "\n",
                      PressureReport(resp));
}

std::string FrameText(absl::string_view body, int64_t index, bool tty) {
  if (tty) return absl::StrCat("\x1b[H\x1b[2J", body);
  if (index == 0) return std::string(body);
  return absl::StrCat("---\n", body);
}

absl::StatusOr<double> ParseInterval(absl::string_view text) {
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || !std::isfinite(v) || v <= 0 || v > 3600) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--interval=\"", text, "\" is not a number of seconds in (0, 3600]"));
  }
  return v;
}

absl::StatusOr<int64_t> ParseCount(absl::string_view text) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--count=\"", text,
        "\" is not a whole number of frames >= 0 (0: until interrupted)"));
  }
  return v;
}

}  // namespace triax::kvctl
