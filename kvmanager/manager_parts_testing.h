// Test support for the unit tests of ManagerCore's parts: the parts wired
// the way ManagerCore wires them, on a FakeClock, and helpers that make the
// records a test needs through the parts' own interfaces (no ManagerCore,
// no events). Model: 2 layers, 2 KV heads, head_dim 64, T = 16, so a BF16
// block is 16384 bytes, INT8 9728, FP8 8256, INT4 5632, INT2 3584.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "kvmanager/calibration_store.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/policy.h"
#include "kvmanager/sequence_table.h"
#include "kvmanager/tenant_ledger.h"
#include "kvmanager/types.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {

inline ModelShape PartsModel() { return ModelShape{"test", 2, 2, 4, 64}; }

inline uint64_t PartsBytes(const Encoding& e) {
  return BlockBytes(PartsModel(), 16, e);
}

struct PartsWorld {
  FakeClock clock;
  WorkerRegistry workers;
  TenantLedger tenants;
  CalibrationStore calibrations;
  SequenceTable sequences{/*closed_retention=*/100};
  uint64_t next_token = 1;

  WorkerRecord* AddWorker(const std::string& id, uint64_t capacity,
                          uint64_t host = 0, uint64_t disk = 0) {
    RegisterWorkerRequest req;
    req.worker_id = id;
    req.address = "127.0.0.1:" + std::to_string(9000 + workers.all().size());
    req.backend = "cpu";
    req.capacity_bytes = capacity;
    req.host_capacity_bytes = host;
    req.disk_capacity_bytes = disk;
    return workers.Register(req, clock.NowMs());
  }

  // ceiling 0: no device budget.
  TenantRecord* AddTenant(const std::string& id, uint64_t ceiling = 0,
                          uint64_t floor = 0) {
    TenantLedger::Budgets budgets;
    if (ceiling > 0) {
      budgets[static_cast<int>(Tier::kDevice)] =
          Budget{Tier::kDevice, floor, ceiling};
    }
    auto t = tenants.Create(id, budgets, kDefaultPolicy);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : nullptr;
  }

  // An open sequence of one full block per role (all turn 0, the first a
  // SINK), under built-in `policy`, charged like ManagerCore's Open.
  SequenceRecord* AddSequence(TenantRecord* t, WorkerRecord* w,
                              const std::vector<Role>& roles,
                              const std::string& policy = "bf16",
                              uint32_t tokens_per_block = 16) {
    auto seq = std::make_unique<SequenceRecord>();
    SequenceRecord* s = seq.get();
    s->id = sequences.NewId();
    s->tenant = t;
    s->worker = w;
    s->model = PartsModel();
    s->block_tokens = 16;
    s->policy = FindBuiltinPolicy(policy);
    s->turn_start.push_back(0);
    s->last_access_ms = clock.NowMs();
    for (Role r : roles) {
      const uint32_t index = static_cast<uint32_t>(s->blocks.size());
      const Tag tag{TemporalFor(index, 0, 0, 2), Modality::kText, r};
      const Encoding e = s->policy->EncodingFor(tag);
      sequences.NewBlock(s, s->num_tokens, tokens_per_block, tag, e, 0,
                         BlockBytes(s->model, s->block_tokens, e));
      s->num_tokens += tokens_per_block;
    }
    t->open_sequences++;
    w->open.insert(s);
    return sequences.Insert(std::move(seq));
  }

  // Moves a device block of `s` to a spill tier in the accounting, as a
  // finished spill does.
  static void Spill(SequenceRecord* s, BlockRecord* b, Tier to) {
    const int dev = static_cast<int>(Tier::kDevice);
    const int t = static_cast<int>(to);
    b->charged->used[dev] -= b->bytes;
    b->charged->used[t] += b->bytes;
    b->worker->reserved -= b->bytes;
    b->worker->tier_used[t] += b->bytes;
    s->bytes -= b->bytes;
    ++s->spilled;
    b->tier = to;
  }
};

}  // namespace triax::manager
