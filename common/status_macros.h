// Status helpers missing from Abseil 20220623.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TRIAX_STATUS_CONCAT_INNER(a, b) a##b
#define TRIAX_STATUS_CONCAT(a, b) TRIAX_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define TRIAX_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status _triax_status = (expr);         \
    if (!_triax_status.ok()) return _triax_status; \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status.
#define TRIAX_ASSIGN_OR_RETURN(lhs, rexpr)                                     \
  TRIAX_ASSIGN_OR_RETURN_IMPL(TRIAX_STATUS_CONCAT(_triax_sor_, __LINE__), lhs, \
                              rexpr)
// `tmp` is a generated name and `lhs` may be a declaration ("auto x"), so
// neither can be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define TRIAX_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)
