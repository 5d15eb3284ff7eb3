#include "client/kvctl_format.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/log.h"

namespace triax::kvctl {
namespace {

// `full` (e.g. "ROLE_TOOL_CALL") without `prefix`, lower-cased.
std::string Short(const std::string& full, absl::string_view prefix, int value,
                  bool lower = true) {
  if (value == 0) return "-";
  if (full.empty()) return absl::StrCat("?", value);
  std::string s = full;
  if (absl::StartsWith(s, prefix)) s = s.substr(prefix.size());
  if (lower) absl::AsciiStrToLower(&s);
  return s;
}

std::string OrDash(const std::string& s) { return s.empty() ? "-" : s; }

std::string Budgets(const triax::v1::TenantInfo& t) {
  std::vector<std::string> parts;
  for (const auto& b : t.budgets()) {
    parts.push_back(absl::StrCat(TierName(b.tier()), "=",
                                 HumanBytes(b.floor_bytes()), "..",
                                 HumanBytes(b.ceiling_bytes())));
  }
  return parts.empty() ? "unlimited" : absl::StrJoin(parts, " ");
}

std::string Usage(const triax::v1::TenantInfo& t) {
  std::vector<std::string> parts;
  for (const auto& u : t.usage()) {
    parts.push_back(
        absl::StrCat(TierName(u.tier()), "=", HumanBytes(u.used_bytes())));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, " ");
}

std::string Inventory(const triax::v1::Inventory& inv) {
  std::vector<std::string> parts;
  for (const auto& f : inv.formats()) {
    parts.push_back(
        absl::StrCat(FormatName(f.format()), ":", f.pages_used(), "p"));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, " ");
}

}  // namespace

std::string RoleName(triax::v1::Role v) {
  return Short(triax::v1::Role_Name(v), "ROLE_", v);
}
std::string ModalityName(triax::v1::Modality v) {
  return Short(triax::v1::Modality_Name(v), "MODALITY_", v);
}
std::string TemporalName(triax::v1::Temporal v) {
  return Short(triax::v1::Temporal_Name(v), "TEMPORAL_", v);
}
std::string FormatName(triax::v1::Format v) {
  if (v == triax::v1::FORMAT_FP8_E4M3) return "fp8";
  return Short(triax::v1::Format_Name(v), "FORMAT_", v);
}

bool ParseFormat(absl::string_view name, triax::v1::Format* out) {
  for (int v = 1; v <= 8; ++v) {
    if (!triax::v1::Format_IsValid(v)) continue;
    const auto f = static_cast<triax::v1::Format>(v);
    if (name == FormatName(f)) {
      *out = f;
      return true;
    }
  }
  return false;
}

std::string ScaleDtypeName(triax::v1::ScaleDtype v) {
  switch (v) {
    case triax::v1::SCALE_DTYPE_FP16:
      return "fp16";
    case triax::v1::SCALE_DTYPE_FP8_E4M3:
      return "fp8";
    case triax::v1::SCALE_DTYPE_UNSPECIFIED:
      return "-";
    default:
      return absl::StrCat("?", static_cast<int>(v));
  }
}

namespace {

bool IsInt(triax::v1::Format f) {
  return f == triax::v1::FORMAT_INT8 || f == triax::v1::FORMAT_INT4 ||
         f == triax::v1::FORMAT_INT2;
}

// Parses the value of `key` into the enum whose short names `name_of` gives.
template <typename E>
bool ParseShort(absl::string_view text, int max, std::string (*name_of)(E),
                E* out) {
  for (int v = 1; v <= max; ++v) {
    if (text == name_of(static_cast<E>(v))) {
      *out = static_cast<E>(v);
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Status ParseEncoding(absl::string_view text,
                           triax::v1::BlockEncoding* out) {
  triax::v1::Format k = triax::v1::FORMAT_UNSPECIFIED;
  triax::v1::Format v = triax::v1::FORMAT_UNSPECIFIED;
  uint32_t group = 0;
  triax::v1::ScaleDtype scale = triax::v1::SCALE_DTYPE_UNSPECIFIED;
  if (text.find('=') == absl::string_view::npos) {
    if (!ParseFormat(text, &k)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "encoding \"", text,
          "\": not a format (bf16, fp8, int8, int4, int2, tq4, tq3, tq2)"));
    }
  } else {
    for (absl::string_view part : absl::StrSplit(text, ',')) {
      const size_t eq = part.find('=');
      const absl::string_view key = part.substr(0, eq);
      const absl::string_view val =
          eq == absl::string_view::npos ? "" : part.substr(eq + 1);
      bool ok = true;
      if (key == "k") {
        ok = ParseFormat(val, &k);
      } else if (key == "v") {
        ok = ParseFormat(val, &v);
      } else if (key == "g") {
        ok = absl::SimpleAtoi(val, &group) && group > 0;
      } else if (key == "scale") {
        ok = val == "fp16" || val == "fp8";
        scale = val == "fp8" ? triax::v1::SCALE_DTYPE_FP8_E4M3
                             : triax::v1::SCALE_DTYPE_FP16;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("encoding \"", text, "\": unknown key \"", key,
                         "\" (want k, v, g, scale)"));
      }
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            "encoding \"", text, "\": bad value in \"", part, "\""));
      }
    }
    if (k == triax::v1::FORMAT_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("encoding \"", text, "\": k=FORMAT is required"));
    }
  }
  out->set_format(k);
  out->set_format_v(v);
  out->set_group_size(group);
  out->set_scale_dtype(scale);
  return absl::OkStatus();
}

namespace {

absl::Status BadRow(absl::string_view flag, absl::string_view text,
                    absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=\"", text, "\": ", why));
}

}  // namespace

absl::StatusOr<v1::CapacityPolicy> ParseCapacityRow(absl::string_view flag,
                                                    absl::string_view text) {
  v1::CapacityPolicy p;
  const std::vector<std::string> parts = absl::StrSplit(text, '+');
  const std::string& base = parts[0];
  if (absl::StartsWith(base, "policy=")) {
    p.set_policy(base.substr(7));
  } else if (absl::StartsWith(base, "triaxial=")) {
    double bits = 0;
    if (!absl::SimpleAtod(base.substr(9), &bits)) {
      return BadRow(flag, text, "triaxial=BITS needs a number");
    }
    p.set_budget_bits(bits);
  } else {
    v1::BlockEncoding e;
    absl::Status s = ParseEncoding(base, &e);
    if (!s.ok()) return BadRow(flag, text, s.message());
    p.set_format(e.format());
    p.set_format_v(e.format_v());
    p.set_group_size(e.group_size());
    p.set_scale_dtype(e.scale_dtype());
  }
  for (size_t i = 1; i < parts.size(); ++i) {
    absl::string_view opt = parts[i];
    uint32_t n = 0;
    if (opt == "dnll") {
      p.set_objective(v1::OBJECTIVE_DNLL);
    } else if (absl::ConsumePrefix(&opt, "sink=") &&
               absl::SimpleAtoi(opt, &n)) {
      p.set_sink_tokens(n);
    } else if (absl::ConsumePrefix(&opt, "window=") &&
               absl::SimpleAtoi(opt, &n)) {
      p.set_window_tokens(n);
    } else if (absl::ConsumePrefix(&opt, "label=") && !opt.empty()) {
      p.set_label(std::string(opt));
    } else {
      return BadRow(flag, text,
                    absl::StrCat("unknown option \"", parts[i],
                                 "\" (sink=N, window=N, dnll or label=NAME)"));
    }
  }
  return p;
}

absl::StatusOr<std::vector<v1::CapacityPolicy>> ParseCapacityRows(
    absl::string_view flag, absl::string_view text) {
  std::vector<v1::CapacityPolicy> rows;
  for (absl::string_view row :
       absl::StrSplit(text, ' ', absl::SkipWhitespace())) {
    auto p = ParseCapacityRow(flag, row);
    if (!p.ok()) return p.status();
    rows.push_back(*std::move(p));
  }
  return rows;
}

std::string EncodingString(triax::v1::Format k, triax::v1::Format v,
                           uint32_t group_size, triax::v1::ScaleDtype scale) {
  if (v == triax::v1::FORMAT_UNSPECIFIED) v = k;
  const bool int_any = IsInt(k) || IsInt(v);
  const bool default_group = !int_any || group_size == 0 || group_size == 32;
  const bool default_scale = !int_any ||
                             scale == triax::v1::SCALE_DTYPE_UNSPECIFIED ||
                             scale == triax::v1::SCALE_DTYPE_FP16;
  if (k == v && default_group && default_scale) return FormatName(k);
  std::string s = absl::StrCat("k=", FormatName(k), ",v=", FormatName(v));
  if (!default_group) absl::StrAppend(&s, ",g=", group_size);
  if (!default_scale) absl::StrAppend(&s, ",scale=", ScaleDtypeName(scale));
  return s;
}

absl::Status ParsePolicyRule(absl::string_view text,
                             triax::v1::PolicyRule* out) {
  out->Clear();
  absl::string_view enc = text;
  const size_t colon = text.find(':');
  if (colon != absl::string_view::npos) {
    enc = text.substr(colon + 1);
    const absl::string_view sel = text.substr(0, colon);
    if (sel != "*") {
      for (absl::string_view part : absl::StrSplit(sel, ',')) {
        const size_t eq = part.find('=');
        const absl::string_view key = part.substr(0, eq);
        const absl::string_view val =
            eq == absl::string_view::npos ? "" : part.substr(eq + 1);
        bool ok;
        if (key == "temporal") {
          triax::v1::Temporal t;
          ok = ParseShort(val, 4, &TemporalName, &t);
          if (ok) out->set_temporal(t);
        } else if (key == "role") {
          triax::v1::Role r;
          ok = ParseShort(val, 8, &RoleName, &r);
          if (ok) out->set_role(r);
        } else if (key == "modality") {
          triax::v1::Modality m;
          ok = ParseShort(val, 3, &ModalityName, &m);
          if (ok) out->set_modality(m);
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("rule \"", text, "\": unknown selector \"", key,
                           "\" (want temporal, role, modality or *)"));
        }
        if (!ok) {
          return absl::InvalidArgumentError(
              absl::StrCat("rule \"", text, "\": bad value in \"", part, "\""));
        }
      }
    }
  }
  triax::v1::BlockEncoding e;
  absl::Status st = ParseEncoding(enc, &e);
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rule \"", text, "\": ", st.message()));
  }
  out->set_format(e.format());
  out->set_format_v(e.format_v());
  out->set_group_size(e.group_size());
  out->set_scale_dtype(e.scale_dtype());
  return absl::OkStatus();
}

std::string PolicyRuleString(const triax::v1::PolicyRule& r) {
  std::vector<std::string> sel;
  if (r.temporal() != 0) {
    sel.push_back(absl::StrCat("temporal=", TemporalName(r.temporal())));
  }
  if (r.role() != 0) sel.push_back(absl::StrCat("role=", RoleName(r.role())));
  if (r.modality() != 0) {
    sel.push_back(absl::StrCat("modality=", ModalityName(r.modality())));
  }
  return absl::StrCat(sel.empty() ? "*" : absl::StrJoin(sel, ","), ":",
                      EncodingString(r.format(), r.format_v(), r.group_size(),
                                     r.scale_dtype()));
}

std::string PoliciesTable(const triax::v1::ListPoliciesResponse& resp) {
  Table t({"NAME", "BUILTIN", "#", "RULE"});
  for (const auto& p : resp.policies()) {
    for (int i = 0; i < p.rules_size(); ++i) {
      t.AddRow({i == 0 ? p.name() : "",
                i == 0 ? (p.builtin() ? "yes" : "no") : "", absl::StrCat(i),
                PolicyRuleString(p.rules(i))});
    }
  }
  return t.Render();
}
std::string TierName(triax::v1::Tier v) {
  return Short(triax::v1::Tier_Name(v), "TIER_", v);
}
std::string WorkerStateName(triax::v1::WorkerState v) {
  return Short(triax::v1::WorkerState_Name(v), "WORKER_STATE_", v);
}
std::string SequenceStateName(triax::v1::SequenceState v) {
  return Short(triax::v1::SequenceState_Name(v), "SEQUENCE_STATE_", v);
}
std::string PressureActionName(triax::v1::PressureAction v) {
  return Short(triax::v1::PressureAction_Name(v), "PRESSURE_ACTION_", v);
}
std::string EventKindName(triax::v1::EventKind v) {
  return Short(triax::v1::EventKind_Name(v), "EVENT_", v, /*lower=*/false);
}

std::string TagString(const triax::v1::Tag& tag) {
  return absl::StrCat(TemporalName(tag.temporal()), "/",
                      ModalityName(tag.modality()), "/", RoleName(tag.role()));
}

std::string HumanBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", v, kUnits[unit]);
}

std::string UnixMsString(int64_t unix_ms) {
  if (unix_ms == 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

std::string IdList(const std::vector<uint64_t>& ids) {
  return ids.empty() ? "-" : absl::StrJoin(ids, ",");
}

Table::Table(std::vector<std::string> header) {
  rows_.push_back(std::move(header));
}

void Table::AddRow(std::vector<std::string> row) {
  row.resize(std::max(row.size(), rows_.front().size()));
  rows_.push_back(std::move(row));
}

std::string Table::Render() const {
  std::vector<size_t> width;
  for (const auto& row : rows_) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  std::string out;
  for (const auto& row : rows_) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      if (i > 0) line += "  ";
      line += row[i];
      if (i + 1 < row.size()) line.append(width[i] - row[i].size(), ' ');
    }
    // No trailing blanks when the last cells are empty.
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  }
  return out;
}

std::string FramesCell(const triax::v1::Inventory& inv) {
  if (inv.frame_bytes() == 0) return "-";
  return absl::StrCat(inv.free_frames(), "/", inv.frames(), " x ",
                      HumanBytes(inv.frame_bytes()), " (",
                      inv.free_frames_compacted(), " compacted)");
}

std::string FragCell(const triax::v1::Inventory& inv) {
  if (inv.frame_bytes() == 0) return "-";
  return absl::StrFormat("%.1f%%", 100.0 * inv.fragmentation());
}

std::string CompactionsCell(const triax::v1::Inventory& inv) {
  if (inv.frame_bytes() == 0) return "-";
  return absl::StrCat(inv.compactions(), "/", inv.pages_moved(), "p");
}

std::string WorkersTable(const triax::v1::ListWorkersResponse& resp) {
  Table t({"WORKER", "ADDRESS", "BACKEND", "STATE", "CAPACITY", "RESERVED",
           "USED", "SEQS", "PAGES", "FREE_FRAMES", "FRAG", "COMPACTIONS",
           "LAST_HEARTBEAT"});
  for (const auto& w : resp.workers()) {
    t.AddRow({w.worker_id(), OrDash(w.address()), OrDash(w.backend()),
              WorkerStateName(w.state()), HumanBytes(w.capacity_bytes()),
              HumanBytes(w.reserved_bytes()),
              HumanBytes(w.inventory().used_bytes()),
              absl::StrCat(w.sequences()), Inventory(w.inventory()),
              FramesCell(w.inventory()), FragCell(w.inventory()),
              CompactionsCell(w.inventory()),
              UnixMsString(w.last_heartbeat_unix_ms())});
  }
  return t.Render();
}

std::string PoolsTable(const triax::v1::ListWorkersResponse& resp) {
  Table t({"WORKER", "ENCODING", "PAGE", "FRAMES", "USED", "FREE_SLOTS",
           "ALLOCATABLE", "FREE_SLOTS_COMPACTED"});
  for (const auto& w : resp.workers()) {
    for (const auto& p : w.inventory().pools()) {
      std::string enc = FormatName(p.format());
      if (p.format_v() != 0 && p.format_v() != p.format()) {
        absl::StrAppend(&enc, "/", FormatName(p.format_v()));
      }
      if (p.group_size() != 0 && p.group_size() != 32) {
        absl::StrAppend(&enc, " g", p.group_size());
      }
      if (p.scale_dtype() == triax::v1::SCALE_DTYPE_FP8_E4M3) {
        absl::StrAppend(&enc, " fp8-scales");
      }
      t.AddRow({w.worker_id(), enc, HumanBytes(p.page_bytes()),
                absl::StrCat(p.frames(), " x ", p.pages_per_frame(), "p"),
                absl::StrCat(p.pages_used()), absl::StrCat(p.free_slots()),
                absl::StrCat(p.allocatable_pages()),
                absl::StrCat(p.free_slots_compacted())});
    }
  }
  return t.Render();
}

std::string TokensTable(const triax::v1::ListTokensResponse& resp) {
  auto when = [](int64_t ms) {
    return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMillis(ms),
                            absl::UTCTimeZone());
  };
  Table t({"TOKEN", "ROLE", "TENANT", "CREATED", "EXPIRES", "DESCRIPTION"});
  for (const auto& k : resp.tokens()) {
    t.AddRow({k.token_id(), k.role(),
              k.tenant_id().empty() ? "-" : k.tenant_id(),
              when(k.created_unix_ms()),
              k.expires_unix_ms() == 0 ? "never" : when(k.expires_unix_ms()),
              k.description().empty() ? "-" : k.description()});
  }
  return t.Render();
}

std::string TenantsTable(const triax::v1::ListTenantsResponse& resp) {
  Table t({"TENANT", "OPEN", "USAGE", "BUDGETS (floor..ceiling)"});
  for (const auto& ten : resp.tenants()) {
    t.AddRow({ten.tenant_id(), absl::StrCat(ten.open_sequences()), Usage(ten),
              Budgets(ten)});
  }
  return t.Render();
}

std::string SequencesTable(const triax::v1::ListSequencesResponse& resp) {
  Table t({"SEQUENCE", "TENANT", "STATE", "WORKER", "TOKENS", "TURNS", "POLICY",
           "BYTES", "PARENT"});
  for (const auto& s : resp.sequences()) {
    t.AddRow({s.sequence_id(), s.tenant_id(), SequenceStateName(s.state()),
              OrDash(s.worker_id()), absl::StrCat(s.num_tokens()),
              absl::StrCat(s.turns()), OrDash(s.policy()),
              HumanBytes(s.bytes()), OrDash(s.parent_sequence_id())});
  }
  return t.Render();
}

std::string SequenceDetail(const triax::v1::SequenceInfo& s) {
  const auto& m = s.model();
  Table head({"sequence:", s.sequence_id()});
  head.AddRow({"tenant:", s.tenant_id()});
  head.AddRow({"state:", SequenceStateName(s.state())});
  head.AddRow({"worker:", absl::StrCat(OrDash(s.worker_id()), " (",
                                       OrDash(s.worker_address()), ")")});
  head.AddRow(
      {"model:", absl::StrFormat("%s layers=%u kv_heads=%u "
                                 "q_heads=%u head_dim=%u",
                                 OrDash(m.name()), m.n_layers(), m.n_kv_heads(),
                                 m.n_q_heads(), m.head_dim())});
  head.AddRow({"policy:", OrDash(s.policy())});
  head.AddRow({"tokens:", absl::StrCat(s.num_tokens(), " in ", s.blocks_size(),
                                       " blocks of ", s.block_tokens())});
  head.AddRow({"turns:", absl::StrCat(s.turns())});
  head.AddRow(
      {"bytes:", absl::StrCat(HumanBytes(s.bytes()), " (", s.bytes(), ")")});
  if (!s.parent_sequence_id().empty()) {
    head.AddRow({"parent:", s.parent_sequence_id()});
  }
  if (s.prefix_blocks() > 0) {
    head.AddRow({"prefix:",
                 absl::StrCat(s.prefix_blocks(), " blocks (", s.prefix_tokens(),
                              " tokens) of ", s.prefix_sequence_id())});
  }
  if (s.hashed_blocks() > 0) {
    head.AddRow({"hashed:", absl::StrCat(s.hashed_blocks(), " blocks")});
  }
  if (!s.transfer_id().empty()) {
    head.AddRow(
        {"transfer:", absl::StrCat(s.transfer_id(), " to ",
                                   OrDash(s.transfer_destination_worker_id()),
                                   " in flight (the source serves until the "
                                   "commit)")});
  }
  if (s.state() == triax::v1::SEQUENCE_STATE_LOST) {
    head.AddRow({"lost lineages:", IdList({s.lost_lineage_ids().begin(),
                                           s.lost_lineage_ids().end()})});
  }
  Table blocks({"INDEX", "LINEAGE", "FIRST", "TOKENS", "TAG", "K", "V", "GROUP",
                "SCALE", "REFCOUNT", "TIER", "EVICTED"});
  for (const auto& b : s.blocks()) {
    const triax::v1::Format v = b.format_v() == triax::v1::FORMAT_UNSPECIFIED
                                    ? b.format()
                                    : b.format_v();
    const bool int_any = IsInt(b.format()) || IsInt(v);
    blocks.AddRow(
        {absl::StrCat(b.index()), absl::StrCat(b.lineage_id()),
         absl::StrCat(b.first_token()),
         absl::StrCat(b.num_tokens(), "/", b.capacity()), TagString(b.tag()),
         FormatName(b.format()), FormatName(v),
         int_any ? absl::StrCat(b.group_size() == 0 ? 32 : b.group_size())
                 : "-",
         int_any ? (b.scale_dtype() == triax::v1::SCALE_DTYPE_FP8_E4M3 ? "fp8"
                                                                       : "fp16")
                 : "-",
         absl::StrCat(b.refcount()),
         TierName(b.tier() == triax::v1::TIER_UNSPECIFIED
                      ? triax::v1::TIER_DEVICE
                      : b.tier()),
         b.evicted() ? "yes" : "no"});
  }
  return absl::StrCat(head.Render(), "\n", blocks.Render());
}

namespace {

std::string Percent(uint64_t part, uint64_t whole) {
  if (whole == 0) return "-";
  return absl::StrFormat(
      "%.1f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

// A tenant's standing on one tier against its budget.
std::string Standing(uint64_t used, const triax::v1::Budget* b) {
  if (b == nullptr || (b->floor_bytes() == 0 && b->ceiling_bytes() == 0)) {
    return "no budget";
  }
  if (b->ceiling_bytes() > 0 && used > b->ceiling_bytes()) {
    return absl::StrCat("over ceiling by ",
                        HumanBytes(used - b->ceiling_bytes()));
  }
  if (used > b->floor_bytes()) {
    return absl::StrCat("above floor by ", HumanBytes(used - b->floor_bytes()));
  }
  return "at/below floor";
}

}  // namespace

std::string PressureReport(const triax::v1::GetPressureResponse& r) {
  Table head({"mode:", OrDash(r.mode())});
  head.AddRow({"snapshot:",
               absl::StrFormat("%u blocks, %.1f ms old; ranking took %.3f ms",
                               r.snapshot_blocks(), r.snapshot_age_ms(),
                               r.ranking_ms())});
  head.AddRow({"applied:", absl::StrCat("demotions=", r.demotions(), " spills=",
                                        r.spills(), " restores=", r.restores(),
                                        " evictions=", r.evictions())});
  head.AddRow(
      {"prefix:", absl::StrCat("indexed_blocks=", r.prefix_index_blocks(),
                               " hits=", r.prefix_hits(),
                               " reused_blocks=", r.prefix_reused_blocks())});

  Table pools({"WORKER", "TIER", "USED", "CAPACITY", "USE", "LOW_WM", "HIGH_WM",
               "STATE"});
  for (const auto& p : r.pools()) {
    const char* state = "ok";
    if (p.high_watermark_bytes() > 0 &&
        p.used_bytes() > p.high_watermark_bytes()) {
      state = "over high";
    } else if (p.low_watermark_bytes() > 0 &&
               p.used_bytes() > p.low_watermark_bytes()) {
      state = "above low";
    }
    pools.AddRow({OrDash(p.worker_id()), TierName(p.tier()),
                  HumanBytes(p.used_bytes()), HumanBytes(p.capacity_bytes()),
                  Percent(p.used_bytes(), p.capacity_bytes()),
                  HumanBytes(p.low_watermark_bytes()),
                  HumanBytes(p.high_watermark_bytes()), state});
  }

  Table tenants({"TENANT", "TIER", "USED", "FLOOR", "CEILING", "STANDING"});
  for (const auto& t : r.tenants()) {
    // Tiers in enum order that have a budget or a usage entry.
    for (int tier = triax::v1::TIER_DEVICE; tier <= triax::v1::TIER_DISK;
         ++tier) {
      const triax::v1::Budget* budget = nullptr;
      for (const auto& b : t.budgets()) {
        if (b.tier() == tier) budget = &b;
      }
      const triax::v1::TierUsage* usage = nullptr;
      for (const auto& u : t.usage()) {
        if (u.tier() == tier) usage = &u;
      }
      if (budget == nullptr && usage == nullptr) continue;
      const uint64_t used = usage ? usage->used_bytes() : 0;
      tenants.AddRow(
          {t.tenant_id(), TierName(static_cast<triax::v1::Tier>(tier)),
           HumanBytes(used), budget ? HumanBytes(budget->floor_bytes()) : "-",
           budget ? HumanBytes(budget->ceiling_bytes()) : "-",
           Standing(used, budget)});
    }
  }

  Table ranked({"#", "LINEAGE", "SEQUENCE", "TENANT", "ACTION", "ENCODING",
                "BYTES_FREED", "COST"});
  for (int i = 0; i < r.ranked_size(); ++i) {
    const auto& a = r.ranked(i);
    const auto& e = a.encoding();
    const bool has_enc = e.format() != triax::v1::FORMAT_UNSPECIFIED;
    ranked.AddRow({absl::StrCat(i + 1), absl::StrCat(a.lineage_id()),
                   OrDash(a.sequence_id()), OrDash(a.tenant_id()),
                   PressureActionName(a.action()),
                   has_enc ? EncodingString(e.format(), e.format_v(),
                                            e.group_size(), e.scale_dtype())
                           : "-",
                   HumanBytes(a.bytes_freed()),
                   absl::StrFormat("%.4g", a.cost())});
  }
  return absl::StrCat(head.Render(), "\nPOOLS\n", pools.Render(), "\nTENANTS\n",
                      tenants.Render(), "\nRANKED (", r.ranked_size(),
                      ", cheapest first)\n", ranked.Render());
}

std::string TraceDetail(uint64_t lineage_id,
                        const triax::v1::QueryTraceResponse& resp) {
  const auto& b = resp.block();
  Table head({"lineage:", absl::StrCat(lineage_id)});
  head.AddRow({"created by:", OrDash(resp.sequence_id())});
  head.AddRow(
      {"block:",
       absl::StrCat("index=", b.index(), " first_token=", b.first_token(),
                    " tokens=", b.num_tokens(), "/", b.capacity())});
  head.AddRow({"tag:", TagString(b.tag())});
  head.AddRow({"format:", FormatName(b.format())});
  head.AddRow({"refcount:", absl::StrCat(b.refcount())});
  head.AddRow({"path:", WorkerPath(resp)});
  Table events(
      {"ID", "TIME", "KIND", "SEQUENCE", "WORKER", "TAG", "FORMAT", "DETAIL"});
  for (const auto& e : resp.events()) {
    const std::string worker =
        e.source_worker_id().empty()
            ? OrDash(e.worker_id())
            : absl::StrCat(e.source_worker_id(), " -> ", OrDash(e.worker_id()));
    events.AddRow({absl::StrCat(e.id()), UnixMsString(e.unix_ms()),
                   EventKindName(e.kind()), OrDash(e.sequence_id()), worker,
                   e.has_tag() ? TagString(e.tag()) : "-",
                   FormatName(e.format()), e.detail()});
  }
  return absl::StrCat(head.Render(), "\n", events.Render());
}

std::string EventLine(const triax::v1::Event& e) {
  std::vector<std::string> kv;
  kv.push_back(absl::StrCat("id=", e.id()));
  kv.push_back(absl::StrCat("time=", UnixMsString(e.unix_ms())));
  kv.push_back(absl::StrCat("kind=", EventKindName(e.kind())));
  if (e.lineage_id() != 0)
    kv.push_back(absl::StrCat("lineage=", e.lineage_id()));
  if (!e.sequence_id().empty()) {
    kv.push_back(absl::StrCat("sequence=", e.sequence_id()));
  }
  if (!e.tenant_id().empty())
    kv.push_back(absl::StrCat("tenant=", e.tenant_id()));
  if (!e.worker_id().empty())
    kv.push_back(absl::StrCat("worker=", e.worker_id()));
  if (!e.source_worker_id().empty())
    kv.push_back(absl::StrCat("source=", e.source_worker_id()));
  if (e.has_tag()) kv.push_back(absl::StrCat("tag=", TagString(e.tag())));
  if (e.format() != triax::v1::FORMAT_UNSPECIFIED) {
    kv.push_back(absl::StrCat("format=", FormatName(e.format())));
  }
  if (e.lineage_ids_size() > 0) {
    kv.push_back(
        absl::StrCat("lineages=", absl::StrJoin(e.lineage_ids(), ",")));
  }
  if (!e.detail().empty()) {
    kv.push_back(absl::StrCat("detail=", JsonString(e.detail())));
  }
  return absl::StrJoin(kv, " ");
}

std::string JsonString(const std::string& s) { return Quoted(s); }

std::string EventJson(const triax::v1::Event& e) {
  std::string tag = "null";
  if (e.has_tag()) {
    tag = absl::StrCat(
        "{\"temporal\":", JsonString(TemporalName(e.tag().temporal())),
        ",\"modality\":", JsonString(ModalityName(e.tag().modality())),
        ",\"role\":", JsonString(RoleName(e.tag().role())), "}");
  }
  return absl::StrCat(
      "{\"id\":", e.id(), ",\"unix_ms\":", e.unix_ms(),
      ",\"kind\":", JsonString(EventKindName(e.kind())),
      ",\"lineage_id\":", e.lineage_id(),
      ",\"sequence_id\":", JsonString(e.sequence_id()),
      ",\"tenant_id\":", JsonString(e.tenant_id()),
      ",\"worker_id\":", JsonString(e.worker_id()),
      ",\"source_worker_id\":", JsonString(e.source_worker_id()),
      ",\"tag\":", tag, ",\"format\":", JsonString(FormatName(e.format())),
      ",\"lineage_ids\":[", absl::StrJoin(e.lineage_ids(), ","), "]",
      ",\"detail\":", JsonString(e.detail()), "}");
}

std::string DetailValue(absl::string_view detail, absl::string_view key) {
  for (absl::string_view part : absl::StrSplit(detail, ' ')) {
    const size_t eq = part.find('=');
    if (eq != absl::string_view::npos && part.substr(0, eq) == key) {
      return std::string(part.substr(eq + 1));
    }
  }
  return "";
}

std::string TransferHistory(const std::vector<triax::v1::Event>& events) {
  Table t({"ID", "TIME", "TRANSFER", "EVENT", "FROM", "TO", "DETAIL"});
  size_t rows = 0;
  for (const auto& e : events) {
    const char* what = nullptr;
    switch (e.kind()) {
      case triax::v1::EVENT_TRANSFER_STARTED:
        what = "started";
        break;
      case triax::v1::EVENT_TRANSFER_FAILED:
        what = "failed";
        break;
      case triax::v1::EVENT_SEQUENCE_TRANSFERRED:
        what = "committed";
        break;
      default:
        continue;
    }
    ++rows;
    t.AddRow({absl::StrCat(e.id()), UnixMsString(e.unix_ms()),
              OrDash(DetailValue(e.detail(), "transfer")), what,
              OrDash(e.source_worker_id()), OrDash(e.worker_id()), e.detail()});
  }
  if (rows == 0) return "transfers: none\n";
  return absl::StrCat("transfers:\n", t.Render());
}

std::string TransferReport(const triax::v1::TransferSequenceResponse& r) {
  Table head({"transfer:", r.transfer_id()});
  head.AddRow({"sequence:", r.sequence().sequence_id()});
  head.AddRow({"from -> to:", absl::StrCat(r.source_worker_id(), " -> ",
                                           r.destination_worker_id())});
  head.AddRow({"blocks:", absl::StrCat(r.blocks(), " (", r.pages(),
                                       " pages; evicted blocks do not move)")});
  if (r.shared_blocks() > 0) {
    head.AddRow(
        {"shared blocks:",
         absl::StrCat(r.shared_blocks(), " (blocks [0, ", r.shared_blocks(),
                      ") shared with the destination's prefix "
                      "sequence; not moved)")});
  }
  head.AddRow({"wire bytes:", absl::StrCat(HumanBytes(r.wire_bytes()), " (",
                                           r.wire_bytes(), ")")});
  head.AddRow({"bf16 bytes:", absl::StrCat(HumanBytes(r.bf16_bytes()), " (",
                                           r.bf16_bytes(), ")")});
  head.AddRow({"wire / bf16:",
               r.wire_bytes() == 0 || r.bf16_bytes() == 0
                   ? std::string("-")
                   : absl::StrFormat("%.3f (%.2fx fewer bytes than BF16)",
                                     static_cast<double>(r.wire_bytes()) /
                                         static_cast<double>(r.bf16_bytes()),
                                     static_cast<double>(r.bf16_bytes()) /
                                         static_cast<double>(r.wire_bytes()))});
  head.AddRow({"source bytes:", absl::StrCat(HumanBytes(r.source_bytes()), " (",
                                             r.source_bytes(), ")")});
  head.AddRow({"seconds:", absl::StrFormat("%.3f (pull %.3f)", r.seconds(),
                                           r.pull_seconds())});
  head.AddRow(
      {"data path:", r.data_path().empty() ? std::string("-") : r.data_path()});
  return absl::StrCat(head.Render(), "\n", SequenceDetail(r.sequence()));
}

std::string WorkerPath(const triax::v1::QueryTraceResponse& resp) {
  std::vector<std::string> steps;
  for (const auto& e : resp.events()) {
    if (e.kind() == triax::v1::EVENT_BLOCK_CREATED && steps.empty() &&
        !e.worker_id().empty()) {
      steps.push_back(absl::StrCat("created on ", e.worker_id()));
    } else if (e.kind() == triax::v1::EVENT_BLOCK_TRANSFERRED) {
      if (steps.empty()) {
        steps.push_back(absl::StrCat("on ", OrDash(e.source_worker_id())));
      }
      const std::string id = DetailValue(e.detail(), "transfer");
      const std::string of = id.empty() ? "" : absl::StrCat(" (", id, ")");
      if (DetailValue(e.detail(), "shared") == "true") {
        // A prefix hit: the destination's copy now serves this sequence too.
        steps.push_back(absl::StrCat("shared on ", OrDash(e.worker_id()),
                                     " by ", OrDash(e.sequence_id()), of));
      } else if (DetailValue(e.detail(), "copy") == "true") {
        // A shared block: the source keeps its copy for the others.
        steps.push_back(absl::StrCat("copied ", OrDash(e.source_worker_id()),
                                     " -> ", OrDash(e.worker_id()), of));
      } else {
        steps.push_back(absl::StrCat("transferred ",
                                     OrDash(e.source_worker_id()), " -> ",
                                     OrDash(e.worker_id()), of));
      }
    }
  }
  if (steps.empty()) return "-";
  return absl::StrJoin(steps, ", ");
}

}  // namespace triax::kvctl
