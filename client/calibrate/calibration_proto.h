// CalibrationTable (proto/triax/v1/types.proto) from a Calibrator's entries,
// and the well-formedness check kvcalibrate applies before writing or
// sending a table.
//
// Entries are canonical as the manager writes plans: format_v always set;
// group_size (32) and scale_dtype (FP16) set only when K or V is an INT
// format, else 0 / unspecified.
//
// Thread contract: free functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/calibrate/calibration.h"
#include "kernels/layout.h"
#include "triax/v1/types.pb.h"

namespace triax::calibrate {

struct TableMeta {
  std::string model;  // e.g. "kvproxy-18m"
  triax::v1::ModelShape shape;
  uint32_t block_tokens = 16;
  triax::v1::CalibrationSource source;
};

// The metric text stored in CalibrationSource.metric: the attention metric
// (calibration.h) and the output metric (output_calibration.h; the text
// starts with "output-kl").
std::string MetricDescription(int query_stride, int64_t first_query,
                              uint32_t recent_turns);
std::string OutputMetricDescription(int chunk, uint32_t recent_turns);

// The kernels::Encoding an entry names (group 0 = 32, scale FP16 unless
// FP8_E4M3).
kernels::Encoding EntryEncoding(const triax::v1::CalibrationEntry& e);

// INVALID_ARGUMENT when the result is not a well-formed table (see
// ValidateTable).
absl::StatusOr<triax::v1::CalibrationTable> BuildTable(
    const TableMeta& meta, const std::vector<CalibrationResultEntry>& entries);

// Checks a table: model non-empty; shape with positive dimensions and
// n_kv_heads dividing n_q_heads; block_tokens 1..4096; at least one entry;
// every entry with temporal, modality, role, format and format_v specified,
// group_size 0/32/64/128, finite distortion and distortion_answer >= 0,
// finite dnll and dnll_answer, tokens and queries >= 1, and no (tag,
// encoding) twice; BF16/BF16 entries with all four values 0; source
// with tool, model_file, dataset, metric, created_unix_ms > 0, at least one
// calibration id and none of them among held_out_ids. INVALID_ARGUMENT
// naming the field (e.g. "entries[3].distortion") and the value.
absl::Status ValidateTable(const triax::v1::CalibrationTable& table);

// Reads a table: text format for .txtpb / .textproto / .pbtxt, binary
// otherwise. NOT_FOUND when unreadable, INVALID_ARGUMENT when it does not
// parse. Does not validate (ValidateTable).
absl::StatusOr<triax::v1::CalibrationTable> ReadTableFile(
    const std::string& path);

// One table from runs over the same conversations with different encodings
// (kvcalibrate --encodings): the entries of all, the rest of tables[0]
// (source.created_unix_ms the latest). Each per-(tag, encoding) entry is
// measured against the same BF16 reference independently of the others,
// so the union equals one run over every encoding. INVALID_ARGUMENT naming
// the table index and field when model, shape, block_tokens,
// source.metric, calibration or held-out ids differ, or when a (tag,
// encoding) other than BF16 (all zeros everywhere) occurs twice; the result
// is checked with ValidateTable.
absl::StatusOr<triax::v1::CalibrationTable> UnionTables(
    const std::vector<triax::v1::CalibrationTable>& tables);

// A Markdown table: one row per tag (sorted by the tag's mean distortion
// over the non-BF16 encodings, most sensitive first), one column per
// encoding (in entry order), plus tokens and queries. For an output-metric
// table (source.metric starts with "output-kl"), two such tables:
// distortion, then distortion_answer.
std::string MarkdownTable(const triax::v1::CalibrationTable& table);

}  // namespace triax::calibrate
