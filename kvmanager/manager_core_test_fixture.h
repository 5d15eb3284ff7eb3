// Test support for the ManagerCore scenario tests (manager_core_test,
// manager_core_demote_test): a core on a FakeClock with one worker "w1"
// (1 TiB) and one tenant "acme". Model shape used throughout: 2 layers, 2 KV
// heads, head_dim 64, T = 16, so a block costs 2 * PageBytes(encoding,
// {16, 2, 64}): BF16 16384, INT4 5632, INT2 3584 bytes. Include from one
// test file per binary.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/status_matchers.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

constexpr uint64_t kBf16 = 16384;
constexpr uint64_t kInt4 = 5632;
constexpr uint64_t kInt2 = 3584;

inline ModelShape Model() { return ModelShape{"test", 2, 2, 4, 64}; }
inline Span S(Role r, uint32_t n, Modality m = Modality::kText) {
  return Span{r, m, n};
}

class CoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(ManagerOptions{}); }

  void Make(const ManagerOptions& options) {
    auto core = ManagerCore::Create(options, &clock_);
    ASSERT_THAT(core, ::triax::testing::IsOk());
    core_ = std::move(*core);
    ASSERT_THAT(
        core_->RegisterWorker({"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40}),
        ::triax::testing::IsOk());
    ASSERT_THAT(core_->CreateTenant({"", "acme", {}, ""}),
                ::triax::testing::IsOk());
  }

  absl::StatusOr<SequenceInfo> Open(std::vector<Span> spans,
                                    const std::string& tenant = "acme",
                                    const std::string& policy = "") {
    OpenSequenceRequest req;
    req.tenant_id = tenant;
    req.model = Model();
    req.spans = std::move(spans);
    req.policy = policy;
    return core_->OpenSequence(req);
  }

  absl::StatusOr<ExtendSequenceResult> Extend(const std::string& seq,
                                              std::vector<Span> spans,
                                              bool new_turn,
                                              bool cont = false) {
    ExtendSequenceRequest req;
    req.tenant_id = "acme";
    req.sequence_id = seq;
    req.spans = std::move(spans);
    req.new_turn = new_turn;
    req.continue_last_span = cont;
    return core_->ExtendSequence(req);
  }

  uint64_t DeviceUsage(const std::string& tenant = "acme") {
    auto t = core_->GetTenant(tenant);
    EXPECT_THAT(t, ::triax::testing::IsOk());
    return t->usage[0].used_bytes;  // usage[0] is TIER_DEVICE
  }

  std::vector<Event> AllEvents() {
    return core_->events().Retained(1, EventFilter{});
  }
  size_t CountKind(EventKind k, const std::string& seq = "") {
    size_t n = 0;
    for (const Event& e : AllEvents()) {
      if (e.kind == k && (seq.empty() || e.sequence_id == seq)) ++n;
    }
    return n;
  }

  FakeClock clock_;
  std::unique_ptr<ManagerCore> core_;
};

inline std::vector<Temporal> Temporals(const SequenceInfo& s) {
  std::vector<Temporal> out;
  for (const auto& b : s.blocks) out.push_back(b.tag.temporal);
  return out;
}

inline uint64_t Bytes(const Encoding& e) {
  return 2 * kernels::PageBytes(e, kernels::PageShape{16, 2, 64});
}

}  // namespace triax::manager
