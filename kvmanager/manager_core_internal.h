// Private state records of ManagerCore, shared by its translation units
// (manager_core.cc, manager_pressure.cc). Not part of the API.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

struct ManagerCore::Tenant {
  std::string id;
  std::array<std::optional<Budget>, kNumTiers> budgets;
  std::array<uint64_t, kNumTiers> used{};
  uint32_t open_sequences = 0;
  std::string default_policy;
};

struct ManagerCore::Worker {
  WorkerInfo info;        // reserved_bytes and sequences are kept below
  uint64_t reserved = 0;  // device pool bytes planned onto it
  // Spill-tier bytes held (index: Tier value; kDevice unused, see reserved).
  std::array<uint64_t, kNumTiers> tier_used{};
  absl::flat_hash_set<Sequence*> open;
};

struct ManagerCore::Block {
  uint32_t index = 0;
  uint64_t lineage_id = 0;
  uint64_t first_token = 0;
  uint32_t num_tokens = 0;
  uint32_t capacity = 0;
  Tag tag;
  Encoding encoding;
  uint32_t refcount = 0;
  uint32_t turn = 0;
  uint64_t bytes = 0;
  Tenant* charged = nullptr;
  Worker* worker = nullptr;
  std::string creator;
  // Memory pressure: where the pages are (bytes are charged to this tier of
  // the tenant and the worker), whether the block was evicted (then nothing
  // is charged), and the tier plan (TierPlan token) acting on it, if any.
  Tier tier = Tier::kDevice;
  bool evicted = false;
  uint64_t busy = 0;
  // The sequence holding it while refcount == 1 (the creator, or the fork
  // that kept it after the others released it).
  Sequence* owner = nullptr;
};

struct ManagerCore::Sequence {
  std::string id;
  Tenant* tenant = nullptr;
  Worker* worker = nullptr;
  ModelShape model;
  SequenceState state = SequenceState::kOpen;
  uint32_t block_tokens = 0;
  uint64_t num_tokens = 0;
  uint32_t current_turn = 0;
  std::shared_ptr<const Policy> policy;
  std::string parent;
  std::vector<Block*> blocks;
  std::vector<uint32_t> turn_start;  // first block index of each turn
  uint64_t bytes = 0;                // sum of its blocks' bytes
  uint64_t version = 0;              // bumped by every mutation
  std::vector<uint64_t> lost_lineage_ids;
  // Allocation policies: the calibration table version of Open and the
  // current choice per tag (every tag of the sequence's blocks).
  std::shared_ptr<const Calibration> calibration;
  Allocation allocation;
  // Memory pressure: last use (Open, Extend, ReportAccess), blocks not on the
  // device, and the newest tool-call block (tool call -> result edges).
  int64_t last_access_ms = 0;
  uint32_t spilled = 0;
  uint64_t last_tool_call = 0;
};

struct ManagerCore::Calibration {
  CalibrationTableInfo info;        // entries canonical, source as given
  std::vector<Encoding> encodings;  // entries' resolved encodings
};

struct ManagerCore::PendingDemote {
  std::string tenant_id;
  std::string request_id;
  std::string sequence_id;
  uint64_t version = 0;  // the sequence's version at prepare
  std::string worker_id;
  // lineage id -> new canonical encoding and its bytes (changing blocks only)
  std::vector<std::pair<uint64_t, Encoding>> changes;
  std::vector<uint64_t> new_bytes;
  int64_t bytes_delta = 0;
  uint64_t reserved = 0;  // max(bytes_delta, 0), charged at prepare
  // Set when the demote was started by an Extend (FinishExtendDemotion).
  bool from_extend = false;
  std::string extend_request_id;
  ExtendSequenceResult extend_result;  // the reply without demoted blocks
};

// A tier plan in flight (PlanPressure / PlanAdmission / ReportAccess).
struct ManagerCore::PendingTier {
  struct Item {
    uint64_t lineage_id = 0;
    uint64_t from_bytes = 0;  // the block's bytes at planning time
    Tier from = Tier::kDevice;
    Tier to = Tier::kDevice;  // kSpill / kRestore destination
    Encoding encoding;        // kDemote: the new encoding
    uint64_t to_bytes = 0;    // kDemote: new bytes
    uint64_t reserved = 0;    // destination bytes reserved at planning
  };
  struct Command {
    TierCommand::Kind kind;
    std::string worker_id;
    std::string tenant_id;
    std::string sequence_id;
    std::vector<Item> items;
  };
  std::vector<Command> commands;
};

}  // namespace triax::manager
