#include "kvmanager/dashboard.h"

#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "kvmanager/manager_core_test_fixture.h"

namespace triax::manager {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

class DashboardTest : public CoreTest {
 protected:
  // Calls `handler` with `query` and parses the answer, which must be JSON
  // with `status`.
  json Call(HttpResponse (Dashboard::*handler)(const HttpRequest&) const,
            const std::string& path, const std::string& query,
            int status = 200) {
    const HttpResponse r =
        (dashboard_.get()->*handler)(HttpRequest{path, query});
    EXPECT_EQ(r.status, status) << path << "?" << query << ": " << r.body;
    EXPECT_EQ(r.content_type, "application/json");
    json j = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << r.body;
    return j;
  }
  // The message of an error answer with `status`, whose code is `code`.
  std::string Error(HttpResponse (Dashboard::*handler)(const HttpRequest&)
                        const,
                    const std::string& path, const std::string& query,
                    int status, const std::string& code) {
    const json j = Call(handler, path, query, status);
    if (!j.contains("error")) return "";
    EXPECT_EQ(j["error"]["code"], code) << j.dump();
    return j["error"]["message"].get<std::string>();
  }

  void SetUp() override {
    CoreTest::SetUp();
    dashboard_ = std::make_unique<Dashboard>(core_.get());
  }

  std::unique_ptr<Dashboard> dashboard_;
};

TEST_F(DashboardTest, RoutesServeEveryPath) {
  const auto routes = dashboard_->Routes();
  std::set<std::string> paths;
  for (const auto& [path, handler] : routes) paths.insert(path);
  EXPECT_EQ(paths, (std::set<std::string>{"/", "/dashboard", "/api/workers",
                                          "/api/tenants", "/api/pressure",
                                          "/api/events", "/api/sequences",
                                          "/api/sequence", "/api/plan"}));
  const HttpResponse r =
      routes.at("/api/workers")(HttpRequest{"/api/workers", ""});
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.body, HasSubstr("\"w1\""));
}

TEST_F(DashboardTest, PageIsSelfContained) {
  const HttpResponse r = dashboard_->Page(HttpRequest{"/", ""});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "text/html; charset=utf-8");
  EXPECT_THAT(r.body, HasSubstr("<!doctype html>"));
  for (const char* api :
       {"/api/workers", "/api/tenants", "/api/pressure", "/api/events",
        "/api/sequences", "/api/sequence?", "/api/plan"}) {
    EXPECT_THAT(r.body, HasSubstr(api));
  }
  // Nothing from another host: the cluster may have no internet.
  EXPECT_THAT(r.body, Not(HasSubstr("http://")));
  EXPECT_THAT(r.body, Not(HasSubstr("https://")));
  EXPECT_THAT(r.body, Not(HasSubstr("src=")));
}

TEST_F(DashboardTest, WorkersCarryPoolsByEncoding) {
  Inventory inv;
  inv.capacity_bytes = 1ull << 40;
  inv.used_bytes = 3 * uint64_t{16384};
  inv.window_bytes = 16384;
  inv.formats = {{Format::kBF16, 2, 2 * uint64_t{16384}},
                 {Format::kINT4, 4, 4 * uint64_t{5632}}};
  PoolInventory pool;
  pool.encoding = Encoding(Format::kINT4, Format::kINT2, 64);
  pool.page_bytes = 5632;
  pool.pages_per_frame = 11;
  pool.frames = 2;
  pool.pages_used = 4;
  inv.pools = {pool};
  inv.frame_bytes = 11 * uint64_t{5632};
  inv.frames = 8;
  inv.free_frames = 6;
  inv.free_bytes = 6 * inv.frame_bytes;
  inv.fragmentation = 0.25;
  inv.tiers = {{Tier::kHost, 1 << 20, 4096, 1}};
  ASSERT_THAT(core_->Heartbeat("w1", inv), ::triax::testing::IsOk());

  const json j = Call(&Dashboard::Workers, "/api/workers", "");
  ASSERT_EQ(j["workers"].size(), 1u);
  const json& w = j["workers"][0];
  EXPECT_EQ(w["worker_id"], "w1");
  EXPECT_EQ(w["state"], "up");
  EXPECT_EQ(w["backend"], "cpu");
  EXPECT_EQ(w["capacity_bytes"], 1ull << 40);
  EXPECT_EQ(w["used_bytes"], 3 * 16384);
  EXPECT_EQ(w["window_bytes"], 16384);
  ASSERT_EQ(w["formats"].size(), 2u);
  EXPECT_EQ(w["formats"][1]["format"], "int4");
  EXPECT_EQ(w["formats"][1]["bytes_used"], 4 * 5632);
  ASSERT_EQ(w["pools"].size(), 1u);
  EXPECT_EQ(w["pools"][0]["encoding"], "k=int4,v=int2,g=64");
  EXPECT_EQ(w["pools"][0]["format"], "int4");
  EXPECT_EQ(w["pools"][0]["frames"], 2);
  EXPECT_EQ(w["pools"][0]["pages_used"], 4);
  EXPECT_EQ(w["pools"][0]["pages_per_frame"], 11);
  EXPECT_EQ(w["frame_bytes"], 11 * 5632);
  EXPECT_EQ(w["frames"], 8);
  EXPECT_EQ(w["free_frames"], 6);
  EXPECT_EQ(w["fragmentation"], 0.25);
  ASSERT_EQ(w["tiers"].size(), 1u);
  EXPECT_EQ(w["tiers"][0]["tier"], "host");
  EXPECT_EQ(w["tiers"][0]["used_bytes"], 4096);

  EXPECT_THAT(Error(&Dashboard::Workers, "/api/workers", "x=1", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("unknown query parameter \"x\""));
}

TEST_F(DashboardTest, TenantsShowUsedAgainstFloorAndCeiling) {
  SetBudgetRequest budget;
  budget.tenant_id = "acme";
  budget.budget = {Tier::kDevice, 8 * kBf16, 64 * kBf16};
  ASSERT_THAT(core_->SetBudget(budget), ::triax::testing::IsOk());
  ASSERT_THAT(core_->CreateTenant({"", "zeta", {}, ""}),
              ::triax::testing::IsOk());
  ASSERT_THAT(Open({S(Role::kSystem, 32), S(Role::kUser, 40)}),
              ::triax::testing::IsOk());

  const json j = Call(&Dashboard::Tenants, "/api/tenants", "");
  ASSERT_EQ(j["tenants"].size(), 2u);
  const json& acme = j["tenants"][0];
  EXPECT_EQ(acme["tenant_id"], "acme");
  EXPECT_EQ(acme["open_sequences"], 1);
  ASSERT_GE(acme["tiers"].size(), 1u);
  EXPECT_EQ(acme["tiers"][0]["tier"], "device");
  EXPECT_EQ(acme["tiers"][0]["used_bytes"], DeviceUsage("acme"));
  EXPECT_GT(DeviceUsage("acme"), 0u);
  EXPECT_EQ(acme["tiers"][0]["floor_bytes"], 8 * kBf16);
  EXPECT_EQ(acme["tiers"][0]["ceiling_bytes"], 64 * kBf16);
  // No budget: the device row is there, unlimited.
  const json& zeta = j["tenants"][1];
  EXPECT_EQ(zeta["tenant_id"], "zeta");
  EXPECT_EQ(zeta["tiers"][0]["used_bytes"], 0);
  EXPECT_TRUE(zeta["tiers"][0]["ceiling_bytes"].is_null());
  EXPECT_TRUE(zeta["tiers"][0]["floor_bytes"].is_null());

  // Paged as the List RPC.
  const json first = Call(&Dashboard::Tenants, "/api/tenants", "page_size=1");
  ASSERT_EQ(first["tenants"].size(), 1u);
  const std::string token = first["next_page_token"];
  ASSERT_FALSE(token.empty());
  const json second = Call(&Dashboard::Tenants, "/api/tenants",
                           "page_size=1&page_token=" + token);
  ASSERT_EQ(second["tenants"].size(), 1u);
  EXPECT_EQ(second["tenants"][0]["tenant_id"], "zeta");
  EXPECT_EQ(second["next_page_token"], "");
}

TEST_F(DashboardTest, SequenceBlockMapFollowsThePlan) {
  auto s = Open({S(Role::kSystem, 20), S(Role::kUser, 24),
                 S(Role::kUser, 16, Modality::kImage)});
  ASSERT_THAT(s, ::triax::testing::IsOk());
  ASSERT_THAT(Extend(s->sequence_id, {S(Role::kAssistant, 40)}, true),
              ::triax::testing::IsOk());
  auto info = core_->GetSequence("", s->sequence_id);
  ASSERT_THAT(info, ::triax::testing::IsOk());

  const json j =
      Call(&Dashboard::Sequence, "/api/sequence", "id=" + s->sequence_id);
  EXPECT_EQ(j["sequence_id"], s->sequence_id);
  EXPECT_EQ(j["tenant_id"], "acme");
  EXPECT_EQ(j["worker_id"], "w1");
  EXPECT_EQ(j["state"], "open");
  EXPECT_EQ(j["num_tokens"], 100);
  EXPECT_EQ(j["turns"], 2);
  ASSERT_EQ(j["blocks"].size(), info->blocks.size());
  uint64_t next_token = 0;
  std::set<std::string> temporals, modalities, formats;
  for (size_t i = 0; i < info->blocks.size(); ++i) {
    const BlockPlan& b = info->blocks[i];
    const json& jb = j["blocks"][i];
    EXPECT_EQ(jb["index"], b.index);
    EXPECT_EQ(jb["lineage_id"], b.lineage_id);
    EXPECT_EQ(jb["first_token"], next_token);  // blocks tile the tokens
    EXPECT_EQ(jb["num_tokens"], b.num_tokens);
    EXPECT_EQ(jb["capacity"], 16);
    EXPECT_EQ(jb["tag"]["temporal"], TemporalLabel(b.tag.temporal));
    EXPECT_EQ(jb["tag"]["modality"], ModalityLabel(b.tag.modality));
    EXPECT_EQ(jb["tag"]["role"], RoleLabel(b.tag.role));
    EXPECT_EQ(jb["format"], kernels::FormatName(b.encoding.k));
    EXPECT_EQ(jb["tier"], "device");
    EXPECT_EQ(jb["evicted"], false);
    next_token += b.num_tokens;
    temporals.insert(jb["tag"]["temporal"]);
    modalities.insert(jb["tag"]["modality"]);
    formats.insert(jb["format"]);
  }
  EXPECT_EQ(next_token, 100u);
  // The triaxial picture has something to show on every axis.
  EXPECT_GE(temporals.size(), 2u);
  EXPECT_EQ(modalities, (std::set<std::string>{"text", "image"}));
  EXPECT_GE(formats.size(), 2u);
}

TEST_F(DashboardTest, SequenceBadInput) {
  EXPECT_THAT(Error(&Dashboard::Sequence, "/api/sequence", "id=seq-999", 404,
                    "NOT_FOUND"),
              HasSubstr("seq-999"));
  EXPECT_THAT(
      Error(&Dashboard::Sequence, "/api/sequence", "", 400, "INVALID_ARGUMENT"),
      HasSubstr("id"));
  EXPECT_THAT(Error(&Dashboard::Sequence, "/api/sequence", "id=a%20b", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("id"));
  EXPECT_THAT(Error(&Dashboard::Sequence, "/api/sequence", "id=%zz", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("id"));
  EXPECT_THAT(Error(&Dashboard::Sequence, "/api/sequence", "id=seq-1&id=seq-2",
                    400, "INVALID_ARGUMENT"),
              HasSubstr("id is given twice"));
  EXPECT_THAT(Error(&Dashboard::Sequence, "/api/sequence", "seq=seq-1", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("\"seq\""));
  // A closed sequence is still shown (without blocks) while retained.
  auto s = Open({S(Role::kUser, 40)});
  ASSERT_THAT(s, ::triax::testing::IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "acme", s->sequence_id}),
              ::triax::testing::IsOk());
  const json j =
      Call(&Dashboard::Sequence, "/api/sequence", "id=" + s->sequence_id);
  EXPECT_EQ(j["state"], "closed");
  EXPECT_TRUE(j["blocks"].empty());
}

TEST_F(DashboardTest, SequencesArePaged) {
  for (int i = 0; i < 3; ++i) {
    ASSERT_THAT(Open({S(Role::kUser, 20)}), ::triax::testing::IsOk());
  }
  json page = Call(&Dashboard::Sequences, "/api/sequences", "page_size=2");
  ASSERT_EQ(page["sequences"].size(), 2u);
  EXPECT_EQ(page["sequences"][0]["sequence_id"], "seq-1");
  EXPECT_EQ(page["sequences"][0]["num_tokens"], 20);
  EXPECT_FALSE(page["sequences"][0].contains("blocks"));
  const std::string token = page["next_page_token"];
  ASSERT_FALSE(token.empty());
  page = Call(&Dashboard::Sequences, "/api/sequences",
              "page_size=2&page_token=" + token);
  ASSERT_EQ(page["sequences"].size(), 1u);
  EXPECT_EQ(page["sequences"][0]["sequence_id"], "seq-3");
  EXPECT_EQ(page["next_page_token"], "");

  page = Call(&Dashboard::Sequences, "/api/sequences", "tenant=acme");
  EXPECT_EQ(page["sequences"].size(), 3u);
  ASSERT_THAT(core_->CloseSequence({"", "acme", "seq-2"}),
              ::triax::testing::IsOk());
  EXPECT_EQ(
      Call(&Dashboard::Sequences, "/api/sequences", "")["sequences"].size(),
      2u);
  EXPECT_EQ(Call(&Dashboard::Sequences, "/api/sequences",
                 "include_closed=1")["sequences"]
                .size(),
            3u);

  EXPECT_THAT(Error(&Dashboard::Sequences, "/api/sequences", "page_token=bogus",
                    400, "INVALID_ARGUMENT"),
              HasSubstr("page_token"));
  EXPECT_THAT(Error(&Dashboard::Sequences, "/api/sequences", "page_size=-1",
                    400, "INVALID_ARGUMENT"),
              HasSubstr("page_size=\"-1\""));
  EXPECT_THAT(Error(&Dashboard::Sequences, "/api/sequences", "page_size=1e9",
                    400, "INVALID_ARGUMENT"),
              HasSubstr("page_size"));
  EXPECT_THAT(Error(&Dashboard::Sequences, "/api/sequences",
                    "include_closed=maybe", 400, "INVALID_ARGUMENT"),
              HasSubstr("include_closed=\"maybe\""));
  EXPECT_THAT(Error(&Dashboard::Sequences, "/api/sequences", "tenant=nobody",
                    404, "NOT_FOUND"),
              HasSubstr("nobody"));
  EXPECT_THAT(Error(&Dashboard::Sequences, "/api/sequences", "tenant=a%2Fb",
                    400, "INVALID_ARGUMENT"),
              HasSubstr("tenant"));
}

TEST_F(DashboardTest, PressureShowsPoolsAndTheRankingHead) {
  for (int i = 0; i < 4; ++i) {
    ASSERT_THAT(Open({S(Role::kSystem, 16), S(Role::kUser, 200)}),
                ::triax::testing::IsOk());
  }
  core_->RefreshRanking();
  const PressureState state = core_->GetPressure(3);
  ASSERT_FALSE(state.ranked.empty());

  const json j = Call(&Dashboard::Pressure, "/api/pressure", "top=3");
  EXPECT_EQ(j["mode"], state.mode);
  EXPECT_EQ(j["snapshot_blocks"], state.snapshot_blocks);
  EXPECT_GT(j["snapshot_blocks"].get<uint64_t>(), 0u);
  ASSERT_EQ(j["ranked"].size(), state.ranked.size());
  EXPECT_LE(j["ranked"].size(), 3u);
  for (size_t i = 0; i < state.ranked.size(); ++i) {
    EXPECT_EQ(j["ranked"][i]["rank"], i + 1);
    EXPECT_EQ(j["ranked"][i]["lineage_id"], state.ranked[i].lineage_id);
    EXPECT_EQ(j["ranked"][i]["sequence_id"], state.ranked[i].sequence_id);
    EXPECT_EQ(j["ranked"][i]["bytes_freed"], state.ranked[i].bytes_freed);
  }
  ASSERT_FALSE(j["pools"].empty());
  EXPECT_EQ(j["pools"][0]["worker_id"], "w1");
  EXPECT_EQ(j["pools"][0]["tier"], "device");
  EXPECT_LT(j["pools"][0]["low_watermark_bytes"].get<uint64_t>(),
            j["pools"][0]["high_watermark_bytes"].get<uint64_t>());
  EXPECT_EQ(j["counters"]["spills"], 0);

  EXPECT_EQ(Call(&Dashboard::Pressure, "/api/pressure", "")["ranked"].size(),
            std::min<size_t>(kDashboardDefaultTop,
                             core_->GetPressure(1000).ranked.size()));
  EXPECT_THAT(Error(&Dashboard::Pressure, "/api/pressure", "top=abc", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("top=\"abc\" is not an integer in 0..1000"));
  EXPECT_THAT(Error(&Dashboard::Pressure, "/api/pressure", "top=1001", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("top=\"1001\""));
}

TEST_F(DashboardTest, EventsFeedTheNewestThenWhatFollows) {
  ASSERT_THAT(Open({S(Role::kUser, 40)}), ::triax::testing::IsOk());
  const uint64_t next = core_->events().next_id();
  ASSERT_GT(next, 4u);

  json j = Call(&Dashboard::Events, "/api/events", "limit=2");
  ASSERT_EQ(j["events"].size(), 2u);
  EXPECT_EQ(j["events"][0]["id"], next - 2);
  EXPECT_EQ(j["events"][1]["id"], next - 1);
  EXPECT_EQ(j["next_id"], next);

  // The feed's next poll: nothing new, then what an Open appended.
  j = Call(&Dashboard::Events, "/api/events",
           "after=" + std::to_string(next - 1));
  EXPECT_TRUE(j["events"].empty());
  ASSERT_THAT(Open({S(Role::kSystem, 16), S(Role::kUser, 4)}),
              ::triax::testing::IsOk());
  j = Call(&Dashboard::Events, "/api/events",
           "after=" + std::to_string(next - 1));
  ASSERT_FALSE(j["events"].empty());
  EXPECT_EQ(j["events"][0]["id"], next);
  std::set<std::string> kinds;
  for (const json& e : j["events"]) {
    kinds.insert(e["kind"]);
    EXPECT_EQ(e["sequence_id"], "seq-2");
    if (e["kind"] == "block_created") {
      EXPECT_TRUE(e["tag"].is_object());
      EXPECT_TRUE(e["format"].is_string());
    }
  }
  EXPECT_EQ(kinds, (std::set<std::string>{"block_created", "sequence_opened"}));
  EXPECT_EQ(j["next_id"], core_->events().next_id());

  EXPECT_THAT(Error(&Dashboard::Events, "/api/events", "limit=0", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("limit=\"0\" is not an integer in 1..1000"));
  EXPECT_THAT(Error(&Dashboard::Events, "/api/events", "after=-3", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("after=\"-3\""));
  EXPECT_THAT(Error(&Dashboard::Events, "/api/events", "since=3", 400,
                    "INVALID_ARGUMENT"),
              HasSubstr("\"since\""));
}

TEST_F(DashboardTest, PlanIsTheLiveFleetPlanned) {
  // Nothing open: nothing to plan from, said plainly.
  json j = Call(&Dashboard::Plan, "/api/plan", "");
  EXPECT_TRUE(j["rows"].empty());
  EXPECT_THAT(j["reason"].get<std::string>(), HasSubstr("no sequence is open"));

  // 64 tokens under bf16 and 32 under the tenant's default policy
  // (triaxial-static): the context is their mean, 48 tokens, 3 blocks.
  ASSERT_THAT(Open({S(Role::kSystem, 16), S(Role::kUser, 48)}, "acme", "bf16"),
              ::triax::testing::IsOk());
  ASSERT_THAT(Open({S(Role::kSystem, 16), S(Role::kUser, 16)}),
              ::triax::testing::IsOk());
  j = Call(&Dashboard::Plan, "/api/plan", "");
  EXPECT_EQ(j["model"]["name"], "test");
  EXPECT_EQ(j["block_tokens"], 16);
  EXPECT_EQ(j["gpus"], 1);
  EXPECT_EQ(j["gpu_memory_bytes"], 1ull << 40);  // the worker's pool
  EXPECT_EQ(j["open_sequences"], 2);
  EXPECT_EQ(j["open_tokens"], 96);
  EXPECT_EQ(j["context_tokens"], 48);
  EXPECT_EQ(j["tag_mix_tokens"], 96);
  ASSERT_EQ(j["rows"].size(), 4u);
  std::vector<std::string> labels;
  for (const json& r : j["rows"]) labels.push_back(r["label"]);
  EXPECT_EQ(labels, (std::vector<std::string>{"bf16", "fp8", "int4",
                                              "triaxial-static"}));
  const json& bf16 = j["rows"][0];
  EXPECT_EQ(bf16["kind"], "uniform");
  EXPECT_EQ(bf16["page_tokens"], (1ull << 40) / kBf16 * 16);
  EXPECT_EQ(bf16["sessions"], (1ull << 40) / (3 * kBf16));
  EXPECT_EQ(j["rows"][3]["kind"], "rules");
  // More tokens fit at fewer bits.
  EXPECT_GT(j["rows"][2]["page_tokens"].get<int64_t>(),
            j["rows"][1]["page_tokens"].get<int64_t>());
  ASSERT_EQ(j["tenants"].size(), 1u);
  EXPECT_EQ(j["tenants"][0]["tenant_id"], "acme");
  EXPECT_DOUBLE_EQ(j["tenants"][0]["share_bytes"].get<double>(),
                   static_cast<double>(1ull << 40));
  ASSERT_EQ(j["tenants"][0]["rows"].size(), 4u);
  EXPECT_EQ(j["tenants"][0]["rows"][0]["page_tokens"], bf16["page_tokens"]);

  EXPECT_THAT(
      Error(&Dashboard::Plan, "/api/plan", "gpus=2", 400, "INVALID_ARGUMENT"),
      HasSubstr("unknown query parameter \"gpus\""));
}

}  // namespace
}  // namespace triax::manager
