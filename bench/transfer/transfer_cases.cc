#include "bench/transfer/transfer_cases.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace triax::bench {
namespace {

absl::Status BadEntry(absl::string_view flag, absl::string_view entry,
                      absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": \"", entry, "\" ", why));
}

absl::StatusOr<Mix> ParseSide(absl::string_view name, absl::string_view flag,
                              absl::string_view entry) {
  if (name == "tri-3.5") return Tri35Mix();
  Mix mix;
  mix.name = std::string(name);
  kernels::Format f;
  if (!kernels::ParseFormat(std::string(name).c_str(), &f)) {
    return BadEntry(flag, entry,
                    absl::StrCat("names no encoding (\"", name,
                                 "\"; one of bf16, fp8, int8, int4, int2, "
                                 "tq4, tq3, tq2, tri-3.5)"));
  }
  mix.entries.push_back({kernels::Encoding(f), 1});
  return mix;
}

}  // namespace

absl::StatusOr<std::vector<SizeCase>> ParseSizes(absl::string_view list,
                                                 const BenchShape& shape,
                                                 absl::string_view flag) {
  std::vector<SizeCase> out;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    const absl::string_view e = absl::StripAsciiWhitespace(entry);
    absl::string_view digits = e;
    uint64_t unit = 1;
    if (!e.empty()) {
      switch (absl::ascii_toupper(e.back())) {
        case 'K':
          unit = uint64_t{1} << 10;
          break;
        case 'M':
          unit = uint64_t{1} << 20;
          break;
        case 'G':
          unit = uint64_t{1} << 30;
          break;
        default:
          break;
      }
      if (unit != 1) digits.remove_suffix(1);
    }
    uint64_t n = 0;
    if (!absl::SimpleAtoi(digits, &n) || n == 0 ||
        n > (uint64_t{1} << 40) / unit) {
      return BadEntry(flag, e,
                      "is not a size (a positive integer with an optional "
                      "K, M or G suffix, at most 1T)");
    }
    SizeCase c;
    c.label = std::string(e);
    c.nominal_bytes = n * unit;
    const uint64_t per_token = shape.Bf16BytesPerToken();
    uint64_t tokens = (c.nominal_bytes + per_token - 1) / per_token;
    tokens = (tokens + shape.block_tokens - 1) / shape.block_tokens *
             shape.block_tokens;
    if (tokens > (uint64_t{1} << 24)) {
      return BadEntry(flag, e, "needs more than 2^24 tokens");
    }
    c.tokens = static_cast<uint32_t>(tokens);
    out.push_back(std::move(c));
  }
  return out;
}

absl::StatusOr<kernels::Encoding> ParseEncodingLabel(absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoding \"", text, "\": ", why));
  };
  kernels::Format f;
  if (kernels::ParseFormat(std::string(text).c_str(), &f)) {
    return kernels::Encoding(f);
  }
  kernels::Encoding e;
  bool has_k = false, has_v = false;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(part, absl::MaxSplits('=', 1));
    const std::string value(kv.second);
    if (kv.first == "k" || kv.first == "v") {
      if (!kernels::ParseFormat(value.c_str(), &f)) {
        return bad(absl::StrCat("\"", value, "\" is no format"));
      }
      (kv.first == "k" ? e.k : e.v) = f;
      (kv.first == "k" ? has_k : has_v) = true;
    } else if (kv.first == "g") {
      if (!absl::SimpleAtoi(value, &e.group)) {
        return bad(absl::StrCat("group \"", value, "\" is no integer"));
      }
    } else if (kv.first == "scale" && value == "fp8") {
      e.scale_dtype = kernels::ScaleDtype::kFP8;
    } else if (kv.first == "scale" && value == "fp16") {
      e.scale_dtype = kernels::ScaleDtype::kFP16;
    } else {
      return bad(absl::StrCat("unknown part \"", part, "\""));
    }
  }
  if (!has_k || !has_v) return bad("needs both k= and v=");
  return e;
}

std::vector<kernels::Encoding> Mix::Assign(uint32_t blocks) const {
  std::vector<kernels::Encoding> out;
  out.reserve(blocks);
  int total = 0;
  for (const auto& entry : entries) total += entry.second;
  std::vector<int> current(entries.size(), 0);
  for (uint32_t b = 0; b < blocks; ++b) {
    size_t best = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
      current[i] += entries[i].second;
      if (current[i] > current[best]) best = i;
    }
    current[best] -= total;
    out.push_back(entries[best].first);
  }
  return out;
}

Mix Tri35Mix() {
  // bench/results/policy.md, row tri-3.5, "final plan mix (tokens)".
  static const std::pair<const char*, int> kEntries[] = {
      {"bf16", 1},
      {"int4", 6},
      {"k=int4,v=int2", 5},
      {"k=int4,v=int4,g=128", 2},
      {"k=int8,v=int4", 9},
      {"k=tq2,v=tq3", 2},
      {"k=tq2,v=tq4", 1},
      {"k=tq3,v=tq4", 2},
      {"k=tq4,v=tq2", 3},
      {"k=tq4,v=tq3", 4},
      {"tq2", 53},
      {"tq3", 7},
      {"tq4", 6}};
  Mix mix;
  mix.name = "tri-3.5";
  for (const auto& [label, weight] : kEntries) {
    // The labels are fixed above and parse by construction.
    mix.entries.push_back({*ParseEncodingLabel(label), weight});
  }
  return mix;
}

absl::StatusOr<std::vector<EncodingCase>> ParseEncodingCases(
    absl::string_view list, const BenchShape& shape, absl::string_view flag) {
  std::vector<EncodingCase> out;
  const kernels::PageShape page{static_cast<int>(shape.block_tokens),
                                static_cast<int>(shape.n_kv_heads),
                                static_cast<int>(shape.head_dim)};
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    const absl::string_view e = absl::StripAsciiWhitespace(entry);
    std::vector<absl::string_view> sides = absl::StrSplit(e, "->");
    if (sides.size() > 2) return BadEntry(flag, e, "has more than one \"->\"");
    EncodingCase c;
    c.name = std::string(e);
    auto source = ParseSide(sides[0], flag, e);
    if (!source.ok()) return source.status();
    auto destination =
        ParseSide(sides.size() == 2 ? sides[1] : sides[0], flag, e);
    if (!destination.ok()) return destination.status();
    c.source = *std::move(source);
    c.destination = *std::move(destination);
    for (const Mix* m : {&c.source, &c.destination}) {
      for (const auto& entry_encoding : m->entries) {
        if (const char* why =
                kernels::ValidateEncoding(entry_encoding.first, page)) {
          return BadEntry(flag, e, absl::StrCat("is not valid here: ", why));
        }
      }
    }
    out.push_back(std::move(c));
  }
  return out;
}

uint64_t BlockBytes(const kernels::Encoding& e, const BenchShape& shape) {
  const kernels::PageShape page{static_cast<int>(shape.block_tokens),
                                static_cast<int>(shape.n_kv_heads),
                                static_cast<int>(shape.head_dim)};
  return uint64_t{kernels::PageBytes(e, page)} * shape.n_layers;
}

}  // namespace triax::bench
