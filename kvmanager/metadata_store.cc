#include "kvmanager/metadata_store.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/log.h"
#include "common/model_proto.h"
#include "kvmanager/convert.h"
#include "triax/v1/metadata.pb.h"

namespace triax::manager {

namespace meta = ::triax::v1::meta;

namespace {

// Snapshot records hold about this many bytes of sequences each.
constexpr size_t kSnapshotChunkBytes = size_t{4} << 20;

void EncodeEncoding(const Encoding& e, meta::StoredEncoding* p) {
  p->set_format(static_cast<v1::Format>(e.k));
  p->set_format_v(static_cast<v1::Format>(e.v));
  p->set_group_size(static_cast<uint32_t>(e.group));
  p->set_scale_dtype(static_cast<v1::ScaleDtype>(e.scale_dtype));
}

Encoding DecodeEncoding(const meta::StoredEncoding& p) {
  Encoding e;
  e.k = static_cast<Format>(p.format());
  e.v = static_cast<Format>(p.format_v());
  e.group = static_cast<int>(p.group_size());
  e.scale_dtype = static_cast<ScaleDtype>(p.scale_dtype());
  return e;
}

void EncodeTenant(const TenantRecord& t, meta::StoredTenant* p) {
  p->set_id(t.id);
  for (const std::optional<Budget>& b : t.budgets) {
    if (b.has_value()) ToProto(*b, p->add_budgets());
  }
  p->set_default_policy(t.default_policy);
  p->set_prefix_salt(t.prefix_salt);
}

void EncodeWorker(const WorkerRecord& w, meta::StoredWorker* p) {
  p->set_worker_id(w.info.worker_id);
  p->set_address(w.info.address);
  p->set_backend(w.info.backend);
  p->set_capacity_bytes(w.info.capacity_bytes);
  p->set_host_capacity_bytes(w.info.host_capacity_bytes);
  p->set_disk_capacity_bytes(w.info.disk_capacity_bytes);
  p->set_incarnation(w.incarnation);
}

void EncodeBlock(const BlockRecord& b, meta::StoredBlock* p) {
  p->set_index(b.index);
  p->set_lineage_id(b.lineage_id);
  p->set_first_token(b.first_token);
  p->set_num_tokens(b.num_tokens);
  p->set_capacity(b.capacity);
  ToProto(b.tag, p->mutable_tag());
  EncodeEncoding(b.encoding, p->mutable_encoding());
  p->set_tier(static_cast<v1::Tier>(b.tier));
  p->set_evicted(b.evicted);
  p->set_turn(b.turn);
  p->set_bytes(b.bytes);
  if (b.charged != nullptr) p->set_charged_tenant(b.charged->id);
  p->set_creator(b.creator);
  if (b.owner != nullptr) p->set_owner(b.owner->id);
  p->set_prefix_hash(b.prefix_hash);
  p->set_prefix_indexed(b.prefix_indexed);
}

RecoveredBlock DecodeBlock(const meta::StoredBlock& p) {
  RecoveredBlock out;
  BlockRecord& b = out.record;
  b.index = p.index();
  b.lineage_id = p.lineage_id();
  b.first_token = p.first_token();
  b.num_tokens = p.num_tokens();
  b.capacity = p.capacity();
  b.tag = FromProto(p.tag());
  b.encoding = DecodeEncoding(p.encoding());
  b.tier = static_cast<Tier>(p.tier());
  b.evicted = p.evicted();
  b.turn = p.turn();
  b.bytes = p.bytes();
  b.creator = p.creator();
  b.prefix_hash = p.prefix_hash();
  b.prefix_indexed = p.prefix_indexed();
  out.charged_tenant = p.charged_tenant();
  out.owner = p.owner();
  return out;
}

}  // namespace

// Builds records, interning policy and calibration versions into the
// store's table (MetadataStore::interned_).
class MetadataEncoder {
 public:
  explicit MetadataEncoder(MetadataStore* store) : store_(store) {}

  uint64_t Policy(const std::shared_ptr<const triax::manager::Policy>& p,
                  meta::MetadataRecord* rec) {
    if (p == nullptr) return 0;
    auto [it, inserted] = store_->interned_.try_emplace(p.get());
    if (!inserted) return it->second.ref;
    it->second.ref = store_->next_ref_++;
    it->second.keep = p;
    meta::StoredPolicy* sp = rec->add_policies();
    sp->set_ref(it->second.ref);
    sp->set_builtin(p->builtin);
    if (p->builtin) {
      sp->mutable_policy()->set_name(p->name);
    } else {
      ToProto(p->Info(), sp->mutable_policy());
    }
    return it->second.ref;
  }

  uint64_t Calibration(const std::shared_ptr<const CalibrationTable>& t,
                       meta::MetadataRecord* rec) {
    if (t == nullptr) return 0;
    auto [it, inserted] = store_->interned_.try_emplace(t.get());
    if (!inserted) return it->second.ref;
    it->second.ref = store_->next_ref_++;
    it->second.keep = t;
    meta::StoredCalibration* sc = rec->add_calibrations();
    sc->set_ref(it->second.ref);
    ToProto(t->info, sc->mutable_table());
    return it->second.ref;
  }

  void Sequence(const SequenceRecord& s, meta::MetadataRecord* rec) {
    meta::StoredSequence* p = rec->add_sequences();
    p->set_id(s.id);
    p->set_tenant_id(s.tenant->id);
    p->set_worker_id(s.worker->info.worker_id);
    ToProto(s.model, p->mutable_model());
    p->set_state(static_cast<v1::SequenceState>(s.state));
    p->set_block_tokens(s.block_tokens);
    p->set_has_window_tokens(s.window_tokens.has_value());
    p->set_window_tokens(s.window_tokens.value_or(0));
    p->set_num_tokens(s.num_tokens);
    p->set_current_turn(s.current_turn);
    p->set_policy_ref(Policy(s.policy, rec));
    p->set_parent(s.parent);
    for (const BlockRecord* b : s.blocks) EncodeBlock(*b, p->add_blocks());
    for (uint32_t t : s.turn_start) p->add_turn_start(t);
    p->set_bytes(s.bytes);
    p->set_version(s.version);
    for (uint64_t id : s.lost_lineage_ids) p->add_lost_lineage_ids(id);
    p->set_calibration_ref(Calibration(s.calibration, rec));
    for (const auto& [tag, enc] : s.allocation) {
      meta::StoredAllocation* a = p->add_allocation();
      ToProto(tag, a->mutable_tag());
      EncodeEncoding(enc, a->mutable_encoding());
    }
    p->set_spilled(s.spilled);
    p->set_last_tool_call(s.last_tool_call);
    p->set_prefix_sequence_id(s.prefix_sequence_id);
    p->set_prefix_tenant_id(s.prefix_tenant_id);
    p->set_prefix_blocks(s.prefix_blocks);
    p->set_prefix_tokens(s.prefix_tokens);
    p->set_chain_blocks(s.chain_blocks);
    p->set_chain_open(s.chain_open);
    for (uint32_t t : s.chain_tail) p->add_chain_tail(t);
  }

  void Counters(const StateView& view, meta::MetadataRecord* rec) {
    meta::StoredCounters* c = rec->mutable_counters();
    c->set_sequence_limit(view.sequences.sequence_limit());
    c->set_lineage_limit(view.sequences.lineage_limit());
    c->set_epoch(store_->epoch_);
  }

 private:
  MetadataStore* const store_;
};

MetadataStore::MetadataStore(const MetadataStoreOptions& options,
                             std::unique_ptr<MetadataLog> log, uint64_t epoch,
                             uint64_t next_ref)
    : options_(options),
      log_(std::move(log)),
      epoch_(epoch),
      next_ref_(next_ref) {}

uint64_t MetadataStore::Write(const ChangeSet& changes, const StateView& view) {
  MetadataEncoder enc(this);
  meta::MetadataRecord rec;
  if (changes.counters) enc.Counters(view, &rec);
  for (const std::string& id : changes.tenants) {
    if (const TenantRecord* t = view.tenants.FindOrNull(id)) {
      EncodeTenant(*t, rec.add_tenants());
    }
  }
  for (const std::string& id : changes.workers) {
    if (const WorkerRecord* w = view.workers.Find(id)) {
      EncodeWorker(*w, rec.add_workers());
    }
  }
  for (const std::string& name : changes.operator_policies) {
    auto it = view.policies.all().find(name);
    if (it == view.policies.all().end()) continue;
    meta::StoredName* n = rec.add_operator_policies();
    n->set_name(name);
    n->set_ref(enc.Policy(it->second, &rec));
  }
  for (const std::string& model : changes.calibrations) {
    auto it = view.calibrations.all().find(model);
    if (it == view.calibrations.all().end()) continue;
    meta::StoredName* n = rec.add_calibration_tables();
    n->set_name(model);
    n->set_ref(enc.Calibration(it->second, &rec));
  }
  std::vector<const SequenceRecord*> seqs;
  seqs.reserve(changes.sequences.size());
  for (const std::string& id : changes.sequences) {
    if (const SequenceRecord* s = view.sequences.Find(id)) seqs.push_back(s);
  }
  std::sort(seqs.begin(), seqs.end(),
            [](const SequenceRecord* a, const SequenceRecord* b) {
              return SequenceIdBefore(a->id, b->id);
            });
  for (const SequenceRecord* s : seqs) enc.Sequence(*s, &rec);
  for (const std::string& id : changes.dropped_sequences) {
    rec.add_dropped_sequence_ids(id);
  }
  const uint64_t ticket = log_->Append(rec.SerializeAsString());
  if (log_->stats().bytes_since_snapshot >= options_.snapshot_bytes) {
    return Snapshot(view);  // a later ticket: covers this record too
  }
  return ticket;
}

uint64_t MetadataStore::Snapshot(const StateView& view) {
  // Versions are written again with the snapshot: what it replaces goes.
  interned_.clear();
  MetadataEncoder enc(this);
  std::vector<std::string> records;
  meta::MetadataRecord head;
  head.set_snapshot_part(true);
  head.set_snapshot_first(true);
  enc.Counters(view, &head);
  for (const auto& [id, t] : view.tenants.all()) {
    EncodeTenant(*t, head.add_tenants());
  }
  for (const auto& [id, w] : view.workers.all()) {
    EncodeWorker(*w, head.add_workers());
  }
  for (const auto& [name, p] : view.policies.all()) {
    meta::StoredName* n = head.add_operator_policies();
    n->set_name(name);
    n->set_ref(enc.Policy(p, &head));
  }
  for (const auto& [model, t] : view.calibrations.all()) {
    meta::StoredName* n = head.add_calibration_tables();
    n->set_name(model);
    n->set_ref(enc.Calibration(t, &head));
  }
  records.push_back(head.SerializeAsString());
  meta::MetadataRecord part;
  part.set_snapshot_part(true);
  size_t part_bytes = 0;
  for (const auto& [id, s] : view.sequences.all()) {
    enc.Sequence(*s, &part);
    part_bytes += 64 + 96 * s->blocks.size();
    if (part_bytes >= kSnapshotChunkBytes) {
      records.push_back(part.SerializeAsString());
      part.Clear();
      part.set_snapshot_part(true);
      part_bytes = 0;
    }
  }
  if (part.sequences_size() > 0 || part.policies_size() > 0 ||
      part.calibrations_size() > 0) {
    records.push_back(part.SerializeAsString());
  }
  return log_->AppendSnapshot(std::move(records));
}

namespace {

// Fail-stop: the core's memory is ahead of its disk. A restart recovers
// what is on disk; serving on would acknowledge changes that are not.
[[noreturn]] void FailStop(const absl::Status& st) {
  Log(LogLevel::kError, "metadata",
      absl::StrCat("cannot write the metadata log, stopping: ", st.message()));
  std::_Exit(74);  // EX_IOERR
}

}  // namespace

void MetadataStore::Wait(uint64_t ticket) {
  absl::Status st = log_->Wait(ticket);
  if (!st.ok()) FailStop(st);
}

void MetadataStore::OnDurable(uint64_t ticket, std::function<void()> fn) {
  log_->OnDurable(ticket, [fn = std::move(fn)](const absl::Status& st) {
    if (!st.ok()) FailStop(st);
    fn();
  });
}

// --- Recovery ----------------------------------------------------------------

namespace {

// The stored state as the records leave it: newest record wins per id.
struct Image {
  meta::StoredCounters counters;
  absl::flat_hash_map<std::string, meta::StoredTenant> tenants;
  absl::flat_hash_map<std::string, meta::StoredWorker> workers;
  absl::flat_hash_map<uint64_t, meta::StoredPolicy> policies;
  absl::flat_hash_map<uint64_t, meta::StoredCalibration> calibrations;
  absl::flat_hash_map<std::string, uint64_t> operator_policies;
  absl::flat_hash_map<std::string, uint64_t> calibration_tables;
  absl::flat_hash_map<std::string, meta::StoredSequence> sequences;
  absl::flat_hash_map<uint64_t, meta::StoredBlock> blocks;  // newest copy
  uint64_t max_ref = 0;

  void Apply(meta::MetadataRecord& rec) {
    if (rec.snapshot_first()) *this = Image();
    if (rec.has_counters()) counters = rec.counters();
    for (auto& t : *rec.mutable_tenants()) tenants[t.id()] = std::move(t);
    for (auto& w : *rec.mutable_workers()) {
      workers[w.worker_id()] = std::move(w);
    }
    for (auto& p : *rec.mutable_policies()) {
      max_ref = std::max(max_ref, p.ref());
      policies[p.ref()] = std::move(p);
    }
    for (auto& c : *rec.mutable_calibrations()) {
      max_ref = std::max(max_ref, c.ref());
      calibrations[c.ref()] = std::move(c);
    }
    for (const auto& n : rec.operator_policies()) {
      operator_policies[n.name()] = n.ref();
    }
    for (const auto& n : rec.calibration_tables()) {
      calibration_tables[n.name()] = n.ref();
    }
    for (auto& s : *rec.mutable_sequences()) {
      for (const auto& b : s.blocks()) blocks[b.lineage_id()] = b;
      s.clear_blocks();  // kept as lineage ids below, in `order`
      const std::string id = s.id();
      sequences[id] = std::move(s);
    }
    for (const std::string& id : rec.dropped_sequence_ids()) {
      sequences.erase(id);
    }
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetadataStore>> MetadataStore::Open(
    const MetadataStoreOptions& options, RecoveredState* recovered,
    RecoveryFigures* figures) {
  const auto start = std::chrono::steady_clock::now();
  MetadataLogOptions log_options;
  log_options.dir = options.dir;
  log_options.sync = options.sync;
  absl::StatusOr<std::unique_ptr<MetadataLog>> log =
      MetadataLog::Open(log_options);
  if (!log.ok()) return log.status();
  Image image;
  // Each stored sequence's block lineage ids, as the newest record of it
  // listed them.
  absl::flat_hash_map<std::string, std::vector<uint64_t>> lineages;
  RecoveryFigures fig;
  absl::Status st = (*log)->Replay([&](absl::string_view bytes,
                                       bool /*from_snapshot*/) -> absl::Status {
    meta::MetadataRecord rec;
    if (!rec.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
      return absl::DataLossError(absl::StrCat("metadata record ",
                                              fig.records + 1, " in ",
                                              options.dir, " does not parse"));
    }
    ++fig.records;
    fig.bytes += bytes.size();
    if (rec.snapshot_first()) lineages.clear();
    for (const auto& s : rec.sequences()) {
      std::vector<uint64_t>& ids = lineages[s.id()];
      ids.clear();
      for (const auto& b : s.blocks()) ids.push_back(b.lineage_id());
    }
    for (const std::string& id : rec.dropped_sequence_ids()) {
      lineages.erase(id);
    }
    image.Apply(rec);
    return absl::OkStatus();
  });
  if (!st.ok()) return st;

  RecoveredState out;
  out.next_sequence = image.counters.sequence_limit();
  out.next_lineage = image.counters.lineage_limit();
  out.epoch = image.counters.epoch();
  for (const auto& [id, t] : image.tenants) {
    TenantRecord r;
    r.id = t.id();
    for (const v1::Budget& b : t.budgets()) {
      Budget d = FromProto(b);
      const int tier = static_cast<int>(d.tier);
      if (tier <= 0 || tier >= kNumTiers) {
        return absl::DataLossError(absl::StrCat(
            "stored tenant ", Quote(t.id()), " has a budget for tier ", tier));
      }
      r.budgets[tier] = d;
    }
    r.default_policy = t.default_policy();
    r.prefix_salt = t.prefix_salt();
    out.tenants.push_back(std::move(r));
  }
  for (const auto& [id, w] : image.workers) {
    RegisterWorkerRequest r;
    r.worker_id = w.worker_id();
    r.address = w.address();
    r.backend = w.backend();
    r.capacity_bytes = w.capacity_bytes();
    r.host_capacity_bytes = w.host_capacity_bytes();
    r.disk_capacity_bytes = w.disk_capacity_bytes();
    r.incarnation = w.incarnation();
    out.workers.push_back(std::move(r));
  }
  absl::flat_hash_map<uint64_t, std::shared_ptr<const Policy>> policies;
  auto policy_of =
      [&](uint64_t ref) -> absl::StatusOr<std::shared_ptr<const Policy>> {
    if (auto it = policies.find(ref); it != policies.end()) return it->second;
    auto sp = image.policies.find(ref);
    if (sp == image.policies.end()) {
      return absl::DataLossError(
          absl::StrCat("stored policy version ", ref, " is missing"));
    }
    std::shared_ptr<const Policy> p;
    if (sp->second.builtin()) {
      p = FindBuiltinPolicy(sp->second.policy().name());
      if (p == nullptr) {
        return absl::DataLossError(
            absl::StrCat("stored built-in policy ",
                         Quote(sp->second.policy().name()), " is unknown"));
      }
    } else {
      absl::StatusOr<std::shared_ptr<const Policy>> built =
          BuildPolicy(FromProto(sp->second.policy()));
      if (!built.ok()) {
        return absl::DataLossError(
            absl::StrCat("stored policy ", Quote(sp->second.policy().name()),
                         " does not build: ", built.status().message()));
      }
      p = *std::move(built);
    }
    policies[ref] = p;
    return p;
  };
  absl::flat_hash_map<uint64_t, std::shared_ptr<const CalibrationTable>> cals;
  auto calibration_of = [&](uint64_t ref)
      -> absl::StatusOr<std::shared_ptr<const CalibrationTable>> {
    if (auto it = cals.find(ref); it != cals.end()) return it->second;
    auto sc = image.calibrations.find(ref);
    if (sc == image.calibrations.end()) {
      return absl::DataLossError(absl::StrCat(
          "stored calibration table version ", ref, " is missing"));
    }
    absl::StatusOr<std::shared_ptr<const CalibrationTable>> built =
        CalibrationStore::Build(FromProto(sc->second.table()));
    if (!built.ok()) {
      return absl::DataLossError(absl::StrCat(
          "stored calibration table ", Quote(sc->second.table().model()),
          " does not build: ", built.status().message()));
    }
    cals[ref] = *built;
    return *std::move(built);
  };
  for (const auto& [name, ref] : image.operator_policies) {
    absl::StatusOr<std::shared_ptr<const Policy>> p = policy_of(ref);
    if (!p.ok()) return p.status();
    out.operator_policies.push_back(*std::move(p));
  }
  for (const auto& [model, ref] : image.calibration_tables) {
    absl::StatusOr<std::shared_ptr<const CalibrationTable>> t =
        calibration_of(ref);
    if (!t.ok()) return t.status();
    out.calibrations.push_back(*std::move(t));
  }
  std::vector<std::string> ids;
  ids.reserve(image.sequences.size());
  for (const auto& [id, s] : image.sequences) ids.push_back(id);
  std::sort(ids.begin(), ids.end(), SequenceIdBefore);
  for (const std::string& id : ids) {
    const meta::StoredSequence& p = image.sequences.at(id);
    RecoveredSequence rs;
    SequenceRecord& s = rs.record;
    s.id = p.id();
    rs.tenant_id = p.tenant_id();
    rs.worker_id = p.worker_id();
    s.model = FromProto(p.model());
    s.state = static_cast<SequenceState>(p.state());
    s.block_tokens = p.block_tokens();
    if (p.has_window_tokens()) s.window_tokens = p.window_tokens();
    s.num_tokens = p.num_tokens();
    s.current_turn = p.current_turn();
    absl::StatusOr<std::shared_ptr<const Policy>> policy =
        policy_of(p.policy_ref());
    if (!policy.ok()) return policy.status();
    s.policy = *std::move(policy);
    s.parent = p.parent();
    s.turn_start.assign(p.turn_start().begin(), p.turn_start().end());
    s.bytes = p.bytes();
    s.version = p.version();
    s.lost_lineage_ids.assign(p.lost_lineage_ids().begin(),
                              p.lost_lineage_ids().end());
    if (p.calibration_ref() != 0) {
      absl::StatusOr<std::shared_ptr<const CalibrationTable>> t =
          calibration_of(p.calibration_ref());
      if (!t.ok()) return t.status();
      s.calibration = *std::move(t);
    }
    for (const meta::StoredAllocation& a : p.allocation()) {
      s.allocation.emplace_back(FromProto(a.tag()),
                                DecodeEncoding(a.encoding()));
    }
    s.spilled = p.spilled();
    s.last_tool_call = p.last_tool_call();
    s.prefix_sequence_id = p.prefix_sequence_id();
    s.prefix_tenant_id = p.prefix_tenant_id();
    s.prefix_blocks = p.prefix_blocks();
    s.prefix_tokens = p.prefix_tokens();
    s.chain_blocks = p.chain_blocks();
    s.chain_open = p.chain_open();
    s.chain_tail.assign(p.chain_tail().begin(), p.chain_tail().end());
    if (s.state == SequenceState::kOpen) {
      rs.lineage_ids = lineages[id];
      for (uint64_t lineage : rs.lineage_ids) {
        if (out.blocks.contains(lineage)) continue;
        auto b = image.blocks.find(lineage);
        if (b == image.blocks.end()) {
          return absl::DataLossError(absl::StrCat("stored sequence ", Quote(id),
                                                  " lists block ", lineage,
                                                  ", which is not stored"));
        }
        out.blocks.emplace(lineage, DecodeBlock(b->second));
      }
    }
    out.sequences.push_back(std::move(rs));
  }
  const uint64_t epoch = out.epoch + 1;
  fig.epoch = epoch;
  fig.read_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (figures != nullptr) *figures = fig;
  *recovered = std::move(out);
  return std::unique_ptr<MetadataStore>(
      new MetadataStore(options, *std::move(log), epoch, image.max_ref + 1));
}

}  // namespace triax::manager
