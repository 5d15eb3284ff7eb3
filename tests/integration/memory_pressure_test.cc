// Memory pressure end to end with real processes: a kvmanager running its
// background pressure loop and a kvworker with a small device pool, a host
// tier and a disk tier (real files). Sequences are written until the pool
// passes its high watermark; the manager demotes, spills and (if needed)
// evicts; then every sequence is made active (ReportAccess active=true: the
// manager has the worker restore its spilled blocks, checksums verified,
// reclaiming room from others) and attended, and compared with a float64
// reference over exactly the values its blocks now decode to (a block
// demoted several times holds each step's re-encoding of the last, as its
// trace of BLOCK_DEMOTED events says; evicted blocks' tokens left out). No
// block may be lost: every lineage id stays in its plan, in a tier or marked
// evicted, and no BLOCK_LOST event appears.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

constexpr uint32_t kTokens = 192;  // 12 blocks of 16

class MemoryPressureTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> manager_flags,
             std::vector<std::string> worker_flags, uint64_t ceiling = 0) {
    ClusterOptions o;
    o.pool_mb = 1;
    o.window_tokens = 0;
    o.manager_flags = std::move(manager_flags);
    // 64 frames of 16 KiB: a 1 MiB pool in 256 KiB frames (the default) has
    // 4, one per encoding in use, and nothing left to demote into.
    o.worker_flags = {"--frame_kb=16"};
    o.worker_flags.insert(o.worker_flags.end(), worker_flags.begin(),
                          worker_flags.end());
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    {
      auto worker = cluster_->GetWorker("w0");
      ASSERT_THAT(worker, IsOk());
      tol_ = ToleranceFor(worker->backend());
    }
    ASSERT_THAT(cluster_->CreateTenant("acme", ceiling, "bf16"), IsOk());
    auto cl = cluster_->NewClient("acme");
    ASSERT_THAT(cl, IsOk());
    client_ = std::move(*cl);
    shape_ = kernels::PageShape{16, static_cast<int>(model_.n_kv_heads()),
                                static_cast<int>(model_.head_dim())};
  }

  size_t Elems() const {
    return size_t{model_.n_kv_heads()} * model_.head_dim();
  }

  struct Seq {
    client::SequenceHandle handle;
    std::vector<std::vector<float>> k, v;  // written, per layer
    std::vector<uint64_t> lineages;
  };

  absl::Status OpenAndWrite() {
    client::OpenOptions open;
    open.block_tokens = 16;
    open.window_tokens = 0;
    auto h = client_->Open(
        model_, {MakeSpan(ROLE_SYSTEM, 16), MakeSpan(ROLE_USER, kTokens - 16)},
        open);
    if (!h.ok()) return h.status();
    Seq s;
    s.handle = *h;
    for (const auto& b : s.handle.blocks) s.lineages.push_back(b.lineage_id());
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      s.k.push_back(RandomVector(kTokens * Elems(), &rng_));
      s.v.push_back(RandomVector(kTokens * Elems(), &rng_));
      absl::Status st = client_->WriteKV(s.handle, l, 0, kTokens, s.k[l].data(),
                                         s.v[l].data());
      if (!st.ok()) return st;
    }
    seqs_.push_back(std::move(s));
    return absl::OkStatus();
  }

  absl::StatusOr<triax::v1::GetPressureResponse> Pressure() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    triax::v1::GetPressureRequest req;
    req.set_top(5);
    triax::v1::GetPressureResponse resp;
    grpc::Status st = cluster_->manager()->GetPressure(&ctx, req, &resp);
    if (!st.ok())
      return absl::Status(absl::StatusCode(st.error_code()),
                          st.error_message());
    return resp;
  }

  // Counts what pressure left (before anything is restored), then checks
  // every sequence (CheckSequence).
  void CheckAllSequences(size_t* evicted_blocks, size_t* spilled_blocks) {
    for (Seq& s : seqs_) {
      auto info = client_->GetSequence(s.handle.sequence_id);
      ASSERT_THAT(info, IsOk());
      ASSERT_EQ(info->blocks_size(), static_cast<int>(s.lineages.size()));
      for (int i = 0; i < info->blocks_size(); ++i) {
        const auto& b = info->blocks(i);
        EXPECT_EQ(b.lineage_id(), s.lineages[i]) << "block lost or moved";
        *evicted_blocks += b.evicted();
        *spilled_blocks += b.tier() == triax::v1::TIER_HOST ||
                           b.tier() == triax::v1::TIER_DISK;
      }
    }
    for (Seq& s : seqs_) ASSERT_NO_FATAL_FAILURE(CheckSequence(s));
  }

  // The sequence becomes active (ReportAccess active=true: the manager
  // restores its spilled blocks before replying), then it is attended at 3
  // positions of each layer and the output is checked against the
  // reference over its blocks' encodings. The background loop may act on
  // the sequence between the plan read and the Attend (after a restore the
  // pool may be above its high watermark); an attempt whose plan changed
  // meanwhile is retried.
  void CheckSequence(Seq& s) {
    const std::vector<uint64_t> positions = {40, 120, kTokens - 1};
    std::string last_problem;
    for (int attempt = 0; attempt < 8; ++attempt) {
      {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(30));
        triax::v1::ReportAccessRequest req;
        req.set_tenant_id("acme");
        req.set_sequence_id(s.handle.sequence_id);
        req.set_active(true);
        triax::v1::ReportAccessResponse resp;
        const grpc::Status st =
            cluster_->manager()->ReportAccess(&ctx, req, &resp);
        ASSERT_TRUE(st.ok()) << s.handle.sequence_id << ": ReportAccess "
                             << st.error_code() << " " << st.error_message();
      }
      auto info = client_->GetSequence(s.handle.sequence_id);
      ASSERT_THAT(info, IsOk());
      ASSERT_EQ(info->blocks_size(), static_cast<int>(s.lineages.size()));
      bool resident = true;
      std::string chain_mismatch;  // the first block whose trace disagrees
      std::vector<bool> evicted;
      for (int i = 0; i < info->blocks_size(); ++i) {
        const auto& b = info->blocks(i);
        EXPECT_EQ(b.lineage_id(), s.lineages[i]) << "block lost or moved";
        evicted.push_back(b.evicted());
        resident &= b.evicted() || b.tier() == triax::v1::TIER_DEVICE;
      }
      // The plan the worker serves now.
      s.handle.blocks.assign(info->blocks().begin(), info->blocks().end());
      std::vector<std::vector<float>> outs;
      std::vector<std::vector<double>> refs;
      absl::Status attended;
      for (uint32_t l = 0; l < model_.n_layers() && attended.ok(); ++l) {
        // Reference K/V: each kept block decoded from its encoding.
        std::vector<float> rk, rv;
        std::vector<uint64_t> rpos;
        uint64_t kept = 0;  // tokens kept before the current block
        for (int i = 0; i < info->blocks_size(); ++i) {
          const auto& b = info->blocks(i);
          const uint64_t first = b.first_token();
          const uint32_t n = b.num_tokens();
          // A query inside this block attends the kept tokens up to it.
          for (uint64_t p : positions) {
            if (p < first || p >= first + n) continue;
            rpos.push_back(evicted[i] ? kept - 1 : kept + (p - first));
          }
          if (!evicted[i]) {
            std::vector<kernels::Encoding> chain;
            ASSERT_NO_FATAL_FAILURE(EncodingChain(b.lineage_id(), &chain));
            ASSERT_FALSE(chain.empty());
            // A demotion between the plan read and the trace read shows in
            // the trace first; the plan read after the Attend then differs
            // and the attempt is retried. With the plan unchanged, the
            // trace's last encoding must be the plan's.
            if (!(chain.back() == EncodingFromProto(b)) &&
                chain_mismatch.empty()) {
              chain_mismatch =
                  absl::StrCat("block ", b.lineage_id(), ": trace ends at ",
                               NameOf(chain.back()), ", the plan has ",
                               NameOf(EncodingFromProto(b)));
            }
            std::vector<float> dk(&s.k[l][first * Elems()],
                                  &s.k[l][(first + n) * Elems()]);
            std::vector<float> dv(&s.v[l][first * Elems()],
                                  &s.v[l][(first + n) * Elems()]);
            // A block demoted more than once holds each step's re-encoding
            // of the last (the worker decodes, rounds to BF16, encodes).
            for (size_t c = 0; c < chain.size(); ++c) {
              for (const kernels::Encoding& e :
                   c == 0 ? std::vector<kernels::Encoding>{chain[0]}
                          : std::vector<kernels::Encoding>{
                                kernels::Encoding(kernels::Format::kBF16),
                                chain[c]}) {
                const std::vector<float> ik = dk, iv = dv;
                ASSERT_THAT(
                    RoundTripPage(e, shape_, ik.data(), iv.data(),
                                  static_cast<int>(n), dk.data(), dv.data()),
                    IsOk());
              }
            }
            rk.insert(rk.end(), dk.begin(), dk.end());
            rv.insert(rv.end(), dv.begin(), dv.end());
            kept += n;
          }
        }
        const std::vector<float> q = RandomVector(
            positions.size() * model_.n_q_heads() * model_.head_dim(), &rng_);
        std::vector<float> out(q.size(), std::nanf(""));
        client::Client::AttendArgs a;
        a.layer = l;
        a.num_queries = positions.size();
        a.positions = positions.data();
        a.q = q.data();
        a.out = out.data();
        attended = client_->Attend(s.handle, a);
        outs.push_back(std::move(out));
        refs.push_back(ReferenceAttention(model_, q, rpos, rk, rv));
      }
      // A demotion the worker finished while the Attend ran reaches the
      // manager's plan only with the worker's reply to it: read the plan
      // after that has surely arrived (the pressure loop runs every 50 ms),
      // so such an attempt shows a changed plan and is retried.
      absl::SleepFor(absl::Milliseconds(250));
      auto after = client_->GetSequence(s.handle.sequence_id);
      ASSERT_THAT(after, IsOk());
      bool same_plan = after->blocks_size() == info->blocks_size();
      for (int i = 0; same_plan && i < info->blocks_size(); ++i) {
        same_plan = after->blocks(i).SerializeAsString() ==
                    info->blocks(i).SerializeAsString();
      }
      if (!same_plan || !attended.ok()) {
        last_problem =
            !same_plan ? "plan changed during the check" : attended.ToString();
        continue;
      }
      EXPECT_EQ(chain_mismatch, "") << s.handle.sequence_id;
      EXPECT_TRUE(resident) << s.handle.sequence_id
                            << ": spilled blocks after ReportAccess(active)";
      for (size_t l = 0; l < outs.size(); ++l) {
        EXPECT_LT(RelativeError(outs[l], refs[l]), tol_.relative)
            << s.handle.sequence_id << " layer " << l;
      }
      return;
    }
    FAIL() << s.handle.sequence_id
           << ": no stable attempt in 8; last: " << last_problem;
  }

  // The encodings a block had, oldest first: at BLOCK_CREATED, then after
  // each BLOCK_DEMOTED (their details' "encoding=" and "to=").
  void EncodingChain(uint64_t lineage, std::vector<kernels::Encoding>* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    triax::v1::QueryTraceRequest req;
    req.set_lineage_id(lineage);
    triax::v1::QueryTraceResponse resp;
    ASSERT_TRUE(cluster_->manager()->QueryTrace(&ctx, req, &resp).ok());
    for (const auto& e : resp.events()) {
      const char* key = e.kind() == triax::v1::EVENT_BLOCK_CREATED ? "encoding="
                        : e.kind() == triax::v1::EVENT_BLOCK_DEMOTED ? "to="
                                                                     : nullptr;
      if (key == nullptr) continue;
      std::string name;
      for (absl::string_view word : absl::StrSplit(e.detail(), ' ')) {
        if (absl::ConsumePrefix(&word, key)) name = std::string(word);
      }
      ASSERT_FALSE(name.empty()) << e.detail();
      out->push_back(ParseEncodingName(name));
    }
  }

  static std::string NameOf(const kernels::Encoding& e) {
    char buf[96];
    return kernels::EncodingName(e, buf, sizeof(buf));
  }

  // kernels::EncodingName's text back: "int4", or
  // "k=int4,v=int2[,g=64][,scale=fp8]".
  static kernels::Encoding ParseEncodingName(const std::string& name) {
    kernels::Encoding e;
    if (name.find('=') == std::string::npos) {
      kernels::Format f;
      EXPECT_TRUE(kernels::ParseFormat(name.c_str(), &f)) << name;
      return kernels::Encoding(f);
    }
    for (absl::string_view part : absl::StrSplit(name, ',')) {
      if (absl::ConsumePrefix(&part, "k=")) {
        EXPECT_TRUE(kernels::ParseFormat(std::string(part).c_str(), &e.k));
      } else if (absl::ConsumePrefix(&part, "v=")) {
        EXPECT_TRUE(kernels::ParseFormat(std::string(part).c_str(), &e.v));
      } else if (absl::ConsumePrefix(&part, "g=")) {
        EXPECT_TRUE(absl::SimpleAtoi(part, &e.group)) << name;
      } else if (part == "scale=fp8") {
        e.scale_dtype = kernels::ScaleDtype::kFP8;
      } else {
        ADD_FAILURE() << "encoding " << name;
      }
    }
    return e;
  }

  // Every block's trace: created, never lost or freed.
  void ExpectNoLostBlocks() {
    size_t traced = 0;
    for (const Seq& s : seqs_) {
      for (uint64_t lineage : s.lineages) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
        triax::v1::QueryTraceRequest req;
        req.set_lineage_id(lineage);
        triax::v1::QueryTraceResponse resp;
        ASSERT_TRUE(cluster_->manager()->QueryTrace(&ctx, req, &resp).ok())
            << lineage;
        for (const auto& e : resp.events()) {
          EXPECT_NE(e.kind(), triax::v1::EVENT_BLOCK_LOST) << lineage;
          EXPECT_NE(e.kind(), triax::v1::EVENT_BLOCK_FREED) << lineage;
        }
        ++traced;
      }
    }
    EXPECT_GT(traced, 0u);
  }

  triax::v1::ModelShape model_ = SmallModel();
  kernels::PageShape shape_;
  std::mt19937 rng_{20261122};
  AttendTolerance tol_ = ToleranceFor("cpu");
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<client::Client> client_;
  std::vector<Seq> seqs_;
};

TEST_F(MemoryPressureTest, DemotesAndSpillsUnderPressureThenRestoresOnAttend) {
  std::printf("seed 20261122\n");
  const std::string disk =
      absl::StrCat(::testing::TempDir(), "/mp-disk-", ::getpid());
  // A small pool (1 MiB = 128 BF16 blocks of this model), watermarks at
  // 60% / 40%, blocks idle for more than ~100 ms count as cold (spills are
  // then nearly free), the disk tier in a real directory. A sequence made
  // active stays guarded from spills for 1 s (the default 5 s would keep
  // every sequence the check restored within the last 5 s on the device:
  // 14 sequences of 96 KiB do not fit 1 MiB, and the last restores would
  // find nothing left to take).
  ASSERT_NO_FATAL_FAILURE(
      Start({"--pressure_interval_ms=50", "--high_watermark=0.6",
             "--low_watermark=0.4", "--window_guard_tokens=0",
             "--reuse_half_life_ms=100", "--active_guard_ms=1000"},
            {"--host_tier_mb=1", absl::StrCat("--disk_tier_dir=", disk),
             "--disk_tier_mb=64"}));
  auto under_high = [&]() -> absl::StatusOr<bool> {
    auto p = Pressure();
    if (!p.ok()) return p.status();
    const auto& dev = p->pools(0);
    return dev.used_bytes() <= dev.high_watermark_bytes();
  };
  // Phase 1: 9 sequences of 12 blocks (108 BF16 blocks, far above the high
  // watermark) written back to back: every block is fresh, so demotion is
  // the cheapest loss per byte (spilling would cost restores soon).
  for (int i = 0; i < 9; ++i) ASSERT_THAT(OpenAndWrite(), IsOk()) << i;
  ASSERT_THAT(Cluster::WaitFor("pool under the high watermark",
                               absl::Seconds(20), under_high),
              IsOk());
  auto phase1 = Pressure();
  ASSERT_THAT(phase1, IsOk());
  EXPECT_EQ(phase1->mode(), "demote-first");
  EXPECT_GT(phase1->demotions(), 0u);
  // Phase 2: once the earlier sequences are cold (a few reuse half-lives
  // idle), spilling them is nearly free, so the manager's ranking puts a
  // spill first; the next pressure then spills rather than demotes further.
  ASSERT_THAT(
      Cluster::WaitFor("a spill ranked cheapest", absl::Seconds(20),
                       [&]() -> absl::StatusOr<bool> {
                         auto p = Pressure();
                         if (!p.ok()) return p.status();
                         return p->ranked_size() > 0 &&
                                (p->ranked(0).action() ==
                                     triax::v1::PRESSURE_ACTION_SPILL_HOST ||
                                 p->ranked(0).action() ==
                                     triax::v1::PRESSURE_ACTION_SPILL_DISK);
                       }),
      IsOk());
  // Each write waits for the background loop to bring the pool under the
  // high watermark first. Back to back, a write can be admitted on frame
  // room the manager no longer has: the heartbeat's free frames count the
  // previous sequence's planned pages as allocated before its client
  // allocated them (docs/manager.md, "Room"), and the worker then refuses
  // AllocatePages RESOURCE_EXHAUSTED — a definite error, nothing lost, but
  // not what this test is about.
  for (int i = 0; i < 5; ++i) {
    ASSERT_THAT(Cluster::WaitFor("pool under the high watermark",
                                 absl::Seconds(20), under_high),
                IsOk());
    ASSERT_THAT(OpenAndWrite(), IsOk()) << i;
  }
  ASSERT_THAT(Cluster::WaitFor("spills under pressure", absl::Seconds(20),
                               [&]() -> absl::StatusOr<bool> {
                                 auto p = Pressure();
                                 if (!p.ok()) return p.status();
                                 auto u = under_high();
                                 if (!u.ok()) return u.status();
                                 return *u && p->spills() > 0;
                               }),
              IsOk());
  auto phase2 = Pressure();
  ASSERT_THAT(phase2, IsOk());
  std::printf(
      "phase 1: demotions %llu spills %llu; phase 2: demotions %llu spills "
      "%llu evictions %llu\n",
      static_cast<unsigned long long>(phase1->demotions()),
      static_cast<unsigned long long>(phase1->spills()),
      static_cast<unsigned long long>(phase2->demotions()),
      static_cast<unsigned long long>(phase2->spills()),
      static_cast<unsigned long long>(phase2->evictions()));

  size_t evicted = 0, spilled = 0;
  ASSERT_NO_FATAL_FAILURE(CheckAllSequences(&evicted, &spilled));
  std::printf("blocks spilled before attend %zu, evicted %zu\n", spilled,
              evicted);
  EXPECT_GT(spilled, 0u);
  // ReportAccess(active) had the manager restore the spilled blocks.
  ASSERT_THAT(Cluster::WaitFor("restores counted", absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 auto p = Pressure();
                                 if (!p.ok()) return p.status();
                                 return p->restores() > 0;
                               }),
              IsOk());
  ExpectNoLostBlocks();
}

TEST_F(MemoryPressureTest, SpillsGoToDiskFilesWhenThereIsNoHostTier) {
  const std::string disk =
      absl::StrCat(::testing::TempDir(), "/mp-disk2-", ::getpid());
  ASSERT_NO_FATAL_FAILURE(
      Start({"--pressure_interval_ms=50", "--high_watermark=0.6",
             "--low_watermark=0.4", "--window_guard_tokens=0",
             "--reuse_half_life_ms=100", "--spill_disk_penalty=0"},
            {"--host_tier_mb=0", absl::StrCat("--disk_tier_dir=", disk),
             "--disk_tier_mb=64"}));
  for (int i = 0; i < 9; ++i) ASSERT_THAT(OpenAndWrite(), IsOk()) << i;
  ASSERT_THAT(Cluster::WaitFor("spills to disk", absl::Seconds(20),
                               [&]() -> absl::StatusOr<bool> {
                                 auto p = Pressure();
                                 if (!p.ok()) return p.status();
                                 return p->spills() > 0 &&
                                        p->pools(0).used_bytes() <=
                                            p->pools(0).high_watermark_bytes();
                               }),
              IsOk());
  // Real files hold the spilled pages.
  size_t files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(disk)) {
    files += e.is_regular_file();
  }
  EXPECT_GT(files, 0u);
  size_t evicted = 0, spilled = 0;
  ASSERT_NO_FATAL_FAILURE(CheckAllSequences(&evicted, &spilled));
  EXPECT_GT(spilled, 0u);
  ExpectNoLostBlocks();
}

TEST_F(MemoryPressureTest, AdmissionReclaimsWithinTheTenantCeiling) {
  // Ceiling of 40 BF16 blocks; no background loop, so every reclaim here
  // is the admission path's.
  const uint64_t block = 2 * kernels::PageBytes(kernels::Format::kBF16,
                                                kernels::PageShape{16, 2, 32});
  ASSERT_NO_FATAL_FAILURE(
      Start({"--pressure_interval_ms=0", "--window_guard_tokens=0"}, {},
            /*ceiling=*/40 * block));
  // 6 sequences of 12 blocks = 72 blocks of BF16 > 40: the 4th and later
  // Opens are admitted only after reclaiming the tenant's own blocks.
  for (int i = 0; i < 6; ++i) {
    ASSERT_THAT(OpenAndWrite(), IsOk()) << i << "\nmanager log:\n"
                                        << cluster_->manager_process()->Log();
  }
  auto tenant = cluster_->GetTenant("acme");
  ASSERT_THAT(tenant, IsOk());
  EXPECT_LE(tenant->usage(0).used_bytes(), 40 * block);
  auto p = Pressure();
  ASSERT_THAT(p, IsOk());
  EXPECT_GT(p->demotions() + p->evictions(), 0u);
  size_t evicted = 0, spilled = 0;
  ASSERT_NO_FATAL_FAILURE(CheckAllSequences(&evicted, &spilled));
  ExpectNoLostBlocks();
}

TEST_F(MemoryPressureTest, BadInput) {
  ASSERT_NO_FATAL_FAILURE(Start({"--pressure_interval_ms=0"}, {}));
  ASSERT_THAT(OpenAndWrite(), IsOk());
  {
    grpc::ClientContext ctx;
    triax::v1::ReportAccessRequest req;
    req.set_tenant_id("acme");
    req.set_sequence_id(seqs_[0].handle.sequence_id);
    req.add_lineage_ids(seqs_[0].lineages[0]);
    req.add_weights(2.0f);
    triax::v1::ReportAccessResponse resp;
    grpc::Status st = cluster_->manager()->ReportAccess(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("weights[0]"));
  }
  {
    grpc::ClientContext ctx;
    triax::v1::ReportAccessRequest req;
    req.set_tenant_id("acme");
    req.set_sequence_id(seqs_[0].handle.sequence_id);
    req.add_lineage_ids(987654321);
    triax::v1::ReportAccessResponse resp;
    grpc::Status st = cluster_->manager()->ReportAccess(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(st.error_message(), HasSubstr("987654321"));
  }
  {
    grpc::ClientContext ctx;
    triax::v1::GetPressureRequest req;
    req.set_top(10001);
    triax::v1::GetPressureResponse resp;
    grpc::Status st = cluster_->manager()->GetPressure(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("top 10001"));
  }
  // A valid report with active=true on a sequence with nothing spilled.
  {
    grpc::ClientContext ctx;
    triax::v1::ReportAccessRequest req;
    req.set_tenant_id("acme");
    req.set_sequence_id(seqs_[0].handle.sequence_id);
    req.add_lineage_ids(seqs_[0].lineages[1]);
    req.set_active(true);
    triax::v1::ReportAccessResponse resp;
    ASSERT_TRUE(cluster_->manager()->ReportAccess(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.blocks_prefetching(), 0u);
  }
}

}  // namespace
}  // namespace triax::testing
