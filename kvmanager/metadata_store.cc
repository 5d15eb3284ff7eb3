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

void EncodeToken(const TokenRecord& t, meta::StoredToken* p) {
  p->set_id(t.id);
  p->set_sha256(t.sha256);
  p->set_role(static_cast<uint32_t>(t.role));
  p->set_tenant_id(t.tenant_id);
  p->set_description(t.description);
  p->set_created_ms(t.created_ms);
  p->set_expires_ms(t.expires_ms);
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

uint32_t PackTag(const Tag& t) {
  return static_cast<uint32_t>(t.temporal) |
         static_cast<uint32_t>(t.modality) << 8 |
         static_cast<uint32_t>(t.role) << 16;
}

Tag UnpackTag(uint32_t v) {
  Tag t;
  t.temporal = static_cast<Temporal>(v & 0xff);
  t.modality = static_cast<Modality>((v >> 8) & 0xff);
  t.role = static_cast<Role>((v >> 16) & 0xff);
  return t;
}

uint32_t PackEncoding(const Encoding& e) {
  return static_cast<uint32_t>(e.k) | static_cast<uint32_t>(e.v) << 8 |
         static_cast<uint32_t>(e.group & 0xff) << 16 |
         static_cast<uint32_t>(e.scale_dtype) << 24;
}

Encoding UnpackEncoding(uint32_t v) {
  Encoding e;
  e.k = static_cast<Format>(v & 0xff);
  e.v = static_cast<Format>((v >> 8) & 0xff);
  e.group = static_cast<int>((v >> 16) & 0xff);
  e.scale_dtype = static_cast<ScaleDtype>((v >> 24) & 0xff);
  return e;
}

void EncodeBlocks(const SequenceRecord& s, meta::StoredBlocks* p) {
  const int n = static_cast<int>(s.blocks.size());
  p->mutable_lineage_id()->Reserve(n);
  p->mutable_first_token()->Reserve(n);
  p->mutable_num_tokens()->Reserve(n);
  p->mutable_capacity()->Reserve(n);
  p->mutable_tag()->Reserve(n);
  p->mutable_encoding()->Reserve(n);
  p->mutable_flags()->Reserve(n);
  p->mutable_turn()->Reserve(n);
  p->mutable_bytes()->Reserve(n);
  for (uint32_t i = 0; i < s.blocks.size(); ++i) {
    const BlockRecord& b = *s.blocks[i];
    p->add_lineage_id(b.lineage_id);
    p->add_first_token(b.first_token);
    p->add_num_tokens(b.num_tokens);
    p->add_capacity(b.capacity);
    p->add_tag(PackTag(b.tag));
    p->add_encoding(PackEncoding(b.encoding));
    p->add_flags(static_cast<uint32_t>(b.tier) | (b.evicted ? 1u << 8 : 0u) |
                 (b.prefix_indexed ? 1u << 9 : 0u));
    p->add_turn(b.turn);
    p->add_bytes(b.bytes);
    if (b.charged != nullptr && b.charged != s.tenant) {
      (*p->mutable_charged_tenant())[i] = b.charged->id;
    }
    if (b.creator != s.id) (*p->mutable_creator())[i] = b.creator;
    if (b.owner != &s) {
      (*p->mutable_owner())[i] = b.owner != nullptr ? b.owner->id : "";
    }
    if (!b.prefix_hash.empty()) (*p->mutable_prefix_hash())[i] = b.prefix_hash;
  }
}

// Block i of a stored sequence (id, tenant).
RecoveredBlock DecodeBlock(const meta::StoredBlocks& p, uint32_t i,
                           const std::string& sequence_id,
                           const std::string& tenant_id) {
  RecoveredBlock out;
  BlockRecord& b = out.record;
  b.index = i;
  b.lineage_id = p.lineage_id(i);
  b.first_token = p.first_token(i);
  b.num_tokens = p.num_tokens(i);
  b.capacity = p.capacity(i);
  b.tag = UnpackTag(p.tag(i));
  b.encoding = UnpackEncoding(p.encoding(i));
  const uint32_t flags = p.flags(i);
  b.tier = static_cast<Tier>(flags & 0xff);
  b.evicted = (flags & (1u << 8)) != 0;
  b.prefix_indexed = (flags & (1u << 9)) != 0;
  b.turn = p.turn(i);
  b.bytes = p.bytes(i);
  auto find = [i](const google::protobuf::Map<uint32_t, std::string>& m,
                  const std::string& fallback) {
    auto it = m.find(i);
    return it == m.end() ? fallback : it->second;
  };
  out.charged_tenant = find(p.charged_tenant(), tenant_id);
  b.creator = find(p.creator(), sequence_id);
  out.owner = find(p.owner(), sequence_id);
  b.prefix_hash = find(p.prefix_hash(), "");
  return out;
}

// Whether every column of `p` has `n` entries.
bool ColumnsMatch(const meta::StoredBlocks& p) {
  const int n = p.lineage_id_size();
  return p.first_token_size() == n && p.num_tokens_size() == n &&
         p.capacity_size() == n && p.tag_size() == n &&
         p.encoding_size() == n && p.flags_size() == n && p.turn_size() == n &&
         p.bytes_size() == n;
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
    EncodeBlocks(s, p->mutable_blocks());
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
    p->set_in_doubt(s.in_doubt);
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
                             std::unique_ptr<GroupCommitLog> log,
                             uint64_t epoch, uint64_t next_ref)
    : options_(options),
      log_(std::move(log)),
      epoch_(epoch),
      next_ref_(next_ref) {}

uint64_t MetadataStore::Write(const ChangeSet& changes, const StateView& view) {
  MetadataEncoder enc(this);
  // Reused: Clear keeps the sub-messages and arrays of the last records, so
  // an Open's record is built without allocating (Write runs under the
  // core's mutex, never twice at once).
  meta::MetadataRecord& rec = record_;
  rec.Clear();
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
  for (const std::string& id : changes.tokens) {
    if (std::optional<TokenRecord> t = view.tokens.Find(id)) {
      EncodeToken(*t, rec.add_tokens());
    }
  }
  for (const std::string& id : changes.revoked_tokens) {
    rec.add_revoked_token_ids(id);
  }
  if (changes.capability_key) rec.set_capability_key(view.capability_key);
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
  // What a large record (every sequence of a lost worker) held is not kept.
  if (rec.sequences_size() > kReusedSequences) rec = meta::MetadataRecord();
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
  for (const TokenRecord& t : view.tokens.List()) {
    EncodeToken(t, head.add_tokens());
  }
  head.set_capability_key(view.capability_key);
  records.push_back(head.SerializeAsString());
  meta::MetadataRecord part;
  part.set_snapshot_part(true);
  size_t part_bytes = 0;
  for (const auto& [id, s] : view.sequences.all()) {
    enc.Sequence(*s, &part);
    part_bytes += 64 + 40 * s->blocks.size();
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
  absl::flat_hash_map<std::string, meta::StoredToken> tokens;
  std::string capability_key;
  absl::flat_hash_map<uint64_t, RecoveredBlock> blocks;  // newest copies
  uint64_t max_ref = 0;

  absl::Status Apply(meta::MetadataRecord& rec) {
    if (rec.snapshot_first()) *this = Image();
    if (rec.has_counters()) counters = rec.counters();
    for (auto& t : *rec.mutable_tenants()) tenants[t.id()] = std::move(t);
    for (auto& t : *rec.mutable_tokens()) tokens[t.id()] = std::move(t);
    for (const std::string& id : rec.revoked_token_ids()) tokens.erase(id);
    if (!rec.capability_key().empty()) capability_key = rec.capability_key();
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
      const meta::StoredBlocks& cols = s.blocks();
      if (!ColumnsMatch(cols)) {
        return absl::DataLossError(absl::StrCat("stored sequence ",
                                                Quote(s.id()),
                                                " has block columns of "
                                                "different lengths"));
      }
      for (int i = 0; i < cols.lineage_id_size(); ++i) {
        blocks[cols.lineage_id(i)] =
            DecodeBlock(cols, static_cast<uint32_t>(i), s.id(), s.tenant_id());
      }
      const std::string id = s.id();
      sequences[id] = std::move(s);
      // Only the lineage ids are kept (the blocks are in `blocks`).
      meta::StoredBlocks* kept = sequences[id].mutable_blocks();
      google::protobuf::RepeatedField<uint64_t> ids;
      ids.Swap(kept->mutable_lineage_id());
      kept->Clear();
      kept->mutable_lineage_id()->Swap(&ids);
    }
    for (const std::string& id : rec.dropped_sequence_ids()) {
      sequences.erase(id);
    }
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetadataStore>> MetadataStore::Open(
    const MetadataStoreOptions& options, RecoveredState* recovered,
    RecoveryFigures* figures) {
  MetadataLogOptions log_options;
  log_options.dir = options.dir;
  log_options.sync = options.sync;
  absl::StatusOr<std::unique_ptr<MetadataLog>> log =
      MetadataLog::Open(log_options);
  if (!log.ok()) return log.status();
  return Open(*std::move(log), options, recovered, figures);
}

absl::StatusOr<std::unique_ptr<MetadataStore>> MetadataStore::Open(
    std::unique_ptr<GroupCommitLog> log, const MetadataStoreOptions& options,
    RecoveredState* recovered, RecoveryFigures* figures) {
  const auto start = std::chrono::steady_clock::now();
  Image image;
  RecoveryFigures fig;
  absl::Status st = log->Replay([&](absl::string_view bytes,
                                    bool /*from_snapshot*/) -> absl::Status {
    meta::MetadataRecord rec;
    if (!rec.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
      return absl::DataLossError(absl::StrCat("metadata record ",
                                              fig.records + 1, " in ",
                                              log->where(), " does not parse"));
    }
    ++fig.records;
    fig.bytes += bytes.size();
    return image.Apply(rec);
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
  out.capability_key = image.capability_key;
  for (const auto& [id, t] : image.tokens) {
    if (t.role() < static_cast<uint32_t>(TokenRole::kAdmin) ||
        t.role() > static_cast<uint32_t>(TokenRole::kWorker)) {
      return absl::DataLossError(
          absl::StrCat("stored token ", id, " has an unknown role ", t.role()));
    }
    TokenRecord r;
    r.id = t.id();
    r.sha256 = t.sha256();
    r.role = static_cast<TokenRole>(t.role());
    r.tenant_id = t.tenant_id();
    r.description = t.description();
    r.created_ms = t.created_ms();
    r.expires_ms = t.expires_ms();
    out.tokens.push_back(std::move(r));
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
    s.in_doubt = p.in_doubt();
    if (s.state == SequenceState::kOpen) {
      rs.lineage_ids.assign(p.blocks().lineage_id().begin(),
                            p.blocks().lineage_id().end());
      for (uint64_t lineage : rs.lineage_ids) {
        if (out.blocks.contains(lineage)) continue;
        auto b = image.blocks.find(lineage);
        if (b == image.blocks.end()) {
          return absl::DataLossError(absl::StrCat("stored sequence ", Quote(id),
                                                  " lists block ", lineage,
                                                  ", which is not stored"));
        }
        out.blocks.emplace(lineage, std::move(b->second));
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
      new MetadataStore(options, std::move(log), epoch, image.max_ref + 1));
}

}  // namespace triax::manager
