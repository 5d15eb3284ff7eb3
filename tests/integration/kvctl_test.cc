// kvctl against a live manager: every read command names the ids it shows,
// errors exit 1 with "kvctl: CODE: ...", bad usage exits 2.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class KvctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = Cluster::Start(ClusterOptions{});
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
  }

  // Runs kvctl against the cluster; returns the exit code.
  int Kvctl(std::vector<std::string> args) {
    args.insert(args.begin(), "--manager=" + cluster_->manager_address());
    auto rc = RunToCompletion("kvctl", args, cluster_->dir(), &out_, &err_);
    EXPECT_THAT(rc, IsOk());
    return rc.ok() ? *rc : -1;
  }

  std::unique_ptr<Cluster> cluster_;
  std::string out_, err_;
};

TEST_F(KvctlTest, ShowsWorkersTenantsSequencesTracesAndEvents) {
  ASSERT_EQ(Kvctl({"tenant-create", "ops", "--device_ceiling_bytes=1000000"}),
            0)
      << err_;
  EXPECT_THAT(out_, HasSubstr("ops"));
  ASSERT_EQ(Kvctl({"budget-set", "ops", "--tier=host", "--floor_bytes=0",
                   "--ceiling_bytes=2048"}),
            0)
      << err_;
  EXPECT_THAT(out_, HasSubstr("host="));

  auto client = cluster_->NewClient("ops");
  ASSERT_THAT(client, IsOk());
  auto seq = (*client)->Open(
      SmallModel(),
      {MakeSpan(triax::v1::ROLE_SYSTEM, 16), MakeSpan(triax::v1::ROLE_USER, 4)},
      "bf16", 16);
  ASSERT_THAT(seq, IsOk());
  const std::string lineage = absl::StrCat(seq->blocks[1].lineage_id());

  ASSERT_EQ(Kvctl({"workers"}), 0) << err_;
  EXPECT_THAT(out_, StartsWith("WORKER"));
  EXPECT_THAT(out_, HasSubstr("w0"));
  EXPECT_THAT(out_, HasSubstr("up"));

  ASSERT_EQ(Kvctl({"tenants"}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("ops"));

  ASSERT_EQ(Kvctl({"sequences", "--tenant=ops"}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr(seq->sequence_id));

  ASSERT_EQ(Kvctl({"sequence", seq->sequence_id}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr(seq->sequence_id));
  EXPECT_THAT(out_, HasSubstr(lineage));
  EXPECT_THAT(out_, HasSubstr("sink/text/system"));
  EXPECT_THAT(out_, HasSubstr("bf16"));

  ASSERT_EQ(Kvctl({"trace", lineage}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr(lineage));
  EXPECT_THAT(out_, HasSubstr(seq->sequence_id));
  EXPECT_THAT(out_, HasSubstr("BLOCK_CREATED"));

  ASSERT_EQ(Kvctl({"events", "--from=1", "--max=5"}), 0) << err_;
  std::vector<std::string> lines =
      absl::StrSplit(out_, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 5u) << out_;
  for (const auto& l : lines) EXPECT_THAT(l, StartsWith("id="));
  EXPECT_THAT(lines[0], StartsWith("id=1 "));

  ASSERT_EQ(Kvctl({"events", "--from=1", "--sequence=" + seq->sequence_id,
                   "--max=1", "--json"}),
            0)
      << err_;
  EXPECT_THAT(out_, StartsWith("{\"id\":"));
  EXPECT_THAT(out_, HasSubstr(absl::StrCat("\"sequence_id\":\"",
                                           seq->sequence_id, "\"")));

  // Errors: the server's code, exit 1.
  EXPECT_EQ(Kvctl({"sequence", "no-such-seq"}), 1);
  EXPECT_THAT(err_, StartsWith("kvctl: NOT_FOUND: "));
  EXPECT_THAT(err_, HasSubstr("no-such-seq"));
  // Bad usage: exit 2 with the usage text.
  EXPECT_EQ(Kvctl({"trace", "not-a-number"}), 2);
  EXPECT_THAT(err_, HasSubstr("usage: kvctl"));
  EXPECT_EQ(Kvctl({"frobnicate"}), 2);
  EXPECT_EQ(Kvctl({"budget-set", "ops", "--tier=moon"}), 2);
}

}  // namespace
}  // namespace triax::testing
