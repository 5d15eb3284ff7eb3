// gMock matchers for absl::Status / StatusOr (absent from Abseil 20220623).
#pragma once

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace triax::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

// EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, HasSubstr("tenant_id")))
MATCHER_P2(StatusIs, code, message_matcher, "") {
  const absl::Status& s = GetStatus(arg);
  if (s.code() != code) {
    *result_listener << "status is " << s;
    return false;
  }
  return ::testing::ExplainMatchResult(
      message_matcher, std::string(s.message()), result_listener);
}

MATCHER(IsOk, "") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

// EXPECT_THAT(statusor, IsOkAndHolds(ElementsAre(1, 2)))
MATCHER_P(IsOkAndHolds, value_matcher, "") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace triax::testing
