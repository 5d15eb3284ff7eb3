// ManagerService::PlanCapacity (manager.proto; kvmanager/capacity.h): the
// request's wire form to a CapacityRequest, filled from the live manager
// where asked (its tenants, the tag mix of its open sequences' blocks, its
// policies, its stored calibration tables), planned, and the plan back.
// Read-only: nothing in the core changes.
#include <grpcpp/grpcpp.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "kvmanager/capacity.h"
#include "kvmanager/capacity_live.h"
#include "kvmanager/convert.h"
#include "kvmanager/manager_service.h"

namespace triax::manager {
namespace {

template <typename Msg>
EncodingSpec SpecOfWire(const Msg& m) {
  EncodingSpec e;
  e.format = FormatFromProto(m.format());
  e.format_v = FormatFromProto(m.format_v());
  e.group_size = m.group_size();
  e.scale_dtype = ClampWireEnum(m.scale_dtype());
  return e;
}

CapacityPolicySpec FromWire(const v1::CapacityPolicy& p) {
  CapacityPolicySpec d;
  d.label = p.label();
  d.encoding = SpecOfWire(p);
  d.sink_tokens = p.sink_tokens();
  d.policy = p.policy();
  d.budget_bits = p.budget_bits();
  d.objective = ClampWireEnum(p.objective());
  d.answer_weight = p.answer_weight();
  d.window_tokens = p.window_tokens();
  return d;
}

CapacityTenant FromWire(const v1::CapacityTenant& p) {
  return CapacityTenant{p.tenant_id(), p.floor_bytes(), p.ceiling_bytes()};
}

absl::StatusOr<CapacityRequest> FromWire(const v1::PlanCapacityRequest& p,
                                         const ManagerCore& core) {
  CapacityRequest d;
  d.model_preset = p.model_preset();
  if (p.has_model()) d.model = FromProto(p.model());
  if (p.has_block_tokens()) d.block_tokens = p.block_tokens();
  d.gpu_memory_bytes = p.gpu_memory_bytes();
  if (p.has_gpu_count()) d.gpu_count = p.gpu_count();
  d.reserve_bytes = p.reserve_bytes();
  if (p.has_ceiling()) d.ceiling = p.ceiling();
  d.host_bytes = p.host_bytes();
  d.disk_bytes = p.disk_bytes();
  d.frame_bytes = p.frame_bytes();
  for (const auto& x : p.policies()) d.policies.push_back(FromWire(x));
  d.context_lengths.assign(p.context_lengths().begin(),
                           p.context_lengths().end());
  for (const auto& t : p.tenants()) d.tenants.push_back(FromWire(t));
  if (p.live_tenants()) {
    for (CapacityTenant& t : LiveTenants(core)) d.tenants.push_back(t);
  }
  if (p.live_tag_mix()) {
    if (p.tag_mix_size() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("live_tag_mix=true and tag_mix (", p.tag_mix_size(),
                       " tags) are both given; give one"));
    }
    d.tag_mix = LiveTagMix(core);
  }
  for (const auto& t : p.tag_mix()) {
    d.tag_mix.push_back(TagTokens{FromProto(t.tag()), t.tokens()});
  }
  d.policies_known = core.ListPolicies();
  // The calibration table: given, named, or the one a named allocation
  // policy refers to.
  std::string model = p.calibration_model();
  if (p.has_calibration()) {
    if (!model.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "calibration (table ", Quote(p.calibration().model()),
          ") and calibration_model=", Quote(model), " are both given"));
    }
    d.calibration = FromProto(p.calibration());
  } else {
    for (const CapacityPolicySpec& row : d.policies) {
      for (const PolicyInfo& known : d.policies_known) {
        if (model.empty() && known.name == row.policy &&
            known.budget_bits > 0) {
          model = known.calibration_model;
        }
      }
    }
    if (!model.empty()) {
      auto table = core.GetCalibration(model);
      if (!table.ok()) return table.status();
      d.calibration = *std::move(table);
    }
  }
  for (const auto& w : p.what_ifs()) {
    CapacityWhatIf c;
    c.label = w.label();
    c.add_gpus = w.add_gpus();
    for (const auto& t : w.add_tenants()) c.add_tenants.push_back(FromWire(t));
    for (const auto& x : w.policies()) c.policies.push_back(FromWire(x));
    d.what_ifs.push_back(std::move(c));
  }
  return d;
}

void ToWire(const CapacityRow& d, v1::CapacityRow* p) {
  p->set_label(d.label);
  p->set_kind(d.kind);
  p->set_encoding(d.encoding);
  for (const CapacityTagChoice& c : d.mix) {
    v1::CapacityTagChoice* m = p->add_mix();
    ToProto(c.tag, m->mutable_tag());
    EncodingToProto(c.encoding, m);
    m->set_tokens(c.tokens);
  }
  p->set_sink_tokens(d.sink_tokens);
  p->set_window_tokens(d.window_tokens);
  p->set_page_bits(d.page_bits);
  p->set_ideal_bytes_per_token(d.ideal_bytes_per_token);
  p->set_ideal_tokens(d.ideal_tokens);
  p->set_page_bytes_per_token(d.page_bytes_per_token);
  p->set_block_bytes(d.block_bytes);
  p->set_page_tokens(d.page_tokens);
  p->set_host_tokens(d.host_tokens);
  p->set_disk_tokens(d.disk_tokens);
  for (const CapacitySessions& s : d.sessions) {
    v1::CapacitySessions* m = p->add_sessions();
    m->set_context_tokens(s.context_tokens);
    m->set_ideal_session_bytes(s.ideal_session_bytes);
    m->set_ideal_sessions(s.ideal_sessions);
    m->set_page_session_bytes(s.page_session_bytes);
    m->set_page_sessions(s.page_sessions);
  }
  for (const CapacityTenantRow& t : d.tenants) {
    v1::CapacityTenantRow* m = p->add_tenants();
    m->set_tenant_id(t.tenant_id);
    m->set_page_tokens(t.page_tokens);
    for (const int64_t n : t.page_sessions) m->add_page_sessions(n);
  }
  p->set_calibration_shape_matches(d.calibration_shape_matches);
}

void ToWire(const CapacityTenantShare& d, v1::CapacityTenantShare* p) {
  p->set_tenant_id(d.tenant_id);
  p->set_floor_bytes(d.floor_bytes);
  p->set_ceiling_bytes(d.ceiling_bytes);
  p->set_share_bytes(d.share_bytes);
}

void ToWire(const CapacityPlan& d, const CapacityRequest& req,
            v1::PlanCapacityResponse* p) {
  ToProto(d.model, p->mutable_model());
  p->set_block_tokens(d.block_tokens);
  p->set_gpu_count(d.gpu_count);
  p->set_kv_bytes(d.kv_bytes);
  p->set_usable_bytes(d.usable_bytes);
  for (const int64_t l : d.context_lengths) p->add_context_lengths(l);
  for (const CapacityRow& r : d.rows) ToWire(r, p->add_rows());
  for (const CapacityTenantShare& t : d.tenants) ToWire(t, p->add_tenants());
  p->set_floors_exceed_memory(d.floors_exceed_memory);
  for (const CapacityPlan::WhatIf& w : d.what_ifs) {
    v1::CapacityWhatIfResult* m = p->add_what_ifs();
    m->set_label(w.label);
    m->set_gpu_count(w.gpu_count);
    m->set_usable_bytes(w.usable_bytes);
    for (const CapacityRow& r : w.rows) ToWire(r, m->add_rows());
    for (const CapacityTenantShare& t : w.tenants) ToWire(t, m->add_tenants());
    m->set_floors_exceed_memory(w.floors_exceed_memory);
  }
  for (const TagTokens& t : req.tag_mix) {
    v1::CapacityTagTokens* m = p->add_tag_mix();
    ToProto(t.tag, m->mutable_tag());
    m->set_tokens(t.tokens);
  }
  if (req.calibration.has_value()) {
    p->set_calibration_model(req.calibration->model);
  }
}

}  // namespace

grpc::ServerUnaryReactor* ManagerService::PlanCapacity(
    grpc::CallbackServerContext* ctx, const v1::PlanCapacityRequest* req,
    v1::PlanCapacityResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status status = [&]() -> absl::Status {
    // An operator's tool: it reads every tenant's budgets and blocks.
    if (absl::Status denied = auth_.Admin(*ctx, "PlanCapacity"); !denied.ok()) {
      return denied;
    }
    absl::StatusOr<CapacityRequest> d = FromWire(*req, *core_);
    if (!d.ok()) return d.status();
    absl::StatusOr<CapacityPlan> plan = ::triax::manager::PlanCapacity(*d);
    if (!plan.ok()) return plan.status();
    ToWire(*plan, *d, resp);
    return absl::OkStatus();
  }();
  FinishDurable(core_, reactor, ToGrpcStatus(status));
  return reactor;
}

}  // namespace triax::manager
