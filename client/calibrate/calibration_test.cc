#include "client/calibrate/calibration.h"

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "client/calibrate/calibrate_test_util.h"
#include "client/calibrate/sha256.h"
#include "client/frontend/llama2c.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"

namespace triax::calibrate {
namespace {

using frontend::RenderedConversation;
using frontend::RenderedTurn;
using frontend::RoleSpan;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

constexpr Role kDelim = Role::kDelimiter, kSystem = Role::kSystem,
               kSchema = Role::kToolSchema, kUser = Role::kUser,
               kCall = Role::kToolCall, kResult = Role::kToolResult;

using testutil::MakeConversation;
using testutil::SmallConfig;

TEST(TemporalForTest, MirrorsManagerRules) {
  // kvmanager ManagerCore::TemporalFor with recent_turns 2.
  EXPECT_EQ(TemporalFor(0, 5, 5, 2), Temporal::kSink);
  EXPECT_EQ(TemporalFor(0, 0, 5, 2), Temporal::kSink);
  EXPECT_EQ(TemporalFor(7, 5, 5, 2), Temporal::kCurrentTurn);
  EXPECT_EQ(TemporalFor(7, 4, 5, 2), Temporal::kRecentTurns);
  EXPECT_EQ(TemporalFor(7, 3, 5, 2), Temporal::kRecentTurns);
  EXPECT_EQ(TemporalFor(7, 2, 5, 2), Temporal::kOlder);
  EXPECT_EQ(TemporalFor(7, 0, 5, 0), Temporal::kOlder);
  EXPECT_EQ(TemporalFor(7, 4, 5, 0), Temporal::kOlder);
}

TEST(PlanBlocksTest, CutsPerSpanWithBosInFirstSpanAndTagsLikeTheManager) {
  // Two turns: spans (bytes) turn 0: delim 19, system 40, schema 20,
  // delim 11, delim 17, user 8, delim 33, call 7, delim 29, result 16,
  // delim 11; turn 1: delim 17, user 8, ...
  RenderedConversation c = MakeConversation(3, 20, 8);
  auto blocks = PlanBlocks(c, 1, 16);
  ASSERT_THAT(blocks.status(), IsOk());
  // First span: 19 bytes + BOS = 20 tokens -> 16 + 4.
  ASSERT_GE(blocks->size(), 4u);
  EXPECT_EQ((*blocks)[0].first, 0);
  EXPECT_EQ((*blocks)[0].tokens, 16);
  EXPECT_EQ((*blocks)[0].role, kDelim);
  EXPECT_EQ((*blocks)[1].first, 16);
  EXPECT_EQ((*blocks)[1].tokens, 4);
  // System: 40 tokens -> 16, 16, 8; never mixed with the next span.
  EXPECT_EQ((*blocks)[2].role, kSystem);
  EXPECT_EQ((*blocks)[4].tokens, 8);
  EXPECT_EQ((*blocks)[5].role, kSchema);
  EXPECT_EQ((*blocks)[5].first, 1 + 19 + 40);
  // Contiguous, every block within one span and one turn.
  int64_t pos = 0;
  uint32_t last_turn = 0;
  for (const CalBlock& b : *blocks) {
    EXPECT_EQ(b.first, pos);
    EXPECT_GE(b.tokens, 1);
    EXPECT_LE(b.tokens, 16);
    EXPECT_GE(b.turn, last_turn);
    last_turn = b.turn;
    pos += b.tokens;
  }
  EXPECT_EQ(pos, static_cast<int64_t>(c.text.size()) + 1);
  EXPECT_EQ(last_turn, 2u);

  // Current turn 2, recent_turns 1: turn 1 recent, turn 0 older, block 0
  // sink.
  const std::vector<Tag> tags = TagBlocks(*blocks, 2, 1);
  ASSERT_EQ(tags.size(), blocks->size());
  EXPECT_EQ(tags[0].temporal, Temporal::kSink);
  EXPECT_EQ(tags[0].role, kDelim);
  for (size_t i = 1; i < tags.size(); ++i) {
    const uint32_t t = (*blocks)[i].turn;
    const Temporal want = t == 2   ? Temporal::kCurrentTurn
                          : t == 1 ? Temporal::kRecentTurns
                                   : Temporal::kOlder;
    EXPECT_EQ(tags[i].temporal, want) << i;
    EXPECT_EQ(tags[i].role, (*blocks)[i].role);
    EXPECT_EQ(tags[i].modality, Modality::kText);
  }
  EXPECT_EQ(TagLabel(tags[2]), "older/text/system");
}

TEST(PlanBlocksTest, RejectsBadArguments) {
  RenderedConversation c = MakeConversation(1, 20, 8);
  EXPECT_THAT(PlanBlocks(c, 1, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block_tokens 0")));
  RenderedConversation empty;
  EXPECT_THAT(
      PlanBlocks(empty, 1, 16).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no turns")));
  c.turns[0].spans[1].begin += 1;  // a hole
  EXPECT_THAT(PlanBlocks(c, 1, 16).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("does not follow")));
}

TEST(HeldOutTest, RefusesHeldOutAndDuplicateIds) {
  EXPECT_THAT(CheckCalibrationIds({"multi_turn_base_2", "multi_turn_base_10"}),
              IsOk());
  for (const char* id :
       {"multi_turn_base_3", "multi_turn_base_181",
        "multi_turn_long_context_42", "memory_25", "memory_154"}) {
    EXPECT_THAT(CheckCalibrationIds({"multi_turn_base_2", id}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("\"", id, "\" is held out"))))
        << id;
  }
  EXPECT_THAT(
      CheckCalibrationIds({"multi_turn_base_2", "multi_turn_base_2"}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listed twice")));
  EXPECT_THAT(CheckCalibrationIds({}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_EQ(HeldOutIds().size(), 26u);
}

TEST(Sha256Test, KnownAnswers) {
  EXPECT_EQ(Sha256Hex(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(
      Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_THAT(Sha256File("/nonexistent/kvcalibrate").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot open")));
}

struct Captured {
  std::unique_ptr<frontend::Model> model;
  std::unique_ptr<frontend::LocalKvStore> local;
  std::unique_ptr<CaptureKvStore> capture;
  std::vector<CalBlock> blocks;
};

Captured Capture(const RenderedConversation& conv, int layers,
                 int64_t first_query, int stride) {
  Captured c;
  c.model = frontend::MakeSyntheticModel(SmallConfig(layers), 17);
  c.local = std::make_unique<frontend::LocalKvStore>(c.model->config);
  c.capture = std::make_unique<CaptureKvStore>(c.local.get(), c.model->config,
                                               first_query, stride);
  frontend::ByteTokenizer bt;
  const std::vector<int> tokens = bt.Encode(conv.text, true);
  frontend::Transformer tf(c.model.get(), 1);
  std::vector<float> logits;
  EXPECT_THAT(tf.Prefill(tokens, 0, 64, c.capture.get(), &logits), IsOk());
  auto blocks = PlanBlocks(conv, 1, 16);
  EXPECT_THAT(blocks.status(), IsOk());
  c.blocks = *blocks;
  return c;
}

const CalibrationResultEntry* Find(
    const std::vector<CalibrationResultEntry>& es, Temporal t, Role role,
    kernels::Encoding e) {
  for (const auto& r : es) {
    if (r.tag.temporal == t && r.tag.role == role && r.encoding == e) return &r;
  }
  return nullptr;
}

TEST(CalibratorTest, SyntheticModelDistortionsAreOrdered) {
  using kernels::Format;
  // Two turns, recent_turns 2: no OLDER tag exists.
  RenderedConversation conv = MakeConversation(2, 60, 24);
  Captured c = Capture(conv, 2, 32, 4);
  ASSERT_GT(c.capture->query_positions().size(), 10u);
  CalibratorOptions opt;
  opt.encodings = DefaultEncodings();
  opt.threads = 2;
  auto cal = Calibrator::Create(c.model->config, opt);
  ASSERT_THAT(cal.status(), IsOk());
  ASSERT_THAT(cal->AddConversation(c.blocks, *c.capture), IsOk());
  const std::vector<CalibrationResultEntry> es = cal->Entries();
  ASSERT_FALSE(es.empty());
  std::map<std::string, int> tags;
  for (const auto& r : es) {
    tags[TagLabel(r.tag)]++;
    EXPECT_NE(r.tag.temporal, Temporal::kOlder) << TagLabel(r.tag);
    EXPECT_NE(r.tag.role, Role::kAssistant) << "no assistant tokens";
    EXPECT_TRUE(std::isfinite(r.distortion));
    EXPECT_GE(r.tokens, 1u);
    EXPECT_GE(r.queries, 1u);
    if (r.encoding == kernels::Encoding(Format::kBF16)) {
      EXPECT_EQ(r.distortion, 0.0) << TagLabel(r.tag);
    } else {
      EXPECT_GT(r.distortion, 0.0) << TagLabel(r.tag);
    }
  }
  for (const auto& [name, n] : tags) {
    EXPECT_EQ(n, static_cast<int>(opt.encodings.size())) << name;
  }
  EXPECT_EQ(tags.count("sink/text/delimiter"), 1u);
  EXPECT_EQ(tags.count("current_turn/text/tool_schema"), 1u);
  EXPECT_EQ(tags.count("recent_turns/text/tool_schema"), 1u);
  for (const auto& [t, role] : std::vector<std::pair<Temporal, Role>>{
           {Temporal::kSink, kDelim},
           {Temporal::kCurrentTurn, kSchema},
           {Temporal::kRecentTurns, kUser},
           {Temporal::kCurrentTurn, kCall}}) {
    const auto* i8 = Find(es, t, role, Format::kINT8);
    const auto* i4 = Find(es, t, role, Format::kINT4);
    const auto* i2 = Find(es, t, role, Format::kINT2);
    const auto* t2 = Find(es, t, role, Format::kTQ2);
    const auto* t4 = Find(es, t, role, Format::kTQ4);
    ASSERT_TRUE(i8 && i4 && i2 && t2 && t4)
        << TemporalLabel(t) << " " << RoleLabel(role);
    EXPECT_LT(i8->distortion, i4->distortion)
        << TemporalLabel(t) << RoleLabel(role);
    EXPECT_LT(i4->distortion, i2->distortion)
        << TemporalLabel(t) << RoleLabel(role);
    EXPECT_LT(t4->distortion, t2->distortion)
        << TemporalLabel(t) << RoleLabel(role);
  }
  // The tags' shares add up to one per (query, layer).
  std::map<std::string, double> share;
  for (const auto& r : es) share[TagLabel(r.tag)] = r.mean_share;
  double total = 0;
  for (const auto& [name, s] : share) total += s;
  EXPECT_NEAR(total, 1.0, 1e-9);
}

TEST(CalibratorTest, ResultIndependentOfThreadCount) {
  RenderedConversation conv = MakeConversation(2, 30, 16);
  Captured c = Capture(conv, 1, 16, 8);
  std::vector<double> d[2];
  for (int threads : {1, 3}) {
    CalibratorOptions opt;
    opt.encodings = {kernels::Format::kBF16, kernels::Format::kINT4};
    opt.threads = threads;
    auto cal = Calibrator::Create(c.model->config, opt);
    ASSERT_THAT(cal.status(), IsOk());
    ASSERT_THAT(cal->AddConversation(c.blocks, *c.capture), IsOk());
    for (const auto& r : cal->Entries())
      d[threads == 3].push_back(r.distortion);
  }
  EXPECT_EQ(d[0], d[1]);
}

// The per-tag decomposition equals attention over mixed-encoding pages with
// kernels::DecodeAttentionRef.
TEST(CalibratorTest, MatchesDecodeAttentionRefOverMixedPages) {
  using kernels::Format;
  RenderedConversation conv = MakeConversation(2, 40, 20);
  const int64_t n_text = static_cast<int64_t>(conv.text.size()) + 1;
  const int64_t qpos = n_text - 1;
  Captured c = Capture(conv, 1, qpos, 1);  // one query: the last token
  ASSERT_EQ(c.capture->query_positions().size(), 1u);
  const frontend::ModelConfig& cfg = c.model->config;
  const std::vector<kernels::Encoding> encs = {
      Format::kBF16, Format::kINT4, Format::kINT2, Format::kTQ3,
      kernels::Encoding(Format::kINT4, Format::kINT2)};
  CalibratorOptions opt;
  opt.encodings = encs;
  auto cal = Calibrator::Create(cfg, opt);
  ASSERT_THAT(cal.status(), IsOk());
  ASSERT_THAT(cal->AddConversation(c.blocks, *c.capture), IsOk());
  const std::vector<CalibrationResultEntry> es = cal->Entries();

  const uint32_t current = c.blocks.back().turn;
  const std::vector<Tag> tags = TagBlocks(c.blocks, current, 2);
  const kernels::PageShape shape{16, cfg.n_kv_heads, cfg.head_dim()};
  const int kv_dim = cfg.kv_dim();
  std::vector<uint16_t> kb(c.capture->k(0).size()), vb(kb.size());
  for (size_t i = 0; i < kb.size(); ++i) {
    kb[i] = kernels::FloatToBf16(c.capture->k(0)[i]);
    vb[i] = kernels::FloatToBf16(c.capture->v(0)[i]);
  }
  auto attend = [&](const Tag* only, const kernels::Encoding& e) {
    std::vector<std::vector<uint8_t>> pages;
    std::vector<kernels::PageRef> refs;
    for (size_t b = 0; b < c.blocks.size(); ++b) {
      const kernels::Encoding eb =
          only && tags[b] == *only ? e : kernels::Encoding(Format::kBF16);
      pages.emplace_back(kernels::PageBytes(eb, shape));
      const size_t off = static_cast<size_t>(c.blocks[b].first) * kv_dim;
      kernels::EncodePage(eb, shape, &kb[off], &vb[off], c.blocks[b].tokens,
                          pages.back().data());
    }
    for (size_t b = 0; b < c.blocks.size(); ++b) {
      const kernels::Encoding eb =
          only && tags[b] == *only ? e : kernels::Encoding(Format::kBF16);
      refs.push_back(kernels::PageRef{eb, pages[b].data(), c.blocks[b].tokens});
    }
    std::vector<float> out(cfg.dim);
    kernels::DecodeParams p;
    p.q = c.capture->queries(0).data();
    p.out = out.data();
    p.n_q_heads = cfg.n_heads;
    p.shape = shape;
    p.scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim()));
    p.pages = refs.data();
    p.num_pages = static_cast<int>(refs.size());
    p.attend_tokens = qpos + 1;
    kernels::DecodeAttentionRef(p);
    return out;
  };
  const std::vector<float> ref = attend(nullptr, Format::kBF16);
  double ref2 = 0;
  for (float x : ref) ref2 += double{x} * x;
  int checked = 0;
  for (const auto& r : es) {
    if (r.encoding == kernels::Encoding(Format::kBF16)) continue;
    const std::vector<float> o = attend(&r.tag, r.encoding);
    double d2 = 0;
    for (int i = 0; i < cfg.dim; ++i)
      d2 += double(o[i] - ref[i]) * (o[i] - ref[i]);
    const double want = (d2 / ref2) / r.mean_share;
    EXPECT_NEAR(r.distortion, want, 0.02 * want + 1e-9)
        << TagLabel(r.tag) << " " << static_cast<int>(r.encoding.k);
    ++checked;
  }
  EXPECT_GE(checked, 20);
}

TEST(CalibratorTest, RejectsBadOptionsAndInputs) {
  const frontend::ModelConfig cfg = SmallConfig(1);
  CalibratorOptions opt;
  EXPECT_THAT(Calibrator::Create(cfg, opt).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("encodings is empty")));
  opt.encodings = {kernels::Format::kINT4, kernels::Format::kINT4};
  EXPECT_THAT(Calibrator::Create(cfg, opt).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("encodings[1] int4 repeats")));
  opt.encodings = {kernels::Format::kINT4};
  opt.threads = 0;
  EXPECT_THAT(
      Calibrator::Create(cfg, opt).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("threads 0")));
  frontend::ModelConfig odd = cfg;
  odd.dim = 96;  // head_dim 24: TQ needs a power of two
  opt.threads = 1;
  opt.encodings = {kernels::Format::kTQ4};
  EXPECT_THAT(
      Calibrator::Create(odd, opt).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim 24")));

  RenderedConversation conv = MakeConversation(1, 20, 8);
  Captured c = Capture(conv, 1, 10000, 8);  // nothing sampled
  opt.encodings = {kernels::Format::kINT4};
  auto cal = Calibrator::Create(c.model->config, opt);
  ASSERT_THAT(cal.status(), IsOk());
  EXPECT_THAT(cal->AddConversation(c.blocks, *c.capture),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no query position")));
  Captured c2 = Capture(conv, 1, 8, 8);
  std::vector<CalBlock> short_blocks(c2.blocks.begin(), c2.blocks.end() - 1);
  EXPECT_THAT(
      cal->AddConversation(short_blocks, *c2.capture),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks cover")));
  EXPECT_TRUE(cal->Entries().empty());
}

TEST(ParseEncodingsTest, NamesAsEncodingNameWritesThem) {
  auto d = ParseEncodings("");
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ(*d, DefaultEncodings());
  // Every default round-trips through its name.
  std::string all;
  for (const kernels::Encoding& e : DefaultEncodings()) {
    char buf[96];
    if (!all.empty()) all += ";";
    all += kernels::EncodingName(e, buf, sizeof(buf));
  }
  auto again = ParseEncodings(all);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(*again, DefaultEncodings());
  auto mixed = ParseEncodings("k=tq4,v=tq3;k=int4,v=int4,g=64");
  ASSERT_THAT(mixed, IsOk());
  ASSERT_EQ(mixed->size(), 2u);
  EXPECT_EQ((*mixed)[0],
            kernels::Encoding(kernels::Format::kTQ4, kernels::Format::kTQ3));
  EXPECT_EQ((*mixed)[1].Group(), 64);
  EXPECT_THAT(ParseEncodings("tq4;int5"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"int5\" is not an encoding name")));
  EXPECT_THAT(ParseEncodings("tq4;tq4"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"tq4\" is listed twice")));
  EXPECT_THAT(ParseEncodings(";"), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("names no encoding")));
}

}  // namespace
}  // namespace triax::calibrate
