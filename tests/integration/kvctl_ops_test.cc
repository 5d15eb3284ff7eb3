// kvctl's operator views against a live manager and workers: a block's
// lifecycle (created, demoted, transferred across workers, freed) written as
// a Chrome trace and read back with a JSON parser; `kvctl top` and
// `kvctl pressure --watch` frames with the real tenant and worker numbers;
// their bad flags as usage errors (exit 2).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using json = nlohmann::json;
namespace v1 = triax::v1;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kTenant[] = "ops";

class KvctlViewsTest : public ::testing::Test {
 protected:
  void Start(int workers) {
    ClusterOptions o;
    o.num_workers = workers;
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    ASSERT_THAT(cluster_->CreateTenant(kTenant), IsOk());
    auto cl = cluster_->NewClient(kTenant);
    ASSERT_THAT(cl, IsOk());
    client_ = std::move(*cl);
  }

  int Kvctl(std::vector<std::string> args) {
    args.insert(args.begin(), "--manager=" + cluster_->manager_address());
    auto rc = RunToCompletion("kvctl", args, cluster_->dir(), &out_, &err_,
                              absl::Seconds(30));
    EXPECT_THAT(rc, IsOk());
    return rc.ok() ? *rc : -1;
  }

  // A written sequence of `tokens` tokens (system then user span).
  client::SequenceHandle OpenWritten(uint32_t tokens) {
    const v1::ModelShape model = SmallModel();
    auto h = client_->Open(model,
                           {MakeSpan(v1::ROLE_SYSTEM, tokens / 2),
                            MakeSpan(v1::ROLE_USER, tokens - tokens / 2)},
                           "bf16", 16);
    EXPECT_THAT(h, IsOk());
    if (!h.ok()) return {};
    std::mt19937 rng(18);
    const size_t elems = size_t{model.n_kv_heads()} * model.head_dim();
    for (uint32_t l = 0; l < model.n_layers(); ++l) {
      auto k = RandomVector(tokens * elems, &rng);
      auto v = RandomVector(tokens * elems, &rng);
      EXPECT_THAT(client_->WriteKV(*h, l, 0, tokens, k.data(), v.data()),
                  IsOk());
    }
    return *h;
  }

  json ReadJson(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << path << "\n" << ss.str();
    return j;
  }

  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<client::Client> client_;
  std::string out_, err_;
};

// pid -> process name, and the trace events of phase `ph`.
std::map<int, std::string> Processes(const json& t) {
  std::map<int, std::string> out;
  for (const json& e : t["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") {
      out[e["pid"].get<int>()] = e["args"]["name"].get<std::string>();
    }
  }
  return out;
}
std::vector<json> Phase(const json& t, const std::string& ph) {
  std::vector<json> out;
  for (const json& e : t["traceEvents"]) {
    if (e["ph"] == ph) out.push_back(e);
  }
  return out;
}

TEST_F(KvctlViewsTest, ChromeTraceShowsABlockDemotedTransferredAndFreed) {
  Start(2);
  client::SequenceHandle h = OpenWritten(48);
  ASSERT_FALSE(h.sequence_id.empty());
  const uint64_t lineage = h.blocks[1].lineage_id();
  // Block 0 is sealed (48 tokens written, a 32-token window): its worker
  // reports the seal with its next heartbeat (every 100 ms here).
  const uint64_t sealed = h.blocks[0].lineage_id();
  ASSERT_THAT(
      Cluster::WaitFor(
          "block 0 sealed", absl::Seconds(10),
          [&]() -> absl::StatusOr<bool> {
            v1::QueryTraceRequest req;
            req.set_lineage_id(sealed);
            v1::QueryTraceResponse resp;
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::seconds(5));
            if (!cluster_->manager()->QueryTrace(&ctx, req, &resp).ok()) {
              return false;
            }
            for (const auto& e : resp.events()) {
              if (e.kind() == v1::EVENT_BLOCK_SEALED) return true;
            }
            return false;
          }),
      IsOk());
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  const std::string src = info->worker_id();
  const std::string dst = src == "w0" ? "w1" : "w0";

  ASSERT_EQ(Kvctl({"demote", h.sequence_id, absl::StrCat(lineage), "int4",
                   absl::StrCat("--tenant=", kTenant)}),
            0)
      << err_;
  ASSERT_EQ(Kvctl({"transfer", h.sequence_id, "--to=" + dst}), 0) << err_;
  ASSERT_THAT(client_->Close(h), IsOk());

  const std::string file = cluster_->dir() + "/lineage.json";
  ASSERT_EQ(Kvctl({"trace", absl::StrCat(lineage), "--chrome_trace=" + file}),
            0)
      << err_;
  EXPECT_THAT(out_, HasSubstr("chrome trace: " + file));
  const json t = ReadJson(file);
  // One process per worker the block was on.
  std::map<int, std::string> procs = Processes(t);
  int src_pid = 0, dst_pid = 0;
  for (const auto& [pid, name] : procs) {
    if (name == "worker " + src) src_pid = pid;
    if (name == "worker " + dst) dst_pid = pid;
  }
  ASSERT_NE(src_pid, 0) << t.dump();
  ASSERT_NE(dst_pid, 0) << t.dump();

  // Its spans: bf16 then int4 on the source, int4 on the destination until
  // freed; all the real lineage's.
  std::vector<std::tuple<int, std::string, std::string>> spans;
  for (const json& x : Phase(t, "X")) {
    EXPECT_EQ(x["args"]["lineage_id"], lineage);
    EXPECT_EQ(x["args"]["sequence_id"], h.sequence_id);
    EXPECT_EQ(x["args"]["tier"], "device");
    spans.emplace_back(x["pid"].get<int>(), x["name"].get<std::string>(),
                       x["args"]["closed_by"].get<std::string>());
  }
  EXPECT_THAT(spans, ::testing::ElementsAre(
                         std::make_tuple(src_pid, "bf16", "BLOCK_DEMOTED"),
                         std::make_tuple(src_pid, "int4", "BLOCK_TRANSFERRED"),
                         std::make_tuple(dst_pid, "int4", "BLOCK_FREED")))
      << t.dump();
  std::vector<std::string> instants;
  for (const json& i : Phase(t, "i")) {
    instants.push_back(i["name"].get<std::string>());
  }
  EXPECT_THAT(instants,
              ::testing::ElementsAre("created", "demoted", "transferred",
                                     "released", "freed"));
  // The transfer as a flow from the source's track to the destination's.
  ASSERT_EQ(Phase(t, "s").size(), 1u);
  ASSERT_EQ(Phase(t, "f").size(), 1u);
  EXPECT_EQ(Phase(t, "s")[0]["pid"], src_pid);
  EXPECT_EQ(Phase(t, "f")[0]["pid"], dst_pid);

  // kvctl events: the sequence's events, its own instants on the event
  // tracks, and the same block spans.
  const std::string seq_file = cluster_->dir() + "/sequence.json";
  ASSERT_EQ(Kvctl({"events", "--sequence=" + h.sequence_id,
                   "--chrome_trace=" + seq_file}),
            0)
      << err_;
  EXPECT_THAT(out_, HasSubstr("kind=SEQUENCE_OPENED"));
  const json s = ReadJson(seq_file);
  std::set<std::string> names;
  for (const json& i : Phase(s, "i")) names.insert(i["name"]);
  for (const char* n :
       {"sequence_opened", "transfer_started", "sequence_transferred",
        "sequence_closed", "created", "demoted", "transferred", "freed"}) {
    EXPECT_TRUE(names.count(n)) << n << " missing in " << s.dump();
  }
  size_t lineage_spans = 0;
  for (const json& x : Phase(s, "X")) {
    if (x["args"]["lineage_id"] == lineage) ++lineage_spans;
  }
  EXPECT_EQ(lineage_spans, 3u);
  // Block 0's path starts with its seal: the span of its writing closes at
  // BLOCK_SEALED on the source, the next opens there.
  std::vector<std::string> sealed_spans;
  for (const json& x : Phase(s, "X")) {
    if (x["args"]["lineage_id"] != sealed) continue;
    sealed_spans.push_back(x["args"]["opened_by"].get<std::string>() + ">" +
                           x["args"]["closed_by"].get<std::string>());
  }
  EXPECT_THAT(sealed_spans,
              ::testing::ElementsAre("BLOCK_CREATED>BLOCK_SEALED",
                                     "BLOCK_SEALED>BLOCK_TRANSFERRED",
                                     "BLOCK_TRANSFERRED>BLOCK_FREED"))
      << s.dump();
  EXPECT_TRUE(names.count("sealed"));

  // A window after everything: no events, an empty trace.
  const std::string later =
      absl::StrCat(absl::ToUnixSeconds(absl::Now()) + 3600);
  const std::string empty_file = cluster_->dir() + "/empty.json";
  ASSERT_EQ(
      Kvctl({"events", "--since=" + later, "--chrome_trace=" + empty_file}), 0)
      << err_;
  EXPECT_TRUE(ReadJson(empty_file)["traceEvents"].empty());
  // A window that holds them (RFC 3339 until).
  ASSERT_EQ(
      Kvctl({"events", "--from=1", "--since=0", "--until=2100-01-01T00:00:00Z",
             "--sequence=" + h.sequence_id, "--max=1"}),
      0)
      << err_;
  EXPECT_THAT(out_, HasSubstr("sequence=" + h.sequence_id));

  // Bad input: usage errors naming the flag and value.
  EXPECT_EQ(Kvctl({"events", "--since=yesterday"}), 2);
  EXPECT_THAT(err_, HasSubstr("--since=\"yesterday\""));
  EXPECT_EQ(Kvctl({"events", "--since=200", "--until=100"}), 2);
  EXPECT_THAT(err_, HasSubstr("is after --until=100"));
  EXPECT_EQ(Kvctl({"trace", absl::StrCat(lineage),
                   "--chrome_trace=" + cluster_->dir() + "/no/such/dir.json"}),
            1);
  EXPECT_THAT(err_, HasSubstr("cannot write --chrome_trace="));
}

// The frames of a plain (non-TTY) run, split at the "---" lines.
std::vector<std::string> Frames(const std::string& out) {
  return absl::StrSplit(out, "\n---\n");
}

TEST_F(KvctlViewsTest, TopAndPressureWatchDrawFramesWithTheLiveNumbers) {
  Start(1);
  // kvctl top runs on; the sequence opens once its first frame is out, so
  // the second frame (5 s later) shows it.
  auto top = Process::Start("kvctl-top", "kvctl",
                            {"--manager=" + cluster_->manager_address(), "top",
                             "--count=2", "--interval=5"},
                            cluster_->dir(), /*with_port_file=*/false);
  ASSERT_THAT(top, IsOk());
  ASSERT_THAT(Cluster::WaitFor("kvctl top's first frame", absl::Seconds(20),
                               [&]() -> absl::StatusOr<bool> {
                                 return absl::StrContains((*top)->Log(20000),
                                                          "prefix_hits/s=");
                               }),
              IsOk());
  EXPECT_THAT((*top)->Log(20000), Not(HasSubstr("\n---\n")))
      << "the second frame came before the sequence opened";
  client::SequenceHandle h = OpenWritten(48);
  auto rc = (*top)->Wait(absl::Seconds(30));
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 0) << (*top)->Log();
  const std::string out = (*top)->Log(100000);
  EXPECT_THAT(out, Not(HasSubstr("\x1b["))) << "ANSI codes off a terminal";
  std::vector<std::string> frames = Frames(out);
  ASSERT_EQ(frames.size(), 2u) << out;
  EXPECT_THAT(frames[0], HasSubstr("rates: - (first frame)"));
  EXPECT_THAT(frames[0], ContainsRegex("\nw0 +up +0 "));
  EXPECT_THAT(frames[0], ContainsRegex("\nops +0 +0 B "));
  EXPECT_THAT(frames[1], HasSubstr("rates over "));
  EXPECT_THAT(frames[1], ContainsRegex("\nw0 +up +1 "));
  // The tenant's device bytes grew by the sequence's.
  EXPECT_THAT(frames[1],
              ContainsRegex("\nops +1 +[0-9.]+ [KM]iB +\\+[0-9.]+ "));
  for (const std::string& f : frames) {
    EXPECT_THAT(f, HasSubstr("WORKERS\nWORKER  STATE"));
    EXPECT_THAT(f, HasSubstr("TENANTS\nTENANT"));
    EXPECT_THAT(f, HasSubstr("PRESSURE\nmode="));
  }
  EXPECT_THAT(frames[1], ContainsRegex("\nw0 +bf16 +[1-9][0-9]* "));

  ASSERT_EQ(Kvctl({"pressure", "--watch", "--count=2", "--interval=0.2"}), 0)
      << err_;
  frames = Frames(out_);
  ASSERT_EQ(frames.size(), 2u) << out_;
  for (const std::string& f : frames) {
    EXPECT_THAT(f, ::testing::StartsWith("kvctl pressure  "));
    EXPECT_THAT(f, ContainsRegex("w0 +device +[0-9.]+ [KM]iB"));
    EXPECT_THAT(f, ContainsRegex("ops +device +[0-9.]+ [KM]iB"));
  }

  // Bad flags: usage, exit 2, naming the flag and the value.
  EXPECT_EQ(Kvctl({"top", "--interval=0"}), 2);
  EXPECT_THAT(err_, HasSubstr("top: --interval=\"0\" is not a number"));
  EXPECT_EQ(Kvctl({"top", "--interval=-1"}), 2);
  EXPECT_THAT(err_, HasSubstr("--interval=\"-1\""));
  EXPECT_EQ(Kvctl({"top", "--count=many"}), 2);
  EXPECT_THAT(err_, HasSubstr("--count=\"many\""));
  EXPECT_EQ(Kvctl({"pressure", "--watch", "--count=-2"}), 2);
  EXPECT_THAT(err_, HasSubstr("pressure: --count=\"-2\""));
  EXPECT_THAT(err_, HasSubstr("usage: kvctl"));
  EXPECT_EQ(Kvctl({"top", "extra"}), 2);
  EXPECT_THAT(client_->Close(h), IsOk());
}

}  // namespace
}  // namespace triax::testing
