// The replay driver's accounting (replay_driver.h) on tiny traces whose
// every figure is worked out by hand. Model as in pressure_test_fixture.h:
// 2 layers, 2 KV heads, head_dim 64, T = 16, so a BF16 block is 16,384
// bytes; the worker holds 8 of them.
#include "bench/capacity/replay_driver.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace triax::bench::capacity {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

constexpr uint64_t kBf16 = 16384;

ReplayConfig Config() {
  ReplayConfig c;
  c.model = ModelShape{"test", 2, 2, 4, 64};
  c.block_tokens = 16;
  c.device_bytes = 8 * kBf16;
  c.policy = "bf16";
  c.reclaim = false;
  c.patience_ms = 500;
  c.sample_ms = 100;
  return c;
}

TraceTurn Turn(int64_t think_ms, int64_t decode_ms, uint32_t prompt,
               uint32_t response) {
  TraceTurn t;
  t.think_ms = think_ms;
  t.decode_ms = decode_ms;
  if (prompt > 0) t.prompt = {{Role::kUser, Modality::kText, prompt}};
  if (response > 0) {
    t.response = {{Role::kToolCall, Modality::kText, response}};
  }
  return t;
}

TraceSession Session(const std::string& id, const std::string& tenant,
                     int64_t arrive_ms, std::vector<TraceTurn> turns) {
  TraceSession s;
  s.id = id;
  s.tenant = tenant;
  s.arrive_ms = arrive_ms;
  s.shape = "test";
  s.turns = std::move(turns);
  return s;
}

// s0 (a) holds 4 blocks, then 5, and closes at 100. s1 (b) holds 3 blocks
// from 10, 4 from 210, and closes then. s2 (a) arrives at 20 needing 2: 4 +
// 3 + 2 > 8, so it waits until s0 closes at 100 (80 ms), then plays two
// turns and closes at 1200. s3 (b) needs 10 blocks, more than the worker,
// and gives up after 500 ms.
Trace FourSessions() {
  Trace t;
  t.sessions = {
      Session("s0", "a", 0, {Turn(0, 100, 64, 16)}),
      Session("s1", "b", 10, {Turn(0, 200, 48, 16)}),
      Session("s2", "a", 20, {Turn(0, 50, 32, 16), Turn(1000, 50, 16, 16)}),
      Session("s3", "b", 30, {Turn(0, 10, 160, 16)}),
  };
  return t;
}

TEST(ReplayDriverTest, CountsAdmissionWaitsRefusalsAndConcurrency) {
  auto r = RunReplay(FourSessions(), Config());
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(r->tenants, (std::vector<std::string>{"a", "b"}));
  const ReplayCounts& all = r->total;
  EXPECT_EQ(all.sessions, 4u);
  EXPECT_EQ(all.admitted, 3u);
  EXPECT_EQ(all.admitted_after_wait, 1u);
  EXPECT_EQ(all.completed, 3u);
  EXPECT_EQ(all.refused, 1u);
  EXPECT_EQ(all.dropped, 0u);
  EXPECT_EQ(all.turns, 4u);
  EXPECT_EQ(all.tokens, 80u + 64u + 80u);
  EXPECT_EQ(all.open_wait_ms, 80 + 500);
  EXPECT_EQ(all.open_wait_max_ms, 500);
  EXPECT_EQ(all.turn_waits, 0u);
  EXPECT_EQ(all.peak_open, 2u);
  EXPECT_EQ(all.peak_device_bytes, 8 * kBf16);  // s0 5 blocks + s1 3
  // Open sessions over time: s0 100 ms, s1 200 ms, s2 1100 ms.
  EXPECT_DOUBLE_EQ(all.open_ms, 1400.0);
  EXPECT_EQ(r->span_ms, 1200);
  EXPECT_DOUBLE_EQ(r->MeanOpen(), 1400.0 / 1200.0);
  // Until the last arrival (30): s0 30 ms, s1 20 ms.
  EXPECT_EQ(r->arrival_span_ms, 30);
  EXPECT_DOUBLE_EQ(all.open_ms_arriving, 50.0);
  EXPECT_DOUBLE_EQ(r->MeanOpenArriving(), 50.0 / 30.0);
  EXPECT_EQ(all.demotions + all.spills + all.restores + all.evictions, 0u);

  const ReplayCounts& a = r->by_tenant[0];
  EXPECT_EQ(a.sessions, 2u);
  EXPECT_EQ(a.admitted, 2u);
  EXPECT_EQ(a.admitted_after_wait, 1u);
  EXPECT_EQ(a.completed, 2u);
  EXPECT_EQ(a.open_wait_ms, 80);
  EXPECT_EQ(a.peak_open, 1u);
  EXPECT_EQ(a.peak_device_bytes, 5 * kBf16);
  const ReplayCounts& b = r->by_tenant[1];
  EXPECT_EQ(b.sessions, 2u);
  EXPECT_EQ(b.admitted, 1u);
  EXPECT_EQ(b.refused, 1u);
  EXPECT_EQ(b.open_wait_ms, 500);
  EXPECT_EQ(b.tokens, 64u);

  // Samples every 100 ms from the first arrival to the end: the state in
  // force at each.
  ASSERT_EQ(r->samples.size(), 13u);
  EXPECT_EQ(r->samples[0].t_ms, 0);
  EXPECT_EQ(r->samples[0].device_bytes, (std::vector<uint64_t>{4 * kBf16, 0}));
  EXPECT_EQ(r->samples[2].t_ms, 200);  // s2 3 blocks, s1 3
  EXPECT_EQ(r->samples[2].device_bytes,
            (std::vector<uint64_t>{3 * kBf16, 3 * kBf16}));
  EXPECT_EQ(r->samples[2].open, (std::vector<uint32_t>{1, 1}));
  EXPECT_EQ(r->samples[2].tokens, (std::vector<uint64_t>{48, 48}));
  EXPECT_EQ(r->samples[12].device_bytes, (std::vector<uint64_t>{0, 0}));
  EXPECT_EQ(r->samples[12].tokens, (std::vector<uint64_t>{0, 0}));
  // While arriving (the sample at 0): s0's 64 tokens in 4 full BF16 blocks.
  EXPECT_EQ(r->values_per_token, 2u * 2 * 2 * 64);
  EXPECT_DOUBLE_EQ(r->HeldBitsPerValue(), 16.0);
}

TEST(ReplayDriverTest, HeldBitsCountTheFreeSlotsOfEachSpansLastBlock) {
  // s0's prompt of 8 tokens takes a whole block until its response at
  // 1000; s1's of 16 (8 + 8, two spans) takes two from 100, the last
  // arrival. Samples at 0 and 100: 1 + 3 blocks for 8 + 24 tokens,
  // 4 x 16,384 bytes x 8 / (32 tokens x 512 values) = 32 bits a value.
  TraceTurn two_spans = Turn(0, 1000, 8, 8);
  two_spans.prompt.push_back({Role::kUser, Modality::kText, 8});
  Trace t;
  t.sessions = {Session("s0", "a", 0, {Turn(0, 1000, 8, 8)}),
                Session("s1", "a", 100, {two_spans})};
  auto r = RunReplay(t, Config());
  ASSERT_THAT(r, IsOk());
  ASSERT_GE(r->samples.size(), 2u);
  EXPECT_EQ(r->samples[1].t_ms, 100);
  EXPECT_EQ(r->samples[1].device_bytes, (std::vector<uint64_t>{3 * kBf16}));
  EXPECT_EQ(r->samples[1].tokens, (std::vector<uint64_t>{24}));
  EXPECT_DOUBLE_EQ(r->HeldBitsPerValue(), 32.0);
}

TEST(ReplayDriverTest, AWaitingTurnPastPatienceDropsTheSession) {
  // s0 holds 7 blocks for 2 s; s1 opens 1 and needs 2 more for its
  // response at 20: it gives up at 520 and is closed; s0 then takes its
  // response's block at 2000.
  Trace t;
  t.sessions = {Session("s0", "a", 0, {Turn(0, 2000, 112, 16)}),
                Session("s1", "a", 10, {Turn(0, 10, 16, 32)})};
  auto r = RunReplay(t, Config());
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->total.admitted, 2u);
  EXPECT_EQ(r->total.dropped, 1u);
  EXPECT_EQ(r->total.completed, 1u);
  EXPECT_EQ(r->total.turn_waits, 1u);
  EXPECT_EQ(r->total.turn_wait_ms, 500);
  EXPECT_EQ(r->total.turns, 1u);
}

TEST(ReplayDriverTest, TheOldestWaiterGoesFirstWhateverItsTenant) {
  // s0 (a) holds 8 blocks until 1000. s1 (b, from 10) and s2 (a, from 20)
  // each need 5: when s0 closes only one fits, and it is s1, the older,
  // though tenant a comes first in the trace; s2 follows when s1 closes.
  ReplayConfig c = Config();
  c.patience_ms = 2000;
  Trace t;
  t.sessions = {Session("s0", "a", 0, {Turn(0, 1000, 112, 16)}),
                Session("s1", "b", 10, {Turn(0, 500, 80, 16)}),
                Session("s2", "a", 20, {Turn(0, 500, 80, 16)})};
  auto r = RunReplay(t, c);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->total.completed, 3u);
  EXPECT_EQ(r->by_tenant[1].open_wait_ms, 1000 - 10);
  EXPECT_EQ(r->by_tenant[0].open_wait_ms, 1500 - 20);
}

TEST(ReplayDriverTest, AnOlderOpenGoesBeforeAnotherTenantsNewerStep) {
  // s0 (a) holds 4 blocks and s1 (a) 3. s2 (b) waits from 10 for an Open
  // of 4 blocks; s1's response needs 2 more and waits from 500. At 3000 s0
  // takes its response's block and closes: 5 blocks free, room for one of
  // the two. s2 waited longer: it goes first (and closes at 3100 with its
  // response), then s1's response. Ordering in-flight steps before Opens
  // across tenants would admit s1's step first and keep s2 waiting until
  // s1 closed at 4100.
  ReplayConfig c = Config();
  c.patience_ms = 5000;
  Trace t;
  t.sessions = {
      Session("s0", "a", 0, {Turn(0, 3000, 64, 16)}),
      Session("s1", "a", 0, {Turn(0, 500, 48, 32), Turn(1000, 100, 16, 16)}),
      Session("s2", "b", 10, {Turn(0, 100, 64, 16)})};
  auto r = RunReplay(t, c);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->total.completed, 3u);
  EXPECT_EQ(r->by_tenant[1].open_wait_ms, 3000 - 10);
  EXPECT_EQ(r->by_tenant[0].turn_waits, 1u);
  EXPECT_EQ(r->by_tenant[0].turn_wait_ms, 3100 - 500);
}

TEST(ReplayDriverTest, ReclaimCountsEveryActionOnTheTenantItTouched) {
  // s0 (a) holds 6 blocks until its response at 1000; s1 (b) needs 4 at
  // 100: admitted after the reclaim demotes a's blocks. The per-tenant
  // counts add up to the core's own.
  ReplayConfig c = Config();
  c.reclaim = true;
  c.manager.window_guard_tokens = 0;
  c.patience_ms = 2000;
  Trace t;
  t.sessions = {Session("s0", "a", 0, {Turn(0, 1000, 96, 16)}),
                Session("s1", "b", 100, {Turn(0, 100, 64, 0)})};
  auto r = RunReplay(t, c);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->total.admitted, 2u);
  EXPECT_EQ(r->total.admitted_after_wait, 0u);
  EXPECT_EQ(r->total.completed, 2u);
  EXPECT_GE(r->reclaim_rounds, 1u);
  EXPECT_GT(r->total.demotions, 0u);
  EXPECT_EQ(r->by_tenant[0].demotions, r->total.demotions);
  EXPECT_EQ(r->by_tenant[1].demotions, 0u);
  EXPECT_EQ(r->total.demotions, r->core_demotions);
  EXPECT_EQ(r->total.spills, r->core_spills);
  EXPECT_EQ(r->total.evictions, r->core_evictions);
  EXPECT_EQ(r->unapplied, 0u);
  EXPECT_LE(r->total.peak_device_bytes, 8 * kBf16);

  // Without reclaiming, s1 waits until s0 closes at 1000.
  c.reclaim = false;
  r = RunReplay(t, c);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->total.admitted_after_wait, 1u);
  EXPECT_EQ(r->total.open_wait_ms, 900);
  EXPECT_EQ(r->total.demotions, 0u);
}

TEST(ReplayDriverTest, BadConfigNamesTheField) {
  ReplayConfig c = Config();
  c.patience_ms = 0;
  EXPECT_THAT(
      RunReplay(FourSessions(), c),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("patience_ms=0")));
  c = Config();
  c.policy = "no-such-policy";
  EXPECT_THAT(RunReplay(FourSessions(), c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no-such-policy")));
  c = Config();
  c.tenants = {{"a", 0, kBf16}, {"a", 0, kBf16}};
  EXPECT_THAT(RunReplay(FourSessions(), c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a is listed twice")));
}

TEST(ReplayDriverTest, SameTraceSameResult) {
  ReplayConfig c = Config();
  c.reclaim = true;
  auto first = RunReplay(FourSessions(), c);
  auto second = RunReplay(FourSessions(), c);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(first->total.open_wait_ms, second->total.open_wait_ms);
  EXPECT_EQ(first->total.demotions, second->total.demotions);
  EXPECT_EQ(first->samples.size(), second->samples.size());
}

}  // namespace
}  // namespace triax::bench::capacity
