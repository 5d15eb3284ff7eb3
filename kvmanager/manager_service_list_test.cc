// Paging over gRPC (docs/manager.md "Paging"): the List RPCs and QueryTrace
// answer pages and next_page_token, a request without page fields gets the
// first (default-sized) page, and bad page fields are INVALID_ARGUMENT
// naming the field.
#include <functional>
#include <string>
#include <vector>

#include "kvmanager/manager_service_test_util.h"

namespace triax::manager {
namespace {

using C = grpc::StatusCode;

// Exposes the fixture's Call to the helper below.
class ListServiceTest : public ServiceTest {
 public:
  template <typename Req, typename Resp>
  grpc::Status CallPublic(grpc::Status (v1::Manager::Stub::*method)(
                              grpc::ClientContext*, const Req&, Resp*),
                          const Req& req, Resp* resp) {
    return Call(method, req, resp);
  }
};

// Every page of `req` through `method`, each page's size into *sizes;
// `items` reads a page's ids.
template <typename Req, typename Resp>
std::vector<std::string> WalkL(
    ListServiceTest* t,
    grpc::Status (v1::Manager::Stub::*method)(grpc::ClientContext*, const Req&,
                                              Resp*),
    Req req, const std::function<std::vector<std::string>(const Resp&)>& items,
    std::vector<size_t>* sizes) {
  std::vector<std::string> out;
  for (int guard = 0; guard < 1000; ++guard) {
    Resp resp;
    grpc::Status s = t->CallPublic(method, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (!s.ok()) break;
    const std::vector<std::string> page = items(resp);
    sizes->push_back(page.size());
    out.insert(out.end(), page.begin(), page.end());
    if (resp.next_page_token().empty()) break;
    req.set_page_token(resp.next_page_token());
  }
  return out;
}

std::vector<std::string> SeqIds(const v1::ListSequencesResponse& r) {
  std::vector<std::string> out;
  for (const auto& s : r.sequences()) out.push_back(s.sequence_id());
  return out;
}

TEST_F(ListServiceTest, SequencesPageAndOldRequestsGetTheFirstPage) {
  std::vector<std::string> want;
  for (int i = 0; i < 7; ++i) want.push_back(Open("acme"));
  Open("other");
  v1::ListSequencesRequest req;
  req.set_tenant_id("acme");
  req.set_page_size(3);
  std::vector<size_t> sizes;
  EXPECT_EQ((WalkL<v1::ListSequencesRequest, v1::ListSequencesResponse>(
                this, &v1::Manager::Stub::ListSequences, req, SeqIds, &sizes)),
            want);
  EXPECT_EQ(sizes, (std::vector<size_t>{3, 3, 1}));
  // No page fields (a client from before paging): the first page of the
  // default size, here everything, and no token.
  v1::ListSequencesRequest old;
  old.set_tenant_id("acme");
  v1::ListSequencesResponse resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::ListSequences, old, &resp).ok());
  EXPECT_EQ(SeqIds(resp), want);
  EXPECT_TRUE(resp.next_page_token().empty());
}

TEST_F(ListServiceTest, BadPageFieldsAreInvalidArgumentNamingTheField) {
  Open("acme");
  Open("acme");
  v1::ListSequencesRequest req;
  req.set_page_size(-2);
  v1::ListSequencesResponse resp;
  grpc::Status s = Call(&v1::Manager::Stub::ListSequences, req, &resp);
  EXPECT_EQ(s.error_code(), C::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("page_size -2"));

  req.set_page_size(1);
  ASSERT_TRUE(Call(&v1::Manager::Stub::ListSequences, req, &resp).ok());
  ASSERT_FALSE(resp.next_page_token().empty());
  const std::string token = resp.next_page_token();

  req.set_page_token("garbage");
  s = Call(&v1::Manager::Stub::ListSequences, req, &resp);
  EXPECT_EQ(s.error_code(), C::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("page_token \"garbage\""));

  // The token with another filter, and with another RPC.
  req.set_page_token(token);
  req.set_tenant_id("acme");
  s = Call(&v1::Manager::Stub::ListSequences, req, &resp);
  EXPECT_EQ(s.error_code(), C::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("page_token"));
  v1::ListTenantsRequest lt;
  lt.set_page_token(token);
  v1::ListTenantsResponse lt_resp;
  s = Call(&v1::Manager::Stub::ListTenants, lt, &lt_resp);
  EXPECT_EQ(s.error_code(), C::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("issued by ListSequences"));
}

TEST_F(ListServiceTest, WorkersTenantsPoliciesAndTracePage) {
  std::vector<size_t> sizes;
  v1::ListTenantsRequest lt;
  lt.set_page_size(1);
  EXPECT_EQ((WalkL<v1::ListTenantsRequest, v1::ListTenantsResponse>(
                this, &v1::Manager::Stub::ListTenants, lt,
                [](const v1::ListTenantsResponse& r) {
                  std::vector<std::string> out;
                  for (const auto& t : r.tenants())
                    out.push_back(t.tenant_id());
                  return out;
                },
                &sizes)),
            (std::vector<std::string>{"acme", "other"}));

  v1::RegisterWorkerRequest reg;
  reg.set_worker_id("w0");
  reg.set_address("127.0.0.1:9000");
  reg.set_backend("cpu");
  reg.set_capacity_bytes(1 << 30);
  v1::RegisterWorkerResponse reg_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, reg, &reg_resp).ok());
  v1::ListWorkersRequest lw;
  lw.set_page_size(1);
  sizes.clear();
  EXPECT_EQ((WalkL<v1::ListWorkersRequest, v1::ListWorkersResponse>(
                this, &v1::Manager::Stub::ListWorkers, lw,
                [](const v1::ListWorkersResponse& r) {
                  std::vector<std::string> out;
                  for (const auto& w : r.workers())
                    out.push_back(w.worker_id());
                  return out;
                },
                &sizes)),
            (std::vector<std::string>{"w0", "w1"}));
  EXPECT_EQ(sizes, (std::vector<size_t>{1, 1}));

  v1::PutPolicyResponse put_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutPolicy, PolicyReq(), &put_resp).ok());
  v1::ListPoliciesResponse all;
  ASSERT_TRUE(
      Call(&v1::Manager::Stub::ListPolicies, v1::ListPoliciesRequest(), &all)
          .ok());
  std::vector<std::string> want;
  for (const auto& p : all.policies()) want.push_back(p.name());
  EXPECT_EQ(want.back(), "mixed");
  v1::ListPoliciesRequest lp;
  lp.set_page_size(2);
  sizes.clear();
  EXPECT_EQ((WalkL<v1::ListPoliciesRequest, v1::ListPoliciesResponse>(
                this, &v1::Manager::Stub::ListPolicies, lp,
                [](const v1::ListPoliciesResponse& r) {
                  std::vector<std::string> out;
                  for (const auto& p : r.policies()) out.push_back(p.name());
                  return out;
                },
                &sizes)),
            want);
  EXPECT_EQ(sizes.size(), (want.size() + 1) / 2);

  // A closed sequence's first block: created, released, freed.
  const std::string seq = Open("acme");
  v1::CloseSequenceRequest close;
  close.set_tenant_id("acme");
  close.set_sequence_id(seq);
  v1::CloseSequenceResponse close_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &close_resp).ok());
  ASSERT_GT(close_resp.freed_lineage_ids_size(), 0);
  const uint64_t lineage = close_resp.freed_lineage_ids(0);
  v1::QueryTraceRequest qt;
  qt.set_lineage_id(lineage);
  v1::QueryTraceResponse whole;
  ASSERT_TRUE(Call(&v1::Manager::Stub::QueryTrace, qt, &whole).ok());
  ASSERT_GE(whole.events_size(), 2);
  qt.set_page_size(1);
  std::vector<uint64_t> got;
  for (int guard = 0; guard < 100; ++guard) {
    v1::QueryTraceResponse page;
    ASSERT_TRUE(Call(&v1::Manager::Stub::QueryTrace, qt, &page).ok());
    EXPECT_EQ(page.block().lineage_id(), lineage);
    EXPECT_EQ(page.sequence_id(), seq);
    for (const auto& e : page.events()) got.push_back(e.id());
    if (page.next_page_token().empty()) break;
    qt.set_page_token(page.next_page_token());
  }
  std::vector<uint64_t> want_ids;
  for (const auto& e : whole.events()) want_ids.push_back(e.id());
  EXPECT_EQ(got, want_ids);
}

}  // namespace
}  // namespace triax::manager
