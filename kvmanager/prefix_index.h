// Prefix reuse by content hash (docs/manager.md "Prefix reuse").
//
// The blocks at the head of a sequence whose token ids are known get content
// hashes chained over their parents' hashes, so that equal hashes mean equal
// token prefixes cut into equal blocks (same model, same salt). The hash of
// block i (its n tokens; n = block_tokens for a full block) is SHA-256 over
//
//   parent      32 bytes: the hash of block i-1; 32 zero bytes for i = 0
//   model_len   u32 little-endian, then model: ModelIdentity(shape)
//   salt_len    u32 little-endian, then salt: PrefixSalt(tenant)
//   n           u32 little-endian: the block's tokens
//   tokens      n x u32 little-endian token ids
//
// and all 32 bytes are kept. A block is hashed once it is sealed: full, or
// followed by another block (blocks are span-aligned, so a span's last
// block may be partial; once a block follows it, it never grows). A
// partial last block waits. For a prompt whose blocks are all full (one
// span, or spans of multiples of block_tokens) the chain is the usual one
// over fixed chunks of block_tokens tokens (ChainHashes); otherwise a
// router needs the block boundaries (the plan's first_token / num_tokens).
// A chain stops at the first token id the manager was not given.
//
// Salts: a tenant's salt is "tenant/<tenant_id>" (private: no other tenant
// computes it) unless it opted into a shared salt at CreateTenant
// (prefix_salt S): then "shared/<S>", the same for every tenant that chose
// S. Ids never contain '/', so the two kinds cannot collide.
//
// PrefixIndex maps a hash to the live blocks that carry it and are usable
// as a prefix (sealed, on the device, not evicted). A block leaves the
// index when it is freed, spilled, evicted, cut by a truncation, or grown
// again (a truncation made it the last block); it never comes back (a
// restored block is not re-indexed).
//
// Thread contract: not thread-safe; ManagerCore calls it with mu_ held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvmanager/manager_state.h"
#include "kvmanager/types.h"

namespace triax::manager {

inline constexpr size_t kPrefixHashBytes = 32;

// "<name>/<n_layers>/<n_kv_heads>/<n_q_heads>/<head_dim>".
std::string ModelIdentity(const ModelShape& model);
// The salt bytes of a tenant (see above); prefix_salt empty: private.
std::string PrefixSalt(const std::string& tenant_id,
                       const std::string& prefix_salt);
// The hash of one block holding `tokens`: parent is empty (block 0) or 32
// bytes.
std::string BlockHash(const std::string& parent, const std::string& model,
                      const std::string& salt,
                      absl::Span<const uint32_t> tokens);
// Hashes of the leading floor(tokens.size() / block_tokens) full blocks of
// block_tokens tokens, chained from `parent` (empty for a chain from token
// 0).
std::vector<std::string> ChainHashes(const std::string& parent,
                                     const std::string& model,
                                     const std::string& salt,
                                     uint32_t block_tokens,
                                     absl::Span<const uint32_t> tokens);
// Lowercase hex of a hash (events, logs).
std::string HashHex(const std::string& hash);

class PrefixIndex {
 public:
  // Indexes `b` under b->prefix_hash (non-empty); no-op when indexed.
  void Add(BlockRecord* b);
  // Drops `b` from the index (prefix_indexed false); no-op when it is not.
  void Remove(BlockRecord* b);
  // The indexed blocks with this hash (nullptr: none).
  const std::vector<BlockRecord*>* Find(const std::string& hash) const {
    auto it = map_.find(hash);
    return it == map_.end() ? nullptr : &it->second;
  }
  // Indexed blocks.
  size_t size() const { return blocks_; }

 private:
  absl::flat_hash_map<std::string, std::vector<BlockRecord*>> map_;
  size_t blocks_ = 0;
};

}  // namespace triax::manager
