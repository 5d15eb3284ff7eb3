#include "kvmanager/token_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::triax::testing::IsOk;
using ::triax::testing::IsOkAndHolds;
using ::triax::testing::StatusIs;

TEST(TokenStoreTest, IssuedTokensVerifyToTheirPrincipalAndKeepNoSecret) {
  auto t = MakeToken(TokenRole::kTenant, "acme", "ci", 1000, 0);
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT(t->token, ::testing::StartsWith("tkv1." + t->record.id + "."));
  EXPECT_EQ(t->record.id.size(), 16u);
  EXPECT_EQ(t->token.size(), 5u + 16 + 1 + 43);
  EXPECT_EQ(t->record.sha256.size(), 32u);
  // The record holds no part of the secret.
  const std::string secret = t->token.substr(22);
  EXPECT_THAT(t->record.sha256, Not(HasSubstr(secret.substr(0, 8))));
  TokenStore store;
  store.Put(t->record);
  auto p = store.Verify(t->token, 2000);
  ASSERT_THAT(p, IsOk());
  EXPECT_EQ(p->role, TokenRole::kTenant);
  EXPECT_EQ(p->tenant_id, "acme");
  EXPECT_EQ(p->token_id, t->record.id);
  // Two tokens never share an id or a secret.
  auto u = MakeToken(TokenRole::kTenant, "acme", "", 1000, 0);
  ASSERT_THAT(u, IsOk());
  EXPECT_NE(u->record.id, t->record.id);
  EXPECT_NE(u->token.substr(22), secret);
}

TEST(TokenStoreTest, ForgedMalformedUnknownExpiredAndRevokedAreRefused) {
  auto t = MakeToken(TokenRole::kAdmin, "", "", 1000, 10);
  ASSERT_THAT(t, IsOk());
  TokenStore store;
  store.Put(t->record);
  std::string forged = t->token;
  forged.back() = forged.back() == 'A' ? 'B' : 'A';
  EXPECT_THAT(store.Verify(forged, 2000),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("the secret does not match")));
  for (const std::string bad :
       {std::string(""), std::string("tkv1"), std::string("tkv2.a.b"),
        "tkv1." + t->record.id, "tkv1.ABCDEF0123456789." + std::string(43, 'a'),
        "tkv1." + t->record.id + "." + std::string(42, 'a'),
        "tkv1." + t->record.id + "." + std::string(42, 'a') + "="}) {
    EXPECT_THAT(store.Verify(bad, 2000),
                StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_))
        << bad;
  }
  auto other = MakeToken(TokenRole::kAdmin, "", "", 1000, 0);
  ASSERT_THAT(other, IsOk());
  EXPECT_THAT(store.Verify(other->token, 2000),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       HasSubstr("unknown or revoked")));
  EXPECT_THAT(store.Verify(t->token, 10999), IsOk());
  EXPECT_THAT(
      store.Verify(t->token, 11000),
      StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("expired")));
  EXPECT_TRUE(store.Remove(t->record.id));
  EXPECT_FALSE(store.Remove(t->record.id));
  EXPECT_THAT(store.Verify(t->token, 2000),
              StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
}

TEST(TokenStoreTest, RolesAndTenantsMustAgree) {
  EXPECT_THAT(MakeToken(TokenRole::kTenant, "", "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tenant_id is empty")));
  EXPECT_THAT(MakeToken(TokenRole::kWorker, "acme", "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("only tenant tokens name a tenant")));
  EXPECT_THAT(ParseRole("root"), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("role=\"root\"")));
  EXPECT_THAT(ParseRole("worker"), IsOkAndHolds(TokenRole::kWorker));
}

TEST(TokenStoreTest, TheBootstrapTokenVerifiesButIsNeitherListedNorRevoked) {
  auto admin = MakeToken(TokenRole::kAdmin, "", "", 0, 0);
  auto tenant = MakeToken(TokenRole::kTenant, "acme", "", 0, 0);
  ASSERT_THAT(admin, IsOk());
  ASSERT_THAT(tenant, IsOk());
  TokenStore store;
  ASSERT_THAT(store.AddBootstrap(admin->token), IsOk());
  store.Put(tenant->record);
  EXPECT_THAT(store.Verify(admin->token, 1), IsOk());
  ASSERT_EQ(store.List().size(), 1u);
  EXPECT_EQ(store.List()[0].id, tenant->record.id);
  EXPECT_EQ(store.size(), 1u);
  EXPECT_FALSE(store.Find(admin->record.id).has_value());
  EXPECT_FALSE(store.Remove(admin->record.id));
  EXPECT_THAT(store.Verify(admin->token, 1), IsOk());
  EXPECT_THAT(store.AddBootstrap("garbage"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST(TokenStoreTest, AdminTokenFileIsCreatedPrivateAndReadBack) {
  char dir[] = "/tmp/token-store-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/admin.token";
  bool created = false;
  auto first = ReadOrCreateAdminToken(path, 0, &created);
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(created);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto again = ReadOrCreateAdminToken(path, 0, &created);
  ASSERT_THAT(again, IsOk());
  EXPECT_FALSE(created);
  EXPECT_EQ(*again, *first);
  chmod(path.c_str(), 0440);  // a Secret mounted for the pod's fsGroup
  EXPECT_THAT(ReadOrCreateAdminToken(path, 0, &created), IsOk());
  for (mode_t bad : {0644, 0604, 0660}) {
    chmod(path.c_str(), bad);
    EXPECT_THAT(
        ReadOrCreateAdminToken(path, 0, &created),
        StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("chmod 600")))
        << bad;
  }
  chmod(path.c_str(), 0600);
  std::ofstream(path) << "not a token\n";
  EXPECT_THAT(ReadOrCreateAdminToken(path, 0, &created),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(path)));
  EXPECT_THAT(
      ReadOrCreateAdminToken(std::string(dir) + "/no/such/dir", 0, &created),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("cannot create")));
  unlink(path.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace triax::manager
