#include "client/frontend/llama2c.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <queue>
#include <random>
#include <sstream>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace triax::frontend {

uint64_t ModelConfig::NumWeights() const {
  // In 128 bits: a hostile header's dimensions (each < 2^31) must not wrap
  // around to a count that matches the file's size. Saturates at 2^64 - 1,
  // which no file matches.
  using U = unsigned __int128;
  const U d = dim, h = hidden_dim, l = n_layers, v = vocab_size;
  const U kv = static_cast<U>(n_kv_heads) * (n_heads > 0 ? dim / n_heads : 0);
  U n = l * d * 2 + d + v * d;            // norms, final norm, embeddings
  n += l * (d * d + kv * d * 2 + d * d);  // wq, wk, wv, wo
  n += l * h * d * 3;                     // w1, w2, w3
  if (!shared_classifier) n += v * d;
  return n > UINT64_MAX / 4 ? UINT64_MAX : static_cast<uint64_t>(n);
}

absl::Status ValidateConfig(const ModelConfig& c) {
  const std::pair<const char*, int> dims[] = {{"dim", c.dim},
                                              {"hidden_dim", c.hidden_dim},
                                              {"n_layers", c.n_layers},
                                              {"n_heads", c.n_heads},
                                              {"n_kv_heads", c.n_kv_heads},
                                              {"vocab_size", c.vocab_size},
                                              {"max_seq_len", c.max_seq_len}};
  for (const auto& [field, value] : dims) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model header field ", field, " = ", value, "; must be positive"));
    }
  }
  if (c.dim % c.n_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model header: dim = ", c.dim,
                     " is not a multiple of n_heads = ", c.n_heads));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model header: n_heads = ", c.n_heads,
                     " is not a multiple of n_kv_heads = ", c.n_kv_heads));
  }
  if (c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model header: head_dim = ", c.head_dim(), " must be even for RoPE"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad())
    return absl::DataLossError(absl::StrCat("read error on ", path));
  return ss.str();
}

namespace {

void SetViews(Model* m) {
  const ModelConfig& c = m->config;
  const size_t d = c.dim, h = c.hidden_dim, l = c.n_layers, v = c.vocab_size;
  const size_t kv = c.kv_dim();
  const float* p = m->storage.data();
  auto take = [&p](size_t n) {
    const float* r = p;
    p += n;
    return r;
  };
  m->attention_norm = take(l * d);
  m->ffn_norm = take(l * d);
  m->final_norm = take(d);
  m->tok_embeddings = take(v * d);
  m->wq = take(l * d * d);
  m->wk = take(l * kv * d);
  m->wv = take(l * kv * d);
  m->wo = take(l * d * d);
  m->w1 = take(l * h * d);
  m->w2 = take(l * d * h);
  m->w3 = take(l * h * d);
  m->classifier = c.shared_classifier ? m->tok_embeddings : take(v * d);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> ParseModel(absl::string_view bytes,
                                                  absl::string_view name) {
  if (bytes.size() < static_cast<size_t>(kLlama2cHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": file has ", bytes.size(), " bytes, less than the ",
        kLlama2cHeaderBytes, "-byte llama2.c v1 header"));
  }
  uint32_t magic;
  int32_t ints[8];
  std::memcpy(&magic, bytes.data(), 4);
  std::memcpy(ints, bytes.data() + 4, sizeof(ints));
  if (magic != kLlama2cMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: magic = 0x%08x, want 0x%08x (\"ak42\", llama2.c version 1)", name,
        magic, kLlama2cMagic));
  }
  if (ints[0] != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": version = ", ints[0], ", only version 1 (fp32) is supported"));
  }
  auto m = std::make_unique<Model>();
  m->name = std::string(name);
  ModelConfig& c = m->config;
  c.dim = ints[1];
  c.hidden_dim = ints[2];
  c.n_layers = ints[3];
  c.n_heads = ints[4];
  c.n_kv_heads = ints[5];
  c.vocab_size = ints[6];
  c.max_seq_len = ints[7];
  c.shared_classifier = static_cast<uint8_t>(bytes[36]) != 0;
  if (absl::Status s = ValidateConfig(c); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", s.message()));
  }
  const uint64_t weights = c.NumWeights();
  const uint64_t want =
      weights == UINT64_MAX ? UINT64_MAX : kLlama2cHeaderBytes + weights * 4;
  if (bytes.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": file size = ", bytes.size(),
        " bytes, the header's shape needs ", want,
        " (shared_classifier = ", c.shared_classifier ? 1 : 0, ")"));
  }
  m->storage.resize(c.NumWeights());
  std::memcpy(m->storage.data(), bytes.data() + kLlama2cHeaderBytes,
              m->storage.size() * 4);
  SetViews(m.get());
  return m;
}

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& path) {
  auto bytes = ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  return ParseModel(*bytes, path);
}

std::unique_ptr<Model> MakeSyntheticModel(const ModelConfig& config,
                                          uint64_t seed) {
  auto m = std::make_unique<Model>();
  m->name = absl::StrCat("synthetic-seed", seed);
  m->config = config;
  m->storage.resize(config.NumWeights());
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (float& w : m->storage) w = normal(rng);
  SetViews(m.get());
  // Norm gains of 1, as a freshly initialised model has.
  const size_t norms =
      static_cast<size_t>(config.n_layers) * config.dim * 2 + config.dim;
  std::fill(m->storage.begin(), m->storage.begin() + norms, 1.0f);
  return m;
}

// ---------------------------------------------------------------------------
// BpeTokenizer

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(
    const std::string& path, int vocab_size) {
  auto bytes_or = ReadFile(path);
  if (!bytes_or.ok()) return bytes_or.status();
  const std::string& b = *bytes_or;
  // Encode() starts with BOS (id 1) and run.c's ids 0..2 are <unk>, <s>,
  // </s>: a smaller vocabulary would have Encode index past its end.
  if (vocab_size < 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer vocab_size = ", vocab_size,
                     "; must be at least 3 (<unk>, <s>, </s>)"));
  }
  size_t off = 0;
  auto read = [&](void* dst, size_t n) {
    if (off + n > b.size()) return false;
    std::memcpy(dst, b.data() + off, n);
    off += n;
    return true;
  };
  int32_t max_len;
  if (!read(&max_len, 4)) {
    return absl::DataLossError(absl::StrCat(path, ": truncated header"));
  }
  // Every entry takes at least 8 bytes (score, length): a vocab_size the file
  // cannot hold is refused before anything is allocated for it.
  // (The message names the first token that cannot fit, as the loop would.)
  if (const size_t fit = (b.size() - off) / 8;
      fit < static_cast<size_t>(vocab_size)) {
    return absl::DataLossError(absl::StrCat(path, ": truncated at token ", fit,
                                            " of vocab_size ", vocab_size));
  }
  auto t = absl::WrapUnique(new BpeTokenizer());
  t->vocab_.resize(vocab_size);
  t->scores_.resize(vocab_size);
  for (int i = 0; i < vocab_size; ++i) {
    int32_t len;
    if (!read(&t->scores_[i], 4) || !read(&len, 4)) {
      return absl::DataLossError(absl::StrCat(path, ": truncated at token ", i,
                                              " of vocab_size ", vocab_size));
    }
    if (len < 0 || len > (1 << 16)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": token ", i, " has length ", len));
    }
    if (off + len > b.size()) {
      return absl::DataLossError(absl::StrCat(path, ": truncated in token ", i,
                                              " of vocab_size ", vocab_size));
    }
    // run.c keeps tokens as C strings: bytes after a NUL are invisible.
    std::string piece(b.data() + off, len);
    off += len;
    piece = piece.substr(0, std::strlen(piece.c_str()));
    t->vocab_[i] = piece;
    t->index_.emplace(piece, i);  // first id wins for duplicate pieces
  }
  return t;
}

int BpeTokenizer::Lookup(absl::string_view s) const {
  auto it = index_.find(s);
  return it == index_.end() ? -1 : it->second;
}

std::vector<int> BpeTokenizer::Encode(absl::string_view text, bool bos) const {
  // run.c stops at the first NUL of its C string.
  text = text.substr(0, std::min(text.size(), text.find('\0')));
  std::vector<int> tokens;
  if (bos) tokens.push_back(1);
  // run.c would push -1 for a missing " " and byte + 3 past the vocabulary,
  // then index its vocabulary with them; here the prefix is left out and such
  // a byte becomes 0 (<unk>), so every id is in range (a hostile or truncated
  // tokenizer.bin; same result as run.c for every well-formed one).
  if (!text.empty()) {
    const int dummy = Lookup(" ");
    if (dummy != -1) tokens.push_back(dummy);
  }
  // Code points (at most 4 bytes, as run.c groups continuation bytes).
  std::string buf;
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = text[i];
    if ((c & 0xC0) != 0x80) buf.clear();
    buf.push_back(static_cast<char>(c));
    const bool next_cont =
        i + 1 < text.size() &&
        (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80;
    if (next_cont && buf.size() < 4) continue;
    const int id = Lookup(buf);
    if (id != -1) {
      tokens.push_back(id);
    } else {
      for (unsigned char byte : buf) {
        tokens.push_back(byte + 3 < vocab_size() ? byte + 3 : 0);
      }
    }
    buf.clear();
  }

  // Merges: a doubly linked list plus a max-heap of candidate pairs ordered by
  // (score desc, original position asc). Positions keep their relative order
  // under merges, so this picks exactly the pair run.c's rescan picks.
  const int n = static_cast<int>(tokens.size());
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    float score;
    int left;
    int left_id, right_id, merged;
  };
  auto worse = [](const Cand& a, const Cand& b) {
    if (a.score != b.score) return a.score < b.score;
    return a.left > b.left;
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
  auto push = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    const int right = next[left];
    const int id = Lookup(vocab_[tokens[left]] + vocab_[tokens[right]]);
    if (id != -1)
      heap.push({scores_[id], left, tokens[left], tokens[right], id});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int l = c.left;
    if (!alive[l] || tokens[l] != c.left_id) continue;
    const int r = next[l];
    if (r < 0 || tokens[r] != c.right_id) continue;
    // run.c merges only pairs scoring above -1e10.
    if (!(c.score > -1e10f)) continue;
    tokens[l] = c.merged;
    alive[r] = false;
    next[l] = next[r];
    if (next[r] >= 0) prev[next[r]] = l;
    push(prev[l]);
    push(l);
  }
  std::vector<int> out;
  out.reserve(n);
  for (int i = (n > 0 ? 0 : -1); i >= 0; i = next[i]) out.push_back(tokens[i]);
  return out;
}

std::string BpeTokenizer::Decode(int prev_token, int token) const {
  if (token < 0 || token >= vocab_size()) return "";
  absl::string_view piece = vocab_[token];
  if (prev_token == 1 && !piece.empty() && piece[0] == ' ')
    piece.remove_prefix(1);
  unsigned char byte_val;
  // sscanf needs a NUL-terminated copy.
  std::string copy(piece);
  if (std::sscanf(copy.c_str(), "<0x%02hhX>", &byte_val) == 1) {
    return std::string(1, static_cast<char>(byte_val));
  }
  return copy;
}

std::string BpeTokenizer::Printable(int prev_token, int token) const {
  std::string piece = Decode(prev_token, token);
  // safe_printf: a NUL-terminated string; a lone byte must be printable or
  // whitespace.
  piece = piece.substr(0, std::strlen(piece.c_str()));
  if (piece.size() == 1) {
    const unsigned char b = piece[0];
    if (!(std::isprint(b) || std::isspace(b))) return "";
  }
  return piece;
}

// ---------------------------------------------------------------------------
// ByteTokenizer

std::vector<int> ByteTokenizer::Encode(absl::string_view text, bool bos) const {
  std::vector<int> out;
  out.reserve(text.size() + 1);
  if (bos) out.push_back(kBos);
  for (unsigned char c : text) out.push_back(c);
  return out;
}

std::string ByteTokenizer::Printable(int prev_token, int token) const {
  if (token < 0 || token > 255) return "";
  return std::string(1, static_cast<char>(token));
}

}  // namespace triax::frontend
