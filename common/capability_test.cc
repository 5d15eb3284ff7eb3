#include "common/capability.h"

#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using Scope = v1::Capability;

int64_t g_now = 1000;
int64_t Now() { return g_now; }

class CapabilityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_now = 1000;
    key_ = *NewCapabilityKey();
    verifier_.Require();
    verifier_.SetWorkerId("w0");
    verifier_.SetKey(key_);
  }

  v1::Capability Cap(const std::string& tenant, const std::string& seq,
                     v1::Capability::Scope scope, uint64_t max_tokens = 0,
                     const std::string& worker = "w0") {
    v1::Capability c;
    c.set_tenant_id(tenant);
    c.set_sequence_id(seq);
    c.set_worker_id(worker);
    c.set_expires_unix_ms(5000);
    c.set_scope(scope);
    c.set_max_tokens(max_tokens);
    SignCapability(key_, &c);
    return c;
  }

  absl::Status Check(std::vector<v1::Capability> caps,
                     std::vector<CapabilityNeed> needs) {
    return verifier_.CheckPresented(std::move(caps), "ReadKV", needs);
  }

  std::string key_;
  CapabilityVerifier verifier_{&Now};
};

TEST_F(CapabilityTest, ASignedCapabilityAllowsItsSequenceOnly) {
  const v1::Capability a = Cap("acme", "seq-1", Scope::SCOPE_CLIENT, 64);
  EXPECT_THAT(Check({a}, {{"acme", "seq-1", Scope::SCOPE_CLIENT}}), IsOk());
  EXPECT_THAT(
      Check({a}, {{"acme", "seq-2", Scope::SCOPE_CLIENT}}),
      StatusIs(
          absl::StatusCode::kPermissionDenied,
          HasSubstr("no capability of this call names sequence_id=\"seq-2\"")));
  EXPECT_THAT(Check({a}, {{"beta", "seq-1", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("beta")));
  EXPECT_THAT(Check({}, {{"acme", "seq-1", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("no capability for sequence_id=\"seq-1\"")));
  // Every need of a call must be covered (an Attend over two sequences).
  EXPECT_THAT(
      Check({a}, {{"acme", "seq-1", Scope::SCOPE_CLIENT},
                  {"acme", "seq-2", Scope::SCOPE_CLIENT}}),
      StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("seq-2")));
}

TEST_F(CapabilityTest, TamperedForeignAndExpiredCapabilitiesDoNotVerify) {
  v1::Capability t = Cap("acme", "seq-1", Scope::SCOPE_CLIENT, 64);
  t.set_tenant_id("beta");
  EXPECT_THAT(Check({t}, {{"beta", "seq-1", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("signature does not verify")));
  for (int field = 0; field < 5; ++field) {
    v1::Capability c = Cap("acme", "seq-1", Scope::SCOPE_CLIENT, 64);
    switch (field) {
      case 0:
        c.set_sequence_id("seq-2");
        break;
      case 1:
        c.set_expires_unix_ms(c.expires_unix_ms() + 1);
        break;
      case 2:
        c.set_scope(Scope::SCOPE_MANAGER);
        break;
      case 3:
        c.set_max_tokens(65);
        break;
      case 4:
        c.set_worker_id("w1");
        break;
    }
    EXPECT_THAT(Check({c}, {{"acme", c.sequence_id(), Scope::SCOPE_CLIENT}}),
                StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_))
        << field;
  }
  // Signed with another key (another cluster's manager).
  v1::Capability other = Cap("acme", "seq-1", Scope::SCOPE_CLIENT);
  SignCapability(*NewCapabilityKey(), &other);
  EXPECT_THAT(Check({other}, {{"acme", "seq-1", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  // For another worker.
  EXPECT_THAT(Check({Cap("acme", "seq-1", Scope::SCOPE_CLIENT, 0, "w1")},
                    {{"acme", "seq-1", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("for worker \"w1\", not this one")));
  // Expired.
  const v1::Capability a = Cap("acme", "seq-1", Scope::SCOPE_CLIENT);
  g_now = 4999;
  EXPECT_THAT(Check({a}, {{"acme", "seq-1", Scope::SCOPE_CLIENT}}), IsOk());
  g_now = 5000;
  EXPECT_THAT(
      Check({a}, {{"acme", "seq-1", Scope::SCOPE_CLIENT}}),
      StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("expired")));
}

TEST_F(CapabilityTest, ScopesAndPlannedTokensBoundWhatACapabilityAllows) {
  const v1::Capability client = Cap("acme", "s", Scope::SCOPE_CLIENT, 64);
  const v1::Capability fork = Cap("acme", "s", Scope::SCOPE_FORK);
  const v1::Capability manager = Cap("acme", "s", Scope::SCOPE_MANAGER);
  EXPECT_THAT(
      Check({client}, {{"acme", "s", Scope::SCOPE_MANAGER}}),
      StatusIs(absl::StatusCode::kPermissionDenied,
               HasSubstr("client capability for sequence_id=\"s\" of "
                         "tenant_id=\"acme\" does not allow a manager")));
  EXPECT_THAT(Check({fork}, {{"acme", "s", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  EXPECT_THAT(Check({fork}, {{"acme", "s", Scope::SCOPE_FORK}}), IsOk());
  EXPECT_THAT(Check({client}, {{"acme", "s", Scope::SCOPE_FORK}}), IsOk());
  EXPECT_THAT(Check({manager}, {{"acme", "s", Scope::SCOPE_CLIENT}}), IsOk());
  EXPECT_THAT(Check({client}, {{"acme", "s", Scope::SCOPE_CLIENT, 64}}),
              IsOk());
  EXPECT_THAT(Check({client}, {{"acme", "s", Scope::SCOPE_CLIENT, 65}}),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("65 tokens exceed the 64")));
  // A worker-wide manager capability covers every sequence; a sequence's
  // does not cover worker-wide calls.
  const v1::Capability wide = Cap("", "", Scope::SCOPE_MANAGER);
  EXPECT_THAT(Check({wide}, {{"x", "y", Scope::SCOPE_MANAGER},
                             {"", "", Scope::SCOPE_MANAGER}}),
              IsOk());
  EXPECT_THAT(Check({manager}, {{"", "", Scope::SCOPE_MANAGER}}),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
  CapabilityNeed any{"", "", Scope::SCOPE_MANAGER};
  any.any_sequence = true;
  EXPECT_THAT(Check({manager}, {any}), IsOk());
  EXPECT_THAT(Check({client}, {any}),
              StatusIs(absl::StatusCode::kPermissionDenied, ::testing::_));
}

TEST_F(CapabilityTest, KeysRotateWithAGraceForThePreviousOne) {
  const v1::Capability old = Cap("acme", "s", Scope::SCOPE_CLIENT);
  const std::string first = key_;
  key_ = *NewCapabilityKey();
  verifier_.SetKey(key_);
  EXPECT_THAT(Check({old}, {{"acme", "s", Scope::SCOPE_CLIENT}}), IsOk());
  verifier_.SetKey(*NewCapabilityKey());  // two changes: the first is gone
  EXPECT_THAT(Check({old}, {{"acme", "s", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
}

TEST(CapabilityVerifierTest, OffAcceptsAndRequiredWithoutAKeyIsUnavailable) {
  CapabilityVerifier v(&Now);
  EXPECT_THAT(v.CheckPresented({}, "ReadKV", {{"a", "s", Scope::SCOPE_CLIENT}}),
              IsOk());
  v.Require();
  EXPECT_THAT(v.CheckPresented({}, "ReadKV", {{"a", "s", Scope::SCOPE_CLIENT}}),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("no capability key yet")));
}

}  // namespace
}  // namespace triax
