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

using ::testing::ContainsRegex;
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
  EXPECT_THAT(out_, HasSubstr("transfers: none"));
  // One worker: nowhere to transfer to (the manager's code, exit 1).
  EXPECT_EQ(Kvctl({"transfer", seq->sequence_id}), 1);
  EXPECT_THAT(err_, StartsWith("kvctl: UNAVAILABLE: "));
  EXPECT_THAT(err_, HasSubstr("besides the source \"w0\""));

  ASSERT_EQ(Kvctl({"trace", lineage}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr(lineage));
  EXPECT_THAT(out_, HasSubstr(seq->sequence_id));
  EXPECT_THAT(out_, HasSubstr("BLOCK_CREATED"));
  EXPECT_THAT(out_, HasSubstr("created on w0"));

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
  EXPECT_EQ(Kvctl({"workers", "--worker_sockets=127.0.0.1:1=/tmp/w.sock"}), 2);
  EXPECT_THAT(err_,
              HasSubstr("--worker_sockets entry \"127.0.0.1:1=/tmp/w.sock\""
                        " is not WORKER_ADDRESS=unix:/PATH"));
  EXPECT_EQ(Kvctl({"workers", "--worker_sockets=a=unix:/x,a=unix:/y"}), 2);
  EXPECT_THAT(err_, HasSubstr("names worker address \"a\" twice"));
}

TEST_F(KvctlTest, PoliciesPolicyPutAndDemote) {
  ASSERT_EQ(Kvctl({"policies"}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("triaxial-static  yes"));
  EXPECT_THAT(out_, HasSubstr("temporal=older:int2"));
  EXPECT_THAT(out_, HasSubstr("*:tq3"));
  ASSERT_EQ(Kvctl({"policy-put", "mixed", "temporal=sink:bf16",
                   "role=system:k=fp8,v=int4,g=64,scale=fp8", "*:int4"}),
            0)
      << err_;
  EXPECT_THAT(out_, HasSubstr("role=system:k=fp8,v=int4,g=64,scale=fp8"));
  // The server's validation: the last rule must be a catch-all.
  EXPECT_EQ(Kvctl({"policy-put", "broken", "role=user:int4"}), 1);
  EXPECT_THAT(err_, StartsWith("kvctl: INVALID_ARGUMENT: "));
  EXPECT_THAT(err_, HasSubstr("policy.rules[0] (the last rule"));
  // Local syntax errors are usage errors.
  EXPECT_EQ(Kvctl({"policy-put", "broken", "role=boss:int4"}), 2);
  EXPECT_THAT(err_, HasSubstr("bad value in \"role=boss\""));

  ASSERT_THAT(cluster_->CreateTenant("ops"), IsOk());
  auto client = cluster_->NewClient("ops");
  ASSERT_THAT(client, IsOk());
  auto seq = (*client)->Open(
      SmallModel(), {MakeSpan(triax::v1::ROLE_SYSTEM, 32)}, "mixed", 16);
  ASSERT_THAT(seq, IsOk());
  ASSERT_EQ(Kvctl({"sequence", seq->sequence_id}), 0) << err_;
  EXPECT_THAT(out_, ContainsRegex("fp8 +int4 +64 +fp8"));
  const std::string lineage = absl::StrCat(seq->blocks[1].lineage_id());
  ASSERT_EQ(
      Kvctl({"demote", seq->sequence_id, lineage, "int2", "--tenant=ops"}), 0)
      << err_;
  EXPECT_THAT(out_, HasSubstr("bytes_delta: -"));
  EXPECT_THAT(out_, ContainsRegex("int2 +int2 +32 +fp16"));
  EXPECT_EQ(Kvctl({"demote", seq->sequence_id, lineage, "int2"}), 2);
  EXPECT_THAT(err_, HasSubstr("--tenant is required"));
  ASSERT_THAT(cluster_->CreateTenant("intruder"), IsOk());
  EXPECT_EQ(
      Kvctl({"demote", seq->sequence_id, lineage, "int4", "--tenant=intruder"}),
      1);
  EXPECT_THAT(err_, StartsWith("kvctl: PERMISSION_DENIED: "));
  EXPECT_THAT((*client)->Close(*seq), IsOk());
}

TEST_F(KvctlTest, ListCommandsPrintEveryPage) {
  ASSERT_THAT(cluster_->CreateTenant("ops"), IsOk());
  ASSERT_THAT(cluster_->CreateTenant("ops2"), IsOk());
  auto client = cluster_->NewClient("ops");
  ASSERT_THAT(client, IsOk());
  std::vector<std::string> ids;
  std::vector<triax::client::SequenceHandle> seqs;
  for (int i = 0; i < 5; ++i) {
    auto seq = (*client)->Open(
        SmallModel(), {MakeSpan(triax::v1::ROLE_USER, 20)}, "bf16", 16);
    ASSERT_THAT(seq, IsOk());
    ids.push_back(seq->sequence_id);
    seqs.push_back(*seq);
  }
  ASSERT_THAT((*client)->Close(seqs[1]), IsOk());

  // Pages of 2: every open sequence, each once, in creation order.
  ASSERT_EQ(Kvctl({"sequences", "--tenant=ops", "--page_size=2"}), 0) << err_;
  std::vector<std::string> lines =
      absl::StrSplit(out_, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 5u) << out_;  // header + 4 open sequences
  for (size_t i = 0, open = 0; i < ids.size(); ++i) {
    if (i == 1) {
      EXPECT_THAT(out_, ::testing::Not(HasSubstr(ids[1] + " "))) << out_;
      continue;
    }
    EXPECT_THAT(lines[1 + open], StartsWith(ids[i])) << out_;
    ++open;
  }
  ASSERT_EQ(Kvctl({"sequences", "--all", "--page_size=1"}), 0) << err_;
  for (const std::string& id : ids) EXPECT_THAT(out_, HasSubstr(id));

  ASSERT_EQ(Kvctl({"tenants", "--page_size=1"}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("ops "));
  EXPECT_THAT(out_, HasSubstr("ops2"));
  ASSERT_EQ(Kvctl({"workers", "--page_size=1"}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("w0"));
  ASSERT_EQ(Kvctl({"policies", "--page_size=2"}), 0) << err_;
  for (const char* p : {"triaxial-static", "bf16", "int2", "tq2"}) {
    EXPECT_THAT(out_, HasSubstr(p));
  }
  const std::string lineage = absl::StrCat(seqs[0].blocks[0].lineage_id());
  ASSERT_EQ(Kvctl({"trace", lineage, "--page_size=1"}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("BLOCK_CREATED"));

  EXPECT_EQ(Kvctl({"sequences", "--page_size=-1"}), 2);
  EXPECT_THAT(err_, HasSubstr("--page_size=-1 is negative"));
}

TEST_F(KvctlTest, PressureShowsPoolsTenantsAndTheRanking) {
  ASSERT_EQ(Kvctl({"tenant-create", "ops", "--device_floor_bytes=1024",
                   "--device_ceiling_bytes=10000000"}),
            0)
      << err_;
  auto client = cluster_->NewClient("ops");
  ASSERT_THAT(client, IsOk());
  auto seq = (*client)->Open(SmallModel(),
                             {MakeSpan(triax::v1::ROLE_SYSTEM, 16),
                              MakeSpan(triax::v1::ROLE_USER, 48)},
                             "bf16", 16);
  ASSERT_THAT(seq, IsOk());

  // The plan shows where each block is: on the device, not evicted.
  ASSERT_EQ(Kvctl({"sequence", seq->sequence_id}), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("TIER    EVICTED"));
  EXPECT_THAT(out_, ContainsRegex("bf16 +bf16 +- +- +1 +device +no"));

  ASSERT_EQ(Kvctl({"pressure", "--top=5"}), 0) << err_;
  EXPECT_THAT(out_, ContainsRegex("mode: +(demote-first|graph-evict|lru)"));
  EXPECT_THAT(out_, ContainsRegex("snapshot: +[0-9]+ blocks"));
  EXPECT_THAT(out_, HasSubstr("applied:"));
  EXPECT_THAT(out_, HasSubstr("POOLS\nWORKER  TIER"));
  EXPECT_THAT(out_, ContainsRegex("w0 +device +[0-9.]+ [KMG]?i?B"));
  EXPECT_THAT(out_, ContainsRegex("ops +device +[0-9.]+ [KMG]?i?B +1.00 KiB"));
  EXPECT_THAT(out_, HasSubstr("above floor by"));
  EXPECT_THAT(out_, HasSubstr("cheapest first)\n#  LINEAGE"));

  // Bad usage: exit 2.
  EXPECT_EQ(Kvctl({"pressure", "--top=0"}), 2);
  EXPECT_THAT(err_, HasSubstr("--top=0"));
  EXPECT_EQ(Kvctl({"pressure", "extra"}), 2);
  EXPECT_THAT((*client)->Close(*seq), IsOk());
}

}  // namespace
}  // namespace triax::testing
