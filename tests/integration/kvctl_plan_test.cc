// kvctl plan against a live manager (PlanCapacity; docs/capacity.md): the
// FP8/INT4 note's Llama-3-8B table in the printed output, the live tag mix
// and tenants of the manager, the chart, and bad input refused with the
// field and the value.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
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

class KvctlPlanTest : public ::testing::Test {
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

  // The printed line of the row labelled `label` ("" when none).
  std::string Row(const std::string& label) const {
    for (absl::string_view line : absl::StrSplit(out_, '\n')) {
      if (absl::StartsWith(line, label + " ")) return std::string(line);
    }
    return "";
  }

  std::unique_ptr<Cluster> cluster_;
  std::string out_, err_;
};

const std::vector<std::string> kNote = {"plan", "--model=Llama-3-8B",
                                        "--gpu_memory=80GiB", "--reserve=35GiB",
                                        "--policies=bf16 fp8 k=int4,g=64"};

TEST_F(KvctlPlanTest, PrintsTheNotesTableBesideTriaxkvPages) {
  ASSERT_EQ(Kvctl(kNote), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("model llama-3-8b: 32 layers, 8 KV heads, "
                              "head_dim 128"));
  EXPECT_THAT(out_, HasSubstr("45.00 GiB for KV"));
  // POLICY KIND BITS IDEAL-KiB/T IDEAL-TOKENS PAGE-KiB/T PAGE-TOKENS.
  EXPECT_THAT(Row("bf16"),
              ContainsRegex("uniform +16.00 +128.0 +368,640 +128.0 +368,640"));
  EXPECT_THAT(Row("fp8"),
              ContainsRegex("uniform +8.02 +64.0 +737,280 +64.1 +735,840"));
  EXPECT_THAT(Row("k=int4,v=int4,g=64"),
              ContainsRegex("uniform +5.25 +34.0 +1,387,821 +42.0 +1,123,472"));

  std::vector<std::string> ceiling = kNote;
  ceiling.push_back("--ceiling=0.7");
  ASSERT_EQ(Kvctl(ceiling), 0) << err_;
  EXPECT_THAT(Row("bf16"), ContainsRegex("128.0 +258,048 "));
  EXPECT_THAT(Row("fp8"), ContainsRegex("64.0 +516,096 "));
  EXPECT_THAT(Row("k=int4,v=int4,g=64"), ContainsRegex("34.0 +971,475 "));
}

TEST_F(KvctlPlanTest, UsesTheLiveTagMixTenantsAndWritesAChart) {
  ASSERT_EQ(Kvctl({"tenant-create", "ops", "--device_floor_bytes=1000",
                   "--device_ceiling_bytes=1000000000"}),
            0)
      << err_;
  auto client = cluster_->NewClient("ops");
  ASSERT_THAT(client, IsOk());
  auto seq = (*client)->Open(
      SmallModel(),
      {MakeSpan(triax::v1::ROLE_SYSTEM, 16), MakeSpan(triax::v1::ROLE_USER, 4)},
      "bf16", 16);
  ASSERT_THAT(seq, IsOk());

  const std::string svg = cluster_->dir() + "/plan.svg";
  ASSERT_EQ(Kvctl({"plan", "--model=qwen2.5-7b", "--gpu_memory=141GB",
                   "--gpus=2", "--reserve=20GB", "--context=4096",
                   "--policies=bf16 policy=triaxial-static", "--tag_mix=live",
                   "--live_tenants", "--what_if_gpus=1", "--svg=" + svg}),
            0)
      << err_;
  // The open sequence's 20 tokens: its sink block and its user block.
  EXPECT_THAT(out_, HasSubstr("tag mix: 2 tags, 20 tokens"));
  EXPECT_THAT(out_, ContainsRegex("sink/text/system +bf16 +16 tokens"));
  EXPECT_THAT(out_, ContainsRegex("current_turn/text/user +bf16 +4 tokens"));
  EXPECT_THAT(Row("triaxial-static"), HasSubstr("rules"));
  // The tenant with its device budget: ceiling 1 GB (0.93 GiB).
  EXPECT_THAT(out_, ContainsRegex("\nops +0.00 GiB +0.93 GiB +0.93 GiB"));
  EXPECT_THAT(out_, HasSubstr("what if +1 GPU: 3 GPUs"));
  EXPECT_THAT(out_, HasSubstr("bf16: +50.0% page tokens"));
  std::ifstream in(svg);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_THAT(ss.str(),
              StartsWith("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_THAT(ss.str(), HasSubstr(">triaxial-static</text>"));
  // --context given: the sessions-against-memory panel, a line per row.
  EXPECT_THAT(ss.str(), HasSubstr("Sessions of 4096 tokens (triaxkv pages)"));
  EXPECT_THAT(ss.str(), ContainsRegex("(<polyline class=\"sessions\"[^\n]*\n"
                                      "[^\n]*\n){2}"));
  EXPECT_THAT(ss.str(), HasSubstr("</svg>"));
}

TEST_F(KvctlPlanTest, AllocationRowsUseTheManagersStoredCalibration) {
  // A table on the Llama-3-8B shape for the user tag: BF16, INT4, INT2.
  triax::v1::PutCalibrationRequest put;
  put.set_request_id("plan-cal-1");
  triax::v1::CalibrationTable* t = put.mutable_table();
  t->set_model("plan-cal");
  t->mutable_shape()->set_name("llama-3-8b");
  t->mutable_shape()->set_n_layers(32);
  t->mutable_shape()->set_n_kv_heads(8);
  t->mutable_shape()->set_n_q_heads(32);
  t->mutable_shape()->set_head_dim(128);
  t->set_block_tokens(16);
  const triax::v1::Format formats[] = {
      triax::v1::FORMAT_BF16, triax::v1::FORMAT_INT4, triax::v1::FORMAT_INT2};
  const double distortion[] = {0, 0.1, 1};
  for (int i = 0; i < 3; ++i) {
    triax::v1::CalibrationEntry* e = t->add_entries();
    e->mutable_tag()->set_temporal(triax::v1::TEMPORAL_CURRENT_TURN);
    e->mutable_tag()->set_role(triax::v1::ROLE_USER);
    e->set_format(formats[i]);
    e->set_distortion(distortion[i]);
  }
  auto client = cluster_->NewClient("");
  ASSERT_THAT(client, IsOk());
  {
    grpc::ClientContext ctx;
    triax::v1::PutCalibrationResponse resp;
    ASSERT_TRUE((*client)->manager()->PutCalibration(&ctx, put, &resp).ok());
  }
  const std::string mix = cluster_->dir() + "/mix.txt";
  {
    std::ofstream out(mix);
    out << "# sink and a user turn\nsink/text/system 16\n"
           "current_turn/text/user 4080\n";
  }
  std::vector<std::string> args = {"plan",
                                   "--model=llama-3-8b",
                                   "--gpu_memory=80GiB",
                                   "--reserve=35GiB",
                                   "--policies=bf16 triaxial=6",
                                   "--calibration_model=plan-cal",
                                   "--tag_mix=" + mix};
  ASSERT_EQ(Kvctl(args), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("calibration: plan-cal"));
  EXPECT_THAT(out_, HasSubstr("tag mix: 2 tags, 4,096 tokens"));
  // 6 bits: the user turn in INT4 (INT4 at T=16 is 5.5 effective bits; the
  // 16 sink tokens stay BF16), on the model's own shape.
  EXPECT_THAT(Row("triaxial@6b"), HasSubstr("allocation"));
  EXPECT_THAT(out_, HasSubstr("triaxial@6b by tag:\n"));
  EXPECT_THAT(out_, ContainsRegex("sink/text/system +bf16 +16 tokens"));
  EXPECT_THAT(out_,
              ContainsRegex("current_turn/text/user +int4 +4,080 tokens"));

  args[5] = "--calibration_model=nope";
  EXPECT_EQ(Kvctl(args), 1);
  EXPECT_THAT(err_, StartsWith("kvctl: NOT_FOUND: "));
  EXPECT_THAT(err_, HasSubstr("nope"));
}

TEST_F(KvctlPlanTest, BadInputNamesTheFieldAndTheValue) {
  struct Case {
    std::vector<std::string> flags;
    std::string want;
  };
  const Case cases[] = {
      {{"--ceiling=1.5"}, "INVALID_ARGUMENT: ceiling=1.5 is outside (0, 1]"},
      {{"--ceiling=0"}, "INVALID_ARGUMENT: ceiling=0 is outside (0, 1]"},
      {{"--gpu_memory=-1GiB"},
       "INVALID_ARGUMENT: gpu_memory_bytes=-1073741824 is not positive"},
      {{"--gpu_memory=0"},
       "INVALID_ARGUMENT: gpu_memory_bytes=0 is not positive"},
      {{"--model=llama-9"},
       "INVALID_ARGUMENT: model_preset=\"llama-9\" is no "
       "preset"},
      {{"--gpus=0"}, "INVALID_ARGUMENT: gpu_count=0"},
      {{"--context=0"}, "INVALID_ARGUMENT: context_lengths[0]=0"},
      {{"--tenants=t:2GiB:1GiB"},
       "INVALID_ARGUMENT: tenants[0].ceiling_bytes=1073741824"},
      {{"--policies=policy=nope"},
       "INVALID_ARGUMENT: policies[0].policy=\"nope\""},
      {{"--policies=triaxial=4"},
       "FAILED_PRECONDITION: policies[0] (budget_bits 4) needs a "
       "calibration table"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    std::vector<std::string> args = kNote;
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    EXPECT_EQ(Kvctl(args), 1) << out_;
    EXPECT_THAT(err_, StartsWith("kvctl: " + c.want));
  }
  // Text that does not parse is kvctl's own usage error.
  std::vector<std::string> args = kNote;
  args.push_back("--reserve=lots");
  EXPECT_EQ(Kvctl(args), 2);
  EXPECT_THAT(err_, HasSubstr("--reserve=\"lots\": is no size"));
}

}  // namespace
}  // namespace triax::testing
