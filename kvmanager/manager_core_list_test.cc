// The paged lists of ManagerCore (manager_core_list.cc, paging.h): pages
// cover every item exactly once in order, stay correct when items come and
// go between pages, refuse bad tokens and sizes, filter by tenant; and
// closed_retention bounds the closed sequences kept.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvmanager/manager_core_test_fixture.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

// Walks ListSequences page by page; each page's ids go into *pages.
std::vector<std::string> WalkSequences(ManagerCore* core,
                                       const std::string& tenant,
                                       bool include_closed, int32_t size,
                                       std::vector<size_t>* pages = nullptr) {
  std::vector<std::string> ids;
  PageRequest req{size, ""};
  for (int guard = 0; guard < 10000; ++guard) {
    auto page = core->ListSequences(tenant, include_closed, req);
    EXPECT_THAT(page, IsOk());
    if (!page.ok()) break;
    if (pages != nullptr) pages->push_back(page->items.size());
    for (const SequenceInfo& s : page->items) ids.push_back(s.sequence_id);
    if (page->next_page_token.empty()) break;
    req.page_token = page->next_page_token;
  }
  return ids;
}

std::vector<std::string> Seqs(std::initializer_list<int> ns) {
  std::vector<std::string> out;
  for (int n : ns) out.push_back(absl::StrCat("seq-", n));
  return out;
}

class ListTest : public CoreTest {
 protected:
  std::string OpenOne(const std::string& tenant = "acme") {
    auto s = Open({S(Role::kUser, 20)}, tenant);
    EXPECT_THAT(s, IsOk());
    return s.ok() ? s->sequence_id : "";
  }
  void Close(const std::string& id, const std::string& tenant = "acme") {
    ASSERT_THAT(core_->CloseSequence({"", tenant, id}), IsOk());
  }
};

TEST_F(ListTest, PagesCoverEverySequenceOnceInCreationOrder) {
  std::vector<std::string> want;
  for (int i = 0; i < 25; ++i) want.push_back(OpenOne());
  // Creation order is shortlex order of the ids: seq-9 before seq-10.
  EXPECT_EQ(want[8], "seq-9");
  EXPECT_EQ(want[9], "seq-10");
  std::vector<size_t> pages;
  EXPECT_THAT(WalkSequences(core_.get(), "", false, 4, &pages),
              ElementsAreArray(want));
  EXPECT_THAT(pages, ElementsAreArray({4u, 4u, 4u, 4u, 4u, 4u, 1u}));
  // A page size that divides the count ends with a full page and no token.
  pages.clear();
  EXPECT_THAT(WalkSequences(core_.get(), "", false, 5, &pages),
              ElementsAreArray(want));
  EXPECT_THAT(pages, ElementsAreArray({5u, 5u, 5u, 5u, 5u}));
  // The unpaged call agrees.
  auto all = core_->ListSequences("", false);
  ASSERT_THAT(all, IsOk());
  ASSERT_EQ(all->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*all)[i].sequence_id, want[i]);
  }
}

TEST_F(ListTest, TokensSurviveInsertsAndClosesBetweenPages) {
  for (int i = 0; i < 10; ++i) OpenOne();
  auto first = core_->ListSequences("", false, PageRequest{3, ""});
  ASSERT_THAT(first, IsOk());
  ASSERT_FALSE(first->next_page_token.empty());
  std::vector<std::string> got;
  for (const auto& s : first->items) got.push_back(s.sequence_id);
  EXPECT_THAT(got, ElementsAreArray(Seqs({1, 2, 3})));
  // Behind the cursor: seq-2 (already returned) and seq-3 (the cursor's own
  // key) close; ahead: seq-5 closes and seq-11 opens.
  Close("seq-2");
  Close("seq-3");
  Close("seq-5");
  OpenOne();
  PageRequest next{3, first->next_page_token};
  for (int guard = 0; guard < 100; ++guard) {
    auto page = core_->ListSequences("", false, next);
    ASSERT_THAT(page, IsOk());
    for (const auto& s : page->items) got.push_back(s.sequence_id);
    if (page->next_page_token.empty()) break;
    next.page_token = page->next_page_token;
  }
  EXPECT_THAT(got, ElementsAreArray(Seqs({1, 2, 3, 4, 6, 7, 8, 9, 10, 11})));
}

TEST_F(ListTest, LastItemLeavingDoesNotEndTheWalkEarly) {
  for (int i = 0; i < 4; ++i) OpenOne();
  auto first = core_->ListSequences("", false, PageRequest{2, ""});
  ASSERT_THAT(first, IsOk());
  // Every item but the ones ahead closes, the cursor's key included.
  Close("seq-1");
  Close("seq-2");
  auto rest = core_->ListSequences("", false, {2, first->next_page_token});
  ASSERT_THAT(rest, IsOk());
  ASSERT_EQ(rest->items.size(), 2u);
  EXPECT_EQ(rest->items[0].sequence_id, "seq-3");
  EXPECT_EQ(rest->items[1].sequence_id, "seq-4");
  EXPECT_TRUE(rest->next_page_token.empty());
}

TEST_F(ListTest, TenantFilterAndClosedSequences) {
  ASSERT_THAT(core_->CreateTenant({"", "zeta", {}, ""}), IsOk());
  // Interleaved: acme seq-1,3,5,7,9; zeta seq-2,4,6,8,10.
  for (int i = 0; i < 5; ++i) {
    OpenOne("acme");
    OpenOne("zeta");
  }
  Close("seq-3");
  Close("seq-4", "zeta");
  EXPECT_THAT(WalkSequences(core_.get(), "acme", false, 2),
              ElementsAreArray(Seqs({1, 5, 7, 9})));
  EXPECT_THAT(WalkSequences(core_.get(), "acme", true, 2),
              ElementsAreArray(Seqs({1, 3, 5, 7, 9})));
  EXPECT_THAT(WalkSequences(core_.get(), "zeta", false, 1),
              ElementsAreArray(Seqs({2, 6, 8, 10})));
  EXPECT_THAT(WalkSequences(core_.get(), "", true, 3),
              ElementsAreArray(Seqs({1, 2, 3, 4, 5, 6, 7, 8, 9, 10})));
  EXPECT_THAT(WalkSequences(core_.get(), "", false, 3),
              ElementsAreArray(Seqs({1, 2, 5, 6, 7, 8, 9, 10})));
  // The last of a tenant's sequences ends its list: no token pointing at
  // the next tenant's entries.
  auto acme = core_->ListSequences("acme", false, PageRequest{4, ""});
  ASSERT_THAT(acme, IsOk());
  EXPECT_EQ(acme->items.size(), 4u);
  EXPECT_TRUE(acme->next_page_token.empty());
  EXPECT_THAT(core_->ListSequences("nobody", false, PageRequest{}),
              StatusIs(C::kNotFound, HasSubstr("\"nobody\"")));
}

TEST_F(ListTest, PageSizeDefaultsAndBounds) {
  for (int i = 0; i < kDefaultPageSize + 1; ++i) OpenOne();
  auto page = core_->ListSequences("", false, PageRequest{0, ""});
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->items.size(), static_cast<size_t>(kDefaultPageSize));
  EXPECT_FALSE(page->next_page_token.empty());
  auto rest = core_->ListSequences("", false, {0, page->next_page_token});
  ASSERT_THAT(rest, IsOk());
  ASSERT_EQ(rest->items.size(), 1u);
  EXPECT_EQ(rest->items[0].sequence_id,
            absl::StrCat("seq-", kDefaultPageSize + 1));
  EXPECT_TRUE(rest->next_page_token.empty());
  // Above the maximum: lowered to it (here: everything fits).
  auto big = core_->ListSequences("", false, PageRequest{1 << 30, ""});
  ASSERT_THAT(big, IsOk());
  EXPECT_EQ(big->items.size(), static_cast<size_t>(kDefaultPageSize + 1));
  EXPECT_TRUE(big->next_page_token.empty());
  EXPECT_THAT(core_->ListSequences("", false, PageRequest{-1, ""}),
              StatusIs(C::kInvalidArgument, HasSubstr("page_size -1")));
  EXPECT_THAT(core_->ListWorkers(PageRequest{-5, ""}),
              StatusIs(C::kInvalidArgument, HasSubstr("page_size -5")));
}

TEST(PageCursorTest, SizeIsClampedToTheMaximum) {
  auto c = PageCursor::Start("L", "", PageRequest{kMaxPageSize + 1, ""});
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->size(), static_cast<size_t>(kMaxPageSize));
  c = PageCursor::Start("L", "", PageRequest{0, ""});
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->size(), static_cast<size_t>(kDefaultPageSize));
  EXPECT_FALSE(c->after().has_value());
  c = PageCursor::Start("L", "", PageRequest{7, c->NextToken("k-1")});
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->size(), 7u);
  EXPECT_EQ(c->after(), "k-1");
}

TEST_F(ListTest, MalformedAndForeignTokensAreRefused) {
  ASSERT_THAT(core_->CreateTenant({"", "zeta", {}, ""}), IsOk());
  for (int i = 0; i < 3; ++i) OpenOne();
  auto seqs = core_->ListSequences("acme", false, PageRequest{1, ""});
  ASSERT_THAT(seqs, IsOk());
  const std::string token = seqs->next_page_token;
  ASSERT_FALSE(token.empty());
  // seq-1's blocks (lineages 1 and 2) get their release events: a trace
  // of more than one page.
  Close("seq-1");
  auto tenants = core_->ListTenants(PageRequest{1, ""});
  ASSERT_THAT(tenants, IsOk());
  ASSERT_FALSE(tenants->next_page_token.empty());

  auto bad = [&](const std::string& t, const std::string& tenant = "acme",
                 bool closed = false) {
    return core_->ListSequences(tenant, closed, PageRequest{1, t});
  };
  EXPECT_THAT(
      bad("not base64 !!"),
      StatusIs(C::kInvalidArgument, HasSubstr("page_token \"not base64 !!\"")));
  EXPECT_THAT(bad(absl::WebSafeBase64Escape("seq-1")),
              StatusIs(C::kInvalidArgument, HasSubstr("page_token")));
  // Another list's token.
  EXPECT_THAT(
      bad(tenants->next_page_token),
      StatusIs(C::kInvalidArgument, HasSubstr("issued by ListTenants")));
  EXPECT_THAT(
      core_->ListWorkers(PageRequest{1, token}),
      StatusIs(C::kInvalidArgument, HasSubstr("issued by ListSequences")));
  // The same list with other filter fields.
  EXPECT_THAT(bad(token, "zeta"),
              StatusIs(C::kInvalidArgument, HasSubstr("page_token")));
  EXPECT_THAT(bad(token, "acme", true),
              StatusIs(C::kInvalidArgument, HasSubstr("other fields")));
  EXPECT_THAT(bad(token, ""),
              StatusIs(C::kInvalidArgument, HasSubstr("page_token")));
  // A trace token for another lineage.
  auto trace = core_->QueryTrace(1, PageRequest{1, ""});
  ASSERT_THAT(trace, IsOk());
  ASSERT_FALSE(trace->next_page_token.empty());
  EXPECT_THAT(core_->QueryTrace(2, PageRequest{1, trace->next_page_token}),
              StatusIs(C::kInvalidArgument, HasSubstr("lineage_id=1")));
  // The right one still works.
  EXPECT_THAT(bad(token), IsOk());
}

TEST_F(ListTest, WorkersTenantsAndPoliciesPage) {
  std::vector<std::string> tenants = {"acme"};
  for (int i = 0; i < 11; ++i) {
    const std::string id = absl::StrCat("t", i < 10 ? "0" : "", i);
    ASSERT_THAT(core_->CreateTenant({"", id, {}, ""}), IsOk());
    tenants.push_back(id);
  }
  std::sort(tenants.begin(), tenants.end());
  std::vector<std::string> got;
  PageRequest req{5, ""};
  do {
    auto page = core_->ListTenants(req);
    ASSERT_THAT(page, IsOk());
    EXPECT_LE(page->items.size(), 5u);
    for (const TenantInfo& t : page->items) got.push_back(t.tenant_id);
    req.page_token = page->next_page_token;
  } while (!req.page_token.empty());
  EXPECT_THAT(got, ElementsAreArray(tenants));

  std::vector<std::string> workers = {"w1"};
  for (const char* id : {"w0", "w3", "w2"}) {
    ASSERT_THAT(core_->RegisterWorker(
                    {"", id, absl::StrCat(id, ":1"), "cpu", 1ull << 30}),
                IsOk());
    workers.push_back(id);
  }
  std::sort(workers.begin(), workers.end());
  got.clear();
  req = {3, ""};
  do {
    auto page = core_->ListWorkers(req);
    ASSERT_THAT(page, IsOk());
    for (const WorkerInfo& w : page->items) got.push_back(w.worker_id);
    req.page_token = page->next_page_token;
  } while (!req.page_token.empty());
  EXPECT_THAT(got, ElementsAreArray(workers));

  // Policies: the built-ins in their order, then operator ones by name; a
  // page boundary falls inside each part and between them.
  for (const char* name : {"zz", "aa", "mm"}) {
    PolicyInfo p;
    p.name = name;
    PolicyRuleInfo rule;
    rule.encoding = EncodingSpec{Format::kTQ3, Format(0), 0, 0};
    p.rules = {rule};
    ASSERT_THAT(core_->PutPolicy(PutPolicyRequest{"", p}), IsOk());
  }
  std::vector<std::string> want;
  for (const PolicyInfo& p : core_->ListPolicies()) want.push_back(p.name);
  ASSERT_EQ(want.size(), BuiltinPolicies().size() + 3);
  EXPECT_EQ(want.back(), "zz");
  for (int32_t size : {1, 2, 4, static_cast<int32_t>(want.size())}) {
    got.clear();
    req = {size, ""};
    do {
      auto page = core_->ListPolicies(req);
      ASSERT_THAT(page, IsOk());
      for (const PolicyInfo& p : page->items) got.push_back(p.name);
      req.page_token = page->next_page_token;
    } while (!req.page_token.empty());
    EXPECT_THAT(got, ElementsAreArray(want)) << "page_size " << size;
  }
}

TEST_F(ListTest, TraceEventsPage) {
  // Four turns retag block 1 (CURRENT -> RECENT -> OLDER), then it is
  // released and freed.
  auto seq = Open({S(Role::kSystem, 16), S(Role::kUser, 16)});
  ASSERT_THAT(seq, IsOk());
  const uint64_t lineage = seq->blocks[1].lineage_id;
  for (int turn = 0; turn < 4; ++turn) {
    ASSERT_THAT(Extend(seq->sequence_id, {S(Role::kUser, 16)}, true), IsOk());
  }
  Close(seq->sequence_id);
  auto all = core_->QueryTrace(lineage);
  ASSERT_THAT(all, IsOk());
  ASSERT_GE(all->events.size(), 4u);
  std::vector<uint64_t> want;
  for (const Event& e : all->events) want.push_back(e.id);
  std::vector<uint64_t> got;
  PageRequest req{1, ""};
  do {
    auto page = core_->QueryTrace(lineage, req);
    ASSERT_THAT(page, IsOk());
    EXPECT_EQ(page->block.lineage_id, lineage);
    EXPECT_EQ(page->sequence_id, seq->sequence_id);
    EXPECT_LE(page->events.size(), 1u);
    for (const Event& e : page->events) got.push_back(e.id);
    req.page_token = page->next_page_token;
  } while (!req.page_token.empty());
  EXPECT_THAT(got, ElementsAreArray(want));
}

TEST_F(ListTest, LostSequencesLeaveTheOpenListAndComeBackWhenRecovered) {
  RegisterWorkerRequest reg{"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40};
  reg.incarnation = "boot-1";
  ASSERT_THAT(core_->RegisterWorker(reg), IsOk());
  for (int i = 0; i < 4; ++i) OpenOne();
  // w1 silent past worker_down_timeout_ms: every sequence LOST.
  clock_.AdvanceMs(3001);
  core_->CheckWorkers();
  clock_.AdvanceMs(30000);
  ASSERT_EQ(core_->CheckWorkers().size(), 1u);
  EXPECT_TRUE(WalkSequences(core_.get(), "", false, 2).empty());
  EXPECT_TRUE(WalkSequences(core_.get(), "acme", false, 2).empty());
  EXPECT_THAT(WalkSequences(core_.get(), "", true, 3),
              ElementsAreArray(Seqs({1, 2, 3, 4})));
  // The same incarnation returns holding seq-2 and seq-4: those are open
  // again (and listed as open), the others stay lost.
  reg.inventory.sequence_ids = {"seq-2", "seq-4"};
  ASSERT_THAT(core_->RegisterWorker(reg), IsOk());
  EXPECT_THAT(WalkSequences(core_.get(), "", false, 1),
              ElementsAreArray(Seqs({2, 4})));
  EXPECT_THAT(WalkSequences(core_.get(), "acme", false, 1),
              ElementsAreArray(Seqs({2, 4})));
  EXPECT_THAT(WalkSequences(core_.get(), "acme", true, 10),
              ElementsAreArray(Seqs({1, 2, 3, 4})));
}

TEST_F(ListTest, ClosedRetentionForgetsTheOldestClosedSequences) {
  ManagerOptions options;
  options.closed_retention = 2;
  Make(options);
  for (int i = 0; i < 5; ++i) OpenOne();
  Close("seq-1");
  Close("seq-3");
  Close("seq-4");
  // seq-1 was the oldest of three closed: past closed_retention 2.
  EXPECT_THAT(core_->GetSequence("", "seq-1"),
              StatusIs(C::kNotFound, HasSubstr("seq-1")));
  EXPECT_THAT(core_->GetSequence("", "seq-3"), IsOk());
  EXPECT_THAT(WalkSequences(core_.get(), "", true, 2),
              ElementsAreArray(Seqs({2, 3, 4, 5})));
  EXPECT_THAT(WalkSequences(core_.get(), "acme", true, 1),
              ElementsAreArray(Seqs({2, 3, 4, 5})));
  EXPECT_THAT(WalkSequences(core_.get(), "", false, 2),
              ElementsAreArray(Seqs({2, 5})));
  // closed_retention 0: a sequence is forgotten as it closes.
  options.closed_retention = 0;
  Make(options);
  OpenOne();
  Close("seq-1");
  EXPECT_THAT(core_->GetSequence("", "seq-1"),
              StatusIs(C::kNotFound, HasSubstr("seq-1")));
  EXPECT_TRUE(WalkSequences(core_.get(), "", true, 2).empty());
}

}  // namespace
}  // namespace triax::manager
