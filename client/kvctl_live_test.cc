// The live views' frames: kvctl top's tables and rates between two samples,
// pressure --watch's frame, the TTY / plain framing and the flag parsers.
#include "client/kvctl_live.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace triax::kvctl {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using ::triax::testing::IsOkAndHolds;

TopSample Sample(int64_t ms, uint64_t worker_spills, uint64_t tenant_device,
                 uint32_t seqs, uint64_t demotions) {
  TopSample s;
  s.unix_ms = ms;
  auto* w = s.workers.add_workers();
  w->set_worker_id("w0");
  w->set_state(triax::v1::WORKER_STATE_UP);
  w->set_sequences(seqs);
  w->set_capacity_bytes(1 << 20);
  w->set_reserved_bytes(tenant_device);
  auto* inv = w->mutable_inventory();
  inv->set_used_bytes(256 * 1024);
  inv->set_spills(worker_spills);
  inv->set_window_bytes(2048);
  auto* f = inv->add_formats();
  f->set_format(triax::v1::FORMAT_INT4);
  f->set_pages_used(12);
  f->set_bytes_used(3 * 1024);
  auto* host = inv->add_tiers();
  host->set_tier(triax::v1::TIER_HOST);
  host->set_used_bytes(1536);
  auto* t = s.tenants.add_tenants();
  t->set_tenant_id("acme");
  t->set_open_sequences(seqs);
  auto* u = t->add_usage();
  u->set_tier(triax::v1::TIER_DEVICE);
  u->set_used_bytes(tenant_device);
  auto* b = t->add_budgets();
  b->set_tier(triax::v1::TIER_DEVICE);
  b->set_ceiling_bytes(8192);
  s.pressure.set_mode("demote-first");
  s.pressure.set_snapshot_blocks(5);
  s.pressure.set_demotions(demotions);
  return s;
}

TEST(TopFrameTest, FirstFrameShowsTheNumbersWithoutRates) {
  const std::string f = TopFrame(Sample(1000, 3, 4096, 1, 0), nullptr);
  EXPECT_THAT(f, HasSubstr("kvctl top  1970-01-01T00:00:01.000Z  rates: - "
                           "(first frame)"));
  EXPECT_THAT(f, ContainsRegex("\nw0 +up +1 +4.00 KiB +256.00 KiB +1.00 MiB "
                               "+25.0% +1.50 KiB +0 B +- +- +-\n"));
  EXPECT_THAT(f, ContainsRegex("\nw0 +int4 +12 +3.00 KiB\n"));
  EXPECT_THAT(f, ContainsRegex("\nw0 +window +- +2.00 KiB\n"));
  EXPECT_THAT(f, ContainsRegex("\nacme +1 +4.00 KiB +- +0 B +0 B +8.00 KiB "
                               "+50.0%\n"));
  EXPECT_THAT(f, HasSubstr("mode=demote-first snapshot_blocks=5 "
                           "demotions/s=- spills/s=-"));
}

TEST(TopFrameTest, LaterFramesShowRatesAndDeltasSinceThePrevious) {
  const TopSample a = Sample(1000, 3, 4096, 1, 10);
  const TopSample b = Sample(3000, 7, 6144, 2, 14);  // 2 s later
  const std::string f = TopFrame(b, &a);
  EXPECT_THAT(f, HasSubstr("rates over 2.00 s"));
  // Worker spills 3 -> 7 over 2 s.
  EXPECT_THAT(f, ContainsRegex("\nw0 +up +2 +6.00 KiB .* +2.0 +0.0 +0.0\n"));
  // Tenant device bytes 4096 -> 6144.
  EXPECT_THAT(f, ContainsRegex("\nacme +2 +6.00 KiB +\\+2.00 KiB "));
  EXPECT_THAT(f, HasSubstr("demotions/s=2.0"));
  // Less than before: a minus sign.
  const std::string g = TopFrame(a, &b);
  EXPECT_THAT(g, ContainsRegex("\nacme +1 +4.00 KiB +-2.00 KiB "));
}

TEST(PressureFrameTest, StartsWithTheTimeThenTheReport) {
  triax::v1::GetPressureResponse r;
  r.set_mode("lru");
  auto* p = r.add_pools();
  p->set_worker_id("w3");
  p->set_tier(triax::v1::TIER_DEVICE);
  p->set_capacity_bytes(1024);
  p->set_used_bytes(512);
  const std::string f = PressureFrame(2000, r);
  EXPECT_THAT(f, ::testing::StartsWith(
                     "kvctl pressure  1970-01-01T00:00:02.000Z\nmode:"));
  EXPECT_THAT(f, ContainsRegex("w3 +device +512 B +1.00 KiB +50.0%"));
}

TEST(FrameTextTest, ClearsTheScreenOnlyOnATerminal) {
  EXPECT_EQ(FrameText("body\n", 0, /*tty=*/true), "\x1b[H\x1b[2Jbody\n");
  EXPECT_EQ(FrameText("body\n", 3, /*tty=*/true), "\x1b[H\x1b[2Jbody\n");
  EXPECT_EQ(FrameText("body\n", 0, /*tty=*/false), "body\n");
  EXPECT_EQ(FrameText("body\n", 1, /*tty=*/false), "---\nbody\n");
  EXPECT_THAT(FrameText("body\n", 1, false), Not(HasSubstr("\x1b")));
}

TEST(LiveFlagsTest, IntervalAndCountTakeOnlyTheirRanges) {
  EXPECT_THAT(ParseInterval("0.2"), IsOkAndHolds(0.2));
  EXPECT_THAT(ParseInterval("3600"), IsOkAndHolds(3600.0));
  for (const char* bad : {"0", "-1", "abc", "", "nan", "inf", "3601"}) {
    auto r = ParseInterval(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(),
                HasSubstr(absl::StrCat("--interval=\"", bad, "\"")));
  }
  EXPECT_THAT(ParseCount("0"), IsOkAndHolds(0));
  EXPECT_THAT(ParseCount("2"), IsOkAndHolds(2));
  for (const char* bad : {"-1", "two", "", "1.5"}) {
    auto r = ParseCount(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(r.status().message(),
                HasSubstr(absl::StrCat("--count=\"", bad, "\"")));
  }
}

}  // namespace
}  // namespace triax::kvctl
