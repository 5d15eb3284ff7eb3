// The capacity planner (capacity.h): the FP8/INT4 serving note's tables for
// the Llama-3-8B shape, triaxkv's real page bytes beside them, sessions,
// tenant shares, mixed rows through the manager's allocator, what-ifs and
// bad input.
#include "kvmanager/capacity.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

constexpr int64_t kGiB = int64_t{1} << 30;

CapacityPolicySpec Uniform(Format f, uint32_t group = 0) {
  CapacityPolicySpec p;
  p.encoding.format = f;
  p.encoding.group_size = group;
  p.encoding.scale_dtype = 1;  // FP16
  return p;
}

// The note's set-up: Llama-3-8B, 45 GiB of KV memory (80 GiB GPU, 35 GiB of
// weights and runtime), BF16 / FP8 / INT4 group-64 with FP16 scales.
CapacityRequest NoteRequest(double ceiling) {
  CapacityRequest r;
  r.model_preset = "Llama-3-8B";
  r.gpu_memory_bytes = 80 * kGiB;
  r.reserve_bytes = 35 * kGiB;
  r.ceiling = ceiling;
  r.policies = {Uniform(Format::kBF16), Uniform(Format::kFP8),
                Uniform(Format::kINT4, 64)};
  return r;
}

TEST(CapacityTest, ReproducesTheNotesTablesForLlama3_8B) {
  auto full = PlanCapacity(NoteRequest(1.0));
  ASSERT_THAT(full, IsOk());
  EXPECT_EQ(full->model.n_layers, 32u);
  EXPECT_EQ(full->model.n_kv_heads, 8u);
  EXPECT_EQ(full->model.head_dim, 128u);
  ASSERT_EQ(full->rows.size(), 3u);
  // KiB per token: 128.0 / 64.0 / 34.0.
  EXPECT_EQ(full->rows[0].ideal_bytes_per_token, 128.0 * 1024);
  EXPECT_EQ(full->rows[1].ideal_bytes_per_token, 64.0 * 1024);
  EXPECT_EQ(full->rows[2].ideal_bytes_per_token, 34.0 * 1024);
  // Tokens in 45 GiB.
  EXPECT_EQ(full->rows[0].ideal_tokens, 368640);
  EXPECT_EQ(full->rows[1].ideal_tokens, 737280);
  EXPECT_EQ(full->rows[2].ideal_tokens, 1387821);

  auto ceiling = PlanCapacity(NoteRequest(0.7));
  ASSERT_THAT(ceiling, IsOk());
  EXPECT_EQ(ceiling->rows[0].ideal_tokens, 258048);
  EXPECT_EQ(ceiling->rows[1].ideal_tokens, 516096);
  EXPECT_EQ(ceiling->rows[2].ideal_tokens, 971475);
}

TEST(CapacityTest, PagesColumnIsPageBytesPerBlockOverBlockTokens) {
  auto plan = PlanCapacity(NoteRequest(1.0));
  ASSERT_THAT(plan, IsOk());
  const kernels::PageShape shape{16, 8, 128};
  const Encoding encodings[] = {
      Encoding(Format::kBF16), Encoding(Format::kFP8),
      Encoding(Format::kINT4, Format::kINT4, 64, ScaleDtype::kFP16)};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    const double block = 32.0 * kernels::PageBytes(encodings[i], shape);
    EXPECT_EQ(plan->rows[i].block_bytes, block);
    EXPECT_EQ(plan->rows[i].page_bytes_per_token, block / 16);
    EXPECT_EQ(
        plan->rows[i].page_tokens,
        static_cast<int64_t>(45 * kGiB / static_cast<int64_t>(block)) * 16);
  }
  // BF16 pages hold nothing but codes: both columns agree.
  EXPECT_EQ(plan->rows[0].page_bytes_per_token, 128.0 * 1024);
  EXPECT_EQ(plan->rows[0].page_tokens, 368640);
  // FP8: an f32 scale per head per page for K and V, each section padded
  // to 16 bytes: 16416 + 16416 bytes a layer page, 64.125 KiB a token.
  EXPECT_EQ(plan->rows[1].page_bytes_per_token, 64.125 * 1024);
  EXPECT_EQ(plan->rows[1].page_tokens, 735840);
  // INT4 g64: keys grouped over min(64, 16) = 16 tokens with an FP16 scale
  // AND zero per group (4096 bytes), values over 64 channels (1024), plus
  // 8192 + 8192 bytes of codes: 21504 bytes a layer page, 42.0 KiB a token.
  EXPECT_EQ(plan->rows[2].page_bytes_per_token, 42.0 * 1024);
  EXPECT_EQ(plan->rows[2].page_tokens, 1123472);
  EXPECT_EQ(plan->rows[2].encoding, "k=int4,v=int4,g=64");
}

TEST(CapacityTest, FramesSpreadTheirTailOverTheirPages) {
  CapacityRequest r = NoteRequest(1.0);
  r.frame_bytes = 256 * 1024;
  auto plan = PlanCapacity(r);
  ASSERT_THAT(plan, IsOk());
  // BF16 pages (64 KiB) fill a frame exactly.
  EXPECT_EQ(plan->rows[0].page_tokens, 368640);
  // INT4 g64 pages (21504 bytes): 12 a frame, 4096 bytes of tail.
  EXPECT_EQ(plan->rows[2].block_bytes, 32.0 * 262144 / 12);
  EXPECT_LT(plan->rows[2].page_tokens, 1123472);
}

TEST(CapacityTest, SessionsCountBlocksSinksAndWindowPages) {
  CapacityRequest r = NoteRequest(1.0);
  r.context_lengths = {8192, 100};
  CapacityPolicySpec windowed = Uniform(Format::kINT4, 64);
  windowed.sink_tokens = 16;
  windowed.window_tokens = 32;
  r.policies.push_back(windowed);
  auto plan = PlanCapacity(r);
  ASSERT_THAT(plan, IsOk());
  // BF16 at 8192 tokens: 512 blocks of 2 MiB each; 45 GiB / 1 GiB.
  ASSERT_EQ(plan->rows[0].sessions.size(), 2u);
  EXPECT_EQ(plan->rows[0].sessions[0].page_session_bytes, uint64_t{1} << 30);
  EXPECT_EQ(plan->rows[0].sessions[0].page_sessions, 45);
  EXPECT_EQ(plan->rows[0].sessions[0].ideal_sessions, 45);
  // 100 tokens: 7 blocks (the last one partial).
  EXPECT_EQ(plan->rows[0].sessions[1].page_session_bytes, 7u * 2 * 1024 * 1024);
  EXPECT_EQ(plan->rows[3].label, "k=int4,v=int4,g=64+sink=16+window=32");
  // INT4 with a BF16 sink block and a 32-token window at 100 tokens: block 0
  // is BF16; blocks 4..6 end after token 68 so they also hold a BF16 window
  // page: 1 + 3 BF16 pages and 6 INT4 pages per layer.
  const double int4 = 21504, bf16 = 65536;
  EXPECT_EQ(plan->rows[3].sessions[1].page_session_bytes,
            static_cast<uint64_t>(32 * (4 * bf16 + 6 * int4)));
  // Idealized: 48 tokens in BF16, 52 in INT4.
  EXPECT_EQ(plan->rows[3].sessions[1].ideal_session_bytes,
            48 * 131072.0 + 52 * 34816.0);
}

TEST(CapacityTest, TenantsShareByWaterFillingBetweenFloorAndCeiling) {
  CapacityRequest r = NoteRequest(1.0);
  r.context_lengths = {8192};
  // 45 GiB: "big" has a 30 GiB floor, "small" a 5 GiB ceiling, "mid"
  // neither: small 5, then big and mid split the rest above big's floor.
  r.tenants = {{"big", 30 * kGiB, 0}, {"small", 0, 5 * kGiB}, {"mid", 0, 0}};
  auto plan = PlanCapacity(r);
  ASSERT_THAT(plan, IsOk());
  ASSERT_EQ(plan->tenants.size(), 3u);
  EXPECT_FALSE(plan->floors_exceed_memory);
  EXPECT_EQ(plan->tenants[0].share_bytes, 30.0 * kGiB);
  EXPECT_EQ(plan->tenants[1].share_bytes, 5.0 * kGiB);
  EXPECT_EQ(plan->tenants[2].share_bytes, 10.0 * kGiB);
  // BF16 row: 10 GiB is 10 sessions of 8192 tokens.
  ASSERT_EQ(plan->rows[0].tenants.size(), 3u);
  EXPECT_EQ(plan->rows[0].tenants[2].tenant_id, "mid");
  EXPECT_EQ(plan->rows[0].tenants[2].page_sessions[0], 10);
  EXPECT_EQ(plan->rows[0].tenants[1].page_sessions[0], 5);
  EXPECT_EQ(plan->rows[0].tenants[0].page_tokens, 30 * 8192);

  // Floors past the memory: floors scaled down, flagged.
  r.tenants = {{"a", 60 * kGiB, 0}, {"b", 30 * kGiB, 0}};
  plan = PlanCapacity(r);
  ASSERT_THAT(plan, IsOk());
  EXPECT_TRUE(plan->floors_exceed_memory);
  EXPECT_NEAR(plan->tenants[0].share_bytes, 30.0 * kGiB, 1);
  EXPECT_NEAR(plan->tenants[1].share_bytes, 15.0 * kGiB, 1);
}

// A calibration table on the Llama-3-8B shape for two tags, the tag mix of
// a session with a sink, a system prompt and tool results.
CalibrationTableInfo Table() {
  CalibrationTableInfo t;
  t.model = "plan-test";
  t.shape.name = "llama-3-8b";
  t.shape.n_layers = 32;
  t.shape.n_kv_heads = 8;
  t.shape.n_q_heads = 32;
  t.shape.head_dim = 128;
  t.block_tokens = 16;
  const Tag tags[] = {{Temporal::kRecentTurns, Modality::kText, Role::kSystem},
                      {Temporal::kOlder, Modality::kText, Role::kToolResult}};
  const Format formats[] = {Format::kBF16, Format::kINT8, Format::kINT4,
                            Format::kINT2};
  for (const Tag& tag : tags) {
    double d = 0;
    for (Format f : formats) {
      CalibrationEntryInfo e;
      e.tag = tag;
      e.encoding.format = f;
      // System prompts suffer more from low bits than old tool results.
      e.distortion = d * (tag.role == Role::kSystem ? 10 : 1);
      t.entries.push_back(e);
      d = d == 0 ? 0.01 : d * 10;
    }
  }
  return t;
}

std::vector<TagTokens> Mix() {
  return {{{Temporal::kSink, Modality::kText, Role::kSystem}, 16},
          {{Temporal::kRecentTurns, Modality::kText, Role::kSystem}, 1008},
          {{Temporal::kOlder, Modality::kText, Role::kToolResult}, 7168}};
}

TEST(CapacityTest, AllocationRowsComeFromTheManagersAllocator) {
  CapacityRequest r = NoteRequest(1.0);
  r.calibration = Table();
  r.tag_mix = Mix();
  CapacityPolicySpec loose, tight, rules;
  loose.budget_bits = 16;
  tight.budget_bits = 4.5;
  rules.policy = "triaxial-static";
  r.policies = {Uniform(Format::kBF16), loose, tight, rules};
  auto plan = PlanCapacity(r);
  ASSERT_THAT(plan, IsOk());
  ASSERT_EQ(plan->rows.size(), 4u);
  // 16 bits is BF16 everywhere.
  EXPECT_EQ(plan->rows[1].kind, "allocation");
  EXPECT_EQ(plan->rows[1].label, "triaxial@16b");
  EXPECT_EQ(plan->rows[1].page_tokens, plan->rows[0].page_tokens);
  // 4.5 bits: within budget, the sink pinned to BF16, tool results given
  // fewer bits than the system prompt (they cost less distortion).
  const CapacityRow& t = plan->rows[2];
  EXPECT_TRUE(t.calibration_shape_matches);
  EXPECT_LE(t.page_bits, 4.5 * (1 + 1e-9));
  EXPECT_GT(t.page_tokens, 2 * plan->rows[0].page_tokens);
  ASSERT_EQ(t.mix.size(), 3u);
  Encoding sink, system, tool;
  for (const CapacityTagChoice& c : t.mix) {
    if (c.tag.temporal == Temporal::kSink) sink = c.encoding;
    if (c.tag.temporal == Temporal::kRecentTurns) system = c.encoding;
    if (c.tag.temporal == Temporal::kOlder) tool = c.encoding;
  }
  EXPECT_EQ(sink, Encoding(Format::kBF16));
  EXPECT_LT(kernels::FormatBits(tool.k), kernels::FormatBits(system.k));
  // triaxial-static: sink BF16, system INT4, older INT2.
  const CapacityRow& s = plan->rows[3];
  EXPECT_EQ(s.kind, "rules");
  EXPECT_EQ(s.label, "triaxial-static");
  const kernels::PageShape shape{16, 8, 128};
  const double expect =
      (16 * 32.0 * kernels::PageBytes(Encoding(Format::kBF16), shape) +
       1008 * 32.0 * kernels::PageBytes(Encoding(Format::kINT4), shape) +
       7168 * 32.0 * kernels::PageBytes(Encoding(Format::kINT2), shape)) /
      8192;
  EXPECT_DOUBLE_EQ(s.block_bytes, expect);

  // Below the cheapest mix: the allocator's RESOURCE_EXHAUSTED, named.
  r.policies = {tight};
  r.policies[0].budget_bits = 1;
  EXPECT_THAT(PlanCapacity(r),
              StatusIs(C::kResourceExhausted, HasSubstr("policies[0]: ")));
}

TEST(CapacityTest, MixedRowsNeedAMixAndAllocationRowsATable) {
  CapacityRequest r = NoteRequest(1.0);
  CapacityPolicySpec rules;
  rules.policy = "triaxial-static";
  r.policies = {rules};
  EXPECT_THAT(PlanCapacity(r),
              StatusIs(C::kFailedPrecondition, HasSubstr("tag mix")));
  CapacityPolicySpec alloc;
  alloc.budget_bits = 4;
  r.policies = {alloc};
  r.tag_mix = Mix();
  EXPECT_THAT(PlanCapacity(r),
              StatusIs(C::kFailedPrecondition, HasSubstr("calibration table")));
}

TEST(CapacityTest, WhatIfsAddGpusTenantsAndPolicies) {
  CapacityRequest r = NoteRequest(1.0);
  r.tenants = {{"a", 0, 0}};
  CapacityWhatIf gpu;
  gpu.label = "+1 GPU";
  gpu.add_gpus = 1;
  CapacityWhatIf tenant;
  tenant.label = "+tenant b";
  tenant.add_tenants = {{"b", 0, 0}};
  CapacityWhatIf policy;
  policy.label = "int2";
  policy.policies = {Uniform(Format::kINT2)};
  r.what_ifs = {gpu, tenant, policy};
  auto plan = PlanCapacity(r);
  ASSERT_THAT(plan, IsOk());
  ASSERT_EQ(plan->what_ifs.size(), 3u);
  EXPECT_EQ(plan->what_ifs[0].gpu_count, 2);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(plan->what_ifs[0].rows[i].page_tokens,
              2 * plan->rows[i].page_tokens);
  }
  ASSERT_EQ(plan->what_ifs[1].tenants.size(), 2u);
  EXPECT_NEAR(plan->what_ifs[1].tenants[0].share_bytes,
              plan->tenants[0].share_bytes / 2, 1);
  ASSERT_EQ(plan->what_ifs[2].rows.size(), 1u);
  EXPECT_GT(plan->what_ifs[2].rows[0].page_tokens, plan->rows[2].page_tokens);
}

TEST(CapacityTest, ModelByHandEqualsItsPreset) {
  CapacityRequest r = NoteRequest(1.0);
  r.model_preset.clear();
  r.model = {"mine", 32, 8, 32, 128};
  auto hand = PlanCapacity(r);
  auto preset = PlanCapacity(NoteRequest(1.0));
  ASSERT_THAT(hand, IsOk());
  ASSERT_THAT(preset, IsOk());
  EXPECT_EQ(hand->rows[2].page_tokens, preset->rows[2].page_tokens);
  EXPECT_THAT(PresetShape("model_preset", "qwen2.5-72b"), IsOk());
  EXPECT_EQ(PresetShape("m", "Qwen2.5-7B")->n_kv_heads, 4u);
}

TEST(CapacityTest, BadInputIsInvalidArgumentNamingFieldAndValue) {
  struct Case {
    const char* want;
    void (*edit)(CapacityRequest*);
  };
  const Case cases[] = {
      {"gpu_memory_bytes=-1",
       [](CapacityRequest* r) { r->gpu_memory_bytes = -1; }},
      {"gpu_memory_bytes=0",
       [](CapacityRequest* r) { r->gpu_memory_bytes = 0; }},
      {"gpu_count=0", [](CapacityRequest* r) { r->gpu_count = 0; }},
      {"reserve_bytes=85899345920",
       [](CapacityRequest* r) { r->reserve_bytes = 80 * kGiB; }},
      {"reserve_bytes=-3", [](CapacityRequest* r) { r->reserve_bytes = -3; }},
      {"ceiling=1.5", [](CapacityRequest* r) { r->ceiling = 1.5; }},
      {"ceiling=0", [](CapacityRequest* r) { r->ceiling = 0; }},
      {"ceiling=-0.2", [](CapacityRequest* r) { r->ceiling = -0.2; }},
      {"model_preset=\"llama-9\"",
       [](CapacityRequest* r) { r->model_preset = "llama-9"; }},
      {"model.n_layers=0",
       [](CapacityRequest* r) {
         r->model_preset.clear();
         r->model = {"x", 0, 8, 8, 128};
       }},
      {"host_bytes=-1", [](CapacityRequest* r) { r->host_bytes = -1; }},
      {"disk_bytes=-1", [](CapacityRequest* r) { r->disk_bytes = -1; }},
      {"block_tokens=0", [](CapacityRequest* r) { r->block_tokens = 0; }},
      {"context_lengths[1]=0",
       [](CapacityRequest* r) {
         r->context_lengths = {10, 0};
       }},
      {"policies has 0", [](CapacityRequest* r) { r->policies.clear(); }},
      {"policies[1].encoding.group_size 48",
       [](CapacityRequest* r) { r->policies[1] = Uniform(Format::kINT4, 48); }},
      {"policies[0] must set exactly one",
       [](CapacityRequest* r) { r->policies[0].budget_bits = 4; }},
      {"policies[2].policy=\"nope\"",
       [](CapacityRequest* r) {
         r->policies[2] = CapacityPolicySpec();
         r->policies[2].policy = "nope";
       }},
      {"policies[0].budget_bits=-1",
       [](CapacityRequest* r) {
         r->policies[0] = CapacityPolicySpec();
         r->policies[0].budget_bits = -1;
       }},
      {"tenants[0].ceiling_bytes=5",
       [](CapacityRequest* r) {
         r->tenants = {{"t", 10, 5}};
       }},
      {"tenants[1].tenant_id=\"t\" repeats tenants[0]",
       [](CapacityRequest* r) {
         r->tenants = {{"t", 0, 0}, {"t", 0, 0}};
       }},
      {"tenants[0].floor_bytes=-1",
       [](CapacityRequest* r) {
         r->tenants = {{"t", -1, 0}};
       }},
      {"tag_mix[1].tag=sink/text/system repeats",
       [](CapacityRequest* r) {
         r->tag_mix = {Mix()[0], Mix()[0]};
       }},
      {"frame_bytes=1024 is smaller",
       [](CapacityRequest* r) { r->frame_bytes = 1024; }},
      {"what_ifs[0].add_gpus=-1",
       [](CapacityRequest* r) {
         r->what_ifs = {{"w", -1, {}, {}}};
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    CapacityRequest r = NoteRequest(1.0);
    c.edit(&r);
    EXPECT_THAT(PlanCapacity(r),
                StatusIs(C::kInvalidArgument, HasSubstr(c.want)));
  }
}

TEST(CapacityTest, CountsSaturateInsteadOfOverflowing) {
  CapacityRequest r;
  r.model = {"tiny", 1, 1, 1, 2};
  r.block_tokens = 1;
  r.gpu_memory_bytes = int64_t{1} << 62;  // 32-byte blocks: 1.4e17 a GPU
  r.gpu_count = kMaxCapacityGpus;
  r.policies = {Uniform(Format::kBF16)};
  auto plan = PlanCapacity(r);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->rows[0].block_bytes, 32);
  EXPECT_EQ(plan->rows[0].page_tokens, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(plan->rows[0].ideal_tokens, std::numeric_limits<int64_t>::max());
}

TEST(CapacityTest, ParsesTagLabels) {
  auto t = ParseTagLabel("f", "older/text/tool_schema");
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ(*t, (Tag{Temporal::kOlder, Modality::kText, Role::kToolSchema}));
  EXPECT_THAT(ParseTagLabel("tag_mix_file line 3", "old/text/user"),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("tag_mix_file line 3=\"old/text/user\"")));
}

}  // namespace
}  // namespace triax::manager
