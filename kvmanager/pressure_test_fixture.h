// Test support for the memory-pressure scenarios through the ManagerCore
// facade (manager_core_pressure_test, reclaim_round_test): a core on a
// FakeClock with one worker "w1" that is only a registry entry (the test
// plays the worker and reports each tier command's outcome to
// FinishTierPlan). Model: 2 layers, 2 KV heads, head_dim 64, T = 16: a BF16
// block is 16384 bytes. Sequences are "system 16 + user 128" (9 blocks);
// with the default window guard of 64 tokens the first 5 blocks (80 tokens)
// are rankable. Include from one test file per binary.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>

#include "common/clock.h"
#include "common/status_matchers.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

constexpr uint64_t kBf16 = 16384;

inline ModelShape Model() { return ModelShape{"test", 2, 2, 4, 64}; }

class PressureFixture : public ::testing::Test {
 protected:
  // A worker with room for `blocks` BF16 blocks and spill tiers of
  // `host_blocks` and `disk_blocks`.
  void Make(const ManagerOptions& options, uint64_t blocks,
            uint64_t host_blocks = 0, uint64_t disk_blocks = 0) {
    auto core = ManagerCore::Create(options, &clock_);
    ASSERT_THAT(core, ::triax::testing::IsOk());
    core_ = std::move(*core);
    RegisterWorkerRequest reg;
    reg.worker_id = "w1";
    reg.address = "127.0.0.1:9001";
    reg.backend = "cpu";
    reg.capacity_bytes = blocks * kBf16;
    reg.host_capacity_bytes = host_blocks * kBf16;
    reg.disk_capacity_bytes = disk_blocks * kBf16;
    ASSERT_THAT(core_->RegisterWorker(reg), ::triax::testing::IsOk());
  }

  // A tenant with the bf16 policy and, when `ceiling` > 0, a device budget.
  void Tenant(const std::string& id, uint64_t floor = 0, uint64_t ceiling = 0) {
    CreateTenantRequest req;
    req.tenant_id = id;
    if (ceiling > 0) req.budgets.push_back({Tier::kDevice, floor, ceiling});
    req.default_policy = "bf16";
    ASSERT_THAT(core_->CreateTenant(req), ::triax::testing::IsOk());
  }

  absl::StatusOr<SequenceInfo> Open(const std::string& tenant,
                                    AdmissionShortfall* sf = nullptr,
                                    uint32_t user_tokens = 128) {
    OpenSequenceRequest req;
    req.tenant_id = tenant;
    req.model = Model();
    req.spans = {Span{Role::kSystem, Modality::kText, 16}};
    if (user_tokens > 0) {
      req.spans.push_back(Span{Role::kUser, Modality::kText, user_tokens});
    }
    return core_->OpenSequence(req, sf);
  }

  // Tenant "t" and three 9-block sequences: seq-1 idle for 10 minutes
  // (ranked coldest), then seq-2 and seq-3.
  void OneIdleTwoBusy() {
    Tenant("t");
    ASSERT_THAT(Open("t"), ::triax::testing::IsOk());
    clock_.AdvanceMs(int64_t{10} * 60 * 1000);
    ASSERT_THAT(Open("t"), ::triax::testing::IsOk());
    ASSERT_THAT(Open("t"), ::triax::testing::IsOk());
  }

  uint64_t Used(const std::string& tenant, Tier tier) {
    auto t = core_->GetTenant(tenant);
    EXPECT_THAT(t, ::triax::testing::IsOk());
    for (const TierUsage& u : t->usage) {
      if (u.tier == tier) return u.used_bytes;
    }
    return 0;
  }
  uint64_t Reserved() { return core_->ListWorkers()[0].reserved_bytes; }

  FakeClock clock_;
  std::unique_ptr<ManagerCore> core_;
};

}  // namespace triax::manager
