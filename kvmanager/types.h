// Domain types of the manager core. They mirror triax.v1 (types.proto,
// manager.proto) field for field, but carry no protobuf dependency: the core
// takes and returns these, and manager_service converts at the edge. The
// vocabulary shared with the worker and the clients (ModelShape, Tier, the
// tag axes Role / Modality / Temporal, Tag, Encoding, BlockSpec) is defined
// once in common/model.h. Enum values equal the proto enum values, so
// conversion is a cast; the core validates the range (a value outside the
// enum is rejected like an unspecified one).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model.h"
#include "kernels/layout.h"

namespace triax::manager {

enum class WorkerState : int {
  kUnspecified = 0,
  kUp = 1,
  kDown = 2,
  kSuspect = 3,  // missed heartbeats; not yet DOWN
};
// "up", "suspect", "down"; "unspecified" for anything else (metrics
// labels, the dashboard's JSON).
std::string WorkerStateName(WorkerState s);
enum class SequenceState : int {
  kUnspecified = 0,
  kOpen = 1,
  kClosed = 2,
  kLost = 3
};

enum class EventKind : int {
  kUnspecified = 0,
  kBlockCreated = 1,
  kBlockRetagged = 2,
  kBlockShared = 3,
  kBlockReleased = 4,
  kBlockFreed = 5,
  kBlockLost = 6,
  kSequenceOpened = 7,
  kSequenceExtended = 8,
  kSequenceForked = 9,
  kSequenceClosed = 10,
  kSequenceLost = 11,
  kWorkerUp = 12,
  kWorkerDown = 13,
  kTenantChanged = 14,
  kBlockDemoted = 15,
  kBlockSpilled = 16,
  kBlockRestored = 17,
  kBlockEvicted = 18,
  kWorkerSuspect = 19,
  kWorkerRecovered = 20,
  kSequenceRecovered = 21,
  kSequenceTruncated = 22,
  // Worker-to-worker transfers: worker_id is the destination,
  // source_worker_id the source.
  kTransferStarted = 23,
  kBlockTransferred = 24,
  kTransferFailed = 25,
  kSequenceTransferred = 26,
  // Reported by the worker (Inventory.sealed_blocks): every layer of the
  // block written and encoded into its format.
  kBlockSealed = 27,
  kLastEventKind = kBlockSealed,
};

// "EVENT_BLOCK_CREATED", ...; "EVENT_KIND(<int>)" when out of range.
std::string EventKindName(EventKind k);

// A run of tokens that share role and modality.
struct Span {
  Role role = Role::kUnspecified;
  Modality modality = Modality::kText;  // kUnspecified means text
  uint32_t num_tokens = 0;              // >= 1
  // Not on the wire (spans from the tagger only): the span's turn relative to
  // the request's first turn (Open: turn 0; Extend: the current turn, or the
  // next one with new_turn). Non-decreasing across a request's spans, in
  // steps of at most 1, the first 0 for Open and 0 or 1 for Extend.
  uint32_t turn_offset = 0;
};

// triax.v1.ChatTemplate.
enum class ChatTemplate : int {
  kUnspecified = 0,
  kChatML = 1,
  kLlama3 = 2,
  kGeneric = 3
};

// triax.v1.RenderedText: a rendered prompt the manager tags itself
// (kvmanager/tagger.h).
struct RenderedText {
  std::string text;
  ChatTemplate chat_template = ChatTemplate::kUnspecified;
  std::vector<uint32_t> token_offsets;  // empty: one token per byte
  uint32_t bos_tokens = 0;
  Role continues = Role::kUnspecified;  // the message the text continues
};

// A block of a sequence's plan: the worker's BlockSpec (tokens, lineage,
// encoding, tier, eviction) plus what the manager tracks about it.
// `encoding` is canonical (policy.h: CanonicalEncoding); on the wire it is
// format, format_v, group_size, scale_dtype.
struct BlockPlan : BlockSpec {
  uint32_t capacity = 0;  // the sequence's block_tokens
  Tag tag;
  uint32_t refcount = 0;  // sequences sharing the block
};

// An encoding as it comes off the wire (BlockPlan / PolicyRule /
// BlockEncoding fields), before validation (policy.h: ResolveEncoding).
// Out-of-range wire enum values arrive as 255.
struct EncodingSpec {
  Format format = static_cast<Format>(0);    // K (and V unless format_v)
  Format format_v = static_cast<Format>(0);  // 0: same as format
  uint32_t group_size = 0;                   // 0 (= 32), 32, 64, 128
  int scale_dtype = 0;  // 0 unspecified (FP16), 1 FP16, 2 FP8 E4M3
};

// triax.v1.PolicyRule: unspecified tag fields match anything.
struct PolicyRuleInfo {
  Temporal temporal = Temporal::kUnspecified;
  Role role = Role::kUnspecified;
  Modality modality = Modality::kUnspecified;
  EncodingSpec encoding;
};

// triax.v1.Policy. budget_bits > 0 makes it an allocation policy
// (policy.h): encodings chosen per tag by the bit allocator from the
// calibration table of calibration_model, among `candidates` (empty: every
// encoding the table has); rules act as pins.
struct PolicyInfo {
  std::string name;
  std::vector<PolicyRuleInfo> rules;
  bool builtin = false;  // output only
  double budget_bits = 0;
  std::string calibration_model;
  std::vector<EncodingSpec> candidates;  // wire: PolicyRule, tag ignored
  double answer_weight = 0;
  // triax.v1.Objective as sent (0 KL, 1 DNLL; BuildPolicy refuses others).
  int objective = 0;
};

// triax.v1.CalibrationEntry: distortion per token of one tag at one encoding.
struct CalibrationEntryInfo {
  Tag tag;                // temporal and role specified; modality 0 = TEXT
  EncodingSpec encoding;  // canonical once stored
  double distortion = 0;  // finite, >= 0
  uint64_t tokens = 0;
  uint64_t queries = 0;
  double distortion_answer = 0;  // finite, >= 0
  double dnll = 0;               // finite
  double dnll_answer = 0;        // finite
};

// triax.v1.CalibrationSource: where a table came from; stored as given.
struct CalibrationSourceInfo {
  std::string tool;
  std::string model_file;
  std::string dataset;
  std::vector<std::string> calibration_ids;
  std::vector<std::string> held_out_ids;
  std::string metric;
  int64_t created_unix_ms = 0;
};

// triax.v1.CalibrationTable.
struct CalibrationTableInfo {
  std::string model;  // id policies refer to (calibration_model)
  ModelShape shape;
  uint32_t block_tokens = 0;
  std::vector<CalibrationEntryInfo> entries;
  CalibrationSourceInfo source;
};

struct PutCalibrationRequest {
  std::string request_id;
  CalibrationTableInfo table;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct Budget {
  Tier tier = Tier::kUnspecified;
  uint64_t floor_bytes = 0;    // guaranteed
  uint64_t ceiling_bytes = 0;  // admission limit; > 0 and >= floor_bytes
};

struct TierUsage {
  Tier tier = Tier::kUnspecified;
  uint64_t used_bytes = 0;
};

struct TenantInfo {
  std::string tenant_id;
  std::vector<Budget> budgets;   // ordered by tier
  std::vector<TierUsage> usage;  // every tier, ordered by tier
  uint32_t open_sequences = 0;
  std::string default_policy;
  std::string prefix_salt;  // shared prefix salt; empty: private
};

struct FormatInventory {
  Format format = Format::kBF16;
  uint64_t pages_used = 0;
  uint64_t bytes_used = 0;
};

struct TierInventory {
  Tier tier = Tier::kUnspecified;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t blocks = 0;
};

// One page pool of a worker's arena (triax.v1.PoolInventory).
struct PoolInventory {
  Encoding encoding;
  uint64_t page_bytes = 0;
  uint64_t pages_per_frame = 0;
  uint64_t frames = 0;
  uint64_t pages_used = 0;
  uint64_t free_slots = 0;
  uint64_t allocatable_pages = 0;
  uint64_t free_slots_compacted = 0;
};

struct Inventory {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  std::vector<FormatInventory> formats;
  std::vector<std::string> sequence_ids;
  uint64_t window_bytes = 0;
  std::vector<TierInventory> tiers;  // host and disk spill tiers
  uint64_t spills = 0;
  uint64_t restores = 0;
  uint64_t checksum_failures = 0;
  uint64_t evictions = 0;
  // Restored by the worker itself (restore on Attend) since its previous
  // heartbeat.
  std::vector<uint64_t> restored_lineage_ids;
  // Sealed on the worker since its previous heartbeat: (lineage id, the
  // worker's unix ms of the seal).
  std::vector<std::pair<uint64_t, int64_t>> sealed_blocks;
  std::string device_error;  // empty: the device serves
  // The page arena in frames (triax.v1.Inventory fields 20..31);
  // frame_bytes 0: the worker reported none (room is then counted in bytes).
  uint64_t frame_bytes = 0;
  uint64_t frames = 0;
  uint64_t free_frames = 0;
  uint64_t free_frames_compacted = 0;
  uint64_t free_bytes = 0;
  uint64_t tail_bytes = 0;
  double fragmentation = 0;
  std::vector<PoolInventory> pools;
  uint64_t compactions = 0;
  uint64_t pages_moved = 0;
  uint64_t bytes_moved = 0;
  uint64_t frames_freed_by_compaction = 0;
  // Blocks of the sequences GetInventory was asked to describe.
  struct Described {
    std::string sequence_id;
    std::vector<BlockSpec> blocks;
  };
  std::vector<Described> described;
};

struct WorkerInfo {
  std::string worker_id;
  std::string address;
  std::string backend;
  WorkerState state = WorkerState::kUnspecified;
  uint64_t capacity_bytes = 0;
  uint64_t reserved_bytes = 0;
  Inventory inventory;
  int64_t last_heartbeat_unix_ms = 0;
  uint32_t sequences = 0;            // open sequences placed on it
  uint64_t host_capacity_bytes = 0;  // spill tiers (0: none)
  uint64_t disk_capacity_bytes = 0;
  std::string incarnation;  // as registered
};

struct SequenceInfo {
  std::string sequence_id;
  std::string tenant_id;
  ModelShape model;
  std::string worker_id;
  std::string worker_address;
  SequenceState state = SequenceState::kUnspecified;
  uint32_t block_tokens = 0;
  uint64_t num_tokens = 0;
  uint32_t turns = 0;  // number of turns so far (Open is turn 0, so >= 1)
  std::string policy;
  std::string parent_sequence_id;
  std::vector<BlockPlan> blocks;  // empty once closed or lost
  // Device bytes of the sequence's blocks: sum over blocks of
  // n_layers * PageBytes(encoding). Blocks shared with a fork count in both
  // sequences here, but are charged to the tenant once.
  uint64_t bytes = 0;
  std::vector<uint64_t> lost_lineage_ids;  // set when state is kLost
  // Set while a transfer of the sequence is in flight.
  std::string transfer_id;
  std::string transfer_destination_worker_id;
  // Prefix reuse: Open shared blocks [0, prefix_blocks) (prefix_tokens
  // tokens) of prefix_sequence_id; hashed_blocks leading blocks carry hashes.
  std::string prefix_sequence_id;
  std::string prefix_tenant_id;  // the tenant of prefix_sequence_id
  uint32_t prefix_blocks = 0;
  uint64_t prefix_tokens = 0;
  uint32_t hashed_blocks = 0;
};

struct Event {
  uint64_t id = 0;  // dense, increasing; assigned by the EventLog
  int64_t unix_ms = 0;
  EventKind kind = EventKind::kUnspecified;
  uint64_t lineage_id = 0;  // block events
  std::string sequence_id;
  std::string tenant_id;
  std::string worker_id;
  Tag tag;
  Format format = static_cast<Format>(0);  // K format; 0: non-block events
  std::string detail;                      // key=value
  std::vector<uint64_t> lineage_ids;       // SEQUENCE_LOST: every lost block
  std::string source_worker_id;            // transfer events
};

// --- Requests and results of the mutating calls ------------------------------

struct RegisterWorkerRequest {
  std::string request_id;
  std::string worker_id;             // [A-Za-z0-9._:-]{1,128}
  std::string address;               // host:port, non-empty
  std::string backend;               // non-empty, e.g. "cpu" or "cuda"
  uint64_t capacity_bytes = 0;       // > 0
  uint64_t host_capacity_bytes = 0;  // host spill tier; 0: none
  uint64_t disk_capacity_bytes = 0;  // disk spill tier; 0: none
  // The worker process's identity ([A-Za-z0-9._:-]{1,128}); empty: every
  // re-registration is a restart. See ManagerCore::RegisterWorker.
  std::string incarnation;
  Inventory inventory;       // what the worker holds now
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};
struct RegisterWorkerResult {
  uint32_t heartbeat_interval_ms = 0;
  std::vector<std::string> lost_sequence_ids;
  // Inventory sequences the manager does not hold open on this worker: the
  // worker frees them. Sorted.
  std::vector<std::string> release_sequence_ids;
  // LOST sequences of this worker that are OPEN again. Sorted.
  std::vector<std::string> recovered_sequence_ids;
  // Not sent to the worker: open sequences a two-phase change was in
  // flight on when the manager stopped, whose blocks the service asks the
  // worker to describe (ManagerCore::AdoptWorkerBlocks).
  std::vector<std::string> describe_sequence_ids;
};
struct HeartbeatResult {
  // As RegisterWorkerResult::release_sequence_ids.
  std::vector<std::string> release_sequence_ids;
  // As RegisterWorkerResult::describe_sequence_ids, with the worker's
  // address to ask.
  std::vector<std::string> describe_sequence_ids;
  std::string worker_address;
};

struct CreateTenantRequest {
  std::string request_id;
  std::string tenant_id;
  std::vector<Budget> budgets;  // at most one per tier; others unlimited
  std::string default_policy;   // empty: the manager's default
  // Prefix reuse: a shared salt (an id); empty: the tenant's private salt.
  std::string prefix_salt;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct SetBudgetRequest {
  std::string request_id;
  std::string tenant_id;
  Budget budget;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct OpenSequenceRequest {
  std::string request_id;
  std::string tenant_id;
  ModelShape model;
  std::vector<Span> spans;
  uint32_t block_tokens = 0;  // 0: the manager's default
  std::string policy;         // empty: the tenant's default
  // Exactly one of spans and rendered (the core tags rendered text).
  std::optional<RenderedText> rendered;
  // The worker-side BF16 window the frontend gives AllocatePages; nullopt:
  // the worker's --window_tokens (SequenceRecord::window_tokens).
  std::optional<uint32_t> window_tokens;
  // The worker to open on (WorkerRegistry::PlaceOn); empty: placement.
  std::string worker_id;
  // Prefix reuse (prefix_index.h): the prompt's token ids (one per token of
  // the spans, or none) and/or the client's hashes of its leading full
  // blocks (32 bytes each); no_reuse registers hashes but shares nothing.
  std::vector<uint32_t> token_ids;
  std::vector<std::string> block_hashes;
  bool no_reuse = false;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct ExtendSequenceRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<Span> spans;
  bool new_turn = false;
  bool continue_last_span = false;
  // Exactly one of spans and rendered; with rendered, new_turn is false and
  // each user message in the text starts a turn.
  std::optional<RenderedText> rendered;
  // The new tokens' ids (one per token, or none): newly full blocks of the
  // sequence's hash chain get hashes (prefix_index.h).
  std::vector<uint32_t> token_ids;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct ForkSequenceRequest {
  std::string request_id;
  std::string tenant_id;
  std::string parent_sequence_id;
  uint64_t num_tokens = 0;   // 0: all
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

struct CloseSequenceRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};
struct CloseSequenceResult {
  std::vector<uint64_t> freed_lineage_ids;
};

struct TruncateSequenceRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  uint64_t num_tokens = 0;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};
struct TruncateSequenceResult {
  SequenceInfo sequence;
  std::vector<uint64_t> released_lineage_ids;
  std::vector<uint64_t> freed_lineage_ids;
};

struct PutPolicyRequest {
  std::string request_id;
  PolicyInfo policy;
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};

// The new encoding of one block of a DemoteBlocks request.
struct BlockEncoding {
  uint64_t lineage_id = 0;
  EncodingSpec encoding;
};

struct DemoteBlocksRequest {
  std::string request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<BlockEncoding> blocks;  // 1..kMaxSequenceBlocks, distinct
  uint64_t fingerprint = 0;  // of the payload: IdempotencyCache::Lookup
};
struct DemoteBlocksResult {
  SequenceInfo sequence;
  int64_t bytes_delta = 0;  // change of the tenant's TIER_DEVICE bytes
};

// What ManagerCore::PrepareDemote hands the service: either a remembered
// reply (`done`, an idempotent repeat) or the worker call to make and the
// token to commit or abort with.
struct DemotePrepared {
  std::optional<DemoteBlocksResult> done;
  uint64_t token = 0;
  std::string worker_id;
  std::string worker_address;
  // The worker's DemoteRequest: request id, tenant, sequence, and for each
  // block whose encoding changes its plan with the new encoding (blocks
  // already in the requested encoding are left out; may be empty).
  std::string worker_request_id;
  std::string tenant_id;
  std::string sequence_id;
  std::vector<BlockPlan> blocks;
  int64_t bytes_delta = 0;
};

struct ExtendSequenceResult {
  SequenceInfo sequence;
  std::vector<BlockPlan> new_blocks;
  std::vector<BlockPlan> grown_blocks;
  std::vector<BlockPlan> retagged_blocks;
  // Allocation policies: blocks re-encoded in place at this call, with their
  // new encoding (filled by FinishExtendDemotion once the worker applied
  // them).
  std::vector<BlockPlan> demoted_blocks;
  // Set by ExtendSequence when existing blocks are to be demoted: the
  // worker's DemoteRequest content and the token for FinishExtendDemotion.
  // Never set in a remembered (idempotent) reply.
  std::optional<DemotePrepared> demotion;
};

struct TraceResult {
  BlockPlan block;  // current state, or the last known one if freed/lost
  std::string sequence_id;    // the sequence that created the block
  std::vector<Event> events;  // retained events of the lineage, by id
  // The paged QueryTrace: the token of the next page of events (empty: last).
  std::string next_page_token;
};

// Which events a watcher sees; empty / zero fields match everything.
struct EventFilter {
  std::string tenant_id;
  std::string sequence_id;
  uint64_t lineage_id = 0;  // matches lineage_id or any of lineage_ids
  EventKind kind = EventKind::kUnspecified;  // unspecified: any kind
  bool Matches(const Event& e) const;
};

// --- Memory pressure
// ----------------------------------------------------------

struct ReportAccessRequest {
  std::string tenant_id;
  std::string sequence_id;
  std::vector<uint64_t> lineage_ids;  // blocks of the sequence, <= 4096
  std::vector<float> weights;         // empty, or one per lineage id, 0..1
  bool active = false;                // prefetch the sequence's spilled blocks
};

}  // namespace triax::manager
