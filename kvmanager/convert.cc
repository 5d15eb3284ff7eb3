#include "kvmanager/convert.h"

#include "common/proto_fingerprint.h"
#include "kvmanager/policy.h"

namespace triax::manager {
namespace {

EncodingSpec SpecFromWire(int format, int format_v, uint32_t group_size,
                          int scale_dtype) {
  EncodingSpec e;
  e.format = FormatFromProto(format);
  e.format_v = FormatFromProto(format_v);
  e.group_size = group_size;
  e.scale_dtype = scale_dtype;
  return e;
}

// Sets the encoding fields of a BlockPlan / PolicyRule / BlockEncoding.
template <typename P>
void SetEncoding(const EncodingSpec& s, P* p) {
  p->set_format(static_cast<v1::Format>(s.format));
  p->set_format_v(static_cast<v1::Format>(s.format_v));
  p->set_group_size(s.group_size);
  p->set_scale_dtype(static_cast<v1::ScaleDtype>(s.scale_dtype));
}

}  // namespace

RegisterWorkerRequest FromProto(const v1::RegisterWorkerRequest& p) {
  RegisterWorkerRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.worker_id = p.worker_id();
  d.address = p.address();
  d.backend = p.backend();
  d.capacity_bytes = p.capacity_bytes();
  d.host_capacity_bytes = p.host_capacity_bytes();
  d.disk_capacity_bytes = p.disk_capacity_bytes();
  d.incarnation = p.incarnation();
  d.inventory = FromProto(p.inventory());
  return d;
}

Inventory FromProto(const v1::Inventory& p) {
  Inventory d;
  for (const v1::DescribedSequence& ds : p.described()) {
    Inventory::Described out;
    out.sequence_id = ds.sequence_id();
    for (const v1::BlockPlan& b : ds.blocks()) {
      out.blocks.push_back(FromProto(b));
    }
    d.described.push_back(std::move(out));
  }
  d.capacity_bytes = p.capacity_bytes();
  d.used_bytes = p.used_bytes();
  d.window_bytes = p.window_bytes();
  d.formats.reserve(p.formats_size());
  for (const auto& f : p.formats()) {
    d.formats.push_back(FormatInventory{FormatFromProto(f.format()),
                                        f.pages_used(), f.bytes_used()});
  }
  d.sequence_ids.assign(p.sequence_ids().begin(), p.sequence_ids().end());
  for (const auto& t : p.tiers()) {
    d.tiers.push_back(TierInventory{static_cast<Tier>(t.tier()),
                                    t.capacity_bytes(), t.used_bytes(),
                                    t.blocks()});
  }
  d.spills = p.spills();
  d.restores = p.restores();
  d.checksum_failures = p.checksum_failures();
  d.evictions = p.evictions();
  d.restored_lineage_ids.assign(p.restored_lineage_ids().begin(),
                                p.restored_lineage_ids().end());
  for (const v1::SealedBlock& b : p.sealed_blocks()) {
    d.sealed_blocks.emplace_back(b.lineage_id(), b.unix_ms());
  }
  d.device_error = p.device_error();
  d.frame_bytes = p.frame_bytes();
  d.frames = p.frames();
  d.free_frames = p.free_frames();
  d.free_frames_compacted = p.free_frames_compacted();
  d.free_bytes = p.free_bytes();
  d.tail_bytes = p.tail_bytes();
  d.fragmentation = p.fragmentation();
  d.pools.reserve(p.pools_size());
  for (const auto& q : p.pools()) {
    PoolInventory pool;
    pool.encoding.k = FormatFromProto(q.format());
    pool.encoding.v =
        q.format_v() == 0 ? pool.encoding.k : FormatFromProto(q.format_v());
    pool.encoding.group = static_cast<int>(q.group_size());
    pool.encoding.scale_dtype = q.scale_dtype() == v1::SCALE_DTYPE_FP8_E4M3
                                    ? kernels::ScaleDtype::kFP8
                                    : kernels::ScaleDtype::kFP16;
    pool.page_bytes = q.page_bytes();
    pool.pages_per_frame = q.pages_per_frame();
    pool.frames = q.frames();
    pool.pages_used = q.pages_used();
    pool.free_slots = q.free_slots();
    pool.allocatable_pages = q.allocatable_pages();
    pool.free_slots_compacted = q.free_slots_compacted();
    d.pools.push_back(pool);
  }
  d.compactions = p.compactions();
  d.pages_moved = p.pages_moved();
  d.bytes_moved = p.bytes_moved();
  d.frames_freed_by_compaction = p.frames_freed_by_compaction();
  return d;
}

ReportAccessRequest FromProto(const v1::ReportAccessRequest& p) {
  ReportAccessRequest d;
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.lineage_ids.assign(p.lineage_ids().begin(), p.lineage_ids().end());
  d.weights.assign(p.weights().begin(), p.weights().end());
  d.active = p.active();
  return d;
}

Budget FromProto(const v1::Budget& p) {
  return Budget{static_cast<Tier>(p.tier()), p.floor_bytes(),
                p.ceiling_bytes()};
}

CreateTenantRequest FromProto(const v1::CreateTenantRequest& p) {
  CreateTenantRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  for (const auto& b : p.budgets()) d.budgets.push_back(FromProto(b));
  d.default_policy = p.default_policy();
  d.prefix_salt = p.prefix_salt();
  return d;
}

SetBudgetRequest FromProto(const v1::SetBudgetRequest& p) {
  SetBudgetRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.budget = FromProto(p.budget());
  return d;
}

Span FromProto(const v1::Span& p) {
  return Span{static_cast<Role>(p.role()), static_cast<Modality>(p.modality()),
              p.num_tokens()};
}

RenderedText FromProto(const v1::RenderedText& p) {
  RenderedText d;
  d.text = p.text();
  d.chat_template = static_cast<ChatTemplate>(p.chat_template());
  d.token_offsets.assign(p.token_offsets().begin(), p.token_offsets().end());
  d.bos_tokens = p.bos_tokens();
  d.continues = static_cast<Role>(p.continues());
  return d;
}

OpenSequenceRequest FromProto(const v1::OpenSequenceRequest& p) {
  OpenSequenceRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.model = FromProto(p.model());
  d.spans.reserve(p.spans_size());
  for (const auto& s : p.spans()) d.spans.push_back(FromProto(s));
  d.block_tokens = p.block_tokens();
  d.policy = p.policy();
  if (p.has_rendered()) d.rendered = FromProto(p.rendered());
  if (p.has_window_tokens()) d.window_tokens = p.window_tokens();
  d.worker_id = p.worker_id();
  d.token_ids.assign(p.token_ids().begin(), p.token_ids().end());
  d.block_hashes.assign(p.block_hashes().begin(), p.block_hashes().end());
  d.no_reuse = p.no_reuse();
  return d;
}

ExtendSequenceRequest FromProto(const v1::ExtendSequenceRequest& p) {
  ExtendSequenceRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.spans.reserve(p.spans_size());
  for (const auto& s : p.spans()) d.spans.push_back(FromProto(s));
  d.new_turn = p.new_turn();
  d.continue_last_span = p.continue_last_span();
  if (p.has_rendered()) d.rendered = FromProto(p.rendered());
  d.token_ids.assign(p.token_ids().begin(), p.token_ids().end());
  return d;
}

ForkSequenceRequest FromProto(const v1::ForkSequenceRequest& p) {
  ForkSequenceRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.parent_sequence_id = p.parent_sequence_id();
  d.num_tokens = p.num_tokens();
  return d;
}

CloseSequenceRequest FromProto(const v1::CloseSequenceRequest& p) {
  CloseSequenceRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  return d;
}

TruncateSequenceRequest FromProto(const v1::TruncateSequenceRequest& p) {
  TruncateSequenceRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.num_tokens = p.num_tokens();
  return d;
}

EventFilter FromProto(const v1::WatchEventsRequest& p) {
  EventFilter f;
  f.tenant_id = p.tenant_id();
  f.sequence_id = p.sequence_id();
  f.lineage_id = p.lineage_id();
  return f;
}

void ToProto(const BlockPlan& d, v1::BlockPlan* p) {
  ToProto(static_cast<const BlockSpec&>(d), p);
  p->set_capacity(d.capacity);
  ToProto(d.tag, p->mutable_tag());
  p->set_refcount(d.refcount);
}

PolicyInfo FromProto(const v1::Policy& p) {
  PolicyInfo d;
  d.name = p.name();
  d.rules.reserve(p.rules_size());
  for (const auto& r : p.rules()) {
    PolicyRuleInfo ri;
    ri.temporal = static_cast<Temporal>(r.temporal());
    ri.role = static_cast<Role>(r.role());
    ri.modality = static_cast<Modality>(r.modality());
    ri.encoding =
        SpecFromWire(r.format(), r.format_v(), r.group_size(), r.scale_dtype());
    d.rules.push_back(ri);
  }
  d.budget_bits = p.budget_bits();
  d.calibration_model = p.calibration_model();
  d.answer_weight = p.answer_weight();
  d.objective = static_cast<int>(p.objective());
  d.candidates.reserve(p.candidates_size());
  for (const auto& r : p.candidates()) {
    d.candidates.push_back(SpecFromWire(r.format(), r.format_v(),
                                        r.group_size(), r.scale_dtype()));
  }
  return d;
}

CalibrationTableInfo FromProto(const v1::CalibrationTable& p) {
  CalibrationTableInfo d;
  d.model = p.model();
  d.shape = FromProto(p.shape());
  d.block_tokens = p.block_tokens();
  d.entries.reserve(p.entries_size());
  for (const auto& e : p.entries()) {
    CalibrationEntryInfo de;
    de.tag.temporal = static_cast<Temporal>(e.tag().temporal());
    de.tag.modality = static_cast<Modality>(e.tag().modality());
    de.tag.role = static_cast<Role>(e.tag().role());
    de.encoding =
        SpecFromWire(e.format(), e.format_v(), e.group_size(), e.scale_dtype());
    de.distortion = e.distortion();
    de.tokens = e.tokens();
    de.queries = e.queries();
    de.distortion_answer = e.distortion_answer();
    de.dnll = e.dnll();
    de.dnll_answer = e.dnll_answer();
    d.entries.push_back(de);
  }
  const auto& s = p.source();
  d.source.tool = s.tool();
  d.source.model_file = s.model_file();
  d.source.dataset = s.dataset();
  d.source.calibration_ids.assign(s.calibration_ids().begin(),
                                  s.calibration_ids().end());
  d.source.held_out_ids.assign(s.held_out_ids().begin(),
                               s.held_out_ids().end());
  d.source.metric = s.metric();
  d.source.created_unix_ms = s.created_unix_ms();
  return d;
}

PutCalibrationRequest FromProto(const v1::PutCalibrationRequest& p) {
  PutCalibrationRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.table = FromProto(p.table());
  return d;
}

void ToProto(const CalibrationTableInfo& d, v1::CalibrationTable* p) {
  p->set_model(d.model);
  ToProto(d.shape, p->mutable_shape());
  p->set_block_tokens(d.block_tokens);
  for (const CalibrationEntryInfo& e : d.entries) {
    auto* pe = p->add_entries();
    ToProto(e.tag, pe->mutable_tag());
    SetEncoding(e.encoding, pe);
    pe->set_distortion(e.distortion);
    pe->set_tokens(e.tokens);
    pe->set_queries(e.queries);
    pe->set_distortion_answer(e.distortion_answer);
    pe->set_dnll(e.dnll);
    pe->set_dnll_answer(e.dnll_answer);
  }
  auto* s = p->mutable_source();
  s->set_tool(d.source.tool);
  s->set_model_file(d.source.model_file);
  s->set_dataset(d.source.dataset);
  for (const auto& id : d.source.calibration_ids) s->add_calibration_ids(id);
  for (const auto& id : d.source.held_out_ids) s->add_held_out_ids(id);
  s->set_metric(d.source.metric);
  s->set_created_unix_ms(d.source.created_unix_ms);
}

PutPolicyRequest FromProto(const v1::PutPolicyRequest& p) {
  PutPolicyRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.policy = FromProto(p.policy());
  return d;
}

DemoteBlocksRequest FromProto(const v1::DemoteBlocksRequest& p) {
  DemoteBlocksRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.blocks.reserve(p.blocks_size());
  for (const auto& b : p.blocks()) {
    d.blocks.push_back(BlockEncoding{
        b.lineage_id(), SpecFromWire(b.format(), b.format_v(), b.group_size(),
                                     b.scale_dtype())});
  }
  return d;
}

void ToProto(const PolicyInfo& d, v1::Policy* p) {
  p->set_name(d.name);
  p->set_builtin(d.builtin);
  for (const PolicyRuleInfo& r : d.rules) {
    auto* pr = p->add_rules();
    pr->set_temporal(static_cast<v1::Temporal>(r.temporal));
    pr->set_role(static_cast<v1::Role>(r.role));
    pr->set_modality(static_cast<v1::Modality>(r.modality));
    SetEncoding(r.encoding, pr);
  }
  p->set_budget_bits(d.budget_bits);
  p->set_calibration_model(d.calibration_model);
  p->set_answer_weight(d.answer_weight);
  p->set_objective(static_cast<v1::Objective>(d.objective));
  for (const EncodingSpec& e : d.candidates)
    SetEncoding(e, p->add_candidates());
}

void ToProto(const DemoteBlocksResult& d, v1::DemoteBlocksResponse* p) {
  ToProto(d.sequence, p->mutable_sequence());
  p->set_bytes_delta(d.bytes_delta);
}

void ToProto(const DemotePrepared& d, v1::DemoteRequest* p) {
  p->set_request_id(d.worker_request_id);
  p->set_tenant_id(d.tenant_id);
  p->set_sequence_id(d.sequence_id);
  for (const BlockPlan& b : d.blocks) ToProto(b, p->add_blocks());
}

void ToProto(const Budget& d, v1::Budget* p) {
  p->set_tier(static_cast<v1::Tier>(d.tier));
  p->set_floor_bytes(d.floor_bytes);
  p->set_ceiling_bytes(d.ceiling_bytes);
}

void ToProto(const TokenRecord& d, v1::TokenInfo* p) {
  p->set_token_id(d.id);
  p->set_role(RoleName(d.role));
  p->set_tenant_id(d.tenant_id);
  p->set_description(d.description);
  p->set_created_unix_ms(d.created_ms);
  p->set_expires_unix_ms(d.expires_ms);
}

void ToProto(const TenantInfo& d, v1::TenantInfo* p) {
  p->set_tenant_id(d.tenant_id);
  for (const Budget& b : d.budgets) ToProto(b, p->add_budgets());
  for (const TierUsage& u : d.usage) {
    auto* pu = p->add_usage();
    pu->set_tier(static_cast<v1::Tier>(u.tier));
    pu->set_used_bytes(u.used_bytes);
  }
  p->set_open_sequences(d.open_sequences);
  p->set_prefix_salt(d.prefix_salt);
}

void ToProto(const Inventory& d, v1::Inventory* p) {
  p->set_capacity_bytes(d.capacity_bytes);
  p->set_used_bytes(d.used_bytes);
  p->set_window_bytes(d.window_bytes);
  for (const FormatInventory& f : d.formats) {
    auto* pf = p->add_formats();
    pf->set_format(static_cast<v1::Format>(f.format));
    pf->set_pages_used(f.pages_used);
    pf->set_bytes_used(f.bytes_used);
  }
  for (const std::string& s : d.sequence_ids) p->add_sequence_ids(s);
  for (const TierInventory& t : d.tiers) {
    auto* pt = p->add_tiers();
    pt->set_tier(static_cast<v1::Tier>(t.tier));
    pt->set_capacity_bytes(t.capacity_bytes);
    pt->set_used_bytes(t.used_bytes);
    pt->set_blocks(t.blocks);
  }
  p->set_spills(d.spills);
  p->set_restores(d.restores);
  p->set_checksum_failures(d.checksum_failures);
  p->set_evictions(d.evictions);
  p->set_device_error(d.device_error);
  p->set_frame_bytes(d.frame_bytes);
  p->set_frames(d.frames);
  p->set_free_frames(d.free_frames);
  p->set_free_frames_compacted(d.free_frames_compacted);
  p->set_free_bytes(d.free_bytes);
  p->set_tail_bytes(d.tail_bytes);
  p->set_fragmentation(d.fragmentation);
  for (const PoolInventory& pool : d.pools) {
    auto* q = p->add_pools();
    q->set_format(static_cast<v1::Format>(pool.encoding.k));
    q->set_format_v(static_cast<v1::Format>(pool.encoding.v));
    q->set_group_size(static_cast<uint32_t>(pool.encoding.Group()));
    q->set_scale_dtype(static_cast<v1::ScaleDtype>(pool.encoding.scale_dtype));
    q->set_page_bytes(pool.page_bytes);
    q->set_pages_per_frame(pool.pages_per_frame);
    q->set_frames(pool.frames);
    q->set_pages_used(pool.pages_used);
    q->set_free_slots(pool.free_slots);
    q->set_allocatable_pages(pool.allocatable_pages);
    q->set_free_slots_compacted(pool.free_slots_compacted);
  }
  p->set_compactions(d.compactions);
  p->set_pages_moved(d.pages_moved);
  p->set_bytes_moved(d.bytes_moved);
  p->set_frames_freed_by_compaction(d.frames_freed_by_compaction);
}

void ToProto(const WorkerInfo& d, v1::WorkerInfo* p) {
  p->set_worker_id(d.worker_id);
  p->set_address(d.address);
  p->set_backend(d.backend);
  p->set_state(static_cast<v1::WorkerState>(d.state));
  p->set_capacity_bytes(d.capacity_bytes);
  p->set_reserved_bytes(d.reserved_bytes);
  ToProto(d.inventory, p->mutable_inventory());
  p->set_last_heartbeat_unix_ms(d.last_heartbeat_unix_ms);
  p->set_sequences(d.sequences);
  p->set_host_capacity_bytes(d.host_capacity_bytes);
  p->set_disk_capacity_bytes(d.disk_capacity_bytes);
  p->set_incarnation(d.incarnation);
}

void ToProto(const SequenceInfo& d, v1::SequenceInfo* p) {
  p->set_sequence_id(d.sequence_id);
  p->set_tenant_id(d.tenant_id);
  ToProto(d.model, p->mutable_model());
  p->set_worker_id(d.worker_id);
  p->set_worker_address(d.worker_address);
  p->set_state(static_cast<v1::SequenceState>(d.state));
  p->set_block_tokens(d.block_tokens);
  p->set_num_tokens(d.num_tokens);
  p->set_turns(d.turns);
  p->set_policy(d.policy);
  p->set_parent_sequence_id(d.parent_sequence_id);
  p->mutable_blocks()->Reserve(static_cast<int>(d.blocks.size()));
  for (const BlockPlan& b : d.blocks) ToProto(b, p->add_blocks());
  p->set_bytes(d.bytes);
  for (uint64_t id : d.lost_lineage_ids) p->add_lost_lineage_ids(id);
  p->set_transfer_id(d.transfer_id);
  p->set_transfer_destination_worker_id(d.transfer_destination_worker_id);
  p->set_prefix_sequence_id(d.prefix_sequence_id);
  p->set_prefix_tenant_id(d.prefix_tenant_id);
  p->set_prefix_blocks(d.prefix_blocks);
  p->set_prefix_tokens(d.prefix_tokens);
  p->set_hashed_blocks(d.hashed_blocks);
}

void ToProto(const Event& d, v1::Event* p) {
  p->set_id(d.id);
  p->set_unix_ms(d.unix_ms);
  p->set_kind(static_cast<v1::EventKind>(d.kind));
  p->set_lineage_id(d.lineage_id);
  p->set_sequence_id(d.sequence_id);
  p->set_tenant_id(d.tenant_id);
  p->set_worker_id(d.worker_id);
  if (d.lineage_id != 0) {
    ToProto(d.tag, p->mutable_tag());
    p->set_format(static_cast<v1::Format>(d.format));
  }
  p->set_detail(d.detail);
  for (uint64_t id : d.lineage_ids) p->add_lineage_ids(id);
  p->set_source_worker_id(d.source_worker_id);
}

void ToProto(const RegisterWorkerResult& d, v1::RegisterWorkerResponse* p) {
  p->set_heartbeat_interval_ms(d.heartbeat_interval_ms);
  for (const std::string& s : d.lost_sequence_ids) p->add_lost_sequence_ids(s);
  for (const std::string& s : d.release_sequence_ids)
    p->add_release_sequence_ids(s);
  for (const std::string& s : d.recovered_sequence_ids)
    p->add_recovered_sequence_ids(s);
}

void ToProto(const HeartbeatResult& d, v1::HeartbeatResponse* p) {
  for (const std::string& s : d.release_sequence_ids)
    p->add_release_sequence_ids(s);
}

void ToProto(const ExtendSequenceResult& d, v1::ExtendSequenceResponse* p) {
  ToProto(d.sequence, p->mutable_sequence());
  for (const BlockPlan& b : d.new_blocks) ToProto(b, p->add_new_blocks());
  for (const BlockPlan& b : d.grown_blocks) ToProto(b, p->add_grown_blocks());
  for (const BlockPlan& b : d.retagged_blocks)
    ToProto(b, p->add_retagged_blocks());
  for (const BlockPlan& b : d.demoted_blocks)
    ToProto(b, p->add_demoted_blocks());
}

void ToProto(const CloseSequenceResult& d, v1::CloseSequenceResponse* p) {
  for (uint64_t id : d.freed_lineage_ids) p->add_freed_lineage_ids(id);
}

void ToProto(const TruncateSequenceResult& d, v1::TruncateSequenceResponse* p) {
  ToProto(d.sequence, p->mutable_sequence());
  for (uint64_t id : d.released_lineage_ids) p->add_released_lineage_ids(id);
  for (uint64_t id : d.freed_lineage_ids) p->add_freed_lineage_ids(id);
}

void ToProto(const TraceResult& d, v1::QueryTraceResponse* p) {
  ToProto(d.block, p->mutable_block());
  p->set_sequence_id(d.sequence_id);
  for (const Event& e : d.events) ToProto(e, p->add_events());
  p->set_next_page_token(d.next_page_token);
}

void ToProto(const PressureState& d, v1::GetPressureResponse* p) {
  for (const PoolState& pool : d.pools) {
    auto* pp = p->add_pools();
    pp->set_worker_id(pool.worker_id);
    pp->set_tier(static_cast<v1::Tier>(pool.tier));
    pp->set_capacity_bytes(pool.capacity_bytes);
    pp->set_used_bytes(pool.used_bytes);
    pp->set_high_watermark_bytes(pool.high_watermark_bytes);
    pp->set_low_watermark_bytes(pool.low_watermark_bytes);
  }
  for (const TenantInfo& t : d.tenants) ToProto(t, p->add_tenants());
  for (const RankedActionInfo& a : d.ranked) {
    auto* pa = p->add_ranked();
    pa->set_lineage_id(a.lineage_id);
    pa->set_sequence_id(a.sequence_id);
    pa->set_tenant_id(a.tenant_id);
    pa->set_action(static_cast<v1::PressureAction>(a.action));
    if (a.action == PressureAction::kDemote) {
      auto* e = pa->mutable_encoding();
      e->set_lineage_id(a.lineage_id);
      EncodingToProto(a.encoding, e);
    }
    pa->set_bytes_freed(a.bytes_freed);
    pa->set_cost(a.cost);
  }
  p->set_mode(d.mode);
  p->set_snapshot_blocks(d.snapshot_blocks);
  p->set_snapshot_age_ms(d.snapshot_age_ms);
  p->set_ranking_ms(d.ranking_ms);
  p->set_snapshot_ms(d.snapshot_ms);
  p->set_snapshot_lock_ms(d.snapshot_lock_ms);
  p->set_prefix_index_blocks(d.prefix_index_blocks);
  p->set_prefix_hits(d.prefix_hits);
  p->set_prefix_reused_blocks(d.prefix_reused_blocks);
  p->set_demotions(d.demotions);
  p->set_spills(d.spills);
  p->set_restores(d.restores);
  p->set_evictions(d.evictions);
}

TransferSequenceRequest FromProto(const v1::TransferSequenceRequest& p) {
  TransferSequenceRequest d;
  d.request_id = p.request_id();
  if (!d.request_id.empty()) d.fingerprint = ProtoFingerprint(p);
  d.tenant_id = p.tenant_id();
  d.sequence_id = p.sequence_id();
  d.destination_worker_id = p.destination_worker_id();
  d.destination_policy = p.destination_policy();
  d.timeout_ms = p.timeout_ms();
  d.follow_writes = p.follow_writes();
  d.first_block = p.first_block();
  d.destination_prefix_sequence_id = p.destination_prefix_sequence_id();
  return d;
}

TransferImportFigures FromProto(const v1::ImportSequenceResponse& p) {
  TransferImportFigures d;
  d.pages = p.pages();
  d.wire_bytes = p.wire_bytes();
  d.bf16_bytes = p.bf16_bytes();
  d.page_bytes = p.page_bytes();
  d.seconds = p.seconds();
  d.data_path = p.data_path();
  return d;
}

void ToProto(const TransferSequenceResult& d, v1::TransferSequenceResponse* p) {
  p->set_transfer_id(d.transfer_id);
  p->set_source_worker_id(d.source_worker_id);
  p->set_destination_worker_id(d.destination_worker_id);
  ToProto(d.sequence, p->mutable_sequence());
  p->set_blocks(d.blocks);
  p->set_shared_blocks(d.shared_blocks);
  p->set_pages(d.pages);
  p->set_wire_bytes(d.wire_bytes);
  p->set_bf16_bytes(d.bf16_bytes);
  p->set_source_bytes(d.source_bytes);
  p->set_seconds(d.seconds);
  p->set_pull_seconds(d.pull_seconds);
  p->set_data_path(d.data_path);
}

void ToProto(const TransferPrepared& d, v1::ImportSequenceRequest* p) {
  p->set_request_id(d.worker_request_id);
  p->set_transfer_id(d.transfer_id);
  p->set_tenant_id(d.tenant_id);
  p->set_sequence_id(d.sequence_id);
  ToProto(d.model, p->mutable_model());
  p->set_block_tokens(d.block_tokens);
  if (d.window_tokens) p->set_window_tokens(*d.window_tokens);
  p->mutable_blocks()->Reserve(static_cast<int>(d.blocks.size()));
  for (const BlockPlan& b : d.blocks) ToProto(b, p->add_blocks());
  p->set_source_address(d.source_address);
  p->set_source_worker_id(d.source_worker_id);
  p->set_timeout_ms(d.timeout_ms);
  p->set_follow_writes(d.follow_writes);
  p->set_prefix_sequence_id(d.prefix_sequence_id);
  p->set_prefix_blocks(d.prefix_blocks);
}

}  // namespace triax::manager
