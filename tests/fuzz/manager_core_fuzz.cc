// Fuzz target: the manager core's request handling. Each input is a list of
// records (fuzz_util.h) whose payloads are wire requests of the Manager
// service; they are parsed, converted (kvmanager/convert.h, as the service
// does) and applied to a fresh ManagerCore on a FakeClock with one worker
// "w1" (1 GiB, host and disk tiers) and one tenant "acme". The two-phase
// calls are finished the way the service finishes them when the worker
// succeeds (DemoteBlocks, Extend demotions, tier plans, transfers), so that
// commits run too. Selectors (mod kOps):
//   0 OpenSequence      1 ExtendSequence    2 ForkSequence
//   3 CloseSequence     4 TruncateSequence  5 PutPolicy
//   6 PutCalibration    7 DemoteBlocks      8 ReportAccess
//   9 SetBudget        10 CreateTenant     11 Heartbeat
//  12 RegisterWorker   13 clock + CheckWorkers (payload: u16 seconds)
//  14 pressure round   15 TransferSequence (commit or abort by payload)
// After every call the sequences the core lists are read back whole.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "kvmanager/convert.h"
#include "kvmanager/manager_core.h"
#include "tests/fuzz/fuzz_util.h"
#include "triax/v1/manager.pb.h"

namespace triax::manager {
namespace {

using fuzz::FuzzCheck;

constexpr int kOps = 16;

template <typename Proto>
bool Parse(absl::string_view payload, Proto* p) {
  return p->ParseFromArray(payload.data(), static_cast<int>(payload.size()));
}

void FinishPlan(ManagerCore& core, const TierPlan& plan) {
  if (plan.token == 0) return;
  std::vector<absl::Status> ok(plan.commands.size());
  FuzzCheck(core.FinishTierPlan(plan.token, ok), "FinishTierPlan");
}

void Apply(ManagerCore& core, FakeClock& clock, uint8_t op,
           absl::string_view payload) {
  switch (op % kOps) {
    case 0: {
      v1::OpenSequenceRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.OpenSequence(FromProto(p)), "OpenSequence");
      return;
    }
    case 1: {
      v1::ExtendSequenceRequest p;
      if (!Parse(payload, &p)) return;
      auto r = core.ExtendSequence(FromProto(p));
      FuzzCheck(r, "ExtendSequence");
      if (r.ok() && r->demotion.has_value()) {
        FuzzCheck(
            core.FinishExtendDemotion(r->demotion->token, absl::OkStatus()),
            "FinishExtendDemotion");
      }
      return;
    }
    case 2: {
      v1::ForkSequenceRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.ForkSequence(FromProto(p)), "ForkSequence");
      return;
    }
    case 3: {
      v1::CloseSequenceRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.CloseSequence(FromProto(p)), "CloseSequence");
      return;
    }
    case 4: {
      v1::TruncateSequenceRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.TruncateSequence(FromProto(p)), "TruncateSequence");
      return;
    }
    case 5: {
      v1::PutPolicyRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.PutPolicy(FromProto(p)), "PutPolicy");
      return;
    }
    case 6: {
      v1::PutCalibrationRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.PutCalibration(FromProto(p)), "PutCalibration");
      return;
    }
    case 7: {
      v1::DemoteBlocksRequest p;
      if (!Parse(payload, &p)) return;
      auto prepared = core.PrepareDemote(FromProto(p));
      FuzzCheck(prepared, "PrepareDemote");
      if (prepared.ok() && !prepared->done.has_value()) {
        FuzzCheck(core.CommitDemote(prepared->token), "CommitDemote");
      }
      return;
    }
    case 8: {
      v1::ReportAccessRequest p;
      if (!Parse(payload, &p)) return;
      auto plan = core.ReportAccess(FromProto(p));
      FuzzCheck(plan, "ReportAccess");
      if (plan.ok()) FinishPlan(core, *plan);
      return;
    }
    case 9: {
      v1::SetBudgetRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.SetBudget(FromProto(p)), "SetBudget");
      return;
    }
    case 10: {
      v1::CreateTenantRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.CreateTenant(FromProto(p)), "CreateTenant");
      return;
    }
    case 11: {
      v1::HeartbeatRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Heartbeat(p.worker_id(), FromProto(p.inventory()),
                               p.incarnation()),
                "Heartbeat");
      return;
    }
    case 12: {
      v1::RegisterWorkerRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.RegisterWorker(FromProto(p)), "RegisterWorker");
      return;
    }
    case 13: {
      const uint32_t s = payload.size() >= 2
                             ? (static_cast<uint8_t>(payload[0]) |
                                static_cast<uint8_t>(payload[1]) << 8)
                             : 1;
      clock.AdvanceMs(int64_t{s} * 1000);
      core.CheckWorkers();
      return;
    }
    case 14: {
      core.RefreshRanking();
      FinishPlan(core, core.PlanPressure());
      return;
    }
    case 15: {
      v1::TransferSequenceRequest p;
      if (payload.empty() || !Parse(payload.substr(1), &p)) return;
      auto prepared = core.PrepareTransfer(FromProto(p));
      FuzzCheck(prepared, "PrepareTransfer");
      if (!prepared.ok() || prepared->done.has_value()) return;
      if (payload[0] & 1) {
        core.AbortTransfer(prepared->token,
                           absl::UnavailableError("fuzz: destination failed"));
      } else {
        FuzzCheck(core.CommitTransfer(prepared->token, {}), "CommitTransfer");
      }
      return;
    }
  }
}

void ReadBack(const ManagerCore& core) {
  auto list = core.ListSequences("", /*include_closed=*/true);
  FuzzCheck(list, "ListSequences");
  if (!list.ok()) return;
  for (const SequenceInfo& s : *list) {
    auto got = core.GetSequence("", s.sequence_id);
    FuzzCheck(got, "GetSequence");
    if (!got.ok()) continue;
    v1::SequenceInfo wire;
    ToProto(*got, &wire);
  }
}

}  // namespace
}  // namespace triax::manager

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace triax::manager;  // NOLINT(google-build-using-namespace)
  triax::FakeClock clock;
  ManagerOptions options;
  options.event_retention = 4096;
  auto core = ManagerCore::Create(options, &clock);
  if (!core.ok()) triax::fuzz::FuzzFail("Create", core.status(), "setup");
  RegisterWorkerRequest w;
  w.worker_id = "w1";
  w.address = "127.0.0.1:9001";
  w.backend = "cpu";
  w.capacity_bytes = uint64_t{1} << 30;
  w.host_capacity_bytes = uint64_t{1} << 28;
  w.disk_capacity_bytes = uint64_t{1} << 28;
  w.incarnation = "fuzz-1";
  if (auto r = (*core)->RegisterWorker(w); !r.ok()) {
    triax::fuzz::FuzzFail("RegisterWorker", r.status(), "setup");
  }
  CreateTenantRequest t;
  t.tenant_id = "acme";
  if (auto r = (*core)->CreateTenant(t); !r.ok()) {
    triax::fuzz::FuzzFail("CreateTenant", r.status(), "setup");
  }
  triax::fuzz::Records records(data, size);
  uint8_t op = 0;
  absl::string_view payload;
  int calls = 0;
  // A bound on calls keeps one input's run short (each may rank every block).
  while (calls++ < 64 && records.Next(&op, &payload)) {
    Apply(**core, clock, op, payload);
    ReadBack(**core);
  }
  return 0;
}
