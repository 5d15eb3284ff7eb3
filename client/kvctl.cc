// kvctl: the operator CLI of triaxkv. Talks to the manager only.
//
//   kvctl [--manager host:port] <command> [args] [flags]
//
// Errors print "kvctl: <CODE>: <message>" to stderr and exit 1; bad usage
// prints the usage text and exits 2.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kv_client.h"
#include "client/kvctl_format.h"
#include "client/kvctl_live.h"
#include "client/kvctl_plan.h"
#include "client/kvctl_trace.h"
#include "common/bearer.h"
#include "common/grpc_status.h"
#include "common/tls.h"
#include "common/version.h"

ABSL_FLAG(std::string, manager, "127.0.0.1:7070",
          "manager address host:port, or several comma-separated (managers "
          "on etcd: calls go to the leader)");
ABSL_FLAG(int64_t, timeout_ms, 10000,
          "deadline of each unary RPC; transfer: the transfer's bound (the "
          "manager's --transfer_timeout_ms when not given)");
ABSL_FLAG(std::string, tenant, "",
          "tenant filter (sequences, events); owner tenant (demote; transfer: "
          "looked up when empty)");
ABSL_FLAG(bool, all, false, "sequences: include closed sequences");
ABSL_FLAG(uint64_t, device_floor_bytes, 0, "tenant-create: device floor");
ABSL_FLAG(uint64_t, device_ceiling_bytes, 0,
          "tenant-create: device ceiling (no device budget when both are 0)");
ABSL_FLAG(std::string, policy, "",
          "tenant-create: default policy; transfer: destination policy");
ABSL_FLAG(std::string, to, "",
          "transfer: destination worker (empty: placement chooses)");
ABSL_FLAG(bool, follow_writes, false,
          "transfer: take each layer as the source writes it");
ABSL_FLAG(uint32_t, first_block, 0,
          "transfer: a prefix hit: blocks [0, N) are on the destination "
          "already, held by --prefix_sequence; only the others move");
ABSL_FLAG(std::string, prefix_sequence, "",
          "transfer: the destination's sequence holding blocks [0, "
          "--first_block)");
ABSL_FLAG(std::string, prefix_salt, "",
          "tenant-create: shared prefix salt (empty: private prefixes)");
ABSL_FLAG(std::string, tier, "", "budget-set: device|host|disk");
ABSL_FLAG(uint64_t, floor_bytes, 0, "budget-set: guaranteed bytes");
ABSL_FLAG(uint64_t, ceiling_bytes, 0, "budget-set: admission limit in bytes");
ABSL_FLAG(uint64_t, from, 0,
          "events: replay retained events with id >= from (0: live only)");
ABSL_FLAG(uint32_t, max, 0, "events: stop after this many (0: until ^C)");
ABSL_FLAG(std::string, sequence, "", "events: sequence filter");
ABSL_FLAG(uint64_t, lineage, 0, "events: lineage filter");
ABSL_FLAG(int64_t, wait_ms, 0,
          "events: stop quietly after this long (0: no limit)");
ABSL_FLAG(bool, json, false, "events: print JSON lines");
ABSL_FLAG(std::string, chrome_trace, "",
          "trace, events: also write the events as a Chrome trace (Trace "
          "Event Format JSON; open in Perfetto or chrome://tracing) to this "
          "file; events then reads the retained events and stops");
ABSL_FLAG(std::string, since, "",
          "events: only events at or after this time (RFC 3339, e.g. "
          "2026-11-25T13:00:00Z, or Unix seconds)");
ABSL_FLAG(std::string, until, "",
          "events: only events at or before this time (RFC 3339 or Unix "
          "seconds)");
ABSL_FLAG(bool, watch, false,
          "pressure: re-draw every --interval seconds (until ^C or --count)");
ABSL_FLAG(std::string, interval, "1",
          "pressure --watch, top: seconds between frames, in (0, 3600]");
ABSL_FLAG(std::string, count, "0",
          "pressure --watch, top: frames to draw, then exit (0: until ^C)");
ABSL_FLAG(uint32_t, top, 20, "pressure: ranked actions to show (1..10000)");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: talk TLS to the manager and workers, "
          "verified by them; empty: plaintext (docs/security.md)");
ABSL_FLAG(std::string, tls_cert, "",
          "with --tls_ca: PEM client certificate for servers that ask for "
          "one (--tls_require_client_cert)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, worker_sockets, "",
          "workers on this host to reach on their --local_listen sockets: "
          "WORKER_ADDRESS=unix:/PATH,... (no TCP, no TLS to them)");
ABSL_FLAG(std::string, tls_worker_server_name, "",
          "with --tls_ca: verify workers' certificates against this DNS "
          "name instead of their address; empty: the address");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token for a manager with --auth=token "
          "(else the TRIAX_TOKEN environment variable)");
ABSL_FLAG(uint64_t, ttl_seconds, 0,
          "token-issue: seconds until the token expires (0: never)");
ABSL_FLAG(std::string, description, "", "token-issue: free text");
ABSL_FLAG(int32_t, page_size, 0,
          "workers, pools, tenants, sequences, policies, trace: items asked "
          "per page (every page is fetched and printed; 0: the manager's "
          "default, 1000)");

namespace {

constexpr char kUsage[] =
    R"(kvctl: operator CLI of the triaxkv manager.

usage: kvctl [--manager host:port] [--timeout_ms N]
             [--tls_ca F [--tls_cert F --tls_key F]] <command> [args] [flags]

commands:
  workers                       registered workers, state, capacity, pages,
                                free frames, fragmentation, compactions
  pools                         every worker's page pools: frames, pages
                                used, free slots, allocatable pages
  tenants                       tenants, usage and budgets
  tenant-create ID [--device_floor_bytes N --device_ceiling_bytes N]
                   [--policy P] [--prefix_salt S]
                                S: a shared prefix salt (tenants with the
                                same one reuse each other's prefixes)
  budget-set ID --tier device|host|disk --floor_bytes N --ceiling_bytes N
  sequences [--tenant T] [--all]
  sequence ID                   plan (K/V formats, group, scale, tier,
                                evicted), state, lost lineage ids, current
                                worker, transfer in flight and the transfer
                                history (retained events)
  policies                      built-in and operator policies, rule by rule
  policy-put NAME RULE...       add or replace an operator policy; RULE is
                                [SELECTOR,...:]ENCODING or *:ENCODING, e.g.
                                temporal=sink:bf16
                                role=system:k=int4,v=int2,g=64,scale=fp8
                                *:int4   (the last rule must be *:...)
  demote SEQ LINEAGE ENCODING --tenant T
                                re-encode one block in place, e.g.
                                kvctl demote seq-3 17 int2 --tenant acme
  pressure [--top N] [--watch --interval S --count N]
                                memory pressure: pools (used, capacity,
                                watermarks), tenants against floor and
                                ceiling per tier, mode, ranking time,
                                snapshot size, applied-action counters and
                                the N cheapest ranked actions (default 20)
  top [--interval S] [--count N]  live workers, encodings, tenants, rates
  plan --model M --gpu_memory SIZE [...]
                                capacity per policy and tenant (`kvctl plan`
                                alone lists its flags; docs/capacity.md)
  transfer SEQ [--to W] [--policy P] [--timeout_ms N] [--follow_writes]
              [--first_block K --prefix_sequence P] [--tenant T]
                                move a sequence to worker W (placement when
                                not given), re-encoded to policy P; with K,
                                blocks [0, K) are shared with P's on P's
                                worker and only the others move; prints
                                blocks moved and shared, pages, wire vs
                                BF16 bytes, seconds
  trace LINEAGE_ID [--chrome_trace FILE]
                                a block, its worker path (created on A,
                                transferred A -> B, ...) and its events
  events [--from N] [--max N] [--tenant T] [--sequence S] [--lineage L]
         [--since T] [--until T] [--wait_ms N] [--json] [--chrome_trace F]
                                one event per line (key=value or JSON)
  tokens                        bearer tokens (id, role, tenant, expiry;
                                never the secrets); admin
  token-issue ROLE [TENANT] [--ttl_seconds N] [--description D]
                                issue a token (ROLE admin, tenant or
                                worker; TENANT for tenant tokens) and print
                                it once; admin
  token-revoke TOKEN_ID         revoke a token; admin
  --token_file PATH             the caller's bearer token (a manager with
                                --auth=token; else $TRIAX_TOKEN)
  --version                     print the version and the git commit of the
                                build and exit 0

The list commands (workers, pools, tenants, sequences, policies, trace) read
every page the manager answers and print all items; --page_size N (1..10000,
0: the manager's default of 1000) sets the items asked per page.
)";

// The usage, then what was wrong: last, where a terminal (or a log's tail)
// shows it after the long usage.
int Usage(const std::string& why) {
  std::cerr << kUsage;
  if (!why.empty()) std::cerr << "\nkvctl: " << why << "\n";
  return 2;
}

int Fail(const absl::Status& s) {
  std::cerr << "kvctl: " << absl::StatusCodeToString(s.code()) << ": "
            << s.message() << "\n";
  return 1;
}

// Flags not known to kvctl are usage errors (exit 2), found before absl's
// parser, which would exit 1 for them.
bool CheckFlagNames(int argc, char** argv, std::string* bad) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (a == "--") break;
    if (a.size() < 2 || a[0] != '-') continue;
    a.remove_prefix(a[1] == '-' ? 2 : 1);
    absl::string_view name = a.substr(0, a.find('='));
    if (name == "help" || name == "helpfull" || name == "version") continue;
    if (absl::FindCommandLineFlag(name) != nullptr) continue;
    if (absl::StartsWith(name, "no") &&
        absl::FindCommandLineFlag(name.substr(2)) != nullptr) {
      continue;
    }
    *bad = std::string(argv[i]);
    return false;
  }
  return true;
}

class Kvctl {
 public:
  // timeout_given: --timeout_ms was on the command line.
  Kvctl(triax::client::Client* client, bool timeout_given)
      : client_(client), timeout_given_(timeout_given) {}

  void Deadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(
        std::chrono::system_clock::now() +
        std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
    client_->Authorize(ctx);
  }

  // The list commands follow the manager's pages (Client::List*), so they
  // print every item however many there are.
  static int32_t PageSize() { return absl::GetFlag(FLAGS_page_size); }
  int Workers() {
    auto resp = client_->ListWorkers(PageSize());
    if (!resp.ok()) return Fail(resp.status());
    std::cout << triax::kvctl::WorkersTable(*resp);
    return 0;
  }

  int Pools() {
    auto resp = client_->ListWorkers(PageSize());
    if (!resp.ok()) return Fail(resp.status());
    std::cout << triax::kvctl::PoolsTable(*resp);
    return 0;
  }

  int Tenants() {
    auto resp = client_->ListTenants(PageSize());
    if (!resp.ok()) return Fail(resp.status());
    std::cout << triax::kvctl::TenantsTable(*resp);
    return 0;
  }

  int TenantCreate(const std::string& id) {
    triax::v1::CreateTenantRequest req;
    req.set_request_id(client_->NewRequestId());
    req.set_tenant_id(id);
    req.set_default_policy(absl::GetFlag(FLAGS_policy));
    req.set_prefix_salt(absl::GetFlag(FLAGS_prefix_salt));
    const uint64_t floor = absl::GetFlag(FLAGS_device_floor_bytes);
    const uint64_t ceiling = absl::GetFlag(FLAGS_device_ceiling_bytes);
    if (floor != 0 || ceiling != 0) {
      triax::v1::Budget* b = req.add_budgets();
      b->set_tier(triax::v1::TIER_DEVICE);
      b->set_floor_bytes(floor);
      b->set_ceiling_bytes(ceiling);
    }
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::CreateTenantResponse resp;
    auto s = m()->CreateTenant(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    triax::v1::ListTenantsResponse one;
    *one.add_tenants() = resp.tenant();
    std::cout << triax::kvctl::TenantsTable(one);
    return 0;
  }

  int BudgetSet(const std::string& id) {
    const std::string tier = absl::GetFlag(FLAGS_tier);
    triax::v1::Tier t;
    if (tier == "device") {
      t = triax::v1::TIER_DEVICE;
    } else if (tier == "host") {
      t = triax::v1::TIER_HOST;
    } else if (tier == "disk") {
      t = triax::v1::TIER_DISK;
    } else {
      return Usage(absl::StrCat("budget-set: --tier=\"", tier,
                                "\"; want device, host or disk"));
    }
    triax::v1::SetBudgetRequest req;
    req.set_request_id(client_->NewRequestId());
    req.set_tenant_id(id);
    req.mutable_budget()->set_tier(t);
    req.mutable_budget()->set_floor_bytes(absl::GetFlag(FLAGS_floor_bytes));
    req.mutable_budget()->set_ceiling_bytes(absl::GetFlag(FLAGS_ceiling_bytes));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::SetBudgetResponse resp;
    auto s = m()->SetBudget(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    triax::v1::ListTenantsResponse one;
    *one.add_tenants() = resp.tenant();
    std::cout << triax::kvctl::TenantsTable(one);
    return 0;
  }

  int Sequences() {
    auto resp = client_->ListSequences(absl::GetFlag(FLAGS_tenant),
                                       absl::GetFlag(FLAGS_all), PageSize());
    if (!resp.ok()) return Fail(resp.status());
    std::cout << triax::kvctl::SequencesTable(*resp);
    return 0;
  }

  int Sequence(const std::string& id) {
    triax::v1::GetSequenceRequest req;
    req.set_sequence_id(id);  // no tenant: operator view
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::GetSequenceResponse resp;
    auto s = m()->GetSequence(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    std::cout << triax::kvctl::SequenceDetail(resp.sequence());
    // The transfer history from the retained events of the sequence.
    triax::v1::WatchEventsRequest watch;
    watch.set_from_id(1);
    watch.set_sequence_id(id);
    watch.set_replay_only(true);
    grpc::ClientContext wctx;
    Deadline(&wctx);
    auto reader = m()->WatchEvents(&wctx, watch);
    std::vector<triax::v1::Event> events;
    triax::v1::Event e;
    while (reader->Read(&e)) events.push_back(e);
    s = reader->Finish();
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    std::cout << "\n" << triax::kvctl::TransferHistory(events);
    return 0;
  }

  int Transfer(const std::string& seq) {
    std::string tenant = absl::GetFlag(FLAGS_tenant);
    if (tenant.empty()) {  // the owner, from the operator view
      triax::v1::GetSequenceRequest g;
      g.set_sequence_id(seq);
      grpc::ClientContext ctx;
      Deadline(&ctx);
      triax::v1::GetSequenceResponse info;
      auto s = m()->GetSequence(&ctx, g, &info);
      if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
      tenant = info.sequence().tenant_id();
    }
    triax::v1::TransferSequenceRequest req;
    req.set_request_id(client_->NewRequestId());
    req.set_tenant_id(tenant);
    req.set_sequence_id(seq);
    req.set_destination_worker_id(absl::GetFlag(FLAGS_to));
    req.set_destination_policy(absl::GetFlag(FLAGS_policy));
    req.set_follow_writes(absl::GetFlag(FLAGS_follow_writes));
    req.set_first_block(absl::GetFlag(FLAGS_first_block));
    req.set_destination_prefix_sequence_id(
        absl::GetFlag(FLAGS_prefix_sequence));
    // --timeout_ms bounds the transfer only when given; the call's deadline
    // leaves the manager 5 s beyond it to answer.
    int64_t bound_ms = 10000;
    if (timeout_given_) {
      const int64_t t = absl::GetFlag(FLAGS_timeout_ms);
      if (t < 1 || t > 3600000) {
        return Usage(absl::StrCat("transfer: --timeout_ms=", t,
                                  " is not in [1, 3600000]"));
      }
      req.set_timeout_ms(static_cast<uint32_t>(t));
      bound_ms = t;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(bound_ms + 5000));
    triax::v1::TransferSequenceResponse resp;
    auto s = m()->TransferSequence(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    std::cout << triax::kvctl::TransferReport(resp);
    return 0;
  }

  int Tokens() {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::ListTokensResponse resp;
    auto s = m()->ListTokens(&ctx, triax::v1::ListTokensRequest{}, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    std::cout << triax::kvctl::TokensTable(resp);
    return 0;
  }

  int TokenIssue(const std::string& role, const std::string& tenant) {
    triax::v1::IssueTokenRequest req;
    req.set_role(role);
    req.set_tenant_id(tenant);
    req.set_ttl_seconds(absl::GetFlag(FLAGS_ttl_seconds));
    req.set_description(absl::GetFlag(FLAGS_description));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::IssueTokenResponse resp;
    auto s = m()->IssueToken(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    // The token on stdout alone (for a file or a secret store); what it is
    // on stderr.
    std::cerr << "issued token " << resp.info().token_id()
              << " role=" << resp.info().role()
              << (resp.info().tenant_id().empty()
                      ? std::string()
                      : " tenant=" + resp.info().tenant_id())
              << " expires_unix_ms=" << resp.info().expires_unix_ms()
              << " (shown once; the manager keeps only its hash)\n";
    std::cout << resp.token() << "\n";
    return 0;
  }

  int TokenRevoke(const std::string& id) {
    triax::v1::RevokeTokenRequest req;
    req.set_token_id(id);
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::RevokeTokenResponse resp;
    auto s = m()->RevokeToken(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    std::cout << "revoked token " << id << "\n";
    return 0;
  }

  int Policies() {
    auto resp = client_->ListPolicies(PageSize());
    if (!resp.ok()) return Fail(resp.status());
    std::cout << triax::kvctl::PoliciesTable(*resp);
    return 0;
  }

  int PolicyPut(const std::string& name,
                const std::vector<std::string>& rules) {
    triax::v1::PutPolicyRequest req;
    req.set_request_id(client_->NewRequestId());
    req.mutable_policy()->set_name(name);
    for (const std::string& text : rules) {
      absl::Status st = triax::kvctl::ParsePolicyRule(
          text, req.mutable_policy()->add_rules());
      if (!st.ok()) return Usage(absl::StrCat("policy-put: ", st.message()));
    }
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::PutPolicyResponse resp;
    auto s = m()->PutPolicy(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    triax::v1::ListPoliciesResponse one;
    *one.add_policies() = resp.policy();
    std::cout << triax::kvctl::PoliciesTable(one);
    return 0;
  }

  int Demote(const std::string& seq, uint64_t lineage,
             const std::string& encoding) {
    const std::string tenant = absl::GetFlag(FLAGS_tenant);
    if (tenant.empty()) return Usage("demote: --tenant is required");
    triax::v1::DemoteBlocksRequest req;
    req.set_request_id(client_->NewRequestId());
    req.set_tenant_id(tenant);
    req.set_sequence_id(seq);
    triax::v1::BlockEncoding* b = req.add_blocks();
    absl::Status st = triax::kvctl::ParseEncoding(encoding, b);
    if (!st.ok()) return Usage(absl::StrCat("demote: ", st.message()));
    b->set_lineage_id(lineage);
    grpc::ClientContext ctx;
    Deadline(&ctx);
    triax::v1::DemoteBlocksResponse resp;
    auto s = m()->DemoteBlocks(&ctx, req, &resp);
    if (!s.ok()) return Fail(triax::FromGrpcStatus(s));
    std::cout << "bytes_delta: " << resp.bytes_delta() << "\n"
              << triax::kvctl::SequenceDetail(resp.sequence());
    return 0;
  }

  int Pressure() {
    const uint32_t top = absl::GetFlag(FLAGS_top);
    if (top == 0 || top > 10000) {
      return Usage(
          absl::StrCat("pressure: --top=", top, " is not in [1, 10000]"));
    }
    if (absl::GetFlag(FLAGS_watch)) {
      return Live("pressure", [&]() -> absl::StatusOr<std::string> {
        const int64_t now = absl::ToUnixMillis(absl::Now());
        auto resp = client_->GetPressure(top);
        if (!resp.ok()) return resp.status();
        return triax::kvctl::PressureFrame(now, *resp);
      });
    }
    auto resp = client_->GetPressure(top);
    if (!resp.ok()) return Fail(resp.status());
    std::cout << triax::kvctl::PressureReport(*resp);
    return 0;
  }

  int Trace(uint64_t lineage) {
    auto resp = client_->QueryTrace(lineage, PageSize());
    if (!resp.ok()) return Fail(resp.status());
    std::cout << triax::kvctl::TraceDetail(lineage, *resp);
    const std::string file = absl::GetFlag(FLAGS_chrome_trace);
    if (file.empty()) return 0;
    const std::vector<triax::v1::Event> events(resp->events().begin(),
                                               resp->events().end());
    return WriteTrace(file, events);
  }

  // The events as a Chrome trace in `file`; spans still open end now.
  static int WriteTrace(const std::string& file,
                        const std::vector<triax::v1::Event>& events) {
    const std::string json =
        triax::kvctl::ChromeTraceJson(events, absl::ToUnixMillis(absl::Now()));
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << json;
    out.close();
    if (!out) {
      return Fail(absl::ErrnoToStatus(
          errno, absl::StrCat("cannot write --chrome_trace=", file)));
    }
    std::cout << "chrome trace: " << file << " (" << events.size()
              << " events; open in https://ui.perfetto.dev or "
                 "chrome://tracing)\n";
    return 0;
  }

  int Events() {
    int64_t since = 0;
    int64_t until = INT64_MAX;
    absl::Status bad_time;
    auto parse_time = [&](absl::string_view name, const std::string& text,
                          int64_t* out) {
      if (text.empty() || !bad_time.ok()) return;
      absl::StatusOr<int64_t> t = triax::kvctl::ParseTimeFlag(name, text);
      if (t.ok()) {
        *out = *t;
      } else {
        bad_time = t.status();
      }
    };
    parse_time("since", absl::GetFlag(FLAGS_since), &since);
    parse_time("until", absl::GetFlag(FLAGS_until), &until);
    if (!bad_time.ok()) {
      return Usage(absl::StrCat("events: ", bad_time.message()));
    }
    if (since > until) {
      return Usage(
          absl::StrCat("events: --since=", absl::GetFlag(FLAGS_since),
                       " is after --until=", absl::GetFlag(FLAGS_until)));
    }
    const std::string trace_file = absl::GetFlag(FLAGS_chrome_trace);
    std::vector<triax::v1::Event> kept;
    triax::v1::WatchEventsRequest req;
    req.set_from_id(absl::GetFlag(FLAGS_from));
    if (!trace_file.empty()) {
      // A file is written once: read what is retained, then stop.
      if (req.from_id() == 0) req.set_from_id(1);
      req.set_replay_only(true);
    }
    req.set_max_events(absl::GetFlag(FLAGS_max));
    req.set_tenant_id(absl::GetFlag(FLAGS_tenant));
    req.set_sequence_id(absl::GetFlag(FLAGS_sequence));
    req.set_lineage_id(absl::GetFlag(FLAGS_lineage));
    const bool json = absl::GetFlag(FLAGS_json);
    const int64_t wait_ms = absl::GetFlag(FLAGS_wait_ms);
    grpc::ClientContext ctx;
    if (wait_ms > 0) {
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(wait_ms));
    }
    auto reader = m()->WatchEvents(&ctx, req);
    triax::v1::Event e;
    while (reader->Read(&e)) {
      // The manager filters by tenant, sequence and lineage; the time
      // window is applied here.
      if (e.unix_ms() < since || e.unix_ms() > until) continue;
      std::cout << (json ? triax::kvctl::EventJson(e)
                         : triax::kvctl::EventLine(e))
                << std::endl;  // flushed: the stream may be live
      if (!trace_file.empty()) kept.push_back(e);
    }
    grpc::Status s = reader->Finish();
    if (!s.ok() && !(wait_ms > 0 &&
                     s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)) {
      return Fail(triax::FromGrpcStatus(s));
    }
    // (--wait_ms running out is a normal end.)
    if (!trace_file.empty()) return WriteTrace(trace_file, kept);
    return 0;
  }

  // Draws frames from `render` (absl::StatusOr<std::string>()) every
  // --interval seconds, --count of them (0: until interrupted).
  template <typename Render>
  static int Live(absl::string_view command, Render render) {
    auto interval = triax::kvctl::ParseInterval(absl::GetFlag(FLAGS_interval));
    if (!interval.ok()) {
      return Usage(absl::StrCat(command, ": ", interval.status().message()));
    }
    auto count = triax::kvctl::ParseCount(absl::GetFlag(FLAGS_count));
    if (!count.ok()) {
      return Usage(absl::StrCat(command, ": ", count.status().message()));
    }
    const bool tty = isatty(STDOUT_FILENO) == 1;
    for (int64_t i = 0; *count == 0 || i < *count; ++i) {
      if (i > 0) absl::SleepFor(absl::Seconds(*interval));
      absl::StatusOr<std::string> body = render();
      if (!body.ok()) return Fail(body.status());
      std::cout << triax::kvctl::FrameText(*body, i, tty) << std::flush;
    }
    return 0;
  }

  int Top() {
    std::optional<triax::kvctl::TopSample> prev;
    return Live("top", [&]() -> absl::StatusOr<std::string> {
      triax::kvctl::TopSample now;
      now.unix_ms = absl::ToUnixMillis(absl::Now());
      auto workers = client_->ListWorkers(PageSize());
      if (!workers.ok()) return workers.status();
      auto tenants = client_->ListTenants(PageSize());
      if (!tenants.ok()) return tenants.status();
      auto pressure = client_->GetPressure(1);
      if (!pressure.ok()) return pressure.status();
      now.workers = *std::move(workers);
      now.tenants = *std::move(tenants);
      now.pressure = *std::move(pressure);
      std::string frame = triax::kvctl::TopFrame(now, prev ? &*prev : nullptr);
      prev = std::move(now);
      return frame;
    });
  }

 private:
  triax::v1::Manager::Stub* m() { return client_->manager(); }
  triax::client::Client* client_;
  const bool timeout_given_;
};

// Whether flag `name` is given in argv ("--name", "--name=...", "-name").
bool FlagGiven(int argc, char** argv, absl::string_view name) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (a == "--") break;
    if (a.size() < 2 || a[0] != '-') continue;
    a.remove_prefix(a[1] == '-' ? 2 : 1);
    if (a.substr(0, a.find('=')) == name) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig config;
  config.version_string = [] { return triax::VersionLine(); };
  absl::SetFlagsUsageConfig(config);
  std::string bad;
  if (!CheckFlagNames(argc, argv, &bad)) {
    return Usage(absl::StrCat("unknown flag ", bad));
  }
  const bool timeout_given = FlagGiven(argc, argv, "timeout_ms");
  std::vector<char*> pos = absl::ParseCommandLine(argc, argv);
  if (pos.size() < 2) return Usage("missing command");
  const std::string cmd = pos[1];
  const std::vector<std::string> args(pos.begin() + 2, pos.end());
  auto want_args = [&](size_t n) { return args.size() == n; };

  triax::client::ClientOptions opts;
  opts.manager_address = absl::GetFlag(FLAGS_manager);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> token =
        triax::ReadBearerToken("token_file", path);
    if (!token.ok()) return Usage(std::string(token.status().message()));
    opts.token = *std::move(token);
  } else if (const char* env = std::getenv("TRIAX_TOKEN");
             env != nullptr && *env != '\0') {
    opts.token = env;
  }
  opts.rpc_timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  {
    auto tls = triax::LoadTls({absl::GetFlag(FLAGS_tls_cert),
                               absl::GetFlag(FLAGS_tls_key),
                               absl::GetFlag(FLAGS_tls_ca), false});
    if (!tls.ok()) return Usage(std::string(tls.status().message()));
    if (!tls->cert_pem.empty() && !tls->client_enabled()) {
      return Usage("--tls_cert needs --tls_ca (empty)");
    }
    opts.credentials = triax::ChannelCredentials(*tls);
    opts.tls_worker_server_name = absl::GetFlag(FLAGS_tls_worker_server_name);
    auto sockets =
        triax::client::ParseWorkerSockets(absl::GetFlag(FLAGS_worker_sockets));
    if (!sockets.ok()) return Usage(std::string(sockets.status().message()));
    opts.worker_sockets = *std::move(sockets);
  }
  auto client = triax::client::Client::Connect(opts);
  if (!client.ok()) return Fail(client.status());
  Kvctl k(client->get(), timeout_given);
  if (const int32_t n = absl::GetFlag(FLAGS_page_size); n < 0) {
    return Usage(absl::StrCat("--page_size=", n, " is negative"));
  }

  if (cmd == "workers" && want_args(0)) return k.Workers();
  if (cmd == "pools" && want_args(0)) return k.Pools();
  if (cmd == "tenants" && want_args(0)) return k.Tenants();
  if (cmd == "tenant-create" && want_args(1)) return k.TenantCreate(args[0]);
  if (cmd == "budget-set" && want_args(1)) return k.BudgetSet(args[0]);
  if (cmd == "sequences" && want_args(0)) return k.Sequences();
  if (cmd == "sequence" && want_args(1)) return k.Sequence(args[0]);
  if (cmd == "transfer" && want_args(1)) return k.Transfer(args[0]);
  if (cmd == "trace" && want_args(1)) {
    uint64_t lineage = 0;
    if (!absl::SimpleAtoi(args[0], &lineage) || lineage == 0) {
      return Usage(absl::StrCat("trace: LINEAGE_ID \"", args[0],
                                "\" is not a positive integer"));
    }
    return k.Trace(lineage);
  }
  if (cmd == "tokens" && want_args(0)) return k.Tokens();
  if (cmd == "token-issue" && (want_args(1) || want_args(2))) {
    return k.TokenIssue(args[0], args.size() == 2 ? args[1] : "");
  }
  if (cmd == "token-revoke" && want_args(1)) return k.TokenRevoke(args[0]);
  if (cmd == "events" && want_args(0)) return k.Events();
  if (cmd == "pressure" && want_args(0)) return k.Pressure();
  if (cmd == "top" && want_args(0)) return k.Top();
  if (cmd == "policies" && want_args(0)) return k.Policies();
  if (cmd == "policy-put" && args.size() >= 2) {
    return k.PolicyPut(args[0], {args.begin() + 1, args.end()});
  }
  if (cmd == "plan" && want_args(0)) {
    return triax::kvctl::RunPlan((*client)->manager(),
                                 absl::GetFlag(FLAGS_timeout_ms));
  }
  if (cmd == "demote" && want_args(3)) {
    uint64_t lineage = 0;
    if (!absl::SimpleAtoi(args[1], &lineage) || lineage == 0) {
      return Usage(absl::StrCat("demote: LINEAGE \"", args[1],
                                "\" is not a positive integer"));
    }
    return k.Demote(args[0], lineage, args[2]);
  }
  return Usage(absl::StrCat("bad command or arguments: ", cmd, " (",
                            args.size(), " arguments)"));
}
