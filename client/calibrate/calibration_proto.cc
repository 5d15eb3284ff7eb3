#include "client/calibrate/calibration_proto.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/model_proto.h"
#include "common/status_macros.h"
#include "google/protobuf/text_format.h"
#include "kernels/layout.h"

namespace triax::calibrate {
namespace {

namespace v1 = ::triax::v1;

bool IsInt(v1::Format f) {
  return f == v1::FORMAT_INT8 || f == v1::FORMAT_INT4 || f == v1::FORMAT_INT2;
}

std::string EncodingLabel(const v1::CalibrationEntry& e) {
  const kernels::Encoding enc = EntryEncoding(e);
  char buf[96];
  return kernels::EncodingName(enc, buf, sizeof(buf));
}

std::string TagLabel(const v1::Tag& t) {
  return triax::TagLabel(triax::FromProto(t));
}

}  // namespace

kernels::Encoding EntryEncoding(const v1::CalibrationEntry& e) {
  return kernels::Encoding(static_cast<kernels::Format>(e.format()),
                           static_cast<kernels::Format>(e.format_v()),
                           static_cast<int>(e.group_size()),
                           e.scale_dtype() == v1::SCALE_DTYPE_FP8_E4M3
                               ? kernels::ScaleDtype::kFP8
                               : kernels::ScaleDtype::kFP16);
}

std::string OutputMetricDescription(int chunk, uint32_t recent_turns) {
  return absl::StrCat(
      "output-kl: distortion = sum over predicted positions p of "
      "KL(P_ref(.|p) || P_kf(.|p)) in nats divided by sum of share_k(p) = "
      "sealed tag-k tokens in [0, p] / (p + 1); distortion_answer the same "
      "over positions whose next token is ASSISTANT or TOOL_CALL; dnll / "
      "dnll_answer = sum of next-token NLL increase / sum share_k. P_ref: "
      "teacher-forced fp32 forward over BF16 K/V; P_kf: same with every "
      "sealed 16-token block whose tag (relative to the query's turn) is k "
      "read through EncodePage/DecodePage in f; turns prefilled in chunks "
      "of ",
      chunk, " tokens; recent_turns ", recent_turns);
}

std::string MetricDescription(int query_stride, int64_t first_query,
                              uint32_t recent_turns) {
  return absl::StrCat(
      "distortion = sum over (query, layer) of ||o_kf - o||^2 / ||o||^2 "
      "(all query heads) divided by sum of share_k = tag-k tokens / attended "
      "tokens; o = attention over BF16 K/V, o_kf = same with only tag-k "
      "tokens' K/V through EncodePage/DecodePage of their 16-token blocks; "
      "fp32 forward, queries every ",
      query_stride, " positions from ", first_query,
      ", every layer; temporal tags with the query's turn current, "
      "recent_turns ",
      recent_turns);
}

absl::StatusOr<v1::CalibrationTable> BuildTable(
    const TableMeta& meta, const std::vector<CalibrationResultEntry>& entries) {
  v1::CalibrationTable table;
  table.set_model(meta.model);
  *table.mutable_shape() = meta.shape;
  table.set_block_tokens(meta.block_tokens);
  for (const CalibrationResultEntry& r : entries) {
    v1::CalibrationEntry* e = table.add_entries();
    e->mutable_tag()->set_temporal(
        static_cast<v1::Temporal>(static_cast<int>(r.tag.temporal)));
    e->mutable_tag()->set_modality(static_cast<v1::Modality>(r.tag.modality));
    e->mutable_tag()->set_role(static_cast<v1::Role>(r.tag.role));
    const auto fk = static_cast<v1::Format>(r.encoding.k);
    const auto fv = static_cast<v1::Format>(r.encoding.v);
    e->set_format(fk);
    e->set_format_v(fv);
    if (IsInt(fk) || IsInt(fv)) {
      e->set_group_size(static_cast<uint32_t>(r.encoding.Group()));
      e->set_scale_dtype(r.encoding.scale_dtype == kernels::ScaleDtype::kFP8
                             ? v1::SCALE_DTYPE_FP8_E4M3
                             : v1::SCALE_DTYPE_FP16);
    }
    e->set_distortion(r.distortion);
    e->set_distortion_answer(r.distortion_answer);
    e->set_dnll(r.dnll);
    e->set_dnll_answer(r.dnll_answer);
    e->set_tokens(r.tokens);
    e->set_queries(r.queries);
  }
  *table.mutable_source() = meta.source;
  TRIAX_RETURN_IF_ERROR(ValidateTable(table));
  return table;
}

absl::Status ValidateTable(const v1::CalibrationTable& table) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(what);
  };
  if (table.model().empty()) return bad("model is empty");
  const v1::ModelShape& s = table.shape();
  if (s.n_layers() < 1 || s.n_kv_heads() < 1 || s.n_q_heads() < 1 ||
      s.head_dim() < 2 || s.n_q_heads() % s.n_kv_heads() != 0) {
    return bad(absl::StrCat("shape {n_layers ", s.n_layers(), ", n_kv_heads ",
                            s.n_kv_heads(), ", n_q_heads ", s.n_q_heads(),
                            ", head_dim ", s.head_dim(), "} is invalid"));
  }
  if (table.block_tokens() < 1 || table.block_tokens() > 4096) {
    return bad(absl::StrCat("block_tokens ", table.block_tokens(),
                            " is outside 1..4096"));
  }
  if (table.entries().empty()) return bad("entries is empty");
  std::set<std::tuple<int, int, int, int, int, uint32_t, int>> keys;
  for (int i = 0; i < table.entries_size(); ++i) {
    const v1::CalibrationEntry& e = table.entries(i);
    const std::string at = absl::StrCat("entries[", i, "]");
    if (e.tag().temporal() == v1::TEMPORAL_UNSPECIFIED ||
        e.tag().modality() == v1::MODALITY_UNSPECIFIED ||
        e.tag().role() == v1::ROLE_UNSPECIFIED) {
      return bad(absl::StrCat(
          at, ".tag has an unspecified field (temporal ", e.tag().temporal(),
          ", modality ", e.tag().modality(), ", role ", e.tag().role(), ")"));
    }
    if (e.format() == v1::FORMAT_UNSPECIFIED ||
        e.format_v() == v1::FORMAT_UNSPECIFIED) {
      return bad(absl::StrCat(at, ".format/format_v unspecified (", e.format(),
                              ", ", e.format_v(), ")"));
    }
    if (e.group_size() != 0 && e.group_size() != 32 && e.group_size() != 64 &&
        e.group_size() != 128) {
      return bad(absl::StrCat(at, ".group_size ", e.group_size(),
                              " is not 0, 32, 64 or 128"));
    }
    if (!std::isfinite(e.distortion()) || e.distortion() < 0) {
      return bad(absl::StrCat(at, ".distortion ", e.distortion(),
                              " is not a finite value >= 0"));
    }
    if (!std::isfinite(e.distortion_answer()) || e.distortion_answer() < 0) {
      return bad(absl::StrCat(at, ".distortion_answer ", e.distortion_answer(),
                              " is not a finite value >= 0"));
    }
    if (!std::isfinite(e.dnll()) || !std::isfinite(e.dnll_answer())) {
      return bad(absl::StrCat(at, ".dnll / dnll_answer ", e.dnll(), " / ",
                              e.dnll_answer(), " are not finite"));
    }
    if (e.format() == v1::FORMAT_BF16 && e.format_v() == v1::FORMAT_BF16 &&
        (e.distortion() != 0 || e.distortion_answer() != 0 || e.dnll() != 0 ||
         e.dnll_answer() != 0)) {
      return bad(absl::StrCat(at, ".distortion ", e.distortion(), " (answer ",
                              e.distortion_answer(), ", dnll ", e.dnll(),
                              ", dnll_answer ", e.dnll_answer(),
                              ") for bf16; expected 0 (the reference)"));
    }
    if (e.tokens() < 1 || e.queries() < 1) {
      return bad(absl::StrCat(at, " measured tokens ", e.tokens(),
                              " and queries ", e.queries(),
                              "; both must be >= 1"));
    }
    if (!keys.emplace(e.tag().temporal(), e.tag().modality(), e.tag().role(),
                      e.format(), e.format_v(), e.group_size(), e.scale_dtype())
             .second) {
      return bad(absl::StrCat(at, " repeats tag ", TagLabel(e.tag()),
                              " encoding ", EncodingLabel(e)));
    }
  }
  const v1::CalibrationSource& src = table.source();
  if (src.tool().empty()) return bad("source.tool is empty");
  if (src.model_file().empty()) return bad("source.model_file is empty");
  if (src.dataset().empty()) return bad("source.dataset is empty");
  if (src.metric().empty()) return bad("source.metric is empty");
  if (src.created_unix_ms() <= 0) {
    return bad(absl::StrCat("source.created_unix_ms ", src.created_unix_ms(),
                            " is not positive"));
  }
  if (src.calibration_ids().empty()) {
    return bad("source.calibration_ids is empty");
  }
  const std::set<std::string> held(src.held_out_ids().begin(),
                                   src.held_out_ids().end());
  for (int i = 0; i < src.calibration_ids_size(); ++i) {
    if (held.count(src.calibration_ids(i))) {
      return bad(absl::StrCat("source.calibration_ids[", i, "] \"",
                              src.calibration_ids(i),
                              "\" is also in source.held_out_ids"));
    }
  }
  return absl::OkStatus();
}

namespace {

std::string MarkdownOf(const v1::CalibrationTable& table,
                       double (v1::CalibrationEntry::*value)() const) {
  std::vector<std::string> encs;
  std::map<std::string, std::map<std::string, double>> cell;  // tag -> enc
  std::map<std::string, std::pair<uint64_t, uint64_t>> counts;
  for (const v1::CalibrationEntry& e : table.entries()) {
    const std::string enc = EncodingLabel(e);
    if (std::find(encs.begin(), encs.end(), enc) == encs.end()) {
      encs.push_back(enc);
    }
    const std::string tag = TagLabel(e.tag());
    cell[tag][enc] = (e.*value)();
    counts[tag] = {e.tokens(), e.queries()};
  }
  std::vector<std::pair<double, std::string>> order;
  for (const auto& [tag, row] : cell) {
    double sum = 0;
    int n = 0;
    for (const auto& [enc, d] : row) {
      if (enc == "bf16") continue;
      sum += d;
      ++n;
    }
    order.emplace_back(n ? sum / n : 0.0, tag);
  }
  std::sort(order.begin(), order.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string out = "| tag |";
  for (const std::string& e : encs) absl::StrAppend(&out, " ", e, " |");
  absl::StrAppend(&out, " tokens | queries |\n|---|");
  for (size_t i = 0; i < encs.size(); ++i) absl::StrAppend(&out, "---:|");
  absl::StrAppend(&out, "---:|---:|\n");
  for (const auto& [mean, tag] : order) {
    absl::StrAppend(&out, "| ", tag, " |");
    for (const std::string& e : encs) {
      auto it = cell[tag].find(e);
      if (it == cell[tag].end()) {
        absl::StrAppend(&out, " |");
      } else if (it->second == 0) {
        absl::StrAppend(&out, " 0 |");
      } else {
        absl::StrAppend(&out, absl::StrFormat(" %.3g |", it->second));
      }
    }
    absl::StrAppend(&out, " ", counts[tag].first, " | ", counts[tag].second,
                    " |\n");
  }
  return out;
}

}  // namespace

std::string MarkdownTable(const v1::CalibrationTable& table) {
  if (!absl::StartsWith(table.source().metric(), "output-kl")) {
    return MarkdownOf(table, &v1::CalibrationEntry::distortion);
  }
  return absl::StrCat(
      "distortion: KL (nats) per share, all predicted positions\n\n",
      MarkdownOf(table, &v1::CalibrationEntry::distortion),
      "\ndistortion_answer: KL (nats) per share, positions predicting "
      "ASSISTANT / TOOL_CALL tokens\n\n",
      MarkdownOf(table, &v1::CalibrationEntry::distortion_answer));
}

absl::StatusOr<v1::CalibrationTable> ReadTableFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  v1::CalibrationTable t;
  const bool text = absl::EndsWith(path, ".txtpb") ||
                    absl::EndsWith(path, ".textproto") ||
                    absl::EndsWith(path, ".pbtxt");
  const bool ok =
      text ? google::protobuf::TextFormat::ParseFromString(ss.str(), &t)
           : t.ParseFromString(ss.str());
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a CalibrationTable"));
  }
  return t;
}

absl::StatusOr<v1::CalibrationTable> UnionTables(
    const std::vector<v1::CalibrationTable>& tables) {
  if (tables.empty()) return absl::InvalidArgumentError("no tables to join");
  v1::CalibrationTable out = tables[0];
  auto key = [](const v1::CalibrationEntry& e) {
    const kernels::Encoding enc = EntryEncoding(e);
    return std::make_tuple(e.tag().temporal(), e.tag().modality(),
                           e.tag().role(), static_cast<int>(enc.k),
                           static_cast<int>(enc.v), enc.Group(),
                           static_cast<int>(enc.scale_dtype));
  };
  std::set<decltype(key(out.entries(0)))> have;
  for (const auto& e : out.entries()) have.insert(key(e));
  auto ids = [](const google::protobuf::RepeatedPtrField<std::string>& r) {
    return std::set<std::string>(r.begin(), r.end());
  };
  for (size_t t = 1; t < tables.size(); ++t) {
    const v1::CalibrationTable& b = tables[t];
    auto differs = [&](const char* field) {
      return absl::InvalidArgumentError(
          absl::StrCat("tables[", t, "].", field, " differs from tables[0]'s"));
    };
    if (b.model() != out.model()) return differs("model");
    if (b.shape().SerializeAsString() != out.shape().SerializeAsString()) {
      return differs("shape");
    }
    if (b.block_tokens() != out.block_tokens()) return differs("block_tokens");
    if (b.source().metric() != out.source().metric()) {
      return differs("source.metric");
    }
    if (ids(b.source().calibration_ids()) !=
        ids(out.source().calibration_ids())) {
      return differs("source.calibration_ids");
    }
    if (ids(b.source().held_out_ids()) != ids(out.source().held_out_ids())) {
      return differs("source.held_out_ids");
    }
    for (int i = 0; i < b.entries_size(); ++i) {
      const v1::CalibrationEntry& e = b.entries(i);
      const bool bf16 =
          e.format() == v1::FORMAT_BF16 && e.format_v() == v1::FORMAT_BF16;
      if (!have.insert(key(e)).second) {
        if (bf16) continue;  // zeros in every table
        return absl::InvalidArgumentError(absl::StrCat(
            "tables[", t, "].entries[", i,
            "]: its tag and encoding are already in an earlier table"));
      }
      *out.add_entries() = e;
    }
    out.mutable_source()->set_created_unix_ms(
        std::max(out.source().created_unix_ms(), b.source().created_unix_ms()));
  }
  TRIAX_RETURN_IF_ERROR(ValidateTable(out));
  return out;
}

}  // namespace triax::calibrate
