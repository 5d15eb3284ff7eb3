// Prefix reuse by content hash (manager_core.h, prefix_index.h): the hash
// chains of sequences, the longest cached prefix of an Open, and the index's
// upkeep when blocks stop being usable as a prefix.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/pending_transfers.h"

namespace triax::manager {

absl::StatusOr<std::vector<std::string>> ManagerCore::OpenPrefixHashesLocked(
    const OpenSequenceRequest& req, const TenantRecord& tenant,
    const std::vector<PlannedBlock>& blocks, size_t sealed) const {
  std::vector<std::string> hashes;
  if (!req.token_ids.empty()) {
    const std::string model = ModelIdentity(req.model);
    const std::string salt = PrefixSalt(tenant.id, tenant.prefix_salt);
    const auto ids = absl::MakeConstSpan(req.token_ids);
    hashes.reserve(sealed);
    for (size_t i = 0; i < sealed; ++i) {
      hashes.push_back(
          BlockHash(i == 0 ? "" : hashes.back(), model, salt,
                    ids.subspan(blocks[i].first_token, blocks[i].num_tokens)));
    }
    for (size_t i = 0; i < req.block_hashes.size(); ++i) {
      if (req.block_hashes[i] != hashes[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("block_hashes[", i, "] ", HashHex(req.block_hashes[i]),
                         " differs from the hash of token_ids' block ", i, " ",
                         HashHex(hashes[i]), " (tenant ", Quote(tenant.id),
                         "'s salt; prefix_index.h gives the layout)"));
      }
    }
    return hashes;
  }
  return req.block_hashes;
}

ManagerCore::PrefixMatch ManagerCore::FindPrefixLocked(
    const TenantRecord& tenant, const ModelShape& model, uint32_t block_tokens,
    const std::optional<uint32_t>& window_tokens, const std::string& worker_id,
    const std::vector<std::string>& hashes) const {
  const std::string salt = PrefixSalt(tenant.id, tenant.prefix_salt);
  const std::string model_id = ModelIdentity(model);
  // The sequence that holds `b` at its index: its creator while open and
  // holding it, else the open sequence owning it.
  auto holder = [&](const BlockRecord& b) -> SequenceRecord* {
    SequenceRecord* c = sequences_.Find(b.creator);
    if (c != nullptr && c->state == SequenceState::kOpen &&
        b.index < c->blocks.size() && c->blocks[b.index] == &b) {
      return c;
    }
    return SequenceTable::Owner(b);
  };
  auto usable = [&](const SequenceRecord& d, size_t k) {
    if (d.state != SequenceState::kOpen || !CheckNotTransferring(d).ok() ||
        d.worker->info.state != WorkerState::kUp ||
        (!worker_id.empty() && d.worker->info.worker_id != worker_id) ||
        d.block_tokens != block_tokens || d.window_tokens != window_tokens ||
        d.blocks.size() < k || ModelIdentity(d.model) != model_id ||
        PrefixSalt(d.tenant->id, d.tenant->prefix_salt) != salt) {
      return false;
    }
    for (size_t j = 0; j < k; ++j) {
      const BlockRecord& b = *d.blocks[j];
      if (!b.prefix_indexed || b.prefix_hash != hashes[j] ||
          b.tier != Tier::kDevice || b.evicted || b.busy != 0) {
        return false;
      }
    }
    return true;
  };
  for (size_t k = hashes.size(); k > 0; --k) {
    const std::vector<BlockRecord*>* found = prefix_.Find(hashes[k - 1]);
    if (found == nullptr) continue;
    for (BlockRecord* b : *found) {
      if (b->index != k - 1) continue;
      SequenceRecord* d = holder(*b);
      if (d != nullptr && usable(*d, k)) {
        return PrefixMatch{d, static_cast<uint32_t>(k)};
      }
    }
  }
  return PrefixMatch{};
}

namespace {

// The token that follows block c-1 of s (0 for c = 0).
uint64_t ChainEnd(const SequenceRecord& s, uint32_t c) {
  if (c == 0) return 0;
  const BlockRecord& b = *s.blocks[c - 1];
  return b.first_token + b.num_tokens;
}

}  // namespace

void ManagerCore::AdvanceChainLocked(SequenceRecord* s,
                                     absl::Span<const uint32_t> ids) {
  if (!s->chain_open) return;
  if (ids.empty()) {
    s->chain_open = false;
    s->chain_tail.clear();
    return;
  }
  const uint32_t T = s->block_tokens;
  std::vector<uint32_t> buf = std::move(s->chain_tail);
  s->chain_tail.clear();
  buf.insert(buf.end(), ids.begin(), ids.end());
  const uint64_t base = ChainEnd(*s, s->chain_blocks);
  const std::string salt = PrefixSalt(s->tenant->id, s->tenant->prefix_salt);
  const std::string model_id = ModelIdentity(s->model);
  std::string prev =
      s->chain_blocks == 0 ? "" : s->blocks[s->chain_blocks - 1]->prefix_hash;
  for (size_t i = s->chain_blocks; i < s->blocks.size(); ++i) {
    BlockRecord* b = s->blocks[i];
    const uint64_t at = b->first_token - base;
    // A partial last block may still grow: it waits.
    if (b->num_tokens != T && i + 1 == s->blocks.size()) {
      s->chain_tail.assign(buf.begin() + static_cast<ptrdiff_t>(at), buf.end());
      return;
    }
    if (b->prefix_hash.empty()) {
      b->prefix_hash =
          BlockHash(prev, model_id, salt,
                    absl::MakeConstSpan(buf).subspan(at, b->num_tokens));
      if (b->tier == Tier::kDevice && !b->evicted) prefix_.Add(b);
      if (keep_token_ids_) {
        const auto ids = absl::MakeConstSpan(buf).subspan(at, b->num_tokens);
        b->token_ids.assign(ids.begin(), ids.end());
      }
    }
    prev = b->prefix_hash;
    ++s->chain_blocks;
  }
}

void ManagerCore::ForkChainLocked(const SequenceRecord& parent,
                                  const ForkPlan& plan, SequenceRecord* child) {
  const uint32_t c =
      static_cast<uint32_t>(std::min<size_t>(parent.chain_blocks, plan.shared));
  child->chain_blocks = c;
  const uint64_t base = ChainEnd(parent, c);
  if (c == parent.chain_blocks && parent.chain_open && plan.cut == nullptr &&
      plan.num_tokens >= base) {
    // Keeps the parent's whole chain (and its partial last block, if kept).
    child->chain_open = true;
    child->chain_tail.assign(
        parent.chain_tail.begin(),
        parent.chain_tail.begin() +
            static_cast<ptrdiff_t>(std::min<uint64_t>(parent.chain_tail.size(),
                                                      plan.num_tokens - base)));
    return;
  }
  child->chain_open = plan.num_tokens == base;
}

void ManagerCore::UnsealLastLocked(SequenceRecord* s) {
  BlockRecord* last = s->blocks.back();
  if (last->prefix_hash.empty()) return;
  prefix_.Remove(last);
  last->prefix_hash.clear();
  last->token_ids.clear();
  const uint32_t index = static_cast<uint32_t>(s->blocks.size() - 1);
  if (s->chain_blocks > index) {
    // Its token ids are not kept: the chain cannot continue past it.
    s->chain_blocks = index;
    s->chain_open = false;
    s->chain_tail.clear();
  }
}

void ManagerCore::TruncateChainLocked(SequenceRecord* s) {
  const uint32_t T = s->block_tokens;
  const bool was_open = s->chain_open;
  const uint32_t was_blocks = s->chain_blocks;
  // A last block that is not full (cut, or partial and now last) may grow:
  // its hash no longer holds.
  if (s->blocks.back()->num_tokens != T) UnsealLastLocked(s);
  uint32_t c = 0;
  while (c < s->chain_blocks && c < s->blocks.size() &&
         !s->blocks[c]->prefix_hash.empty()) {
    ++c;
  }
  const uint64_t base = ChainEnd(*s, c);
  if (was_open && s->chain_open && c == was_blocks) {
    s->chain_tail.resize(s->num_tokens - base);
  } else {
    s->chain_open = s->num_tokens == base;
    s->chain_tail.clear();
  }
  s->chain_blocks = c;
}

void ManagerCore::DropUnusablePrefixesLocked(const std::vector<Event>& ev) {
  for (const Event& e : ev) {
    if (e.kind != EventKind::kBlockSpilled &&
        e.kind != EventKind::kBlockEvicted) {
      continue;
    }
    if (BlockRecord* b = sequences_.FindBlock(e.lineage_id)) prefix_.Remove(b);
  }
}

}  // namespace triax::manager
