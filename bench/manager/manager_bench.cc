// manager_bench: control-plane throughput and latency of a real kvmanager
// process over gRPC on loopback.
//
// Starts the kvmanager binary (--kvmanager) on a free port (--port_file),
// registers one fake worker with a huge capacity (heartbeating every 500 ms),
// creates --tenants tenants, then for each N in --clients runs N client
// threads for --seconds. Each client has its OWN channel (a separate TCP
// connection, made before the clock starts) and loops over one session:
//   OpenSequence   5 spans, 600 tokens (system 200, tool_schema 150, user 100,
//                  assistant 100, user 50) -> 41 blocks at T = 16
//   ExtendSequence new turn, 2 spans (assistant 60, user 40) -> 7 blocks
//   CloseSequence
// Model shape: 32 layers, 8 KV heads, 32 query heads, head_dim 128.
// Prints a markdown table: RPCs/s, blocks planned/s (blocks of Open plus new
// blocks of Extend), and p50/p99 latency per RPC. The subprocess is
// terminated at the end (SIGTERM, then SIGKILL after 5 s).
//
// --mode=memory measures the manager's memory instead (docs/manager.md
// "Retention and memory"): --memory_clients clients open and close
// --sessions sequences in all (3 spans, 144 tokens -> 9 blocks; 29 events
// each: opened, 9 created, 9 released, 9 freed, closed; every call with a
// request id), and the manager's resident set (VmRSS of /proc/PID/status)
// is printed at the start and after every quarter, then after a paged
// ListSequences walk of every retained sequence (include_closed, pages of
// 1000), with the sequences that walk saw. --manager_flags passes
// retention flags (e.g. "--event_retention=100000 --closed_retention=1000").
//
// --security compares configurations of TLS and tokens in one run
// (bench/security/security_setup.h; bench/results/manager.md "Security on
// and off"): one kvmanager per configuration, started together; for each
// client count, --repeats rounds of every configuration one after the
// other, then a table of each one's RPCs/s, latency and CPU per RPC (the
// manager's, and this process's) against the first (plain, for a ratio of
// the cost). The clients' connections, TLS handshakes included, are made
// before the clock starts. Under tls/mtls the clients dial with
// the CA (and client.crt under mtls) and the fake worker presents
// worker.crt; under token the clients carry tenant tokens and the fake
// worker a worker token, all issued through the manager with its admin
// token. --cpus_manager pins the managers, --cpus_bench this process.
//
// --paths=unary,stream runs the sessions (and the floor) both ways against
// each manager, alternating: one unary RPC per call, or the calls on
// Manager.SequenceCalls streams (client/sequence_call_stream.h); --streams
// is how many streams the clients share (0: one per client; N: client i on
// stream i % N, as N frontends each multiplexing its sessions; each stream
// on its own connection, opened before the clock starts).
// bench/results/manager.md "Call streams".
//
// --floor adds, at each level and configuration right after the sessions,
// the same clients calling GetSequence of a sequence that does not exist:
// what a call costs the manager without work (bench/results/manager.md
// "The floor"). The clients' loops are in session_clients.h.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "bench/common/process.h"
#include "bench/manager/session_clients.h"
#include "bench/security/security_setup.h"
#include "common/bearer.h"
#include "common/local_socket.h"
#include "triax/v1/manager.grpc.pb.h"

extern char** environ;

ABSL_FLAG(std::string, kvmanager, "",
          "path of the kvmanager binary; default: next to this binary");
ABSL_FLAG(std::string, clients, "1,16,64", "comma-separated client counts");
ABSL_FLAG(int, seconds, 5, "seconds per client count");
ABSL_FLAG(int, level_sessions, 0,
          "throughput: sessions per client count in all, spread over the "
          "clients, instead of --seconds (a fixed amount of work, for "
          "instruction counts under callgrind); 0: --seconds");
ABSL_FLAG(int, tenants, 4, "tenants the clients spread over");
ABSL_FLAG(std::string, mode, "throughput",
          "throughput (RPCs/s and latency) or memory (the manager's RSS as "
          "sequences open and close)");
ABSL_FLAG(bool, floor, false,
          "throughput: also measure, at each level and configuration right "
          "after the sessions, the floor: every client calls GetSequence of "
          "a sequence that does not exist (NOT_FOUND) in a loop, a call "
          "that passes gRPC, the interceptors and the tenant's check and "
          "does no work; printed with the sessions' RPCs/s over it");
ABSL_FLAG(std::string, paths, "unary",
          "comma-separated: unary (one RPC per call), stream (the calls on "
          "SequenceCalls streams)");
ABSL_FLAG(int, streams, 0,
          "stream path: streams the clients share (0: one per client)");
ABSL_FLAG(std::string, manager_flags, "",
          "extra kvmanager flags, space-separated");
ABSL_FLAG(int, sessions, 41400,
          "memory: sequences opened and closed (29 events each)");
ABSL_FLAG(int, memory_clients, 8, "memory: client threads");
ABSL_FLAG(std::string, recovery_blocks, "",
          "comma-separated block counts: instead of the throughput levels, "
          "for each count fill a kvmanager (embedded store) with that many "
          "blocks, kill it with SIGKILL, start it again on its store and "
          "time the restart until it serves");
ABSL_FLAG(std::string, metadata, "file",
          "the kvmanager's durable metadata: file (its embedded store in a "
          "fresh directory, fsync'ed group commits) or memory (none)");
ABSL_FLAG(std::string, security, "plain",
          "throughput: comma-separated configurations compared in one run, "
          "each plain or tls / mtls and token joined with '+' (e.g. "
          "plain,tls,mtls,token,mtls+token); the first is the baseline of "
          "the ratios");
ABSL_FLAG(int, repeats, 1,
          "throughput: rounds of every configuration per client count, "
          "alternating");
ABSL_FLAG(std::string, tls_dir, "",
          "tests/tls/make_certs.sh's certificates; made there (with "
          "--make_certs) when it has no ca.crt; empty: a fresh directory");
ABSL_FLAG(std::string, make_certs, "tests/tls/make_certs.sh",
          "the script that makes the certificates of --tls_dir");
ABSL_FLAG(std::string, cpus_manager, "",
          "CPU list the kvmanager processes are pinned to (\"0-1\"); empty: "
          "not pinned");
ABSL_FLAG(std::string, cpus_bench, "",
          "CPU list this process (its client threads) is pinned to");
ABSL_FLAG(std::string, tsv, "",
          "throughput: also write every run as TSV (bench/security's "
          "columns) to this file");

namespace {

using triax::bench::manager::Clock;
namespace v1 = triax::v1;
namespace bench = triax::bench;
using triax::AddBearer;
using triax::ReadBearerToken;
using triax::bench::manager::Access;
using triax::bench::manager::AddSpan;
using triax::bench::manager::ClientStats;
using triax::bench::manager::NewChannel;
using triax::bench::manager::RunClient;
using triax::bench::manager::RunFloorClient;
using triax::bench::manager::SessionCalls;
using triax::bench::manager::SetBenchModel;

// The kvmanager subprocess; terminated by the destructor.
class Manager {
 public:
  bool Start(const std::string& binary, const std::string& dir,
             const std::vector<std::string>& extra) {
    port_file_ = dir + "/port";
    log_file_ = dir + "/kvmanager.log";
    const std::string metadata = absl::GetFlag(FLAGS_metadata) == "memory"
                                     ? "memory"
                                     : "file:" + dir + "/metadata";
    std::vector<std::string> args = {
        binary, "--listen=127.0.0.1:0", "--port_file=" + port_file_,
        "--worker_timeout_ms=10000", "--metadata=" + metadata};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_file_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const int rc = posix_spawn(&pid_, binary.c_str(), &actions, nullptr,
                               argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      std::cerr << "cannot start " << binary << ": " << strerror(rc) << "\n";
      pid_ = -1;
      return false;
    }
    for (int i = 0; i < 200; ++i) {
      std::ifstream in(port_file_);
      int port = 0;
      if (in >> port && port > 0) {
        port_ = port;
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::cerr << "kvmanager did not write " << port_file_
              << " within 10 s; see " << log_file_ << "\n";
    return false;
  }

  ~Manager() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  const std::string& log_file() const { return log_file_; }

  // SIGKILL, reaped; the port file goes, so that a Start on the same
  // directory waits for the new process's.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
    std::remove(port_file_.c_str());
  }
  // The process's resident set in KiB (VmRSS), 0 when unreadable.
  uint64_t RssKiB() const {
    std::ifstream in(absl::StrCat("/proc/", pid_, "/status"));
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("VmRSS:", 0) != 0) continue;
      uint64_t kib = 0;
      std::vector<std::string> parts =
          absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kib)) return kib;
    }
    return 0;
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string port_file_, log_file_;
};

// --- --mode=memory -------------------------------------------------------

struct SessionStats {
  uint64_t done = 0;
  uint64_t errors = 0;
  std::string first_error;
  uint64_t last_lineage = 0;  // a block freed by the client's last Close
};

// Opens and closes sequences number next++ while below `end`.
void RunSessions(const std::string& target, int index,
                 const std::string& tenant, std::atomic<int>* next, int end,
                 SessionStats* stats) {
  auto stub = v1::Manager::NewStub(NewChannel(target, index));
  v1::OpenSequenceRequest open;
  open.set_tenant_id(tenant);
  SetBenchModel(open.mutable_model());
  AddSpan(open.mutable_spans(), v1::ROLE_SYSTEM, 64);
  AddSpan(open.mutable_spans(), v1::ROLE_USER, 48);
  AddSpan(open.mutable_spans(), v1::ROLE_ASSISTANT, 32);
  v1::CloseSequenceRequest close;
  close.set_tenant_id(tenant);
  auto fail = [&](const char* what, const grpc::Status& s) {
    if (stats->errors++ == 0) {
      stats->first_error =
          absl::StrCat(what, ": ", s.error_code(), " ", s.error_message());
    }
  };
  while (true) {
    // Take the next number only while below `end`, so none is lost between
    // the quarters.
    int i = next->load();
    while (i < end && !next->compare_exchange_weak(i, i + 1)) {
    }
    if (i >= end) break;
    open.set_request_id(absl::StrCat("mo-", i));
    v1::OpenSequenceResponse open_resp;
    grpc::Status s;
    {
      grpc::ClientContext ctx;
      s = stub->OpenSequence(&ctx, open, &open_resp);
    }
    if (!s.ok()) {
      fail("OpenSequence", s);
      continue;
    }
    close.set_request_id(absl::StrCat("mc-", i));
    close.set_sequence_id(open_resp.sequence().sequence_id());
    v1::CloseSequenceResponse close_resp;
    {
      grpc::ClientContext ctx;
      s = stub->CloseSequence(&ctx, close, &close_resp);
    }
    if (!s.ok()) {
      fail("CloseSequence", s);
      continue;
    }
    ++stats->done;
    if (close_resp.freed_lineage_ids_size() > 0) {
      stats->last_lineage =
          close_resp.freed_lineage_ids(close_resp.freed_lineage_ids_size() - 1);
    }
  }
}

double MiB(uint64_t kib) { return kib / 1024.0; }

int RunMemory(const std::string& target, const Manager& manager,
              v1::Manager::Stub* admin, int tenants) {
  const int sessions = std::max(1, absl::GetFlag(FLAGS_sessions));
  const int clients = std::max(1, absl::GetFlag(FLAGS_memory_clients));
  std::printf("kvmanager at %s, flags: %s\n\n", target.c_str(),
              absl::GetFlag(FLAGS_manager_flags).empty()
                  ? "(defaults)"
                  : absl::GetFlag(FLAGS_manager_flags).c_str());
  std::printf(
      "| stage | sequences opened and closed | events appended | "
      "RSS MiB |\n|---|---:|---:|---:|\n");
  std::printf("| started | 0 | - | %.1f |\n", MiB(manager.RssKiB()));
  std::atomic<int> next{0};
  std::vector<SessionStats> stats(clients);
  uint64_t errors = 0;
  uint64_t last_lineage = 0;
  for (int quarter = 1; quarter <= 4; ++quarter) {
    const int end = static_cast<int>(int64_t{sessions} * quarter / 4);
    std::vector<std::thread> threads;
    threads.reserve(clients);
    for (int i = 0; i < clients; ++i) {
      threads.emplace_back(RunSessions, target, i,
                           absl::StrCat("bench-t", i % tenants), &next, end,
                           &stats[i]);
    }
    for (auto& t : threads) t.join();
    uint64_t done = 0;
    errors = 0;
    for (const SessionStats& st : stats) {
      done += st.done;
      errors += st.errors;
      if (st.last_lineage > last_lineage) last_lineage = st.last_lineage;
    }
    // The newest event id: the last freed block's trace ends a few events
    // before its sequence's SEQUENCE_CLOSED.
    std::string appended = "-";
    if (last_lineage != 0) {
      v1::QueryTraceRequest req;
      req.set_lineage_id(last_lineage);
      req.set_page_size(10000);
      v1::QueryTraceResponse resp;
      grpc::ClientContext ctx;
      if (admin->QueryTrace(&ctx, req, &resp).ok() && resp.events_size() > 0) {
        appended = absl::StrCat("~", resp.events(resp.events_size() - 1).id());
      }
    }
    std::printf("| after %d/4 | %llu | %s | %.1f |\n", quarter,
                static_cast<unsigned long long>(done), appended.c_str(),
                MiB(manager.RssKiB()));
    std::fflush(stdout);
  }
  // Every retained sequence through the pages.
  v1::ListSequencesRequest req;
  req.set_include_closed(true);
  req.set_page_size(1000);
  uint64_t listed = 0, pages = 0;
  const auto t0 = Clock::now();
  while (true) {
    v1::ListSequencesResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = admin->ListSequences(&ctx, req, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "ListSequences: %s\n", s.error_message().c_str());
      return 1;
    }
    listed += resp.sequences_size();
    ++pages;
    if (resp.next_page_token().empty()) break;
    req.set_page_token(resp.next_page_token());
  }
  const double walk_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::printf(
      "\nListSequences(include_closed) walk: %llu sequences retained, %llu "
      "pages of <= 1000 in %.0f ms; RSS after it %.1f MiB\n",
      static_cast<unsigned long long>(listed),
      static_cast<unsigned long long>(pages), walk_ms, MiB(manager.RssKiB()));
  if (errors > 0) {
    for (const SessionStats& st : stats) {
      if (!st.first_error.empty()) {
        std::fprintf(stderr, "%llu errors; first: %s\n",
                     static_cast<unsigned long long>(errors),
                     st.first_error.c_str());
        break;
      }
    }
    return 1;
  }
  return 0;
}

// The bench worker (registered on `worker`, under `worker_token`) and
// `tenants` tenants ("bench-t<i>", created under `admin_token`) on a fresh
// manager.
bool Setup(v1::Manager::Stub* admin, v1::Manager::Stub* worker,
           const std::string& admin_token, const std::string& worker_token,
           int tenants) {
  v1::RegisterWorkerRequest req;
  req.set_request_id("bench-register");
  req.set_worker_id("bench-worker");
  req.set_address("127.0.0.1:1");
  req.set_backend("cpu");
  req.set_capacity_bytes(uint64_t{1} << 62);
  req.set_incarnation("bench-incarnation");
  v1::RegisterWorkerResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  AddBearer(&ctx, worker_token);
  grpc::Status s = worker->RegisterWorker(&ctx, req, &resp);
  if (!s.ok()) {
    std::cerr << "RegisterWorker: " << s.error_message() << "\n";
    return false;
  }
  for (int t = 0; t < tenants; ++t) {
    v1::CreateTenantRequest treq;
    treq.set_tenant_id(absl::StrCat("bench-t", t));
    v1::CreateTenantResponse tresp;
    grpc::ClientContext tctx;
    AddBearer(&tctx, admin_token);
    s = admin->CreateTenant(&tctx, treq, &tresp);
    if (!s.ok()) {
      std::cerr << "CreateTenant: " << s.error_message() << "\n";
      return false;
    }
  }
  return true;
}

// Recovery: for each block count, a manager filled with open sequences of
// 125 blocks (2,000 tokens at T = 16, the session's model), killed with
// SIGKILL and started again on its store. Prints the store's size, the
// restart's time until the port file appears (recovery, restore and the
// start snapshot come before listening) and the manager's own figures.
int RunRecovery(const std::string& binary, const std::vector<int64_t>& sizes) {
  std::printf(
      "| blocks | sequences | store MiB | fill s | restart until serving s | "
      "read s | restore s | records |\n|---:|---:|---:|---:|---:|---:|---:|"
      "---:|\n");
  for (const int64_t blocks : sizes) {
    char dir_template[] = "/tmp/manager_recovery.XXXXXX";
    const char* dir = mkdtemp(dir_template);
    if (dir == nullptr) return 1;
    Manager manager;
    if (!manager.Start(binary, dir, {})) return 1;
    const std::string target = absl::StrCat("127.0.0.1:", manager.port());
    auto admin = v1::Manager::NewStub(NewChannel(target, -1));
    if (!Setup(admin.get(), admin.get(), "", "", 1)) return 1;
    const int64_t sequences = (blocks + 124) / 125;
    const int threads_n = 16;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> errors{0};
    const auto fill_start = Clock::now();
    std::vector<std::thread> threads;
    threads.reserve(threads_n);
    for (int i = 0; i < threads_n; ++i) {
      threads.emplace_back([&, i] {
        auto stub = v1::Manager::NewStub(NewChannel(target, i));
        v1::OpenSequenceRequest open;
        open.set_tenant_id("bench-t0");
        SetBenchModel(open.mutable_model());
        AddSpan(open.mutable_spans(), v1::ROLE_SYSTEM, 400);
        AddSpan(open.mutable_spans(), v1::ROLE_USER, 1600);
        while (next.fetch_add(1) < sequences) {
          v1::OpenSequenceResponse resp;
          grpc::ClientContext ctx;
          if (!stub->OpenSequence(&ctx, open, &resp).ok()) errors++;
        }
      });
    }
    for (auto& t : threads) t.join();
    const double fill_s =
        std::chrono::duration<double>(Clock::now() - fill_start).count();
    if (errors > 0) {
      std::cerr << errors << " opens failed\n";
      return 1;
    }
    manager.Kill();
    uint64_t store_bytes = 0;
    for (const auto& e :
         std::filesystem::directory_iterator(std::string(dir) + "/metadata")) {
      store_bytes += e.file_size();
    }
    const auto restart = Clock::now();
    if (!manager.Start(binary, dir, {})) return 1;
    const double serving_s =
        std::chrono::duration<double>(Clock::now() - restart).count();
    // The manager's "metadata recovered" line: read_seconds and
    // restore_seconds (restore includes the start snapshot).
    std::ifstream log(manager.log_file());
    std::string line, read_s = "?", restore_s = "?", records = "?";
    auto field = [&](const std::string& key) -> std::string {
      const size_t at = line.find(key + "=");
      if (at == std::string::npos) return "?";
      const size_t from = at + key.size() + 1;
      return line.substr(from, line.find_first_of(" \"}", from) - from);
    };
    while (std::getline(log, line)) {
      if (line.find("metadata recovered") == std::string::npos) continue;
      read_s = field("read_seconds");
      restore_s = field("restore_seconds");
      records = field("records");
    }
    std::printf("| %lld | %lld | %.1f | %.1f | %.2f | %s | %s | %s |\n",
                static_cast<long long>(sequences) * 125,
                static_cast<long long>(sequences), store_bytes / 1048576.0,
                fill_s, serving_s, read_s.c_str(), restore_s.c_str(),
                records.c_str());
    std::fflush(stdout);
  }
  return 0;
}

// One kvmanager under one security configuration, with the fake worker
// registered and heartbeating every 500 ms until destroyed.
struct Secured {
  bench::SecurityConfig config;
  Manager manager;
  std::string target;
  std::string client_target;  // the clients': target, or the local socket
  Access access;
  std::unique_ptr<v1::Manager::Stub> admin;   // client credentials
  std::unique_ptr<v1::Manager::Stub> worker;  // the fake worker's channel
  std::string admin_token, worker_token;
  absl::Notification stop;
  std::thread heartbeat;

  ~Secured() {
    stop.Notify();
    if (heartbeat.joinable()) heartbeat.join();
  }
};

// Starts the manager of `config` in `dir` (its flags after `extra`), pins it
// to --cpus_manager, issues the worker's and the tenants' tokens through it
// (token configurations) and sets it up; null, with the reason on stderr,
// when any step fails.
std::unique_ptr<Secured> StartSecured(const std::string& binary,
                                      const std::string& dir,
                                      std::vector<std::string> extra,
                                      const bench::SecurityConfig& config,
                                      const bench::CertFiles& certs,
                                      int tenants) {
  auto m = std::make_unique<Secured>();
  m->config = config;
  const std::string admin_file = dir + "/admin.token";
  for (std::string& f : bench::ManagerSecurityFlags(config, certs, admin_file))
    extra.push_back(std::move(f));
  const std::string socket = bench::LocalSocket(dir, "manager");
  if (config.local) extra.push_back("--local_listen=" + socket);
  auto fail = [&](const absl::Status& s) {
    std::cerr << "manager_bench: " << config.name << ": " << s.message()
              << "\n";
    return nullptr;
  };
  if (!m->manager.Start(binary, dir, extra)) return nullptr;
  if (const std::string cpus = absl::GetFlag(FLAGS_cpus_manager);
      !cpus.empty()) {
    absl::Status s =
        bench::PinProcess(m->manager.pid(), cpus, "--cpus_manager");
    if (!s.ok()) return fail(s);
  }
  m->target = absl::StrCat("127.0.0.1:", m->manager.port());
  auto client = bench::CredentialsFor(config, certs, bench::Peer::kClient);
  if (!client.ok()) return fail(client.status());
  auto worker = bench::CredentialsFor(config, certs, bench::Peer::kWorker);
  if (!worker.ok()) return fail(worker.status());
  m->access.credentials = *client;
  // Local: the clients are frontends on the manager's host, on its socket;
  // the fake worker registers over TCP (under mtls only its certificate
  // may).
  m->client_target = config.local ? socket : m->target;
  if (config.local) {
    m->access.credentials = triax::ChannelCredentialsFor(socket, nullptr);
  }
  m->admin = v1::Manager::NewStub(NewChannel(m->target, -1, *client));
  m->worker = v1::Manager::NewStub(NewChannel(m->target, -2, *worker));
  if (config.tokens) {
    absl::StatusOr<std::string> admin =
        ReadBearerToken("admin_token_file", admin_file);
    if (!admin.ok()) return fail(admin.status());
    m->admin_token = *admin;
    absl::StatusOr<std::string> token =
        bench::IssueToken(m->admin.get(), m->admin_token, "worker", "");
    if (!token.ok()) return fail(token.status());
    m->worker_token = *token;
  }
  if (!Setup(m->admin.get(), m->worker.get(), m->admin_token, m->worker_token,
             tenants)) {
    return nullptr;
  }
  for (int t = 0; config.tokens && t < tenants; ++t) {
    absl::StatusOr<std::string> token = bench::IssueToken(
        m->admin.get(), m->admin_token, "tenant", absl::StrCat("bench-t", t));
    if (!token.ok()) return fail(token.status());
    m->access.tenant_tokens.push_back(*token);
  }
  Secured* raw = m.get();
  m->heartbeat = std::thread([raw] {
    while (!raw->stop.WaitForNotificationWithTimeout(absl::Milliseconds(500))) {
      v1::HeartbeatRequest req;
      req.set_worker_id("bench-worker");
      req.set_incarnation("bench-incarnation");
      v1::HeartbeatResponse resp;
      grpc::ClientContext ctx;
      AddBearer(&ctx, raw->worker_token);
      raw->worker->Heartbeat(&ctx, req, &resp);
    }
  });
  return m;
}

// `clients` client threads against `m` for `seconds`: prints the row of the
// throughput table (with `name` first when not empty) and
// returns the run for the comparison (an empty one when a client cannot
// connect).
bench::Measurement RunLevel(const Secured& m, bool stream, int streams,
                            int clients, int tenants, int seconds,
                            int level_sessions, const std::string& name,
                            bool floor, int* failures) {
  std::vector<ClientStats> stats(clients);
  // Every client's connection (TCP, and the TLS handshake) is made before
  // the clock starts: frontends keep their channels (and their streams).
  const int links =
      stream && streams > 0 ? std::min(streams, clients) : clients;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < links; ++i) {
    channels.push_back(NewChannel(m.client_target, i, m.access.credentials));
    if (!channels.back()->WaitForConnected(std::chrono::system_clock::now() +
                                           std::chrono::seconds(10))) {
      std::fprintf(stderr, "client %d of %s: not connected after 10 s\n", i,
                   name.c_str());
      ++*failures;
      return {};
    }
  }
  // Client i's link, its tenant, and how its calls go.
  auto tenant_of = [&](int i) { return (i % links) % tenants; };
  auto token_of = [&](int t) {
    return m.access.tenant_tokens.empty() ? std::string()
                                          : m.access.tenant_tokens[t];
  };
  std::vector<std::unique_ptr<v1::Manager::Stub>> stubs;
  std::vector<std::unique_ptr<triax::client::SequenceCallStream>> call_streams;
  std::vector<std::unique_ptr<SessionCalls>> calls;
  for (int i = 0; stream && i < links; ++i) {
    stubs.push_back(v1::Manager::NewStub(channels[i]));
    call_streams.push_back(std::make_unique<triax::client::SequenceCallStream>(
        stubs.back().get(), token_of(tenant_of(i))));
  }
  for (int i = 0; i < clients; ++i) {
    calls.push_back(stream ? triax::bench::manager::StreamCalls(
                                 call_streams[i % links].get())
                           : triax::bench::manager::UnaryCalls(
                                 channels[i], token_of(tenant_of(i))));
  }
  // The streams open (and authenticate) before the clock starts too.
  for (int i = 0; stream && i < links; ++i) {
    v1::GetSequenceRequest get;
    get.set_tenant_id(absl::StrCat("bench-t", tenant_of(i)));
    get.set_sequence_id("bench-warmup");
    v1::GetSequenceResponse resp;
    const grpc::Status s = calls[i]->Get(get, &resp);
    if (s.error_code() != grpc::StatusCode::NOT_FOUND) {
      std::fprintf(stderr, "stream %d of %s: warm-up call answered %d %s\n", i,
                   name.c_str(), s.error_code(), s.error_message().c_str());
      ++*failures;
      return {};
    }
  }
  std::vector<std::thread> threads;
  threads.reserve(clients);
  const absl::StatusOr<double> server_cpu0 =
      bench::ProcessCpuSeconds(m.manager.pid());
  const absl::StatusOr<double> client_cpu0 = bench::ProcessCpuSeconds(0);
  static int runs = 0;
  const int run_id = runs++;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::seconds(seconds);
  for (int i = 0; floor && i < clients; ++i) {
    threads.emplace_back(RunFloorClient, calls[i].get(), i, tenant_of(i),
                         deadline, &stats[i]);
  }
  for (int i = 0; !floor && i < clients; ++i) {
    // Client i's share of --level_sessions (-1: timed).
    const int share = level_sessions > 0 ? level_sessions / clients +
                                               (i < level_sessions % clients)
                                         : -1;
    threads.emplace_back(RunClient, calls[i].get(), i, tenant_of(i), deadline,
                         share, run_id, &stats[i]);
  }
  for (auto& t : threads) t.join();
  const double elapsed =
      std::chrono::duration<double>(Clock::now() - start).count();
  const absl::StatusOr<double> server_cpu1 =
      bench::ProcessCpuSeconds(m.manager.pid());
  const absl::StatusOr<double> client_cpu1 = bench::ProcessCpuSeconds(0);
  ClientStats all;
  for (auto& s : stats) {
    all.open_ms.insert(all.open_ms.end(), s.open_ms.begin(), s.open_ms.end());
    all.extend_ms.insert(all.extend_ms.end(), s.extend_ms.begin(),
                         s.extend_ms.end());
    all.close_ms.insert(all.close_ms.end(), s.close_ms.begin(),
                        s.close_ms.end());
    all.blocks += s.blocks;
    all.errors += s.errors;
    if (all.first_error.empty()) all.first_error = s.first_error;
  }
  bench::Measurement run;
  run.seconds = elapsed;
  run.errors = all.errors;
  for (const auto* v : {&all.open_ms, &all.extend_ms, &all.close_ms}) {
    run.latency_ms.insert(run.latency_ms.end(), v->begin(), v->end());
  }
  run.ops = run.latency_ms.size();
  if (server_cpu0.ok() && server_cpu1.ok()) {
    run.server_cpu_s = *server_cpu1 - *server_cpu0;
  }
  if (client_cpu0.ok() && client_cpu1.ok()) {
    run.client_cpu_s = *client_cpu1 - *client_cpu0;
  }
  if (floor) {
    if (all.errors > 0) {
      std::fprintf(stderr, "floor: first error at %d clients (%s): %s\n",
                   clients, name.c_str(), all.first_error.c_str());
      ++*failures;
    }
    return run;
  }
  std::printf(
      "| %s%d | %.0f | %.0f | %.0f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f "
      "| %llu |\n",
      name.empty() ? "" : absl::StrCat(name, " | ").c_str(), clients,
      run.ops / elapsed, all.close_ms.size() / elapsed, all.blocks / elapsed,
      bench::Quantile(&all.open_ms, 0.5), bench::Quantile(&all.open_ms, 0.99),
      bench::Quantile(&all.extend_ms, 0.5),
      bench::Quantile(&all.extend_ms, 0.99),
      bench::Quantile(&all.close_ms, 0.5), bench::Quantile(&all.close_ms, 0.99),
      static_cast<unsigned long long>(all.errors));
  std::fflush(stdout);
  if (all.errors > 0) {
    std::fprintf(stderr, "first error at %d clients (%s): %s\n", clients,
                 name.c_str(), all.first_error.c_str());
    ++*failures;
  }
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string binary = absl::GetFlag(FLAGS_kvmanager);
  if (binary.empty()) binary = bench::SelfDir() + "/kvmanager";
  std::vector<int> levels;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_clients), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1) {
      std::cerr << "--clients: bad count \"" << part << "\"\n";
      return 2;
    }
    levels.push_back(n);
  }
  if (!absl::GetFlag(FLAGS_recovery_blocks).empty()) {
    std::vector<int64_t> sizes;
    for (absl::string_view part :
         absl::StrSplit(absl::GetFlag(FLAGS_recovery_blocks), ',')) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(part, &n) || n < 1) {
        std::cerr << "--recovery_blocks: bad count \"" << part << "\"\n";
        return 2;
      }
      sizes.push_back(n);
    }
    return RunRecovery(binary, sizes);
  }
  const int seconds = absl::GetFlag(FLAGS_seconds);
  const int tenants = std::max(1, absl::GetFlag(FLAGS_tenants));
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "throughput" && mode != "memory") {
    std::cerr << "--mode: \"" << mode << "\"; want throughput or memory\n";
    return 2;
  }
  auto configs =
      bench::ParseSecurityList(absl::GetFlag(FLAGS_security), "--security");
  if (!configs.ok()) {
    std::cerr << "manager_bench: " << configs.status().message() << "\n";
    return 2;
  }
  const bench::SecurityConfig& first = configs->front();
  if (mode == "memory" && (configs->size() > 1 || first.tokens ||
                           first.tls != bench::TlsMode::kOff)) {
    std::cerr << "manager_bench: --security=" << absl::GetFlag(FLAGS_security)
              << " applies to --mode=throughput only; --mode=memory runs "
                 "plain\n";
    return 2;
  }
  std::vector<bool> paths;  // false: unary, true: stream
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_paths), ',', absl::SkipEmpty())) {
    if (part != "unary" && part != "stream") {
      std::cerr << "--paths: \"" << part << "\"; want unary or stream\n";
      return 2;
    }
    paths.push_back(part == "stream");
  }
  if (paths.empty()) {
    std::cerr << "--paths: empty; want unary, stream or both\n";
    return 2;
  }
  const int streams = absl::GetFlag(FLAGS_streams);
  if (streams < 0) {
    std::cerr << "--streams=" << streams << "; want >= 0\n";
    return 2;
  }
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (repeats < 1) {
    std::cerr << "manager_bench: --repeats=" << repeats << "; want >= 1\n";
    return 2;
  }
  for (const auto& [flag, value] :
       {std::pair{"--cpus_manager", absl::GetFlag(FLAGS_cpus_manager)},
        std::pair{"--cpus_bench", absl::GetFlag(FLAGS_cpus_bench)}}) {
    if (absl::Status s = bench::CheckCpuList(value, flag);
        !value.empty() && !s.ok()) {
      std::cerr << "manager_bench: " << s.message() << "\n";
      return 2;
    }
  }
  if (const std::string cpus = absl::GetFlag(FLAGS_cpus_bench); !cpus.empty()) {
    if (absl::Status s = bench::PinProcess(getpid(), cpus, "--cpus_bench");
        !s.ok()) {
      std::cerr << "manager_bench: " << s.message() << "\n";
      return 1;
    }
  }

  char dir_template[] = "/tmp/manager_bench.XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) {
    std::cerr << "mkdtemp failed\n";
    return 1;
  }
  bench::CertFiles certs;
  if (bench::AnyTls(*configs)) {
    std::string tls_dir = absl::GetFlag(FLAGS_tls_dir);
    if (tls_dir.empty()) tls_dir = std::string(dir) + "/certs";
    auto made = bench::PrepareCerts(tls_dir, absl::GetFlag(FLAGS_make_certs),
                                    "--make_certs");
    if (!made.ok()) {
      std::cerr << "manager_bench: " << made.status().message() << "\n";
      return 2;
    }
    certs = *made;
  }
  const std::vector<std::string> extra = absl::StrSplit(
      absl::GetFlag(FLAGS_manager_flags), ' ', absl::SkipEmpty());
  std::vector<std::unique_ptr<Secured>> managers;
  for (size_t c = 0; c < configs->size(); ++c) {
    const std::string sub = absl::StrCat(dir, "/config", c);
    std::filesystem::create_directories(sub);
    managers.push_back(
        StartSecured(binary, sub, extra, (*configs)[c], certs, tenants));
    if (managers.back() == nullptr) return 1;
  }

  if (mode == "memory") {
    const Secured& m = *managers.front();
    return RunMemory(m.target, m.manager, m.admin.get(), tenants);
  }

  // What is compared: each manager's configuration over each path; the
  // first entry is the baseline of the ratios.
  struct Entry {
    size_t manager;
    bool stream;
    std::string name;
  };
  std::vector<Entry> entries;
  std::vector<bench::SecurityConfig> entry_configs;
  for (size_t c = 0; c < managers.size(); ++c) {
    for (bool stream : paths) {
      std::string name = managers[c]->config.name;
      if (paths.size() > 1 || stream) name += stream ? "+stream" : "+unary";
      entries.push_back({c, stream, name});
      entry_configs.push_back(managers[c]->config);
      entry_configs.back().name = name;
    }
  }
  const bool compare = entries.size() > 1 || repeats > 1;
  const unsigned cores = std::thread::hardware_concurrency();
  const int level_sessions = absl::GetFlag(FLAGS_level_sessions);
  const std::string where =
      compare ? absl::StrCat(managers.front()->target, " and ",
                             managers.size() - 1, " more")
              : managers.front()->target;
  if (level_sessions > 0) {
    std::printf(
        "kvmanager at %s, %u cores (nproc), %d sessions per level, one "
        "channel per client (stream path: per stream; --streams=%d)\n\n",
        where.c_str(), cores, level_sessions, streams);
  } else {
    std::printf(
        "kvmanager at %s, %u cores (nproc), %d s per level, one channel per "
        "client (stream path: per stream; --streams=%d)\n\n",
        where.c_str(), cores, seconds, streams);
  }
  std::printf(
      "| %sclients | RPCs/s | sessions/s | blocks planned/s | open p50/p99 ms "
      "| extend p50/p99 ms | close p50/p99 ms | errors |\n",
      compare ? "security | " : "");
  std::printf("|%s---:|---:|---:|---:|---:|---:|---:|---:|\n",
              compare ? "---|" : "");
  std::vector<std::string> labels;
  labels.reserve(levels.size());
  for (int n : levels) labels.push_back(absl::StrCat(n));
  bench::CostReport report(entry_configs, labels);
  int failures = 0;
  const bool floor = absl::GetFlag(FLAGS_floor);
  // --floor: per level and configuration, the sessions' and the floor's
  // calls and seconds over the repeats, and the floor's latencies.
  struct FloorCell {
    double session_ops = 0, session_s = 0, floor_ops = 0, floor_s = 0;
    double session_cpu_s = 0, floor_cpu_s = 0;  // the manager's
    std::vector<double> floor_ms;
  };
  std::vector<std::vector<FloorCell>> floors(
      levels.size(), std::vector<FloorCell>(entries.size()));
  for (size_t l = 0; l < levels.size(); ++l) {
    for (int r = 0; r < repeats; ++r) {
      for (size_t e = 0; e < entries.size(); ++e) {
        const Entry& entry = entries[e];
        const Secured& m = *managers[entry.manager];
        const std::string name = compare ? entry.name : "";
        bench::Measurement sessions =
            RunLevel(m, entry.stream, streams, levels[l], tenants, seconds,
                     level_sessions, name, /*floor=*/false, &failures);
        if (floor) {
          FloorCell& cell = floors[l][e];
          cell.session_ops += sessions.ops;
          cell.session_s += sessions.seconds;
          cell.session_cpu_s += sessions.server_cpu_s;
          bench::Measurement f =
              RunLevel(m, entry.stream, streams, levels[l], tenants, seconds,
                       /*level_sessions=*/0, name, /*floor=*/true, &failures);
          cell.floor_ops += f.ops;
          cell.floor_s += f.seconds;
          cell.floor_cpu_s += f.server_cpu_s;
          cell.floor_ms.insert(cell.floor_ms.end(), f.latency_ms.begin(),
                               f.latency_ms.end());
        }
        report.Add(l, e, std::move(sessions));
      }
    }
  }
  if (floor) {
    std::printf(
        "\nThe floor (GetSequence of an unknown id, NOT_FOUND), run right "
        "after the sessions at each level, %d repeat(s) pooled:\n\n"
        "| security | clients | floor RPCs/s | floor p50 / p99 ms | "
        "sessions RPCs/s | sessions / floor | manager CPU us per call: floor "
        "| sessions |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
        repeats);
    for (size_t l = 0; l < levels.size(); ++l) {
      for (size_t e = 0; e < entries.size(); ++e) {
        FloorCell& cell = floors[l][e];
        const double f = cell.floor_s > 0 ? cell.floor_ops / cell.floor_s : 0;
        const double sr =
            cell.session_s > 0 ? cell.session_ops / cell.session_s : 0;
        auto us = [](double cpu_s, double ops) {
          return ops > 0 ? cpu_s * 1e6 / ops : 0.0;
        };
        std::printf(
            "| %s | %d | %.0f | %.3f / %.3f | %.0f | %.3f | %.1f | %.1f |\n",
            entries[e].name.c_str(), levels[l], f,
            bench::Quantile(&cell.floor_ms, 0.5),
            bench::Quantile(&cell.floor_ms, 0.99), sr, f > 0 ? sr / f : 0.0,
            us(cell.floor_cpu_s, cell.floor_ops),
            us(cell.session_cpu_s, cell.session_ops));
      }
    }
  }
  if (compare) {
    std::printf("\nRPCs (Open, Extend, Close) against %s, %d repeat(s):\n\n%s",
                entries.front().name.c_str(), repeats,
                report.Markdown("clients", "RPCs", "manager").c_str());
  }
  if (const std::string tsv = absl::GetFlag(FLAGS_tsv); !tsv.empty()) {
    if (absl::Status s = report.WriteTsv(tsv, "manager"); !s.ok()) {
      std::cerr << "manager_bench: " << s.message() << "\n";
      return 1;
    }
  }
  return failures == 0 ? 0 : 1;
}
