#include "client/kvctl_plan.h"

#include <google/protobuf/text_format.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/kvctl_format.h"
#include "common/grpc_status.h"
#include "common/svg.h"

ABSL_FLAG(std::string, model, "",
          "plan: a model preset (llama-3-8b, llama-3-70b, qwen2.5-7b, "
          "qwen2.5-72b, mistral-7b) or LAYERS,KV_HEADS,HEAD_DIM by hand");
ABSL_FLAG(std::string, gpu_memory, "", "plan: memory per GPU, e.g. 80GiB");
ABSL_FLAG(int64_t, gpus, 1, "plan: number of GPUs");
ABSL_FLAG(std::string, reserve, "0",
          "plan: per GPU, weights and runtime, e.g. 35GiB");
ABSL_FLAG(double, ceiling, 1.0,
          "plan: safety ceiling, the share of the KV memory used, in (0, 1]");
ABSL_FLAG(std::string, host_tier, "0", "plan: host spill tier per worker");
ABSL_FLAG(std::string, disk_tier, "0", "plan: disk spill tier per worker");
ABSL_FLAG(std::string, frame, "0",
          "plan: the workers' frame size (kvworker --frame_kb; 256KiB by "
          "default there); 0: pages without frames");
ABSL_FLAG(uint32_t, block_tokens, 16, "plan: tokens per block");
ABSL_FLAG(std::string, policies, "bf16 fp8 int4",
          "plan: rows separated by spaces: ENCODING[+sink=N][+window=N], "
          "policy=NAME[+window=N] or triaxial=BITS[+dnll][+window=N]");
ABSL_FLAG(std::string, context, "",
          "plan: context lengths for sessions, e.g. 4096,32768");
ABSL_FLAG(std::string, tenants, "",
          "plan: ID:FLOOR:CEILING,... (sizes; ceiling 0: none)");
ABSL_FLAG(bool, live_tenants, false,
          "plan: add the manager's tenants and their device budgets");
ABSL_FLAG(std::string, tag_mix, "",
          "plan: a file of `TAG TOKENS` lines (TAG as temporal/modality/role) "
          "or `live` (the blocks of the manager's open sequences)");
ABSL_FLAG(std::string, calibration, "",
          "plan: a CalibrationTable file (.txtpb text, else binary) for "
          "triaxial rows");
ABSL_FLAG(std::string, calibration_model, "",
          "plan: the manager's stored calibration table of this model");
ABSL_FLAG(int64_t, what_if_gpus, 0, "plan: what if N GPUs were added");
ABSL_FLAG(std::string, what_if_tenant, "",
          "plan: what if tenant ID:FLOOR:CEILING were added");
ABSL_FLAG(std::string, what_if_policies, "",
          "plan: what if the rows were these (--policies syntax)");
ABSL_FLAG(std::string, svg, "",
          "plan: also write a chart (SVG): live tokens per policy and, with "
          "--context, sessions against KV memory per GPU");

namespace triax::kvctl {

const char kPlanUsage[] =
    R"(  plan --model M --gpu_memory SIZE [--gpus N] [--reserve SIZE]
       [--ceiling C] [--policies "ROW ROW ..."] [--context L,L]
       [--tenants ID:FLOOR:CEIL,...] [--live_tenants] [--tag_mix FILE|live]
       [--calibration FILE | --calibration_model NAME] [--block_tokens T]
       [--frame SIZE] [--host_tier SIZE] [--disk_tier SIZE]
       [--what_if_gpus N] [--what_if_tenant ID:FLOOR:CEIL]
       [--what_if_policies "ROW ..."] [--svg FILE]
                                capacity plan: bytes per token (idealized
                                and triaxkv pages), live tokens, sessions
                                per context length and per tenant
                                (docs/capacity.md); ROW: ENCODING[+sink=N]
                                [+window=N], policy=NAME or
                                triaxial=BITS[+dnll]; any with +label=NAME
)";

namespace {

absl::Status Bad(absl::string_view flag, absl::string_view text,
                 absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=\"", text, "\": ", why));
}

absl::StatusOr<v1::CapacityTenant> ParseTenant(absl::string_view flag,
                                               absl::string_view text) {
  const std::vector<std::string> f = absl::StrSplit(text, ':');
  if (f.size() != 3 || f[0].empty()) {
    return Bad(flag, text, "want ID:FLOOR:CEILING");
  }
  v1::CapacityTenant t;
  t.set_tenant_id(f[0]);
  auto floor = ParseSize(flag, f[1]);
  if (!floor.ok()) return floor.status();
  auto ceiling = ParseSize(flag, f[2]);
  if (!ceiling.ok()) return ceiling.status();
  t.set_floor_bytes(*floor);
  t.set_ceiling_bytes(*ceiling);
  return t;
}

absl::Status ReadTagMix(const std::string& path, v1::PlanCapacityRequest* req) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l[0] == '#') continue;
    const std::vector<absl::string_view> f =
        absl::StrSplit(l, ' ', absl::SkipWhitespace());
    const std::string where = absl::StrCat(path, ":", n);
    int64_t tokens = 0;
    if (f.size() != 2 || !absl::SimpleAtoi(f[1], &tokens)) {
      return Bad("tag_mix", line,
                 absl::StrCat(where, ": want `temporal/modality/role TOKENS`"));
    }
    const std::vector<std::string> axes = absl::StrSplit(f[0], '/');
    v1::Tag tag;
    bool ok = axes.size() == 3;
    if (ok) {
      v1::Temporal t;
      v1::Modality m;
      v1::Role r;
      ok = v1::Temporal_Parse(
               absl::StrCat("TEMPORAL_", absl::AsciiStrToUpper(axes[0])), &t) &&
           v1::Modality_Parse(
               absl::StrCat("MODALITY_", absl::AsciiStrToUpper(axes[1])), &m) &&
           v1::Role_Parse(absl::StrCat("ROLE_", absl::AsciiStrToUpper(axes[2])),
                          &r);
      tag.set_temporal(t);
      tag.set_modality(m);
      tag.set_role(r);
    }
    if (!ok) {
      return Bad("tag_mix", line,
                 absl::StrCat(where, ": \"", f[0],
                              "\" is no temporal/modality/role tag, e.g. "
                              "older/text/tool_result"));
    }
    v1::CapacityTagTokens* t = req->add_tag_mix();
    *t->mutable_tag() = tag;
    t->set_tokens(tokens);
  }
  return absl::OkStatus();
}

absl::Status ReadCalibration(const std::string& path, v1::CalibrationTable* t) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  const bool text = absl::EndsWith(path, ".txtpb") ||
                    absl::EndsWith(path, ".textproto") ||
                    absl::EndsWith(path, ".pbtxt");
  const bool ok =
      text ? google::protobuf::TextFormat::ParseFromString(ss.str(), t)
           : t->ParseFromString(ss.str());
  if (!ok) return Bad("calibration", path, "is not a CalibrationTable");
  return absl::OkStatus();
}

// 1234567 -> "1,234,567".
std::string Thousands(int64_t v) {
  std::string digits = absl::StrCat(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string GiB(double bytes) {
  return absl::StrFormat("%.2f GiB", bytes / (1024.0 * 1024 * 1024));
}

std::string RowsTable(
    const v1::PlanCapacityResponse& r,
    const google::protobuf::RepeatedPtrField<v1::CapacityRow>& rows) {
  bool tiers = false;
  for (const auto& row : rows) {
    tiers = tiers || row.host_tokens() > 0 || row.disk_tokens() > 0;
  }
  std::string out = absl::StrFormat(
      "%-24s %-10s %6s  %10s %14s  %10s %14s", "POLICY", "KIND", "BITS",
      "IDEAL KiB/T", "IDEAL TOKENS", "PAGE KiB/T", "PAGE TOKENS");
  if (tiers)
    absl::StrAppend(
        &out, absl::StrFormat("  %12s %12s", "HOST TOKENS", "DISK TOKENS"));
  for (const int64_t l : r.context_lengths()) {
    absl::StrAppend(&out,
                    absl::StrFormat("  %21s", absl::StrCat("SESSIONS@", l)));
  }
  out += "\n";
  for (const auto& row : rows) {
    absl::StrAppend(
        &out, absl::StrFormat("%-24s %-10s %6.2f  %10.1f %14s  %10.1f %14s",
                              row.label(), row.kind(), row.page_bits(),
                              row.ideal_bytes_per_token() / 1024,
                              Thousands(row.ideal_tokens()),
                              row.page_bytes_per_token() / 1024,
                              Thousands(row.page_tokens())));
    if (tiers) {
      absl::StrAppend(
          &out, absl::StrFormat("  %12s %12s", Thousands(row.host_tokens()),
                                Thousands(row.disk_tokens())));
    }
    for (const auto& s : row.sessions()) {
      absl::StrAppend(
          &out, absl::StrFormat(
                    "  %21s", absl::StrCat(Thousands(s.ideal_sessions()), " / ",
                                           Thousands(s.page_sessions()))));
    }
    out += "\n";
  }
  return out;
}

}  // namespace

absl::StatusOr<int64_t> ParseSize(absl::string_view flag,
                                  absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  struct Unit {
    const char* suffix;
    double bytes;
  };
  static constexpr Unit kUnits[] = {
      {"KiB", 1024.0},
      {"MiB", 1024.0 * 1024},
      {"GiB", 1024.0 * 1024 * 1024},
      {"TiB", 1024.0 * 1024 * 1024 * 1024},
      {"KB", 1e3},
      {"MB", 1e6},
      {"GB", 1e9},
      {"TB", 1e12},
      {"B", 1},
  };
  double scale = 1;
  for (const Unit& u : kUnits) {
    if (absl::ConsumeSuffix(&t, u.suffix)) {
      scale = u.bytes;
      break;
    }
  }
  t = absl::StripAsciiWhitespace(t);
  double v = 0;
  if (t.empty() || !absl::SimpleAtod(t, &v) || !std::isfinite(v) ||
      std::fabs(v * scale) > 9e18) {
    return Bad(flag, text,
               "is no size; want a number with an optional unit (B, KiB, "
               "MiB, GiB, TiB, KB, MB, GB, TB), e.g. 80GiB");
  }
  return static_cast<int64_t>(std::llround(v * scale));
}

absl::StatusOr<v1::PlanCapacityRequest> PlanRequestFromFlags() {
  v1::PlanCapacityRequest req;
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) {
    return absl::InvalidArgumentError(
        "--model is required: a preset (llama-3-8b, ...) or "
        "LAYERS,KV_HEADS,HEAD_DIM");
  }
  if (absl::StrContains(model, ',')) {
    const std::vector<std::string> f = absl::StrSplit(model, ',');
    uint32_t n[3] = {0, 0, 0};
    if (f.size() != 3 || !absl::SimpleAtoi(f[0], &n[0]) ||
        !absl::SimpleAtoi(f[1], &n[1]) || !absl::SimpleAtoi(f[2], &n[2])) {
      return Bad("model", model, "want LAYERS,KV_HEADS,HEAD_DIM");
    }
    v1::ModelShape* m = req.mutable_model();
    m->set_name("custom");
    m->set_n_layers(n[0]);
    m->set_n_kv_heads(n[1]);
    m->set_n_q_heads(n[1]);
    m->set_head_dim(n[2]);
  } else {
    req.set_model_preset(model);
  }
  const std::string gpu = absl::GetFlag(FLAGS_gpu_memory);
  if (gpu.empty()) {
    return absl::InvalidArgumentError("--gpu_memory is required, e.g. 80GiB");
  }
  struct SizeFlag {
    const char* name;
    std::string value;
    void (v1::PlanCapacityRequest::*set)(int64_t);
  };
  const SizeFlag sizes[] = {
      {"gpu_memory", gpu, &v1::PlanCapacityRequest::set_gpu_memory_bytes},
      {"reserve", absl::GetFlag(FLAGS_reserve),
       &v1::PlanCapacityRequest::set_reserve_bytes},
      {"host_tier", absl::GetFlag(FLAGS_host_tier),
       &v1::PlanCapacityRequest::set_host_bytes},
      {"disk_tier", absl::GetFlag(FLAGS_disk_tier),
       &v1::PlanCapacityRequest::set_disk_bytes},
      {"frame", absl::GetFlag(FLAGS_frame),
       &v1::PlanCapacityRequest::set_frame_bytes},
  };
  for (const SizeFlag& s : sizes) {
    auto v = ParseSize(s.name, s.value);
    if (!v.ok()) return v.status();
    (req.*s.set)(*v);
  }
  req.set_gpu_count(absl::GetFlag(FLAGS_gpus));
  req.set_ceiling(absl::GetFlag(FLAGS_ceiling));
  req.set_block_tokens(absl::GetFlag(FLAGS_block_tokens));
  auto rows = ParseCapacityRows("policies", absl::GetFlag(FLAGS_policies));
  if (!rows.ok()) return rows.status();
  for (auto& row : *rows) *req.add_policies() = std::move(row);
  const std::string context = absl::GetFlag(FLAGS_context);
  for (absl::string_view l : absl::StrSplit(context, ',', absl::SkipEmpty())) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(l, &n)) {
      return Bad("context", context, absl::StrCat("\"", l, "\" is no number"));
    }
    req.add_context_lengths(n);
  }
  const std::string tenants = absl::GetFlag(FLAGS_tenants);
  for (absl::string_view t : absl::StrSplit(tenants, ',', absl::SkipEmpty())) {
    auto tenant = ParseTenant("tenants", t);
    if (!tenant.ok()) return tenant.status();
    *req.add_tenants() = *std::move(tenant);
  }
  req.set_live_tenants(absl::GetFlag(FLAGS_live_tenants));
  const std::string mix = absl::GetFlag(FLAGS_tag_mix);
  if (mix == "live") {
    req.set_live_tag_mix(true);
  } else if (!mix.empty()) {
    absl::Status s = ReadTagMix(mix, &req);
    if (!s.ok()) return s;
  }
  const std::string calibration = absl::GetFlag(FLAGS_calibration);
  if (!calibration.empty()) {
    absl::Status s = ReadCalibration(calibration, req.mutable_calibration());
    if (!s.ok()) return s;
  }
  req.set_calibration_model(absl::GetFlag(FLAGS_calibration_model));
  if (const int64_t n = absl::GetFlag(FLAGS_what_if_gpus); n != 0) {
    v1::CapacityWhatIf* w = req.add_what_ifs();
    w->set_label(absl::StrCat("+", n, " GPU", n == 1 ? "" : "s"));
    w->set_add_gpus(n);
  }
  if (const std::string t = absl::GetFlag(FLAGS_what_if_tenant); !t.empty()) {
    auto tenant = ParseTenant("what_if_tenant", t);
    if (!tenant.ok()) return tenant.status();
    v1::CapacityWhatIf* w = req.add_what_ifs();
    w->set_label(absl::StrCat("+tenant ", tenant->tenant_id()));
    *w->add_add_tenants() = *std::move(tenant);
  }
  if (const std::string p = absl::GetFlag(FLAGS_what_if_policies); !p.empty()) {
    auto alt = ParseCapacityRows("what_if_policies", p);
    if (!alt.ok()) return alt.status();
    v1::CapacityWhatIf* w = req.add_what_ifs();
    w->set_label(absl::StrCat("policies: ", p));
    for (auto& row : *alt) *w->add_policies() = std::move(row);
  }
  return req;
}

std::string PlanTable(const v1::PlanCapacityResponse& r) {
  const v1::ModelShape& m = r.model();
  std::string out = absl::StrCat(
      "model ", m.name(), ": ", m.n_layers(), " layers, ", m.n_kv_heads(),
      " KV heads, head_dim ", m.head_dim(), "; blocks of ", r.block_tokens(),
      " tokens\n", "memory: ", r.gpu_count(), " GPU",
      r.gpu_count() == 1 ? "" : "s", ", ", GiB(r.kv_bytes()), " for KV, ",
      GiB(r.usable_bytes()), " under the ceiling\n");
  if (!r.calibration_model().empty()) {
    absl::StrAppend(&out, "calibration: ", r.calibration_model(), "\n");
  }
  if (r.tag_mix_size() > 0) {
    int64_t total = 0;
    for (const auto& t : r.tag_mix()) total += t.tokens();
    absl::StrAppend(&out, "tag mix: ", r.tag_mix_size(), " tags, ",
                    Thousands(total), " tokens\n");
  }
  absl::StrAppend(&out,
                  "columns: IDEAL = the FP8/INT4 note's formula (codes + one "
                  "scale per group); PAGE = triaxkv pages (PageBytes per "
                  "block / block tokens); SESSIONS = ideal / pages\n\n");
  absl::StrAppend(&out, RowsTable(r, r.rows()));
  for (const auto& row : r.rows()) {
    if (row.mix_size() == 0) continue;
    absl::StrAppend(&out, "\n", row.label(), " by tag",
                    row.calibration_shape_matches()
                        ? ""
                        : " (calibration measured on another shape)",
                    ":\n");
    for (const auto& c : row.mix()) {
      absl::StrAppend(
          &out,
          absl::StrFormat("  %-30s %-22s %12s tokens\n", TagString(c.tag()),
                          EncodingString(c.format(), c.format_v(),
                                         c.group_size(), c.scale_dtype()),
                          Thousands(c.tokens())));
    }
  }
  if (r.tenants_size() > 0) {
    absl::StrAppend(&out, "\ntenants",
                    r.floors_exceed_memory() ? " (floors exceed the memory: "
                                               "shares are floors scaled down)"
                                             : "",
                    ":\n",
                    absl::StrFormat("%-16s %12s %12s %12s", "TENANT", "FLOOR",
                                    "CEILING", "SHARE"));
    for (const auto& row : r.rows()) {
      absl::StrAppend(&out, absl::StrFormat("  %20s", row.label()));
    }
    out += "\n";
    for (int i = 0; i < r.tenants_size(); ++i) {
      const auto& t = r.tenants(i);
      absl::StrAppend(
          &out,
          absl::StrFormat("%-16s %12s %12s %12s", t.tenant_id(),
                          GiB(static_cast<double>(t.floor_bytes())),
                          t.ceiling_bytes() == 0
                              ? std::string("-")
                              : GiB(static_cast<double>(t.ceiling_bytes())),
                          GiB(t.share_bytes())));
      for (const auto& row : r.rows()) {
        const auto& tr = row.tenants(i);
        std::string cell = Thousands(tr.page_tokens());
        if (tr.page_sessions_size() > 0) {
          absl::StrAppend(&cell, " tok/", Thousands(tr.page_sessions(0)), " s");
        }
        absl::StrAppend(&out, absl::StrFormat("  %20s", cell));
      }
      out += "\n";
    }
  }
  for (const auto& w : r.what_ifs()) {
    absl::StrAppend(&out, "\nwhat if ", w.label(), ": ", w.gpu_count(),
                    " GPUs, ", GiB(w.usable_bytes()), " usable\n",
                    RowsTable(r, w.rows()));
    // Page tokens against the base row of the same label.
    for (const auto& row : w.rows()) {
      for (const auto& base : r.rows()) {
        if (base.label() != row.label() || base.page_tokens() == 0) continue;
        absl::StrAppend(
            &out,
            absl::StrFormat("  %s: %+.1f%% page tokens\n", row.label(),
                            100.0 * (static_cast<double>(row.page_tokens()) /
                                         base.page_tokens() -
                                     1)));
      }
    }
    for (const auto& t : w.tenants()) {
      absl::StrAppend(&out, "  tenant ", t.tenant_id(), ": share ",
                      GiB(t.share_bytes()), "\n");
    }
  }
  return out;
}

namespace {

// Sessions of the first context length against the KV memory per GPU, one
// line per row: floor(memory x ceiling / session bytes) x GPUs at 64
// memory points, the pages column's arithmetic at the row's session bytes
// (frame rounding left out). Drawn from y = top; returns the panel's height.
int SessionsPanel(const v1::PlanCapacityResponse& r, int top,
                  std::string* out) {
  constexpr int kPoints = 64;
  const double gpus = static_cast<double>(std::max<int64_t>(1, r.gpu_count()));
  const double per_gpu = r.kv_bytes() / gpus;
  const double ceiling = r.kv_bytes() > 0 ? r.usable_bytes() / r.kv_bytes() : 1;
  auto sessions = [&](const v1::CapacityRow& row, double memory) {
    const auto bytes =
        static_cast<double>(row.sessions(0).page_session_bytes());
    return bytes > 0 ? std::floor(std::floor(memory * ceiling) / bytes) * gpus
                     : 0.0;
  };
  svg::LinePanel panel;
  panel.title = absl::StrFormat(
      "Sessions of %d tokens (triaxkv pages) against KV memory per GPU "
      "(under the ceiling), %d GPU%s",
      r.context_lengths(0), r.gpu_count(), r.gpu_count() == 1 ? "" : "s");
  panel.top = top;
  panel.x_max = per_gpu > 0 ? per_gpu : 1;
  panel.y_max = 1;
  panel.css_class = "sessions";
  for (int t = 0; t <= 4; ++t) panel.x_ticks.push_back(GiB(per_gpu * t / 4.0));
  std::vector<svg::Series> lines;
  for (const auto& row : r.rows()) {
    if (row.sessions_size() == 0) continue;
    svg::Series line{row.label(), {}};
    for (int k = 0; k <= kPoints; ++k) {
      const double memory = per_gpu * k / kPoints;
      line.points.emplace_back(memory, sessions(row, memory));
      panel.y_max = std::max(panel.y_max, line.points.back().second);
    }
    lines.push_back(std::move(line));
  }
  panel.y_max_label = Thousands(static_cast<int64_t>(panel.y_max));
  return svg::AppendLinePanel(panel, lines, out);
}

}  // namespace

std::string PlanSvg(const v1::PlanCapacityResponse& r) {
  constexpr int kBarH = 14, kGap = 10, kLeft = 200, kWidth = 520, kTop = 40;
  const int n = r.rows_size();
  const int bars = kTop + n * (2 * kBarH + kGap) + 40;
  std::string panel;
  const int height =
      bars +
      (r.context_lengths_size() > 0 ? SessionsPanel(r, bars, &panel) : 0);
  double max_tokens = 1;
  for (const auto& row : r.rows()) {
    max_tokens = std::max({max_tokens, static_cast<double>(row.ideal_tokens()),
                           static_cast<double>(row.page_tokens())});
  }
  std::string out = absl::StrCat(
      svg::Open(kLeft + kWidth + 200, height),
      absl::StrFormat("<text x=\"10\" y=\"20\" font-size=\"14\">Live "
                      "tokens per policy: %s, %s usable</text>\n",
                      svg::Escape(r.model().name()), GiB(r.usable_bytes())));
  for (int i = 0; i < n; ++i) {
    const auto& row = r.rows(i);
    const int y = kTop + i * (2 * kBarH + kGap);
    const double wi =
        kWidth * static_cast<double>(row.ideal_tokens()) / max_tokens;
    const double wp =
        kWidth * static_cast<double>(row.page_tokens()) / max_tokens;
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s</text>\n"
            "<rect class=\"ideal\" x=\"%d\" y=\"%d\" width=\"%.1f\" "
            "height=\"%d\" fill=\"#9ecae1\"/>\n"
            "<text x=\"%.1f\" y=\"%d\">%s</text>\n"
            "<rect class=\"pages\" x=\"%d\" y=\"%d\" width=\"%.1f\" "
            "height=\"%d\" fill=\"#3182bd\"/>\n"
            "<text x=\"%.1f\" y=\"%d\">%s</text>\n",
            kLeft - 6, y + kBarH + 4, svg::Escape(row.label()), kLeft, y, wi,
            kBarH, kLeft + wi + 4, y + kBarH - 3, Thousands(row.ideal_tokens()),
            kLeft, y + kBarH, wp, kBarH, kLeft + wp + 4, y + 2 * kBarH - 3,
            Thousands(row.page_tokens())));
  }
  absl::StrAppend(
      &out,
      absl::StrFormat(
          "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" "
          "fill=\"#9ecae1\"/><text x=\"%d\" y=\"%d\">idealized (note)</text>\n"
          "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" "
          "fill=\"#3182bd\"/><text x=\"%d\" y=\"%d\">triaxkv pages</text>\n",
          kLeft, bars - 24, kLeft + 16, bars - 14, kLeft + 160, bars - 24,
          kLeft + 176, bars - 14),
      panel, "</svg>\n");
  return out;
}

int RunPlan(v1::Manager::Stub* stub, int64_t timeout_ms) {
  auto req = PlanRequestFromFlags();
  if (!req.ok()) {
    std::cerr << "kvctl: plan: " << req.status().message() << "\n\n"
              << kPlanUsage;
    return 2;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(timeout_ms));
  v1::PlanCapacityResponse resp;
  const grpc::Status s = stub->PlanCapacity(&ctx, *req, &resp);
  if (!s.ok()) {
    const absl::Status st = FromGrpcStatus(s);
    std::cerr << "kvctl: " << absl::StatusCodeToString(st.code()) << ": "
              << st.message() << "\n";
    return 1;
  }
  std::cout << PlanTable(resp);
  if (const std::string path = absl::GetFlag(FLAGS_svg); !path.empty()) {
    std::ofstream out(path);
    out << PlanSvg(resp);
    if (!out) {
      std::cerr << "kvctl: INTERNAL: cannot write " << path << "\n";
      return 1;
    }
    std::cout << "chart: " << path << "\n";
  }
  return 0;
}

}  // namespace triax::kvctl
