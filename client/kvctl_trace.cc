#include "client/kvctl_trace.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/kvctl_format.h"

namespace triax::kvctl {
namespace {

// Keys in the order they are set, so the file reads ph, name, ts, pid, tid.
using json = nlohmann::ordered_json;
using triax::v1::Event;

constexpr int kTiers = 3;  // device, host, disk
const char* const kTierNames[kTiers] = {"device", "host", "disk"};
constexpr int kEventsTid = 1;

int TierIndex(absl::string_view name) {
  if (name == "host") return 1;
  if (name == "disk") return 2;
  return 0;
}

int64_t Micros(int64_t unix_ms) { return unix_ms * 1000; }

// "EVENT_BLOCK_SPILLED" -> "spilled", "EVENT_SEQUENCE_OPENED" ->
// "sequence_opened".
std::string InstantName(triax::v1::EventKind kind) {
  std::string name = EventKindName(kind);
  absl::AsciiStrToLower(&name);
  if (absl::StartsWith(name, "block_")) name = name.substr(6);
  return name;
}

bool IsBlockEvent(triax::v1::EventKind kind) {
  switch (kind) {
    case triax::v1::EVENT_BLOCK_CREATED:
    case triax::v1::EVENT_BLOCK_RETAGGED:
    case triax::v1::EVENT_BLOCK_SHARED:
    case triax::v1::EVENT_BLOCK_RELEASED:
    case triax::v1::EVENT_BLOCK_FREED:
    case triax::v1::EVENT_BLOCK_LOST:
    case triax::v1::EVENT_BLOCK_DEMOTED:
    case triax::v1::EVENT_BLOCK_SPILLED:
    case triax::v1::EVENT_BLOCK_RESTORED:
    case triax::v1::EVENT_BLOCK_EVICTED:
    case triax::v1::EVENT_BLOCK_TRANSFERRED:
    case triax::v1::EVENT_BLOCK_SEALED:
      return true;
    default:
      return false;
  }
}

// Where a block sits between two of its events.
struct Residence {
  std::string worker;
  int tier = 0;
  std::string encoding;
  int64_t start_ms = 0;
  const Event* opened_by = nullptr;
};

// The encoding and tier an event's detail names after "to=": the reconcile
// form "to=int4/host" or the plain "to=int4" (tier empty).
std::pair<std::string, std::string> DetailTo(const Event& e) {
  const std::string to = DetailValue(e.detail(), "to");
  const size_t slash = to.find('/');
  if (slash == std::string::npos) return {to, ""};
  return {to.substr(0, slash), to.substr(slash + 1)};
}

class TraceBuilder {
 public:
  TraceBuilder(const std::vector<Event>& events, int64_t end_unix_ms)
      : events_(events), end_ms_(end_unix_ms) {
    std::set<std::string> workers;
    std::set<uint64_t> lineages;
    for (const Event& e : events) {
      if (!e.worker_id().empty()) workers.insert(e.worker_id());
      if (!e.source_worker_id().empty()) workers.insert(e.source_worker_id());
      if (e.worker_id().empty()) manager_used_ = true;
      if (IsBlockEvent(e.kind()) && e.lineage_id() != 0) {
        lineages.insert(e.lineage_id());
      }
      end_ms_ = std::max(end_ms_, e.unix_ms());
    }
    int pid = 1;
    for (const std::string& w : workers) pids_[w] = pid++;
    manager_pid_ = pid;
    int rank = 0;
    for (uint64_t l : lineages) ranks_[l] = rank++;
  }

  std::string Build() {
    for (const Event& e : events_) {
      if (IsBlockEvent(e.kind()) && e.lineage_id() != 0) {
        BlockEvent(e);
      } else {
        const int pid = Pid(e.worker_id());
        Instant(e, pid, kEventsTid);
      }
    }
    for (auto& [lineage, r] : open_) Close(lineage, r, end_ms_, nullptr);
    open_.clear();

    std::vector<json> out;
    for (const auto& [worker, pid] : pids_)
      Process(&out, pid, "worker " + worker);
    if (manager_used_) Process(&out, manager_pid_, "manager");
    for (const auto& [pid_tid, name] : threads_) {
      out.push_back(
          Meta("thread_name", pid_tid.first, pid_tid.second, {{"name", name}}));
      out.push_back(Meta("thread_sort_index", pid_tid.first, pid_tid.second,
                         {{"sort_index", SortIndex(pid_tid.second)}}));
    }
    for (json& e : trace_) out.push_back(std::move(e));
    // One trace event per line: the file diffs and greps well.
    std::string text = "{\"traceEvents\":[\n";
    for (size_t i = 0; i < out.size(); ++i) {
      absl::StrAppend(&text, out[i].dump(), i + 1 < out.size() ? ",\n" : "\n");
    }
    absl::StrAppend(&text, "],\"displayTimeUnit\":\"ms\"}\n");
    return text;
  }

 private:
  int Pid(const std::string& worker) const {
    auto it = pids_.find(worker);
    return it == pids_.end() ? manager_pid_ : it->second;
  }

  int BlockTid(uint64_t lineage, int tier) const {
    return 2 + 3 * ranks_.at(lineage) + tier;
  }

  // Event threads first, then block threads grouped by tier.
  int SortIndex(int tid) const {
    if (tid == kEventsTid) return 0;
    const int rank = (tid - 2) / 3;
    const int tier = (tid - 2) % 3;
    return 1 + tier * static_cast<int>(ranks_.size()) + rank;
  }

  void UseThread(int pid, int tid, std::string name) {
    threads_.emplace(std::make_pair(pid, tid), std::move(name));
  }

  std::pair<int, int> BlockThread(const std::string& worker, uint64_t lineage,
                                  int tier) {
    const int pid = Pid(worker);
    const int tid = BlockTid(lineage, tier);
    UseThread(pid, tid, absl::StrCat(kTierNames[tier], " L", lineage));
    return {pid, tid};
  }

  static json Meta(const char* name, int pid, int tid, json args) {
    return json{{"ph", "M"},
                {"name", name},
                {"pid", pid},
                {"tid", tid},
                {"args", std::move(args)}};
  }

  void Process(std::vector<json>* out, int pid, const std::string& name) {
    out->push_back(Meta("process_name", pid, 0, {{"name", name}}));
    out->push_back(Meta("process_sort_index", pid, 0, {{"sort_index", pid}}));
  }

  void Instant(const Event& e, int pid, int tid) {
    if (tid == kEventsTid) UseThread(pid, tid, "events");
    json args = {{"id", e.id()}, {"kind", EventKindName(e.kind())}};
    if (e.lineage_id() != 0) args["lineage_id"] = e.lineage_id();
    if (!e.sequence_id().empty()) args["sequence_id"] = e.sequence_id();
    if (!e.tenant_id().empty()) args["tenant_id"] = e.tenant_id();
    if (!e.source_worker_id().empty()) {
      args["source_worker_id"] = e.source_worker_id();
    }
    if (!e.detail().empty()) args["detail"] = e.detail();
    if (!e.lineage_ids().empty()) {
      args["lineage_ids"] =
          std::vector<uint64_t>(e.lineage_ids().begin(), e.lineage_ids().end());
    }
    trace_.push_back(json{{"ph", "i"},
                          {"name", InstantName(e.kind())},
                          {"cat", "event"},
                          {"ts", Micros(e.unix_ms())},
                          {"pid", pid},
                          {"tid", tid},
                          {"s", "t"},
                          {"args", std::move(args)}});
  }

  void Close(uint64_t lineage, const Residence& r, int64_t end_ms,
             const Event* closed_by) {
    auto [pid, tid] = BlockThread(r.worker, lineage, r.tier);
    const Event& o = *r.opened_by;
    json args = {
        {"lineage_id", lineage},
        {"sequence_id", o.sequence_id()},
        {"tenant_id", o.tenant_id()},
        {"tag", TagString(o.tag())},
        {"tier", kTierNames[r.tier]},
        {"encoding", r.encoding},
        {"opened_by", EventKindName(o.kind())},
        {"closed_by", closed_by == nullptr ? std::string("end of trace")
                                           : EventKindName(closed_by->kind())},
        {"open", closed_by == nullptr}};
    trace_.push_back(json{{"ph", "X"},
                          {"name", r.encoding},
                          {"cat", "block"},
                          {"ts", Micros(r.start_ms)},
                          {"dur", Micros(end_ms - r.start_ms)},
                          {"pid", pid},
                          {"tid", tid},
                          {"args", std::move(args)}});
  }

  // Closes the block's open span (if any) at `e`; returns what it was.
  std::optional<Residence> CloseAt(const Event& e) {
    auto it = open_.find(e.lineage_id());
    if (it == open_.end()) return std::nullopt;
    Residence r = it->second;
    open_.erase(it);
    Close(e.lineage_id(), r, e.unix_ms(), &e);
    return r;
  }

  void Open(const Event& e, std::string worker, int tier,
            std::string encoding) {
    if (encoding.empty()) encoding = FormatName(e.format());
    open_[e.lineage_id()] = Residence{std::move(worker), tier,
                                      std::move(encoding), e.unix_ms(), &e};
    auto [pid, tid] =
        BlockThread(open_[e.lineage_id()].worker, e.lineage_id(), tier);
    Instant(e, pid, tid);
  }

  void BlockEvent(const Event& e) {
    const uint64_t lineage = e.lineage_id();
    auto [to_encoding, to_tier] = DetailTo(e);
    switch (e.kind()) {
      case triax::v1::EVENT_BLOCK_CREATED:
        CloseAt(e);
        Open(e, e.worker_id(), 0, DetailValue(e.detail(), "encoding"));
        return;
      case triax::v1::EVENT_BLOCK_DEMOTED:
      case triax::v1::EVENT_BLOCK_SPILLED:
      case triax::v1::EVENT_BLOCK_RESTORED: {
        std::optional<Residence> was = CloseAt(e);
        int tier = was ? was->tier : 0;
        std::string encoding = was ? was->encoding : "";
        if (e.kind() == triax::v1::EVENT_BLOCK_DEMOTED) {
          encoding = to_encoding;
        } else if (e.kind() == triax::v1::EVENT_BLOCK_SPILLED) {
          tier = TierIndex(DetailValue(e.detail(), "tier"));
        } else {
          tier = 0;
        }
        if (!to_tier.empty()) tier = TierIndex(to_tier);  // by=reconcile
        if (!to_encoding.empty()) encoding = to_encoding;
        Open(e, e.worker_id(), tier, encoding);
        return;
      }
      case triax::v1::EVENT_BLOCK_TRANSFERRED: {
        std::optional<Residence> was = CloseAt(e);
        std::string encoding = to_encoding;
        if (encoding.empty()) encoding = DetailValue(e.detail(), "encoding");
        if (encoding.empty() && was) encoding = was->encoding;
        const std::string source =
            was ? was->worker : std::string(e.source_worker_id());
        auto [spid, stid] = BlockThread(source, lineage, was ? was->tier : 0);
        Open(e, e.worker_id(), 0, encoding);
        auto [dpid, dtid] = BlockThread(e.worker_id(), lineage, 0);
        // A flow start binds to the slice enclosing it; the source span ends
        // at the transfer, so the start sits 1 us inside it (viewers differ
        // on whether a slice encloses its own end).
        int64_t from_us = Micros(e.unix_ms());
        if (was && was->start_ms < e.unix_ms()) from_us -= 1;
        trace_.push_back(json{{"ph", "s"},
                              {"name", "transfer"},
                              {"cat", "transfer"},
                              {"id", e.id()},
                              {"ts", from_us},
                              {"pid", spid},
                              {"tid", stid}});
        trace_.push_back(json{{"ph", "f"},
                              {"name", "transfer"},
                              {"cat", "transfer"},
                              {"id", e.id()},
                              {"ts", Micros(e.unix_ms())},
                              {"pid", dpid},
                              {"tid", dtid},
                              {"bp", "e"}});
        return;
      }
      case triax::v1::EVENT_BLOCK_SEALED: {
        // Written and encoded: the span of its writing ends, the block's
        // sealed span (same tier) begins.
        std::optional<Residence> was = CloseAt(e);
        std::string encoding = DetailValue(e.detail(), "encoding");
        if (encoding.empty() && was) encoding = was->encoding;
        Open(e, was ? was->worker : e.worker_id(), was ? was->tier : 0,
             encoding);
        return;
      }
      case triax::v1::EVENT_BLOCK_EVICTED:
      case triax::v1::EVENT_BLOCK_FREED:
      case triax::v1::EVENT_BLOCK_LOST: {
        std::optional<Residence> was = CloseAt(e);
        const std::string worker = was ? was->worker : e.worker_id();
        auto [pid, tid] = BlockThread(worker, lineage, was ? was->tier : 0);
        Instant(e, pid, tid);
        return;
      }
      default: {  // retagged, shared, released: the block stays where it is
        auto it = open_.find(lineage);
        const std::string worker =
            it == open_.end() ? e.worker_id() : it->second.worker;
        auto [pid, tid] = BlockThread(worker, lineage,
                                      it == open_.end() ? 0 : it->second.tier);
        Instant(e, pid, tid);
        return;
      }
    }
  }

  const std::vector<Event>& events_;
  int64_t end_ms_;
  std::map<std::string, int> pids_;
  int manager_pid_ = 1;
  bool manager_used_ = false;
  std::map<uint64_t, int> ranks_;
  std::map<uint64_t, Residence> open_;
  std::map<std::pair<int, int>, std::string> threads_;
  std::vector<json> trace_;
};

}  // namespace

std::string ChromeTraceJson(const std::vector<triax::v1::Event>& events,
                            int64_t end_unix_ms) {
  return TraceBuilder(events, end_unix_ms).Build();
}

absl::StatusOr<int64_t> ParseTimeFlag(absl::string_view flag,
                                      absl::string_view text) {
  const bool numeric =
      !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
        return absl::ascii_isdigit(static_cast<unsigned char>(c)) || c == '.';
      });
  if (numeric) {
    double seconds = 0;
    if (absl::SimpleAtod(text, &seconds) && std::isfinite(seconds) &&
        seconds < 1e12) {
      return static_cast<int64_t>(std::llround(seconds * 1000));
    }
  } else {
    absl::Time t;
    std::string err;
    if (absl::ParseTime(absl::RFC3339_full, std::string(text), &t, &err)) {
      return absl::ToUnixMillis(t);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=\"", text,
                   "\" is not an RFC 3339 time (2026-11-25T13:00:00Z) or "
                   "Unix seconds"));
}

}  // namespace triax::kvctl
