// Calibration storage and allocation policies in the manager core: FakeClock,
// a hand-made calibration table, choices checked against the allocator run
// directly on the same problem. Model: 2 layers, 2 KV heads, head_dim 64,
// T = 16; effective bits of a full page: BF16 16, INT4 5.5, INT2 3.5; block
// bytes BF16 16384, INT4 5632, INT2 3584.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kvmanager/allocator.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

constexpr uint64_t kBf16 = 16384;
constexpr uint64_t kInt4 = 5632;
constexpr uint64_t kInt2 = 3584;
const kernels::PageShape kShape{16, 2, 64};

ModelShape Model() { return ModelShape{"tiny", 2, 2, 4, 64}; }
Span S(Role r, uint32_t n, Modality m = Modality::kText) {
  return Span{r, m, n};
}

CalibrationEntryInfo Entry(Temporal t, Role r, Format f, double d) {
  CalibrationEntryInfo e;
  e.tag = Tag{t, Modality::kText, r};
  e.encoding.format = f;
  e.distortion = d;
  e.tokens = 100;
  e.queries = 10;
  return e;
}

// Older tokens are cheaper to quantize: distortion of INT4 / INT2 per token
// by temporal class (BF16 is 0). Roles user and assistant; no system entries.
CalibrationTableInfo Table() {
  CalibrationTableInfo t;
  t.model = "tiny-cal";
  t.shape = Model();
  t.block_tokens = 16;
  const std::map<Temporal, std::pair<double, double>> d = {
      {Temporal::kCurrentTurn, {1.0, 8.0}},
      {Temporal::kRecentTurns, {0.5, 2.0}},
      {Temporal::kOlder, {0.2, 0.3}}};
  for (Role r : {Role::kUser, Role::kAssistant}) {
    for (const auto& [temporal, dist] : d) {
      t.entries.push_back(Entry(temporal, r, Format::kBF16, 0));
      t.entries.push_back(Entry(temporal, r, Format::kINT4, dist.first));
      t.entries.push_back(Entry(temporal, r, Format::kINT2, dist.second));
    }
  }
  t.source.tool = "hand-made";
  t.source.dataset = "none";
  t.source.calibration_ids = {"a", "b"};
  t.source.held_out_ids = {"c"};
  t.source.metric = "mse";
  t.source.created_unix_ms = 1234;
  return t;
}

PolicyInfo AllocPolicy(const std::string& name, double budget) {
  PolicyInfo p;
  p.name = name;
  p.budget_bits = budget;
  p.calibration_model = "tiny-cal";
  return p;
}

double Bits(const Encoding& e) { return kernels::EffectiveBits(e, kShape); }

// The allocation problem of a plan, built independently of the core: tags
// grouped, sinks pinned BF16, options from Table() (tag's own entries; none
// for a role without entries -> pinned BF16).
AllocProblem ProblemOf(const SequenceInfo& s, double budget) {
  const CalibrationTableInfo table = Table();
  std::map<std::tuple<int, int, int>, AllocGroup> groups;
  for (const BlockPlan& b : s.blocks) {
    AllocGroup& g = groups[{static_cast<int>(b.tag.temporal),
                            static_cast<int>(b.tag.modality),
                            static_cast<int>(b.tag.role)}];
    g.tag = b.tag;
    g.tokens += b.num_tokens;
  }
  AllocProblem p;
  p.budget_bits = budget;
  for (auto& [key, g] : groups) {
    if (g.tag.temporal != Temporal::kSink) {
      for (const auto& e : table.entries) {
        if (!(e.tag == g.tag)) continue;
        g.options.push_back(
            *MakeAllocOption(e.encoding.format, kShape, e.distortion));
      }
    }
    if (g.options.empty()) {
      g.options.push_back(*MakeAllocOption(Format::kBF16, kShape, 0));
      g.pinned = true;
    }
    p.groups.push_back(g);
  }
  return p;
}

// The allocator's choice per tag for the plan.
std::map<std::tuple<int, int, int>, Encoding> Expected(const SequenceInfo& s,
                                                       double budget) {
  const AllocProblem p = ProblemOf(s, budget);
  auto r = Solve(p);
  EXPECT_THAT(r, IsOk());
  std::map<std::tuple<int, int, int>, Encoding> out;
  for (size_t k = 0; k < p.groups.size(); ++k) {
    const Tag& t = p.groups[k].tag;
    out[{static_cast<int>(t.temporal), static_cast<int>(t.modality),
         static_cast<int>(t.role)}] =
        p.groups[k].options[r->choice[k]].encoding;
  }
  return out;
}

std::tuple<int, int, int> Key(const Tag& t) {
  return {static_cast<int>(t.temporal), static_cast<int>(t.modality),
          static_cast<int>(t.role)};
}

class AllocationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto core = ManagerCore::Create(ManagerOptions{}, &clock_);
    ASSERT_THAT(core, IsOk());
    core_ = std::move(*core);
    ASSERT_THAT(
        core_->RegisterWorker({"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40}),
        IsOk());
    ASSERT_THAT(core_->CreateTenant({"", "acme", {}, ""}), IsOk());
  }

  absl::StatusOr<SequenceInfo> Open(std::vector<Span> spans,
                                    const std::string& policy) {
    OpenSequenceRequest req;
    req.tenant_id = "acme";
    req.model = Model();
    req.spans = std::move(spans);
    req.policy = policy;
    return core_->OpenSequence(req);
  }

  // Extend, then finish its demotion with `worker` as the worker's outcome.
  absl::StatusOr<ExtendSequenceResult> Extend(
      const std::string& seq, std::vector<Span> spans, bool new_turn,
      const absl::Status& worker = absl::OkStatus(),
      const std::string& request_id = "") {
    ExtendSequenceRequest req;
    req.request_id = request_id;
    req.tenant_id = "acme";
    req.sequence_id = seq;
    req.spans = std::move(spans);
    req.new_turn = new_turn;
    auto r = core_->ExtendSequence(req);
    if (!r.ok() || !r->demotion) return r;
    return core_->FinishExtendDemotion(r->demotion->token, worker);
  }

  uint64_t DeviceUsage() {
    auto t = core_->GetTenant("acme");
    EXPECT_THAT(t, IsOk());
    return t->usage[0].used_bytes;
  }

  FakeClock clock_;
  std::unique_ptr<ManagerCore> core_;
};

TEST_F(AllocationTest, CalibrationStoreKeepsTheTableAndSource) {
  EXPECT_THAT(core_->GetCalibration("tiny-cal"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"tiny-cal\"")));
  CalibrationTableInfo t = Table();
  t.entries[1].tag.modality = Modality::kUnspecified;  // stored as TEXT
  t.entries[1].encoding.group_size = 0;                // stored as 32
  auto n = core_->PutCalibration({"r1", t});
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(*n, 18u);
  auto got = core_->GetCalibration("tiny-cal");
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(got->model, "tiny-cal");
  EXPECT_EQ(got->block_tokens, 16u);
  EXPECT_EQ(got->shape.head_dim, 64u);
  ASSERT_EQ(got->entries.size(), 18u);
  EXPECT_EQ(got->entries[1].tag.modality, Modality::kText);
  EXPECT_EQ(got->entries[1].encoding.group_size, 32u);
  EXPECT_EQ(got->entries[1].encoding.format_v, Format::kINT4);
  EXPECT_EQ(got->entries[2].distortion, 8.0);
  EXPECT_EQ(got->entries[2].tokens, 100u);
  EXPECT_EQ(got->source.tool, "hand-made");
  EXPECT_THAT(got->source.calibration_ids, ::testing::ElementsAre("a", "b"));
  EXPECT_THAT(got->source.held_out_ids, ::testing::ElementsAre("c"));
  EXPECT_EQ(got->source.created_unix_ms, 1234);

  // Same request id and table: the first reply. The id with another table
  // (another fingerprint; the service sets it from the wire request):
  // refused, nothing replaced.
  auto repeat = core_->PutCalibration({"r1", t});
  ASSERT_THAT(repeat, IsOk());
  EXPECT_EQ(*repeat, 18u);
  CalibrationTableInfo small = Table();
  small.entries.resize(3);
  PutCalibrationRequest other{"r1", small};
  other.fingerprint = 2;
  EXPECT_THAT(core_->PutCalibration(other),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("request_id=\"r1\" was used for a "
                                 "different PutCalibration request")));
  EXPECT_EQ(core_->GetCalibration("tiny-cal")->entries.size(), 18u);
  // A new request id replaces the table.
  auto n2 = core_->PutCalibration({"r2", small});
  ASSERT_THAT(n2, IsOk());
  EXPECT_EQ(*n2, 3u);
  EXPECT_EQ(core_->GetCalibration("tiny-cal")->entries.size(), 3u);
}

TEST_F(AllocationTest, CalibrationValidationNamesTheFieldAndChangesNothing) {
  struct Case {
    const char* what;
    std::function<void(CalibrationTableInfo*)> mutate;
    const char* message;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Case> cases = {
      {"model", [](auto* t) { t->model = "bad model"; }, "table.model"},
      {"layers", [](auto* t) { t->shape.n_layers = 0; },
       "table.shape.n_layers=0"},
      {"head_dim", [](auto* t) { t->shape.head_dim = 7; },
       "table.shape.head_dim=7"},
      {"block_tokens", [](auto* t) { t->block_tokens = 0; },
       "table.block_tokens 0"},
      {"empty", [](auto* t) { t->entries.clear(); }, "table.entries is empty"},
      {"temporal",
       [](auto* t) { t->entries[4].tag.temporal = Temporal::kUnspecified; },
       "table.entries[4].tag.temporal is TEMPORAL_UNSPECIFIED"},
      {"role", [](auto* t) { t->entries[5].tag.role = Role::kUnspecified; },
       "table.entries[5].tag.role is ROLE_UNSPECIFIED"},
      {"modality",
       [](auto* t) { t->entries[5].tag.modality = static_cast<Modality>(9); },
       "table.entries[5].tag.modality"},
      {"format",
       [](auto* t) { t->entries[2].encoding.format = static_cast<Format>(0); },
       "table.entries[2].format is FORMAT_UNSPECIFIED"},
      {"group", [](auto* t) { t->entries[2].encoding.group_size = 48; },
       "table.entries[2].group_size 48"},
      {"shape",
       [](auto* t) {
         t->shape.head_dim = 96;
         t->entries[2].encoding.format = Format::kTQ3;
       },
       "table.entries[2] encoding tq3 is invalid for table.block_tokens 16"},
      {"nan", [nan](auto* t) { t->entries[3].distortion = nan; },
       "table.entries[3].distortion is nan"},
      {"negative", [](auto* t) { t->entries[3].distortion = -1; },
       "table.entries[3].distortion is -1"},
      {"negative answer", [](auto* t) { t->entries[3].distortion_answer = -2; },
       "table.entries[3].distortion_answer is -2"},
      {"nan dnll", [nan](auto* t) { t->entries[4].dnll = nan; },
       "table.entries[4].dnll / dnll_answer are nan / 0"},
      {"duplicate",
       [](auto* t) {
         t->entries[7] = t->entries[1];
         t->entries[7].encoding.group_size = 32;  // same canonical encoding
       },
       "table.entries[7] repeats table.entries[1]"},
  };
  for (const Case& c : cases) {
    CalibrationTableInfo t = Table();
    c.mutate(&t);
    const absl::Status st = core_->PutCalibration({"", t}).status();
    EXPECT_THAT(
        st, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.what << ": " << st;
    EXPECT_THAT(core_->GetCalibration("tiny-cal"),
                StatusIs(absl::StatusCode::kNotFound, ::testing::_))
        << c.what;
  }
  EXPECT_THAT(core_->PutCalibration({"bad id!", Table()}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(core_->GetCalibration(""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model")));
}

TEST_F(AllocationTest, PutPolicyValidatesAllocationFields) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    std::function<void(PolicyInfo*)> mutate;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](auto* p) { p->budget_bits = -1; }, "policy.budget_bits is -1"},
      {[nan](auto* p) { p->budget_bits = nan; }, "policy.budget_bits is nan"},
      {[](auto* p) { p->budget_bits = 65; }, "policy.budget_bits is 65"},
      {[](auto* p) { p->calibration_model = ""; }, "policy.calibration_model"},
      {[](auto* p) {
         p->budget_bits = 0;
         p->rules.push_back(PolicyRuleInfo{});
         p->rules.back().encoding.format = Format::kBF16;
       },
       "policy.calibration_model is \"tiny-cal\" but policy.budget_bits is 0"},
      {[](auto* p) {
         p->candidates.resize(2);
         p->candidates[0].format = Format::kINT4;
         p->candidates[1].format = static_cast<Format>(255);
       },
       "policy.candidates[1].format"},
      {[](auto* p) {
         p->candidates.resize(2);
         p->candidates[0].format = Format::kINT4;
         p->candidates[1].format = Format::kINT4;
         p->candidates[1].group_size = 32;
       },
       "policy.candidates[1] encoding int4 repeats policy.candidates[0]"},
      {[](auto* p) { p->answer_weight = -0.5; },
       "policy.answer_weight is -0.5; it must be finite and >= 0"},
      {[nan](auto* p) { p->answer_weight = nan; },
       "policy.answer_weight is nan"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    PolicyInfo p = AllocPolicy("alloc", 4);
    cases[i].mutate(&p);
    EXPECT_THAT(core_->PutPolicy({"", p}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(cases[i].message)))
        << i;
  }
  EXPECT_EQ(core_->ListPolicies().size(), BuiltinPolicies().size());
  // Candidates need an allocation policy.
  PolicyInfo rules;
  rules.name = "plain";
  rules.rules.resize(1);
  rules.rules[0].encoding.format = Format::kINT4;
  rules.candidates.resize(1);
  rules.candidates[0].format = Format::kINT4;
  EXPECT_THAT(core_->PutPolicy({"", rules}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("policy.candidates has 1 entries but "
                                 "policy.budget_bits is 0")));
  // So does an answer weight.
  rules.candidates.clear();
  rules.answer_weight = 1;
  EXPECT_THAT(core_->PutPolicy({"", rules}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("policy.answer_weight is 1 but "
                                 "policy.budget_bits is 0")));
  // Valid: no rules, no catch-all needed; the table may come later.
  PolicyInfo ok = AllocPolicy("alloc", 4.5);
  ok.candidates.resize(2);
  ok.candidates[0].format = Format::kINT4;
  ok.candidates[1].format = Format::kINT2;
  auto stored = core_->PutPolicy({"", ok});
  ASSERT_THAT(stored, IsOk());
  EXPECT_EQ(stored->budget_bits, 4.5);
  EXPECT_EQ(stored->calibration_model, "tiny-cal");
  ASSERT_EQ(stored->candidates.size(), 2u);
  EXPECT_EQ(stored->candidates[1].format_v, Format::kINT2);
  EXPECT_EQ(stored->candidates[1].group_size, 32u);
  EXPECT_EQ(core_->ListPolicies().back().budget_bits, 4.5);
  // A request id reused for another policy (another fingerprint): refused.
  ASSERT_THAT(core_->PutPolicy({"p-1", ok, 1}), IsOk());
  PolicyInfo other = ok;
  other.budget_bits = 3.0;
  EXPECT_THAT(core_->PutPolicy({"p-1", other, 2}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("request_id=\"p-1\" was used for a "
                                 "different PutPolicy request")));
  EXPECT_EQ(core_->ListPolicies().back().budget_bits, 4.5);
}

TEST_F(AllocationTest, OpenNeedsTheTableAMatchingShapeAndAFeasibleBudget) {
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("a8", 8)}), IsOk());
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("a5", 5)}), IsOk());
  const std::vector<Span> spans = {S(Role::kUser, 64), S(Role::kAssistant, 64)};
  EXPECT_THAT(Open(spans, "a8"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("model \"tiny-cal\", which is not stored")));
  CalibrationTableInfo other = Table();
  other.shape.n_layers = 4;
  ASSERT_THAT(core_->PutCalibration({"", other}), IsOk());
  EXPECT_THAT(Open(spans, "a8"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("was measured on n_layers 4")));
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());
  // Budget 5: the cheapest plan is a BF16 sink (16 x 16) and INT2 elsewhere
  // (112 x 3.5): (256 + 392) / 128 = 5.0625 bits per value.
  const absl::Status a5 = Open(spans, "a5").status();
  EXPECT_THAT(a5, StatusIs(absl::StatusCode::kResourceExhausted,
                           AllOf(HasSubstr("policy \"a5\""),
                                 HasSubstr("allocation infeasible"),
                                 HasSubstr("need 5.0625 effective bits"),
                                 HasSubstr("budget_bits is 5"))))
      << a5;
  EXPECT_EQ(DeviceUsage(), 0u);
  EXPECT_TRUE(core_->ListSequences("acme", true)->empty());
}

TEST_F(AllocationTest, OpenChoosesWhatTheAllocatorChooses) {
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("a8", 8)}), IsOk());
  // sink(user 16) BF16 pinned | user 48 current | assistant 64 current.
  // Budget 8 x 128 = 1024 bit-tokens; the sink takes 256; both INT4 would be
  // 616 (fits), one of them BF16 does not: both INT4.
  auto seq = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "a8");
  ASSERT_THAT(seq, IsOk());
  ASSERT_EQ(seq->blocks.size(), 8u);
  EXPECT_EQ(seq->blocks[0].tag.temporal, Temporal::kSink);
  EXPECT_EQ(seq->blocks[0].encoding, Format::kBF16);
  const auto want = Expected(*seq, 8);
  for (const BlockPlan& b : seq->blocks) {
    EXPECT_EQ(b.encoding, want.at(Key(b.tag))) << b.index;
    if (b.index > 0) {
      EXPECT_EQ(b.encoding, Format::kINT4) << b.index;
    }
  }
  EXPECT_EQ(seq->bytes, kBf16 + 7 * kInt4);
  EXPECT_EQ(DeviceUsage(), seq->bytes);

  // Budget 6.5: 832 - 256 = 576 for 112 tokens. Both INT4 (616) do not
  // fit; user INT2 + assistant INT4 = 520 (distortion 48x8 + 64x1 = 448)
  // beats user INT4 + assistant INT2 = 488 (48x1 + 64x8 = 560).
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("a65", 6.5)}), IsOk());
  auto seq7 = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "a65");
  ASSERT_THAT(seq7, IsOk());
  const auto want7 = Expected(*seq7, 6.5);
  for (const BlockPlan& b : seq7->blocks) {
    EXPECT_EQ(b.encoding, want7.at(Key(b.tag))) << b.index;
  }
  EXPECT_EQ(seq7->blocks[1].encoding, Format::kINT2);  // user
  EXPECT_EQ(seq7->blocks[4].encoding, Format::kINT4);  // assistant
}

TEST_F(AllocationTest, AnswerWeightProtectsTheAnswerPositions) {
  // The table of OpenChoosesWhatTheAllocatorChooses plus an answer-position
  // distortion: INT2 user tokens hurt the answer positions (10 per token),
  // nothing else does.
  CalibrationTableInfo t = Table();
  for (CalibrationEntryInfo& e : t.entries) {
    if (e.tag.role == Role::kUser && e.encoding.format == Format::kINT2) {
      e.distortion_answer = 10;
    }
  }
  ASSERT_THAT(core_->PutCalibration({"", t}), IsOk());
  // Budget 6.5, user 48 + assistant 64 current tokens (see above): all
  // tokens only, user INT2 + assistant INT4 (48x8 + 64x1 = 448) beats user
  // INT4 + assistant INT2 (48x1 + 64x8 = 560);
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("w0", 6.5)}), IsOk());
  PolicyInfo weighted = AllocPolicy("w1", 6.5);
  weighted.answer_weight = 1;
  auto stored = core_->PutPolicy({"", weighted});
  ASSERT_THAT(stored, IsOk());
  EXPECT_EQ(stored->answer_weight, 1);
  auto plain = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "w0");
  ASSERT_THAT(plain, IsOk());
  EXPECT_EQ(plain->blocks[1].encoding, Format::kINT2);  // user
  EXPECT_EQ(plain->blocks[7].encoding, Format::kINT4);  // assistant
  // with answer_weight 1 the user's INT2 costs 48 x (8 + 10) = 864 more, so
  // user INT4 + assistant INT2 (560) wins.
  auto protect = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "w1");
  ASSERT_THAT(protect, IsOk());
  EXPECT_EQ(protect->blocks[1].encoding, Format::kINT4);
  EXPECT_EQ(protect->blocks[7].encoding, Format::kINT2);
}

TEST_F(AllocationTest, DnllObjectiveAllocatesByTheMeasuredNllIncrease) {
  // An output-metric table whose NLL increase disagrees with its KL: user
  // INT2 costs the next tokens' NLL most (+5 per token) and user INT4
  // lowers it (-0.2, negative like TQ4 on kvproxy-18m), while assistant
  // INT2 barely moves it (+0.1).
  CalibrationTableInfo t = Table();
  t.source.metric = "output-kl: test";
  for (CalibrationEntryInfo& e : t.entries) {
    if (e.tag.temporal != Temporal::kCurrentTurn) continue;
    if (e.encoding.format == Format::kINT4) {
      e.dnll = e.tag.role == Role::kUser ? -0.2 : 0.3;
    } else if (e.encoding.format == Format::kINT2) {
      e.dnll = e.tag.role == Role::kUser ? 5.0 : 0.1;
    }
  }
  ASSERT_THAT(core_->PutCalibration({"", t}), IsOk());
  PolicyInfo by_nll = AllocPolicy("nll", 6.5);
  by_nll.objective = 1;
  auto stored = core_->PutPolicy({"", by_nll});
  ASSERT_THAT(stored, IsOk());
  EXPECT_EQ(stored->objective, 1);
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("kl", 6.5)}), IsOk());
  // By KL (AnswerWeightProtectsTheAnswerPositions): user INT2, assistant
  // INT4. By NLL: user INT2 + assistant INT4 costs 48 x 5 + 64 x 0.3 = 259,
  // user INT4 + assistant INT2 48 x -0.2 + 64 x 0.1 = -3.2: the latter.
  auto kl = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "kl");
  ASSERT_THAT(kl, IsOk());
  EXPECT_EQ(kl->blocks[1].encoding, Format::kINT2);
  EXPECT_EQ(kl->blocks[7].encoding, Format::kINT4);
  auto nll = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "nll");
  ASSERT_THAT(nll, IsOk());
  EXPECT_EQ(nll->blocks[1].encoding, Format::kINT4);
  EXPECT_EQ(nll->blocks[7].encoding, Format::kINT2);
}

TEST_F(AllocationTest, DnllObjectiveNeedsAnOutputTableAndAnAllocation) {
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());  // metric "mse"
  PolicyInfo p = AllocPolicy("nll", 6.5);
  p.objective = 1;
  ASSERT_THAT(core_->PutPolicy({"", p}), IsOk());
  EXPECT_THAT(Open({S(Role::kUser, 64)}, "nll").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("OBJECTIVE_DNLL"),
                             HasSubstr("has metric \"mse\""))));
  p.objective = 7;
  EXPECT_THAT(core_->PutPolicy({"", p}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("policy.objective is 7")));
  PolicyInfo rules;
  rules.name = "rules-nll";
  rules.rules.resize(1);
  rules.rules[0].encoding.format = Format::kINT4;
  rules.objective = 1;
  EXPECT_THAT(core_->PutPolicy({"", rules}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("policy.budget_bits is 0")));
}

TEST_F(AllocationTest, PinsCandidatesAndFallbacks) {
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());
  PolicyInfo p = AllocPolicy("pins", 12);
  // Un-pin sinks (a non-BF16 rule leaves them to the allocator); pin
  // assistant blocks BF16; only INT2 and BF16 may be chosen.
  p.rules.resize(2);
  p.rules[0].temporal = Temporal::kSink;
  p.rules[0].encoding.format = Format::kINT8;
  p.rules[1].role = Role::kAssistant;
  p.rules[1].encoding.format = Format::kBF16;
  p.candidates.resize(2);
  p.candidates[0].format = Format::kINT2;
  p.candidates[1].format = Format::kBF16;
  ASSERT_THAT(core_->PutPolicy({"", p}), IsOk());
  // Blocks: sink(user) | user | system | image(user) | assistant.
  auto seq =
      Open({S(Role::kUser, 32), S(Role::kSystem, 16),
            S(Role::kUser, 16, Modality::kImage), S(Role::kAssistant, 16)},
           "pins");
  ASSERT_THAT(seq, IsOk());
  ASSERT_EQ(seq->blocks.size(), 5u);
  // Budget 12 over 80 tokens = 960; the assistant pin takes 256, the system
  // (no entries for the role: pinned) 256; 448 left for three 16-token
  // groups: the sink borrows the user entries of the nearest temporal
  // (current), the image block the text ones.
  EXPECT_EQ(seq->blocks[2].encoding, Format::kBF16);  // system: pinned
  EXPECT_EQ(seq->blocks[4].encoding, Format::kBF16);  // assistant: pinned
  for (int i : {0, 1, 3}) {
    const Encoding e = seq->blocks[i].encoding;
    EXPECT_TRUE(e == Encoding(Format::kINT2) || e == Encoding(Format::kBF16))
        << i;
  }
  double cost = 0;
  for (const BlockPlan& b : seq->blocks)
    cost += b.num_tokens * Bits(b.encoding);
  EXPECT_LE(cost, 12.0 * 80 * (1 + kBudgetRelTol));
  // Options BF16 (distortion 0) or INT2 (8): one group in BF16 costs
  // 256 + 2 x 56 = 368 <= 448, two 512 + 56 > 448: exactly one is BF16.
  int bf16 = 0;
  for (int i : {0, 1, 3}) bf16 += seq->blocks[i].encoding == Format::kBF16;
  EXPECT_EQ(bf16, 1);
}

TEST_F(AllocationTest, AgingDemotesOlderTurnsAndNeverPromotes) {
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());
  const double budget = 6;
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("a6", budget)}), IsOk());
  auto open = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "a6");
  ASSERT_THAT(open, IsOk());
  SequenceInfo seq = *open;
  const std::string id = seq.sequence_id;
  size_t demoted_total = 0;
  for (int turn = 1; turn <= 4; ++turn) {
    SCOPED_TRACE(absl::StrCat("turn ", turn));
    std::map<uint64_t, BlockPlan> before;
    for (const BlockPlan& b : seq.blocks) before[b.lineage_id] = b;
    const uint64_t usage_before = DeviceUsage();
    auto r = Extend(id, {S(Role::kUser, 64), S(Role::kAssistant, 64)}, true);
    ASSERT_THAT(r, IsOk());
    EXPECT_FALSE(r->demotion.has_value());
    const SequenceInfo& now = r->sequence;
    const auto want = Expected(now, budget);
    std::set<uint64_t> demoted;
    uint64_t freed = 0;
    for (const BlockPlan& b : r->demoted_blocks) {
      demoted.insert(b.lineage_id);
      const BlockPlan& old = before.at(b.lineage_id);
      const uint64_t ob = 2 * kernels::PageBytes(old.encoding, kShape);
      const uint64_t nb = 2 * kernels::PageBytes(b.encoding, kShape);
      EXPECT_LT(nb, ob) << b.index;
      freed += ob - nb;
    }
    uint64_t added = 0;
    double cost = 0;
    for (const BlockPlan& b : now.blocks) {
      cost += b.num_tokens * Bits(b.encoding);
      const Encoding chosen = want.at(Key(b.tag));
      auto it = before.find(b.lineage_id);
      if (it == before.end()) {  // new: its tag's choice
        EXPECT_EQ(b.encoding, chosen) << b.index;
        added += 2 * kernels::PageBytes(b.encoding, kShape);
        continue;
      }
      const Encoding old = it->second.encoding;
      const bool smaller =
          kernels::PageBytes(chosen, kShape) < kernels::PageBytes(old, kShape);
      // Demoted exactly when the choice got smaller; never promoted.
      EXPECT_EQ(b.encoding, smaller ? chosen : old) << b.index;
      EXPECT_EQ(demoted.count(b.lineage_id), smaller ? 1u : 0u) << b.index;
      EXPECT_LE(kernels::PageBytes(b.encoding, kShape),
                kernels::PageBytes(old, kShape));
    }
    // The allocator's bound over the plan, sink included; the blocks hold at
    // most their tag's choice, so the plan is within it too.
    EXPECT_LE(cost, budget * now.num_tokens * (1 + kBudgetRelTol));
    EXPECT_EQ(DeviceUsage(), usage_before + added - freed);
    EXPECT_EQ(DeviceUsage(), now.bytes);
    demoted_total += demoted.size();
    seq = now;
  }
  EXPECT_GT(demoted_total, 0u);
  // Turn 0 (older since turn 3) ends in INT2 except its sink.
  for (const BlockPlan& b : seq.blocks) {
    if (b.first_token >= 128 || b.index == 0) continue;
    EXPECT_EQ(b.tag.temporal, Temporal::kOlder) << b.index;
    EXPECT_EQ(b.encoding, Format::kINT2) << b.index;
  }
  EXPECT_EQ(seq.blocks[0].encoding, Format::kBF16);
  // One BLOCK_DEMOTED event per demotion.
  size_t events = 0;
  for (const Event& e : core_->events().Retained(1, EventFilter{})) {
    events += e.kind == EventKind::kBlockDemoted;
  }
  EXPECT_EQ(events, demoted_total);
}

TEST_F(AllocationTest, FailedWorkerDemotionKeepsTheEncodingAndRetriesLater) {
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("a6", 6)}), IsOk());
  auto open = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "a6");
  ASSERT_THAT(open, IsOk());
  const std::string id = open->sequence_id;
  // Run turns until one wants demotions, failing the worker call.
  ExtendSequenceRequest req;
  req.tenant_id = "acme";
  req.sequence_id = id;
  req.spans = {S(Role::kUser, 64), S(Role::kAssistant, 64)};
  req.new_turn = true;
  std::optional<DemotePrepared> pending;
  for (int turn = 1; turn <= 4 && !pending; ++turn) {
    req.request_id = absl::StrCat("ext-", turn);
    auto r = core_->ExtendSequence(req);
    ASSERT_THAT(r, IsOk());
    if (r->demotion) pending = r->demotion;
  }
  ASSERT_TRUE(pending.has_value());
  ASSERT_FALSE(pending->blocks.empty());
  EXPECT_LT(pending->bytes_delta, 0);
  // In flight: the same request id is ABORTED.
  EXPECT_THAT(core_->ExtendSequence(req),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("in progress")));
  const uint64_t usage = DeviceUsage();
  auto fin = core_->FinishExtendDemotion(
      pending->token, absl::FailedPreconditionError("shared with a fork"));
  ASSERT_THAT(fin, IsOk());
  EXPECT_TRUE(fin->demoted_blocks.empty());
  EXPECT_EQ(DeviceUsage(), usage);
  for (const BlockPlan& want : pending->blocks) {
    const BlockPlan& b = fin->sequence.blocks[want.index];
    EXPECT_NE(b.encoding, want.encoding) << b.index;  // kept
  }
  // The repeat now returns the final reply.
  auto again = core_->ExtendSequence(req);
  ASSERT_THAT(again, IsOk());
  EXPECT_FALSE(again->demotion.has_value());
  EXPECT_EQ(again->sequence.num_tokens, fin->sequence.num_tokens);
  EXPECT_THAT(core_->FinishExtendDemotion(pending->token, absl::OkStatus()),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  // The next Extend (an append, no new turn) demotes them.
  auto next = Extend(id, {S(Role::kAssistant, 16)}, false);
  ASSERT_THAT(next, IsOk());
  std::set<uint64_t> demoted;
  for (const BlockPlan& b : next->demoted_blocks) demoted.insert(b.lineage_id);
  for (const BlockPlan& want : pending->blocks) {
    EXPECT_EQ(demoted.count(want.lineage_id), 1u) << want.index;
  }
  EXPECT_EQ(DeviceUsage(), next->sequence.bytes);
}

TEST_F(AllocationTest, BlocksSharedWithAForkAreNotDemoted) {
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());
  ASSERT_THAT(core_->PutPolicy({"", AllocPolicy("a6", 6)}), IsOk());
  auto open = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "a6");
  ASSERT_THAT(open, IsOk());
  ForkSequenceRequest fork;
  fork.tenant_id = "acme";
  fork.parent_sequence_id = open->sequence_id;
  ASSERT_THAT(core_->ForkSequence(fork), IsOk());
  for (int turn = 1; turn <= 4; ++turn) {
    auto r = Extend(open->sequence_id,
                    {S(Role::kUser, 64), S(Role::kAssistant, 64)}, true);
    ASSERT_THAT(r, IsOk());
    for (const BlockPlan& b : r->demoted_blocks) {
      EXPECT_GE(b.first_token, 128u) << "shared block " << b.index;
    }
    for (size_t i = 0; i < open->blocks.size(); ++i) {
      EXPECT_EQ(r->sequence.blocks[i].encoding, open->blocks[i].encoding);
    }
  }
}

TEST_F(AllocationTest, ExtendOverBudgetTakesTheCheapestAndSucceeds) {
  ASSERT_THAT(core_->PutCalibration({"", Table()}), IsOk());
  // 8 bits: feasible at Open (two INT4 groups), then a long BF16-pinned
  // system span makes every later plan infeasible.
  PolicyInfo p = AllocPolicy("a8", 8);
  ASSERT_THAT(core_->PutPolicy({"", p}), IsOk());
  auto open = Open({S(Role::kUser, 64), S(Role::kAssistant, 64)}, "a8");
  ASSERT_THAT(open, IsOk());
  auto r = Extend(open->sequence_id, {S(Role::kSystem, 512)}, false);
  ASSERT_THAT(r, IsOk());
  for (const BlockPlan& b : r->sequence.blocks) {
    if (b.tag.role == Role::kSystem || b.index == 0) {
      EXPECT_EQ(b.encoding, Format::kBF16) << b.index;
    } else {
      EXPECT_EQ(b.encoding, Format::kINT2) << b.index;  // the cheapest
    }
  }
  EXPECT_EQ(r->demoted_blocks.size(), 7u);
  EXPECT_EQ(DeviceUsage(), kBf16 * 33 + kInt2 * 7);
}

}  // namespace
}  // namespace triax::manager
