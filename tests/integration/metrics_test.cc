// The operator HTTP endpoints of real kvmanager and kvworker processes
// (--http_listen): traffic through the client library (open, write, attend,
// close, an Open the tenant's ceiling refuses, Opens admitted only after
// the manager reclaims), then /metrics scraped over HTTP from both: the
// named series move as the traffic says, and `promtool check metrics`
// accepts both live scrapes. /healthz and /readyz answer 200; bad requests
// get 404, 405 and 400 and the servers go on serving; a stalled
// (slow-loris) connection does not hold a scrape up.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "tests/integration/cluster.h"
#include "tests/integration/http_scrape.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using ::testing::HasSubstr;
using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

bool OnPath(const std::string& binary) {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path ? path : "", ':')) {
    if (access(absl::StrCat(dir, "/", binary).c_str(), X_OK) == 0) return true;
  }
  return false;
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("metrics_test");
    ASSERT_THAT(dir, IsOk());
    dir_ = std::move(*dir);
    ClusterOptions o;
    o.pool_mb = 1;
    o.window_tokens = 0;
    // No background loop: every reclaim here is the admission path's.
    o.manager_flags = {"--http_listen=127.0.0.1:0",
                       "--http_port_file=" + dir_->path() + "/m.http",
                       "--pressure_interval_ms=0", "--window_guard_tokens=0"};
    o.worker_flags = {"--frame_kb=16", "--http_listen=127.0.0.1:0",
                      "--http_port_file=" + dir_->path() + "/w0.http"};
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    manager_http_ = PortFromFile(dir_->path() + "/m.http");
    worker_http_ = PortFromFile(dir_->path() + "/w0.http");
    ASSERT_GT(manager_http_, 0);
    ASSERT_GT(worker_http_, 0);
  }

  Scrape ScrapeOf(int port, std::string* text = nullptr) {
    auto r = HttpGet(port, "/metrics");
    EXPECT_THAT(r, IsOk());
    if (!r.ok()) return {};
    EXPECT_EQ(r->status, 200);
    if (text != nullptr) *text = r->body;
    return ParseScrape(r->body);
  }

  // Opens a sequence of `tokens` (system 16 + user) and writes every layer.
  absl::StatusOr<client::SequenceHandle> OpenAndWrite(client::Client* c,
                                                      uint32_t tokens) {
    auto h = c->Open(
        model_, {MakeSpan(ROLE_SYSTEM, 16), MakeSpan(ROLE_USER, tokens - 16)},
        "", 16);
    if (!h.ok()) return h.status();
    const size_t elems = size_t{model_.n_kv_heads()} * model_.head_dim();
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      auto k = RandomVector(tokens * elems, &rng_);
      auto v = RandomVector(tokens * elems, &rng_);
      if (absl::Status s = c->WriteKV(*h, l, 0, tokens, k.data(), v.data());
          !s.ok()) {
        return s;
      }
    }
    return h;
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Cluster> cluster_;
  int manager_http_ = 0;
  int worker_http_ = 0;
  triax::v1::ModelShape model_ = SmallModel();
  std::mt19937 rng_{20261125};
};

TEST_F(MetricsTest, SeriesFollowTrafficAndPromtoolAcceptsTheScrapes) {
  std::printf("seed 20261125\n");
  const uint64_t block = 2 * kernels::PageBytes(kernels::Format::kBF16,
                                                kernels::PageShape{16, 2, 32});
  ASSERT_THAT(cluster_->CreateTenant("acme", 40 * block, "bf16"), IsOk());
  ASSERT_THAT(cluster_->CreateTenant("tiny", 2 * block, "bf16"), IsOk());
  auto acme = cluster_->NewClient("acme");
  ASSERT_THAT(acme, IsOk());
  auto tiny = cluster_->NewClient("tiny");
  ASSERT_THAT(tiny, IsOk());

  const Scrape m0 = ScrapeOf(manager_http_);
  const Scrape w0 = ScrapeOf(worker_http_);
  EXPECT_EQ(SumSeries(m0, "triaxkv_manager_workers", {"state=\"up\""}), 1);
  EXPECT_EQ(SumSeries(m0, "triaxkv_manager_blocks"), 0);
  EXPECT_EQ(SumSeries(w0, "triaxkv_worker_pool_used_bytes"), 0);
  EXPECT_EQ(SumSeries(w0, "triaxkv_worker_pool_capacity_bytes"), 1 << 20);

  // One session: open, write, attend twice, keep it open.
  auto first = OpenAndWrite(acme->get(), 192);
  ASSERT_THAT(first, IsOk());
  const uint64_t pos = 191;
  auto q = RandomVector(size_t{model_.n_q_heads()} * model_.head_dim(), &rng_);
  std::vector<float> out(q.size());
  client::Client::AttendArgs a;
  a.num_queries = 1;
  a.positions = &pos;
  a.q = q.data();
  a.out = out.data();
  for (uint32_t layer = 0; layer < 2; ++layer) {
    a.layer = layer;
    ASSERT_THAT((*acme)->Attend(*first, a), IsOk());
  }
  const Scrape m1 = ScrapeOf(manager_http_);
  const Scrape w1 = ScrapeOf(worker_http_);
  const std::string open_ok =
      "triaxkv_manager_rpc_requests_total{code=\"OK\",method="
      "\"OpenSequence\",service=\"triax.v1.Manager\"}";
  EXPECT_EQ(SumSeries(m1, open_ok), 1);
  EXPECT_EQ(SumSeries(m1, "triaxkv_manager_blocks", {"tenant=\"acme\""}), 12);
  EXPECT_EQ(
      SumSeries(m1, "triaxkv_manager_block_bytes",
                {"tenant=\"acme\"", "tier=\"device\"", "encoding=\"bf16\""}),
      12 * block);
  auto tenant = cluster_->GetTenant("acme");
  ASSERT_THAT(tenant, IsOk());
  EXPECT_EQ(SumSeries(m1, "triaxkv_manager_tenant_used_bytes",
                      {"tenant=\"acme\"", "tier=\"device\""}),
            tenant->usage(0).used_bytes());
  EXPECT_EQ(
      SumSeries(m1, "triaxkv_manager_events_total", {"kind=\"block_created\""}),
      12);
  EXPECT_EQ(SumSeries(w1, "triaxkv_worker_rpc_requests_total",
                      {"method=\"Attend\"", "code=\"OK\""}),
            2);
  EXPECT_GT(SumSeries(w1, "triaxkv_worker_rpc_requests_total",
                      {"method=\"WriteKV\"", "code=\"OK\""}),
            0);
  EXPECT_EQ(SumSeries(w1, "triaxkv_worker_rpc_duration_seconds_count",
                      {"method=\"Attend\"", "code=\"OK\""}),
            2);
  // Each Attend ran one device batch over BF16 pages only.
  EXPECT_EQ(SumSeries(w1, "triaxkv_worker_attention_seconds_count",
                      {"formats=\"bf16\""}),
            2);
  EXPECT_GT(SumSeries(w1, "triaxkv_worker_attention_pages_total",
                      {"format=\"bf16\""}),
            0);
  EXPECT_EQ(
      SumSeries(w1, "triaxkv_worker_encoding_pages", {"encoding=\"bf16\""}),
      24);  // 12 blocks on 2 layers
  EXPECT_EQ(SumSeries(w1, "triaxkv_worker_sequences"), 1);
  EXPECT_GT(SumSeries(w1, "triaxkv_worker_pool_used_bytes"), 0);

  // An Open over the tiny tenant's ceiling is refused (nothing of its own
  // to reclaim).
  EXPECT_EQ(OpenAndWrite(tiny->get(), 192).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Five more sessions of 12 blocks: 72 > 40 blocks of ceiling, so the
  // later Opens are admitted after reclaiming acme's own blocks.
  for (int i = 0; i < 5; ++i) {
    ASSERT_THAT(OpenAndWrite(acme->get(), 192), IsOk()) << i;
  }
  const Scrape m2 = ScrapeOf(manager_http_);
  EXPECT_EQ(SumSeries(m2, "triaxkv_manager_admission_refusals_total",
                      {"method=\"OpenSequence\""}),
            1);
  EXPECT_EQ(
      SumSeries(m2, "triaxkv_manager_rpc_requests_total",
                {"method=\"OpenSequence\"", "code=\"RESOURCE_EXHAUSTED\""}),
      1);
  EXPECT_EQ(SumSeries(m2, open_ok), 6);
  const double actions = SumSeries(m2, "triaxkv_manager_pressure_actions_total",
                                   {"action=\"demote\""}) +
                         SumSeries(m2, "triaxkv_manager_pressure_actions_total",
                                   {"action=\"evict\""});
  EXPECT_GT(actions, 0);
  EXPECT_EQ(SumSeries(m2, "triaxkv_manager_events_total",
                      {"kind=\"block_demoted\""}) +
                SumSeries(m2, "triaxkv_manager_events_total",
                          {"kind=\"block_evicted\""}),
            actions);
  tenant = cluster_->GetTenant("acme");
  ASSERT_THAT(tenant, IsOk());
  EXPECT_EQ(SumSeries(m2, "triaxkv_manager_block_bytes", {"tenant=\"acme\""}),
            tenant->usage(0).used_bytes());
  EXPECT_LE(tenant->usage(0).used_bytes(), 40 * block);
  EXPECT_EQ(SumSeries(m2, "triaxkv_manager_tenant_ceiling_bytes",
                      {"tenant=\"acme\"", "tier=\"device\""}),
            40 * block);

  // promtool's linter on both live scrapes.
  std::string manager_text, worker_text;
  ScrapeOf(manager_http_, &manager_text);
  ScrapeOf(worker_http_, &worker_text);
  if (!OnPath("promtool")) {
    std::printf(
        "SKIPPED promtool check: promtool is not on PATH (Debian's "
        "prometheus package; scripts/install_deps.sh installs it)\n");
  } else {
    for (const auto& [name, text] : {std::make_pair("manager", &manager_text),
                                     std::make_pair("worker", &worker_text)}) {
      const std::string path = absl::StrCat(dir_->path(), "/", name, ".prom");
      std::ofstream(path) << *text;
      const std::string cmd =
          absl::StrCat("promtool check metrics < ", path, " 2>&1");
      FILE* p = popen(cmd.c_str(), "r");
      ASSERT_NE(p, nullptr);
      std::string said;
      char buf[512];
      while (fgets(buf, sizeof(buf), p) != nullptr) said += buf;
      const int status = pclose(p);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << name << ": promtool check metrics said:\n"
          << said;
    }
  }
}

TEST_F(MetricsTest, ClosingFreesTheWorkersPages) {
  ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
  auto acme = cluster_->NewClient("acme");
  ASSERT_THAT(acme, IsOk());
  auto h = OpenAndWrite(acme->get(), 64);
  ASSERT_THAT(h, IsOk());
  EXPECT_EQ(SumSeries(ScrapeOf(worker_http_), "triaxkv_worker_sequences"), 1);
  ASSERT_THAT((*acme)->Close(*h), IsOk());
  const Scrape m = ScrapeOf(manager_http_);
  EXPECT_EQ(SumSeries(m, "triaxkv_manager_blocks"), 0);
  EXPECT_EQ(
      SumSeries(m, "triaxkv_manager_events_total", {"kind=\"block_freed\""}),
      4);
  EXPECT_EQ(SumSeries(m, "triaxkv_manager_rpc_requests_total",
                      {"method=\"CloseSequence\"", "code=\"OK\""}),
            1);
  // The worker frees on the client's FreePages.
  const Scrape w = ScrapeOf(worker_http_);
  EXPECT_EQ(SumSeries(w, "triaxkv_worker_sequences"), 0);
  EXPECT_EQ(SumSeries(w, "triaxkv_worker_pool_used_bytes"), 0);
}

TEST_F(MetricsTest, ProbesAndBadRequests) {
  for (int port : {manager_http_, worker_http_}) {
    auto health = HttpGet(port, "/healthz");
    ASSERT_THAT(health, IsOk());
    EXPECT_EQ(health->status, 200);
    EXPECT_EQ(health->body, "ok\n");
    auto ready = HttpGet(port, "/readyz");
    ASSERT_THAT(ready, IsOk());
    EXPECT_EQ(ready->status, 200) << ready->body;

    auto missing = HttpGet(port, "/metricz");
    ASSERT_THAT(missing, IsOk());
    EXPECT_EQ(missing->status, 404);
    auto post = HttpExchange(port,
                             "POST /metrics HTTP/1.1\r\nHost: t\r\n"
                             "Content-Length: 0\r\nConnection: close\r\n\r\n");
    ASSERT_THAT(post, IsOk());
    EXPECT_EQ(post->status, 405);
    EXPECT_EQ(post->allow, "GET");
    auto garbage = HttpExchange(port, "NOT HTTP AT ALL\r\n\r\n");
    ASSERT_THAT(garbage, IsOk());
    EXPECT_EQ(garbage->status, 400);
    auto oversized =
        HttpExchange(port, absl::StrCat("GET /", std::string(20000, 'x'),
                                        " HTTP/1.1\r\nHost: t\r\n\r\n"));
    ASSERT_THAT(oversized, IsOk());
    EXPECT_EQ(oversized->status, 400);
    EXPECT_THAT(oversized->body, HasSubstr("header limit"));

    // A stalled connection (half a request line) does not hold up a scrape.
    asio::io_context ctx;
    tcp::socket slow(ctx);
    slow.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                               static_cast<uint16_t>(port)));
    asio::write(slow, asio::buffer(std::string("GET /metr")));
    auto scrape = HttpGet(port, "/metrics");
    ASSERT_THAT(scrape, IsOk());
    EXPECT_EQ(scrape->status, 200);
    EXPECT_THAT(scrape->body, HasSubstr("# TYPE triaxkv_"));
  }
}

TEST_F(MetricsTest, AnHttpPortInUseFailsStartUp) {
  std::string out, err;
  auto code =
      RunToCompletion("kvmanager",
                      {"--listen=127.0.0.1:0",
                       absl::StrCat("--http_listen=127.0.0.1:", manager_http_)},
                      dir_->path(), &out, &err);
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(
      err, HasSubstr(absl::StrCat("--http_listen=127.0.0.1:", manager_http_)));
  EXPECT_THAT(err, HasSubstr("in use"));
  code =
      RunToCompletion("kvworker",
                      {"--listen=127.0.0.1:0", "--backend=cpu", "--pool_mb=1",
                       absl::StrCat("--http_listen=127.0.0.1:", worker_http_)},
                      dir_->path(), &out, &err);
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(
      err, HasSubstr(absl::StrCat("--http_listen=127.0.0.1:", worker_http_)));
  // The running daemons still answer.
  auto r = HttpGet(manager_http_, "/healthz");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->status, 200);
}

}  // namespace
}  // namespace triax::testing
