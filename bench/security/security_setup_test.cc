#include "bench/security/security_setup.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax::bench {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

TEST(ParseSecurityListTest, ReadsEveryPartInOrder) {
  auto configs =
      ParseSecurityList("plain,tls,mtls,token,tls+token,token+mtls", "--s");
  ASSERT_THAT(configs, IsOk());
  ASSERT_EQ(configs->size(), 6u);
  const std::vector<std::pair<TlsMode, bool>> want = {
      {TlsMode::kOff, false},    {TlsMode::kServer, false},
      {TlsMode::kMutual, false}, {TlsMode::kOff, true},
      {TlsMode::kServer, true},  {TlsMode::kMutual, true}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*configs)[i].tls, want[i].first) << i;
    EXPECT_EQ((*configs)[i].tokens, want[i].second) << i;
  }
  EXPECT_EQ((*configs)[5].name, "token+mtls");
  EXPECT_TRUE(AnyTls(*configs));
  EXPECT_FALSE(AnyTls(*ParseSecurityList("plain,token", "--s")));
}

TEST(ParseSecurityListTest, LocalJoinsTheOtherParts) {
  auto configs = ParseSecurityList("mtls+token,mtls+local+token,local", "--s");
  ASSERT_THAT(configs, IsOk());
  ASSERT_EQ(configs->size(), 3u);
  EXPECT_FALSE((*configs)[0].local);
  EXPECT_TRUE((*configs)[1].local);
  EXPECT_EQ((*configs)[1].tls, TlsMode::kMutual);
  EXPECT_TRUE((*configs)[1].tokens);
  EXPECT_TRUE((*configs)[2].local);
  EXPECT_EQ((*configs)[2].tls, TlsMode::kOff);
  EXPECT_EQ(LocalSocket("/tmp/b", "worker"), "unix:/tmp/b/worker.sock");
}

TEST(ParseSecurityListTest, RefusesNamingTheFlagAndEntry) {
  for (const auto& [list, entry, why] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"plain,tsl", "\"tsl\"", "unknown part \"tsl\""},
           {"", "\"\"", "unknown part \"\""},
           {"plain,", "\"\"", "unknown part"},
           {"plain+tls", "\"plain+tls\"", "joins plain"},
           {"tls+mtls", "\"tls+mtls\"", "names tls twice"},
           {"token+token", "\"token+token\"", "names \"token\" twice"},
           {"tls+token,token+tls", "\"token+tls\"", "listed twice"},
           {"plain+local", "\"plain+local\"", "joins plain"},
           {"local,local", "\"local\"", "listed twice"},
           {"tls+local,local+tls", "\"local+tls\"", "listed twice"}}) {
    EXPECT_THAT(
        ParseSecurityList(list, "--security"),
        StatusIs(
            absl::StatusCode::kInvalidArgument,
            AllOf(HasSubstr(absl::StrCat("--security=", list, ": ", entry)),
                  HasSubstr(why))))
        << list;
  }
}

TEST(SecurityFlagsTest, EachConfigurationGetsItsFlags) {
  const CertFiles certs{"/c"};
  auto flags = [&](const std::string& name, bool manager) {
    const SecurityConfig c = ParseSecurityList(name, "--s")->front();
    return manager ? ManagerSecurityFlags(c, certs, "/d/admin.token")
                   : WorkerSecurityFlags(c, certs, "/d/worker.token");
  };
  EXPECT_TRUE(flags("plain", true).empty());
  EXPECT_TRUE(flags("plain", false).empty());
  EXPECT_THAT(flags("tls", true),
              ElementsAre("--tls_cert=/c/manager.crt",
                          "--tls_key=/c/manager.key", "--tls_ca=/c/ca.crt"));
  EXPECT_THAT(
      flags("mtls+token", true),
      ElementsAre("--tls_cert=/c/manager.crt", "--tls_key=/c/manager.key",
                  "--tls_ca=/c/ca.crt", "--tls_require_client_cert",
                  "--auth=token", "--admin_token_file=/d/admin.token"));
  EXPECT_THAT(flags("mtls", false),
              ElementsAre("--tls_cert=/c/worker.crt", "--tls_key=/c/worker.key",
                          "--tls_ca=/c/ca.crt", "--tls_require_client_cert"));
  EXPECT_THAT(flags("token", false),
              ElementsAre("--token_file=/d/worker.token"));
}

TEST(PrepareCertsTest, MissingScriptIsNamed) {
  EXPECT_THAT(PrepareCerts("/nonexistent/certs", "/nonexistent/make_certs.sh",
                           "--make_certs"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--make_certs=/nonexistent/make_certs.sh: "
                                 "cannot be read")));
}

Measurement Timed(uint64_t ops, double seconds, double latency,
                  double server_cpu_s) {
  Measurement m;
  m.ops = ops;
  m.seconds = seconds;
  m.latency_ms.assign(ops, latency);
  m.server_cpu_s = server_cpu_s;
  m.client_cpu_s = 2 * server_cpu_s;
  return m;
}

TEST(CostReportTest, RatiosAgainstTheFirstConfiguration) {
  auto configs = ParseSecurityList("plain,mtls+token", "--s");
  ASSERT_THAT(configs, IsOk());
  CostReport report(*configs, {"1"});
  // Three repeats: plain 100/s, 200/s, 100/s; mtls+token 90/s, 150/s,
  // 110/s. CPU: plain 10 us per call, mtls+token 11 us.
  report.Add(0, 0, Timed(100, 1.0, 2.0, 0.001));
  report.Add(0, 1, Timed(90, 1.0, 2.5, 0.00099));
  report.Add(0, 0, Timed(200, 1.0, 2.0, 0.002));
  report.Add(0, 1, Timed(150, 1.0, 2.5, 0.00165));
  report.Add(0, 0, Timed(100, 1.0, 2.0, 0.001));
  report.Add(0, 1, Timed(110, 1.0, 2.5, 0.00121));
  const std::string md = report.Markdown("clients", "RPCs", "manager");
  EXPECT_THAT(md, HasSubstr("| clients | security | RPCs/s | vs plain | "
                            "median (range) | p50 ms | p99 ms | p50 vs plain "
                            "| manager CPU us/op | vs plain | client CPU "
                            "us/op | vs plain | errors |"));
  EXPECT_THAT(md, HasSubstr("| 1 | plain | 133 | 1.000 | 1.000 (1.000-1.000) "
                            "| 2.000 | 2.000 | 1.000 | 10.0 | 1.000 | 20.0 | "
                            "1.000 | 0 |"));
  // Pooled 350 / 400 calls; per repeat 0.9, 0.75, 1.1 (median 0.9); p50
  // 2.5 / 2.0; CPU 11 / 10 us.
  EXPECT_THAT(md, HasSubstr("| 1 | mtls+token | 117 | 0.875 | 0.900 "
                            "(0.750-1.100) | 2.500 | 2.500 | 1.250 | 11.0 | "
                            "1.100 | 22.0 | 1.100 | 0 |"));
  EXPECT_EQ(report.errors(), 0u);

  const std::string path = ::testing::TempDir() + "/cost.tsv";
  ASSERT_THAT(report.WriteTsv(path, "manager"), IsOk());
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<std::string> lines =
      absl::StrSplit(text.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 1u + 8u);  // header, 2 x (3 repeats + pooled)
  EXPECT_EQ(lines[0],
            "bench\tlevel\tsecurity\trepeat\tops\tseconds\tops_per_s\tp50_ms\t"
            "p99_ms\terrors\tratio\tserver_cpu_us\tclient_cpu_us\t"
            "server_cpu_ratio");
  EXPECT_EQ(lines[6],
            "manager\t1\tmtls+token\t2\t150\t1.000\t150.0\t2.5000\t2.5000\t0\t"
            "0.7500\t11.00\t22.00\t1.1000");
  EXPECT_EQ(lines[8],
            "manager\t1\tmtls+token\tall\t350\t3.000\t116.7\t2.5000\t2.5000\t"
            "0\t0.8750\t11.00\t22.00\t1.1000");
  unlink(path.c_str());
}

TEST(CostReportTest, CountsErrors) {
  CostReport report(*ParseSecurityList("plain", "--s"), {"1"});
  Measurement m = Timed(3, 1.0, 1.0, 0.0);
  m.errors = 2;
  report.Add(0, 0, m);
  EXPECT_EQ(report.errors(), 2u);
}

TEST(QuantileTest, PicksFromTheSortedValues) {
  std::vector<double> v = {5, 1, 4, 2, 3};
  EXPECT_EQ(Quantile(&v, 0.5), 3);
  EXPECT_EQ(Quantile(&v, 0.99), 5);
  std::vector<double> none;
  EXPECT_EQ(Quantile(&none, 0.5), 0);
}

}  // namespace
}  // namespace triax::bench
