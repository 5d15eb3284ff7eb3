// Capacity planning (PlanCapacity, `kvctl plan`; docs/capacity.md): with a
// model, GPUs and a mix of work, how many tokens and sessions fit per
// policy, and what each tenant gets.
//
// Memory. Per GPU the KV pool is gpu_memory_bytes - reserve_bytes (weights
// and runtime), of which the safety ceiling (0, 1] is used; gpu_count GPUs.
// A session lives on one GPU (one worker), so sessions are counted per GPU
// and multiplied. host_bytes / disk_bytes: the spill tiers of one worker.
//
// Two columns per policy row:
//   idealized     the published FP8/INT4 serving note's formula: bytes per
//                 token = layers * H * D * (bytes_K + bytes_V), a tensor's
//                 bytes per value being bits/8 plus, for INT formats, one
//                 scale per group of `group` values (2 bytes FP16, 1 FP8;
//                 no zero point), for TQ one FP16 norm per head_dim values,
//                 nothing for FP8's per-page scale; tokens = the ceiling's
//                 bytes / bytes per token rounded to the nearest token, as
//                 the note rounds (its 971,475 is 971,474.8).
//   triaxkv pages what the pools really take: kernels::PageBytes of one
//                 block (every layer) over block_tokens, so scale AND zero
//                 per group (keys grouped over min(g, T) tokens), FP8's
//                 per-page scales and 16-byte section padding count; with
//                 frame_bytes > 0 each page also carries its share of its
//                 frame's tail (a frame holds floor(frame / page) pages of
//                 one pool; worker/page_allocator.h). Only whole blocks
//                 fit: tokens = floor(usable / block bytes) * block_tokens.
//
// Policies (one row each):
//   uniform      an encoding (K/V formats, group, scale dtype) for every
//                block; sink_tokens leading tokens (whole blocks) in BF16.
//   named        a built-in or operator policy (policy.h) by name: a rule
//                policy gives each tag of the tag mix its rule's encoding;
//                an allocation policy is solved as below.
//   allocation   the triaxial policy at budget_bits: the manager's own
//                allocator (SequencePlanner::Allocate, the code every Open
//                and Extend runs) over the tag mix with the calibration
//                table; the row's bytes are the mix's share-weighted bytes.
// window_tokens (any row): the worker's BF16 recent window; a non-BF16 block
// whose tokens are not all older than the window also holds a BF16 window
// page (docs/worker.md), so sessions pay for it. Live tokens do not (they
// are the steady state of long contexts).
// Sessions at a context length L: ceil(L / T) blocks per session (sinks and
// window as above); pages: floor(per-GPU usable / session bytes) * GPUs;
// idealized: floor(usable / (L * idealized bytes)), sinks and window in BF16.
//
// Tenants: the usable device bytes are shared out by water-filling: every
// tenant gets the same amount, raised to its floor and capped at its ceiling
// (0: none), the level chosen so the shares add up to the usable bytes (or
// every tenant sits at its ceiling). When the floors alone exceed the usable
// bytes the shares are the floors scaled down in proportion and
// floors_exceed_memory is set. Each row gives each tenant's tokens and
// sessions at its share.
//
// What-ifs: each is the same plan with GPUs added, tenants added and/or the
// policies replaced, planned in full.
//
// Errors: INVALID_ARGUMENT naming the field and the value (e.g.
// `ceiling=1.5 is outside (0, 1]`, `model_preset="llama-9"`,
// `policies[2].budget_bits=-1`); FAILED_PRECONDITION when a named or
// allocation row needs a tag mix or calibration table the request lacks;
// RESOURCE_EXHAUSTED from the allocator when a budget is below the cheapest
// mix.
//
// Thread contract: pure functions; safe to call concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvmanager/sequence_planner.h"
#include "kvmanager/types.h"

namespace triax::manager {

inline constexpr size_t kMaxCapacityPolicies = 64;
inline constexpr size_t kMaxCapacityContexts = 64;
inline constexpr size_t kMaxCapacityTenants = 1024;
inline constexpr size_t kMaxCapacityWhatIfs = 16;
inline constexpr uint32_t kMaxCapacityGpus = 1 << 16;

// A model family's attention shape.
struct ModelPreset {
  const char* name;  // e.g. "llama-3-8b"
  uint32_t n_layers, n_kv_heads, n_q_heads, head_dim;
};
// Llama-3-8B, Llama-3-70B, Qwen2.5-7B, Qwen2.5-72B, Mistral-7B.
const std::vector<ModelPreset>& ModelPresets();
// The preset's shape (name matched case-insensitively; "Llama-3-8B" and
// "llama-3-8b" are one); INVALID_ARGUMENT naming `field`, the value and
// the presets otherwise.
absl::StatusOr<ModelShape> PresetShape(absl::string_view field,
                                       absl::string_view name);

struct CapacityPolicySpec {
  std::string label;  // the row's name; empty: derived from the rest
  // uniform: encoding.format set (policy empty, budget_bits 0).
  EncodingSpec encoding;
  uint32_t sink_tokens = 0;  // uniform only
  // named: a policy by name (built-in, or in CapacityRequest::policies).
  std::string policy;
  // allocation: budget_bits > 0 with CapacityRequest::calibration.
  double budget_bits = 0;
  int objective = 0;  // 0 KL, 1 DNLL (Policy::Objective)
  double answer_weight = 0;
  uint32_t window_tokens = 0;  // any row
};

struct CapacityTenant {
  std::string tenant_id;
  int64_t floor_bytes = 0;    // >= 0
  int64_t ceiling_bytes = 0;  // 0: none; else >= floor_bytes
};

struct CapacityWhatIf {
  std::string label;  // non-empty
  int64_t add_gpus = 0;
  std::vector<CapacityTenant> add_tenants;
  std::vector<CapacityPolicySpec> policies;  // non-empty: replace the rows
};

struct CapacityRequest {
  std::string model_preset;  // or `model` (n_layers > 0); not both
  ModelShape model;
  uint32_t block_tokens = 16;
  int64_t gpu_memory_bytes = 0;  // per GPU, > 0
  int64_t gpu_count = 1;         // 1..kMaxCapacityGpus
  int64_t reserve_bytes = 0;     // per GPU, >= 0, < gpu_memory_bytes
  double ceiling = 1;            // (0, 1]
  int64_t host_bytes = 0;        // per worker, >= 0
  int64_t disk_bytes = 0;        // per worker, >= 0
  int64_t frame_bytes = 0;       // 0: no frame packing; else >= page bytes
  std::vector<CapacityPolicySpec> policies;  // 1..kMaxCapacityPolicies
  std::vector<int64_t> context_lengths;      // each > 0
  std::vector<CapacityTenant> tenants;
  // Distinct tags (modality UNSPECIFIED is TEXT), tokens >= 0.
  std::vector<TagTokens> tag_mix;
  std::optional<CalibrationTableInfo> calibration;
  // Operator policies the named rows may refer to (the live manager's).
  std::vector<PolicyInfo> policies_known;
  std::vector<CapacityWhatIf> what_ifs;
};

// One tag of a mixed row: its encoding and its tokens in the mix.
struct CapacityTagChoice {
  Tag tag;
  Encoding encoding;
  int64_t tokens = 0;
};

struct CapacitySessions {
  int64_t context_tokens = 0;
  double ideal_session_bytes = 0;
  int64_t ideal_sessions = 0;
  uint64_t page_session_bytes = 0;  // blocks, sinks and window pages
  int64_t page_sessions = 0;
};

struct CapacityTenantRow {
  std::string tenant_id;
  int64_t page_tokens = 0;
  std::vector<int64_t> page_sessions;  // per context length
};

struct CapacityRow {
  std::string label;
  std::string kind;                    // "uniform", "rules", "allocation"
  std::string encoding;                // uniform: EncodingString; mixed: "mix"
  std::vector<CapacityTagChoice> mix;  // mixed rows
  uint32_t sink_tokens = 0, window_tokens = 0;
  // Effective bits per K/V value of the pages (all metadata and padding).
  double page_bits = 0;
  double ideal_bytes_per_token = 0;
  int64_t ideal_tokens = 0;
  double page_bytes_per_token = 0;  // block bytes (frame tails included) / T
  double block_bytes = 0;           // one block, every layer
  int64_t page_tokens = 0;          // live tokens on every GPU
  int64_t host_tokens = 0;          // per worker
  int64_t disk_tokens = 0;          // per worker
  std::vector<CapacitySessions> sessions;  // per context length
  std::vector<CapacityTenantRow> tenants;
  // Allocation rows: whether the calibration table was measured on this
  // model's shape (if not, its distortions stand in for this model's).
  bool calibration_shape_matches = true;
};

struct CapacityTenantShare {
  std::string tenant_id;
  int64_t floor_bytes = 0, ceiling_bytes = 0;
  double share_bytes = 0;  // of the usable device bytes, every GPU
};

struct CapacityPlan {
  ModelShape model;
  uint32_t block_tokens = 0;
  int64_t gpu_count = 0;
  double kv_bytes = 0;      // every GPU, before the ceiling
  double usable_bytes = 0;  // every GPU, after the ceiling
  std::vector<int64_t> context_lengths;
  std::vector<CapacityRow> rows;
  std::vector<CapacityTenantShare> tenants;
  bool floors_exceed_memory = false;
  struct WhatIf {
    std::string label;
    std::vector<CapacityRow> rows;
    std::vector<CapacityTenantShare> tenants;
    int64_t gpu_count = 0;
    double usable_bytes = 0;
    bool floors_exceed_memory = false;
  };
  std::vector<WhatIf> what_ifs;
};

// See the file comment.
absl::StatusOr<CapacityPlan> PlanCapacity(const CapacityRequest& req);

// The note's bytes per token of `e` (see "idealized" above).
double IdealBytesPerToken(const Encoding& e, const ModelShape& m);

// Parses a TagLabel ("older/text/tool_schema": temporal/modality/role);
// INVALID_ARGUMENT naming `field` and the value otherwise.
absl::StatusOr<Tag> ParseTagLabel(absl::string_view field,
                                  absl::string_view label);

}  // namespace triax::manager
