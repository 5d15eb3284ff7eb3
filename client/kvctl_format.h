// Output formatting for kvctl: aligned tables, key=value event lines and JSON
// lines. Pure functions of the proto messages (no I/O), thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
// PRESSURE_ACTION_SPILL_HOST -> "spill_host".
std::string PressureActionName(triax::v1::PressureAction v);
// Kernel names: "bf16", "fp8", "int8", "int4", "int2", "tq4", "tq3", "tq2"
// (FormatName gives these too; FORMAT_FP8_E4M3 prints as "fp8").
// Parses one; false for anything else (FORMAT_UNSPECIFIED is not a name).
bool ParseFormat(absl::string_view name, triax::v1::Format* out);
// "fp16" / "fp8"; "-" for unspecified.
std::string ScaleDtypeName(triax::v1::ScaleDtype v);

// Compact encoding syntax (docs/client.md):
//   FMT                              K and V in FMT, default group and scale
//   k=FMT,v=FMT,g=N,scale=fp16|fp8   any subset; v defaults to k; k required
// ParseEncoding fills format, format_v (only when given), group_size and
// scale_dtype of `out` (a BlockPlan-like message: BlockEncoding or
// PolicyRule). INVALID_ARGUMENT naming the bad part.
absl::Status ParseEncoding(absl::string_view text,
                           triax::v1::BlockEncoding* out);
// A capacity row (docs/capacity.md), as `kvctl plan --policies` and
// capacity_replay --policies take it: ENCODING (the compact syntax above),
// policy=NAME or triaxial=BITS, then options +sink=N, +window=N, +dnll and
// +label=NAME (the row's name). INVALID_ARGUMENT `--FLAG="TEXT": why`.
absl::StatusOr<triax::v1::CapacityPolicy> ParseCapacityRow(
    absl::string_view flag, absl::string_view text);
// Rows separated by spaces.
absl::StatusOr<std::vector<triax::v1::CapacityPolicy>> ParseCapacityRows(
    absl::string_view flag, absl::string_view text);
// The compact form of an encoding: "int4" when V is unspecified or equal to
// K and group/scale are default; else "k=fp8,v=int4,g=64,scale=fp8" with
// only the non-default parts after k and v.
std::string EncodingString(triax::v1::Format k, triax::v1::Format v,
                           uint32_t group_size, triax::v1::ScaleDtype scale);

// Policy rules: "[SELECTOR[,SELECTOR...]:]ENCODING" or "*:ENCODING", where a
// SELECTOR is temporal=sink|current_turn|recent_turns|older,
// role=system|tool_schema|user|assistant|reasoning|tool_call|tool_result|
// delimiter, or modality=text|image|audio. Without selectors (or with "*")
// the rule matches everything. E.g. "temporal=sink:bf16",
// "role=system:k=int4,v=int2,g=64,scale=fp8", "*:int4".
absl::Status ParsePolicyRule(absl::string_view text,
                             triax::v1::PolicyRule* out);
// The rule in the same syntax (round-trips through ParsePolicyRule).
std::string PolicyRuleString(const triax::v1::PolicyRule& r);
// One row per rule: NAME, BUILTIN, #, RULE.
std::string PoliciesTable(const triax::v1::ListPoliciesResponse& resp);

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
// One row per page pool of every worker (its last heartbeat's inventory).
std::string PoolsTable(const triax::v1::ListWorkersResponse& resp);
std::string TenantsTable(const triax::v1::ListTenantsResponse& resp);
// Token id, role, tenant ("-" for none), created and expiry (RFC 3339 UTC,
// "never"), description.
std::string TokensTable(const triax::v1::ListTokensResponse& resp);
std::string SequencesTable(const triax::v1::ListSequencesResponse& resp);
// Header fields (with the transfer in flight, if any), the plan as a table
// (K and V formats, INT group and scale dtype, tier (unspecified prints as
// "device") and evicted flag per block), and the lost lineage ids when LOST.
std::string SequenceDetail(const triax::v1::SequenceInfo& seq);
// The value of `key` in an event detail of key=value pairs ("" when absent).
std::string DetailValue(absl::string_view detail, absl::string_view key);
// `kvctl sequence`'s transfer history: one row per transfer event among
// `events` (TRANSFER_STARTED, TRANSFER_FAILED, SEQUENCE_TRANSFERRED):
//   ID TIME TRANSFER EVENT FROM TO DETAIL
// with EVENT "started", "failed" or "committed"; "transfers: none" when
// there is none.
std::string TransferHistory(const std::vector<triax::v1::Event>& events);
// `kvctl transfer`: the transfer, source -> destination, blocks and pages,
// wire bytes against BF16 bytes (ratio and "N.NNx fewer"), source bytes,
// seconds and pull seconds; then the sequence (SequenceDetail).
std::string TransferReport(const triax::v1::TransferSequenceResponse& r);
// Where a block has been, from its trace's events in order: "created on A,
// transferred A -> B (xfer-1), transferred B -> A (xfer-2)". Starts with
// "on A" when the creation event is no longer retained; "-" when no event
// names a worker.
std::string WorkerPath(const triax::v1::QueryTraceResponse& resp);
// `kvctl pressure`: the mode, the ranker's snapshot (blocks, age, ranking
// time) and the applied-action counters; then three tables:
//   POOLS    WORKER TIER USED CAPACITY USE LOW_WM HIGH_WM STATE, where STATE
//            is "over high" (used > high watermark: the manager reclaims),
//            "above low" (between the watermarks) or "ok";
//   TENANTS  TENANT TIER USED FLOOR CEILING STANDING, one row per tier with a
//            budget or usage; STANDING is "over ceiling by X", "above floor
//            by X" (gives memory first), "at/below floor" or "no budget";
//   RANKED   # LINEAGE SEQUENCE TENANT ACTION ENCODING BYTES_FREED COST,
//            cheapest first (ENCODING is the new encoding of a demote).
std::string PressureReport(const triax::v1::GetPressureResponse& resp);
// The block's current state, its worker path (WorkerPath) and its lifecycle
// events as a table (WORKER: the worker, "A -> B" for a transfer).
std::string TraceDetail(uint64_t lineage_id,
                        const triax::v1::QueryTraceResponse& resp);

// One event as key=value pairs, empty fields left out:
//   id=7 time=... kind=BLOCK_CREATED lineage=3 sequence=s1 tenant=t1
//   worker=w1 source=w0 tag=sink/text/system format=bf16 lineages=1,2
//   detail="..."   (source: transfer events' source worker)
std::string EventLine(const triax::v1::Event& e);
// One event as a JSON object on one line, every field present:
//   {"id":7,"unix_ms":...,"kind":"BLOCK_CREATED","lineage_id":3,...}
std::string EventJson(const triax::v1::Event& e);
// A JSON string literal with quotes, escaping per RFC 8259.
std::string JsonString(const std::string& s);

}  // namespace triax::kvctl
