// Failover on etcd (docs/manager.md "Failover on etcd") with real
// processes: a three-member etcd cluster on loopback (Debian's etcd), two
// kvmanagers with --metadata=etcd://..., a kvworker and clients given both
// manager addresses. One manager leads, the other answers UNAVAILABLE
// naming it. The leader is killed with SIGKILL under load: the standby takes
// over, the worker and the clients follow it, and every acknowledged
// sequence is there with its blocks; no id is reused. Prints the failover
// time (kill until the new leader answers). Skipped without /usr/bin/etcd.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/process.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kEtcd[] = "/usr/bin/etcd";

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

// ListWorkers on one manager: OK (it leads) or its error.
absl::Status Probe(const std::string& address, v1::ListWorkersResponse* out) {
  auto stub = v1::Manager::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(500));
  v1::ListWorkersRequest req;
  v1::ListWorkersResponse resp;
  const grpc::Status s = stub->ListWorkers(&ctx, req, &resp);
  if (out != nullptr) *out = resp;
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
}

uint64_t SeqNumber(const std::string& id) {
  uint64_t n = 0;
  EXPECT_TRUE(absl::SimpleAtoi(id.substr(4), &n)) << id;
  return n;
}

class ManagerFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kEtcd, X_OK) != 0) {
      GTEST_SKIP() << kEtcd << " is not installed (Debian: etcd-server)";
    }
    auto dir = TempDir::Create("failover");
    ASSERT_THAT(dir, IsOk());
    dir_ = std::move(*dir);
    std::vector<std::string> peers;
    std::vector<int> client_ports, peer_ports;
    for (int i = 0; i < 3; ++i) {
      client_ports.push_back(FreePort());
      peer_ports.push_back(FreePort());
      peers.push_back(
          absl::StrCat("e", i, "=http://127.0.0.1:", peer_ports[i]));
    }
    for (int i = 0; i < 3; ++i) {
      const std::string client =
          absl::StrCat("http://127.0.0.1:", client_ports[i]);
      const std::string peer = absl::StrCat("http://127.0.0.1:", peer_ports[i]);
      auto p = Process::Start(
          absl::StrCat("etcd", i), kEtcd,
          {absl::StrCat("--name=e", i),
           absl::StrCat("--data-dir=", dir_->path(), "/etcd", i),
           "--listen-client-urls=" + client,
           "--advertise-client-urls=" + client, "--listen-peer-urls=" + peer,
           "--initial-advertise-peer-urls=" + peer,
           "--initial-cluster=" + absl::StrJoin(peers, ","),
           "--initial-cluster-state=new", "--initial-cluster-token=triax",
           "--heartbeat-interval=50", "--election-timeout=500"},
          dir_->path(), /*with_port_file=*/false);
      ASSERT_THAT(p, IsOk());
      etcd_.push_back(std::move(*p));
      endpoints_.push_back(absl::StrCat("127.0.0.1:", client_ports[i]));
    }
    for (int i = 0; i < 2; ++i) StartManager(i, FreePort());
    // Who leads: the one that answers.
    ASSERT_THAT(Cluster::WaitFor("a leader", absl::Seconds(20),
                                 [&]() -> absl::StatusOr<bool> {
                                   return LeaderIndex() >= 0;
                                 }),
                IsOk())
        << managers_[0]->Log() << managers_[1]->Log();
    auto w =
        Process::Start("w0", "kvworker",
                       {"--listen=127.0.0.1:0", "--manager=" + ManagerList(),
                        "--worker_id=w0", "--pool_mb=64", "--window_tokens=32"},
                       dir_->path());
    ASSERT_THAT(w, IsOk());
    worker_ = std::move(*w);
    ASSERT_THAT(WaitWorkerUp(), IsOk());
  }

  void StartManager(int i, int port) {
    auto m = Process::Start(
        absl::StrCat("kvmanager-", i, "-", starts_++), "kvmanager",
        {absl::StrCat("--listen=127.0.0.1:", port),
         "--metadata=etcd://" + absl::StrJoin(endpoints_, ","),
         "--etcd_prefix=/triaxkv/test", "--etcd_lease_seconds=2",
         "--heartbeat_interval_ms=100", "--worker_timeout_ms=3000",
         "--worker_down_timeout_ms=20000"},
        dir_->path());
    ASSERT_THAT(m, IsOk());
    if (static_cast<int>(managers_.size()) <= i) managers_.resize(i + 1);
    if (static_cast<int>(addresses_.size()) <= i) addresses_.resize(i + 1);
    managers_[i] = std::move(*m);
    addresses_[i] = managers_[i]->address();
  }

  std::string ManagerList() const { return absl::StrJoin(addresses_, ","); }

  int LeaderIndex() {
    for (size_t i = 0; i < managers_.size(); ++i) {
      if (managers_[i] && managers_[i]->running() &&
          Probe(addresses_[i], nullptr).ok()) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  absl::Status WaitWorkerUp() {
    return Cluster::WaitFor(
        "w0 UP on the leader", absl::Seconds(20),
        [&]() -> absl::StatusOr<bool> {
          const int l = LeaderIndex();
          if (l < 0) return false;
          v1::ListWorkersResponse r;
          if (!Probe(addresses_[l], &r).ok()) return false;
          for (const auto& w : r.workers()) {
            if (w.worker_id() == "w0" && w.state() == v1::WORKER_STATE_UP) {
              return true;
            }
          }
          return false;
        });
  }

  absl::StatusOr<std::unique_ptr<client::Client>> NewClient(
      const std::string& tenant) {
    client::ClientOptions o;
    o.manager_address = ManagerList();
    o.tenant_id = tenant;
    o.rpc_timeout_ms = 5000;
    o.failover_ms = 20000;
    return client::Client::Connect(o);
  }

  std::unique_ptr<TempDir> dir_;
  std::vector<std::unique_ptr<Process>> etcd_;
  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<Process>> managers_;
  std::vector<std::string> addresses_;
  std::unique_ptr<Process> worker_;
  int starts_ = 0;
};

TEST_F(ManagerFailoverTest, TheStandbyTakesOverWhenTheLeaderIsKilled) {
  const int leader = LeaderIndex();
  ASSERT_GE(leader, 0);
  const int standby = 1 - leader;
  // The standby refuses, naming the leader once it has seen the leader's
  // key (its etcd watch may lag the leader's own start by a few ms; until
  // then it answers "no leader is known yet").
  ASSERT_THAT(Cluster::WaitFor(
                  "the standby names the leader", absl::Seconds(10),
                  [&]() -> absl::StatusOr<bool> {
                    const absl::Status s = Probe(addresses_[standby], nullptr);
                    return absl::StrContains(s.message(), "the leader is at ");
                  }),
              IsOk());
  EXPECT_THAT(Probe(addresses_[standby], nullptr),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("is a standby; the leader is at " +
                                 addresses_[leader])));
  auto admin = NewClient("");
  ASSERT_THAT(admin, IsOk());
  {
    v1::CreateTenantRequest req;
    req.set_tenant_id("acme");
    v1::CreateTenantResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    auto stub = v1::Manager::NewStub(grpc::CreateChannel(
        addresses_[leader], grpc::InsecureChannelCredentials()));
    ASSERT_TRUE(stub->CreateTenant(&ctx, req, &resp).ok());
  }
  auto client = NewClient("acme");
  ASSERT_THAT(client, IsOk());
  const v1::ModelShape model = SmallModel();

  // Load: opens and extends until the kill, remembering what was
  // acknowledged.
  absl::Mutex mu;
  std::map<std::string, std::vector<uint64_t>> acked;
  uint64_t max_seq = 0, max_lineage = 0;
  std::atomic<bool> stop{false};
  std::thread load([&] {
    auto c = NewClient("acme");
    if (!c.ok()) return;
    int i = 0;
    while (!stop) {
      auto s = (*c)->Open(model, {MakeSpan(v1::ROLE_USER, 8 + (i++ % 5) * 9)},
                          "bf16", 16);
      if (!s.ok()) continue;  // the failover: go on once it is over
      absl::MutexLock l(&mu);
      std::vector<uint64_t> ids;
      for (const auto& b : s->blocks) {
        ids.push_back(b.lineage_id());
        max_lineage = std::max(max_lineage, b.lineage_id());
      }
      acked[s->sequence_id] = ids;
      max_seq = std::max(max_seq, SeqNumber(s->sequence_id));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const auto killed = std::chrono::steady_clock::now();
  managers_[leader]->Kill();
  ASSERT_THAT(
      Cluster::WaitFor("the standby to lead", absl::Seconds(20),
                       [&]() -> absl::StatusOr<bool> {
                         return Probe(addresses_[standby], nullptr).ok();
                       }),
      IsOk())
      << managers_[standby]->Log();
  const double failover_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed)
          .count();
  std::printf(
      "failover: the standby served %.2f s after the leader's SIGKILL\n",
      failover_s);
  ASSERT_THAT(WaitWorkerUp(), IsOk()) << managers_[standby]->Log();
  // Load goes on against the new leader for a while.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  stop = true;
  load.join();

  // The killed one comes back as a standby of the new leader.
  StartManager(leader, managers_.size() > 0 ? FreePort() : 0);
  ASSERT_THAT(
      Cluster::WaitFor("the restarted manager to stand by", absl::Seconds(10),
                       [&]() -> absl::StatusOr<bool> {
                         absl::Status s = Probe(addresses_[leader], nullptr);
                         return absl::IsUnavailable(s) &&
                                absl::StrContains(s.message(), "is a standby");
                       }),
      IsOk());

  absl::MutexLock l(&mu);
  ASSERT_FALSE(acked.empty());
  int checked = 0;
  for (const auto& [id, ids] : acked) {
    auto got = (*client)->GetSequence(id);
    ASSERT_THAT(got, IsOk()) << id;
    EXPECT_EQ(got->state(), v1::SEQUENCE_STATE_OPEN) << id;
    std::vector<uint64_t> have;
    for (const auto& b : got->blocks()) have.push_back(b.lineage_id());
    EXPECT_EQ(have, ids) << id;
    ++checked;
  }
  EXPECT_GT(checked, 0);
  // No id reused.
  auto fresh =
      (*client)->Open(model, {MakeSpan(v1::ROLE_USER, 16)}, "bf16", 16);
  ASSERT_THAT(fresh, IsOk());
  EXPECT_GT(SeqNumber(fresh->sequence_id), max_seq);
  EXPECT_GT(fresh->blocks[0].lineage_id(), max_lineage);
}

TEST_F(ManagerFailoverTest, BadEtcdFlagsAreRefused) {
  std::string out, err;
  auto rc = RunToCompletion("kvmanager",
                            {"--metadata=etcd://", "--listen=127.0.0.1:0"},
                            dir_->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2) << err;
  EXPECT_THAT(err, HasSubstr("names no etcd endpoint"));
  rc = RunToCompletion(
      "kvmanager",
      {"--metadata=etcd://127.0.0.1:2379", "--etcd_lease_seconds=0"},
      dir_->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2) << err;
  EXPECT_THAT(err, HasSubstr("--etcd_lease_seconds=0"));
}

// The manager's etcd client over TLS (--etcd_tls_*): one etcd member that
// serves only TLS and requires client certificates; a manager with the
// flags leads and keeps its metadata there across a restart, one without
// them never leads.
TEST(EtcdTlsTest, TheManagerTalksTlsToEtcd) {
  if (access(kEtcd, X_OK) != 0) GTEST_SKIP() << kEtcd << " not installed";
  auto dir = TempDir::Create("triax-etcd-tls");
  ASSERT_THAT(dir, IsOk());
  const std::string d = (*dir)->path();
  std::string out, err;
  auto made = RunToCompletion("/bin/bash", {TRIAX_MAKE_CERTS, d + "/tls"}, d,
                              &out, &err, absl::Seconds(60));
  ASSERT_THAT(made, IsOk());
  ASSERT_EQ(*made, 0) << out << err;
  const std::string tls = d + "/tls/";
  const int client = FreePort();
  const std::string url = absl::StrCat("https://127.0.0.1:", client);
  auto etcd = Process::Start(
      "etcd", kEtcd,
      {"--name=e0", "--data-dir=" + d + "/etcd", "--listen-client-urls=" + url,
       "--advertise-client-urls=" + url,
       absl::StrCat("--listen-peer-urls=http://127.0.0.1:", FreePort()),
       "--cert-file=" + tls + "manager.crt",
       "--key-file=" + tls + "manager.key",
       "--trusted-ca-file=" + tls + "ca.crt", "--client-cert-auth"},
      d, /*with_port_file=*/false);
  ASSERT_THAT(etcd, IsOk());
  const std::string metadata =
      absl::StrCat("--metadata=etcd://127.0.0.1:", client);
  const std::vector<std::string> etcd_tls = {
      "--etcd_tls_ca=" + tls + "ca.crt",
      "--etcd_tls_cert=" + tls + "manager.crt",
      "--etcd_tls_key=" + tls + "manager.key"};
  auto start = [&](const std::string& name, int port, bool with_tls) {
    std::vector<std::string> args = {metadata,
                                     absl::StrCat("--listen=127.0.0.1:", port),
                                     "--etcd_lease_seconds=2"};
    if (with_tls) args.insert(args.end(), etcd_tls.begin(), etcd_tls.end());
    return Process::Start(name, "kvmanager", args, d);
  };
  const int port = FreePort();
  const std::string address = absl::StrCat("127.0.0.1:", port);
  {
    auto m = start("m-tls", port, true);
    ASSERT_THAT(m, IsOk());
    ASSERT_THAT(
        Cluster::WaitFor("the manager leads over TLS", absl::Seconds(20),
                         [&]() -> absl::StatusOr<bool> {
                           return Probe(address, nullptr).ok();
                         }),
        IsOk())
        << (*m)->Log() << (*etcd)->Log();
    auto stub = v1::Manager::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    v1::CreateTenantRequest req;
    req.set_tenant_id("acme");
    v1::CreateTenantResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    ASSERT_TRUE(stub->CreateTenant(&ctx, req, &resp).ok());
  }  // stopped: its lease lapses
  // Without the TLS flags: the member refuses the plaintext client, and the
  // manager never leads.
  const int plain_port = FreePort();
  auto plain = start("m-plain", plain_port, false);
  ASSERT_THAT(plain, IsOk());
  absl::SleepFor(absl::Seconds(4));
  EXPECT_FALSE(Probe(absl::StrCat("127.0.0.1:", plain_port), nullptr).ok());
  (*plain)->Stop();
  // With them again: the tenant stored over TLS is back.
  auto again = start("m-tls-2", port, true);
  ASSERT_THAT(again, IsOk());
  v1::ListWorkersResponse unused;
  ASSERT_THAT(Cluster::WaitFor("the manager leads again", absl::Seconds(20),
                               [&]() -> absl::StatusOr<bool> {
                                 return Probe(address, &unused).ok();
                               }),
              IsOk())
      << (*again)->Log();
  auto stub = v1::Manager::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  v1::ListTenantsResponse tenants;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ASSERT_TRUE(stub->ListTenants(&ctx, {}, &tenants).ok());
  ASSERT_EQ(tenants.tenants_size(), 1);
  EXPECT_EQ(tenants.tenants(0).tenant_id(), "acme");
  // A bad file is refused before anything starts, naming the etcd flag.
  auto rc = RunToCompletion("kvmanager",
                            {metadata, "--etcd_tls_ca=" + d + "/nope.crt"}, d,
                            &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2);
  EXPECT_THAT(err, HasSubstr("--etcd_tls_ca="));
}

}  // namespace
}  // namespace triax::testing
