// ChromeTraceJson over a hand-built event list: the exact tracks, phases and
// timestamps of a block created, demoted, spilled, restored, transferred and
// freed, and of a block still open at the end.
#include "client/kvctl_trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "common/status_matchers.h"

namespace triax::kvctl {
namespace {

using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using triax::v1::Event;

Event Ev(uint64_t id, int64_t ms, triax::v1::EventKind kind, uint64_t lineage,
         const std::string& worker, const std::string& detail = "") {
  Event e;
  e.set_id(id);
  e.set_unix_ms(ms);
  e.set_kind(kind);
  e.set_lineage_id(lineage);
  e.set_worker_id(worker);
  e.set_detail(detail);
  if (lineage != 0) {
    e.set_sequence_id("s1");
    e.set_tenant_id("t1");
    e.set_format(triax::v1::FORMAT_BF16);
    e.mutable_tag()->set_temporal(triax::v1::TEMPORAL_SINK);
    e.mutable_tag()->set_modality(triax::v1::MODALITY_TEXT);
    e.mutable_tag()->set_role(triax::v1::ROLE_SYSTEM);
  }
  return e;
}

std::vector<Event> Lifecycle() {
  std::vector<Event> ev;
  ev.push_back(Ev(1, 1000, triax::v1::EVENT_SEQUENCE_OPENED, 0, "w0",
                  "blocks=2 tokens=32"));
  ev.back().set_sequence_id("s1");
  ev.push_back(Ev(2, 1000, triax::v1::EVENT_BLOCK_CREATED, 7, "w0",
                  "index=0 first_token=0 num_tokens=16 bytes=4096 "
                  "encoding=bf16"));
  ev.push_back(Ev(3, 1010, triax::v1::EVENT_BLOCK_DEMOTED, 7, "w0",
                  "index=0 from=bf16 to=int4 bytes_from=4096 bytes_to=1152"));
  ev.push_back(Ev(4, 1020, triax::v1::EVENT_BLOCK_SPILLED, 7, "w0",
                  "tier=host bytes=1152"));
  ev.push_back(Ev(5, 1030, triax::v1::EVENT_BLOCK_RESTORED, 7, "w0",
                  "from=host bytes=1152 by=manager"));
  ev.push_back(Ev(6, 1040, triax::v1::EVENT_BLOCK_TRANSFERRED, 7, "w1",
                  "transfer=xfer-1 index=0 from=int4 to=int2 bytes_from=1152 "
                  "bytes_to=640"));
  ev.back().set_source_worker_id("w0");
  ev.push_back(Ev(7, 1050, triax::v1::EVENT_BLOCK_CREATED, 9, "w1",
                  "index=1 encoding=k=fp8,v=int4"));
  ev.push_back(Ev(8, 1060, triax::v1::EVENT_BLOCK_FREED, 7, "w1", "bytes=640"));
  ev.push_back(Ev(9, 1070, triax::v1::EVENT_TENANT_CHANGED, 0, "",
                  "created=true default_policy="));
  ev.back().set_tenant_id("t1");
  return ev;
}

json Parse(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << text;
  return j;
}

std::vector<json> Phase(const json& trace, const std::string& ph) {
  std::vector<json> out;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == ph) out.push_back(e);
  }
  return out;
}

TEST(ChromeTraceTest, NamesAProcessPerWorkerAndAThreadPerBlockAndTier) {
  const json t = Parse(ChromeTraceJson(Lifecycle(), 2000));
  EXPECT_EQ(t["displayTimeUnit"], "ms");
  std::set<std::tuple<int, std::string>> processes;
  std::set<std::tuple<int, int, std::string>> threads;
  for (const json& m : Phase(t, "M")) {
    if (m["name"] == "process_name") {
      processes.emplace(m["pid"], m["args"]["name"]);
    } else if (m["name"] == "thread_name") {
      threads.emplace(m["pid"], m["tid"], m["args"]["name"]);
    }
  }
  EXPECT_EQ(processes,
            (std::set<std::tuple<int, std::string>>{
                {1, "worker w0"}, {2, "worker w1"}, {3, "manager"}}));
  // L7 ranks 0 (device tid 2, host tid 3), L9 ranks 1 (device tid 5).
  EXPECT_EQ(threads,
            (std::set<std::tuple<int, int, std::string>>{{1, 1, "events"},
                                                         {1, 2, "device L7"},
                                                         {1, 3, "host L7"},
                                                         {2, 2, "device L7"},
                                                         {2, 5, "device L9"},
                                                         {3, 1, "events"}}));
}

TEST(ChromeTraceTest, SpansCoverEachTierAndEncodingInMicroseconds) {
  const json t = Parse(ChromeTraceJson(Lifecycle(), 2000));
  std::vector<
      std::tuple<int, int, std::string, int64_t, int64_t, std::string, bool>>
      spans;
  for (const json& x : Phase(t, "X")) {
    spans.emplace_back(x["pid"], x["tid"], x["name"], x["ts"], x["dur"],
                       x["args"]["closed_by"], x["args"]["open"]);
    EXPECT_EQ(x["cat"], "block");
    EXPECT_EQ(x["args"]["sequence_id"], "s1");
    EXPECT_EQ(x["args"]["tag"], "sink/text/system");
  }
  EXPECT_THAT(
      spans,
      ElementsAre(
          std::make_tuple(1, 2, "bf16", 1000000, 10000, "BLOCK_DEMOTED", false),
          std::make_tuple(1, 2, "int4", 1010000, 10000, "BLOCK_SPILLED", false),
          std::make_tuple(1, 3, "int4", 1020000, 10000, "BLOCK_RESTORED",
                          false),
          std::make_tuple(1, 2, "int4", 1030000, 10000, "BLOCK_TRANSFERRED",
                          false),
          std::make_tuple(2, 2, "int2", 1040000, 20000, "BLOCK_FREED", false),
          // Still open: ends at end_unix_ms.
          std::make_tuple(2, 5, "k=fp8,v=int4", 1050000, 950000, "end of trace",
                          true)));
}

TEST(ChromeTraceTest, InstantsForEveryEventAndAFlowAcrossTheTransfer) {
  const json t = Parse(ChromeTraceJson(Lifecycle(), 2000));
  std::vector<std::tuple<std::string, int, int, int64_t, uint64_t>> instants;
  for (const json& i : Phase(t, "i")) {
    instants.emplace_back(i["name"], i["pid"], i["tid"], i["ts"],
                          i["args"]["id"]);
    EXPECT_EQ(i["s"], "t");
  }
  EXPECT_THAT(instants,
              ElementsAre(std::make_tuple("sequence_opened", 1, 1, 1000000, 1),
                          std::make_tuple("created", 1, 2, 1000000, 2),
                          std::make_tuple("demoted", 1, 2, 1010000, 3),
                          std::make_tuple("spilled", 1, 3, 1020000, 4),
                          std::make_tuple("restored", 1, 2, 1030000, 5),
                          std::make_tuple("transferred", 2, 2, 1040000, 6),
                          std::make_tuple("created", 2, 5, 1050000, 7),
                          std::make_tuple("freed", 2, 2, 1060000, 8),
                          std::make_tuple("tenant_changed", 3, 1, 1070000, 9)));
  const std::vector<json> s = Phase(t, "s");
  const std::vector<json> f = Phase(t, "f");
  ASSERT_EQ(s.size(), 1u);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(s[0]["id"], 6);
  EXPECT_EQ(f[0]["id"], 6);
  EXPECT_EQ(s[0]["ts"], 1039999);  // inside the source span
  EXPECT_EQ(f[0]["ts"], 1040000);
  EXPECT_EQ(std::make_pair(s[0]["pid"], s[0]["tid"]),
            std::make_pair(json(1), json(2)));
  EXPECT_EQ(std::make_pair(f[0]["pid"], f[0]["tid"]),
            std::make_pair(json(2), json(2)));
  EXPECT_EQ(f[0]["bp"], "e");
}

TEST(ChromeTraceTest, ReconcileDetailsNameTheTierAndDetailsAreEscaped) {
  std::vector<Event> ev;
  ev.push_back(Ev(1, 5, triax::v1::EVENT_BLOCK_CREATED, 3, "w\"0",
                  "encoding=int4 note=\"a\\b\nc\""));
  ev.push_back(Ev(2, 6, triax::v1::EVENT_BLOCK_SPILLED, 3, "w\"0",
                  "by=reconcile from=int4/device to=int2/disk bytes=9"));
  const std::string text = ChromeTraceJson(ev, 0);
  const json t = Parse(text);
  const std::vector<json> x = Phase(t, "X");
  ASSERT_EQ(x.size(), 2u);
  EXPECT_EQ(x[1]["name"], "int2");
  EXPECT_EQ(x[1]["args"]["tier"], "disk");
  EXPECT_EQ(x[1]["tid"], 4);  // disk of the first block: 2 + 0 + 2
  // End before the last event: the last event's time.
  EXPECT_EQ(x[1]["dur"], 0);
  EXPECT_EQ(Phase(t, "i")[0]["args"]["detail"],
            "encoding=int4 note=\"a\\b\nc\"");
  for (const json& m : Phase(t, "M")) {
    if (m["name"] == "process_name") {
      EXPECT_EQ(m["args"]["name"], "worker w\"0");
    }
  }
}

TEST(ChromeTraceTest, NoEventsIsAnEmptyTrace) {
  const json t = Parse(ChromeTraceJson({}, 0));
  EXPECT_TRUE(t["traceEvents"].empty());
}

TEST(ParseTimeFlagTest, TakesRfc3339AndUnixSeconds) {
  EXPECT_THAT(ParseTimeFlag("since", "1764075600"),
              ::triax::testing::IsOkAndHolds(1764075600000));
  EXPECT_THAT(ParseTimeFlag("since", "1764075600.25"),
              ::triax::testing::IsOkAndHolds(1764075600250));
  EXPECT_THAT(ParseTimeFlag("until", "2025-11-25T13:00:00Z"),
              ::triax::testing::IsOkAndHolds(1764075600000));
  EXPECT_THAT(ParseTimeFlag("until", "2025-11-25T14:00:00.5+01:00"),
              ::triax::testing::IsOkAndHolds(1764075600500));
  for (const char* bad :
       {"", "yesterday", "2025-13-01T00:00:00Z", "1e9", "-5", "1.2.3"}) {
    auto r = ParseTimeFlag("since", bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(),
                HasSubstr(absl::StrCat("--since=\"", bad, "\"")));
  }
}

}  // namespace
}  // namespace triax::kvctl
