// The manager's live dashboard (docs/dashboard.md): one static page and the
// JSON endpoints it polls, served on --http_listen beside /metrics.
//
//   /, /dashboard          the page (HTML, inline CSS and JS; no build step,
//                          nothing fetched from elsewhere)
//   /api/workers           workers, their device pools by encoding, spill
//                          tiers, frames
//   /api/tenants           tenants: used bytes against floor and ceiling
//                          per tier (page_size, page_token)
//   /api/pressure          pools against their watermarks, the pressure
//                          manager's counters, the ranking head (top)
//   /api/events            the event log: the newest `limit` events, or
//                          those after the id `after` (live feed)
//   /api/sequences         sequences without blocks (tenant,
//                          include_closed, page_size, page_token)
//   /api/sequence          one sequence's block map (id): every block's
//                          tokens, tag, encoding, tier, eviction
//   /api/plan              the live capacity plan (capacity_live.h
//                          LivePlanRequest, PlanCapacity): tokens and
//                          sessions per policy and per tenant for the
//                          fleet as it stands; {"rows": [], "reason"}
//                          when no worker is up or no sequence open
//
// Every answer is JSON built from the core's public calls (nothing is kept
// here). Errors are JSON too, {"error": {"code": ..., "message": ...}}:
// 400 for a bad query (an unknown parameter, a value out of range, a
// malformed page token; the message names the parameter and the value),
// 404 for an unknown sequence or tenant (naming it), 500 otherwise.
//
// Cost of an answer: /api/workers O(workers), /api/pressure O(pools + top),
// /api/events O(limit), the paged lists O(log n + page), /api/sequence
// O(blocks of that sequence); each takes the core's mutex once (the
// events: the event log's). The page polls them every 2 s, except
// /api/plan: O(blocks of every open sequence) (its tag mix; the core's
// mutex once per sequence), polled every 10 s.
//
// Thread contract: thread-safe (the handlers only call the core's
// thread-safe calls); the core must outlive the Dashboard and its routes.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "common/http_server.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

// Bounds of the query values.
inline constexpr uint32_t kDashboardMaxTop = 1000;       // /api/pressure top
inline constexpr uint32_t kDashboardDefaultTop = 20;     //   when not given
inline constexpr uint32_t kDashboardMaxEvents = 1000;    // /api/events limit
inline constexpr uint32_t kDashboardDefaultEvents = 50;  //   when not given

class Dashboard {
 public:
  explicit Dashboard(ManagerCore* core) : core_(core) {}

  // kvmanager --auth=token: the JSON routes (/api/...) answer only requests
  // with "Authorization: Bearer <an admin token>" (401 without one or with
  // an invalid one, 403 for another role); the page itself stays open and
  // sends the token it is given in its URL fragment (#token=...). Call
  // before Routes.
  void RequireAdminTokens() { require_tokens_ = true; }

  // Path -> handler for every route above.
  std::map<std::string, HttpRequestHandler> Routes() const;

  HttpResponse Page(const HttpRequest& req) const;
  HttpResponse Workers(const HttpRequest& req) const;
  HttpResponse Tenants(const HttpRequest& req) const;
  HttpResponse Pressure(const HttpRequest& req) const;
  HttpResponse Events(const HttpRequest& req) const;
  HttpResponse Sequences(const HttpRequest& req) const;
  HttpResponse Sequence(const HttpRequest& req) const;
  HttpResponse Plan(const HttpRequest& req) const;

 private:
  // The refusal of a JSON request without an admin token; nullopt: go on.
  std::optional<HttpResponse> Refused(const HttpRequest& req) const;

  ManagerCore* const core_;
  bool require_tokens_ = false;
};

// The page itself (dashboard_page.cc): HTML with inline CSS and JS.
extern const char kDashboardPage[];

}  // namespace triax::manager
