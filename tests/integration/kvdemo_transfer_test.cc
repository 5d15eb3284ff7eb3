// kvdemo's prefill-on-one-worker, decode-on-another step (a) against a real
// kvmanager and two kvworkers whose exports are all corrupted
// (--testing_corrupt_export_pages=1): every TransferSequence fails with
// DATA_LOSS. --transfer_failure_policy=recompute prefills again into a new
// sequence on the other worker and the greedy text still equals
// expected_greedy_200.txt; =fail stops with the status and exit code 1.
// Either way nothing stays charged to the tenant. Needs stories260k in the
// data directory (skipped without it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/frontend/data_dir.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/process.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kTenant[] = "demo";

class KvdemoTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = frontend::ResolveDataDir("");
    if (!frontend::DataDirComplete(data_dir_, /*need_kvproxy=*/false)) {
      GTEST_SKIP() << "data directory '" << data_dir_
                   << "' lacks stories260k (set TRIAX_DATA_DIR)";
    }
    ClusterOptions o;
    o.num_workers = 2;
    o.worker_flags = {"--testing_corrupt_export_pages=1"};
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
  }

  // Runs kvdemo step (a) with `extra` flags; its exit code and output.
  struct Run {
    int exit_code = -1;
    std::string log;
  };
  Run Demo(const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> args = {
        absl::StrCat("--manager=", cluster_->manager_address()),
        absl::StrCat("--tenant=", kTenant),
        absl::StrCat("--data_dir=", data_dir_), "--steps=a", "--threads=1"};
    args.insert(args.end(), extra.begin(), extra.end());
    Run r;
    auto p = Process::Start(name, "kvdemo", args, cluster_->dir(),
                            /*with_port_file=*/false);
    EXPECT_THAT(p, IsOk());
    if (!p.ok()) return r;
    auto code = (*p)->Wait(absl::Seconds(90));
    EXPECT_THAT(code, IsOk());
    if (code.ok()) r.exit_code = *code;
    r.log = (*p)->Log(1 << 20);
    return r;
  }

  uint64_t TenantBytes() {
    auto t = cluster_->GetTenant(kTenant);
    EXPECT_THAT(t, IsOk());
    uint64_t bytes = 0;
    for (const auto& u : t->usage()) bytes += u.used_bytes();
    return bytes;
  }

  std::string data_dir_;
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(KvdemoTransferTest, RecomputeAfterAFailedTransferKeepsTheText) {
  const Run r = Demo("kvdemo-recompute", {});  // recompute is the default
  EXPECT_EQ(r.exit_code, 0) << r.log;
  EXPECT_THAT(r.log, HasSubstr("transfer failed: DATA_LOSS: "));
  EXPECT_THAT(r.log, HasSubstr("(--transfer_failure_policy=recompute)"));
  EXPECT_THAT(r.log, HasSubstr("recomputed the prefill of 100 tokens on w"));
  // The recomputed sequence went to the worker without the partial copy.
  std::smatch m;
  const std::regex where(
      "prefill on (w[01]), decode on (w[01]) \\(prefill recomputed there\\)");
  ASSERT_TRUE(std::regex_search(r.log, m, where)) << r.log;
  EXPECT_NE(m[1].str(), m[2].str());
  EXPECT_THAT(r.log, HasSubstr("[PASS] greedy prefill on one worker, decode on "
                               "another == expected_greedy_200.txt"));
  EXPECT_THAT(r.log, HasSubstr("ALL CHECKS PASSED"));
  EXPECT_EQ(TenantBytes(), 0u);  // the partial sequence was closed
}

TEST_F(KvdemoTransferTest, FailStopsWithTheTransferStatus) {
  const Run r = Demo("kvdemo-fail", {"--transfer_failure_policy=fail"});
  EXPECT_EQ(r.exit_code, 1) << r.log;
  EXPECT_THAT(r.log, HasSubstr("(--transfer_failure_policy=fail)"));
  EXPECT_THAT(r.log, HasSubstr("FAILED at (a) greedy decoding: DATA_LOSS: "
                               "TransferSequence: "));
  EXPECT_THAT(r.log, Not(HasSubstr("recomputed the prefill")));
  EXPECT_EQ(TenantBytes(), 0u);
}

TEST_F(KvdemoTransferTest, UnknownPolicyIsRefused) {
  const Run r = Demo("kvdemo-bad", {"--transfer_failure_policy=retry"});
  EXPECT_EQ(r.exit_code, 1) << r.log;
  EXPECT_THAT(r.log, HasSubstr("--transfer_failure_policy = \"retry\"; must "
                               "be \"recompute\" or \"fail\""));
}

}  // namespace
}  // namespace triax::testing
