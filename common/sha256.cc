#include "common/sha256.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace triax {
namespace {

constexpr size_t kBlockBytes = 64;
constexpr size_t kDigestBytes = 32;

// SHA-256 fetched from the default provider once per process (freed at
// exit by OpenSSL's own cleanup).
const EVP_MD* Sha256Md() {
  static const EVP_MD* md = [] {
    EVP_MD* fetched = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    // No SHA-256 in the default provider: nothing here can work.
    if (fetched == nullptr) std::abort();
    return fetched;
  }();
  return md;
}

struct CtxDeleter {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
using Ctx = std::unique_ptr<EVP_MD_CTX, CtxDeleter>;

Ctx NewCtx() {
  Ctx c(EVP_MD_CTX_new());
  if (c == nullptr) std::abort();  // out of memory
  return c;
}

// Digest of what `from` has absorbed followed by `data`, leaving `from`
// unchanged.
void FinishFrom(const EVP_MD_CTX* from, absl::string_view data,
                unsigned char* md) {
  Ctx c = NewCtx();
  unsigned int len = 0;
  if (EVP_MD_CTX_copy_ex(c.get(), from) != 1 ||
      EVP_DigestUpdate(c.get(), data.data(), data.size()) != 1 ||
      EVP_DigestFinal_ex(c.get(), md, &len) != 1 || len != kDigestBytes) {
    std::abort();  // SHA-256 on memory does not fail
  }
}

}  // namespace

std::string Sha256(absl::string_view in) {
  unsigned char md[kDigestBytes];
  Ctx c = NewCtx();
  unsigned int len = 0;
  if (EVP_DigestInit_ex(c.get(), Sha256Md(), nullptr) != 1 ||
      EVP_DigestUpdate(c.get(), in.data(), in.size()) != 1 ||
      EVP_DigestFinal_ex(c.get(), md, &len) != 1 || len != kDigestBytes) {
    std::abort();
  }
  return std::string(reinterpret_cast<const char*>(md), kDigestBytes);
}

struct HmacSha256::State {
  Ctx inner = NewCtx();  // after absorbing key ^ ipad
  Ctx outer = NewCtx();  // after absorbing key ^ opad
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
  for (auto [ctx, byte] : {std::pair{state_->inner.get(), 0x36},
                           std::pair{state_->outer.get(), 0x5c}}) {
    for (size_t i = 0; i < kBlockBytes; ++i) pad[i] = block[i] ^ byte;
    if (EVP_DigestInit_ex(ctx, Sha256Md(), nullptr) != 1 ||
        EVP_DigestUpdate(ctx, pad, kBlockBytes) != 1) {
      std::abort();
    }
  }
  OPENSSL_cleanse(block, sizeof(block));
  OPENSSL_cleanse(pad, sizeof(pad));
}

HmacSha256::~HmacSha256() = default;

std::string HmacSha256::Mac(absl::string_view message) const {
  unsigned char inner[kDigestBytes];
  FinishFrom(state_->inner.get(), message, inner);
  unsigned char mac[kDigestBytes];
  FinishFrom(
      state_->outer.get(),
      absl::string_view(reinterpret_cast<const char*>(inner), kDigestBytes),
      mac);
  return std::string(reinterpret_cast<const char*>(mac), kDigestBytes);
}

}  // namespace triax
