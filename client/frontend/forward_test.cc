#include "client/frontend/forward.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "client/frontend/test_data.h"
#include "common/status_matchers.h"

namespace triax::frontend {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::StatusIs;

TEST(ForwardTest, StoriesGreedy200MatchesLlama2c) {
  const std::string dir = TestDataDir();
  TRIAX_REQUIRE_DATA_DIR(dir);
  auto model = LoadModel(dir + "/models/stories260k/model.bin");
  ASSERT_TRUE(model.ok()) << model.status();
  auto tok = BpeTokenizer::Load(dir + "/models/stories260k/tokenizer.bin",
                                (*model)->config.vocab_size);
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto expected = ReadFile(dir + "/models/stories260k/expected_greedy_200.txt");
  ASSERT_TRUE(expected.ok()) << expected.status();

  Transformer tf(model->get());
  LocalKvStore kv((*model)->config);
  std::vector<float> logits;
  std::string text;
  int token = 1;
  for (int pos = 0; pos < 200; ++pos) {
    ASSERT_TRUE(tf.Forward({&token, 1}, pos, &kv, &logits).ok());
    const int next = Argmax(logits.data(), (*model)->config.vocab_size);
    if (next == 1) break;
    text += (*tok)->Printable(token, next);
    token = next;
  }
  EXPECT_EQ(text, *expected);
}

TEST(ForwardTest, KvProxyMatchesReferenceLogits) {
  const std::string dir = TestDataDir();
  TRIAX_REQUIRE_DATA_DIR(dir);
  auto model = LoadModel(dir + "/models/kvproxy-18m/model.bin");
  ASSERT_TRUE(model.ok()) << model.status();
  auto ref = ReadFile(dir + "/models/kvproxy-18m/reference_logits.f32");
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_EQ(ref->size(), 64u * 260 * 4);
  const float* want = reinterpret_cast<const float*>(ref->data());
  auto wiki = ReadFile(dir + "/text/wikitext2_test.txt");
  ASSERT_TRUE(wiki.ok());
  const std::string prompt = wiki->substr(1223534, 63);
  ASSERT_EQ(prompt,
            " British conservative politician Oliver Stanley agreed to accep");
  ByteTokenizer bt;
  const std::vector<int> tokens = bt.Encode(prompt, true);
  ASSERT_EQ(tokens.size(), 64u);

  Transformer tf(model->get(), 2);
  LocalKvStore kv((*model)->config);
  std::vector<float> logits;
  ASSERT_TRUE(tf.Forward(tokens, 0, &kv, &logits).ok());
  double max_err = 0, max_abs = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    ASSERT_TRUE(std::isfinite(logits[i])) << i;
    max_err = std::max<double>(max_err, std::fabs(logits[i] - want[i]));
    max_abs = std::max<double>(max_abs, std::fabs(want[i]));
  }
  ASSERT_GT(max_abs, 1.0);
  EXPECT_LE(max_err / max_abs, 1e-4) << "max abs err " << max_err;
  for (int p = 0; p < 64; ++p) {
    EXPECT_EQ(Argmax(&logits[static_cast<size_t>(p) * 260], 260),
              Argmax(want + static_cast<size_t>(p) * 260, 260))
        << p;
  }
}

// A small synthetic GQA model keeps these tests independent of the data.
ModelConfig SmallConfig() {
  ModelConfig c;
  c.dim = 48;
  c.hidden_dim = 72;
  c.n_layers = 2;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.vocab_size = 260;
  c.max_seq_len = 128;
  return c;
}

TEST(ForwardTest, ChunkedPrefillEqualsTokenByToken) {
  auto model = MakeSyntheticModel(SmallConfig(), 7);
  ByteTokenizer bt;
  const std::vector<int> tokens =
      bt.Encode("The quick brown fox jumps over the lazy dog, twice.", true);
  std::vector<float> one, chunked, all;
  {
    Transformer tf(model.get());
    LocalKvStore kv(model->config);
    ASSERT_TRUE(tf.Prefill(tokens, 0, 1, &kv, &one).ok());
  }
  {
    Transformer tf(model.get(), 2);
    LocalKvStore kv(model->config);
    ASSERT_TRUE(tf.Prefill(tokens, 0, 7, &kv, &chunked).ok());
  }
  {
    Transformer tf(model.get());
    LocalKvStore kv(model->config);
    ASSERT_TRUE(tf.Forward(tokens, 0, &kv, &all).ok());
  }
  ASSERT_EQ(one.size(), tokens.size() * 260);
  ASSERT_EQ(chunked.size(), one.size());
  double norm = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(chunked[i], one[i], 1e-5f * (1 + std::fabs(one[i]))) << i;
    EXPECT_NEAR(all[i], one[i], 1e-5f * (1 + std::fabs(one[i]))) << i;
    norm += std::fabs(one[i]);
  }
  EXPECT_GT(norm, 0.0);
}

// The matrix products sum every output in one fixed order however tokens
// and rows are tiled (forward.cc MatMulRows), so prefill in chunks of 7 on
// 2 threads gives the very floats of token-by-token prefill.
TEST(ForwardTest, ChunkingDoesNotChangeAnyFloat) {
  auto model = MakeSyntheticModel(SmallConfig(), 11);
  ByteTokenizer bt;
  const std::vector<int> tokens = bt.Encode("Tiles of two rows by four.", true);
  std::vector<float> one, chunked;
  {
    Transformer tf(model.get());
    LocalKvStore kv(model->config);
    ASSERT_TRUE(tf.Prefill(tokens, 0, 1, &kv, &one).ok());
  }
  {
    Transformer tf(model.get(), 2);
    LocalKvStore kv(model->config);
    ASSERT_TRUE(tf.Prefill(tokens, 0, 7, &kv, &chunked).ok());
  }
  ASSERT_EQ(chunked.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_EQ(chunked[i], one[i]) << i;
}

TEST(ForwardTest, BadInputsAreErrors) {
  auto model = MakeSyntheticModel(SmallConfig(), 7);
  Transformer tf(model.get());
  LocalKvStore kv(model->config);
  std::vector<float> logits;
  EXPECT_THAT(tf.Forward({}, 0, &kv, &logits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  const int bad = 999;
  EXPECT_THAT(tf.Forward({&bad, 1}, 0, &kv, &logits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("999")));
  const int ok = 5;
  EXPECT_THAT(
      tf.Forward({&ok, 1}, 128, &kv, &logits),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_seq_len")));
  // A hole in the cache: position 3 before 0..2 exist.
  EXPECT_THAT(
      tf.Forward({&ok, 1}, 3, &kv, &logits),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 0")));
  const int64_t pos = 0;
  std::vector<float> q(48), out(48);
  EXPECT_THAT(
      kv.Attend(0, 1, &pos, q.data(), out.data()),
      StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("0 tokens written")));
}

TEST(ForwardTest, TokenNllIsLogSoftmax) {
  const float logits[3] = {1.0f, 2.0f, 3.0f};
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(TokenNll(logits, 3, 0), lse - 1.0, 1e-12);
  EXPECT_NEAR(TokenNll(logits, 3, 2), lse - 3.0, 1e-12);
  EXPECT_EQ(Argmax(logits, 3), 2);
}

TEST(ForwardTest, StoriesNllOnShortSliceIsPlausible) {
  const std::string dir = TestDataDir();
  TRIAX_REQUIRE_DATA_DIR(dir);
  auto model = LoadModel(dir + "/models/stories260k/model.bin");
  ASSERT_TRUE(model.ok()) << model.status();
  auto tok = BpeTokenizer::Load(dir + "/models/stories260k/tokenizer.bin", 512);
  ASSERT_TRUE(tok.ok());
  auto text = ReadFile(dir + "/text/tinystories_val.txt");
  ASSERT_TRUE(text.ok());
  const std::vector<int> ids = (*tok)->Encode(text->substr(0, 3000), false);
  Transformer tf(model->get());
  NllResult r;
  std::vector<float> logits;
  for (size_t off = 0; off < ids.size(); off += 255) {
    std::vector<int> window = {1};
    for (size_t i = off; i < std::min(ids.size(), off + 255); ++i)
      window.push_back(ids[i]);
    LocalKvStore kv((*model)->config);
    ASSERT_TRUE(tf.Forward(window, 0, &kv, &logits).ok());
    for (size_t t = 0; t + 1 < window.size(); ++t) {
      r.sum += TokenNll(&logits[t * 512], 512, window[t + 1]);
      ++r.count;
    }
  }
  EXPECT_GT(r.count, 500);
  EXPECT_GT(r.mean(), 1.0);
  EXPECT_LT(r.mean(), 2.0);
}

}  // namespace
}  // namespace triax::frontend
