// llama2.c "version 1" model files and the two tokenizers the reference
// frontend needs.
//
// Model file: a 256-byte header (uint32 magic 0x616b3432 "ak42", int32
// version 1, int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads,
// vocab_size, max_seq_len, uint8 shared_classifier, zero padding), then fp32
// little-endian tensors, row-major [out][in] (y = W x):
//   attention_norm [L][dim], ffn_norm [L][dim], norm [dim],
//   tok_embeddings [vocab][dim], wq [L][dim][dim], wk [L][kv_dim][dim],
//   wv [L][kv_dim][dim], wo [L][dim][dim], w1 [L][hidden][dim],
//   w2 [L][dim][hidden], w3 [L][hidden][dim], output [vocab][dim] (absent
//   when shared_classifier: the embeddings are the classifier).
// kv_dim = n_kv_heads * head_dim, head_dim = dim / n_heads.
//
// Errors: NOT_FOUND (file missing), INVALID_ARGUMENT (bad magic, version,
// shape, or a size that does not match the header; the message names the
// field, the value and the expected one), DATA_LOSS (short read).
//
// Thread contract: a loaded Model and the tokenizers are immutable and may be
// shared by any number of threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace triax::frontend {

inline constexpr uint32_t kLlama2cMagic = 0x616b3432;
inline constexpr int kLlama2cHeaderBytes = 256;

struct ModelConfig {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int max_seq_len = 0;
  bool shared_classifier = false;

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
  // Number of fp32 values after the header.
  uint64_t NumWeights() const;
};

// INVALID_ARGUMENT unless every dimension is positive, n_heads divides dim,
// n_kv_heads divides n_heads and head_dim is even.
absl::Status ValidateConfig(const ModelConfig& c);

struct Model {
  std::string name;
  ModelConfig config;
  std::vector<float> storage;  // every tensor, in file order
  // Views into `storage` (shapes as in the file comment above).
  const float* attention_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* final_norm = nullptr;
  const float* tok_embeddings = nullptr;
  const float* wq = nullptr;
  const float* wk = nullptr;
  const float* wv = nullptr;
  const float* wo = nullptr;
  const float* w1 = nullptr;
  const float* w2 = nullptr;
  const float* w3 = nullptr;
  const float* classifier = nullptr;
};

// Reads a model file (see the header comment for the format and errors).
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path);
// Parses the bytes of a model file; `name` is used in messages.
absl::StatusOr<std::unique_ptr<Model>> ParseModel(absl::string_view bytes,
                                                  absl::string_view name);
// A model with N(0, 0.05) weights (norm gains 1) from a fixed seed, for runs
// without the data directory.
std::unique_ptr<Model> MakeSyntheticModel(const ModelConfig& config,
                                          uint64_t seed);

// Token ids <-> text.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int vocab_size() const = 0;
  virtual int bos_id() const = 0;
  // Token ids of `text`, with BOS first when `bos`.
  virtual std::vector<int> Encode(absl::string_view text, bool bos) const = 0;
  // The bytes run.c prints for `token` following `prev_token` (decode() then
  // safe_printf(): "" for unprintable single bytes and special tokens).
  virtual std::string Printable(int prev_token, int token) const = 0;
};

// llama2.c's tokenizer.bin: int32 max_token_length, then per token float32
// score, int32 length, bytes. Encode() is run.c's encode() (dummy-prefix space
// when the text is non-empty, UTF-8 code points looked up whole, byte
// fallback to id byte+3, then repeated merge of the best-scoring adjacent pair,
// leftmost on ties) done with a heap instead of rescans, same result. A
// vocabulary without " " gets no dummy prefix and one too small for a byte's
// fallback id gets 0 for it, where run.c would index out of bounds.
// Only Load() makes one, so every tokenizer holds <unk>, <s>, </s> (ids 0..2)
// and BOS is always a valid id.
class BpeTokenizer : public Tokenizer {
 public:
  // Reads `vocab_size` entries (the model's vocab_size, as run.c does).
  // NOT_FOUND, DATA_LOSS (truncated), INVALID_ARGUMENT (vocab_size below 3,
  // negative length).
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Load(
      const std::string& path, int vocab_size);

  int vocab_size() const override { return static_cast<int>(vocab_.size()); }
  int bos_id() const override { return 1; }
  std::vector<int> Encode(absl::string_view text, bool bos) const override;
  std::string Printable(int prev_token, int token) const override;
  // run.c's decode(): the piece, without its leading space after BOS, and
  // "<0xXX>" pieces turned into the raw byte.
  std::string Decode(int prev_token, int token) const;
  const std::string& piece(int id) const { return vocab_[id]; }
  float score(int id) const { return scores_[id]; }

 private:
  BpeTokenizer() = default;
  int Lookup(absl::string_view s) const;  // -1 when absent

  std::vector<std::string> vocab_;
  std::vector<float> scores_;
  absl::flat_hash_map<std::string, int> index_;
};

// kvproxy-18m's byte-level tokenizer: ids 0..255 are bytes, then BOS, EOS,
// IMAGE, PAD.
class ByteTokenizer : public Tokenizer {
 public:
  static constexpr int kBos = 256;
  static constexpr int kEos = 257;
  static constexpr int kImage = 258;
  static constexpr int kPad = 259;
  int vocab_size() const override { return 260; }
  int bos_id() const override { return kBos; }
  std::vector<int> Encode(absl::string_view text, bool bos) const override;
  // The byte itself; "" for special tokens.
  std::string Printable(int prev_token, int token) const override;
};

// Reads a whole file. NOT_FOUND / DATA_LOSS.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace triax::frontend
