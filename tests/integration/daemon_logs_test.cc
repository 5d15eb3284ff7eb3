// Every line the daemons log is logfmt (common/log.h): a kvmanager and a
// kvworker are provoked into warnings and errors (a worker paused past
// --worker_timeout_ms, the manager killed under a live worker and started
// again, bad requests, a refused transfer; gRPC's own logging at INFO) and
// each line of both daemons' output is read back by a strict logfmt parser.
// The one line that is not a log record is the documented "<daemon>
// listening on HOST:PORT" on stdout.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/kv_client.h"
#include "common/logfmt.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
namespace v1 = triax::v1;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The parsed records of one daemon's output; fails the test on any line
// that is neither a record nor the "listening on" line.
std::vector<LogfmtRecord> Records(const std::string& path,
                                  const std::string& daemon) {
  std::vector<LogfmtRecord> out;
  const std::string text = ReadAll(path);
  EXPECT_FALSE(text.empty()) << path;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << path;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, daemon + " listening on 127.0.0.1:")) continue;
    absl::StatusOr<LogfmtRecord> r = ParseLogfmt(line);
    EXPECT_THAT(r, IsOk()) << path;
    if (!r.ok()) continue;
    for (const char* key : {"ts", "level", "component", "msg"}) {
      EXPECT_NE(LogfmtValue(*r, key), "") << key << " missing: " << line;
    }
    out.push_back(*std::move(r));
  }
  return out;
}

bool Has(const std::vector<LogfmtRecord>& records, absl::string_view level,
         absl::string_view msg) {
  for (const LogfmtRecord& r : records) {
    if (LogfmtValue(r, "level") == level && LogfmtValue(r, "msg") == msg) {
      return true;
    }
  }
  return false;
}

TEST(DaemonLogsTest, EveryLineOfBothDaemonsIsLogfmt) {
  // gRPC's own lines too: at INFO it reports its pollers, server and
  // every failed connect to the killed manager.
  ASSERT_EQ(setenv("GRPC_VERBOSITY", "INFO", 1), 0);
  ClusterOptions o;
  o.worker_timeout_ms = 600;
  auto c = Cluster::Start(o);
  ASSERT_THAT(c, IsOk());
  Cluster& cluster = **c;
  ASSERT_THAT(cluster.CreateTenant("ops"), IsOk());
  auto client = cluster.NewClient("ops");
  ASSERT_THAT(client, IsOk());
  auto seq =
      (*client)->Open(SmallModel(), {MakeSpan(v1::ROLE_USER, 40)}, "bf16", 16);
  ASSERT_THAT(seq, IsOk());

  // Bad requests: answered with errors, logged (if at all) as records.
  auto bad = (*client)->Open(SmallModel(), {MakeSpan(v1::ROLE_USER, 8)},
                             "no such policy \"x\"=y", 16);
  EXPECT_FALSE(bad.ok());
  std::string out, err;
  auto rc = RunToCompletion(
      "kvctl",
      {"--manager=" + cluster.manager_address(), "transfer", seq->sequence_id},
      cluster.dir(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 1) << err;  // one worker: nowhere to go
  rc = RunToCompletion("kvctl",
                       {"--manager=" + cluster.manager_address(), "policy-put",
                        "quoted \"name\"", "*:int4"},
                       cluster.dir(), &out, &err);
  ASSERT_THAT(rc, IsOk());

  // The worker silent past --worker_timeout_ms: the manager warns.
  ASSERT_THAT(cluster.worker_process(0)->Pause(), IsOk());
  ASSERT_THAT(cluster.WaitForWorkerState("w0", v1::WORKER_STATE_SUSPECT),
              IsOk());
  ASSERT_THAT(cluster.worker_process(0)->Resume(), IsOk());
  ASSERT_THAT(cluster.WaitForWorkerState("w0", v1::WORKER_STATE_UP), IsOk());

  // The manager killed: the worker's heartbeats fail (errors with spaces
  // and quotes in them); started again, the worker registers again.
  const std::string worker_log = cluster.dir() + "/w0.log";
  cluster.manager_process()->Kill();
  ASSERT_THAT(Cluster::WaitFor("the worker to log a failed heartbeat",
                               absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 return absl::StrContains(ReadAll(worker_log),
                                                          "Heartbeat failed");
                               }),
              IsOk());
  ASSERT_THAT(cluster.RestartManager(), IsOk());
  ASSERT_THAT(cluster.WaitForWorkerState("w0", v1::WORKER_STATE_UP), IsOk());

  const std::vector<LogfmtRecord> manager =
      Records(cluster.dir() + "/kvmanager.log", "kvmanager");
  const std::vector<LogfmtRecord> manager2 =
      Records(cluster.dir() + "/kvmanager-1.log", "kvmanager");
  const std::vector<LogfmtRecord> worker = Records(worker_log, "kvworker");
  ASSERT_EQ(unsetenv("GRPC_VERBOSITY"), 0);
  bool grpc_line = false;
  for (const LogfmtRecord& r : worker) {
    grpc_line |= LogfmtValue(r, "component") == "grpc" &&
                 !LogfmtValue(r, "file").empty();
  }
  EXPECT_TRUE(grpc_line) << "no gRPC record at GRPC_VERBOSITY=INFO";
  EXPECT_TRUE(Has(manager, "warn", "worker suspect: no heartbeat"));
  EXPECT_TRUE(Has(manager, "info", "worker registered"));
  EXPECT_TRUE(Has(manager2, "info", "metadata recovered"));
  // The heartbeat's error is one quoted value, spaces and all.
  bool heartbeat_error = false;
  for (const LogfmtRecord& r : worker) {
    if (LogfmtValue(r, "msg") == "Heartbeat failed") {
      EXPECT_EQ(LogfmtValue(r, "level"), "warn");
      EXPECT_THAT(LogfmtValue(r, "error"), HasSubstr(" "));
      heartbeat_error = true;
    }
  }
  EXPECT_TRUE(heartbeat_error);
}

TEST(DaemonLogsTest, AWorkerThatCannotStartLogsAnErrorRecord) {
  auto dir = TempDir::Create("triax-logs");
  ASSERT_THAT(dir, IsOk());
  // A port file in a directory that does not exist: the start fails after
  // the flags were accepted (exit 1), with an error record.
  auto w = Process::Start(
      "w-bad", "kvworker",
      {"--listen=127.0.0.1:0", "--worker_id=w-bad", "--pool_mb=16",
       "--port_file=" + (*dir)->path() + "/no/such/port"},
      (*dir)->path(), /*with_port_file=*/false);
  ASSERT_THAT(w, IsOk());
  auto rc = (*w)->Wait(absl::Seconds(20));
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 1) << (*w)->Log();
  const std::vector<LogfmtRecord> records =
      Records((*dir)->path() + "/w-bad.log", "kvworker");
  bool error = false;
  for (const LogfmtRecord& r : records) {
    if (LogfmtValue(r, "level") == "error") {
      EXPECT_EQ(LogfmtValue(r, "component"), "worker");
      EXPECT_THAT(LogfmtValue(r, "msg"), HasSubstr("--port_file"));
      error = true;
    }
  }
  EXPECT_TRUE(error) << (*w)->Log();
}

TEST(DaemonLogsTest, WithLogFormatJsonEveryLineIsAJsonObject) {
  ClusterOptions o;
  o.manager_flags = {"--log_format=json"};
  o.worker_flags = {"--log_format=json"};
  auto c = Cluster::Start(o);
  ASSERT_THAT(c, IsOk());
  Cluster& cluster = **c;
  ASSERT_THAT(cluster.CreateTenant("ops"), IsOk());
  // The manager killed: the worker warns with the RPC's error.
  cluster.manager_process()->Kill();
  const std::string worker_log = cluster.dir() + "/w0.log";
  ASSERT_THAT(Cluster::WaitFor("the worker to log a failed heartbeat",
                               absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 return absl::StrContains(ReadAll(worker_log),
                                                          "Heartbeat failed");
                               }),
              IsOk());
  bool registered = false, heartbeat = false;
  for (const auto& [path, daemon] :
       {std::make_pair(cluster.dir() + "/kvmanager.log", "kvmanager"),
        std::make_pair(worker_log, "kvworker")}) {
    const std::string text = ReadAll(path);
    for (absl::string_view line :
         absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      if (absl::StartsWith(line, absl::StrCat(daemon, " listening on "))) {
        continue;
      }
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      ASSERT_TRUE(j.is_object()) << path << ": " << line;
      for (const char* key : {"ts", "level", "component", "msg"}) {
        EXPECT_TRUE(j.contains(key)) << key << " missing: " << line;
      }
      registered |= j["msg"] == "worker registered" && j["worker_id"] == "w0";
      if (j["msg"] == "Heartbeat failed") {
        heartbeat = true;
        EXPECT_TRUE(j["code"].is_number()) << line;
        EXPECT_TRUE(j["error"].is_string()) << line;
      }
    }
  }
  EXPECT_TRUE(registered);
  EXPECT_TRUE(heartbeat);
}

TEST(DaemonLogsTest, ABadLogFormatIsAUsageError) {
  auto dir = TempDir::Create("triax-logs");
  ASSERT_THAT(dir, IsOk());
  for (const char* daemon : {"kvworker", "kvmanager"}) {
    std::string out, err;
    auto rc = RunToCompletion(daemon, {"--log_format=xml"}, (*dir)->path(),
                              &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, 2) << daemon;
    EXPECT_THAT(err, HasSubstr("--log_format=\"xml\": want logfmt or json"))
        << daemon;
    rc = RunToCompletion(daemon, {"--help"}, (*dir)->path(), &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_THAT(out + err, HasSubstr("-log_format")) << daemon;
  }
}

}  // namespace
}  // namespace triax::testing
