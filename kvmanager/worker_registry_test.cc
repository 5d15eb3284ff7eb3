// WorkerRegistry (worker_registry.h) through its own interface: request
// checks, registration and restarts, heartbeats, down detection, placement
// and room checks. Times are explicit (no clock, no sleeps).
#include "kvmanager/worker_registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/status_matchers.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

RegisterWorkerRequest Req(const std::string& id, uint64_t capacity,
                          const std::string& address = "127.0.0.1:9001") {
  RegisterWorkerRequest req;
  req.worker_id = id;
  req.address = address;
  req.backend = "cpu";
  req.capacity_bytes = capacity;
  return req;
}

std::vector<std::string> Ids(const std::vector<WorkerRecord*>& ws) {
  std::vector<std::string> out;
  out.reserve(ws.size());
  for (const WorkerRecord* w : ws) out.push_back(w->info.worker_id);
  return out;
}

TEST(WorkerRegistryTest, RegistrationRequestsAreChecked) {
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(Req("w1", 100)), IsOk());
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(Req("", 100)),
              StatusIs(C::kInvalidArgument, HasSubstr("worker_id is empty")));
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(Req("w 1", 100)),
              StatusIs(C::kInvalidArgument, HasSubstr("worker_id")));
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(Req("w1", 100, "")),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("must be a host:port of 1..256 bytes")));
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(
                  Req("w1", 100, std::string(257, 'a'))),
              StatusIs(C::kInvalidArgument, HasSubstr("address")));
  RegisterWorkerRequest no_backend = Req("w1", 100);
  no_backend.backend.clear();
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(no_backend),
              StatusIs(C::kInvalidArgument, HasSubstr("backend is empty")));
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(Req("w1", 0)),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("capacity_bytes is 0; it must be > 0")));

  Inventory inv;
  inv.formats.push_back(FormatInventory{});
  inv.formats[0].format = Format::kINT4;
  EXPECT_THAT(WorkerRegistry::ValidateHeartbeat("w1", inv), IsOk());
  inv.formats.push_back(FormatInventory{});
  inv.formats[1].format = static_cast<Format>(42);
  EXPECT_THAT(WorkerRegistry::ValidateHeartbeat("w1", inv),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("inventory.formats[1].format is")));
  EXPECT_THAT(WorkerRegistry::ValidateHeartbeat("", Inventory{}),
              StatusIs(C::kInvalidArgument, HasSubstr("worker_id")));
}

TEST(WorkerRegistryTest, RegisterCreatesThenTakesOverTheRecord) {
  WorkerRegistry reg;
  auto fresh = reg.FindForRegistration(Req("w1", 100));
  ASSERT_THAT(fresh, IsOk());
  EXPECT_EQ(*fresh, nullptr);
  RegisterWorkerRequest req = Req("w1", 100);
  req.host_capacity_bytes = 50;
  req.disk_capacity_bytes = 70;
  WorkerRecord* w = reg.Register(req, 1000);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->info.state, WorkerState::kUp);
  EXPECT_EQ(w->info.last_heartbeat_unix_ms, 1000);
  EXPECT_EQ(w->info.host_capacity_bytes, 50u);
  EXPECT_EQ(w->info.disk_capacity_bytes, 70u);
  EXPECT_EQ(reg.Find("w1"), w);
  EXPECT_EQ(reg.Find("w2"), nullptr);

  // The same address again (a restart): the known record, to be reset.
  w->reserved = 40;
  w->info.inventory.device_error = "sticky";
  auto again = reg.FindForRegistration(Req("w1", 100));
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(*again, w);
  EXPECT_EQ(reg.Register(Req("w1", 200), 2000), w);
  EXPECT_EQ(w->info.capacity_bytes, 200u);
  EXPECT_EQ(w->info.host_capacity_bytes, 0u);
  EXPECT_TRUE(w->info.inventory.device_error.empty());
  EXPECT_EQ(w->info.last_heartbeat_unix_ms, 2000);

  // Another address while it is UP: refused; once DOWN: taken over.
  EXPECT_THAT(
      reg.FindForRegistration(Req("w1", 100, "10.0.0.2:1")),
      StatusIs(C::kAlreadyExists, HasSubstr("worker_id \"w1\" is up at address "
                                            "\"127.0.0.1:9001\"")));
  w->info.state = WorkerState::kDown;
  auto down = reg.FindForRegistration(Req("w1", 100, "10.0.0.2:1"));
  ASSERT_THAT(down, IsOk());
  EXPECT_EQ(*down, w);
}

// With a live window: another incarnation at the same address is refused
// while the registered one heartbeat within it, taken once it has been
// silent for the window; no incarnation on either side: the address rule
// only.
TEST(WorkerRegistryTest, AnotherIncarnationWaitsForTheLiveOneToGoSilent) {
  WorkerRegistry reg;
  RegisterWorkerRequest first = Req("w1", 100);
  first.incarnation = "a";
  WorkerRecord* w = reg.Register(first, 1000);
  RegisterWorkerRequest second = Req("w1", 100);
  second.incarnation = "b";
  EXPECT_THAT(reg.FindForRegistration(second, 1199, 200),
              StatusIs(C::kAlreadyExists,
                       HasSubstr("with incarnation \"a\" (last heartbeat "
                                 "199 ms ago); incarnation \"b\" cannot take "
                                 "it until that one misses its heartbeats for "
                                 "200 ms")));
  auto later = reg.FindForRegistration(second, 1200, 200);
  ASSERT_THAT(later, IsOk());
  EXPECT_EQ(*later, w);
  // The same incarnation, and the window off (0), are let in at once.
  EXPECT_THAT(reg.FindForRegistration(first, 1001, 200), IsOk());
  EXPECT_THAT(reg.FindForRegistration(second, 1001, 0), IsOk());
  // A SUSPECT worker is not live.
  w->info.state = WorkerState::kSuspect;
  EXPECT_THAT(reg.FindForRegistration(second, 1001, 200), IsOk());
  // Without an incarnation in the request: the address rule only.
  w->info.state = WorkerState::kUp;
  EXPECT_THAT(reg.FindForRegistration(Req("w1", 100), 1001, 200), IsOk());
}

TEST(WorkerRegistryTest, HeartbeatsAndDownDetection) {
  WorkerRegistry reg;
  EXPECT_THAT(reg.Heartbeat("w1", Inventory{}, 0),
              StatusIs(C::kNotFound, HasSubstr("is not registered; "
                                               "re-register")));
  reg.Register(Req("w2", 100), 0);
  reg.Register(Req("w1", 100), 0);
  reg.Register(Req("w3", 100), 0);
  Inventory inv;
  inv.used_bytes = 7;
  auto hb = reg.Heartbeat("w3", inv, 900);
  ASSERT_THAT(hb, IsOk());
  EXPECT_EQ((*hb)->info.inventory.used_bytes, 7u);
  EXPECT_EQ((*hb)->info.last_heartbeat_unix_ms, 900);
  // Silent for more than the timeout (not exactly it), ordered by id.
  EXPECT_THAT(Ids(reg.Silent(1000, 1000)), ElementsAre());
  EXPECT_THAT(Ids(reg.Silent(1001, 1000)), ElementsAre("w1", "w2"));
  reg.Find("w1")->info.state = WorkerState::kDown;
  EXPECT_THAT(Ids(reg.Silent(5000, 1000)), ElementsAre("w2", "w3"));
  EXPECT_THAT(reg.Heartbeat("w1", Inventory{}, 5000),
              StatusIs(C::kNotFound, HasSubstr("was marked down")));
}

TEST(WorkerRegistryTest, PlacementTakesTheMostFreeHealthyWorker) {
  WorkerRegistry reg;
  EXPECT_THAT(reg.Place(1),
              StatusIs(C::kUnavailable, HasSubstr("no worker is up")));
  WorkerRecord* a = reg.Register(Req("a", 1000), 0);
  WorkerRecord* b = reg.Register(Req("b", 1000), 0);
  WorkerRecord* c = reg.Register(Req("c", 5000), 0);
  // Equal free space: the smaller id.
  c->info.state = WorkerState::kDown;
  auto p = reg.Place(10);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(*p, a);
  a->reserved = 300;
  EXPECT_EQ(*reg.Place(10), b);
  // A failed device takes nothing new.
  b->info.inventory.device_error = "cuda: illegal address";
  EXPECT_EQ(*reg.Place(10), a);
  EXPECT_THAT(reg.Place(701),
              StatusIs(C::kResourceExhausted,
                       HasSubstr("the request needs 701 bytes; the largest "
                                 "free space is 700 bytes (worker \"a\"); "
                                 "over by 1 bytes")));
  EXPECT_THAT(reg.Place(0), IsOk());
  a->info.state = WorkerState::kDown;
  EXPECT_THAT(reg.Place(0), StatusIs(C::kUnavailable, ::testing::_));
}

TEST(WorkerRegistryTest, RoomChecksAndInfo) {
  WorkerRegistry reg;
  WorkerRecord* w = reg.Register(Req("w", 1000), 0);
  w->reserved = 900;
  EXPECT_EQ(WorkerRegistry::FreeBytes(*w), 100u);
  EXPECT_THAT(WorkerRegistry::Fits(*w, 100), IsOk());
  EXPECT_THAT(WorkerRegistry::Fits(*w, 150),
              StatusIs(C::kResourceExhausted,
                       "worker \"w\" has 100 free bytes; the request needs "
                       "150 bytes; over by 50 bytes"));
  w->reserved = 1200;  // over-reserved (a lowered capacity at restart)
  EXPECT_EQ(WorkerRegistry::FreeBytes(*w), 0u);
  SequenceRecord s1, s2;
  w->open.insert(&s1);
  w->open.insert(&s2);
  reg.Register(Req("a", 10), 0);
  const std::vector<WorkerInfo> list = reg.List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].worker_id, "a");
  EXPECT_EQ(list[1].worker_id, "w");
  EXPECT_EQ(list[1].reserved_bytes, 1200u);
  EXPECT_EQ(list[1].sequences, 2u);
  EXPECT_EQ(reg.all().size(), 2u);
}

TEST(WorkerRegistryTest, SuspectWorkersTakeNothingNewAndComeBackOnAHeartbeat) {
  WorkerRegistry reg;
  RegisterWorkerRequest a = Req("a", 5000);
  a.incarnation = "boot-a";
  reg.Register(a, 0);
  reg.Register(Req("b", 1000), 0);
  EXPECT_EQ(reg.Find("a")->incarnation, "boot-a");
  EXPECT_EQ(reg.List()[0].incarnation, "boot-a");
  // Silent: the caller marks it SUSPECT; Silent by state finds it there.
  ASSERT_THAT(reg.Heartbeat("b", Inventory{}, 1500), IsOk());
  EXPECT_THAT(Ids(reg.Silent(1500, 1000)), ElementsAre("a"));
  reg.Find("a")->info.state = WorkerState::kSuspect;
  EXPECT_THAT(Ids(reg.Silent(1500, 1000)), ElementsAre());
  EXPECT_THAT(Ids(reg.Silent(1500, 1000, WorkerState::kSuspect)),
              ElementsAre("a"));
  // The most free worker is SUSPECT: placement takes the other one.
  auto p = reg.Place(10);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ((*p)->info.worker_id, "b");
  // A different address cannot take a SUSPECT id.
  EXPECT_THAT(reg.FindForRegistration(Req("a", 100, "10.0.0.2:1")),
              StatusIs(C::kAlreadyExists, HasSubstr("is suspect at address")));
  // Heartbeats of a worker registered with an incarnation must carry it.
  EXPECT_THAT(reg.Heartbeat("a", Inventory{}, 1600),
              StatusIs(C::kInvalidArgument,
                       HasSubstr("incarnation is empty; worker_id \"a\" "
                                 "registered with incarnation \"boot-a\"")));
  EXPECT_THAT(reg.Heartbeat("a", Inventory{}, 1600, "boot-old"),
              StatusIs(C::kFailedPrecondition,
                       HasSubstr("incarnation \"boot-old\" is stale")));
  EXPECT_THAT(reg.Heartbeat("b", Inventory{}, 1600, "boot-b"),
              StatusIs(C::kFailedPrecondition, HasSubstr("is stale")));
  EXPECT_EQ(reg.Find("a")->info.state, WorkerState::kSuspect);
  // The right one: UP again, placeable again.
  ASSERT_THAT(reg.Heartbeat("a", Inventory{}, 1700, "boot-a"), IsOk());
  EXPECT_EQ(reg.Find("a")->info.state, WorkerState::kUp);
  EXPECT_EQ(reg.Find("a")->info.last_heartbeat_unix_ms, 1700);
  EXPECT_EQ((*reg.Place(10))->info.worker_id, "a");
}

TEST(WorkerRegistryTest, IncarnationsAreCheckedAndCompared) {
  RegisterWorkerRequest req = Req("w1", 100);
  req.incarnation = "1700000000-8f3a";
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(req), IsOk());
  req.incarnation = "boot a";
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(req),
              StatusIs(C::kInvalidArgument, HasSubstr("incarnation")));
  req.incarnation = std::string(129, 'x');
  EXPECT_THAT(WorkerRegistry::ValidateRegistration(req),
              StatusIs(C::kInvalidArgument, HasSubstr("incarnation")));
  EXPECT_THAT(WorkerRegistry::ValidateHeartbeat("w1", Inventory{}, "a/b"),
              StatusIs(C::kInvalidArgument, HasSubstr("incarnation")));
  EXPECT_THAT(WorkerRegistry::ValidateHeartbeat("w1", Inventory{}, ""), IsOk());
  // A registration's inventory is checked like a heartbeat's.
  req.incarnation = "boot-a";
  req.inventory.formats.push_back(FormatInventory{});
  req.inventory.formats[0].format = static_cast<Format>(42);
  EXPECT_THAT(
      WorkerRegistry::ValidateRegistration(req),
      StatusIs(C::kInvalidArgument, HasSubstr("inventory.formats[0].format")));

  WorkerRecord w;
  RegisterWorkerRequest again = Req("w1", 100);
  EXPECT_FALSE(WorkerRegistry::SameIncarnation(w, again));  // both empty
  w.incarnation = "boot-a";
  again.incarnation = "boot-a";
  EXPECT_TRUE(WorkerRegistry::SameIncarnation(w, again));
  again.incarnation = "boot-b";
  EXPECT_FALSE(WorkerRegistry::SameIncarnation(w, again));
}

}  // namespace
}  // namespace triax::manager
