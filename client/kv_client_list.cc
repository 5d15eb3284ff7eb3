// Client's operator lists: the walk over the manager's pages
// (docs/manager.md "Paging").
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/kv_client.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::client {

template <typename Req, typename Resp>
absl::StatusOr<Resp> Client::AllPages(
    absl::string_view what, Req req,
    const std::function<grpc::Status(grpc::ClientContext*, const Req&, Resp*)>&
        page,
    const std::function<void(Resp*, Resp*)>& append) {
  if (req.page_size() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": page_size ", req.page_size(), " is negative; 0: the default"));
  }
  Resp all;
  while (true) {
    Resp one;
    TRIAX_RETURN_IF_ERROR(
        CallWithRetry(what, /*retry=*/true, [&](grpc::ClientContext* ctx) {
          one.Clear();
          return page(ctx, req, &one);
        }));
    const std::string next = one.next_page_token();
    append(&one, &all);
    if (next.empty()) break;
    // A manager that answers the token it was given would loop forever.
    if (next == req.page_token()) {
      return absl::InternalError(
          absl::StrCat(what, ": the manager answered page_token ", Quote(next),
                       " with the same next_page_token"));
    }
    req.set_page_token(next);
  }
  all.clear_next_page_token();
  return all;
}

absl::StatusOr<triax::v1::ListWorkersResponse> Client::ListWorkers(
    int32_t page_size) {
  triax::v1::ListWorkersRequest req;
  req.set_page_size(page_size);
  return AllPages<triax::v1::ListWorkersRequest,
                  triax::v1::ListWorkersResponse>(
      "ListWorkers", req,
      [this](grpc::ClientContext* ctx, const triax::v1::ListWorkersRequest& r,
             triax::v1::ListWorkersResponse* out) {
        return manager_stub()->ListWorkers(ctx, r, out);
      },
      [](triax::v1::ListWorkersResponse* one,
         triax::v1::ListWorkersResponse* all) {
        for (auto& w : *one->mutable_workers())
          *all->add_workers() = std::move(w);
      });
}

absl::StatusOr<triax::v1::ListTenantsResponse> Client::ListTenants(
    int32_t page_size) {
  triax::v1::ListTenantsRequest req;
  req.set_page_size(page_size);
  return AllPages<triax::v1::ListTenantsRequest,
                  triax::v1::ListTenantsResponse>(
      "ListTenants", req,
      [this](grpc::ClientContext* ctx, const triax::v1::ListTenantsRequest& r,
             triax::v1::ListTenantsResponse* out) {
        return manager_stub()->ListTenants(ctx, r, out);
      },
      [](triax::v1::ListTenantsResponse* one,
         triax::v1::ListTenantsResponse* all) {
        for (auto& t : *one->mutable_tenants())
          *all->add_tenants() = std::move(t);
      });
}

absl::StatusOr<triax::v1::ListSequencesResponse> Client::ListSequences(
    const std::string& tenant_id, bool include_closed, int32_t page_size) {
  triax::v1::ListSequencesRequest req;
  req.set_tenant_id(tenant_id);
  req.set_include_closed(include_closed);
  req.set_page_size(page_size);
  return AllPages<triax::v1::ListSequencesRequest,
                  triax::v1::ListSequencesResponse>(
      "ListSequences", req,
      [this](grpc::ClientContext* ctx, const triax::v1::ListSequencesRequest& r,
             triax::v1::ListSequencesResponse* out) {
        return manager_stub()->ListSequences(ctx, r, out);
      },
      [](triax::v1::ListSequencesResponse* one,
         triax::v1::ListSequencesResponse* all) {
        for (auto& s : *one->mutable_sequences()) {
          *all->add_sequences() = std::move(s);
        }
      });
}

absl::StatusOr<triax::v1::ListPoliciesResponse> Client::ListPolicies(
    int32_t page_size) {
  triax::v1::ListPoliciesRequest req;
  req.set_page_size(page_size);
  return AllPages<triax::v1::ListPoliciesRequest,
                  triax::v1::ListPoliciesResponse>(
      "ListPolicies", req,
      [this](grpc::ClientContext* ctx, const triax::v1::ListPoliciesRequest& r,
             triax::v1::ListPoliciesResponse* out) {
        return manager_stub()->ListPolicies(ctx, r, out);
      },
      [](triax::v1::ListPoliciesResponse* one,
         triax::v1::ListPoliciesResponse* all) {
        for (auto& p : *one->mutable_policies()) {
          *all->add_policies() = std::move(p);
        }
      });
}

absl::StatusOr<triax::v1::QueryTraceResponse> Client::QueryTrace(
    uint64_t lineage_id, int32_t page_size) {
  triax::v1::QueryTraceRequest req;
  req.set_lineage_id(lineage_id);
  req.set_page_size(page_size);
  return AllPages<triax::v1::QueryTraceRequest, triax::v1::QueryTraceResponse>(
      "QueryTrace", req,
      [this](grpc::ClientContext* ctx, const triax::v1::QueryTraceRequest& r,
             triax::v1::QueryTraceResponse* out) {
        return manager_stub()->QueryTrace(ctx, r, out);
      },
      [](triax::v1::QueryTraceResponse* one,
         triax::v1::QueryTraceResponse* all) {
        // The block as of the last page: the newest state.
        *all->mutable_block() = one->block();
        all->set_sequence_id(one->sequence_id());
        for (auto& e : *one->mutable_events())
          *all->add_events() = std::move(e);
      });
}

}  // namespace triax::client
