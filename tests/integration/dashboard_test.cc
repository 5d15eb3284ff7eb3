// The manager's live dashboard (kvmanager/dashboard.h) against a real
// cluster: kvmanager with --http_listen and two kvworkers, traffic through
// the client library (two tenants, one with a floor and a ceiling;
// sequences over several turns with system, tool, user, image and assistant
// spans, so their blocks carry several tags and formats; a DemoteBlocks),
// then:
//   - the JSON endpoints over HTTP agree with the gRPC API (a tenant's used
//     bytes, a sequence's block count and tokens), and bad queries get 404
//     and 400 JSON errors naming the id or the parameter;
//   - headless Chromium (Debian's chromium) loads the page, runs its JS
//     (--virtual-time-budget) and dumps the DOM, which must hold the
//     cluster's real numbers: both worker ids, the tenant's used bytes as
//     the API reports them, the sequence id and its block count, the newest
//     event and the ranking head, the live capacity plan's rows (/api/plan);
//     a screenshot is saved (dashboard.png in
//     the working directory, or $TRIAX_DASHBOARD_SCREENSHOT).
// Without chromium on PATH the browser part skips, saying so.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/kv_client.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"
#include "triax/v1/manager.grpc.pb.h"

namespace triax::testing {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using json = nlohmann::json;
using ::testing::HasSubstr;

struct HttpReply {
  int status = 0;
  std::string content_type;
  std::string body;
};

absl::StatusOr<HttpReply> Get(int port, const std::string& target,
                              const std::string& authorization = "") {
  asio::io_context ctx;
  beast::tcp_stream stream(ctx);
  beast::error_code ec;
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                               static_cast<uint16_t>(port)),
                 ec);
  if (ec) return absl::UnavailableError(ec.message());
  http::request<http::empty_body> req(http::verb::get, target, 11);
  req.set(http::field::host, "127.0.0.1");
  if (!authorization.empty()) {
    req.set(http::field::authorization, authorization);
  }
  http::write(stream, req, ec);
  if (ec) return absl::UnavailableError(ec.message());
  beast::flat_buffer buffer;
  http::response<http::string_body> res;
  http::read(stream, buffer, res, ec);
  if (ec) return absl::UnavailableError(ec.message());
  return HttpReply{static_cast<int>(res.result_int()),
                   std::string(res[http::field::content_type]), res.body()};
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The first of `names` that is an executable on PATH; "" when none.
std::string FindOnPath(const std::vector<std::string>& names) {
  const char* path = std::getenv("PATH");
  for (const std::string& name : names) {
    for (absl::string_view dir : absl::StrSplit(path ? path : "", ':')) {
      std::string full = absl::StrCat(dir, "/", name);
      if (access(full.c_str(), X_OK) == 0) return full;
    }
  }
  return "";
}

// Runs `cmd` through the shell; its stdout into *out. Returns the exit
// status (-1 when it did not exit).
int RunShell(const std::string& cmd, std::string* out) {
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

triax::v1::Span SpanOf(triax::v1::Role role, uint32_t n,
                       triax::v1::Modality m = triax::v1::MODALITY_TEXT) {
  triax::v1::Span s = MakeSpan(role, n);
  s.set_modality(m);
  return s;
}

class DashboardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("dashboard_test");
    ASSERT_THAT(dir, IsOk());
    dir_ = std::move(*dir);
    ClusterOptions o;
    o.num_workers = 2;
    o.pool_mb = 8;
    o.window_tokens = 16;
    // Ranks every 50 ms x 10 idle rounds, so the ranking head fills soon.
    o.manager_flags = {"--http_listen=127.0.0.1:0",
                       "--http_port_file=" + dir_->path() + "/m.http",
                       "--pressure_interval_ms=50"};
    o.worker_flags = {"--frame_kb=64"};
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    ASSERT_TRUE(absl::SimpleAtoi(
        absl::StripAsciiWhitespace(ReadAll(dir_->path() + "/m.http")),
        &http_port_));
    ASSERT_GT(http_port_, 0);
  }

  absl::StatusOr<json> GetJson(const std::string& target, int status = 200) {
    auto r = Get(http_port_, target);
    if (!r.ok()) return r.status();
    if (r->status != status || r->content_type != "application/json") {
      return absl::InternalError(absl::StrCat(target, ": HTTP ", r->status, " ",
                                              r->content_type, ": ", r->body));
    }
    json j = json::parse(r->body, nullptr, false);
    if (j.is_discarded()) {
      return absl::InternalError(absl::StrCat(target, ": not JSON: ", r->body));
    }
    return j;
  }

  // Opens `spans` for `c` and writes K/V for every token on every layer.
  absl::StatusOr<client::SequenceHandle> OpenAndWrite(
      client::Client* c, const std::vector<triax::v1::Span>& spans) {
    auto h = c->Open(model_, spans, "", 16);
    if (!h.ok()) return h.status();
    TRIAX_RETURN_IF_ERROR(Write(c, *h, 0, h->num_tokens));
    return h;
  }
  absl::Status Write(client::Client* c, const client::SequenceHandle& h,
                     uint64_t from, uint64_t to) {
    const size_t elems = size_t{model_.n_kv_heads()} * model_.head_dim();
    const uint32_t n = static_cast<uint32_t>(to - from);
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      auto k = RandomVector(n * elems, &rng_);
      auto v = RandomVector(n * elems, &rng_);
      TRIAX_RETURN_IF_ERROR(
          c->WriteKV(h, l, static_cast<uint32_t>(from), n, k.data(), v.data()));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Cluster> cluster_;
  int http_port_ = 0;
  triax::v1::ModelShape model_ = SmallModel();
  std::mt19937 rng_{20260118};
};

TEST_F(DashboardTest, PageShowsTheClustersNumbersInChromium) {
  std::printf("seed 20260118\n");
  using namespace triax::v1;  // NOLINT: the proto enums read better bare
  ASSERT_THAT(cluster_->CreateTenant("acme", 4 << 20), IsOk());
  {
    SetBudgetRequest req;
    req.set_tenant_id("acme");
    req.mutable_budget()->set_tier(TIER_DEVICE);
    req.mutable_budget()->set_floor_bytes(1 << 20);
    req.mutable_budget()->set_ceiling_bytes(4 << 20);
    grpc::ClientContext ctx;
    SetBudgetResponse resp;
    ASSERT_TRUE(cluster_->manager()->SetBudget(&ctx, req, &resp).ok());
  }
  ASSERT_THAT(cluster_->CreateTenant("globex"), IsOk());
  auto acme = cluster_->NewClient("acme");
  ASSERT_THAT(acme, IsOk());
  auto globex = cluster_->NewClient("globex");
  ASSERT_THAT(globex, IsOk());

  // An agent conversation: system prompt, tool schemas, a user turn with an
  // image, then an assistant turn with a tool call and its result, and two
  // more turns, so the blocks span every temporal class.
  auto agent = OpenAndWrite(
      acme->get(),
      {SpanOf(ROLE_SYSTEM, 24), SpanOf(ROLE_TOOL_SCHEMA, 40),
       SpanOf(ROLE_USER, 20), SpanOf(ROLE_USER, 32, MODALITY_IMAGE)});
  ASSERT_THAT(agent, IsOk());
  for (const auto& turn : std::vector<std::vector<Span>>{
           {SpanOf(ROLE_ASSISTANT, 18), SpanOf(ROLE_TOOL_CALL, 12),
            SpanOf(ROLE_TOOL_RESULT, 40)},
           {SpanOf(ROLE_USER, 24), SpanOf(ROLE_ASSISTANT, 36)},
           {SpanOf(ROLE_USER, 20), SpanOf(ROLE_ASSISTANT, 30)}}) {
    const uint64_t from = agent->num_tokens;
    ASSERT_THAT((*acme)->Extend(&*agent, turn, /*new_turn=*/true,
                                /*continue_last_span=*/false),
                IsOk());
    ASSERT_THAT(Write(acme->get(), *agent, from, agent->num_tokens), IsOk());
  }
  // The operator demotes the tool result's first block to INT2.
  uint64_t demoted = 0;
  for (const BlockPlan& b : agent->blocks) {
    if (b.tag().role() == ROLE_TOOL_RESULT) {
      demoted = b.lineage_id();
      break;
    }
  }
  ASSERT_NE(demoted, 0u);
  ASSERT_THAT((*acme)->DemoteBlocks(
                  &*agent, {client::MakeBlockEncoding(demoted, FORMAT_INT2)}),
              IsOk());
  auto chat = OpenAndWrite(globex->get(),
                           {SpanOf(ROLE_SYSTEM, 16), SpanOf(ROLE_USER, 60)});
  ASSERT_THAT(chat, IsOk());
  auto chat2 = OpenAndWrite(acme->get(),
                            {SpanOf(ROLE_SYSTEM, 24), SpanOf(ROLE_USER, 50)});
  ASSERT_THAT(chat2, IsOk());

  // Heartbeats carry the pools' pages, and the pressure loop ranks.
  ASSERT_THAT(Cluster::WaitFor(
                  "workers report their pages and a ranking is published",
                  absl::Seconds(20),
                  [&]() -> absl::StatusOr<bool> {
                    TRIAX_ASSIGN_OR_RETURN(json w, GetJson("/api/workers"));
                    for (const json& x : w["workers"]) {
                      if (x["pools"].empty() || x["used_bytes"] == 0) {
                        return false;
                      }
                    }
                    TRIAX_ASSIGN_OR_RETURN(json p, GetJson("/api/pressure"));
                    return !p["ranked"].empty();
                  }),
              IsOk());

  // The JSON agrees with the gRPC API.
  auto tenants = GetJson("/api/tenants");
  ASSERT_THAT(tenants, IsOk());
  auto acme_info = cluster_->GetTenant("acme");
  ASSERT_THAT(acme_info, IsOk());
  const uint64_t acme_used = acme_info->usage(0).used_bytes();
  ASSERT_GT(acme_used, 0u);
  const json& acme_json = (*tenants)["tenants"][0];
  ASSERT_EQ(acme_json["tenant_id"], "acme");
  EXPECT_EQ(acme_json["tiers"][0]["tier"], "device");
  EXPECT_EQ(acme_json["tiers"][0]["used_bytes"], acme_used);
  EXPECT_EQ(acme_json["tiers"][0]["floor_bytes"], 1 << 20);
  EXPECT_EQ(acme_json["tiers"][0]["ceiling_bytes"], 4 << 20);
  EXPECT_EQ(acme_json["open_sequences"], 2);

  auto seq = GetJson("/api/sequence?id=" + agent->sequence_id);
  ASSERT_THAT(seq, IsOk());
  const size_t blocks = agent->blocks.size();
  ASSERT_EQ((*seq)["blocks"].size(), blocks);
  EXPECT_EQ((*seq)["num_tokens"], agent->num_tokens);
  EXPECT_EQ((*seq)["turns"], 4);
  bool saw_int2 = false;
  std::set<std::string> temporals, formats;
  for (const json& b : (*seq)["blocks"]) {
    temporals.insert(b["tag"]["temporal"]);
    formats.insert(b["format"]);
    saw_int2 |= b["lineage_id"] == demoted && b["format"] == "int2";
  }
  EXPECT_TRUE(saw_int2);
  EXPECT_EQ(temporals, (std::set<std::string>{"sink", "older", "recent_turns",
                                              "current_turn"}));
  EXPECT_GE(formats.size(), 2u);

  auto workers = GetJson("/api/workers");
  ASSERT_THAT(workers, IsOk());
  ASSERT_EQ((*workers)["workers"].size(), 2u);
  EXPECT_EQ((*workers)["workers"][0]["worker_id"], "w0");
  EXPECT_EQ((*workers)["workers"][1]["worker_id"], "w1");

  // The live plan: the fleet as it stands (two workers, the three open
  // sequences' model, tag mix and policy), per policy and tenant.
  auto plan = GetJson("/api/plan");
  ASSERT_THAT(plan, IsOk());
  const uint64_t pool = (*workers)["workers"][0]["capacity_bytes"];
  EXPECT_EQ((*plan)["gpus"], 2);
  EXPECT_EQ((*plan)["gpu_memory_bytes"], pool);
  EXPECT_EQ((*plan)["open_sequences"], 3);
  EXPECT_EQ((*plan)["model"]["name"], model_.name());
  std::vector<std::string> plan_rows;
  for (const json& r : (*plan)["rows"]) plan_rows.push_back(r["label"]);
  EXPECT_EQ(plan_rows, (std::vector<std::string>{"bf16", "fp8", "int4",
                                                 "triaxial-static"}));
  // BF16: 2 bytes a value, K and V, every layer; whole 16-token blocks.
  const uint64_t bf16_block = 16ull * model_.n_layers() * 2 *
                              model_.n_kv_heads() * model_.head_dim() * 2;
  const uint64_t bf16_tokens = pool / bf16_block * 16 * 2;
  EXPECT_EQ((*plan)["rows"][0]["page_tokens"], bf16_tokens);
  ASSERT_EQ((*plan)["tenants"].size(), 2u);
  EXPECT_EQ((*plan)["tenants"][0]["tenant_id"], "acme");

  auto events = GetJson("/api/events?limit=1");
  ASSERT_THAT(events, IsOk());
  ASSERT_EQ((*events)["events"].size(), 1u);
  const uint64_t newest = (*events)["events"][0]["id"];

  // Bad queries over HTTP: JSON errors naming what is wrong.
  auto missing = GetJson("/api/sequence?id=seq-424242", 404);
  ASSERT_THAT(missing, IsOk());
  EXPECT_THAT((*missing)["error"]["message"].get<std::string>(),
              HasSubstr("seq-424242"));
  auto bad_top = GetJson("/api/pressure?top=lots", 400);
  ASSERT_THAT(bad_top, IsOk());
  EXPECT_THAT((*bad_top)["error"]["message"].get<std::string>(),
              HasSubstr("top=\"lots\""));
  auto bad_token = GetJson("/api/sequences?page_token=zzz", 400);
  ASSERT_THAT(bad_token, IsOk());
  EXPECT_THAT((*bad_token)["error"]["message"].get<std::string>(),
              HasSubstr("page_token"));
  auto page = Get(http_port_, "/");
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->content_type, "text/html; charset=utf-8");

  // The page in a real browser.
  const std::string chromium = FindOnPath({"chromium", "chromium-browser"});
  if (chromium.empty()) {
    GTEST_SKIP() << "chromium is not on PATH (Debian's chromium package; "
                    "scripts/install_deps.sh installs it): the page was not "
                    "loaded in a browser";
  }
  const std::string url = absl::StrCat("http://127.0.0.1:", http_port_,
                                       "/?seq=", agent->sequence_id);
  // --virtual-time-budget lets the page's fetches and first renders run
  // before the DOM is dumped or the screenshot taken.
  const std::string flags = absl::StrCat(
      "--headless --disable-gpu --no-sandbox --no-first-run "
      "--disable-extensions --user-data-dir=",
      dir_->path(), "/chromium --window-size=1400,1000 ",
      "--virtual-time-budget=8000 --hide-scrollbars");
  std::string dom;
  ASSERT_EQ(RunShell(absl::StrCat("timeout 120 ", chromium, " ", flags,
                                  " --dump-dom '", url, "' 2>/dev/null"),
                     &dom),
            0);
  // What the page rendered, not its script's text.
  dom = dom.substr(0, dom.find("<script>"));
  EXPECT_THAT(dom, HasSubstr("data-worker-id=\"w0\""));
  EXPECT_THAT(dom, HasSubstr("data-worker-id=\"w1\""));
  EXPECT_THAT(
      dom, HasSubstr(absl::StrCat("data-tenant=\"acme\" data-tier=\"device\" "
                                  "data-used-bytes=\"",
                                  acme_used, "\"")));
  EXPECT_THAT(dom, HasSubstr("data-tenant-id=\"globex\""));
  EXPECT_THAT(dom, HasSubstr(absl::StrCat("<span id=\"seq-id\">",
                                          agent->sequence_id, "</span>")));
  EXPECT_THAT(dom, HasSubstr(absl::StrCat("<span id=\"seq-block-count\">",
                                          blocks, "</span>")));
  EXPECT_THAT(dom, HasSubstr(absl::StrCat("data-event-id=\"", newest, "\"")));
  EXPECT_THAT(dom, HasSubstr("data-lane=\"temporal\""));
  EXPECT_THAT(
      dom, HasSubstr(absl::StrCat("data-plan-row=\"bf16\" data-page-tokens=\"",
                                  bf16_tokens, "\"")));
  EXPECT_THAT(dom, HasSubstr("data-plan-row=\"triaxial-static\""));
  EXPECT_THAT(dom, HasSubstr("data-plan-tenant=\"globex\""));
  // One model, one table, few tenants: nothing was left out of the plan.
  EXPECT_THAT(dom, HasSubstr("<div id=\"plan-notes\" class=\"mute\"></div>"));
  EXPECT_THAT(dom, HasSubstr("live · updated"));
  EXPECT_THAT(dom, ::testing::Not(HasSubstr("no ranking yet")));
  EXPECT_THAT(dom, ::testing::Not(HasSubstr("cannot reach the manager")));

  const char* env = std::getenv("TRIAX_DASHBOARD_SCREENSHOT");
  std::string shot = env != nullptr && *env != '\0' ? env : "";
  if (shot.empty()) {
    char cwd[4096];
    ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
    shot = absl::StrCat(cwd, "/dashboard.png");
  }
  std::remove(shot.c_str());
  std::string ignored;
  ASSERT_EQ(RunShell(absl::StrCat("timeout 120 ", chromium, " ", flags,
                                  " --screenshot='", shot, "' '", url,
                                  "' >/dev/null 2>&1"),
                     &ignored),
            0);
  const std::string png = ReadAll(shot);
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::printf("screenshot: %s (%zu bytes)\n", shot.c_str(), png.size());
}

// With --auth=token the JSON routes answer only an admin bearer token; the
// page itself (which sends the token of its URL fragment) stays open.
TEST(DashboardAuthTest, TheJsonNeedsAnAdminToken) {
  ClusterOptions o;
  o.num_workers = 0;
  o.manager_flags = {"--auth=token", "--admin_token_file=$DIR/admin.token",
                     "--http_listen=127.0.0.1:0",
                     "--http_port_file=$DIR/m.http"};
  auto c = Cluster::Start(o);
  ASSERT_THAT(c, IsOk());
  const std::string dir = (*c)->dir();
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      absl::StripAsciiWhitespace(ReadAll(dir + "/m.http")), &port));
  const std::string admin(
      absl::StripAsciiWhitespace(ReadAll(dir + "/admin.token")));
  // A tenant and its token, through the manager's RPCs as admin.
  auto stub = v1::Manager::NewStub(grpc::CreateChannel(
      (*c)->manager_address(), grpc::InsecureChannelCredentials()));
  std::string tenant_token;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + admin);
    v1::CreateTenantRequest req;
    req.set_tenant_id("acme");
    v1::CreateTenantResponse resp;
    ASSERT_TRUE(stub->CreateTenant(&ctx, req, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + admin);
    v1::IssueTokenRequest req;
    req.set_role("tenant");
    req.set_tenant_id("acme");
    v1::IssueTokenResponse resp;
    ASSERT_TRUE(stub->IssueToken(&ctx, req, &resp).ok());
    tenant_token = resp.token();
  }
  for (const char* path : {"/api/workers", "/api/tenants", "/api/pressure",
                           "/api/events", "/api/sequences", "/api/plan"}) {
    SCOPED_TRACE(path);
    auto none = Get(port, path);
    ASSERT_THAT(none, IsOk());
    EXPECT_EQ(none->status, 401);
    EXPECT_THAT(none->body, HasSubstr("Authorization: Bearer"));
    auto forged = Get(port, path,
                      "Bearer " + admin.substr(0, admin.size() - 1) +
                          (admin.back() == 'A' ? "B" : "A"));
    ASSERT_THAT(forged, IsOk());
    EXPECT_EQ(forged->status, 401);
    auto tenant = Get(port, path, "Bearer " + tenant_token);
    ASSERT_THAT(tenant, IsOk());
    EXPECT_EQ(tenant->status, 403);
    EXPECT_THAT(tenant->body, HasSubstr("is not an admin token"));
    auto ok = Get(port, path, "Bearer " + admin);
    ASSERT_THAT(ok, IsOk());
    EXPECT_EQ(ok->status, 200) << ok->body;
    EXPECT_NO_THROW(json::parse(ok->body));
  }
  auto tenants = Get(port, "/api/tenants", "Bearer " + admin);
  ASSERT_THAT(tenants, IsOk());
  EXPECT_THAT(tenants->body, HasSubstr("acme"));
  auto page = Get(port, "/");
  ASSERT_THAT(page, IsOk());
  EXPECT_EQ(page->status, 200);
  EXPECT_THAT(page->body, HasSubstr("#token="));
}

}  // namespace
}  // namespace triax::testing
