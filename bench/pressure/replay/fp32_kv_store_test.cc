#include "bench/pressure/replay/fp32_kv_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/status_matchers.h"

namespace triax::bench::replay {
namespace {

using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

frontend::ModelConfig Config() {
  frontend::ModelConfig c;
  c.dim = 64;  // 4 heads of 16
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.n_layers = 2;
  c.hidden_dim = 8;
  c.vocab_size = 8;
  c.max_seq_len = 256;
  return c;
}

// Same writes and queries into LocalKvStore and Fp32KvStore (1 and 3
// threads): outputs agree to fp32 rounding.
TEST(Fp32KvStore, MatchesLocalKvStore) {
  const frontend::ModelConfig c = Config();
  const int kv_dim = c.kv_dim();
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  frontend::LocalKvStore ref(c);
  Fp32KvStore one(c, 1), three(c, 3);
  int64_t pos = 0;
  for (int n : {5, 1, 17, 40}) {  // chunks, as a prefill writes them
    for (int layer = 0; layer < c.n_layers; ++layer) {
      const size_t kv_values = static_cast<size_t>(n) * kv_dim;
      const size_t q_values = static_cast<size_t>(n) * c.dim;
      std::vector<float> k(kv_values), v(kv_values), q(q_values);
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      for (auto& x : q) x = 2.0f * nd(rng);
      std::vector<int64_t> positions(n);
      for (int i = 0; i < n; ++i) positions[i] = pos + i;
      std::vector<float> want(q_values), got1(q_values), got3(q_values);
      ASSERT_THAT(ref.Write(layer, pos, n, k.data(), v.data()), IsOk());
      ASSERT_THAT(one.Write(layer, pos, n, k.data(), v.data()), IsOk());
      ASSERT_THAT(three.Write(layer, pos, n, k.data(), v.data()), IsOk());
      ASSERT_THAT(ref.Attend(layer, n, positions.data(), q.data(), want.data()),
                  IsOk());
      ASSERT_THAT(one.Attend(layer, n, positions.data(), q.data(), got1.data()),
                  IsOk());
      ASSERT_THAT(
          three.Attend(layer, n, positions.data(), q.data(), got3.data()),
          IsOk());
      for (size_t j = 0; j < want.size(); ++j) {
        ASSERT_NEAR(got1[j], want[j], 1e-5f * (1 + std::fabs(want[j]))) << j;
        ASSERT_EQ(got3[j], got1[j]) << j;  // threads split queries only
      }
    }
    pos += n;
  }
  EXPECT_EQ(one.written(1), pos);
}

// Every attention row (query x head x layer) puts mass 1 on the positions
// it reads; threads change nothing; a key that dominates the scores takes
// the mass; TakeMass clears.
TEST(Fp32KvStore, TracksAttentionMass) {
  const frontend::ModelConfig c = Config();
  const int kv_dim = c.kv_dim();
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  Fp32KvStore one(c, 1), three(c, 3);
  one.TrackMass(true);
  three.TrackMass(true);
  const int n = 12;
  std::vector<float> k(static_cast<size_t>(n) * kv_dim), v(k.size());
  std::vector<float> q(static_cast<size_t>(n) * c.dim);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  // Position 3's keys align with every query, far above the rest.
  for (int j = 0; j < kv_dim; ++j) k[3 * kv_dim + j] = 4.0f;
  for (auto& x : q) x = 4.0f + nd(rng);
  std::vector<int64_t> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  std::vector<float> out(q.size());
  for (int layer = 0; layer < c.n_layers; ++layer) {
    ASSERT_THAT(one.Write(layer, 0, n, k.data(), v.data()), IsOk());
    ASSERT_THAT(three.Write(layer, 0, n, k.data(), v.data()), IsOk());
    ASSERT_THAT(one.Attend(layer, n, positions.data(), q.data(), out.data()),
                IsOk());
    ASSERT_THAT(three.Attend(layer, n, positions.data(), q.data(), out.data()),
                IsOk());
  }
  const std::vector<double> m1 = one.TakeMass(), m3 = three.TakeMass();
  ASSERT_EQ(m1.size(), static_cast<size_t>(n));
  ASSERT_EQ(m3.size(), m1.size());
  double total = 0;
  for (size_t t = 0; t < m1.size(); ++t) {
    EXPECT_NEAR(m3[t], m1[t], 1e-9) << t;
    total += m1[t];
  }
  EXPECT_NEAR(total, static_cast<double>(n) * c.n_heads * c.n_layers, 1e-3);
  // Queries 3..11 see position 3 (9 queries x 4 heads x 2 layers = 72
  // rows); nearly all of their mass goes there.
  EXPECT_GT(m1[3], 0.95 * 72);
  // Queries 0..2 cannot see it: position 0 gets query 0's whole rows.
  EXPECT_GE(m1[0], 8.0 - 1e-6);
  for (double x : one.TakeMass()) EXPECT_EQ(x, 0.0);  // cleared
  // Off: nothing is tracked.
  Fp32KvStore off(c, 1);
  ASSERT_THAT(off.Write(0, 0, n, k.data(), v.data()), IsOk());
  ASSERT_THAT(off.Attend(0, n, positions.data(), q.data(), out.data()), IsOk());
  for (double x : off.TakeMass()) EXPECT_EQ(x, 0.0);
}

TEST(Fp32KvStore, BadInput) {
  Fp32KvStore s(Config(), 2);
  std::vector<float> kv(64), q(64), out(64);
  EXPECT_THAT(
      s.Write(2, 0, 1, kv.data(), kv.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer=2")));
  EXPECT_THAT(s.Write(0, 0, 0, kv.data(), kv.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n=0")));
  EXPECT_THAT(
      s.Write(0, 3, 1, kv.data(), kv.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("first_pos=3")));
  ASSERT_THAT(s.Write(0, 0, 1, kv.data(), kv.data()), IsOk());
  EXPECT_THAT(s.Write(0, 0, 1, kv.data(), kv.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("first_pos=0")));  // no rewrites
  const int64_t p1 = 1;
  EXPECT_THAT(s.Attend(0, 1, &p1, q.data(), out.data()),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("position 1")));
  EXPECT_THAT(
      s.Attend(-1, 1, &p1, q.data(), out.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer=-1")));
  const int64_t p0 = 0;
  EXPECT_THAT(s.Attend(0, 1, &p0, q.data(), out.data()), IsOk());
}

}  // namespace
}  // namespace triax::bench::replay
