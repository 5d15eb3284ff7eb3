// Output formatting for kvctl: aligned tables, key=value event lines and JSON
// lines. Pure functions of the proto messages (no I/O), thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "triax/v1/manager.pb.h"
#include "triax/v1/types.pb.h"

namespace triax::kvctl {

// Enum values without their prefix, lower case: ROLE_TOOL_CALL ->
// "tool_call", FORMAT_INT4 -> "int4", TIER_DEVICE -> "device". Unspecified
// values print as "-"; values unknown to this build as "?<number>".
std::string RoleName(triax::v1::Role v);
std::string ModalityName(triax::v1::Modality v);
std::string TemporalName(triax::v1::Temporal v);
std::string FormatName(triax::v1::Format v);
std::string TierName(triax::v1::Tier v);
std::string WorkerStateName(triax::v1::WorkerState v);
std::string SequenceStateName(triax::v1::SequenceState v);
// Event kinds keep upper case without "EVENT_": "WORKER_DOWN".
std::string EventKindName(triax::v1::EventKind v);

// "temporal/modality/role", e.g. "sink/text/system".
std::string TagString(const triax::v1::Tag& tag);
// "512 B", "1.50 KiB", "12.00 MiB", "3.00 GiB".
std::string HumanBytes(uint64_t bytes);
// RFC 3339 UTC with milliseconds; "-" for 0.
std::string UnixMsString(int64_t unix_ms);
// Comma-separated decimal ids; "-" when empty.
std::string IdList(const std::vector<uint64_t>& ids);

// Left-aligned columns separated by two spaces; the first row is the header.
// Rows shorter than the header are padded with empty cells.
class Table {
 public:
  explicit Table(std::vector<std::string> header);
  void AddRow(std::vector<std::string> row);
  std::string Render() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string WorkersTable(const triax::v1::ListWorkersResponse& resp);
std::string TenantsTable(const triax::v1::ListTenantsResponse& resp);
std::string SequencesTable(const triax::v1::ListSequencesResponse& resp);
// Header fields, the plan as a table, and the lost lineage ids when LOST.
std::string SequenceDetail(const triax::v1::SequenceInfo& seq);
// The block's current state and its lifecycle events as a table.
std::string TraceDetail(uint64_t lineage_id,
                        const triax::v1::QueryTraceResponse& resp);

// One event as key=value pairs, empty fields left out:
//   id=7 time=... kind=BLOCK_CREATED lineage=3 sequence=s1 tenant=t1
//   worker=w1 tag=sink/text/system format=bf16 lineages=1,2 detail="..."
std::string EventLine(const triax::v1::Event& e);
// One event as a JSON object on one line, every field present:
//   {"id":7,"unix_ms":...,"kind":"BLOCK_CREATED","lineage_id":3,...}
std::string EventJson(const triax::v1::Event& e);
// A JSON string literal with quotes, escaping per RFC 8259.
std::string JsonString(const std::string& s);

}  // namespace triax::kvctl
