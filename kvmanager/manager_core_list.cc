// ManagerCore's paged lists (paging.h; docs/manager.md "Paging"): each page
// is read under mu_ from an ordered index of its part, so its cost is the
// page's, not the list's.
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

absl::StatusOr<Page<WorkerInfo>> ManagerCore::ListWorkers(
    const PageRequest& page) const {
  TRIAX_ASSIGN_OR_RETURN(const PageCursor cursor,
                         PageCursor::Start("ListWorkers", "", page));
  absl::MutexLock lock(&mu_);
  return workers_.ListPage(cursor);
}

absl::StatusOr<Page<TenantInfo>> ManagerCore::ListTenants(
    const PageRequest& page) const {
  TRIAX_ASSIGN_OR_RETURN(const PageCursor cursor,
                         PageCursor::Start("ListTenants", "", page));
  absl::MutexLock lock(&mu_);
  return tenants_.ListPage(cursor);
}

absl::StatusOr<Page<SequenceInfo>> ManagerCore::ListSequences(
    const std::string& tenant_id, bool include_closed,
    const PageRequest& page) const {
  // The filter fields are part of the token: a page of one tenant's list
  // cannot continue another's.
  TRIAX_ASSIGN_OR_RETURN(
      const PageCursor cursor,
      PageCursor::Start(
          "ListSequences",
          absl::StrCat("tenant_id=", tenant_id,
                       " include_closed=", include_closed ? "true" : "false"),
          page));
  absl::MutexLock lock(&mu_);
  const TenantRecord* tenant = nullptr;
  if (!tenant_id.empty()) {
    TRIAX_ASSIGN_OR_RETURN(tenant, tenants_.Find(tenant_id));
  }
  return sequences_.ListPage(tenant, include_closed, cursor);
}

absl::StatusOr<Page<PolicyInfo>> ManagerCore::ListPolicies(
    const PageRequest& page) const {
  TRIAX_ASSIGN_OR_RETURN(const PageCursor cursor,
                         PageCursor::Start("ListPolicies", "", page));
  // Built-in policies first, in their fixed order, then operator policies
  // by name; the key is the last name returned. Operator policies cannot
  // take a built-in name, so the name alone says which part it was in.
  const auto& builtins = BuiltinPolicies();
  size_t next_builtin = 0;
  const std::string* after_operator = nullptr;
  if (cursor.after()) {
    next_builtin = builtins.size();
    after_operator = &*cursor.after();
    for (size_t i = 0; i < builtins.size(); ++i) {
      if (builtins[i]->name == *cursor.after()) {
        next_builtin = i + 1;
        after_operator = nullptr;
        break;
      }
    }
  }
  Page<PolicyInfo> out;
  for (; next_builtin < builtins.size() && out.items.size() < cursor.size();
       ++next_builtin) {
    out.items.push_back(builtins[next_builtin]->Info());
  }
  bool more = next_builtin < builtins.size();
  if (!more) {
    absl::MutexLock lock(&mu_);
    std::vector<PolicyInfo> ops = policies_.ListOperator(
        after_operator, cursor.size() - out.items.size(), &more);
    out.items.insert(out.items.end(), ops.begin(), ops.end());
  }
  if (more) out.next_page_token = cursor.NextToken(out.items.back().name);
  return out;
}

absl::StatusOr<TraceResult> ManagerCore::QueryTrace(
    uint64_t lineage_id, const PageRequest& page) const {
  if (lineage_id == 0) {
    return absl::InvalidArgumentError(
        "lineage_id is 0; lineage ids start at 1");
  }
  TRIAX_ASSIGN_OR_RETURN(
      const PageCursor cursor,
      PageCursor::Start("QueryTrace", absl::StrCat("lineage_id=", lineage_id),
                        page));
  uint64_t after_id = 0;
  if (cursor.after() && !absl::SimpleAtoi(*cursor.after(), &after_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token ", Quote(page.page_token),
                     " is not a page token of QueryTrace (its key ",
                     Quote(*cursor.after()), " is not an event id)"));
  }
  TraceResult result;
  bool found = false;
  {
    absl::MutexLock lock(&mu_);
    if (const BlockRecord* b = sequences_.FindBlock(lineage_id)) {
      result.block = PlanOf(*b);
      result.sequence_id = b->creator;
      found = true;
    }
  }
  if (!found) {
    auto last = events_.FindLastPlan(lineage_id);
    if (!last) {
      return absl::NotFoundError(
          absl::StrCat("lineage_id ", lineage_id,
                       " is neither live nor in retained events"));
    }
    result.block = last->plan;
    result.sequence_id = last->creator;
  }
  bool more = false;
  result.events =
      events_.EventsForLineage(lineage_id, after_id, cursor.size(), &more);
  if (more) {
    result.next_page_token =
        cursor.NextToken(absl::StrCat(result.events.back().id));
  }
  return result;
}

}  // namespace triax::manager
