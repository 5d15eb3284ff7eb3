// The manager's durable metadata (docs/manager.md "Durable metadata") with
// real processes: kvmanager killed with SIGKILL and started again on the
// same flags and port while its kvworkers keep running.
//  - At rest: after each restart, tenants (budgets, bytes by tier), workers'
//    reserved bytes and sequence counts, every retained sequence (state,
//    tokens, turns, policy, blocks with lineage ids, tags, formats, tiers,
//    refcounts) and the operator's policies equal what they were; KV reads
//    and attention give the same bytes; new ids are never old ones.
//  - Under load: clients open, extend, fork and close while the manager is
//    killed at random moments, several times. Every sequence whose last
//    call was acknowledged is as acknowledged; every tenant's device bytes
//    equal the sum of its open sequences' distinct blocks; no id is reused;
//    after closing everything, nothing is left on the workers.
//  - A second kvmanager on the same metadata directory refuses to start.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/process.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;

template <typename Req, typename Resp, typename Fn>
absl::StatusOr<Resp> Call(Fn fn, const Req& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  Resp resp;
  const grpc::Status s = fn(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        s.error_message());
  }
  return resp;
}

// The manager's state as an operator sees it, printed canonically (what
// changes on its own — heartbeat times, inventories — left out).
absl::StatusOr<std::string> Dump(Cluster* cluster) {
  auto* m = cluster->manager();
  std::string out;
  auto tenants = Call<v1::ListTenantsRequest, v1::ListTenantsResponse>(
      [m](auto* c, auto& q, auto* r) { return m->ListTenants(c, q, r); },
      v1::ListTenantsRequest());
  if (!tenants.ok()) return tenants.status();
  for (v1::TenantInfo t : tenants->tenants())
    out += t.ShortDebugString() + "\n";
  auto workers = Call<v1::ListWorkersRequest, v1::ListWorkersResponse>(
      [m](auto* c, auto& q, auto* r) { return m->ListWorkers(c, q, r); },
      v1::ListWorkersRequest());
  if (!workers.ok()) return workers.status();
  std::vector<std::string> ws;
  for (const v1::WorkerInfo& w : workers->workers()) {
    ws.push_back(absl::StrCat(
        w.worker_id(), " ", w.address(), " reserved=", w.reserved_bytes(),
        " sequences=", w.sequences(), " state=", w.state()));
  }
  std::sort(ws.begin(), ws.end());
  for (const std::string& w : ws) out += w + "\n";
  auto policies = Call<v1::ListPoliciesRequest, v1::ListPoliciesResponse>(
      [m](auto* c, auto& q, auto* r) { return m->ListPolicies(c, q, r); },
      v1::ListPoliciesRequest());
  if (!policies.ok()) return policies.status();
  for (const v1::Policy& p : policies->policies()) {
    out += p.ShortDebugString() + "\n";
  }
  v1::ListSequencesRequest lq;
  lq.set_include_closed(true);
  auto seqs = Call<v1::ListSequencesRequest, v1::ListSequencesResponse>(
      [m](auto* c, auto& q, auto* r) { return m->ListSequences(c, q, r); }, lq);
  if (!seqs.ok()) return seqs.status();
  for (const v1::SequenceInfo& s : seqs->sequences()) {
    v1::GetSequenceRequest gq;
    gq.set_sequence_id(s.sequence_id());
    auto full = Call<v1::GetSequenceRequest, v1::GetSequenceResponse>(
        [m](auto* c, auto& q, auto* r) { return m->GetSequence(c, q, r); }, gq);
    if (!full.ok()) return full.status();
    out += full->sequence().ShortDebugString() + "\n";
  }
  return out;
}

absl::Status WaitUp(Cluster* cluster, int workers) {
  for (int i = 0; i < workers; ++i) {
    absl::Status s =
        cluster->WaitForWorkerState(Cluster::WorkerId(i), v1::WORKER_STATE_UP);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

uint64_t SeqNumber(const std::string& id) {
  uint64_t n = 0;
  EXPECT_TRUE(absl::SimpleAtoi(id.substr(4), &n)) << id;
  return n;
}

uint64_t MaxLineage(const v1::SequenceInfo& s) {
  uint64_t m = 0;
  for (const auto& b : s.blocks()) m = std::max(m, b.lineage_id());
  return m;
}

ClusterOptions Options() {
  ClusterOptions o;
  o.num_workers = 2;
  o.heartbeat_interval_ms = 100;
  o.worker_timeout_ms = 2000;
  o.worker_down_timeout_ms = 20000;
  return o;
}

TEST(ManagerRestartTest, KilledAtRestEverythingComesBackAsItWas) {
  auto started = Cluster::Start(Options());
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  ASSERT_THAT(cluster.CreateTenant("acme", uint64_t{48} << 20), IsOk());
  ASSERT_THAT(cluster.CreateTenant("beta"), IsOk());
  {
    v1::PutPolicyRequest req;
    req.mutable_policy()->set_name("ops-int4");
    v1::PolicyRule* r = req.mutable_policy()->add_rules();
    r->set_format(v1::FORMAT_INT4);
    ASSERT_THAT((Call<v1::PutPolicyRequest, v1::PutPolicyResponse>(
                    [&](auto* c, auto& q, auto* p) {
                      return cluster.manager()->PutPolicy(c, q, p);
                    },
                    req)),
                IsOk());
  }
  auto acme = cluster.NewClient("acme");
  auto beta = cluster.NewClient("beta");
  ASSERT_THAT(acme, IsOk());
  ASSERT_THAT(beta, IsOk());
  const v1::ModelShape model = SmallModel();
  std::mt19937 rng(17);
  const size_t per_token = size_t{model.n_kv_heads()} * model.head_dim();

  auto a = (*acme)->Open(
      model, {MakeSpan(v1::ROLE_SYSTEM, 20), MakeSpan(v1::ROLE_USER, 30)}, "",
      16);
  ASSERT_THAT(a, IsOk());
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    auto k = RandomVector(50 * per_token, &rng);
    auto v = RandomVector(50 * per_token, &rng);
    ASSERT_THAT((*acme)->WriteKV(*a, l, 0, 50, k.data(), v.data()), IsOk());
  }
  auto b = (*beta)->Open(model, {MakeSpan(v1::ROLE_USER, 40)}, "ops-int4", 16);
  ASSERT_THAT(b, IsOk());
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    auto k = RandomVector(40 * per_token, &rng);
    auto v = RandomVector(40 * per_token, &rng);
    ASSERT_THAT((*beta)->WriteKV(*b, l, 0, 40, k.data(), v.data()), IsOk());
  }
  uint64_t max_seq =
      std::max(SeqNumber(a->sequence_id), SeqNumber(b->sequence_id));
  uint64_t max_lineage = 0;

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    // Some changes of every kind before each kill.
    client::SequenceHandle grown = *a;
    ASSERT_THAT(
        (*acme)->Extend(&grown, {MakeSpan(v1::ROLE_ASSISTANT, 10 + round)},
                        true, false),
        IsOk());
    *a = grown;
    auto fork = (*acme)->Fork(*a, 32);
    ASSERT_THAT(fork, IsOk());
    auto extra = (*beta)->Open(model, {MakeSpan(v1::ROLE_USER, 17)}, "", 16);
    ASSERT_THAT(extra, IsOk());
    if (round == 1) {
      ASSERT_THAT((*beta)->Close(*extra), IsOk());
    }
    if (round == 2) {
      client::Client::TransferOptions to;
      auto moved = (*beta)->TransferSequence(&*b, to);
      ASSERT_THAT(moved, IsOk());
    }
    for (const std::string& id :
         {a->sequence_id, fork->sequence_id, extra->sequence_id}) {
      max_seq = std::max(max_seq, SeqNumber(id));
    }
    auto plan = (*acme)->GetSequence(a->sequence_id);
    ASSERT_THAT(plan, IsOk());
    max_lineage = std::max(max_lineage, MaxLineage(*plan));
    auto bp = (*beta)->GetSequence(b->sequence_id);
    ASSERT_THAT(bp, IsOk());
    max_lineage = std::max(max_lineage, MaxLineage(*bp));

    std::vector<float> k_before, v_before;
    ASSERT_THAT((*acme)->ReadKV(*a, 1, 0, 50, &k_before, &v_before), IsOk());
    auto before = Dump(&cluster);
    ASSERT_THAT(before, IsOk());

    ASSERT_THAT(cluster.RestartManager(/*kill9=*/true), IsOk());
    ASSERT_THAT(WaitUp(&cluster, 2), IsOk())
        << cluster.manager_process()->Log();
    // Fresh connections (the old ones back off after the kill).
    acme = cluster.NewClient("acme");
    beta = cluster.NewClient("beta");
    ASSERT_THAT(acme, IsOk());
    ASSERT_THAT(beta, IsOk());
    auto after = Dump(&cluster);
    ASSERT_THAT(after, IsOk());
    EXPECT_EQ(*after, *before) << cluster.manager_process()->Log();

    std::vector<float> k_after, v_after;
    ASSERT_THAT((*acme)->ReadKV(*a, 1, 0, 50, &k_after, &v_after), IsOk());
    EXPECT_EQ(k_after, k_before);
    EXPECT_EQ(v_after, v_before);
    // New ids are past every old one.
    auto fresh = (*beta)->Open(model, {MakeSpan(v1::ROLE_USER, 16)}, "", 16);
    ASSERT_THAT(fresh, IsOk());
    EXPECT_GT(SeqNumber(fresh->sequence_id), max_seq);
    auto fp = (*beta)->GetSequence(fresh->sequence_id);
    ASSERT_THAT(fp, IsOk());
    ASSERT_GT(fp->blocks_size(), 0);
    EXPECT_GT(fp->blocks(0).lineage_id(), max_lineage);
    max_seq = SeqNumber(fresh->sequence_id);
    max_lineage = MaxLineage(*fp);
    ASSERT_THAT((*beta)->Close(*fresh), IsOk());
    ASSERT_THAT((*acme)->Close(*fork), IsOk());
  }
}

TEST(ManagerRestartTest, ASecondManagerOnTheSameMetadataRefusesToStart) {
  auto started = Cluster::Start(Options());
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  std::string out, err;
  auto rc = RunToCompletion(
      "kvmanager",
      {"--listen=127.0.0.1:0",
       absl::StrCat("--metadata=file:", cluster.dir(), "/metadata")},
      cluster.dir(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 1) << err;
  EXPECT_THAT(err, HasSubstr("is in use by another kvmanager"));
  // A bad --metadata is a flag error.
  rc = RunToCompletion("kvmanager", {"--metadata=s3://bucket"}, cluster.dir(),
                       &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2) << err;
  EXPECT_THAT(err, HasSubstr("--metadata=s3://bucket"));
}

// What one load client last had acknowledged for each of its sequences.
struct Acked {
  absl::Mutex mu;
  std::map<std::string, std::vector<uint64_t>> open;  // id -> lineage ids
  std::set<std::string> uncertain;  // a call on it was cut by the kill
  uint64_t max_seq = 0;
  uint64_t max_lineage = 0;
};

std::vector<uint64_t> Lineages(const client::SequenceHandle& h) {
  std::vector<uint64_t> out;
  for (const auto& b : h.blocks) out.push_back(b.lineage_id());
  return out;
}

void LoadLoop(client::Client* c, std::atomic<bool>* stop, Acked* acked,
              int seed) {
  const v1::ModelShape model = SmallModel();
  std::mt19937 rng(seed);
  std::vector<client::SequenceHandle> mine;
  while (!stop->load()) {
    const int op = std::uniform_int_distribution<int>(0, 9)(rng);
    if (mine.size() < 3 || op < 4) {
      // BF16 blocks: every block of the load has the same bytes.
      auto s =
          c->Open(model, {MakeSpan(v1::ROLE_USER, 8 + op * 5)}, "bf16", 16);
      if (!s.ok()) return;  // the manager is gone: stop until restarted
      absl::MutexLock l(&acked->mu);
      acked->open[s->sequence_id] = Lineages(*s);
      acked->max_seq = std::max(acked->max_seq, SeqNumber(s->sequence_id));
      for (uint64_t id : Lineages(*s)) {
        acked->max_lineage = std::max(acked->max_lineage, id);
      }
      mine.push_back(*s);
    } else if (op < 7) {
      client::SequenceHandle& h = mine[rng() % mine.size()];
      {
        absl::MutexLock l(&acked->mu);
        acked->uncertain.insert(h.sequence_id);
      }
      absl::Status st =
          c->Extend(&h, {MakeSpan(v1::ROLE_ASSISTANT, 7)}, op == 5, false);
      if (!st.ok()) return;
      absl::MutexLock l(&acked->mu);
      acked->uncertain.erase(h.sequence_id);
      acked->open[h.sequence_id] = Lineages(h);
      for (uint64_t id : Lineages(h)) {
        acked->max_lineage = std::max(acked->max_lineage, id);
      }
    } else {
      const size_t i = rng() % mine.size();
      const std::string id = mine[i].sequence_id;
      {
        absl::MutexLock l(&acked->mu);
        acked->uncertain.insert(id);
      }
      if (!c->Close(mine[i]).ok()) return;
      absl::MutexLock l(&acked->mu);
      acked->uncertain.erase(id);
      acked->open.erase(id);
      mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
}

TEST(ManagerRestartTest, KilledUnderLoadManyTimesLosesNothingAcknowledged) {
  auto started = Cluster::Start(Options());
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  ASSERT_THAT(cluster.CreateTenant("t0"), IsOk());
  ASSERT_THAT(cluster.CreateTenant("t1"), IsOk());
  Acked acked;
  std::mt19937 rng(99);
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::atomic<bool> stop{false};
    std::vector<std::unique_ptr<client::Client>> clients;
    std::vector<std::thread> threads;
    for (int i = 0; i < 3; ++i) {
      auto c = cluster.NewClient(i % 2 == 0 ? "t0" : "t1");
      ASSERT_THAT(c, IsOk());
      clients.push_back(*std::move(c));
    }
    for (int i = 0; i < 3; ++i) {
      threads.emplace_back(LoadLoop, clients[i].get(), &stop, &acked,
                           round * 10 + i);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(
        std::uniform_int_distribution<int>(100, 600)(rng)));
    ASSERT_THAT(cluster.RestartManager(/*kill9=*/true), IsOk());
    stop = true;
    for (auto& t : threads) t.join();
    ASSERT_THAT(WaitUp(&cluster, 2), IsOk())
        << cluster.manager_process()->Log();

    absl::MutexLock l(&acked.mu);
    uint64_t checked = 0;
    std::map<std::string, uint64_t> tenant_bytes;  // expected, by tenant
    std::map<std::string, std::set<uint64_t>> tenant_blocks;
    for (auto it = acked.open.begin(); it != acked.open.end();) {
      v1::GetSequenceRequest gq;
      gq.set_sequence_id(it->first);
      auto got = Call<v1::GetSequenceRequest, v1::GetSequenceResponse>(
          [&](auto* c, auto& q, auto* r) {
            return cluster.manager()->GetSequence(c, q, r);
          },
          gq);
      ASSERT_THAT(got, IsOk()) << it->first;
      const v1::SequenceInfo& s = got->sequence();
      if (acked.uncertain.count(it->first) > 0) {
        // Cut by the kill: whatever it became is now what is acknowledged.
        acked.uncertain.erase(it->first);
        if (s.state() != v1::SEQUENCE_STATE_OPEN) {
          it = acked.open.erase(it);
          continue;
        }
        std::vector<uint64_t> ids;
        for (const auto& b : s.blocks()) ids.push_back(b.lineage_id());
        it->second = ids;
      }
      EXPECT_EQ(s.state(), v1::SEQUENCE_STATE_OPEN) << it->first;
      std::vector<uint64_t> ids;
      for (const auto& b : s.blocks()) {
        ids.push_back(b.lineage_id());
        acked.max_lineage = std::max(acked.max_lineage, b.lineage_id());
        if (tenant_blocks[s.tenant_id()].insert(b.lineage_id()).second &&
            b.tier() == v1::TIER_DEVICE && !b.evicted()) {
          // BF16 on the device (the load's policy): equal bytes per block.
          tenant_bytes[s.tenant_id()] += s.bytes() / s.blocks_size();
        }
      }
      EXPECT_EQ(ids, it->second) << it->first;
      ++checked;
      ++it;
    }
    EXPECT_GT(checked, 0u);
    // Tenant device bytes: exactly their open sequences' blocks.
    for (const char* t : {"t0", "t1"}) {
      auto info = cluster.GetTenant(t);
      ASSERT_THAT(info, IsOk());
      uint64_t device = 0;
      for (const auto& u : info->usage()) {
        if (u.tier() == v1::TIER_DEVICE) device = u.used_bytes();
      }
      EXPECT_EQ(device, tenant_bytes[t]) << t;
    }
    // No id is reused.
    auto c = cluster.NewClient("t0");
    ASSERT_THAT(c, IsOk());
    auto fresh =
        (*c)->Open(SmallModel(), {MakeSpan(v1::ROLE_USER, 16)}, "", 16);
    ASSERT_THAT(fresh, IsOk());
    EXPECT_GT(SeqNumber(fresh->sequence_id), acked.max_seq);
    EXPECT_GT(fresh->blocks[0].lineage_id(), acked.max_lineage);
    ASSERT_THAT((*c)->Close(*fresh), IsOk());
  }
  // Nothing leaks: close everything; the workers end up holding nothing.
  auto c0 = cluster.NewClient("t0");
  auto c1 = cluster.NewClient("t1");
  ASSERT_THAT(c0, IsOk());
  ASSERT_THAT(c1, IsOk());
  {
    absl::MutexLock l(&acked.mu);
    for (const auto& [id, ids] : acked.open) {
      v1::CloseSequenceRequest req;
      auto info = (*c0)->GetSequence(id);
      req.set_tenant_id(info.ok() ? "t0" : "t1");
      req.set_sequence_id(id);
      ASSERT_THAT((Call<v1::CloseSequenceRequest, v1::CloseSequenceResponse>(
                      [&](auto* ctx, auto& q, auto* r) {
                        return cluster.manager()->CloseSequence(ctx, q, r);
                      },
                      req)),
                  IsOk())
          << id;
    }
  }
  for (int i = 0; i < 2; ++i) {
    ASSERT_THAT(
        Cluster::WaitFor("the workers to hold nothing", absl::Seconds(10),
                         [&]() -> absl::StatusOr<bool> {
                           auto w = cluster.GetWorker(Cluster::WorkerId(i));
                           if (!w.ok()) return w.status();
                           return w->inventory().sequence_ids_size() == 0 &&
                                  w->reserved_bytes() == 0;
                         }),
        IsOk());
  }
}

}  // namespace
}  // namespace triax::testing
