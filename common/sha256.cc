#include "common/sha256.h"

// OpenSSL's SHA256_Init/Update/Final (deprecated in 3.0, kept in 3.x): the
// same assembly as the EVP path (SHA-NI where the CPU has it) without the
// provider dispatch and context allocation per call; a SHA256_CTX is a
// plain struct, so a key's HMAC states are copied by value.
#define OPENSSL_SUPPRESS_DEPRECATED 1
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cstring>
#include <utility>

namespace triax {
namespace {

constexpr size_t kBlockBytes = 64;
constexpr size_t kDigestBytes = 32;

// Digest of what `from` has absorbed followed by `data`; `from` unchanged.
void FinishFrom(const SHA256_CTX& from, absl::string_view data,
                unsigned char* md) {
  SHA256_CTX c = from;
  SHA256_Update(&c, data.data(), data.size());
  SHA256_Final(md, &c);
  OPENSSL_cleanse(&c, sizeof(c));
}

}  // namespace

std::string Sha256(absl::string_view in) {
  unsigned char md[kDigestBytes];
  // Not the one-shot SHA256(), which goes through EVP in OpenSSL 3.
  SHA256_CTX c;
  SHA256_Init(&c);
  SHA256_Update(&c, in.data(), in.size());
  SHA256_Final(md, &c);
  return std::string(reinterpret_cast<const char*>(md), kDigestBytes);
}

struct HmacSha256::State {
  SHA256_CTX inner;  // after absorbing key ^ ipad
  SHA256_CTX outer;  // after absorbing key ^ opad
};

HmacSha256::HmacSha256(absl::string_view key) : state_(new State) {
  unsigned char block[kBlockBytes] = {};
  std::string hashed;
  if (key.size() > kBlockBytes) {
    hashed = Sha256(key);
    key = hashed;
  }
  std::memcpy(block, key.data(), key.size());
  unsigned char pad[kBlockBytes];
  for (auto [ctx, byte] :
       {std::pair{&state_->inner, 0x36}, std::pair{&state_->outer, 0x5c}}) {
    for (size_t i = 0; i < kBlockBytes; ++i) pad[i] = block[i] ^ byte;
    SHA256_Init(ctx);
    SHA256_Update(ctx, pad, kBlockBytes);
  }
  OPENSSL_cleanse(block, sizeof(block));
  OPENSSL_cleanse(pad, sizeof(pad));
  if (!hashed.empty()) OPENSSL_cleanse(hashed.data(), hashed.size());
}

HmacSha256::~HmacSha256() { OPENSSL_cleanse(state_.get(), sizeof(State)); }

std::string HmacSha256::Mac(absl::string_view message) const {
  unsigned char inner[kDigestBytes];
  FinishFrom(state_->inner, message, inner);
  unsigned char mac[kDigestBytes];
  FinishFrom(
      state_->outer,
      absl::string_view(reinterpret_cast<const char*>(inner), kDigestBytes),
      mac);
  return std::string(reinterpret_cast<const char*>(mac), kDigestBytes);
}

}  // namespace triax
