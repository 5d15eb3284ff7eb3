#include "client/frontend/tee_kv_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/status_matchers.h"

namespace triax::frontend {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::StatusIs;

ModelConfig SmallConfig() {
  ModelConfig c;
  c.dim = 32;
  c.hidden_dim = 48;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 37;
  c.max_seq_len = 128;
  return c;
}

// A LocalKvStore whose values are scaled by (1 + eps) on write: a store with
// a known, non-zero attention error.
class ScaledValueStore : public KvStore {
 public:
  ScaledValueStore(const ModelConfig& c, float eps) : inner_(c), eps_(eps) {
    kv_dim_ = c.kv_dim();
  }
  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override {
    std::vector<float> v2(v, v + static_cast<size_t>(n) * kv_dim_);
    for (float& x : v2) x *= 1.0f + eps_;
    return inner_.Write(layer, first_pos, n, k, v2.data());
  }
  absl::Status Attend(int layer, int n, const int64_t* pos, const float* q,
                      float* out) override {
    ++attend_calls;
    queries += n;
    return inner_.Attend(layer, n, pos, q, out);
  }
  int attend_calls = 0;
  int64_t queries = 0;

 private:
  LocalKvStore inner_;
  float eps_;
  int kv_dim_;
};

class FailingStore : public KvStore {
 public:
  absl::Status Write(int, int64_t, int, const float*, const float*) override {
    return absl::ResourceExhaustedError("pool full by 16 bytes");
  }
  absl::Status Attend(int, int, const int64_t*, const float*, float*) override {
    return absl::OkStatus();
  }
};

std::vector<int> Tokens(int n, int vocab) {
  std::vector<int> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7 + 3) % vocab;
  return t;
}

TEST(TeeKvStoreTest, IdenticalCopyHasZeroErrorAndPrimaryDrives) {
  const ModelConfig c = SmallConfig();
  auto model = MakeSyntheticModel(c, 7);
  Transformer tf(model.get());
  const std::vector<int> tokens = Tokens(45, c.vocab_size);

  LocalKvStore plain(c);
  std::vector<float> want;
  ASSERT_TRUE(tf.Prefill(tokens, 0, 16, &plain, &want).ok());

  LocalKvStore primary(c), copy(c);
  TeeKvStore tee(&primary, {&copy}, c.n_layers, c.dim);
  std::vector<float> got;
  ASSERT_TRUE(tf.Prefill(tokens, 0, 16, &tee, &got).ok());
  EXPECT_EQ(got, want);
  for (int l = 0; l < c.n_layers; ++l) {
    EXPECT_EQ(tee.error(0, l).queries, 45) << "layer " << l;
    EXPECT_GT(tee.error(0, l).sum_sq_ref, 0.0) << "layer " << l;
    EXPECT_EQ(tee.RelativeError(0, l), 0.0) << "layer " << l;
  }
}

TEST(TeeKvStoreTest, ScaledValuesGiveTheirRelativeErrorWithoutCompounding) {
  const ModelConfig c = SmallConfig();
  auto model = MakeSyntheticModel(c, 11);
  Transformer tf(model.get());
  const std::vector<int> tokens = Tokens(40, c.vocab_size);

  LocalKvStore primary(c);
  ScaledValueStore scaled(c, 0.01f), same(c, 0.0f);
  TeeKvStore tee(&primary, {&scaled, &same}, c.n_layers, c.dim);
  std::vector<float> logits;
  ASSERT_TRUE(tf.Prefill(tokens, 0, 8, &tee, &logits).ok());
  for (int l = 0; l < c.n_layers; ++l) {
    // Attention is linear in V: scaling every value by 1.01 scales the
    // output by 1.01 exactly (up to float rounding), at every layer, since
    // each layer gets the primary's K/V and queries.
    EXPECT_NEAR(tee.RelativeError(0, l), 0.01, 1e-5) << "layer " << l;
    EXPECT_EQ(tee.RelativeError(1, l), 0.0) << "layer " << l;
  }
  // One Attend per layer per chunk on each secondary.
  EXPECT_EQ(scaled.attend_calls, c.n_layers * 5);
}

TEST(TeeKvStoreTest, StrideSamplesQueriesAndAlwaysTheLast) {
  const ModelConfig c = SmallConfig();
  auto model = MakeSyntheticModel(c, 3);
  Transformer tf(model.get());
  // One chunk of 10 tokens at positions 0..9, stride 4: 0, 4, 8 and the last
  // (9); a second chunk of 3 at 10..12: only the last (12).
  const std::vector<int> tokens = Tokens(13, c.vocab_size);
  LocalKvStore primary(c);
  ScaledValueStore s(c, 0.0f);
  TeeKvStore tee(&primary, {&s}, c.n_layers, c.dim, /*query_stride=*/4);
  std::vector<float> logits;
  ASSERT_TRUE(tf.Forward({tokens.data(), 10}, 0, &tee, &logits).ok());
  EXPECT_EQ(tee.error(0, 0).queries, 4);
  ASSERT_TRUE(tf.Forward({tokens.data() + 10, 3}, 10, &tee, &logits).ok());
  EXPECT_EQ(tee.error(0, 0).queries, 5);
  EXPECT_EQ(s.queries, 5 * c.n_layers);
}

TEST(TeeKvStoreTest, ErrorsNameTheSecondaryAndBadLayers) {
  const ModelConfig c = SmallConfig();
  LocalKvStore primary(c);
  FailingStore bad;
  TeeKvStore tee(&primary, {&bad}, c.n_layers, c.dim);
  std::vector<float> k(c.kv_dim()), v(c.kv_dim());
  EXPECT_THAT(tee.Write(0, 0, 1, k.data(), v.data()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("tee secondary 0: pool full")));
  EXPECT_THAT(
      tee.Write(3, 0, 1, k.data(), v.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer = 3")));
  std::vector<float> q(c.dim), out(c.dim);
  const int64_t pos = 0;
  EXPECT_THAT(
      tee.Attend(-1, 1, &pos, q.data(), out.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer = -1")));
}

}  // namespace
}  // namespace triax::frontend
