// capacity_replay (bench/capacity/CMakeLists.txt; docs/capacity.md
// "Replay"): an arrival trace of many sessions played through the manager
// core's admission and memory-pressure code on a fast clock, once per
// policy row, at the same memory: sessions admitted, completed, refused,
// waits, demotions / spills / evictions, peak and mean concurrency, per
// policy and per tenant, and the concurrency gain over the first row.
//
// Traces: --trace=synthetic (drawn shapes), --trace=bfcl (the span
// structure of held-out BFCL conversations, rendered as kvproxy-18m reads
// them), or a trace file (replay_trace.h); --trace_out writes the trace
// played. Writes a markdown report (stdout, and --out) and, with --svg, the
// chart of each tenant's share over time for one row. Exit code 0 when every
// row ran, 1 when a row failed, 2 for a bad flag (the message names it).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/capacity/replay_driver.h"
#include "bench/capacity/replay_report.h"
#include "bench/capacity/replay_trace.h"
#include "client/calibrate/calibration.h"
#include "client/calibrate/calibration_proto.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/data_dir.h"
#include "client/kvctl_format.h"
#include "common/model_proto.h"
#include "common/status_macros.h"
#include "kernels/layout.h"
#include "kvmanager/block_ranker.h"
#include "kvmanager/capacity.h"
#include "kvmanager/convert.h"
#include "kvmanager/policy.h"

ABSL_FLAG(std::string, trace, "synthetic",
          "synthetic, bfcl, or a trace file (bench/capacity/replay_trace.h)");
ABSL_FLAG(std::string, trace_out, "", "also write the trace played here");
ABSL_FLAG(int, sessions, 10000, "sessions to generate (synthetic, bfcl)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the generated trace");
ABSL_FLAG(std::string, tenants, "a:3,b:1",
          "generated sessions' tenants, ID:WEIGHT[:FROM_S-TO_S],... (the "
          "tenant's share of --arrival_rate, arriving only in that window)");
ABSL_FLAG(std::string, budgets, "",
          "device budgets, ID:FLOOR_MIB:CEILING_MIB,... (ceiling 0: the "
          "pool); tenants not listed have none");
ABSL_FLAG(double, arrival_rate, 20, "sessions per second (Poisson)");
ABSL_FLAG(double, think_ms, 5000, "mean idle before each later turn");
ABSL_FLAG(double, decode_ms_per_token, 20, "response tokens' pace");
ABSL_FLAG(double, tool_ms, 200, "added to each turn's response time");
ABSL_FLAG(std::string, synthetic_turns, "2:8", "turns per session, MIN:MAX");
ABSL_FLAG(std::string, synthetic_system, "200:600", "system tokens, MIN:MAX");
ABSL_FLAG(std::string, synthetic_schema, "0:2000",
          "tool schema tokens, MIN:MAX");
ABSL_FLAG(std::string, synthetic_user, "20:200", "user tokens a turn");
ABSL_FLAG(std::string, synthetic_call, "20:120", "tool call tokens a turn");
ABSL_FLAG(std::string, synthetic_result, "10:400", "tool result tokens");
ABSL_FLAG(std::string, bfcl_ids, "",
          "BFCL multi_turn_base ids for --trace=bfcl (empty: every held-out "
          "one of kvproxy-18m's README; others are refused)");
ABSL_FLAG(double, bytes_per_token, 1,
          "BFCL span bytes per token (1: kvproxy-18m's byte tokens)");
ABSL_FLAG(std::string, data_dir, "", "data directory (default ../shared/data)");
ABSL_FLAG(std::string, model, "table",
          "model shape: \"table\" (the calibration table's) or a preset "
          "(llama-3-8b, ...; the table then stands in for its distortions)");
ABSL_FLAG(uint32_t, block_tokens, 16, "tokens per block");
ABSL_FLAG(int, gpus, 1, "workers (one GPU each)");
ABSL_FLAG(uint64_t, device_mib, 1024, "KV pool per worker, MiB");
ABSL_FLAG(uint64_t, host_mib, 0, "host spill tier per worker, MiB");
ABSL_FLAG(uint64_t, disk_mib, 0, "disk spill tier per worker, MiB");
ABSL_FLAG(std::string, policies,
          "bf16 fp8 int4 k=int2,v=int2,g=32+label=kivi-2 triaxial=3 "
          "triaxial=3.5 triaxial=4 triaxial=5",
          "rows, kvctl plan's syntax (docs/capacity.md): ENCODING, "
          "policy=NAME or triaxial=BITS[+dnll], each [+label=NAME]; the first "
          "row is the gains' baseline");
ABSL_FLAG(std::string, calibration,
          "bench/results/calibration_kvproxy-18m-output.txtpb",
          "calibration table (triaxial rows; the ranker's distortions)");
ABSL_FLAG(bool, reclaim, true,
          "admission after reclaim and the background pressure round; "
          "false: refused calls only wait");
ABSL_FLAG(std::string, pressure_mode, "demote-first",
          "demote-first, graph-evict or lru");
ABSL_FLAG(double, high_watermark, 0.90, "background round above this");
ABSL_FLAG(double, low_watermark, 0.80, "background round down to this");
ABSL_FLAG(uint32_t, window_guard_tokens, 64, "kvmanager's flag");
ABSL_FLAG(int64_t, active_guard_ms, 5000, "kvmanager's flag");
ABSL_FLAG(bool, resume_reserve, true, "kvmanager's flag");
ABSL_FLAG(int64_t, tick_ms, 200, "background round interval (simulated)");
ABSL_FLAG(double, patience_s, 60, "a wait longer than this gives up");
ABSL_FLAG(int64_t, retry_ms, 1000, "waiting calls retried at least this often");
ABSL_FLAG(int64_t, sample_ms, 1000, "share samples' interval");
ABSL_FLAG(std::string, out, "", "also write the report here");
ABSL_FLAG(std::string, svg, "", "write the share chart of one row here");
ABSL_FLAG(std::string, svg_row, "", "that row's label (default: the last)");

namespace triax::bench::capacity {
namespace {

absl::Status Bad(absl::string_view flag, absl::string_view text,
                 absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=\"", text, "\": ", why));
}

absl::StatusOr<SyntheticShape> ShapeFromFlags() {
  SyntheticShape s;
  const struct {
    const char* flag;
    const absl::Flag<std::string>* value;
    uint32_t *min, *max;
  } ranges[] = {
      {"synthetic_turns", &FLAGS_synthetic_turns, &s.turns_min, &s.turns_max},
      {"synthetic_system", &FLAGS_synthetic_system, &s.system_min,
       &s.system_max},
      {"synthetic_schema", &FLAGS_synthetic_schema, &s.schema_min,
       &s.schema_max},
      {"synthetic_user", &FLAGS_synthetic_user, &s.user_min, &s.user_max},
      {"synthetic_call", &FLAGS_synthetic_call, &s.call_min, &s.call_max},
      {"synthetic_result", &FLAGS_synthetic_result, &s.result_min,
       &s.result_max}};
  for (const auto& r : ranges) {
    const std::string text = absl::GetFlag(*r.value);
    const std::vector<std::string> f = absl::StrSplit(text, ':');
    if (f.size() != 2 || !absl::SimpleAtoi(f[0], r.min) ||
        !absl::SimpleAtoi(f[1], r.max)) {
      return Bad(r.flag, text, "want MIN:MAX (tokens)");
    }
    if (*r.min > *r.max) return Bad(r.flag, text, "MIN is above MAX");
  }
  if (absl::Status st = CheckSyntheticShape(s); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--synthetic_*: ", st.message()));
  }
  return s;
}

absl::StatusOr<std::vector<TenantWeight>> TenantsFromFlags() {
  const std::string text = absl::GetFlag(FLAGS_tenants);
  std::vector<TenantWeight> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<std::string> f = absl::StrSplit(part, ':');
    TenantWeight t;
    if (f.size() < 2 || f.size() > 3 || f[0].empty() ||
        !absl::SimpleAtod(f[1], &t.weight)) {
      return Bad("tenants", text,
                 absl::StrCat("\"", part, "\" is not ID:WEIGHT[:FROM_S-TO_S]"));
    }
    if (f.size() == 3) {
      const std::vector<std::string> w = absl::StrSplit(f[2], '-');
      double from = 0, to = 0;
      if (w.size() != 2 || !absl::SimpleAtod(w[0], &from) ||
          !absl::SimpleAtod(w[1], &to) || from < 0 || to <= from) {
        return Bad("tenants", text,
                   absl::StrCat("\"", f[2],
                                "\" is not a window FROM_S-TO_S (seconds, "
                                "FROM_S < TO_S)"));
      }
      t.from_ms = static_cast<int64_t>(from * 1000);
      t.to_ms = static_cast<int64_t>(to * 1000);
    }
    t.tenant = f[0];
    out.push_back(t);
  }
  if (out.empty()) return Bad("tenants", text, "no tenants");
  return out;
}

absl::StatusOr<std::vector<ReplayTenant>> BudgetsFromFlags() {
  const std::string text = absl::GetFlag(FLAGS_budgets);
  std::vector<ReplayTenant> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<std::string> f = absl::StrSplit(part, ':');
    uint64_t floor = 0, ceiling = 0;
    if (f.size() != 3 || f[0].empty() || !absl::SimpleAtoi(f[1], &floor) ||
        !absl::SimpleAtoi(f[2], &ceiling)) {
      return Bad(
          "budgets", text,
          absl::StrCat("\"", part, "\" is not ID:FLOOR_MIB:CEILING_MIB"));
    }
    if (ceiling > 0 && floor > ceiling) {
      return Bad(
          "budgets", text,
          absl::StrCat("\"", part, "\": the floor is above the ceiling"));
    }
    out.push_back({f[0], floor << 20, ceiling << 20});
  }
  return out;
}

absl::StatusOr<Trace> TraceFromFlags(const std::vector<TenantWeight>& tenants) {
  const std::string kind = absl::GetFlag(FLAGS_trace);
  Timing timing;
  timing.arrival_rate = absl::GetFlag(FLAGS_arrival_rate);
  timing.think_ms = absl::GetFlag(FLAGS_think_ms);
  timing.decode_ms_per_token = absl::GetFlag(FLAGS_decode_ms_per_token);
  timing.tool_ms = absl::GetFlag(FLAGS_tool_ms);
  const int sessions = absl::GetFlag(FLAGS_sessions);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<Trace> trace;
  if (kind == "synthetic") {
    TRIAX_ASSIGN_OR_RETURN(const SyntheticShape shape, ShapeFromFlags());
    trace = MakeTrace(sessions, tenants, timing, seed, [&](TraceRng& rng) {
      return DrawSyntheticShape(shape, rng);
    });
  } else if (kind == "bfcl") {
    std::vector<std::string> ids;
    const std::vector<std::string>& held_out = calibrate::HeldOutIds();
    const std::string text = absl::GetFlag(FLAGS_bfcl_ids);
    if (text.empty()) {
      for (const std::string& id : held_out) {
        if (absl::StartsWith(id, "multi_turn_base_")) ids.push_back(id);
      }
    } else {
      ids = absl::StrSplit(text, ',', absl::SkipEmpty());
      for (const std::string& id : ids) {
        if (std::find(held_out.begin(), held_out.end(), id) == held_out.end()) {
          return Bad("bfcl_ids", text,
                     absl::StrCat(id,
                                  " is not held out from kvproxy-18m's "
                                  "training (its README); the replay "
                                  "measures on held-out conversations"));
        }
      }
    }
    const std::string dir =
        frontend::ResolveDataDir(absl::GetFlag(FLAGS_data_dir));
    TRIAX_ASSIGN_OR_RETURN(const frontend::BfclData data,
                           frontend::BfclData::Load(dir));
    std::vector<SessionShape> shapes;
    for (const std::string& id : ids) {
      TRIAX_ASSIGN_OR_RETURN(const frontend::RenderedConversation conv,
                             data.Render(id));
      TRIAX_ASSIGN_OR_RETURN(
          SessionShape shape,
          ShapeOfConversation(conv, absl::GetFlag(FLAGS_bytes_per_token)));
      shapes.push_back(std::move(shape));
    }
    trace = MakeTrace(sessions, tenants, timing, seed, [&](TraceRng& rng) {
      return shapes[rng.Next() % shapes.size()];
    });
  } else {
    trace = ReadTrace(kind);
  }
  if (!trace.ok()) {
    return absl::Status(
        trace.status().code(),
        absl::StrCat("--trace=", kind, ": ", trace.status().message()));
  }
  return trace;
}

// What the rows need to be played: the sessions' policy per row, the
// operator policies to put, labels.
struct Row {
  std::string label;
  std::string policy;  // the name sessions open with
  std::string describe;
  std::optional<manager::PolicyInfo> put;
};

absl::StatusOr<std::vector<Row>> RowsFromFlags(
    const ModelShape& model, uint32_t block_tokens,
    const std::optional<manager::CalibrationTableInfo>& table,
    const std::string& table_name) {
  const std::string text = absl::GetFlag(FLAGS_policies);
  TRIAX_ASSIGN_OR_RETURN(auto rows, kvctl::ParseCapacityRows("policies", text));
  if (rows.empty()) return Bad("policies", text, "no rows");
  std::vector<Row> out;
  std::set<std::string> labels;
  const kernels::PageShape page{static_cast<int>(block_tokens),
                                static_cast<int>(model.n_kv_heads),
                                static_cast<int>(model.head_dim)};
  for (size_t i = 0; i < rows.size(); ++i) {
    const v1::CapacityPolicy& p = rows[i];
    Row row;
    if (p.sink_tokens() > 0 || p.window_tokens() > 0) {
      return Bad("policies", text,
                 absl::StrCat("row ", i + 1,
                              ": +sink and +window are plan-only (the "
                              "manager tags one sink block and does not "
                              "charge the workers' window pages)"));
    }
    if (!p.policy().empty()) {
      row.policy = p.policy();
      row.label = p.policy();
      row.describe = absl::StrCat("policy ", p.policy());
    } else if (p.budget_bits() > 0) {
      if (!table) {
        return Bad("policies", text,
                   absl::StrCat("row ", i + 1,
                                ": triaxial=BITS needs "
                                "--calibration"));
      }
      manager::PolicyInfo put;
      put.name =
          absl::StrFormat("triaxial-%g%s", p.budget_bits(),
                          p.objective() == v1::OBJECTIVE_DNLL ? "-dnll" : "");
      put.budget_bits = p.budget_bits();
      put.calibration_model = table->model;
      put.objective = p.objective();
      row.policy = put.name;
      row.label =
          absl::StrFormat("triaxial@%gb%s", p.budget_bits(),
                          p.objective() == v1::OBJECTIVE_DNLL ? "+dnll" : "");
      row.describe = absl::StrFormat(
          "allocation policy at %g effective bits, table %s%s", p.budget_bits(),
          table->model,
          p.objective() == v1::OBJECTIVE_DNLL ? ", objective dNLL" : "");
      row.put = put;
    } else {
      manager::EncodingSpec spec;
      spec.format = FormatFromProto(p.format());
      spec.format_v = FormatFromProto(p.format_v());
      spec.group_size = p.group_size();
      spec.scale_dtype = ClampWireEnum(p.scale_dtype());
      auto enc =
          manager::ResolveEncoding(absl::StrCat("policies row ", i + 1), spec);
      if (!enc.ok()) return Bad("policies", text, enc.status().message());
      const std::string name = manager::EncodingString(*enc);
      row.label = name;
      if (manager::FindBuiltinPolicy(name) != nullptr) {
        row.policy = name;
      } else {
        manager::PolicyInfo put;
        put.name = absl::StrCat("replay-row-", i + 1);
        put.rules.push_back(manager::PolicyRuleInfo{});
        put.rules.back().encoding = spec;
        row.policy = put.name;
        row.put = put;
      }
      row.describe = absl::StrFormat("%s everywhere, %.2f effective bits", name,
                                     kernels::EffectiveBits(*enc, page));
    }
    if (!p.label().empty()) row.label = p.label();
    if (!labels.insert(row.label).second) {
      return Bad("policies", text,
                 absl::StrCat("two rows are labelled ", row.label,
                              " (give one +label=NAME)"));
    }
    out.push_back(std::move(row));
  }
  return out;
}

int Main() {
  auto tenants = TenantsFromFlags();
  auto budgets = BudgetsFromFlags();
  if (!tenants.ok() || !budgets.ok()) {
    std::cerr << "capacity_replay: "
              << (tenants.ok() ? budgets.status() : tenants.status()).message()
              << "\n";
    return 2;
  }
  // The calibration table and the model shape.
  std::optional<manager::CalibrationTableInfo> table;
  if (const std::string path = absl::GetFlag(FLAGS_calibration);
      !path.empty()) {
    auto t = calibrate::ReadTableFile(path);
    if (!t.ok()) {
      std::cerr << "capacity_replay: --calibration=" << path << ": "
                << t.status().message() << "\n";
      return 2;
    }
    table = manager::FromProto(*t);
  }
  ModelShape model;
  std::string model_note;
  const std::string table_name = table ? table->model : "";
  if (const std::string name = absl::GetFlag(FLAGS_model); name == "table") {
    if (!table) {
      std::cerr << "capacity_replay: --model=table needs --calibration\n";
      return 2;
    }
    model = table->shape;
    model_note = absl::StrCat(model.name, " (the calibration table's shape)");
  } else {
    auto shape = manager::PresetShape("--model", name);
    if (!shape.ok()) {
      std::cerr << "capacity_replay: " << shape.status().message() << "\n";
      return 2;
    }
    model = *shape;
    model_note = model.name;
    if (table) {
      // The manager takes a table only on the sequences' shape: the table's
      // distortions stand in for this model's (as kvctl plan says).
      model_note = absl::StrCat(model.name, " (", table->model,
                                "'s calibration table standing in)");
      // Stored under the model's name, so that the ranker reads it for
      // rule-policy sessions too.
      table->shape = model;
      table->model = model.name;
    }
  }
  const uint32_t block_tokens = absl::GetFlag(FLAGS_block_tokens);
  auto rows = RowsFromFlags(model, block_tokens, table, table_name);
  if (!rows.ok()) {
    std::cerr << "capacity_replay: " << rows.status().message() << "\n";
    return 2;
  }
  auto trace = TraceFromFlags(*tenants);
  if (!trace.ok()) {
    std::cerr << "capacity_replay: " << trace.status().message() << "\n";
    return absl::IsInvalidArgument(trace.status()) ? 2 : 1;
  }
  if (const std::string path = absl::GetFlag(FLAGS_trace_out); !path.empty()) {
    if (absl::Status st = WriteTrace(path, *trace); !st.ok()) {
      std::cerr << "capacity_replay: " << st.message() << "\n";
      return 1;
    }
  }
  auto mode = manager::ParsePressureMode(absl::GetFlag(FLAGS_pressure_mode));
  if (!mode.ok()) {
    std::cerr << "capacity_replay: --pressure_mode: " << mode.status().message()
              << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_gpus) < 1 || absl::GetFlag(FLAGS_device_mib) < 1 ||
      !(absl::GetFlag(FLAGS_patience_s) > 0)) {
    std::cerr << "capacity_replay: --gpus=" << absl::GetFlag(FLAGS_gpus)
              << ", --device_mib=" << absl::GetFlag(FLAGS_device_mib)
              << " and --patience_s=" << absl::GetFlag(FLAGS_patience_s)
              << " must all be positive\n";
    return 2;
  }
  ReplayConfig config;
  config.model = model;
  config.block_tokens = block_tokens;
  config.workers = absl::GetFlag(FLAGS_gpus);
  config.device_bytes = absl::GetFlag(FLAGS_device_mib) << 20;
  config.host_bytes = absl::GetFlag(FLAGS_host_mib) << 20;
  config.disk_bytes = absl::GetFlag(FLAGS_disk_mib) << 20;
  config.tenants = *budgets;
  config.calibration = table;
  config.reclaim = absl::GetFlag(FLAGS_reclaim);
  config.manager.ranker.mode = *mode;
  config.manager.watermarks.high = absl::GetFlag(FLAGS_high_watermark);
  config.manager.watermarks.low = absl::GetFlag(FLAGS_low_watermark);
  config.manager.window_guard_tokens = absl::GetFlag(FLAGS_window_guard_tokens);
  config.manager.active_guard_ms = absl::GetFlag(FLAGS_active_guard_ms);
  config.manager.resume_reserve = absl::GetFlag(FLAGS_resume_reserve);
  config.tick_ms = absl::GetFlag(FLAGS_tick_ms);
  config.patience_ms =
      static_cast<int64_t>(absl::GetFlag(FLAGS_patience_s) * 1000.0);
  config.retry_ms = absl::GetFlag(FLAGS_retry_ms);
  config.sample_ms = absl::GetFlag(FLAGS_sample_ms);

  std::string report = absl::StrCat(
      "trace: ", TraceSummary(*trace), "\nmodel: ", model_note, ", ",
      block_tokens, "-token blocks; ", config.workers, " worker(s) of ",
      absl::GetFlag(FLAGS_device_mib), " MiB",
      config.host_bytes > 0
          ? absl::StrCat(", host tier ", absl::GetFlag(FLAGS_host_mib), " MiB")
          : "",
      config.disk_bytes > 0
          ? absl::StrCat(", disk tier ", absl::GetFlag(FLAGS_disk_mib), " MiB")
          : "",
      "; reclaim ", config.reclaim ? "on" : "off", " (",
      manager::PressureModeName(*mode), "), patience ",
      absl::GetFlag(FLAGS_patience_s), " s\n\n");
  const std::string svg_row = absl::GetFlag(FLAGS_svg_row);
  if (!svg_row.empty() &&
      std::none_of(rows->begin(), rows->end(),
                   [&](const Row& r) { return r.label == svg_row; })) {
    std::cerr << "capacity_replay: --svg_row=\"" << svg_row
              << "\" is no row's label\n";
    return 2;
  }
  std::vector<ReplayRow> results;
  for (const Row& row : *rows) {
    ReplayConfig c = config;
    c.policy = row.policy;
    if (row.put) c.put_policies.push_back(*row.put);
    auto r = RunReplay(*trace, c);
    if (!r.ok()) {
      std::cerr << "capacity_replay: row " << row.label << ": "
                << r.status().ToString() << "\n";
      return 1;
    }
    std::fprintf(stderr, "%s: %.1f s\n", row.label.c_str(), r->wall_s);
    absl::StrAppend(&report, "- ", row.label, ": ", row.describe, "\n");
    results.push_back(ReplayRow{row.label, row.describe, *std::move(r)});
  }
  absl::StrAppend(&report, "\n", ResultsTable(results), "\nper tenant:\n\n",
                  TenantTable(results), "\nchecks:\n\n", ChecksTable(results));
  std::cout << report;
  if (const std::string path = absl::GetFlag(FLAGS_out); !path.empty()) {
    std::ofstream out(path);
    out << report;
    if (!out) {
      std::cerr << "capacity_replay: cannot write " << path << "\n";
      return 1;
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_svg); !path.empty()) {
    const ReplayRow* pick = &results.back();
    for (const ReplayRow& r : results) {
      if (r.label == svg_row) pick = &r;
    }
    std::ofstream out(path);
    out << ShareSvg(*pick, absl::StrCat("Replay, ", pick->label));
    if (!out) {
      std::cerr << "capacity_replay: cannot write " << path << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace triax::bench::capacity

int main(int argc, char** argv) {
  // The core logs every allocation demotion at info: a replay makes
  // millions. TRIAX_LOG_LEVEL, when set, still decides.
  setenv("TRIAX_LOG_LEVEL", "warn", /*overwrite=*/0);
  absl::ParseCommandLine(argc, argv);
  return triax::bench::capacity::Main();
}
