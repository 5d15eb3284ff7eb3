// EventLog (event_log.h): retention and the lineage index, filters,
// subscriptions (replay, live delivery, notify, cancel) and slow watchers.
#include "kvmanager/event_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;

Event Ev(EventKind kind, uint64_t lineage, const std::string& seq,
         const std::string& tenant = "t") {
  Event e;
  e.kind = kind;
  e.lineage_id = lineage;
  e.sequence_id = seq;
  e.tenant_id = tenant;
  return e;
}

TEST(EventLogTest, RetentionDropsOldestAndPrunesTheLineageIndex) {
  EventLog log({/*retention=*/5, /*watcher_queue_limit=*/100});
  std::vector<Event> batch;
  for (uint64_t i = 1; i <= 8; ++i)
    batch.push_back(Ev(EventKind::kBlockCreated, i % 3 + 1, "s"));
  log.Append(&batch);
  EXPECT_EQ(batch[7].id, 8u);
  EXPECT_EQ(log.next_id(), 9u);
  auto kept = log.Retained(1, EventFilter{});
  ASSERT_EQ(kept.size(), 5u);
  EXPECT_EQ(kept.front().id, 4u);
  // Lineage 2 had ids 1, 4, 7: only 4 and 7 remain.
  auto l2 = log.EventsForLineage(2);
  ASSERT_EQ(l2.size(), 2u);
  EXPECT_EQ(l2[0].id, 4u);
  EXPECT_EQ(l2[1].id, 7u);
  BlockPlan last;
  last.lineage_id = 2;
  last.num_tokens = 5;
  last.capacity = 16;
  log.RecordLastPlan(last, "s");
  ASSERT_TRUE(log.FindLastPlan(2).has_value());
  EXPECT_EQ(log.FindLastPlan(2)->plan.num_tokens, 5u);
  // When the lineage's last event leaves retention, its entry goes too.
  std::vector<Event> more;
  more.reserve(5);
  for (int i = 0; i < 5; ++i)
    more.push_back(Ev(EventKind::kSequenceOpened, 0, "x"));
  log.Append(&more);
  EXPECT_TRUE(log.EventsForLineage(2).empty());
  EXPECT_FALSE(log.FindLastPlan(2).has_value());
}

TEST(EventLogTest, FiltersMatchTenantSequenceAndLineage) {
  EventLog log({100, 100});
  std::vector<Event> batch = {Ev(EventKind::kBlockCreated, 1, "s1", "a"),
                              Ev(EventKind::kBlockCreated, 2, "s2", "b"),
                              Ev(EventKind::kSequenceLost, 0, "s1", "a")};
  batch[2].lineage_ids = {1, 7};
  log.Append(&batch);
  EXPECT_EQ(log.Retained(1, EventFilter{"a", "", 0}).size(), 2u);
  EXPECT_EQ(log.Retained(1, EventFilter{"", "s2", 0}).size(), 1u);
  EXPECT_EQ(log.Retained(1, EventFilter{"", "", 7}).size(), 1u);
  EXPECT_EQ(log.Retained(1, EventFilter{"", "", 1}).size(), 2u);
  EXPECT_EQ(log.Retained(3, EventFilter{}).size(), 1u);
  EXPECT_EQ(log.Retained(1, EventFilter{}, 2).size(), 2u);
}

TEST(EventLogTest, SubscriptionReplaysThenDeliversLiveAndNotifies) {
  EventLog log({100, 100});
  std::vector<Event> first = {Ev(EventKind::kBlockCreated, 1, "s1"),
                              Ev(EventKind::kBlockCreated, 2, "s2"),
                              Ev(EventKind::kBlockCreated, 3, "s1")};
  log.Append(&first);
  auto sub = log.Subscribe(EventFilter{"", "s1", 0}, 1);
  int notified = 0;
  sub->SetNotify([&] { ++notified; });
  Event e;
  absl::Status end;
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 1u);
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 3u);
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEmpty);
  std::vector<Event> live = {Ev(EventKind::kBlockFreed, 2, "s2"),
                             Ev(EventKind::kBlockFreed, 1, "s1")};
  log.Append(&live);
  EXPECT_EQ(notified, 1);
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 5u);
  EXPECT_EQ(e.kind, EventKind::kBlockFreed);
  // A live-only subscription sees nothing from before.
  auto live_only = log.Subscribe(EventFilter{}, 0);
  EXPECT_EQ(live_only->Next(&e, &end), EventSubscription::Result::kEmpty);
  sub->Cancel();
  live_only->Cancel();
  EXPECT_EQ(log.subscribers(), 0u);
  std::vector<Event> after = {Ev(EventKind::kBlockFreed, 1, "s1")};
  log.Append(&after);
  EXPECT_EQ(notified, 1);
  EXPECT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEnded);
  EXPECT_EQ(end.code(), absl::StatusCode::kCancelled);
}

TEST(EventLogTest, SlowWatcherIsEndedWithResourceExhausted) {
  EventLog log({1000, 3});
  auto sub = log.Subscribe(EventFilter{}, 0);
  std::vector<Event> batch;
  batch.reserve(5);
  for (int i = 0; i < 5; ++i)
    batch.push_back(Ev(EventKind::kBlockCreated, 1, "s"));
  log.Append(&batch);
  Event e;
  absl::Status end;
  EXPECT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEnded);
  EXPECT_EQ(end.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(end.message()),
              HasSubstr("fell behind by more than 3 events"));
  // A replay that falls out of retention ends the same way.
  EventLog small({2, 100});
  std::vector<Event> three = {Ev(EventKind::kBlockCreated, 1, "s"),
                              Ev(EventKind::kBlockCreated, 1, "s")};
  small.Append(&three);
  auto replay = small.Subscribe(EventFilter{}, 1);
  std::vector<Event> two = {Ev(EventKind::kBlockCreated, 1, "s"),
                            Ev(EventKind::kBlockCreated, 1, "s")};
  small.Append(&two);
  EXPECT_EQ(replay->Next(&e, &end), EventSubscription::Result::kEnded);
  EXPECT_THAT(std::string(end.message()), HasSubstr("left retention"));
  sub->Cancel();
  replay->Cancel();
}

}  // namespace
}  // namespace triax::manager

namespace triax::manager {
namespace {

TEST(EventLogTest, ByteBoundDropsOldestEvents) {
  Event sample = Ev(EventKind::kBlockCreated, 1, "seq-1");
  sample.detail = std::string(100, 'x');  // on the heap
  const uint64_t one = EventLog::EventBytes(sample);
  EXPECT_GT(one, 100u);  // the detail is packed with the event
  EventLog log({/*retention=*/1000, /*watcher_queue_limit=*/100,
                /*retention_bytes=*/10 * one});
  std::vector<Event> batch;
  for (uint64_t i = 0; i < 30; ++i) {
    Event e = sample;
    e.lineage_id = i + 1;
    batch.push_back(e);
  }
  log.Append(&batch);
  // The count bound (1000) is far: the byte bound keeps the newest 10.
  EXPECT_EQ(log.retained(), 10u);
  EXPECT_LE(log.retained_bytes(), 10 * one);
  auto kept = log.Retained(1, EventFilter{});
  ASSERT_EQ(kept.size(), 10u);
  EXPECT_EQ(kept.front().id, 21u);
  EXPECT_EQ(kept.back().id, 30u);
  // Evicted events leave the lineage index.
  EXPECT_TRUE(log.EventsForLineage(20).empty());
  EXPECT_EQ(log.EventsForLineage(21).size(), 1u);

  // One event bigger than the bound still stays: the newest is kept.
  Event huge = sample;
  huge.detail = std::string(20 * one, 'y');
  std::vector<Event> big = {huge};
  log.Append(&big);
  EXPECT_EQ(log.retained(), 1u);
  EXPECT_EQ(log.Retained(1, EventFilter{}).front().id, 31u);
}

TEST(EventLogTest, LongLineageKeepsItsNewestEventsInOrderAndPages) {
  EventLog log({/*retention=*/50, /*watcher_queue_limit=*/100});
  for (int i = 0; i < 100; ++i) {
    std::vector<Event> one = {Ev(EventKind::kBlockRetagged, 7, "s")};
    log.Append(&one);
  }
  auto all = log.EventsForLineage(7);
  ASSERT_EQ(all.size(), 50u);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i].id, 51 + i);
  // Pages of 20 after each page's last id.
  std::vector<uint64_t> got;
  uint64_t after = 0;
  bool more = true;
  int pages = 0;
  while (more) {
    auto page = log.EventsForLineage(7, after, 20, &more);
    ++pages;
    for (const Event& e : page) got.push_back(e.id);
    if (!page.empty()) after = page.back().id;
  }
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(got.size(), 50u);
  EXPECT_EQ(got.front(), 51u);
  EXPECT_EQ(got.back(), 100u);
  // A cursor below retention starts at the oldest retained event.
  auto first = log.EventsForLineage(7, 3, 1, &more);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].id, 51u);
  EXPECT_TRUE(more);
}

}  // namespace
}  // namespace triax::manager

namespace triax::manager {
namespace {

// Every field an event carries comes back from the packed records.
TEST(EventLogTest, EventsComeBackWithEveryField) {
  EventLog log({100, 100});
  Event e = Ev(EventKind::kTransferStarted, 42, "seq-7", "tenant-a");
  e.unix_ms = 1234567;
  e.worker_id = "worker-b";
  e.source_worker_id = "worker-a";
  e.tag = Tag{Temporal::kOlder, Modality::kImage, Role::kToolResult};
  e.format = Format::kINT4;
  e.detail = std::string(300, 'd');  // longer than a varint byte
  e.lineage_ids = {5, 6, uint64_t{1} << 40};
  std::vector<Event> batch = {e, Ev(EventKind::kBlockCreated, 0, "")};
  log.Append(&batch);
  const std::vector<Event> got = log.Retained(1, EventFilter{});
  ASSERT_EQ(got.size(), 2u);
  const Event& g = got[0];
  EXPECT_EQ(g.id, 1u);
  EXPECT_EQ(g.unix_ms, 1234567);
  EXPECT_EQ(g.kind, EventKind::kTransferStarted);
  EXPECT_EQ(g.lineage_id, 42u);
  EXPECT_EQ(g.sequence_id, "seq-7");
  EXPECT_EQ(g.tenant_id, "tenant-a");
  EXPECT_EQ(g.worker_id, "worker-b");
  EXPECT_EQ(g.source_worker_id, "worker-a");
  EXPECT_EQ(g.tag, e.tag);
  EXPECT_EQ(g.format, Format::kINT4);
  EXPECT_EQ(g.detail, e.detail);
  EXPECT_EQ(g.lineage_ids, e.lineage_ids);
  EXPECT_TRUE(got[1].sequence_id.empty());
  EXPECT_TRUE(got[1].lineage_ids.empty());
}

// Many times the retention through the rings: records and packed bytes are
// reused, events larger than a chunk come and go, the lineage index follows.
TEST(EventLogTest, RingsWrapManyTimesAndKeepTheNewest) {
  EventLog log({/*retention=*/1000, /*watcher_queue_limit=*/100});
  const std::string big(3 << 20, 'b');  // larger than a packed chunk
  uint64_t id = 0;
  for (int round = 0; round < 200; ++round) {
    std::vector<Event> batch;
    for (int i = 0; i < 100; ++i) {
      ++id;
      Event e = Ev(EventKind::kBlockCreated, id % 500 + 1, "s");
      e.detail = absl::StrCat("n=", id, std::string(id % 97, 'x'));
      if (id % 4999 == 0) e.detail = big;
      batch.push_back(std::move(e));
    }
    log.Append(&batch);
  }
  EXPECT_EQ(log.retained(), 1000u);
  const std::vector<Event> kept = log.Retained(1, EventFilter{});
  ASSERT_EQ(kept.size(), 1000u);
  for (size_t i = 0; i < kept.size(); ++i) {
    const uint64_t want = id - 999 + i;
    ASSERT_EQ(kept[i].id, want);
    if (want % 4999 == 0) {
      EXPECT_EQ(kept[i].detail, big);
    } else {
      EXPECT_EQ(kept[i].detail,
                absl::StrCat("n=", want, std::string(want % 97, 'x')));
    }
  }
  // Lineage 1 had ids 500, 1000, ...: its two retained ones, in order.
  const std::vector<Event> l1 = log.EventsForLineage(1);
  ASSERT_EQ(l1.size(), 2u);
  EXPECT_EQ(l1[0].id, id - 500);
  EXPECT_EQ(l1[1].id, id);
}

// A live watcher that does not read while its events leave retention still
// gets every one of them, in order, within its queue limit.
TEST(EventLogTest, LiveWatcherKeepsEventsThatLeaveRetention) {
  EventLog log({/*retention=*/4, /*watcher_queue_limit=*/10});
  auto sub = log.Subscribe(EventFilter{"", "s1", 0}, 0);
  std::vector<Event> batch;
  for (int i = 0; i < 12; ++i) {
    batch.push_back(Ev(EventKind::kBlockCreated, 1, i % 2 == 0 ? "s1" : "s2"));
  }
  log.Append(&batch);  // ids 1..12; s1 has the odd ones; 9..12 retained
  Event e;
  absl::Status end;
  for (uint64_t want = 1; want <= 11; want += 2) {
    ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
    EXPECT_EQ(e.id, want);
    EXPECT_EQ(e.sequence_id, "s1");
  }
  EXPECT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEmpty);
  sub->Cancel();
}

TEST(EventLogTest, CountsByKindAndFiltersByKind) {
  EventLog log({/*retention=*/2, /*watcher_queue_limit=*/10});
  EventFilter freed;
  freed.kind = EventKind::kBlockFreed;
  auto sub = log.Subscribe(freed, 0);
  std::vector<Event> batch = {Ev(EventKind::kBlockCreated, 1, "s"),
                              Ev(EventKind::kBlockFreed, 1, "s"),
                              Ev(EventKind::kBlockCreated, 2, "s"),
                              Ev(EventKind::kBlockCreated, 3, "s")};
  log.Append(&batch);
  // Counted as appended, whatever the retention kept.
  const auto counts = log.AppendedByKind();
  EXPECT_EQ(counts[static_cast<int>(EventKind::kBlockCreated)], 3u);
  EXPECT_EQ(counts[static_cast<int>(EventKind::kBlockFreed)], 1u);
  EXPECT_EQ(counts[static_cast<int>(EventKind::kSequenceOpened)], 0u);
  Event e;
  absl::Status end;
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 2u);
  EXPECT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEmpty);
  EXPECT_EQ(log.Retained(1, freed).size(), 0u);  // left retention
  sub->Cancel();
}

// A page cursor that is not one of the lineage's events (or left
// retention) still pages from the next event after it.
TEST(EventLogTest, LineagePagesFromAnyCursor) {
  EventLog log({/*retention=*/100, /*watcher_queue_limit=*/10});
  std::vector<Event> batch;
  for (int i = 0; i < 10; ++i) {
    batch.push_back(Ev(EventKind::kBlockRetagged, i % 2 == 0 ? 7 : 8, "s"));
  }
  log.Append(&batch);  // lineage 7: ids 1, 3, 5, 7, 9
  bool more = false;
  auto page = log.EventsForLineage(7, 4, 2, &more);  // 4 is lineage 8's
  ASSERT_EQ(page.size(), 2u);
  EXPECT_EQ(page[0].id, 5u);
  EXPECT_EQ(page[1].id, 7u);
  EXPECT_TRUE(more);
  page = log.EventsForLineage(7, 7, 2, &more);
  ASSERT_EQ(page.size(), 1u);
  EXPECT_EQ(page[0].id, 9u);
  EXPECT_FALSE(more);
  EXPECT_TRUE(log.EventsForLineage(7, 9, 2, &more).empty());
  EXPECT_FALSE(more);
}

}  // namespace
}  // namespace triax::manager

namespace triax::manager {
namespace {

// A batch's events come back as the same events made as structs would.
TEST(EventLogTest, BatchEventsEqualEventStructs) {
  EventLog log({100, 100});
  const std::string seq1 = "seq-1", seq2 = "seq-22", tenant = "t", worker = "w";
  EventBatch batch;
  batch.Begin(5, EventKind::kBlockCreated, seq1, tenant, worker, 7,
              Tag{Temporal::kSink, Modality::kText, Role::kSystem},
              Format::kBF16);
  batch.Detail("index=", 0, " bytes=", uint64_t{4096});
  batch.Detail(" copied_from=", 3);  // appends to the same event
  batch.Begin(6, EventKind::kBlockFreed, seq2, tenant, worker, 8);
  batch.Begin(6, EventKind::kSequenceOpened, seq1, tenant, worker);
  batch.Detail("blocks=1");
  EXPECT_EQ(batch.size(), 3u);
  log.Append(&batch);
  EXPECT_TRUE(batch.empty());  // cleared for reuse
  const std::vector<Event> got = log.Retained(1, EventFilter{});
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].id, 1u);
  EXPECT_EQ(got[0].unix_ms, 5);
  EXPECT_EQ(got[0].kind, EventKind::kBlockCreated);
  EXPECT_EQ(got[0].sequence_id, "seq-1");
  EXPECT_EQ(got[0].tenant_id, "t");
  EXPECT_EQ(got[0].worker_id, "w");
  EXPECT_EQ(got[0].lineage_id, 7u);
  EXPECT_EQ(got[0].tag.role, Role::kSystem);
  EXPECT_EQ(got[0].format, Format::kBF16);
  EXPECT_EQ(got[0].detail, "index=0 bytes=4096 copied_from=3");
  EXPECT_EQ(got[1].sequence_id, "seq-22");  // another name, not the last one
  EXPECT_EQ(got[1].detail, "");
  EXPECT_EQ(got[2].sequence_id, "seq-1");
  EXPECT_EQ(got[2].lineage_id, 0u);
  EXPECT_EQ(got[2].detail, "blocks=1");
  EXPECT_EQ(EventLog::EventBytes(got[0]) + EventLog::EventBytes(got[1]) +
                EventLog::EventBytes(got[2]),
            log.retained_bytes());
  // The lineage index and subscriptions see batch events as any others.
  EXPECT_EQ(log.EventsForLineage(8).size(), 1u);
  auto sub = log.Subscribe(EventFilter{"", "seq-1", 0}, 0);
  batch.Begin(9, EventKind::kBlockReleased, seq2, tenant, worker, 8);
  batch.Begin(9, EventKind::kSequenceClosed, seq1, tenant, worker);
  log.Append(&batch);
  Event e;
  absl::Status end;
  ASSERT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEvent);
  EXPECT_EQ(e.id, 5u);
  EXPECT_EQ(e.kind, EventKind::kSequenceClosed);
  EXPECT_EQ(sub->Next(&e, &end), EventSubscription::Result::kEmpty);
  sub->Cancel();
}

}  // namespace
}  // namespace triax::manager
