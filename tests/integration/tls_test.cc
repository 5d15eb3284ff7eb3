// TLS everywhere (docs/security.md), with real processes on loopback and
// certificates made at run time by tests/tls/make_certs.sh (openssl): a
// cluster on TLS runs its normal flow (open, write, attend, read, a transfer
// between workers, kvctl); a plaintext client is refused and changes
// nothing; only a worker's certificate may RegisterWorker and Heartbeat;
// with --tls_require_client_cert a client without a certificate, or with
// one from another CA, is refused; /metrics is served over HTTPS; bad TLS
// files stop the daemons with exit 2 naming the flag.
#include "common/tls.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/kv_client.h"
#include "common/local_socket.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// The files tests/tls/make_certs.sh writes into a test's temp dir.
class Certs {
 public:
  // Runs the script (openssl at run time); fails the test when it fails.
  static std::unique_ptr<Certs> Make(const std::string& dir) {
    std::string out, err;
    auto rc = RunToCompletion("/bin/bash", {TRIAX_MAKE_CERTS, dir + "/tls"},
                              dir, &out, &err, absl::Seconds(60));
    EXPECT_THAT(rc, IsOk());
    if (!rc.ok() || *rc != 0) {
      ADD_FAILURE() << "make_certs.sh failed: " << out << err;
      return nullptr;
    }
    return std::unique_ptr<Certs>(new Certs(dir + "/tls"));
  }

  std::string File(const std::string& name) const {
    return absl::StrCat(dir_, "/", name);
  }

  // --tls_cert, --tls_key and --tls_ca of a daemon with identity `who`
  // (manager, worker), trusting `ca`.
  std::vector<std::string> DaemonFlags(const std::string& who,
                                       const std::string& ca = "ca") const {
    return {"--tls_cert=" + File(who + ".crt"),
            "--tls_key=" + File(who + ".key"), "--tls_ca=" + File(ca + ".crt")};
  }

  // Channel credentials verifying the server with the test CA, presenting
  // `who`'s certificate ("" : none).
  std::shared_ptr<grpc::ChannelCredentials> Credentials(
      const std::string& who) const {
    TlsOptions o;
    o.ca_file = File("ca.crt");
    if (!who.empty()) {
      o.cert_file = File(who + ".crt");
      o.key_file = File(who + ".key");
    }
    auto config = LoadTls(o);
    EXPECT_THAT(config, IsOk());
    return config.ok() ? ChannelCredentials(*config) : nullptr;
  }

 private:
  explicit Certs(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

std::unique_ptr<v1::Manager::Stub> ManagerStub(
    const std::string& address,
    std::shared_ptr<grpc::ChannelCredentials> creds) {
  return v1::Manager::NewStub(grpc::CreateChannel(address, std::move(creds)));
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Writes `tokens` random tokens of K/V on every layer of `seq`, reads layer
// 0 back bit for bit and attends once at the last position against the
// reference; layer 0's K/V in *k0, *v0. Fatal failures: call in
// ASSERT_NO_FATAL_FAILURE.
void WriteReadAttend(client::Client* client, const client::SequenceHandle& seq,
                     const v1::ModelShape& model, uint32_t tokens,
                     uint32_t seed, std::vector<float>* k0,
                     std::vector<float>* v0) {
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const size_t elems = size_t{model.n_kv_heads()} * model.head_dim();
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    auto k = RandomVector(tokens * elems, &rng);
    auto v = RandomVector(tokens * elems, &rng);
    ASSERT_THAT(client->WriteKV(seq, l, 0, tokens, k.data(), v.data()), IsOk());
    if (l == 0) *k0 = k, *v0 = v;
  }
  std::vector<float> rk, rv;
  ASSERT_THAT(client->ReadKV(seq, 0, 0, tokens, &rk, &rv), IsOk());
  EXPECT_EQ(rk, RoundToBf16(*k0));
  EXPECT_EQ(rv, RoundToBf16(*v0));
  const std::vector<uint64_t> pos = {tokens - 1};
  auto q = RandomVector(model.n_q_heads() * model.head_dim(), &rng);
  std::vector<float> out(q.size(), std::nanf(""));
  client::Client::AttendArgs a;
  a.layer = 0;
  a.num_queries = 1;
  a.positions = pos.data();
  a.q = q.data();
  a.out = out.data();
  ASSERT_THAT(client->Attend(seq, a), IsOk());
  auto ref =
      ReferenceAttention(model, q, pos, RoundToBf16(*k0), RoundToBf16(*v0));
  EXPECT_LE(WorstToleranceRatio(out, ref, ToleranceFor("cpu").atol,
                                ToleranceFor("cpu").rtol),
            1.0);
}

// A cluster of a manager and two CPU workers, all on TLS with the test
// CA; clients present the frontend's certificate. `require`: every
// listener also demands client certificates. `named_workers`: the workers'
// certificate names no address, only kvworker.triaxkv.test, which every
// dialer of a worker verifies instead (--tls_worker_server_name).
class TlsTest : public ::testing::Test {
 protected:
  static constexpr char kWorkerName[] = "kvworker.triaxkv.test";

  void StartCluster(bool require, bool named_workers = false) {
    auto dir = TempDir::Create("tls_test");
    ASSERT_THAT(dir, IsOk());
    dir_ = std::move(*dir);
    certs_ = Certs::Make(dir_->path());
    ASSERT_NE(certs_, nullptr);
    ClusterOptions o;
    o.num_workers = 2;
    o.manager_flags = certs_->DaemonFlags("manager");
    o.manager_flags.push_back("--http_listen=127.0.0.1:0");
    o.manager_flags.push_back("--http_port_file=" + dir_->path() + "/m.http");
    o.worker_flags =
        certs_->DaemonFlags(named_workers ? "named-worker" : "worker");
    o.worker_flags.push_back("--backend=cpu");
    if (named_workers) {
      const std::string flag =
          absl::StrCat("--tls_worker_server_name=", kWorkerName);
      o.manager_flags.push_back(flag);
      o.worker_flags.push_back(flag);
      o.tls_worker_server_name = kWorkerName;
    }
    if (require) {
      o.manager_flags.push_back("--tls_require_client_cert");
      o.worker_flags.push_back("--tls_require_client_cert");
    }
    for (const std::string& f : extra_manager_flags_) {
      o.manager_flags.push_back(f);
    }
    if (!worker0_flags_.empty()) o.per_worker_flags = {worker0_flags_};
    o.credentials = certs_->Credentials("client");
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
  }

  // kvctl against the cluster with `tls` flags first; the exit code.
  int Kvctl(std::vector<std::string> args, std::vector<std::string> tls) {
    tls.push_back("--manager=" + cluster_->manager_address());
    args.insert(args.begin(), tls.begin(), tls.end());
    auto rc = RunToCompletion("kvctl", args, cluster_->dir(), &out_, &err_);
    EXPECT_THAT(rc, IsOk());
    return rc.ok() ? *rc : -1;
  }
  std::vector<std::string> ClientTls() const {
    return {"--tls_ca=" + certs_->File("ca.crt"),
            "--tls_cert=" + certs_->File("client.crt"),
            "--tls_key=" + certs_->File("client.key")};
  }

  // The tenants the manager lists, over TLS.
  std::vector<std::string> TenantIds() {
    auto stub =
        ManagerStub(cluster_->manager_address(), certs_->Credentials("client"));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::ListTenantsResponse resp;
    const grpc::Status s = stub->ListTenants(&ctx, {}, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<std::string> ids;
    for (const auto& t : resp.tenants()) ids.push_back(t.tenant_id());
    return ids;
  }

  std::vector<std::string> extra_manager_flags_;  // StartCluster's, last
  std::vector<std::string> worker0_flags_;        // of worker 0 only
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Certs> certs_;
  std::unique_ptr<Cluster> cluster_;
  std::string out_, err_;
};

class TlsFlowTest : public TlsTest,
                    public ::testing::WithParamInterface<bool> {};

TEST_P(TlsFlowTest, ClusterRunsItsNormalFlowOverTls) {
  const bool named_workers = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*require=*/true, named_workers));
  ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
  auto client = cluster_->NewClient("acme");
  ASSERT_THAT(client, IsOk());
  const v1::ModelShape model = SmallModel();
  auto seq = (*client)->Open(
      model, {MakeSpan(v1::ROLE_SYSTEM, 20), MakeSpan(v1::ROLE_USER, 13)},
      "bf16", 16);
  ASSERT_THAT(seq, IsOk());

  // Write every layer, read layer 0 back bit for bit, attend once.
  std::vector<float> k0, v0;
  ASSERT_NO_FATAL_FAILURE(
      WriteReadAttend(client->get(), *seq, model, 33, 20261125, &k0, &v0));
  std::vector<float> rk, rv;

  // kvctl over TLS with the client certificate lists what was made.
  ASSERT_EQ(Kvctl({"workers"}, ClientTls()), 0) << err_;
  EXPECT_THAT(out_, HasSubstr("w0"));
  EXPECT_THAT(out_, HasSubstr("w1"));
  if (named_workers) {
    // A dialer that checks the worker's address instead of its agreed
    // name cannot verify it: UNAVAILABLE, nothing read.
    client::ClientOptions o;
    o.manager_address = cluster_->manager_address();
    o.tenant_id = "acme";
    o.rpc_timeout_ms = 5000;
    o.credentials = certs_->Credentials("client");
    auto unnamed = client::Client::Connect(o);
    ASSERT_THAT(unnamed, IsOk());
    EXPECT_THAT((*unnamed)->ReadKV(*seq, 0, 0, 33, &rk, &rv),
                StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  }
  ASSERT_EQ(Kvctl({"sequences", "--tenant=acme"}, ClientTls()), 0) << err_;
  EXPECT_THAT(out_, HasSubstr(seq->sequence_id));

  // A transfer: the manager dials both workers, the destination pulls the
  // pages from the source, all over mutual TLS; the pages arrive intact.
  const std::string to =
      seq->worker_address == cluster_->worker_process(0)->address() ? "w1"
                                                                    : "w0";
  ASSERT_EQ(Kvctl({"transfer", seq->sequence_id, "--to=" + to}, ClientTls()), 0)
      << err_;
  client::SequenceHandle moved = *seq;
  moved.worker_address =
      cluster_->worker_process(to == "w0" ? 0 : 1)->address();
  ASSERT_THAT((*client)->ReadKV(moved, 0, 0, 33, &rk, &rv), IsOk());
  EXPECT_EQ(rk, RoundToBf16(k0));
  EXPECT_EQ(rv, RoundToBf16(v0));
}

INSTANTIATE_TEST_SUITE_P(WorkerCertificates, TlsFlowTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "NamedNotAddressed"
                                             : "AddressedByIp";
                         });

TEST_F(TlsTest, PlaintextClientIsRefusedAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*require=*/false));
  auto plain = ManagerStub(cluster_->manager_address(),
                           grpc::InsecureChannelCredentials());
  v1::CreateTenantRequest req;
  req.set_request_id("plain-1");
  req.set_tenant_id("intruder");
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::CreateTenantResponse resp;
  const grpc::Status s = plain->CreateTenant(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_THAT(TenantIds(), Not(::testing::Contains("intruder")));

  // kvctl without --tls_ca speaks plaintext: UNAVAILABLE, exit 1.
  EXPECT_EQ(Kvctl({"tenant-create", "intruder"}, {}), 1);
  EXPECT_THAT(err_, StartsWith("kvctl: UNAVAILABLE: "));
  EXPECT_THAT(TenantIds(), Not(::testing::Contains("intruder")));

  // Plaintext to a worker: refused as well.
  auto worker = v1::Worker::NewStub(
      grpc::CreateChannel(cluster_->worker_process(0)->address(),
                          grpc::InsecureChannelCredentials()));
  grpc::ClientContext wctx;
  Deadline(&wctx);
  v1::Inventory inv;
  EXPECT_EQ(worker->GetInventory(&wctx, {}, &inv).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, OnlyWorkerCertificatesRegisterAndHeartbeat) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*require=*/false));
  auto before = cluster_->GetWorker("w0");
  ASSERT_THAT(before, IsOk());

  v1::RegisterWorkerRequest reg;
  reg.set_worker_id("impostor");
  reg.set_address("127.0.0.1:1");
  reg.set_backend("cpu");
  reg.set_capacity_bytes(1 << 20);
  reg.set_incarnation("x-1");
  v1::HeartbeatRequest hb;
  hb.set_worker_id("w0");
  hb.set_incarnation("x-1");

  struct Caller {
    std::string who;  // certificate presented; "" none
    grpc::StatusCode want;
  };
  for (const Caller& c :
       {Caller{"client", grpc::StatusCode::PERMISSION_DENIED},
        Caller{"manager", grpc::StatusCode::PERMISSION_DENIED},
        Caller{"", grpc::StatusCode::UNAUTHENTICATED}}) {
    SCOPED_TRACE("certificate: " + (c.who.empty() ? "none" : c.who));
    auto stub =
        ManagerStub(cluster_->manager_address(), certs_->Credentials(c.who));
    grpc::ClientContext rctx;
    Deadline(&rctx);
    v1::RegisterWorkerResponse rresp;
    const grpc::Status r = stub->RegisterWorker(&rctx, reg, &rresp);
    EXPECT_EQ(r.error_code(), c.want) << r.error_message();
    EXPECT_THAT(r.error_message(), HasSubstr("RegisterWorker"));
    grpc::ClientContext hctx;
    Deadline(&hctx);
    v1::HeartbeatResponse hresp;
    const grpc::Status h = stub->Heartbeat(&hctx, hb, &hresp);
    EXPECT_EQ(h.error_code(), c.want) << h.error_message();
    // The same caller may still use the frontend RPCs.
    grpc::ClientContext lctx;
    Deadline(&lctx);
    v1::ListWorkersResponse list;
    ASSERT_TRUE(stub->ListWorkers(&lctx, {}, &list).ok());
    for (const auto& w : list.workers()) EXPECT_NE(w.worker_id(), "impostor");
  }
  // w0 keeps its incarnation: the refused heartbeat changed nothing.
  auto after = cluster_->GetWorker("w0");
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->incarnation(), before->incarnation());
  EXPECT_EQ(after->state(), v1::WORKER_STATE_UP);
}

TEST_F(TlsTest, WorkersTakePlansOnlyFromTheManagerAndPagePullsFromWorkers) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*require=*/false));
  ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
  auto client = cluster_->NewClient("acme");
  ASSERT_THAT(client, IsOk());
  const v1::ModelShape model = SmallModel();
  auto seq =
      (*client)->Open(model, {MakeSpan(v1::ROLE_SYSTEM, 16)}, "bf16", 16);
  ASSERT_THAT(seq, IsOk());
  std::mt19937 rng(20261125);
  const size_t elems = size_t{model.n_kv_heads()} * model.head_dim();
  std::vector<float> k, v;
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    k = RandomVector(16 * elems, &rng), v = RandomVector(16 * elems, &rng);
    ASSERT_THAT((*client)->WriteKV(*seq, l, 0, 16, k.data(), v.data()), IsOk());
  }

  v1::EvictRequest evict;
  evict.set_request_id("evict-1");
  evict.set_tenant_id("acme");
  evict.set_sequence_id(seq->sequence_id);
  evict.add_lineage_ids(seq->blocks[0].lineage_id());
  v1::ExportPagesRequest pull;
  pull.set_transfer_id("xfer-x");
  pull.set_tenant_id("acme");
  pull.set_sequence_id(seq->sequence_id);
  *pull.add_blocks() = seq->blocks[0];
  struct Caller {
    std::string who;  // certificate presented; "" none
    grpc::StatusCode want;
  };
  for (const Caller& c : {Caller{"client", grpc::StatusCode::PERMISSION_DENIED},
                          Caller{"", grpc::StatusCode::UNAUTHENTICATED}}) {
    SCOPED_TRACE("certificate: " + (c.who.empty() ? "none" : c.who));
    auto worker = v1::Worker::NewStub(
        grpc::CreateChannel(seq->worker_address, certs_->Credentials(c.who)));
    grpc::ClientContext ectx;
    Deadline(&ectx);
    v1::EvictResponse eresp;
    const grpc::Status e = worker->Evict(&ectx, evict, &eresp);
    EXPECT_EQ(e.error_code(), c.want) << e.error_message();
    EXPECT_THAT(e.error_message(), HasSubstr("Evict"));
    grpc::ClientContext pctx;
    Deadline(&pctx);
    auto reader = worker->ExportPages(&pctx, pull);
    v1::PageBatch batch;
    EXPECT_FALSE(reader->Read(&batch));
    const grpc::Status p = reader->Finish();
    EXPECT_EQ(p.error_code(), c.want) << p.error_message();
  }
  // Nothing was evicted: the last layer reads back as written.
  std::vector<float> rk, rv;
  ASSERT_THAT((*client)->ReadKV(*seq, model.n_layers() - 1, 0, 16, &rk, &rv),
              IsOk());
  EXPECT_EQ(rk, RoundToBf16(k));
  EXPECT_EQ(rv, RoundToBf16(v));
}

TEST_F(TlsTest, RequiredClientCertificatesRefuseOthers) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*require=*/true));
  auto list = [&](std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto stub = ManagerStub(cluster_->manager_address(), std::move(creds));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::ListWorkersResponse resp;
    return stub->ListWorkers(&ctx, {}, &resp).error_code();
  };
  EXPECT_EQ(list(certs_->Credentials("client")), grpc::StatusCode::OK);
  EXPECT_EQ(list(certs_->Credentials("")), grpc::StatusCode::UNAVAILABLE);
  // A certificate named kvworker, signed by a CA the manager does not trust.
  TlsOptions rogue;
  rogue.ca_file = certs_->File("ca.crt");
  rogue.cert_file = certs_->File("rogue-worker.crt");
  rogue.key_file = certs_->File("rogue-worker.key");
  auto config = LoadTls(rogue);
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(list(ChannelCredentials(*config)), grpc::StatusCode::UNAVAILABLE);

  // kvctl without its certificate: refused (exit 1); with it: served.
  EXPECT_EQ(Kvctl({"workers"}, {"--tls_ca=" + certs_->File("ca.crt")}), 1);
  EXPECT_THAT(err_, StartsWith("kvctl: UNAVAILABLE: "));
  EXPECT_EQ(Kvctl({"workers"}, ClientTls()), 0) << err_;

  // A worker with the rogue certificate never registers: the manager
  // refuses its handshake, and its list stays as it was.
  auto rogue_worker = Process::Start(
      "rogue", "kvworker",
      {"--listen=127.0.0.1:0", "--manager=" + cluster_->manager_address(),
       "--worker_id=rogue", "--backend=cpu", "--pool_mb=16",
       "--tls_cert=" + certs_->File("rogue-worker.crt"),
       "--tls_key=" + certs_->File("rogue-worker.key"),
       "--tls_ca=" + certs_->File("ca.crt")},
      dir_->path());
  ASSERT_THAT(rogue_worker, IsOk());
  ASSERT_THAT(Cluster::WaitFor(
                  "the rogue worker's failed registration", absl::Seconds(10),
                  [&]() -> absl::StatusOr<bool> {
                    return absl::StrContains((*rogue_worker)->Log(),
                                             "RegisterWorker failed");
                  }),
              IsOk());
  EXPECT_THAT(cluster_->GetWorker("rogue"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(TlsTest, MetricsAreServedOverHttps) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*require=*/false));
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      absl::StripAsciiWhitespace(ReadAll(dir_->path() + "/m.http")), &port));
  const std::string url = absl::StrCat("https://127.0.0.1:", port, "/metrics");
  std::string out, err;
  auto rc = RunToCompletion("/usr/bin/curl",
                            {"-sS", "--cacert", certs_->File("ca.crt"), url},
                            dir_->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  ASSERT_EQ(*rc, 0) << err;
  EXPECT_THAT(out, HasSubstr("triaxkv_manager_workers"));
  // Not trusting the CA, curl refuses the certificate (exit 60); plain
  // HTTP on the port gets no answer (exit 52 or 56).
  rc = RunToCompletion("/usr/bin/curl", {"-sS", url}, dir_->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 60) << err;
  rc = RunToCompletion(
      "/usr/bin/curl",
      {"-sS", absl::StrCat("http://127.0.0.1:", port, "/metrics")},
      dir_->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_NE(*rc, 0) << out;
}

// Each bad TLS set-up stops a daemon at start-up, exit 2, naming the flag.
TEST(TlsFlagsTest, BadFilesStopTheDaemonsNamingTheFlag) {
  auto dir = TempDir::Create("tls_flags");
  ASSERT_THAT(dir, IsOk());
  auto certs = Certs::Make((*dir)->path());
  ASSERT_NE(certs, nullptr);
  struct Case {
    std::string binary;
    std::vector<std::string> flags;
    std::string message;
  };
  const std::string missing = (*dir)->path() + "/missing.crt";
  const std::vector<Case> cases = {
      {"kvmanager",
       {"--metadata=memory", "--tls_cert=" + missing,
        "--tls_key=" + certs->File("manager.key")},
       "--tls_cert=" + missing + ": cannot read the file"},
      {"kvmanager",
       {"--metadata=memory", "--tls_cert=" + certs->File("manager.crt"),
        "--tls_key=" + certs->File("worker.key")},
       "is not the key of --tls_cert="},
      {"kvmanager",
       {"--metadata=memory", "--tls_cert=" + certs->File("manager.crt"),
        "--tls_key=" + certs->File("manager.key"),
        "--tls_ca=" + certs->File("manager.key")},
       "holds no PEM certificate"},
      {"kvworker",
       {"--backend=cpu", "--tls_cert=" + certs->File("worker.crt")},
       "needs --tls_key"},
      {"kvworker",
       {"--backend=cpu", "--tls_require_client_cert",
        "--tls_cert=" + certs->File("worker.crt"),
        "--tls_key=" + certs->File("worker.key")},
       "--tls_require_client_cert needs --tls_ca"},
      {"kvworker",
       {"--backend=cpu", "--transfer_path=link",
        "--tls_cert=" + certs->File("worker.crt"),
        "--tls_key=" + certs->File("worker.key"),
        "--tls_ca=" + certs->File("ca.crt")},
       "--transfer_path=link"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.binary + " " + c.message);
    std::vector<std::string> args = c.flags;
    args.push_back("--listen=127.0.0.1:0");
    std::string out, err;
    auto rc = RunToCompletion(c.binary, args, (*dir)->path(), &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, 2) << out << err;
    EXPECT_THAT(out + err, HasSubstr(c.message));
  }
}

// --local_listen (docs/security.md "Local socket"): under mutual TLS with
// client certificates required on TCP, a frontend without any certificate
// opens, writes, attends and reads over the manager's and the worker's
// Unix-domain sockets (it could not over TCP: the calls could only have gone
// over the sockets); the methods only the manager's or a worker's
// certificate may call are refused there and change nothing; the sockets
// have their mode and go when the daemons stop.
TEST_F(TlsTest, LocalSocketsServeFrontendsWithoutTls) {
  extra_manager_flags_ = {"--local_listen=unix:$DIR/m.sock",
                          "--local_listen_mode=0600"};
  worker0_flags_ = {"--local_listen=unix:$DIR/w.sock"};
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*require=*/true));
  ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
  const std::string m_sock = cluster_->dir() + "/m.sock";
  const std::string w_sock = cluster_->dir() + "/w.sock";
  struct stat st {};
  ASSERT_EQ(stat(m_sock.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat(w_sock.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);  // the default

  client::ClientOptions o;
  o.manager_address = "unix:" + m_sock;
  o.tenant_id = "acme";
  o.rpc_timeout_ms = 10000;
  o.credentials = nullptr;  // no CA, no certificate
  o.worker_sockets = {
      {cluster_->worker_process(0)->address(), "unix:" + w_sock}};
  auto client = client::Client::Connect(o);
  ASSERT_THAT(client, IsOk());
  const v1::ModelShape model = SmallModel();
  auto seq =
      (*client)->Open(model, {MakeSpan(v1::ROLE_SYSTEM, 20)}, "bf16", 16);
  ASSERT_THAT(seq, IsOk());
  std::vector<float> k0, v0;
  ASSERT_NO_FATAL_FAILURE(
      WriteReadAttend(client->get(), *seq, model, 20, 20261207, &k0, &v0));
  std::vector<float> rk, rv;

  // The same client over TCP has no certificate: refused at the handshake.
  {
    client::ClientOptions tcp = o;
    tcp.manager_address = cluster_->manager_address();
    tcp.worker_sockets.clear();
    tcp.rpc_timeout_ms = 3000;
    auto plain = client::Client::Connect(tcp);
    ASSERT_THAT(plain, IsOk());
    EXPECT_THAT((*plain)->ReadKV(*seq, 0, 0, 20, &rk, &rv),
                StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  }

  // Over the sockets, what needs the manager's or a worker's certificate is
  // refused, naming the method.
  auto worker = v1::Worker::NewStub(grpc::CreateChannel(
      "unix:" + w_sock, ChannelCredentialsFor("unix:" + w_sock, nullptr)));
  v1::EvictRequest evict;
  evict.set_request_id("evict-local");
  evict.set_tenant_id("acme");
  evict.set_sequence_id(seq->sequence_id);
  evict.add_lineage_ids(seq->blocks[0].lineage_id());
  grpc::ClientContext ectx;
  Deadline(&ectx);
  v1::EvictResponse eresp;
  const grpc::Status e = worker->Evict(&ectx, evict, &eresp);
  EXPECT_EQ(e.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << e.error_message();
  EXPECT_THAT(e.error_message(), HasSubstr("Evict"));
  auto manager = ManagerStub("unix:" + m_sock,
                             ChannelCredentialsFor("unix:" + m_sock, nullptr));
  v1::RegisterWorkerRequest reg;
  reg.set_worker_id("rogue");
  reg.set_address("127.0.0.1:1");
  reg.set_capacity_bytes(1ull << 40);
  grpc::ClientContext rctx;
  Deadline(&rctx);
  v1::RegisterWorkerResponse rresp;
  const grpc::Status r = manager->RegisterWorker(&rctx, reg, &rresp);
  EXPECT_EQ(r.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << r.error_message();
  EXPECT_THAT(r.error_message(), HasSubstr("RegisterWorker"));
  EXPECT_THAT(cluster_->GetWorker("rogue"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  ASSERT_THAT((*client)->ReadKV(*seq, 0, 0, 20, &rk, &rv), IsOk());
  EXPECT_EQ(rk, RoundToBf16(k0));

  // A stopped daemon takes its socket file with it.
  cluster_->worker_process(0)->Stop();
  EXPECT_NE(lstat(w_sock.c_str(), &st), 0);
}

TEST(TlsFlagsTest, BadLocalSocketFlagsStopTheDaemonsNamingTheFlag) {
  auto dir = TempDir::Create("sock_flags");
  ASSERT_THAT(dir, IsOk());
  const std::string d = (*dir)->path();
  std::ofstream(d + "/file") << "not a socket";
  struct Case {
    std::string binary;
    std::vector<std::string> flags;
    std::vector<std::string> message;  // parts (the manager logs in logfmt)
  };
  const std::vector<Case> cases = {
      {"kvworker",
       {"--backend=cpu", "--local_listen=127.0.0.1:9"},
       {"--local_listen=", "127.0.0.1:9",
        "is not a Unix-domain socket address"}},
      {"kvworker",
       {"--backend=cpu", "--local_listen=unix:" + d + "/no/w.sock"},
       {"--local_listen=", "the directory", d + "/no", "does not exist"}},
      {"kvworker",
       {"--backend=cpu", "--local_listen=unix:" + d + "/file"},
       {"--local_listen=", "exists and is not a socket"}},
      {"kvworker",
       {"--backend=cpu", "--local_listen=unix:" + d + "/w.sock",
        "--local_listen_mode=0999"},
       {"--local_listen_mode=", "0999", "is not an octal file mode"}},
      {"kvmanager",
       {"--metadata=memory", "--local_listen=unix:relative.sock"},
       {"--local_listen=", "names no absolute path"}},
      {"kvmanager",
       {"--metadata=memory", "--local_listen=unix:" + d + "/m.sock",
        "--local_listen_mode=rw"},
       {"--local_listen_mode=", "rw", "is not an octal file mode"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.binary + " " + c.message.back());
    std::vector<std::string> args = c.flags;
    args.push_back("--listen=127.0.0.1:0");
    std::string out, err;
    auto rc = RunToCompletion(c.binary, args, d, &out, &err);
    ASSERT_THAT(rc, IsOk());
    EXPECT_EQ(*rc, 2) << out << err;
    for (const std::string& part : c.message) {
      EXPECT_THAT(out + err, HasSubstr(part));
    }
  }
  // A second daemon may not take a socket that a live one serves.
  auto first =
      Process::Start("w-first", "kvworker",
                     {"--backend=cpu", "--listen=127.0.0.1:0", "--pool_mb=16",
                      "--local_listen=unix:" + d + "/live.sock"},
                     d);
  ASSERT_THAT(first, IsOk());
  std::string out, err;
  auto rc =
      RunToCompletion("kvworker",
                      {"--backend=cpu", "--listen=127.0.0.1:0", "--pool_mb=16",
                       "--local_listen=unix:" + d + "/live.sock"},
                      d, &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2) << out << err;
  EXPECT_THAT(out + err, HasSubstr("another process serves on"));
}

}  // namespace
}  // namespace triax::testing
