// WorkerCore: request-id idempotency of every mutating call (a repeat gets
// the first reply and applies nothing), reused ids with another payload,
// failures not remembered, bad request ids and inputs, WriteKV streams
// (drained on replay, broken streams not remembered), concurrent
// duplicates, and the pass-throughs (Attend, Read, inventory, health,
// lost sequences). No gRPC: a store over a recording CPU device.
#include "worker/worker_core.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <deque>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "worker/recording_device.h"
#include "worker/tier_store.h"

namespace triax::worker {
namespace {

using kernels::Format;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

constexpr char kTenant[] = "tenant-a";
constexpr size_t kTokenValues = size_t{2} * 32;  // n_kv_heads x head_dim

ModelShape Model() {
  ModelShape m;
  m.name = "test";
  m.n_layers = 2;
  m.n_kv_heads = 2;
  m.n_q_heads = 4;
  m.head_dim = 32;
  return m;
}

// Blocks of 16 tokens (lineage 1000, 1001, ...) covering `tokens`.
std::vector<BlockSpec> Plan(uint32_t tokens, Format format = Format::kINT4) {
  std::vector<BlockSpec> plan;
  uint32_t i = 0;
  for (uint32_t first = 0; first < tokens; first += 16, ++i) {
    BlockSpec b;
    b.index = i;
    b.lineage_id = 1000 + i;
    b.first_token = first;
    b.num_tokens = std::min(16u, tokens - first);
    b.encoding = format;
    plan.push_back(b);
  }
  return plan;
}

AllocatePagesRequest Alloc(const std::string& seq, uint32_t tokens,
                           const std::string& request_id = "",
                           const std::string& tenant = kTenant) {
  AllocatePagesRequest r;
  r.request_id = request_id;
  r.tenant_id = tenant;
  r.sequence_id = seq;
  r.model = Model();
  r.block_tokens = 16;
  r.blocks = Plan(tokens);
  return r;
}

std::string RandomBytes(size_t values, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(values);
  for (float& f : x) f = dist(rng);
  return std::string(reinterpret_cast<const char*>(x.data()), values * 4);
}

// A WriteKV stream of prepared messages; counts pulls and can break (the
// client going away) or block before a given pull.
class TestStream {
 public:
  // A message writing tokens [first, first + n) of `layer` as f32.
  TestStream& Add(const std::string& seq, uint32_t layer, uint64_t first,
                  uint32_t n, const std::string& request_id = "",
                  const std::string& tenant = kTenant) {
    WriteMessage m;
    m.request_id = request_id;
    m.tenant_id = tenant;
    m.sequence_id = seq;
    const uint32_t seed =
        static_cast<uint32_t>(uint64_t{layer} * 100000 + first);
    bytes_.push_back(RandomBytes(n * kTokenValues, seed));
    const std::string& k = bytes_.back();
    bytes_.push_back(RandomBytes(n * kTokenValues, seed + 50000));
    const std::string& v = bytes_.back();
    KvWrite w;
    w.layer = layer;
    w.first_token = first;
    w.num_tokens = n;
    w.dtype = static_cast<int>(KvDtype::kF32);
    w.k = k;
    w.v = v;
    m.chunk = w;
    msgs_.push_back(std::move(m));
    return *this;
  }
  TestStream& AddWithoutChunk(const std::string& seq,
                              const std::string& request_id = "") {
    WriteMessage m;
    m.request_id = request_id;
    m.tenant_id = kTenant;
    m.sequence_id = seq;
    msgs_.push_back(std::move(m));
    return *this;
  }
  // The pull after `n` messages fails CANCELLED.
  TestStream& BreakAfter(size_t n) {
    break_after_ = n;
    return *this;
  }
  // The pull after `n` messages notifies `reached`, then waits for `go`.
  TestStream& PauseAfter(size_t n, absl::Notification* reached,
                         absl::Notification* go) {
    pause_after_ = n;
    reached_ = reached;
    go_ = go;
    return *this;
  }

  WriteStream stream() {
    return WriteStream{[this](WriteMessage* out) -> absl::StatusOr<bool> {
      if (pause_after_ == pulled_) {
        reached_->Notify();
        go_->WaitForNotification();
      }
      if (break_after_ == pulled_) return absl::CancelledError("went away");
      if (pulled_ == msgs_.size()) return false;
      *out = msgs_[pulled_++];
      return true;
    }};
  }
  size_t pulled() const { return pulled_; }
  size_t size() const { return msgs_.size(); }

 private:
  std::deque<std::string> bytes_;  // stable: the messages' views
  std::vector<WriteMessage> msgs_;
  size_t pulled_ = 0;
  std::optional<size_t> break_after_, pause_after_;
  absl::Notification* reached_ = nullptr;
  absl::Notification* go_ = nullptr;
};

class WorkerCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = PageAllocator::Create(&device_, 4 << 20);
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = *std::move(a);
    TierStoreOptions to;
    to.host_capacity_bytes = 256 << 10;
    to.owner = "core-test";
    auto t = TierStore::Create(&device_, to);
    ASSERT_TRUE(t.ok()) << t.status();
    tiers_ = *std::move(t);
    StoreOptions so;
    so.window_tokens = 4;
    so.tiers = tiers_.get();
    so.prefetch_thread = false;
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get(), so);
    core_ = std::make_unique<WorkerCore>(store_.get(), &device_);
  }
  void TearDown() override {
    core_.reset();
    store_.reset();
    tiers_.reset();
    alloc_.reset();
  }

  // Everything a call could change, as text, to show a repeat changed
  // nothing.
  std::string State() {
    const InventorySnapshot inv = core_->Inventory();
    std::string s =
        absl::StrCat("used=", inv.used_bytes, " window=", inv.window_bytes,
                     " host=", inv.host.used_bytes, " spills=", inv.spills,
                     " restores=", inv.restores, " evictions=", inv.evictions,
                     " seqs=", absl::StrJoin(inv.sequence_ids, ","));
    for (const std::string& id : inv.sequence_ids) {
      auto d = store_->Describe(id);
      absl::StrAppend(&s, " ", id, ":", absl::StrJoin(d->written, "/"));
      for (const BlockSpec& b : d->blocks) {
        absl::StrAppend(&s, ",", b.lineage_id, "@", static_cast<int>(b.tier),
                        b.evicted ? "e" : "", "f",
                        static_cast<int>(b.encoding.k));
      }
    }
    return s;
  }

  // Sequence `seq` of 40 INT4 tokens, all written on both layers: blocks
  // 1000 and 1001 sealed (window 4), 1002 not.
  void MakeWritten(const std::string& seq) {
    ASSERT_THAT(core_->AllocatePages(Alloc(seq, 40)), IsOk());
    TestStream s;
    s.Add(seq, 0, 0, 40).Add(seq, 1, 0, 40);
    ASSERT_THAT(core_->WriteKV(s.stream()), IsOk());
  }

  SpillRequest SpillReq(const std::string& request_id,
                        std::vector<uint64_t> ids, Tier tier = Tier::kHost) {
    SpillRequest r;
    r.request_id = request_id;
    r.tenant_id = kTenant;
    r.sequence_id = "s";
    r.lineage_ids = std::move(ids);
    r.tier = tier;
    return r;
  }

  RecordingDevice device_;
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<TierStore> tiers_;
  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<WorkerCore> core_;
};

// Given an AllocatePages under request id "a-1", when it comes again, then
// the first reply comes back and nothing more is reserved; planning 40
// tokens instead of 20 (another fingerprint) is refused FAILED_PRECONDITION;
// another tenant's "a-1" is its own request.
TEST_F(WorkerCoreTest, AllocatePagesRepeatReturnsTheFirstReply) {
  auto first = core_->AllocatePages(Alloc("s", 20, "a-1"));
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->pages_allocated, 4u);  // 2 blocks x 2 layers
  const std::string after = State();
  auto again = core_->AllocatePages(Alloc("s", 20, "a-1"));
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->pages_allocated, first->pages_allocated);
  EXPECT_EQ(again->bytes_allocated, first->bytes_allocated);
  EXPECT_EQ(State(), after);
  // The service fingerprints the wire request; here the core is told.
  AllocatePagesRequest other = Alloc("s", 40, "a-1");
  other.fingerprint = 1;
  EXPECT_THAT(core_->AllocatePages(other),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("request_id=\"a-1\" was used for a "
                                 "different AllocatePages request")));
  EXPECT_EQ(State(), after);
  // Keys are per tenant: tenant-b's "a-1" runs.
  auto b = core_->AllocatePages(Alloc("t", 20, "a-1", "tenant-b"));
  ASSERT_THAT(b, IsOk());
  EXPECT_NE(State(), after);
}

// Keys are per method: one id used by two methods runs both.
TEST_F(WorkerCoreTest, KeysArePerMethod) {
  ASSERT_THAT(core_->AllocatePages(Alloc("s", 20, "r-1")), IsOk());
  FreeRequest f{"r-1", kTenant, "s"};
  auto freed = core_->Free(f);
  ASSERT_THAT(freed, IsOk());
  EXPECT_EQ(freed->pages_freed, 4u);
  EXPECT_TRUE(core_->Inventory().sequence_ids.empty());
}

TEST_F(WorkerCoreTest, ForkDemoteAndFreeRepeatsApplyOnce) {
  ASSERT_NO_FATAL_FAILURE(MakeWritten("s"));
  ForkRequest fork;
  fork.request_id = "f-1";
  fork.tenant_id = kTenant;
  fork.parent_sequence_id = "s";
  fork.child_sequence_id = "c";
  fork.num_tokens = 32;
  fork.blocks = Plan(32);
  auto f1 = core_->Fork(fork);
  ASSERT_THAT(f1, IsOk());
  EXPECT_EQ(f1->pages_shared, 4u);
  const std::string forked = State();
  auto f2 = core_->Fork(fork);  // not ALREADY_EXISTS
  ASSERT_THAT(f2, IsOk());
  EXPECT_EQ(f2->pages_shared, f1->pages_shared);
  EXPECT_EQ(f2->pages_copied, f1->pages_copied);
  EXPECT_EQ(State(), forked);
  fork.request_id = "f-2";
  EXPECT_THAT(core_->Fork(fork), StatusIs(absl::StatusCode::kAlreadyExists,
                                          HasSubstr("child_sequence_id")));

  FreeRequest free_child{"fr-1", kTenant, "c"};
  auto fr1 = core_->Free(free_child);
  ASSERT_THAT(fr1, IsOk());
  const std::string freed = State();
  auto fr2 = core_->Free(free_child);  // not NOT_FOUND
  ASSERT_THAT(fr2, IsOk());
  EXPECT_EQ(fr2->pages_freed, fr1->pages_freed);
  EXPECT_EQ(State(), freed);

  DemoteRequest d;
  d.request_id = "d-1";
  d.tenant_id = kTenant;
  d.sequence_id = "s";
  BlockSpec b = Plan(16)[0];
  b.encoding = Format::kINT2;
  d.blocks = {b};
  auto d1 = core_->Demote(d);
  ASSERT_THAT(d1, IsOk());
  EXPECT_EQ(d1->pages_reencoded, 2u);
  EXPECT_LT(d1->bytes_delta, 0);
  const std::string demoted = State();
  auto d2 = core_->Demote(d);
  ASSERT_THAT(d2, IsOk());
  EXPECT_EQ(d2->pages_reencoded, d1->pages_reencoded);
  EXPECT_EQ(d2->bytes_delta, d1->bytes_delta);
  EXPECT_EQ(State(), demoted);
  // The same id naming another encoding (another fingerprint): refused,
  // nothing applied.
  d.blocks[0].encoding = Format::kBF16;
  d.fingerprint = 1;
  EXPECT_THAT(core_->Demote(d),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("request_id=\"d-1\" was used for a "
                                 "different Demote request")));
  EXPECT_EQ(State(), demoted);
  free_child.fingerprint = 1;
  EXPECT_THAT(core_->Free(free_child),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("different FreePages request")));
  fork.request_id = "f-1";
  fork.fingerprint = 1;
  EXPECT_THAT(core_->Fork(fork),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("different ForkSequence request")));
}

TEST_F(WorkerCoreTest, SpillRestoreEvictRepeatsApplyOnce) {
  ASSERT_NO_FATAL_FAILURE(MakeWritten("s"));
  auto s1 = core_->Spill(SpillReq("sp-1", {1000, 1001}));
  ASSERT_THAT(s1, IsOk());
  EXPECT_EQ(s1->pages_moved, 4u);
  const std::string spilled = State();
  auto s2 = core_->Spill(SpillReq("sp-1", {1000, 1001}));
  ASSERT_THAT(s2, IsOk());
  EXPECT_EQ(s2->bytes_moved, s1->bytes_moved);
  EXPECT_EQ(State(), spilled);

  RestoreRequest r;
  r.request_id = "rs-1";
  r.tenant_id = kTenant;
  r.sequence_id = "s";
  auto r1 = core_->Restore(r);
  ASSERT_THAT(r1, IsOk());
  EXPECT_EQ(r1->pages_restored, 4u);
  const std::string restored = State();
  ASSERT_THAT(core_->Spill(SpillReq("sp-2", {1000})), IsOk());
  // The repeat answers the first reply and does not restore 1000 again.
  auto r2 = core_->Restore(r);
  ASSERT_THAT(r2, IsOk());
  EXPECT_EQ(r2->pages_restored, 4u);
  EXPECT_NE(State(), restored);
  EXPECT_EQ(core_->Inventory().restores, 2u);

  EvictRequest e;
  e.request_id = "ev-1";
  e.tenant_id = kTenant;
  e.sequence_id = "s";
  e.lineage_ids = {1001};
  auto e1 = core_->Evict(e);
  ASSERT_THAT(e1, IsOk());
  EXPECT_EQ(e1->pages_freed, 2u);
  const std::string evicted = State();
  auto e2 = core_->Evict(e);
  ASSERT_THAT(e2, IsOk());
  EXPECT_EQ(e2->pages_freed, 2u);
  EXPECT_EQ(State(), evicted);
  EXPECT_EQ(core_->Inventory().evictions, 1u);

  // Each id reused with another fingerprint is refused, nothing applied.
  SpillRequest sp = SpillReq("sp-1", {1000});
  sp.fingerprint = 1;
  r.fingerprint = 1;
  e.fingerprint = 1;
  EXPECT_THAT(core_->Spill(sp), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("different Spill request")));
  EXPECT_THAT(core_->Restore(r),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("different Restore request")));
  EXPECT_THAT(core_->Evict(e), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("different Evict request")));
  EXPECT_EQ(State(), evicted);
}

// A failure changes nothing and is not remembered: the same id runs again
// once the cause is gone.
TEST_F(WorkerCoreTest, FailuresAreNotRemembered) {
  FreeRequest f{"fr-1", kTenant, "s"};
  EXPECT_THAT(core_->Free(f),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("sequence_id")));
  ASSERT_NO_FATAL_FAILURE(MakeWritten("s"));
  // Block 1002 is still in the window.
  EXPECT_THAT(
      core_->Spill(SpillReq("sp-x", {1002})),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not sealed")));
  auto sp = core_->Spill(SpillReq("sp-x", {1000}));
  ASSERT_THAT(sp, IsOk());
  EXPECT_EQ(sp->pages_moved, 2u);
  auto freed = core_->Free(f);
  ASSERT_THAT(freed, IsOk());
  EXPECT_GT(freed->pages_freed, 0u);
}

TEST_F(WorkerCoreTest, BadRequestIdsAreRefusedFirst) {
  ASSERT_NO_FATAL_FAILURE(MakeWritten("s"));
  const std::string before = State();
  const std::string too_long(129, 'a');
  for (const std::string& id : {std::string("bad id"), too_long,
                                std::string("tab\tid"), std::string("a/b")}) {
    SCOPED_TRACE(id);
    const auto bad = [](const absl::Status& s) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("request_id"));
    };
    bad(core_->AllocatePages(Alloc("t", 20, id)).status());
    ForkRequest fork{id, kTenant, "s", "c", 16, Plan(16)};
    bad(core_->Fork(fork).status());
    DemoteRequest d{id, kTenant, "s", Plan(16)};
    bad(core_->Demote(d).status());
    bad(core_->Free(FreeRequest{id, kTenant, "s"}).status());
    bad(core_->Spill(SpillReq(id, {1000})).status());
    RestoreRequest r;
    r.request_id = id;
    r.tenant_id = kTenant;
    r.sequence_id = "s";
    bad(core_->Restore(r).status());
    bad(core_->Evict(EvictRequest{id, kTenant, "s", {1000}}).status());
    TestStream w;
    w.Add("s", 0, 40, 1, id).Add("s", 1, 40, 1);
    bad(core_->WriteKV(w.stream()).status());
    EXPECT_EQ(w.pulled(), 1u);  // refused on the first message
  }
  EXPECT_EQ(State(), before);
}

TEST_F(WorkerCoreTest, BadInputsAreRefusedWithoutStateChange) {
  ASSERT_NO_FATAL_FAILURE(MakeWritten("s"));
  const std::string before = State();
  EXPECT_THAT(core_->Spill(SpillReq("", {1000}, Tier::kDevice)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tier=1 is not TIER_HOST (2) or TIER_DISK")));
  EXPECT_THAT(
      core_->Spill(SpillReq("", {1000}, Tier::kUnspecified)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tier=0")));
  EXPECT_THAT(core_->Spill(SpillReq("", {})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lineage_ids is empty")));
  EXPECT_THAT(core_->Evict(EvictRequest{"", kTenant, "s", {}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lineage_ids is empty")));
  EXPECT_THAT(
      core_->AllocatePages(Alloc("bad seq", 20)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sequence_id")));
  ReadRequest read;
  read.tenant_id = kTenant;
  read.sequence_id = "s";
  EXPECT_THAT(core_->Read(read),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dtype=0 is not F32 (1) or BF16 (2)")));
  AttendRequest attend;
  EXPECT_THAT(
      core_->Attend(attend),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tenant_id")));
  TestStream missing;
  missing.AddWithoutChunk("s");
  EXPECT_THAT(core_->WriteKV(missing.stream()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("message 0: chunk is missing")));
  EXPECT_EQ(State(), before);
}

// Given a stream under "w-1" that wrote, when the same stream comes again,
// then every message is pulled, nothing is written, and the first reply
// comes back; another payload under "w-1" is pulled too, writes nothing and
// is refused FAILED_PRECONDITION.
TEST_F(WorkerCoreTest, WriteKVRepeatIsDrainedAndAnsweredWithTheFirstReply) {
  ASSERT_THAT(core_->AllocatePages(Alloc("s", 40)), IsOk());
  TestStream first;
  first.Add("s", 0, 0, 10, "w-1").Add("s", 0, 10, 10);
  auto r1 = core_->WriteKV(first.stream());
  ASSERT_THAT(r1, IsOk());
  EXPECT_EQ(r1->tokens_written, 20u);
  EXPECT_EQ(r1->bytes_received, size_t{2} * 20 * kTokenValues * 4);
  const std::string after = State();

  TestStream again;
  again.Add("s", 0, 0, 10, "w-1").Add("s", 0, 10, 10);
  auto r2 = core_->WriteKV(again.stream());
  ASSERT_THAT(r2, IsOk());
  EXPECT_EQ(r2->tokens_written, 20u);
  EXPECT_EQ(r2->bytes_received, r1->bytes_received);
  EXPECT_EQ(again.pulled(), again.size());
  EXPECT_EQ(State(), after);

  TestStream other;
  other.Add("s", 0, 20, 5, "w-1").Add("s", 1, 0, 5).Add("s", 1, 5, 5);
  EXPECT_THAT(core_->WriteKV(other.stream()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("request_id=\"w-1\" was used for a "
                                 "different WriteKV request")));
  EXPECT_EQ(other.pulled(), 3u);
  EXPECT_EQ(State(), after);
  // The same tokens in other chunks: refused as well.
  TestStream changed;
  changed.Add("s", 0, 0, 10, "w-1").Add("s", 0, 10, 9).Add("s", 0, 19, 1);
  EXPECT_THAT(core_->WriteKV(changed.stream()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("different WriteKV request")));
  EXPECT_EQ(State(), after);

  // An empty stream writes nothing.
  TestStream empty;
  auto r4 = core_->WriteKV(empty.stream());
  ASSERT_THAT(r4, IsOk());
  EXPECT_EQ(r4->tokens_written, 0u);
}

// A failing message names itself and what earlier messages wrote (they
// stay written); the stream is not remembered.
TEST_F(WorkerCoreTest, WriteKVErrorsNameTheMessage) {
  ASSERT_THAT(core_->AllocatePages(Alloc("s", 40)), IsOk());
  TestStream w;
  w.Add("s", 0, 0, 10, "w-1").Add("s", 0, 12, 4).Add("s", 0, 10, 2);
  EXPECT_THAT(core_->WriteKV(w.stream()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("message 1 (10 tokens of earlier messages "
                                 "were written): ")));
  EXPECT_EQ(w.pulled(), 2u);
  EXPECT_EQ(store_->Describe("s")->written[0], 10u);
  TestStream retry;
  retry.Add("s", 0, 10, 6, "w-1");
  auto r = core_->WriteKV(retry.stream());
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->tokens_written, 6u);
  EXPECT_EQ(store_->Describe("s")->written[0], 16u);
}

// A stream that breaks (the client went away) ends with that error and is
// not remembered, so a retry under the same id writes.
TEST_F(WorkerCoreTest, BrokenWriteKVStreamIsNotRemembered) {
  ASSERT_THAT(core_->AllocatePages(Alloc("s", 40)), IsOk());
  TestStream broken;
  broken.Add("s", 0, 0, 10, "w-1").Add("s", 0, 10, 10).BreakAfter(1);
  EXPECT_THAT(core_->WriteKV(broken.stream()),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("went away")));
  EXPECT_EQ(store_->Describe("s")->written[0], 10u);
  TestStream rest;
  rest.Add("s", 0, 10, 10, "w-1");
  auto r = core_->WriteKV(rest.stream());
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->tokens_written, 10u);
  EXPECT_EQ(store_->Describe("s")->written[0], 20u);
}

// Given a stream under "w-1" paused after its first message (written), when
// a duplicate under "w-1" arrives, then it waits for the first to finish and
// gets its reply instead of writing again (which would fail out of order).
TEST_F(WorkerCoreTest, ConcurrentDuplicateWaitsForTheFirst) {
  ASSERT_THAT(core_->AllocatePages(Alloc("s", 40)), IsOk());
  absl::Notification reached, go;
  TestStream first;
  first.Add("s", 0, 0, 10, "w-1")
      .Add("s", 0, 10, 10)
      .PauseAfter(1, &reached, &go);
  absl::StatusOr<WriteResult> r1;
  std::thread t1([&] { r1 = core_->WriteKV(first.stream()); });
  reached.WaitForNotification();
  TestStream dup;
  dup.Add("s", 0, 0, 10, "w-1").Add("s", 0, 10, 10);
  absl::StatusOr<WriteResult> r2;
  std::thread t2([&] { r2 = core_->WriteKV(dup.stream()); });
  go.Notify();
  t1.join();
  t2.join();
  ASSERT_THAT(r1, IsOk());
  ASSERT_THAT(r2, IsOk());
  EXPECT_EQ(r1->tokens_written, 20u);
  EXPECT_EQ(r2->tokens_written, 20u);
  EXPECT_EQ(dup.pulled(), 2u);
  EXPECT_EQ(store_->Describe("s")->written[0], 20u);
}

TEST_F(WorkerCoreTest, ReadAttendAndInventoryPassThrough) {
  ASSERT_NO_FATAL_FAILURE(MakeWritten("s"));
  ReadRequest read;
  read.tenant_id = kTenant;
  read.sequence_id = "s";
  read.layer = 1;
  read.first_token = 5;
  read.num_tokens = 3;
  read.dtype = KvDtype::kBF16;
  auto r = core_->Read(read);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->first_token, 5u);
  EXPECT_EQ(r->num_tokens, 3u);
  EXPECT_EQ(r->k.size(), 3 * kTokenValues);

  const std::string q = RandomBytes(size_t{4} * 32, 7);
  AttendRequest attend;
  attend.tenant_id = kTenant;
  attend.items.resize(2);
  attend.items[0].sequence_id = "s";
  attend.items[0].spec.num_queries = 1;
  attend.items[0].spec.queries = q;
  attend.items[1] = attend.items[0];
  attend.items[1].sequence_id = "nope";
  auto a = core_->Attend(attend);
  ASSERT_THAT(a, IsOk());
  ASSERT_EQ(a->items.size(), 2u);
  ASSERT_THAT(a->items[0], IsOk());
  EXPECT_EQ(a->items[0]->size(), 4u * 32);
  EXPECT_THAT(a->items[1], StatusIs(absl::StatusCode::kNotFound,
                                    HasSubstr("sequence_id=\"nope\"")));

  auto inv = core_->GetInventory(InventoryRequest{});
  ASSERT_THAT(inv, IsOk());
  EXPECT_EQ(inv->sequence_ids, std::vector<std::string>{"s"});
  EXPECT_EQ(inv->device_error, "");
  EXPECT_TRUE(inv->described.empty());

  // A restarted manager asks for the blocks of sequences it was unsure of:
  // the ones held are described, unknown ids left out.
  InventoryRequest describe;
  describe.describe_sequence_ids = {"s", "nope"};
  auto described = core_->GetInventory(describe);
  ASSERT_THAT(described, IsOk());
  ASSERT_EQ(described->described.size(), 1u);
  EXPECT_EQ(described->described[0].first, "s");
  EXPECT_FALSE(described->described[0].second.empty());
  EXPECT_EQ(described->described[0].second[0].tier, Tier::kDevice);
  describe.describe_sequence_ids.assign(kMaxDescribed + 1, "s");
  EXPECT_THAT(core_->GetInventory(describe),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("describe_sequence_ids has 1025 ids")));
}

TEST_F(WorkerCoreTest, DeviceHealthAndLostSequences) {
  EXPECT_THAT(core_->DeviceHealth(), IsOk());
  device_.SetUnhealthy("poisoned");
  EXPECT_THAT(core_->DeviceHealth(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("poisoned")));
  device_.SetUnhealthy("");
  EXPECT_THAT(core_->DeviceHealth(), IsOk());

  ASSERT_THAT(core_->AllocatePages(Alloc("a", 16)), IsOk());
  ASSERT_THAT(core_->AllocatePages(Alloc("b", 16, "", "tenant-b")), IsOk());
  core_->DropLost({"a", "b", "never-here"});
  EXPECT_TRUE(core_->Inventory().sequence_ids.empty());
}

}  // namespace
}  // namespace triax::worker
