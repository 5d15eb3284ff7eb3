#include "kvmanager/dashboard.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/ids.h"
#include "kernels/layout.h"
#include "kvmanager/capacity_live.h"

namespace triax::manager {
namespace {

using json = nlohmann::json;

HttpResponse JsonResponse(int status, const json& body) {
  HttpResponse r;
  r.status = status;
  r.content_type = "application/json";
  // Invalid UTF-8 in an id or a detail is replaced, not thrown on: an
  // answer must never fail on what the core holds.
  r.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  r.body.push_back('\n');
  return r;
}

HttpResponse ErrorResponse(const absl::Status& s) {
  int status = 500;
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      status = 400;
      break;
    case absl::StatusCode::kNotFound:
      status = 404;
      break;
    case absl::StatusCode::kUnavailable:
      status = 503;
      break;
    case absl::StatusCode::kUnauthenticated:
      status = 401;
      break;
    case absl::StatusCode::kPermissionDenied:
      status = 403;
      break;
    default:
      break;
  }
  return JsonResponse(status, {{"error",
                                {{"code", absl::StatusCodeToString(s.code())},
                                 {"message", std::string(s.message())}}}});
}

// The request's parameters, refusing any not in `allowed`.
absl::StatusOr<std::map<std::string, std::string>> Params(
    const HttpRequest& req, std::initializer_list<const char*> allowed) {
  auto params = ParseQuery(req.query);
  if (!params.ok()) return params.status();
  for (const auto& [key, value] : *params) {
    if (std::none_of(allowed.begin(), allowed.end(),
                     [&key = key](const char* a) { return key == a; })) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown query parameter ", Quote(key), " on ", req.path,
          allowed.size() == 0
              ? std::string("; it takes none")
              : absl::StrCat("; it takes ", absl::StrJoin(allowed, ", "))));
    }
  }
  return params;
}

// params[name] as an integer in [lo, hi]; `fallback` when absent.
absl::StatusOr<uint64_t> UintParam(
    const std::map<std::string, std::string>& params, const char* name,
    uint64_t lo, uint64_t hi, uint64_t fallback) {
  auto it = params.find(name);
  if (it == params.end()) return fallback;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(it->second, &v) || v < lo || v > hi) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, "=", Quote(it->second), " is not an integer in ", lo, "..", hi));
  }
  return v;
}

absl::StatusOr<bool> BoolParam(const std::map<std::string, std::string>& params,
                               const char* name) {
  auto it = params.find(name);
  if (it == params.end()) return false;
  const std::string v = absl::AsciiStrToLower(it->second);
  if (v == "1" || v == "true" || v.empty()) return true;
  if (v == "0" || v == "false") return false;
  return absl::InvalidArgumentError(absl::StrCat(
      name, "=", Quote(it->second), " is not 0, 1, true or false"));
}

// page_size / page_token of the paged lists. page_size 0 (or absent) is the
// core's default page; the core refuses a malformed token naming page_token.
absl::StatusOr<PageRequest> PageParam(
    const std::map<std::string, std::string>& params) {
  PageRequest page;
  auto size = UintParam(params, "page_size", 0, kMaxPageSize, 0);
  if (!size.ok()) return size.status();
  page.page_size = static_cast<int32_t>(*size);
  if (auto it = params.find("page_token"); it != params.end()) {
    page.page_token = it->second;
  }
  return page;
}

std::string EncodingText(const Encoding& e) {
  char buf[64];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

std::string SequenceStateText(SequenceState s) {
  switch (s) {
    case SequenceState::kOpen:
      return "open";
    case SequenceState::kClosed:
      return "closed";
    case SequenceState::kLost:
      return "lost";
    default:
      return "unspecified";
  }
}

std::string ActionText(PressureAction a) {
  switch (a) {
    case PressureAction::kDemote:
      return "demote";
    case PressureAction::kSpillHost:
      return "spill_host";
    case PressureAction::kSpillDisk:
      return "spill_disk";
    case PressureAction::kEvict:
      return "evict";
    default:
      return "unspecified";
  }
}

// "EVENT_BLOCK_SPILLED" -> "block_spilled", as the metrics label it.
std::string EventKindText(EventKind k) {
  std::string name = EventKindName(k);
  absl::string_view v = name;
  absl::ConsumePrefix(&v, "EVENT_");
  return absl::AsciiStrToLower(v);
}

json TagJson(const Tag& t) {
  return {{"temporal", TemporalLabel(t.temporal)},
          {"modality", ModalityLabel(t.modality)},
          {"role", RoleLabel(t.role)}};
}

json WorkerJson(const WorkerInfo& w) {
  const Inventory& inv = w.inventory;
  json formats = json::array();
  for (const FormatInventory& f : inv.formats) {
    formats.push_back({{"format", kernels::FormatName(f.format)},
                       {"pages_used", f.pages_used},
                       {"bytes_used", f.bytes_used}});
  }
  json pools = json::array();
  for (const PoolInventory& p : inv.pools) {
    pools.push_back({{"encoding", EncodingText(p.encoding)},
                     {"format", kernels::FormatName(p.encoding.k)},
                     {"page_bytes", p.page_bytes},
                     {"pages_per_frame", p.pages_per_frame},
                     {"frames", p.frames},
                     {"pages_used", p.pages_used},
                     {"free_slots", p.free_slots},
                     {"allocatable_pages", p.allocatable_pages}});
  }
  json tiers = json::array();
  for (const TierInventory& t : inv.tiers) {
    tiers.push_back({{"tier", TierLabel(t.tier)},
                     {"capacity_bytes", t.capacity_bytes},
                     {"used_bytes", t.used_bytes},
                     {"blocks", t.blocks}});
  }
  return {{"worker_id", w.worker_id},
          {"address", w.address},
          {"backend", w.backend},
          {"state", WorkerStateName(w.state)},
          {"last_heartbeat_unix_ms", w.last_heartbeat_unix_ms},
          {"sequences", w.sequences},
          {"capacity_bytes", w.capacity_bytes},
          {"reserved_bytes", w.reserved_bytes},
          {"used_bytes", inv.used_bytes},
          {"window_bytes", inv.window_bytes},
          {"host_capacity_bytes", w.host_capacity_bytes},
          {"disk_capacity_bytes", w.disk_capacity_bytes},
          {"frame_bytes", inv.frame_bytes},
          {"frames", inv.frames},
          {"free_frames", inv.free_frames},
          {"fragmentation", inv.fragmentation},
          {"device_error", inv.device_error},
          {"counters",
           {{"spills", inv.spills},
            {"restores", inv.restores},
            {"evictions", inv.evictions},
            {"checksum_failures", inv.checksum_failures},
            {"compactions", inv.compactions}}},
          {"formats", std::move(formats)},
          {"pools", std::move(pools)},
          {"tiers", std::move(tiers)}};
}

// One row per tier that has a budget or bytes in use; floor and ceiling
// null where the tier has no budget (unlimited).
json TenantJson(const TenantInfo& t) {
  json tiers = json::array();
  for (int i = 1; i < kNumTiers; ++i) {
    const Tier tier = static_cast<Tier>(i);
    uint64_t used = 0;
    for (const TierUsage& u : t.usage) {
      if (u.tier == tier) used = u.used_bytes;
    }
    const Budget* budget = nullptr;
    for (const Budget& b : t.budgets) {
      if (b.tier == tier) budget = &b;
    }
    if (budget == nullptr && used == 0 && tier != Tier::kDevice) continue;
    tiers.push_back(
        {{"tier", TierLabel(tier)},
         {"used_bytes", used},
         {"floor_bytes", budget ? json(budget->floor_bytes) : json(nullptr)},
         {"ceiling_bytes",
          budget ? json(budget->ceiling_bytes) : json(nullptr)}});
  }
  return {{"tenant_id", t.tenant_id},
          {"open_sequences", t.open_sequences},
          {"default_policy", t.default_policy},
          {"prefix_salt", t.prefix_salt},
          {"tiers", std::move(tiers)}};
}

json SequenceJson(const SequenceInfo& s) {
  return {{"sequence_id", s.sequence_id},
          {"tenant_id", s.tenant_id},
          {"worker_id", s.worker_id},
          {"state", SequenceStateText(s.state)},
          {"model", s.model.name},
          {"num_tokens", s.num_tokens},
          {"block_tokens", s.block_tokens},
          {"turns", s.turns},
          {"policy", s.policy},
          {"bytes", s.bytes},
          {"parent_sequence_id", s.parent_sequence_id},
          {"prefix_sequence_id", s.prefix_sequence_id},
          {"prefix_blocks", s.prefix_blocks},
          {"transfer_id", s.transfer_id}};
}

json BlockJson(const BlockPlan& b) {
  return {{"index", b.index},
          {"lineage_id", b.lineage_id},
          {"first_token", b.first_token},
          {"num_tokens", b.num_tokens},
          {"capacity", b.capacity},
          {"tag", TagJson(b.tag)},
          {"encoding", EncodingText(b.encoding)},
          {"format", kernels::FormatName(b.encoding.k)},
          {"format_v", kernels::FormatName(b.encoding.v)},
          {"tier", b.evicted ? "evicted" : TierLabel(b.tier)},
          {"evicted", b.evicted},
          {"refcount", b.refcount}};
}

json EventJson(const Event& e) {
  json j = {{"id", e.id},
            {"unix_ms", e.unix_ms},
            {"kind", EventKindText(e.kind)},
            {"lineage_id", e.lineage_id},
            {"sequence_id", e.sequence_id},
            {"tenant_id", e.tenant_id},
            {"worker_id", e.worker_id},
            {"detail", e.detail}};
  if (e.lineage_id != 0) {
    j["tag"] = TagJson(e.tag);
    j["format"] = kernels::FormatName(e.format);
  }
  if (!e.source_worker_id.empty()) j["source_worker_id"] = e.source_worker_id;
  if (!e.lineage_ids.empty()) j["lost_blocks"] = e.lineage_ids.size();
  return j;
}

}  // namespace

std::optional<HttpResponse> Dashboard::Refused(const HttpRequest& req) const {
  if (!require_tokens_) return std::nullopt;
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(req.authorization, kBearer)) {
    return ErrorResponse(absl::UnauthenticatedError(absl::StrCat(
        req.path,
        ": this manager requires \"Authorization: Bearer <admin token>\" "
        "(--auth=token)")));
  }
  absl::StatusOr<Principal> who = core_->tokens().Verify(
      absl::string_view(req.authorization).substr(kBearer.size()),
      core_->NowMs());
  if (!who.ok()) {
    return ErrorResponse(absl::UnauthenticatedError(
        absl::StrCat(req.path, ": ", who.status().message())));
  }
  if (who->role != TokenRole::kAdmin) {
    return ErrorResponse(absl::PermissionDeniedError(absl::StrCat(
        req.path, ": token ", who->token_id, " is not an admin token")));
  }
  return std::nullopt;
}

std::map<std::string, HttpRequestHandler> Dashboard::Routes() const {
  auto bind = [this](HttpResponse (Dashboard::*f)(const HttpRequest&) const) {
    return [this, f](const HttpRequest& req) {
      if (f != &Dashboard::Page) {
        if (std::optional<HttpResponse> refused = Refused(req)) {
          return *std::move(refused);
        }
      }
      return (this->*f)(req);
    };
  };
  return {{"/", bind(&Dashboard::Page)},
          {"/dashboard", bind(&Dashboard::Page)},
          {"/api/workers", bind(&Dashboard::Workers)},
          {"/api/tenants", bind(&Dashboard::Tenants)},
          {"/api/pressure", bind(&Dashboard::Pressure)},
          {"/api/events", bind(&Dashboard::Events)},
          {"/api/sequences", bind(&Dashboard::Sequences)},
          {"/api/sequence", bind(&Dashboard::Sequence)},
          {"/api/plan", bind(&Dashboard::Plan)}};
}

HttpResponse Dashboard::Page(const HttpRequest& req) const {
  // The page reads its own query (?seq=...) in the browser.
  HttpResponse r;
  r.content_type = "text/html; charset=utf-8";
  r.body = kDashboardPage;
  return r;
}

HttpResponse Dashboard::Workers(const HttpRequest& req) const {
  auto params = Params(req, {});
  if (!params.ok()) return ErrorResponse(params.status());
  json workers = json::array();
  for (const WorkerInfo& w : core_->ListWorkers()) {
    workers.push_back(WorkerJson(w));
  }
  return JsonResponse(200, {{"workers", std::move(workers)}});
}

HttpResponse Dashboard::Tenants(const HttpRequest& req) const {
  auto params = Params(req, {"page_size", "page_token"});
  if (!params.ok()) return ErrorResponse(params.status());
  auto page = PageParam(*params);
  if (!page.ok()) return ErrorResponse(page.status());
  auto tenants = core_->ListTenants(*page);
  if (!tenants.ok()) return ErrorResponse(tenants.status());
  json out = json::array();
  for (const TenantInfo& t : tenants->items) out.push_back(TenantJson(t));
  return JsonResponse(200, {{"tenants", std::move(out)},
                            {"next_page_token", tenants->next_page_token}});
}

HttpResponse Dashboard::Pressure(const HttpRequest& req) const {
  auto params = Params(req, {"top"});
  if (!params.ok()) return ErrorResponse(params.status());
  auto top =
      UintParam(*params, "top", 0, kDashboardMaxTop, kDashboardDefaultTop);
  if (!top.ok()) return ErrorResponse(top.status());
  const PressureState p = core_->GetPressure(static_cast<uint32_t>(*top));
  json pools = json::array();
  for (const PoolState& pool : p.pools) {
    pools.push_back({{"worker_id", pool.worker_id},
                     {"tier", TierLabel(pool.tier)},
                     {"capacity_bytes", pool.capacity_bytes},
                     {"used_bytes", pool.used_bytes},
                     {"high_watermark_bytes", pool.high_watermark_bytes},
                     {"low_watermark_bytes", pool.low_watermark_bytes}});
  }
  json ranked = json::array();
  for (size_t i = 0; i < p.ranked.size() && i < *top; ++i) {
    const RankedActionInfo& a = p.ranked[i];
    ranked.push_back({{"rank", i + 1},
                      {"lineage_id", a.lineage_id},
                      {"sequence_id", a.sequence_id},
                      {"tenant_id", a.tenant_id},
                      {"action", ActionText(a.action)},
                      {"encoding", a.action == PressureAction::kDemote
                                       ? json(EncodingText(a.encoding))
                                       : json(nullptr)},
                      {"bytes_freed", a.bytes_freed},
                      {"cost", a.cost}});
  }
  return JsonResponse(200, {{"mode", p.mode},
                            {"snapshot_blocks", p.snapshot_blocks},
                            {"snapshot_age_ms", p.snapshot_age_ms},
                            {"ranking_ms", p.ranking_ms},
                            {"counters",
                             {{"demotions", p.demotions},
                              {"spills", p.spills},
                              {"restores", p.restores},
                              {"evictions", p.evictions}}},
                            {"prefix",
                             {{"index_blocks", p.prefix_index_blocks},
                              {"hits", p.prefix_hits},
                              {"reused_blocks", p.prefix_reused_blocks}}},
                            {"pools", std::move(pools)},
                            {"ranked", std::move(ranked)}});
}

HttpResponse Dashboard::Events(const HttpRequest& req) const {
  auto params = Params(req, {"after", "limit"});
  if (!params.ok()) return ErrorResponse(params.status());
  auto limit = UintParam(*params, "limit", 1, kDashboardMaxEvents,
                         kDashboardDefaultEvents);
  if (!limit.ok()) return ErrorResponse(limit.status());
  auto after = UintParam(*params, "after", 0, UINT64_MAX - 1, 0);
  if (!after.ok()) return ErrorResponse(after.status());
  EventLog& log = core_->events();
  const uint64_t next = log.next_id();
  uint64_t from = *after + 1;
  if (params->count("after") == 0) {
    // The newest `limit` events: where a feed starts.
    from = next > *limit ? next - *limit : 1;
  }
  json events = json::array();
  for (const Event& e : log.Retained(from, EventFilter{}, *limit)) {
    events.push_back(EventJson(e));
  }
  // next_id - 1 is what the next poll passes as `after`; a client behind
  // the retained log sees the gap as first_id > its after + 1.
  const uint64_t first =
      events.empty() ? next : events[0]["id"].get<uint64_t>();
  return JsonResponse(
      200,
      {{"events", std::move(events)}, {"first_id", first}, {"next_id", next}});
}

HttpResponse Dashboard::Sequences(const HttpRequest& req) const {
  auto params =
      Params(req, {"tenant", "include_closed", "page_size", "page_token"});
  if (!params.ok()) return ErrorResponse(params.status());
  std::string tenant;
  if (auto it = params->find("tenant"); it != params->end()) {
    tenant = it->second;
    if (absl::Status s = ValidateId("tenant", tenant); !s.ok()) {
      return ErrorResponse(s);
    }
  }
  auto closed = BoolParam(*params, "include_closed");
  if (!closed.ok()) return ErrorResponse(closed.status());
  auto page = PageParam(*params);
  if (!page.ok()) return ErrorResponse(page.status());
  auto list = core_->ListSequences(tenant, *closed, *page);
  if (!list.ok()) return ErrorResponse(list.status());
  json out = json::array();
  for (const SequenceInfo& s : list->items) out.push_back(SequenceJson(s));
  return JsonResponse(200, {{"sequences", std::move(out)},
                            {"next_page_token", list->next_page_token}});
}

HttpResponse Dashboard::Sequence(const HttpRequest& req) const {
  auto params = Params(req, {"id"});
  if (!params.ok()) return ErrorResponse(params.status());
  auto it = params->find("id");
  if (it == params->end()) {
    return ErrorResponse(absl::InvalidArgumentError(
        "query parameter id (a sequence id, e.g. id=seq-1) is missing"));
  }
  if (absl::Status s = ValidateId("id", it->second); !s.ok()) {
    return ErrorResponse(s);
  }
  auto s = core_->GetSequence("", it->second);
  if (!s.ok()) return ErrorResponse(s.status());
  json out = SequenceJson(*s);
  json blocks = json::array();
  for (const BlockPlan& b : s->blocks) blocks.push_back(BlockJson(b));
  out["blocks"] = std::move(blocks);
  return JsonResponse(200, out);
}

HttpResponse Dashboard::Plan(const HttpRequest& req) const {
  auto params = Params(req, {});
  if (!params.ok()) return ErrorResponse(params.status());
  auto input = LivePlanRequest(*core_);
  if (!input.ok()) {
    if (!absl::IsFailedPrecondition(input.status())) {
      return ErrorResponse(input.status());
    }
    // Nothing to plan from (no worker up, no sequence open): not an error.
    return JsonResponse(200,
                        {{"rows", json::array()},
                         {"reason", std::string(input.status().message())}});
  }
  auto plan = PlanCapacity(input->request);
  if (!plan.ok()) return ErrorResponse(plan.status());
  const ModelShape& m = plan->model;
  json rows = json::array();
  for (const CapacityRow& r : plan->rows) {
    rows.push_back(
        {{"label", r.label},
         {"kind", r.kind},
         {"page_bits", r.page_bits},
         {"page_bytes_per_token", r.page_bytes_per_token},
         {"page_tokens", r.page_tokens},
         {"ideal_tokens", r.ideal_tokens},
         {"sessions", r.sessions.empty() ? json(nullptr)
                                         : json(r.sessions[0].page_sessions)},
         {"calibration_shape_matches", r.calibration_shape_matches}});
  }
  json tenants = json::array();
  for (const CapacityTenantShare& t : plan->tenants) {
    json per_row = json::array();
    for (const CapacityRow& r : plan->rows) {
      for (const CapacityTenantRow& x : r.tenants) {
        if (x.tenant_id != t.tenant_id) continue;
        per_row.push_back(
            {{"label", r.label},
             {"page_tokens", x.page_tokens},
             {"sessions", x.page_sessions.empty() ? json(nullptr)
                                                  : json(x.page_sessions[0])}});
      }
    }
    tenants.push_back({{"tenant_id", t.tenant_id},
                       {"floor_bytes", t.floor_bytes},
                       {"ceiling_bytes", t.ceiling_bytes},
                       {"share_bytes", t.share_bytes},
                       {"rows", std::move(per_row)}});
  }
  int64_t mix_tokens = 0;
  for (const TagTokens& t : input->request.tag_mix) mix_tokens += t.tokens;
  return JsonResponse(200,
                      {{"model",
                        {{"name", m.name},
                         {"n_layers", m.n_layers},
                         {"n_kv_heads", m.n_kv_heads},
                         {"head_dim", m.head_dim}}},
                       {"block_tokens", plan->block_tokens},
                       {"gpus", plan->gpu_count},
                       {"gpu_memory_bytes", input->request.gpu_memory_bytes},
                       {"usable_bytes", plan->usable_bytes},
                       {"open_sequences", input->open_sequences},
                       {"open_tokens", input->open_tokens},
                       {"context_tokens", input->request.context_lengths[0]},
                       {"tag_mix_tokens", mix_tokens},
                       {"floors_exceed_memory", plan->floors_exceed_memory},
                       {"rows", std::move(rows)},
                       {"tenants", std::move(tenants)},
                       {"notes", input->notes}});
}

}  // namespace triax::manager
