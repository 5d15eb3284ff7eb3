#include "client/frontend/llama2c.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/frontend/test_data.h"
#include "common/status_matchers.h"

namespace triax::frontend {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::StatusIs;

// run.c's encode(), verbatim in spirit: rescan all pairs after every merge.
std::vector<int> NaiveEncode(const BpeTokenizer& t, const std::string& text,
                             bool bos) {
  auto lookup = [&](const std::string& s) {
    for (int i = 0; i < t.vocab_size(); ++i) {
      if (t.piece(i) == s) return i;
    }
    return -1;
  };
  std::vector<int> tokens;
  if (bos) tokens.push_back(1);
  if (!text.empty()) tokens.push_back(lookup(" "));
  std::string buf;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) buf.clear();
    buf.push_back(text[i]);
    if (i + 1 < text.size() &&
        (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80 &&
        buf.size() < 4) {
      continue;
    }
    int id = lookup(buf);
    if (id != -1) {
      tokens.push_back(id);
    } else {
      for (unsigned char b : buf) tokens.push_back(b + 3);
    }
    buf.clear();
  }
  while (true) {
    int best_idx = -1, best_id = -1;
    float best_score = -1e10f;
    for (size_t i = 0; i + 1 < tokens.size(); ++i) {
      const int id = lookup(t.piece(tokens[i]) + t.piece(tokens[i + 1]));
      if (id == -1) continue;
      const float score = t.score(id);
      if (score > best_score) {
        best_score = score;
        best_id = id;
        best_idx = static_cast<int>(i);
      }
    }
    if (best_idx == -1) break;
    tokens[best_idx] = best_id;
    tokens.erase(tokens.begin() + best_idx + 1);
  }
  return tokens;
}

class BpeTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TestDataDir();
    TRIAX_REQUIRE_DATA_DIR(dir_);
    auto t =
        BpeTokenizer::Load(dir_ + "/models/stories260k/tokenizer.bin", 512);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::move(*t);
  }
  std::string Decode(const std::vector<int>& ids) {
    std::string s;
    for (size_t i = 1; i < ids.size(); ++i)
      s += tok_->Decode(ids[i - 1], ids[i]);
    return s;
  }
  std::string dir_;
  std::unique_ptr<BpeTokenizer> tok_;
};

TEST_F(BpeTokenizerTest, EmptyTextIsJustBos) {
  EXPECT_EQ(tok_->Encode("", true), std::vector<int>{1});
  EXPECT_TRUE(tok_->Encode("", false).empty());
}

TEST_F(BpeTokenizerTest, KnownStringsRoundTrip) {
  for (const std::string text :
       {"Once upon a time, there was a little girl named Lily.",
        "She loved to play outside in the park.", "Hello world!\nNew line",
        "\xc3\xa9t\xc3\xa9 caf\xc3\xa9 \xe2\x82\xac 100", "a"}) {
    const std::vector<int> ids = tok_->Encode(text, true);
    ASSERT_GE(ids.size(), 2u);
    EXPECT_EQ(ids[0], 1);
    // run.c drops the dummy-prefix space after BOS when decoding.
    EXPECT_EQ(Decode(ids), text) << text;
  }
  // Known pieces: "Once" is one merged token in this vocab, with a leading
  // space from the dummy prefix.
  const std::vector<int> ids = tok_->Encode("Once upon a time", true);
  EXPECT_EQ(tok_->piece(ids[1]), " Once");
  EXPECT_LE(ids.size(), 6u);
}

TEST_F(BpeTokenizerTest, ByteFallbackForUnknownCharacters) {
  // U+4E2D is not in a 512-token vocab: its three UTF-8 bytes fall back to
  // ids byte + 3, whose pieces are "<0xXX>" and decode to the raw bytes.
  const std::vector<int> ids = tok_->Encode("\xe4\xb8\xad", false);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(tok_->piece(ids.back()), "<0xAD>");
  EXPECT_EQ(tok_->Decode(0, 0xAD + 3), "\xad");
  // safe_printf drops unprintable lone bytes.
  EXPECT_EQ(tok_->Printable(0, 0xAD + 3), "");
  EXPECT_EQ(tok_->Printable(0, 'A' + 3), "A");
}

TEST_F(BpeTokenizerTest, HeapMergeEqualsRunCRescan) {
  std::mt19937 rng(20240611);
  const std::string alphabet = "abcdefghijklmnopqrstuvwxyz  ,.!'\nLOT";
  for (int trial = 0; trial < 60; ++trial) {
    std::string text;
    const int len = 1 + rng() % 60;
    for (int i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
    EXPECT_EQ(tok_->Encode(text, true), NaiveEncode(*tok_, text, true)) << text;
  }
}

TEST(BpeTokenizerErrors, MissingAndTruncatedFiles) {
  EXPECT_THAT(BpeTokenizer::Load("/nonexistent/tokenizer.bin", 512),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nonexistent")));
  const std::string path = ::testing::TempDir() + "/short_tokenizer.bin";
  {
    FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const int32_t max_len = 4;
    const float score = 0;
    const int32_t len = 1;
    std::fwrite(&max_len, 4, 1, f);
    for (const char* piece : {"a", "b", "c"}) {
      std::fwrite(&score, 4, 1, f);
      std::fwrite(&len, 4, 1, f);
      std::fwrite(piece, 1, 1, f);
    }
    std::fclose(f);
  }
  EXPECT_THAT(BpeTokenizer::Load(path, 4),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("token 3")));
  auto three = BpeTokenizer::Load(path, 3);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ((*three)->piece(0), "a");
  // No " ", and 'x' + 3 is past the vocabulary: BOS, then <unk>.
  EXPECT_EQ((*three)->Encode("x", true), (std::vector<int>{1, 0}));
}

// BOS is id 1 and Encode() merges pieces by id: fewer than <unk>, <s>, </s>
// is refused (the fuzzer's vocab_size 1 read past the vocabulary).
TEST(BpeTokenizerErrors, VocabularyTooSmallForSpecialTokens) {
  const std::string path = ::testing::TempDir() + "/tiny_tokenizer.bin";
  {
    FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const int32_t max_len = 4;
    const float score = 0;
    const int32_t len = 0;
    std::fwrite(&max_len, 4, 1, f);
    for (int i = 0; i < 2; ++i) {
      std::fwrite(&score, 4, 1, f);
      std::fwrite(&len, 4, 1, f);
    }
    std::fclose(f);
  }
  for (int vocab_size : {-1, 0, 1, 2}) {
    EXPECT_THAT(BpeTokenizer::Load(path, vocab_size),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("vocab_size = ", vocab_size))));
  }
}

TEST(ByteTokenizerTest, BytesAndSpecials) {
  ByteTokenizer t;
  EXPECT_EQ(t.Encode("Hi\n", true), (std::vector<int>{256, 'H', 'i', '\n'}));
  EXPECT_EQ(t.Encode("\xff", false), std::vector<int>{255});
  EXPECT_EQ(t.Printable(256, 'x'), "x");
  EXPECT_EQ(t.Printable(0, ByteTokenizer::kEos), "");
  EXPECT_EQ(t.vocab_size(), 260);
}

std::string Header(uint32_t magic, int32_t version, const int32_t dims[7],
                   uint8_t shared) {
  std::string h(kLlama2cHeaderBytes, '\0');
  std::memcpy(&h[0], &magic, 4);
  std::memcpy(&h[4], &version, 4);
  std::memcpy(&h[8], dims, 28);
  h[36] = static_cast<char>(shared);
  return h;
}

TEST(ModelParseTest, RejectsBadMagicVersionShapeAndSize) {
  const int32_t dims[7] = {8, 16, 1, 2, 1, 10, 32};
  ModelConfig c;
  c.dim = 8;
  c.hidden_dim = 16;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.vocab_size = 10;
  c.max_seq_len = 32;
  c.shared_classifier = true;
  const std::string body(c.NumWeights() * 4, '\0');

  EXPECT_THAT(
      ParseModel("abc", "m"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("256-byte")));
  EXPECT_THAT(ParseModel(Header(0x12345678, 1, dims, 1) + body, "m"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("magic")));
  EXPECT_THAT(
      ParseModel(Header(kLlama2cMagic, 2, dims, 1) + body, "m"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version = 2")));
  EXPECT_THAT(
      ParseModel(Header(kLlama2cMagic, 1, dims, 1) + body + "x", "m"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("file size")));
  // Not shared: the classifier is missing from the file.
  EXPECT_THAT(ParseModel(Header(kLlama2cMagic, 1, dims, 0) + body, "m"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shared_classifier = 0")));
  const int32_t bad[7] = {8, 16, 1, 3, 1, 10, 32};
  EXPECT_THAT(
      ParseModel(Header(kLlama2cMagic, 1, bad, 1) + body, "m"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n_heads = 3")));
  auto ok = ParseModel(Header(kLlama2cMagic, 1, dims, 1) + body, "m");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->classifier, (*ok)->tok_embeddings);
  EXPECT_EQ((*ok)->config.head_dim(), 4);
}

TEST(ModelLoadTest, RealModelsHaveTheDocumentedShapes) {
  const std::string dir = TestDataDir();
  TRIAX_REQUIRE_DATA_DIR(dir);
  auto s = LoadModel(dir + "/models/stories260k/model.bin");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->config.dim, 64);
  EXPECT_EQ((*s)->config.n_layers, 5);
  EXPECT_EQ((*s)->config.n_kv_heads, 4);
  EXPECT_EQ((*s)->config.vocab_size, 512);
  auto k = LoadModel(dir + "/models/kvproxy-18m/model.bin");
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ((*k)->config.head_dim(), 128);
  EXPECT_FALSE((*k)->config.shared_classifier);
  EXPECT_EQ((*k)->config.max_seq_len, 2048);
  EXPECT_THAT(LoadModel(dir + "/models/nope.bin"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope.bin")));
}

}  // namespace
}  // namespace triax::frontend
