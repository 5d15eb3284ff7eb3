#include "kvmanager/prefix_index.h"

#include <openssl/evp.h>

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace triax::manager {

namespace {

void PutU32(uint32_t v, std::string* out) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

}  // namespace

std::string ModelIdentity(const ModelShape& model) {
  return absl::StrCat(model.name, "/", model.n_layers, "/", model.n_kv_heads,
                      "/", model.n_q_heads, "/", model.head_dim);
}

std::string PrefixSalt(const std::string& tenant_id,
                       const std::string& prefix_salt) {
  return prefix_salt.empty() ? absl::StrCat("tenant/", tenant_id)
                             : absl::StrCat("shared/", prefix_salt);
}

std::string BlockHash(const std::string& parent, const std::string& model,
                      const std::string& salt,
                      absl::Span<const uint32_t> tokens) {
  std::string in;
  in.reserve(kPrefixHashBytes + 12 + model.size() + salt.size() +
             4 * tokens.size());
  if (parent.empty()) {
    in.append(kPrefixHashBytes, '\0');
  } else {
    in.append(parent);
  }
  PutU32(static_cast<uint32_t>(model.size()), &in);
  in.append(model);
  PutU32(static_cast<uint32_t>(salt.size()), &in);
  in.append(salt);
  PutU32(static_cast<uint32_t>(tokens.size()), &in);
  for (uint32_t t : tokens) PutU32(t, &in);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(in.data(), in.size(), md, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), len);
}

std::vector<std::string> ChainHashes(const std::string& parent,
                                     const std::string& model,
                                     const std::string& salt,
                                     uint32_t block_tokens,
                                     absl::Span<const uint32_t> tokens) {
  std::vector<std::string> out;
  if (block_tokens == 0) return out;
  out.reserve(tokens.size() / block_tokens);
  std::string prev = parent;
  for (size_t at = 0; at + block_tokens <= tokens.size(); at += block_tokens) {
    prev = BlockHash(prev, model, salt, tokens.subspan(at, block_tokens));
    out.push_back(prev);
  }
  return out;
}

std::string HashHex(const std::string& hash) {
  return absl::BytesToHexString(hash);
}

void PrefixIndex::Add(BlockRecord* b) {
  if (b->prefix_indexed || b->prefix_hash.empty()) return;
  map_[b->prefix_hash].push_back(b);
  b->prefix_indexed = true;
  ++blocks_;
}

void PrefixIndex::Remove(BlockRecord* b) {
  if (!b->prefix_indexed) return;
  b->prefix_indexed = false;
  auto it = map_.find(b->prefix_hash);
  if (it == map_.end()) return;
  auto& v = it->second;
  v.erase(std::remove(v.begin(), v.end(), b), v.end());
  if (v.empty()) map_.erase(it);
  --blocks_;
}

}  // namespace triax::manager
