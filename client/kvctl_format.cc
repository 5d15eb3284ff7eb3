#include "client/kvctl_format.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"

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
  return Short(triax::v1::Format_Name(v), "FORMAT_", v);
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

std::string WorkersTable(const triax::v1::ListWorkersResponse& resp) {
  Table t({"WORKER", "ADDRESS", "BACKEND", "STATE", "CAPACITY", "RESERVED",
           "USED", "SEQS", "PAGES", "LAST_HEARTBEAT"});
  for (const auto& w : resp.workers()) {
    t.AddRow({w.worker_id(), OrDash(w.address()), OrDash(w.backend()),
              WorkerStateName(w.state()), HumanBytes(w.capacity_bytes()),
              HumanBytes(w.reserved_bytes()),
              HumanBytes(w.inventory().used_bytes()),
              absl::StrCat(w.sequences()), Inventory(w.inventory()),
              UnixMsString(w.last_heartbeat_unix_ms())});
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
  if (s.state() == triax::v1::SEQUENCE_STATE_LOST) {
    head.AddRow({"lost lineages:", IdList({s.lost_lineage_ids().begin(),
                                           s.lost_lineage_ids().end()})});
  }
  Table blocks(
      {"INDEX", "LINEAGE", "FIRST", "TOKENS", "TAG", "FORMAT", "REFCOUNT"});
  for (const auto& b : s.blocks()) {
    blocks.AddRow({absl::StrCat(b.index()), absl::StrCat(b.lineage_id()),
                   absl::StrCat(b.first_token()),
                   absl::StrCat(b.num_tokens(), "/", b.capacity()),
                   TagString(b.tag()), FormatName(b.format()),
                   absl::StrCat(b.refcount())});
  }
  return absl::StrCat(head.Render(), "\n", blocks.Render());
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
  Table events({"ID", "TIME", "KIND", "SEQUENCE", "TAG", "FORMAT", "DETAIL"});
  for (const auto& e : resp.events()) {
    events.AddRow({absl::StrCat(e.id()), UnixMsString(e.unix_ms()),
                   EventKindName(e.kind()), OrDash(e.sequence_id()),
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

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
  return out;
}

std::string EventJson(const triax::v1::Event& e) {
  std::string tag = "null";
  if (e.has_tag()) {
    tag = absl::StrCat(
        "{\"temporal\":", JsonString(TemporalName(e.tag().temporal())),
        ",\"modality\":", JsonString(ModalityName(e.tag().modality())),
        ",\"role\":", JsonString(RoleName(e.tag().role())), "}");
  }
  return absl::StrCat("{\"id\":", e.id(), ",\"unix_ms\":", e.unix_ms(),
                      ",\"kind\":", JsonString(EventKindName(e.kind())),
                      ",\"lineage_id\":", e.lineage_id(),
                      ",\"sequence_id\":", JsonString(e.sequence_id()),
                      ",\"tenant_id\":", JsonString(e.tenant_id()),
                      ",\"worker_id\":", JsonString(e.worker_id()),
                      ",\"tag\":", tag,
                      ",\"format\":", JsonString(FormatName(e.format())),
                      ",\"lineage_ids\":[", absl::StrJoin(e.lineage_ids(), ","),
                      "]", ",\"detail\":", JsonString(e.detail()), "}");
}

}  // namespace triax::kvctl
