// attend_bench: the worker's Attend RPC as a frontend sees it (through the
// client library, which attaches the sequence's capabilities and dials
// over the configuration's TLS), with TLS, mutual TLS and bearer tokens
// with capabilities on and off, measured in one run (bench/results/
// attend_security.md).
//
// For each configuration of --security (bench/security/security_setup.h)
// one kvmanager and one kvworker (--backend) run on loopback, all started
// together; under token the bench issues the worker's token and the
// tenant's through the manager with its admin token. For each level
// (--tokens x --clients), every configuration's client threads (each with
// its own Client, so its own channels) open a sequence of `tokens` tokens
// (one user span) and write its K/V on every layer (BF16 of normal(0, 1)
// values from a fixed seed). Then --repeats rounds, every configuration in
// turn on the same sequences: each client calls Attend for --seconds
// (--queries queries at the last position, layers round robin, read-only,
// so the sequence stays as written), timing every call. The sequences are
// closed before the next level. Prints the row of every run, then per
// level each configuration's Attends/s, latency and CPU per Attend (the
// worker's, and this process's: the clients and their gRPC threads)
// against the first configuration's; the cost is 1 - the throughput ratio,
// or the CPU ratio - 1.
//
// The model: --layers layers, --kv_heads KV heads, --q_heads query heads,
// --head_dim (Llama-3-8B's heads by default). The worker's pool is sized
// for the largest level unless --pool_mb says otherwise.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "bench/common/process.h"
#include "bench/security/security_setup.h"
#include "client/kv_client.h"
#include "common/bearer.h"
#include "common/status_macros.h"
#include "tests/integration/process.h"
#include "triax/v1/manager.grpc.pb.h"

ABSL_FLAG(std::string, security, "plain,tls,mtls,token,mtls+token",
          "comma-separated configurations, each plain or tls / mtls, local "
          "and token joined with '+' (local: the clients call the worker on "
          "its Unix-domain socket); the first is the baseline of the ratios");
ABSL_FLAG(std::string, tokens, "512,4096",
          "comma-separated context lengths (tokens of each sequence)");
ABSL_FLAG(std::string, clients, "1,4",
          "comma-separated counts of concurrent client threads");
ABSL_FLAG(int, seconds, 3, "seconds of Attend calls per run");
ABSL_FLAG(int, repeats, 3, "rounds of every configuration per level");
ABSL_FLAG(int, queries, 1, "queries per Attend (1: a decode step)");
ABSL_FLAG(std::string, wire, "f32",
          "queries and outputs on the wire: f32 (Client::Attend) or bf16 "
          "(AttendBatch with AttendWire::kBF16: half the bytes TLS "
          "encrypts)");
ABSL_FLAG(int, layers, 4, "layers of the model");
ABSL_FLAG(int, kv_heads, 8, "KV heads");
ABSL_FLAG(int, q_heads, 32, "query heads (a multiple of --kv_heads)");
ABSL_FLAG(int, head_dim, 128, "head dimension");
ABSL_FLAG(std::string, backend, "cpu", "the workers' --backend");
ABSL_FLAG(int64_t, pool_mb, 0,
          "the workers' --pool_mb; 0: sized for the largest level");
ABSL_FLAG(std::string, worker_flags, "",
          "extra kvworker flags, space-separated (after the bench's)");
ABSL_FLAG(std::string, bin_dir, "",
          "where kvmanager and kvworker are; empty: next to this binary");
ABSL_FLAG(std::string, tls_dir, "",
          "tests/tls/make_certs.sh's certificates; made there (with "
          "--make_certs) when it has no ca.crt; empty: a fresh directory");
ABSL_FLAG(std::string, make_certs, "tests/tls/make_certs.sh",
          "the script that makes the certificates of --tls_dir");
ABSL_FLAG(std::string, cpus_manager, "",
          "CPU list the kvmanager processes are pinned to; empty: not pinned");
ABSL_FLAG(std::string, cpus_worker, "",
          "CPU list the kvworker processes are pinned to");
ABSL_FLAG(std::string, cpus_bench, "",
          "CPU list this process (its client threads) is pinned to");
ABSL_FLAG(std::string, tsv, "", "also write every run as TSV to this file");

namespace {

namespace v1 = triax::v1;
namespace bench = triax::bench;
using triax::testing::Process;
using Clock = std::chrono::steady_clock;

constexpr char kTenant[] = "bench";
constexpr uint32_t kWriteChunk = 256;  // tokens per WriteKV

absl::Status Fail(absl::string_view flag, absl::string_view value,
                  absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat(flag, "=", value, ": ", want));
}

absl::StatusOr<std::vector<int>> ParseCounts(absl::string_view flag,
                                             absl::string_view list, int lo,
                                             int hi) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < lo || n > hi) {
      return Fail(
          flag, list,
          absl::StrCat("\"", part, "\" is not a count in ", lo, "..", hi));
    }
    out.push_back(n);
  }
  return out;
}

v1::ModelShape Model() {
  v1::ModelShape m;
  m.set_name("attend-bench");
  m.set_n_layers(absl::GetFlag(FLAGS_layers));
  m.set_n_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  m.set_n_q_heads(absl::GetFlag(FLAGS_q_heads));
  m.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  return m;
}

// One configuration's kvmanager and kvworker, and how a client reaches
// them.
struct Node {
  bench::SecurityConfig config;
  std::unique_ptr<Process> manager, worker;
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // a client's
  std::string tenant_token;   // empty without tokens
  std::string worker_socket;  // local configurations: "unix:..."
};

absl::Status Pin(const Process& p, absl::string_view flag,
                 const std::string& cpus) {
  return cpus.empty() ? absl::OkStatus()
                      : bench::PinProcess(p.pid(), cpus, flag);
}

// Starts the manager, issues the tokens, creates the tenant, starts the
// worker and waits until the manager lists it UP.
absl::StatusOr<std::unique_ptr<Node>> StartNode(
    const bench::SecurityConfig& config, const bench::CertFiles& certs,
    const std::string& bin, const std::string& dir, int64_t pool_mb) {
  auto node = std::make_unique<Node>();
  node->config = config;
  const std::string admin_file = dir + "/admin.token";
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--metadata=memory",
                                   "--worker_timeout_ms=10000"};
  for (std::string& f : bench::ManagerSecurityFlags(config, certs, admin_file))
    args.push_back(std::move(f));
  auto manager = Process::Start("kvmanager", bin + "/kvmanager", args, dir);
  if (!manager.ok()) return manager.status();
  node->manager = *std::move(manager);
  if (absl::Status s = Pin(*node->manager, "--cpus_manager",
                           absl::GetFlag(FLAGS_cpus_manager));
      !s.ok()) {
    return s;
  }
  auto credentials = bench::CredentialsFor(config, certs, bench::Peer::kClient);
  if (!credentials.ok()) return credentials.status();
  node->credentials = *credentials;
  auto admin = v1::Manager::NewStub(
      grpc::CreateChannel(node->manager->address(), node->credentials));
  std::string admin_token;
  const std::string worker_token_file = dir + "/worker.token";
  if (config.tokens) {
    auto token = triax::ReadBearerToken("admin_token_file", admin_file);
    if (!token.ok()) return token.status();
    admin_token = *token;
    auto worker = bench::IssueToken(admin.get(), admin_token, "worker", "");
    if (!worker.ok()) return worker.status();
    if (absl::Status s = bench::WriteTokenFile(worker_token_file, *worker);
        !s.ok()) {
      return s;
    }
  }
  {
    v1::CreateTenantRequest req;
    req.set_tenant_id(kTenant);
    v1::CreateTenantResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    triax::AddBearer(&ctx, admin_token);
    grpc::Status s = admin->CreateTenant(&ctx, req, &resp);
    if (!s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("CreateTenant: ", s.error_message()));
    }
  }
  if (config.tokens) {
    auto token = bench::IssueToken(admin.get(), admin_token, "tenant", kTenant);
    if (!token.ok()) return token.status();
    node->tenant_token = *token;
  }
  args = {"--listen=127.0.0.1:0", "--manager=" + node->manager->address(),
          // Worker ids take [A-Za-z0-9._:-].
          "--worker_id=w-" + absl::StrReplaceAll(config.name, {{"+", "."}}),
          "--backend=" + absl::GetFlag(FLAGS_backend),
          absl::StrCat("--pool_mb=", pool_mb), "--host_tier_mb=0"};
  for (std::string& f :
       bench::WorkerSecurityFlags(config, certs, worker_token_file)) {
    args.push_back(std::move(f));
  }
  if (config.local) {
    node->worker_socket = bench::LocalSocket(dir, "worker");
    args.push_back("--local_listen=" + node->worker_socket);
  }
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_worker_flags),
                                            ' ', absl::SkipEmpty())) {
    args.emplace_back(f);
  }
  auto worker = Process::Start("kvworker", bin + "/kvworker", args, dir,
                               /*with_port_file=*/true, absl::Seconds(60));
  if (!worker.ok()) return worker.status();
  node->worker = *std::move(worker);
  if (absl::Status s =
          Pin(*node->worker, "--cpus_worker", absl::GetFlag(FLAGS_cpus_worker));
      !s.ok()) {
    return s;
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (true) {
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    triax::AddBearer(&ctx, admin_token);
    grpc::Status s = admin->ListWorkers(&ctx, {}, &resp);
    if (s.ok() && resp.workers_size() == 1 &&
        resp.workers(0).state() == v1::WORKER_STATE_UP) {
      return node;
    }
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat(config.name, ": the worker is not UP after 30 s (",
                       s.error_message(), "); its log: ", node->worker->Log()));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

// One client thread's sequence: its own Client (so its own channels) and
// the sequence it opened and wrote.
struct Session {
  std::unique_ptr<triax::client::Client> client;
  triax::client::SequenceHandle seq;
  std::mt19937 rng;
};

// Opens a sequence of `tokens` tokens (one user span) and writes its K/V
// on every layer.
absl::StatusOr<std::unique_ptr<Session>> OpenSession(const Node& node,
                                                     uint32_t tokens,
                                                     int index) {
  auto session = std::make_unique<Session>();
  session->rng.seed(1234 + index);
  triax::client::ClientOptions options;
  options.manager_address = node.manager->address();
  options.tenant_id = kTenant;
  options.token = node.tenant_token;
  options.credentials = node.credentials;
  if (!node.worker_socket.empty()) {
    // A frontend on the worker's host: its data-plane calls on the socket.
    options.worker_sockets = {{node.worker->address(), node.worker_socket}};
  }
  auto client = triax::client::Client::Connect(options);
  if (!client.ok()) return client.status();
  session->client = *std::move(client);
  const v1::ModelShape model = Model();
  v1::Span span;
  span.set_role(v1::ROLE_USER);
  span.set_modality(v1::MODALITY_TEXT);
  span.set_num_tokens(tokens);
  auto seq = session->client->Open(model, {span});
  if (!seq.ok()) return seq.status();
  session->seq = *std::move(seq);
  std::normal_distribution<float> normal;
  std::vector<float> k(size_t{kWriteChunk} * model.n_kv_heads() *
                       model.head_dim());
  std::vector<float> v(k.size());
  for (float& x : k) x = normal(session->rng);
  for (float& x : v) x = normal(session->rng);
  for (uint32_t layer = 0; layer < model.n_layers(); ++layer) {
    for (uint32_t t = 0; t < tokens; t += kWriteChunk) {
      const uint32_t n = std::min(kWriteChunk, tokens - t);
      absl::Status s = session->client->WriteKV(session->seq, layer, t, n,
                                                k.data(), v.data());
      if (!s.ok()) return s;
    }
  }
  return session;
}

// Opens and writes one session per client, in parallel.
absl::StatusOr<std::vector<std::unique_ptr<Session>>> OpenSessions(
    const Node& node, uint32_t tokens, int clients) {
  std::vector<absl::StatusOr<std::unique_ptr<Session>>> opened(clients);
  std::vector<std::thread> threads;
  threads.reserve(clients);
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] { opened[i] = OpenSession(node, tokens, i); });
  }
  for (auto& t : threads) t.join();
  std::vector<std::unique_ptr<Session>> sessions;
  for (auto& o : opened) {
    if (!o.ok()) {
      return absl::Status(
          o.status().code(),
          absl::StrCat(node.config.name, ": ", o.status().message()));
    }
    sessions.push_back(*std::move(o));
  }
  return sessions;
}

struct ClientRun {
  std::vector<double> latency_ms;
  uint64_t errors = 0;
  std::string first_error;
};

// Every session's thread calls Attend from `go` until `deadline_ns`
// (steady clock): --queries queries at the last position, layers round
// robin, read-only.
void AttendLoop(Session* session, const absl::Notification* go,
                const std::atomic<int64_t>* deadline_ns, ClientRun* out) {
  const v1::ModelShape& model = session->seq.model;
  const uint32_t queries = absl::GetFlag(FLAGS_queries);
  std::normal_distribution<float> normal;
  std::vector<float> q(size_t{queries} * model.n_q_heads() * model.head_dim());
  for (float& x : q) x = normal(session->rng);
  std::vector<float> result(q.size());
  std::vector<uint64_t> positions(queries, session->seq.num_tokens - 1);
  triax::client::Client::AttendArgs args;
  args.num_queries = queries;
  args.positions = positions.data();
  args.q = q.data();
  args.out = result.data();
  const bool bf16 = absl::GetFlag(FLAGS_wire) == "bf16";
  std::vector<triax::client::Client::BatchItem> items(1);
  items[0].seq = &session->seq;
  go->WaitForNotification();
  const int64_t deadline = deadline_ns->load();
  for (uint64_t i = 0;; ++i) {
    const auto t0 = Clock::now();
    if (t0.time_since_epoch().count() >= deadline) break;
    args.layer = i % model.n_layers();
    absl::Status s;
    if (bf16) {
      items[0].args = args;
      auto results =
          session->client->AttendBatch(items, triax::client::AttendWire::kBF16);
      s = results.ok() ? (*results)[0] : results.status();
    } else {
      s = session->client->Attend(session->seq, args);
    }
    const auto t1 = Clock::now();
    if (!s.ok()) {
      if (out->errors++ == 0) out->first_error = std::string(s.message());
      continue;
    }
    out->latency_ms.push_back(
        std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
}

bench::Measurement TimeAttends(const Node& node,
                               std::vector<std::unique_ptr<Session>>* sessions,
                               int seconds) {
  std::vector<ClientRun> runs(sessions->size());
  absl::Notification go;
  std::atomic<int64_t> deadline_ns{0};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < sessions->size(); ++i) {
    threads.emplace_back(AttendLoop, (*sessions)[i].get(), &go, &deadline_ns,
                         &runs[i]);
  }
  const absl::StatusOr<double> server_cpu0 =
      bench::ProcessCpuSeconds(node.worker->pid());
  const absl::StatusOr<double> client_cpu0 = bench::ProcessCpuSeconds(0);
  const auto start = Clock::now();
  deadline_ns =
      (start + std::chrono::seconds(seconds)).time_since_epoch().count();
  go.Notify();
  for (auto& t : threads) t.join();
  bench::Measurement m;
  m.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const absl::StatusOr<double> server_cpu1 =
      bench::ProcessCpuSeconds(node.worker->pid());
  const absl::StatusOr<double> client_cpu1 = bench::ProcessCpuSeconds(0);
  if (server_cpu0.ok() && server_cpu1.ok()) {
    m.server_cpu_s = *server_cpu1 - *server_cpu0;
  }
  if (client_cpu0.ok() && client_cpu1.ok()) {
    m.client_cpu_s = *client_cpu1 - *client_cpu0;
  }
  std::string first_error;
  for (ClientRun& r : runs) {
    m.latency_ms.insert(m.latency_ms.end(), r.latency_ms.begin(),
                        r.latency_ms.end());
    m.errors += r.errors;
    if (first_error.empty()) first_error = r.first_error;
  }
  m.ops = m.latency_ms.size();
  if (!first_error.empty()) {
    std::cerr << "attend_bench: " << node.config.name << ": " << m.errors
              << " Attend errors; first: " << first_error << "\n";
  }
  return m;
}

absl::Status CloseSessions(const std::vector<std::unique_ptr<Session>>& all) {
  for (const auto& s : all) {
    TRIAX_RETURN_IF_ERROR(s->client->Close(s->seq));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "attend_bench [--security=plain,tls,mtls,token,mtls+token] "
      "[--tokens=512,4096] [--clients=1,4]: Attend RPC latency with TLS and "
      "capabilities on and off");
  absl::ParseCommandLine(argc, argv);
  auto configs =
      bench::ParseSecurityList(absl::GetFlag(FLAGS_security), "--security");
  auto token_levels =
      ParseCounts("--tokens", absl::GetFlag(FLAGS_tokens), 1, 1 << 20);
  auto client_levels =
      ParseCounts("--clients", absl::GetFlag(FLAGS_clients), 1, 256);
  absl::Status bad = configs.status();
  if (bad.ok()) bad = token_levels.status();
  if (bad.ok()) bad = client_levels.status();
  for (const auto& [flag, value, lo, hi] :
       {std::tuple{"--seconds", absl::GetFlag(FLAGS_seconds), 1, 3600},
        std::tuple{"--repeats", absl::GetFlag(FLAGS_repeats), 1, 100},
        std::tuple{"--queries", absl::GetFlag(FLAGS_queries), 1, 256},
        std::tuple{"--layers", absl::GetFlag(FLAGS_layers), 1, 512},
        std::tuple{"--kv_heads", absl::GetFlag(FLAGS_kv_heads), 1, 256},
        std::tuple{"--q_heads", absl::GetFlag(FLAGS_q_heads), 1, 1024},
        std::tuple{"--head_dim", absl::GetFlag(FLAGS_head_dim), 1, 1024}}) {
    if (bad.ok() && (value < lo || value > hi)) {
      bad = Fail(flag, absl::StrCat(value),
                 absl::StrCat("must be in ", lo, "..", hi));
    }
  }
  if (bad.ok() &&
      absl::GetFlag(FLAGS_q_heads) % absl::GetFlag(FLAGS_kv_heads) != 0) {
    bad = Fail("--q_heads", absl::StrCat(absl::GetFlag(FLAGS_q_heads)),
               absl::StrCat("must be a multiple of --kv_heads=",
                            absl::GetFlag(FLAGS_kv_heads)));
  }
  if (const std::string wire = absl::GetFlag(FLAGS_wire);
      bad.ok() && wire != "f32" && wire != "bf16") {
    bad = Fail("--wire", wire, "is not f32 or bf16");
  }
  if (bad.ok() && absl::GetFlag(FLAGS_pool_mb) < 0) {
    bad = Fail("--pool_mb", absl::StrCat(absl::GetFlag(FLAGS_pool_mb)),
               "must be >= 0");
  }
  for (const auto& [flag, value] :
       {std::pair{"--cpus_manager", absl::GetFlag(FLAGS_cpus_manager)},
        std::pair{"--cpus_worker", absl::GetFlag(FLAGS_cpus_worker)},
        std::pair{"--cpus_bench", absl::GetFlag(FLAGS_cpus_bench)}}) {
    if (bad.ok() && !value.empty()) bad = bench::CheckCpuList(value, flag);
  }
  if (!bad.ok()) {
    std::cerr << "attend_bench: " << bad.message() << "\n";
    return 2;
  }
  if (const std::string cpus = absl::GetFlag(FLAGS_cpus_bench); !cpus.empty()) {
    if (absl::Status s = bench::PinProcess(getpid(), cpus, "--cpus_bench");
        !s.ok()) {
      std::cerr << "attend_bench: " << s.message() << "\n";
      return 1;
    }
  }

  std::string bin = absl::GetFlag(FLAGS_bin_dir);
  if (bin.empty()) bin = bench::SelfDir();
  auto dir = triax::testing::TempDir::Create("attend_bench");
  if (!dir.ok()) {
    std::cerr << "attend_bench: " << dir.status().message() << "\n";
    return 1;
  }
  bench::CertFiles certs;
  if (bench::AnyTls(*configs)) {
    std::string tls_dir = absl::GetFlag(FLAGS_tls_dir);
    if (tls_dir.empty()) tls_dir = (*dir)->path() + "/certs";
    auto made = bench::PrepareCerts(tls_dir, absl::GetFlag(FLAGS_make_certs),
                                    "--make_certs");
    if (!made.ok()) {
      std::cerr << "attend_bench: " << made.status().message() << "\n";
      return 2;
    }
    certs = *made;
  }
  const v1::ModelShape model = Model();
  const uint64_t seq_bytes = static_cast<uint64_t>(*std::max_element(
                                 token_levels->begin(), token_levels->end())) *
                             model.n_layers() * model.n_kv_heads() *
                             model.head_dim() * 2 * 2;
  int64_t pool_mb = absl::GetFlag(FLAGS_pool_mb);
  if (pool_mb == 0) {
    // BF16 for every sequence at once (the encoded pages are smaller), a
    // quarter more for partly filled frames, and 64 MiB.
    const int most =
        *std::max_element(client_levels->begin(), client_levels->end());
    pool_mb = static_cast<int64_t>(seq_bytes * most * 5 / 4 >> 20) + 64;
  }

  std::vector<std::unique_ptr<Node>> nodes;
  for (size_t c = 0; c < configs->size(); ++c) {
    const std::string sub = absl::StrCat((*dir)->path(), "/config", c);
    std::filesystem::create_directories(sub);
    auto node = StartNode((*configs)[c], certs, bin, sub, pool_mb);
    if (!node.ok()) {
      std::cerr << "attend_bench: " << (*configs)[c].name << ": "
                << node.status().message() << "\n";
      return 1;
    }
    nodes.push_back(*std::move(node));
  }

  const int seconds = absl::GetFlag(FLAGS_seconds);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  std::printf(
      "attend_bench: %zu configurations (%s), backend %s, %u cores (nproc), "
      "model %u layers x %u KV heads x %u query heads x head_dim %u, %d "
      "queries per Attend (%s on the wire), %d s per run, %d repeats, "
      "worker pool %lld MiB\n\n",
      nodes.size(), absl::GetFlag(FLAGS_security).c_str(),
      absl::GetFlag(FLAGS_backend).c_str(), std::thread::hardware_concurrency(),
      model.n_layers(), model.n_kv_heads(), model.n_q_heads(), model.head_dim(),
      absl::GetFlag(FLAGS_queries), absl::GetFlag(FLAGS_wire).c_str(), seconds,
      repeats, static_cast<long long>(pool_mb));
  std::printf(
      "| tokens | clients | security | repeat | Attends/s | p50 ms | p99 ms | "
      "worker CPU us/Attend | errors |\n|---:|---:|---|---:|---:|---:|---:|"
      "---:|---:|\n");
  std::vector<std::string> labels;
  std::vector<std::pair<uint32_t, int>> levels;
  for (int t : *token_levels) {
    for (int c : *client_levels) {
      labels.push_back(absl::StrCat(t, " x ", c));
      levels.emplace_back(t, c);
    }
  }
  bench::CostReport report(*configs, labels);
  for (size_t l = 0; l < levels.size(); ++l) {
    // Every configuration's sessions are written once per level; the
    // repeats then alternate between configurations on the same sequences.
    std::vector<std::vector<std::unique_ptr<Session>>> sessions;
    for (const auto& node : nodes) {
      auto opened = OpenSessions(*node, levels[l].first, levels[l].second);
      if (!opened.ok()) {
        std::cerr << "attend_bench: " << opened.status().message() << "\n";
        return 1;
      }
      sessions.push_back(*std::move(opened));
    }
    for (int r = 0; r < repeats; ++r) {
      for (size_t c = 0; c < nodes.size(); ++c) {
        bench::Measurement m = TimeAttends(*nodes[c], &sessions[c], seconds);
        std::vector<double> latency = m.latency_ms;
        std::printf(
            "| %u | %d | %s | %d | %.0f | %.3f | %.3f | %.1f | %llu |\n",
            levels[l].first, levels[l].second, (*configs)[c].name.c_str(),
            r + 1, m.seconds > 0 ? m.ops / m.seconds : 0,
            bench::Quantile(&latency, 0.5), bench::Quantile(&latency, 0.99),
            m.ops > 0 ? m.server_cpu_s * 1e6 / m.ops : 0,
            static_cast<unsigned long long>(m.errors));
        std::fflush(stdout);
        report.Add(l, c, std::move(m));
      }
    }
    for (size_t c = 0; c < nodes.size(); ++c) {
      if (absl::Status s = CloseSessions(sessions[c]); !s.ok()) {
        std::cerr << "attend_bench: " << (*configs)[c].name << ": "
                  << s.message() << "\n";
        return 1;
      }
    }
  }
  std::printf("\nAttend against %s (level: tokens x clients):\n\n%s",
              configs->front().name.c_str(),
              report.Markdown("tokens x clients", "Attends", "worker").c_str());
  if (const std::string tsv = absl::GetFlag(FLAGS_tsv); !tsv.empty()) {
    if (absl::Status s = report.WriteTsv(tsv, "attend"); !s.ok()) {
      std::cerr << "attend_bench: " << s.message() << "\n";
      return 1;
    }
  }
  return report.errors() == 0 ? 0 : 1;
}
