// LoadTls's checks of the flags and files (the certificates themselves are
// exercised by tests/integration/tls_test.cc, which makes them with
// openssl), and the identity match of CheckPeerIdentity.
#include "common/tls.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "common/status_matchers.h"

namespace triax {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

TEST(LoadTlsTest, NothingSetIsPlaintext) {
  auto config = LoadTls({});
  ASSERT_THAT(config, IsOk());
  EXPECT_FALSE(config->server_enabled());
  EXPECT_FALSE(config->client_enabled());
}

TEST(LoadTlsTest, ACertWithoutItsKeyNamesBothFlags) {
  TlsOptions o;
  o.cert_file = "/etc/x.crt";
  EXPECT_THAT(LoadTls(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                   AllOf(HasSubstr("--tls_cert=/etc/x.crt"),
                                         HasSubstr("needs --tls_key"))));
  o.cert_file.clear();
  o.key_file = "/etc/x.key";
  EXPECT_THAT(LoadTls(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("--tls_key=/etc/x.key needs "
                                             "--tls_cert")));
}

TEST(LoadTlsTest, RequiredClientCertificatesNeedACa) {
  TlsOptions o;
  o.require_client_cert = true;
  EXPECT_THAT(LoadTls(o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls_require_client_cert needs --tls_ca")));
}

TEST(LoadTlsTest, UnreadableAndNonPemFilesNameTheFlagAndPath) {
  TlsOptions o;
  o.ca_file = "/nonexistent/ca.crt";
  EXPECT_THAT(LoadTls(o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls_ca=/nonexistent/ca.crt: cannot read "
                                 "the file")));
  const std::string path =
      ::testing::TempDir() + "/tls_test_not_pem_" + std::to_string(getpid());
  {
    std::ofstream f(path);
    f << "not a certificate\n";
  }
  o.ca_file = path;
  EXPECT_THAT(LoadTls(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("--tls_ca=" + path +
                                             ": holds no PEM certificate")));
  o.ca_file.clear();
  o.cert_file = path;
  o.key_file = path;
  EXPECT_THAT(LoadTls(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("--tls_cert=" + path +
                                             ": holds no PEM certificate")));
  std::remove(path.c_str());
}

TEST(IdentityMatchesTest, ExactNamesAndPrefixes) {
  const std::vector<std::string> names = {"kvworker", "gpu-*"};
  EXPECT_TRUE(IdentityMatches("kvworker", names));
  EXPECT_TRUE(IdentityMatches("gpu-7", names));
  EXPECT_TRUE(IdentityMatches("gpu-", names));
  EXPECT_FALSE(IdentityMatches("kvworker2", names));
  EXPECT_FALSE(IdentityMatches("frontend", names));
  EXPECT_FALSE(IdentityMatches("", names));
  EXPECT_TRUE(IdentityMatches("anyone", {"*"}));
  EXPECT_FALSE(IdentityMatches("", {"*"}));
}

}  // namespace
}  // namespace triax
