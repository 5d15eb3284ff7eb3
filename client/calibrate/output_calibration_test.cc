#include "client/calibrate/output_calibration.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "client/calibrate/calibrate_test_util.h"
#include "client/frontend/llama2c.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"

namespace triax::calibrate {
namespace {

using frontend::RenderedConversation;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

using testutil::MakeConversation;
using testutil::SmallConfig;

OutputConversation Prepare(const RenderedConversation& conv, int chunk = 64) {
  frontend::ByteTokenizer bt;
  auto oc = PrepareOutputConversation(conv, bt.Encode(conv.text, true), 1, 16,
                                      2, chunk);
  EXPECT_THAT(oc.status(), IsOk());
  return *std::move(oc);
}

const Tag kSinkDelim{Temporal::kSink, Modality::kText, Role::kDelimiter};
const Tag kCurrentUser{Temporal::kCurrentTurn, Modality::kText, Role::kUser};
const Tag kRecentUser{Temporal::kRecentTurns, Modality::kText, Role::kUser};

// Rounds K/V to BF16 and forwards to LocalKvStore: the exact reference of a
// BF16 cache.
class RoundingKvStore : public frontend::KvStore {
 public:
  explicit RoundingKvStore(const frontend::ModelConfig& c)
      : inner_(c), kv_dim_(c.kv_dim()) {}
  absl::Status Write(int layer, int64_t first_pos, int n, const float* k,
                     const float* v) override {
    kr_.assign(k, k + static_cast<size_t>(n) * kv_dim());
    vr_.assign(v, v + static_cast<size_t>(n) * kv_dim());
    for (float& x : kr_) x = kernels::Bf16ToFloat(kernels::FloatToBf16(x));
    for (float& x : vr_) x = kernels::Bf16ToFloat(kernels::FloatToBf16(x));
    return inner_.Write(layer, first_pos, n, kr_.data(), vr_.data());
  }
  absl::Status Attend(int layer, int nq, const int64_t* pos, const float* q,
                      float* out) override {
    return inner_.Attend(layer, nq, pos, q, out);
  }

 private:
  size_t kv_dim() const { return kv_dim_; }
  frontend::LocalKvStore inner_;
  size_t kv_dim_;
  std::vector<float> kr_, vr_;
};

TEST(PrepareOutputConversationTest, ChunksPerTurnSharesAndAnswerPositions) {
  const RenderedConversation conv = MakeConversation(3, 60, 24);
  const OutputConversation oc = Prepare(conv, 64);
  const int64_t n = static_cast<int64_t>(oc.tokens.size());
  ASSERT_EQ(oc.positions(), n - 1);
  // Chunks start at every turn's first token and never cross a turn.
  int64_t pos = 0;
  for (const OutputConversation::Chunk& c : oc.chunks) {
    EXPECT_EQ(c.first, pos);
    EXPECT_LE(c.tokens, 64);
    pos += c.tokens;
  }
  EXPECT_EQ(pos, n);
  for (size_t b = 0; b < oc.blocks.size(); ++b) {
    const OutputConversation::Chunk& first =
        oc.chunks[oc.chunk_of[oc.blocks[b].first]];
    EXPECT_EQ(first.turn, oc.blocks[b].turn) << b;
  }
  // Shares are fractions of [0, p] and never exceed 1 in total.
  const size_t T = oc.tags.size();
  for (int64_t p = 0; p < oc.positions(); ++p) {
    double total = 0;
    for (size_t t = 0; t < T; ++t) total += oc.share[p * T + t];
    EXPECT_LE(total, 1.0 + 1e-12) << p;
  }
  // Position 0: the first chunk (64 tokens) seals blocks 0..2 of the
  // turn-0 plan; block 0 (BOS + 15 delimiter tokens) is SINK and 1/1 of
  // [0, 0] is in it.
  const auto sink = std::find(oc.tags.begin(), oc.tags.end(), kSinkDelim);
  ASSERT_NE(sink, oc.tags.end());
  EXPECT_DOUBLE_EQ(oc.share[sink - oc.tags.begin()], 1.0);
  // Answer positions are those whose next token is a TOOL_CALL token.
  int64_t answers = 0;
  for (int64_t p = 0; p < oc.positions(); ++p) answers += oc.answer[p];
  EXPECT_EQ(answers, 3 * (24 / 2 + 3));
  EXPECT_THAT(
      PrepareOutputConversation(conv, {1}, 1, 16, 2, 64).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at least 2")));
  EXPECT_THAT(
      PrepareOutputConversation(conv, oc.tokens, 1, 16, 2, 0).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chunk 0")));
  std::vector<int> short_tokens(oc.tokens.begin(), oc.tokens.end() - 1);
  EXPECT_THAT(
      PrepareOutputConversation(conv, short_tokens, 1, 16, 2, 64).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks cover")));
}

TEST(FakeQuantKvStoreTest, Bf16EverywhereMatchesLocalKvStoreToBf16Rounding) {
  const RenderedConversation conv = MakeConversation(3, 60, 24);
  const OutputConversation oc = Prepare(conv);
  auto model = frontend::MakeSyntheticModel(SmallConfig(2), 17);
  frontend::Transformer tf(model.get(), 1);
  std::unique_ptr<FakeQuantKvStore> store;
  // Every tag listed as BF16 is the same as an empty allocation.
  Allocation bf16;
  for (const Tag& t : oc.tags) bf16[t] = kernels::Format::kBF16;
  auto pass = RunPass(&tf, oc, bf16, nullptr, nullptr, &store);
  ASSERT_THAT(pass.status(), IsOk());
  EXPECT_EQ(store->quantized_reads(), 0);

  RoundingKvStore rounded(model->config);
  std::vector<float> ref;
  ASSERT_THAT(tf.Prefill(oc.tokens, 0, 64, &rounded, &ref), IsOk());
  frontend::LocalKvStore exact(model->config);
  std::vector<float> fp32;
  ASSERT_THAT(tf.Prefill(oc.tokens, 0, 64, &exact, &fp32), IsOk());
  ASSERT_EQ(pass->logits.size(), ref.size());
  double max_rounded = 0, max_exact = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(pass->logits[i])) << i;
    max_rounded =
        std::max<double>(max_rounded, std::abs(pass->logits[i] - ref[i]));
    max_exact =
        std::max<double>(max_exact, std::abs(pass->logits[i] - fp32[i]));
    norm = std::max<double>(norm, std::abs(ref[i]));
  }
  EXPECT_GT(norm, 0.01);
  // Same math on the same BF16 values: only the fp32 summation order differs.
  EXPECT_LT(max_rounded, 1e-5 * std::max(1.0, norm)) << max_rounded;
  // Against the unrounded cache: within BF16's relative precision (2^-8).
  EXPECT_LT(max_exact, 0.02 * norm) << max_exact;
}

TEST(FakeQuantKvStoreTest, ReadsARoundTripOnlyOnceSealedAndOnlyForItsTag) {
  const RenderedConversation conv = MakeConversation(3, 60, 24);
  const OutputConversation oc = Prepare(conv);
  const frontend::ModelConfig cfg = SmallConfig(1);
  const int kv_dim = cfg.kv_dim();
  const int64_t n = static_cast<int64_t>(oc.tokens.size());
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(n * kv_dim), v(n * kv_dim), q(cfg.dim);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  for (float& x : q) x = normal(rng);
  auto make = [&](const Allocation& a) {
    auto s = FakeQuantKvStore::Create(cfg, &oc, a);
    EXPECT_THAT(s.status(), IsOk());
    return *std::move(s);
  };
  auto attend = [&](FakeQuantKvStore* s, int64_t p) {
    std::vector<float> out(cfg.dim);
    EXPECT_THAT(s->Attend(0, 1, &p, q.data(), out.data()), IsOk());
    return out;
  };
  auto ref = make({});
  auto sink = make({{kSinkDelim, kernels::Format::kINT2}});
  auto user = make({{kCurrentUser, kernels::Format::kINT2}});
  auto recent = make({{kRecentUser, kernels::Format::kINT2}});
  for (FakeQuantKvStore* s :
       {ref.get(), sink.get(), user.get(), recent.get()}) {
    ASSERT_THAT(s->Write(0, 0, 10, k.data(), v.data()), IsOk());
  }
  // Block 0 (16 tokens) is not complete: everyone reads BF16.
  EXPECT_EQ(sink->sealed_blocks(0), 0);
  EXPECT_EQ(attend(sink.get(), 5), attend(ref.get(), 5));
  EXPECT_EQ(sink->quantized_reads(), 0);
  for (FakeQuantKvStore* s :
       {ref.get(), sink.get(), user.get(), recent.get()}) {
    ASSERT_THAT(s->Write(0, 10, n - 10, &k[10 * kv_dim], &v[10 * kv_dim]),
                IsOk());
    EXPECT_EQ(s->sealed_blocks(0), static_cast<int>(oc.blocks.size()));
  }
  // Sealed and SINK: the query at 5 reads block 0's INT2 round trip.
  EXPECT_NE(attend(sink.get(), 5), attend(ref.get(), 5));
  EXPECT_GT(sink->quantized_reads(), 0);
  // The user tag has no block before the first user span: BF16 there.
  int first_user = -1;
  for (size_t b = 0; b < oc.blocks.size(); ++b) {
    if (oc.blocks[b].role == Role::kUser) {
      first_user = static_cast<int>(b);
      break;
    }
  }
  ASSERT_GT(first_user, 0);
  const int64_t before_user = oc.blocks[first_user].first - 1;
  EXPECT_EQ(attend(user.get(), before_user), attend(ref.get(), before_user));
  EXPECT_EQ(user->quantized_reads(), 0);
  const int64_t in_turn0 = oc.blocks[first_user].first + 20;
  EXPECT_NE(attend(user.get(), in_turn0), attend(ref.get(), in_turn0));
  // RECENT_TURNS/USER: turn-0 user blocks are CURRENT_TURN for a turn-0
  // query (BF16) and RECENT_TURNS for a turn-1 query (quantized).
  EXPECT_EQ(attend(recent.get(), in_turn0), attend(ref.get(), in_turn0));
  EXPECT_EQ(recent->quantized_reads(), 0);
  const int64_t in_turn1 = static_cast<int64_t>(conv.turns[1].begin) + 1 + 3;
  ASSERT_EQ(oc.chunks[oc.chunk_of[in_turn1]].turn, 1u);
  EXPECT_NE(attend(recent.get(), in_turn1), attend(ref.get(), in_turn1));
  EXPECT_GT(recent->quantized_reads(), 0);

  // Bad input.
  std::vector<float> out(cfg.dim);
  int64_t far = n;
  EXPECT_THAT(ref->Attend(0, 1, &far, q.data(), out.data()),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("position")));
  EXPECT_THAT(ref->Write(1, 0, 1, k.data(), v.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer")));
  EXPECT_THAT(ref->Write(0, n, 1, k.data(), v.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("write")));
  frontend::ModelConfig odd = cfg;
  odd.dim = 4 * 12;  // head_dim 12: TQ needs a power of two
  EXPECT_THAT(
      FakeQuantKvStore::Create(odd, &oc, {{kSinkDelim, kernels::Format::kTQ3}})
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tq3")));
}

TEST(RunPassTest, KlIsZeroForBf16PositiveForInt2AndThePrefixCopyIsExact) {
  const RenderedConversation conv = MakeConversation(4, 60, 24);
  const OutputConversation oc = Prepare(conv);
  auto model = frontend::MakeSyntheticModel(SmallConfig(2), 23);
  const int vocab = model->config.vocab_size;
  frontend::Transformer tf(model.get(), 1);
  std::unique_ptr<FakeQuantKvStore> ref_store, store;
  auto ref = RunPass(&tf, oc, {}, nullptr, nullptr, &ref_store);
  ASSERT_THAT(ref.status(), IsOk());
  Allocation bf16, int2;
  for (const Tag& t : oc.tags) {
    bf16[t] = kernels::Format::kBF16;
    int2[t] = kernels::Format::kINT2;
  }
  auto same = RunPass(&tf, oc, bf16, nullptr, nullptr, &store);
  ASSERT_THAT(same.status(), IsOk());
  const PositionEffects zero =
      CompareLogits(oc, vocab, ref->logits, same->logits);
  for (int64_t p = 0; p < oc.positions(); ++p) {
    ASSERT_EQ(zero.kl[p], 0.0) << p;
    ASSERT_EQ(zero.dnll[p], 0.0) << p;
  }
  auto q2 = RunPass(&tf, oc, int2, ref_store.get(), &ref->logits, &store);
  ASSERT_THAT(q2.status(), IsOk());
  EXPECT_EQ(q2->first_computed, 0);  // block 0 is sealed by the first chunk
  const EffectMeans m =
      MeanEffects(oc, CompareLogits(oc, vocab, ref->logits, q2->logits));
  EXPECT_GT(m.kl, 0.0);
  EXPECT_TRUE(std::isfinite(m.dnll));
  EXPECT_GT(m.answer_positions, 0);
  EXPECT_GT(m.kl_answer, 0.0);

  // A tag that first appears in turn 2 (OLDER): the pass starts there when
  // it may copy the reference, and agrees bit for bit with a full pass.
  const Allocation older{{Tag{Temporal::kOlder, Modality::kText, Role::kUser},
                          kernels::Format::kINT4}};
  const int64_t start = oc.FirstPerturbed(older);
  EXPECT_GE(start, static_cast<int64_t>(conv.turns[3].begin));
  auto copied = RunPass(&tf, oc, older, ref_store.get(), &ref->logits, &store);
  ASSERT_THAT(copied.status(), IsOk());
  EXPECT_EQ(copied->first_computed, start);
  auto full = RunPass(&tf, oc, older, nullptr, nullptr, &store);
  ASSERT_THAT(full.status(), IsOk());
  EXPECT_EQ(full->first_computed, 0);
  EXPECT_EQ(copied->logits, full->logits);
  EXPECT_NE(full->logits, ref->logits);
}

TEST(OutputCalibratorTest, EntriesAreZeroForBf16AndOrderedByBits) {
  const RenderedConversation conv = MakeConversation(3, 60, 24);
  const OutputConversation oc = Prepare(conv);
  auto model = frontend::MakeSyntheticModel(SmallConfig(2), 17);
  OutputCalibratorOptions opt;
  opt.encodings = {kernels::Format::kBF16, kernels::Format::kINT8,
                   kernels::Format::kINT2};
  opt.threads = 2;
  auto cal = OutputCalibrator::Create(model->config, opt);
  ASSERT_THAT(cal.status(), IsOk());
  int passes = 0;
  ASSERT_THAT(cal->AddConversation(
                  *model, oc,
                  [&](const std::string&, const Tag&, const kernels::Encoding&,
                      double seconds, int done, int total) {
                    EXPECT_GE(seconds, 0.0);
                    EXPECT_LE(done, total);
                    ++passes;
                  }),
              IsOk());
  EXPECT_EQ(passes, static_cast<int>(oc.tags.size()) * 2 + 1);
  EXPECT_EQ(cal->positions(), oc.positions());
  const std::vector<CalibrationResultEntry> es = cal->Entries();
  ASSERT_EQ(es.size(), oc.tags.size() * 3);
  double sum8 = 0, sum2 = 0;
  for (size_t i = 0; i < es.size(); i += 3) {
    EXPECT_EQ(es[i].distortion, 0.0);
    EXPECT_EQ(es[i].dnll, 0.0);
    EXPECT_GE(es[i].tokens, 1u);
    EXPECT_GE(es[i].queries, 1u);
    for (int j = 1; j < 3; ++j) {
      EXPECT_TRUE(std::isfinite(es[i + j].distortion));
      EXPECT_GE(es[i + j].distortion, 0.0);
      EXPECT_GE(es[i + j].distortion_answer, 0.0);
    }
    sum8 += es[i + 1].distortion;
    sum2 += es[i + 2].distortion;
  }
  EXPECT_GT(sum2, 0.0);
  EXPECT_GT(sum2, 10 * sum8);

  // The same sums with one thread.
  opt.threads = 1;
  auto one = OutputCalibrator::Create(model->config, opt);
  ASSERT_THAT(one.status(), IsOk());
  ASSERT_THAT(one->AddConversation(*model, oc), IsOk());
  const std::vector<CalibrationResultEntry> es1 = one->Entries();
  ASSERT_EQ(es1.size(), es.size());
  for (size_t i = 0; i < es.size(); ++i) {
    EXPECT_EQ(es1[i].distortion, es[i].distortion) << i;
    EXPECT_EQ(es1[i].dnll_answer, es[i].dnll_answer) << i;
  }

  // Options and plans that do not match.
  opt.chunk = 0;
  EXPECT_THAT(
      OutputCalibrator::Create(model->config, opt).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("chunk 0")));
  opt.chunk = 64;
  opt.threads = 65;
  EXPECT_THAT(
      OutputCalibrator::Create(model->config, opt).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("threads 65")));
  opt.threads = 1;
  opt.encodings.push_back(kernels::Format::kINT8);
  EXPECT_THAT(
      OutputCalibrator::Create(model->config, opt).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("repeats")));
  opt.encodings.pop_back();
  opt.chunk = 32;
  auto small = OutputCalibrator::Create(model->config, opt);
  ASSERT_THAT(small.status(), IsOk());
  EXPECT_THAT(small->AddConversation(*model, oc),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("chunk of 64 tokens")));
}

TEST(OutputCalibratorTest, SumsOfSeparateRunsMergeIntoTheSameTable) {
  // Two conversations measured in one run, and each in its own run whose
  // sums are merged: the same entries (to double rounding: the sums are
  // added in another association).
  RenderedConversation a_conv = MakeConversation(3, 60, 24);
  RenderedConversation b_conv = MakeConversation(2, 40, 30);
  a_conv.id = "conv-a";
  b_conv.id = "conv-b";
  const OutputConversation a = Prepare(a_conv), b = Prepare(b_conv);
  auto model = frontend::MakeSyntheticModel(SmallConfig(2), 17);
  OutputCalibratorOptions opt;
  opt.encodings = {kernels::Format::kBF16, kernels::Format::kINT4,
                   kernels::Format::kINT2};
  opt.threads = 2;
  auto both = OutputCalibrator::Create(model->config, opt);
  auto only_a = OutputCalibrator::Create(model->config, opt);
  auto only_b = OutputCalibrator::Create(model->config, opt);
  auto merged = OutputCalibrator::Create(model->config, opt);
  ASSERT_THAT(both.status(), IsOk());
  ASSERT_THAT(both->AddConversation(*model, a), IsOk());
  ASSERT_THAT(both->AddConversation(*model, b), IsOk());
  ASSERT_THAT(only_a->AddConversation(*model, a), IsOk());
  ASSERT_THAT(only_b->AddConversation(*model, b), IsOk());
  ASSERT_THAT(merged->AddSums(only_a->SaveSums(), "a.sums"), IsOk());
  ASSERT_THAT(merged->AddSums(only_b->SaveSums(), "b.sums"), IsOk());
  EXPECT_EQ(merged->conversation_ids(),
            (std::vector<std::string>{"conv-a", "conv-b"}));
  EXPECT_EQ(merged->tokens(), both->tokens());
  EXPECT_EQ(merged->positions(), both->positions());
  const auto want = both->Entries();
  const auto got = merged->Entries();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].tag, want[i].tag) << i;
    EXPECT_EQ(got[i].encoding, want[i].encoding) << i;
    EXPECT_NEAR(got[i].distortion, want[i].distortion,
                1e-12 * std::abs(want[i].distortion))
        << i;
    EXPECT_NEAR(got[i].distortion_answer, want[i].distortion_answer,
                1e-12 * std::abs(want[i].distortion_answer))
        << i;
    EXPECT_NEAR(got[i].dnll, want[i].dnll, 1e-12 * std::abs(want[i].dnll)) << i;
    EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
    EXPECT_EQ(got[i].queries, want[i].queries) << i;
  }
  EXPECT_GT(want.size(), 0u);
  // A conversation is never counted twice: not from sums, not measured.
  EXPECT_THAT(merged->AddSums(only_a->SaveSums(), "again.sums"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("again.sums:5: conversation \"conv-a\" is "
                                 "measured already")));
  EXPECT_THAT(merged->AddConversation(*model, b),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"conv-b\" is measured already")));
  // Sums of other options or encodings, and malformed ones, are refused
  // and change nothing.
  OutputCalibratorOptions other = opt;
  other.encodings = {kernels::Format::kBF16, kernels::Format::kINT8};
  auto fresh = OutputCalibrator::Create(model->config, other);
  ASSERT_THAT(fresh.status(), IsOk());
  EXPECT_THAT(fresh->AddSums(only_a->SaveSums(), "x.sums"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("x.sums:3: encodings differ")));
  other = opt;
  other.chunk = 32;
  auto chunked = OutputCalibrator::Create(model->config, other);
  ASSERT_THAT(chunked.status(), IsOk());
  EXPECT_THAT(chunked->AddSums(only_a->SaveSums(), "c.sums"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("c.sums:2: options 16 2 64 differ")));
  auto empty = OutputCalibrator::Create(model->config, opt);
  ASSERT_THAT(empty.status(), IsOk());
  EXPECT_THAT(empty->AddSums("hello\n", "h.sums"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("h.sums:1: not a kvcalibrate-output-sums")));
  std::string broken = only_a->SaveSums();
  broken += "tag 1 1 1 nope\n";
  EXPECT_THAT(empty->AddSums(broken, "t.sums"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tag needs temporal")));
  EXPECT_THAT(empty->AddSums("kvcalibrate-output-sums 1\n", "i.sums"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("i.sums: incomplete")));
  EXPECT_TRUE(empty->conversation_ids().empty());
  EXPECT_TRUE(empty->Entries().empty());
}

}  // namespace
}  // namespace triax::calibrate
