// pressure_replay: many concurrent BFCL multi-turn sessions of kvproxy-18m
// replayed turn by turn, round-robin across sessions, into a device pool
// that holds about a third of their final BF16 KV, through a real kvmanager
// and kvworker (started here, fresh per mode). Compares the manager's
// memory-pressure modes (--pressure_mode=lru, graph-evict, demote-first),
// every session on the static "bf16" policy so that the pressure response is
// what differs (optionally a fourth row: demote-first with the triaxial
// policy of the committed calibration table).
//
// Per session: Open with the first turn's role spans (the manager tags
// them); for every later turn ReportAccess(active=true) with the plan's live
// blocks (with --report_mass: none; after every turn instead, the live
// blocks with the attention mass the turn put on them), Extend with the turn's
// spans, and the prefill of the turn's tokens through the service
// (ServiceKvStore: K/V appended and attention run by the worker). The prefill's
// logits give the teacher-forced NLL of the turn's assistant and tool-call
// tokens; ΔNLL is against the same session's NLL with a local fp32 KV cache
// (computed once per session, same chunking). RESOURCE_EXHAUSTED at Open or
// Extend is retried --admit_retries times
// --admit_wait_ms apart (the manager reclaims in the background), then the
// session is rejected (and closed). Before a later turn's appends, a
// read-only Attend brings the session's spilled blocks back ("resume"),
// retried the same way when the pool has no room to restore into. The
// order of turns is round robin, or with --active_fraction < 1 rounds in
// which only some sessions are active (the others idle and come back).
// Writes a markdown report (--out). Exit code 0 when the report was
// written, 1 on any setup failure.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench/pressure/replay/fp32_kv_store.h"
#include "bench/pressure/replay/replay_plan.h"
#include "bench/quality/bench_service.h"
#include "bench/quality/harness.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/bfcl_session.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "client/frontend/service_kv_store.h"
#include "client/frontend/service_types.h"
#include "client/kv_client.h"
#include "common/status_macros.h"
#include "kernels/layout.h"
#include "tests/integration/cluster.h"

ABSL_FLAG(std::string, data_dir, "",
          "data directory; empty: $TRIAX_DATA_DIR, else ../shared/data");
ABSL_FLAG(std::string, bfcl_ids,
          "multi_turn_base_103,multi_turn_base_107,multi_turn_base_112,"
          "multi_turn_base_116,multi_turn_base_118,multi_turn_base_119,"
          "multi_turn_base_122,multi_turn_base_123,multi_turn_base_127,"
          "multi_turn_base_130,multi_turn_base_131,multi_turn_base_135,"
          "multi_turn_base_136,multi_turn_base_146",
          "BFCL multi_turn_base conversations to replay (calibration ids are "
          "refused; the default ones keep 4 turns within 2048 tokens)");
ABSL_FLAG(int, sessions, 12, "replay the first N of --bfcl_ids (0: all)");
ABSL_FLAG(int, bfcl_max_context, 2048,
          "token budget per conversation (kvproxy-18m's context is 2048)");
ABSL_FLAG(int, max_turns, 0, "replay at most this many turns (0: all)");
ABSL_FLAG(std::string, modes, "lru,graph-evict,demote-first",
          "manager --pressure_mode values, one row each (static bf16 policy)");
ABSL_FLAG(bool, triaxial_row, false,
          "add a row: demote-first with the triaxial policy "
          "(--triaxial_budget bits, --calibration table)");
ABSL_FLAG(double, triaxial_budget, 3.5, "budget_bits of the triaxial row");
ABSL_FLAG(std::string, calibration,
          "bench/results/calibration_kvproxy-18m.txtpb",
          "text-format triax.v1.CalibrationTable of kvproxy-18m (put with "
          "PutCalibration: demote costs, triaxial row)");
ABSL_FLAG(double, pool_fraction, 1.0 / 3,
          "device pool = this fraction of the sessions' final BF16 KV");
ABSL_FLAG(int, pool_mb, 0, "kvworker --pool_mb; 0: from --pool_fraction");
ABSL_FLAG(int, host_tier_mb, -1,
          "kvworker --host_tier_mb; -1: half the pool; 0: no host tier");
ABSL_FLAG(int, disk_tier_mb, -1,
          "kvworker --disk_tier_mb (files under the cluster's temp dir); -1: "
          "the pool's size; 0: no disk tier");
ABSL_FLAG(bool, restore_on_attend, true, "kvworker --restore_on_attend");
ABSL_FLAG(double, high_watermark, 0.90, "kvmanager --high_watermark");
ABSL_FLAG(double, low_watermark, 0.80, "kvmanager --low_watermark");
ABSL_FLAG(int, pressure_interval_ms, 200, "kvmanager --pressure_interval_ms");
ABSL_FLAG(std::string, protected_roles, "system,tool_schema",
          "kvmanager --protected_roles");
ABSL_FLAG(double, evict_factor, 4, "kvmanager --evict_factor");
ABSL_FLAG(std::string, manager_flags, "",
          "extra kvmanager flags, comma-separated (--name=value,...)");
ABSL_FLAG(std::string, worker_flags, "",
          "extra kvworker flags, comma-separated (--name=value,...)");
ABSL_FLAG(int, block_tokens, 16, "tokens per block (OpenSequence)");
ABSL_FLAG(int, chunk, 64, "prefill chunk: tokens per forward call (1..256)");
ABSL_FLAG(int, threads, 2, "threads for the matrix products");
ABSL_FLAG(int, admit_retries, 4,
          "retries of an Open/Extend answered RESOURCE_EXHAUSTED");
ABSL_FLAG(int, admit_wait_ms, 500, "wait before each of those retries");
ABSL_FLAG(int, sample_ms, 50, "worker inventory sampling (peak device bytes)");
ABSL_FLAG(double, active_fraction, 1.0,
          "after turn 0, each round a session with turns left is active with "
          "this probability (1: every session every round, round robin)");
ABSL_FLAG(uint32_t, idle_seed, 1, "seed of the active/idle rounds");
ABSL_FLAG(int, max_idle_rounds, 3,
          "a session idle this many rounds in a row is active in the next");
ABSL_FLAG(bool, report_mass, false,
          "after each turn, ReportAccess the session's live blocks with the "
          "attention mass the turn's queries put on them (measured in the "
          "local fp32 pass of the same tokens); the turn's ReportAccess "
          "(active=true) then names no blocks");
ABSL_FLAG(std::string, reference_file, "",
          "local fp32 references (NLL and attention mass per session): read "
          "from this file when it exists (for the same sessions), else "
          "computed and written to it; empty: computed, not kept");
ABSL_FLAG(bool, references_only, false,
          "compute the references (into --reference_file), then exit");
ABSL_FLAG(bool, dry_run, false,
          "print the sessions and the pool arithmetic, then exit (no "
          "reference, no cluster)");
ABSL_FLAG(std::string, out, "", "markdown report path; empty: print only");

namespace triax::bench::replay {
namespace {

using frontend::BfclData;
using frontend::Model;
using frontend::RenderedConversation;
using frontend::ServiceKvStore;
using frontend::ServiceSpans;
using frontend::Transformer;

using Clock = std::chrono::steady_clock;

constexpr const char* kModel = "kvproxy-18m";
constexpr const char* kTenant = "replay";

// One session: the BFCL session (tokens from BOS, per turn the spans and the
// token range, assistant and tool-call tokens as focus), its note, and the
// reference NLL of every focus token.
struct Session {
  frontend::BfclSession bfcl;
  std::string note;
  std::vector<double> ref_nll;  // by token index; local fp32 KV; focus only
  // With --report_mass, by turn: the attention mass the turn's queries put
  // on each token position before the turn's end (local fp32 KV).
  std::vector<std::vector<double>> turn_mass;
};

absl::StatusOr<Session> MakeSession(const BfclData& bfcl, const std::string& id,
                                    int max_context, int max_turns) {
  TRIAX_ASSIGN_OR_RETURN(RenderedConversation conv,
                         bfcl.Render(id, max_context - 1));
  frontend::BfclSessionOptions o;
  o.max_turns = max_turns;
  Session s;
  TRIAX_ASSIGN_OR_RETURN(s.bfcl, frontend::MakeBfclSession(conv, o));
  std::vector<std::string> sizes;
  for (const auto& turn : s.bfcl.turns) {
    sizes.push_back(absl::StrCat(turn.end - turn.first));
  }
  s.note = absl::StrFormat(
      "%s (%d tokens in %d turns: %s; %d assistant/tool-call tokens; %d/%d "
      "doc lines, %d/%d exchanges)",
      id, s.bfcl.tokens.size(), s.bfcl.turns.size(), absl::StrJoin(sizes, "+"),
      s.bfcl.num_focus(), conv.docs_kept, conv.docs_total, conv.turns_kept,
      conv.turns_total);
  return s;
}

// Scores the focus tokens a turn's logits predict: logits row i (position
// first + i) predicts token first + i + 1. Calls score(t, nll) per token.
template <typename F>
void ScoreTurn(const Session& s, int64_t first, int64_t end,
               const std::vector<float>& logits, int vocab, F score) {
  const std::vector<int>& tokens = s.bfcl.tokens;
  for (int64_t t = first + 1;
       t <= end && t < static_cast<int64_t>(tokens.size()); ++t) {
    if (!s.bfcl.focus[t]) continue;
    const float* row = &logits[static_cast<size_t>(t - 1 - first) * vocab];
    score(t, frontend::TokenNll(row, vocab, tokens[t]));
  }
}

// The reference: turn by turn through a local fp32 KV, same chunking.
absl::Status ComputeReference(Transformer* tf, int chunk, int threads,
                              bool mass, Session* s) {
  Fp32KvStore kv(tf->model().config, threads);
  kv.TrackMass(mass);
  const int vocab = tf->model().config.vocab_size;
  s->ref_nll.assign(s->bfcl.tokens.size(), std::nan(""));
  std::vector<float> logits;
  for (const auto& turn : s->bfcl.turns) {
    const int64_t first = turn.first, end = turn.end;
    TRIAX_RETURN_IF_ERROR(tf->Prefill(
        absl::MakeConstSpan(s->bfcl.tokens).subspan(first, end - first), first,
        chunk, &kv, &logits));
    ScoreTurn(*s, first, end, logits, vocab,
              [&](int64_t t, double nll) { s->ref_nll[t] = nll; });
    if (mass) s->turn_mass.push_back(kv.TakeMass());
  }
  return absl::OkStatus();
}

std::vector<std::string> SplitFlags(const std::string& csv) {
  std::vector<std::string> out;
  for (absl::string_view p : absl::StrSplit(csv, ',', absl::SkipEmpty())) {
    out.emplace_back(p);
  }
  return out;
}

// One row of the comparison: a manager mode and the sessions' policy.
struct Row {
  std::string mode;
  std::string policy;  // "bf16" (built in) or the registered triaxial policy
  v1::Policy to_put;   // registered before the replay when named
};

struct Setup {
  std::string dir;  // data
  const Model* model = nullptr;
  std::vector<Session>* sessions = nullptr;
  v1::CalibrationTable table;
  int pool_mb = 0, host_mb = 0, disk_mb = 0;
  int chunk = 64, threads = 2;
};

// The worker's inventory with a short deadline (sampled while the replay
// runs).
absl::StatusOr<v1::Inventory> Inventory(client::Client* c,
                                        const std::string& address) {
  return WorkerInventory(c, address, absl::Seconds(10));
}

// Samples the worker's pool bytes in use every `period` until stopped.
class PeakSampler {
 public:
  PeakSampler(client::Client* c, std::string address,
              std::chrono::milliseconds period)
      : client_(c), address_(std::move(address)), period_(period) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~PeakSampler() { Stop(); }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  void Sample() {
    auto inv = Inventory(client_, address_);
    if (!inv.ok()) return;  // a missed sample only lowers the peak's accuracy
    uint64_t cur = peak_.load();
    while (inv->used_bytes() > cur &&
           !peak_.compare_exchange_weak(cur, inv->used_bytes())) {
    }
  }
  uint64_t peak() const { return peak_.load(); }

 private:
  void Loop() {
    while (!stop_.load()) {
      Sample();
      std::this_thread::sleep_for(period_);
    }
  }
  client::Client* client_;
  std::string address_;
  std::chrono::milliseconds period_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> peak_{0};
  std::thread thread_;
};

// One read-only Attend on layer 0: a zero query at `position` (written).
absl::Status Resume(client::Client* c, const client::SequenceHandle& h,
                    const frontend::ModelConfig& mc, int64_t position) {
  std::vector<float> q(static_cast<size_t>(mc.dim), 0.0f), out(q.size());
  const uint64_t pos = static_cast<uint64_t>(position);
  client::Client::AttendArgs a;
  a.layer = 0;
  a.num_queries = 1;
  a.positions = &pos;
  a.q = q.data();
  a.out = out.data();
  return c->Attend(h, a);
}

absl::Status RunRow(const Setup& setup, const Row& row, ModeResult* r) {
  const auto t0 = Clock::now();
  const auto& mc = setup.model->config;
  const int vocab = mc.vocab_size;
  std::vector<Session>& sessions = *setup.sessions;
  r->mode = row.mode;
  r->policy = row.policy;
  r->sessions = static_cast<int>(sessions.size());
  r->pool_bytes = static_cast<uint64_t>(setup.pool_mb) << 20;

  testing::ClusterOptions o = OneWorkerOptions(setup.pool_mb);
  o.manager_flags = {
      absl::StrCat("--pressure_mode=", row.mode),
      absl::StrCat("--high_watermark=", absl::GetFlag(FLAGS_high_watermark)),
      absl::StrCat("--low_watermark=", absl::GetFlag(FLAGS_low_watermark)),
      absl::StrCat("--pressure_interval_ms=",
                   absl::GetFlag(FLAGS_pressure_interval_ms)),
      absl::StrCat("--protected_roles=", absl::GetFlag(FLAGS_protected_roles)),
      absl::StrCat("--evict_factor=", absl::GetFlag(FLAGS_evict_factor))};
  for (auto& f : SplitFlags(absl::GetFlag(FLAGS_manager_flags))) {
    o.manager_flags.push_back(f);
  }
  o.worker_flags.push_back(
      absl::StrCat("--restore_on_attend=",
                   absl::GetFlag(FLAGS_restore_on_attend) ? "true" : "false"));
  if (setup.host_mb > 0) {
    o.worker_flags.push_back(absl::StrCat("--host_tier_mb=", setup.host_mb));
  }
  // The disk directory is made under the cluster's temp dir after start;
  // the worker is told a path below it that it creates.
  for (auto& f : SplitFlags(absl::GetFlag(FLAGS_worker_flags))) {
    o.worker_flags.push_back(f);
  }
  std::string disk_dir;
  if (setup.disk_mb > 0) {
    char tmpl[] = "/tmp/pressure_replay_disk.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      return absl::InternalError("mkdtemp for the disk tier failed");
    }
    disk_dir = tmpl;
    o.worker_flags.push_back(absl::StrCat("--disk_tier_dir=", disk_dir));
    o.worker_flags.push_back(absl::StrCat("--disk_tier_mb=", setup.disk_mb));
  }
  auto cleanup_disk = [&] {
    if (!disk_dir.empty()) {
      std::string cmd = absl::StrCat("rm -rf '", disk_dir, "'");
      if (std::system(cmd.c_str()) != 0) {
        std::fprintf(stderr, "pressure_replay: could not remove %s\n",
                     disk_dir.c_str());
      }
    }
  };
  absl::Status st = [&]() -> absl::Status {
    TRIAX_ASSIGN_OR_RETURN(BenchCluster bench, StartBenchCluster(o, kTenant));
    client::Client* c = bench.client.get();
    TRIAX_RETURN_IF_ERROR(PutCalibration(c, setup.table));
    if (!row.to_put.name().empty()) {
      TRIAX_RETURN_IF_ERROR(PutPolicy(c, row.to_put));
    }
    TRIAX_ASSIGN_OR_RETURN(
        v1::WorkerInfo w0,
        bench.cluster->GetWorker(testing::Cluster::WorkerId(0)));
    PeakSampler sampler(
        c, w0.address(),
        std::chrono::milliseconds(std::max(1, absl::GetFlag(FLAGS_sample_ms))));

    const v1::ModelShape shape = frontend::ServiceShape(*setup.model);
    client::OpenOptions open;
    open.policy = row.policy;
    open.block_tokens =
        static_cast<uint32_t>(absl::GetFlag(FLAGS_block_tokens));
    open.window_tokens = 0;

    struct Live {
      client::SequenceHandle h;
      bool open = false, stopped = false;
    };
    std::vector<Live> live(sessions.size());
    std::vector<int> turns;
    turns.reserve(sessions.size());
    for (const Session& s : sessions) {
      turns.push_back(static_cast<int>(s.bfcl.turns.size()));
    }
    TRIAX_ASSIGN_OR_RETURN(
        const std::vector<Step> steps,
        IdleRounds(turns, absl::GetFlag(FLAGS_active_fraction),
                   absl::GetFlag(FLAGS_idle_seed),
                   absl::GetFlag(FLAGS_max_idle_rounds)));
    const bool report_mass = absl::GetFlag(FLAGS_report_mass);
    Transformer tf(setup.model, setup.threads);
    const int retries = std::max(0, absl::GetFlag(FLAGS_admit_retries));
    const auto wait = std::chrono::milliseconds(
        std::max(0, absl::GetFlag(FLAGS_admit_wait_ms)));
    bool warned_report = false;

    auto stop = [&](Live& l) {
      l.stopped = true;
      if (l.open) {
        absl::Status cs = c->Close(l.h);
        if (!cs.ok()) {
          std::fprintf(stderr, "  close %s: %s\n", l.h.sequence_id.c_str(),
                       cs.ToString().c_str());
        }
        l.open = false;
      }
    };

    for (size_t k = 0; k < steps.size(); ++k) {
      const Step& step = steps[k];
      Session& s = sessions[step.session];
      Live& l = live[step.session];
      if (l.stopped) continue;
      const auto ts = Clock::now();
      const frontend::BfclSessionTurn& turn = s.bfcl.turns[step.turn];
      const int64_t first = turn.first, end = turn.end;
      // Admission: Open (turn 0) or ReportAccess + Extend (later turns),
      // waiting for the manager to reclaim on RESOURCE_EXHAUSTED.
      absl::Status admit;
      int attempt = 0;
      if (step.turn > 0) {
        std::vector<uint64_t> ids;
        for (const auto& b : l.h.blocks) {
          if (report_mass) break;  // reported with their mass after turns
          if (!b.evicted() && ids.size() < 4096) ids.push_back(b.lineage_id());
        }
        auto n = c->ReportAccess(l.h, ids, {}, /*active=*/true);
        if (!n.ok() && !warned_report) {
          std::fprintf(stderr, "  [%s] ReportAccess: %s (continuing)\n",
                       row.mode.c_str(), n.status().ToString().c_str());
          warned_report = true;
        }
      }
      for (;; ++attempt) {
        if (step.turn == 0) {
          auto h = c->Open(shape, ServiceSpans(turn.spans), open);
          admit = h.status();
          if (h.ok()) {
            l.h = std::move(*h);
            l.open = true;
          }
        } else {
          admit = c->Extend(&l.h, ServiceSpans(turn.spans), /*new_turn=*/true,
                            /*continue_last_span=*/false);
        }
        if (admit.code() != absl::StatusCode::kResourceExhausted ||
            attempt >= retries) {
          break;
        }
        ++r->retry_waits;
        std::this_thread::sleep_for(wait);
      }
      if (!admit.ok()) {
        const bool exhausted =
            admit.code() == absl::StatusCode::kResourceExhausted;
        if (exhausted) {
          ++(step.turn == 0 ? r->rejected_open : r->rejected_extend);
        } else {
          ++r->failed;
        }
        std::printf(
            "  [%s] %s turn %d: %s %s\n", row.mode.c_str(), s.bfcl.id.c_str(),
            step.turn,
            exhausted ? "rejected:" : "FAILED:", admit.ToString().c_str());
        stop(l);
        continue;
      }
      if (step.turn == 0) {
        ++r->admitted;
        if (attempt > 0) ++r->admitted_after_wait;
      } else {
        // Resume: a read-only Attend of the last written token brings the
        // spilled blocks back before the turn's appends (restore on attend,
        // or the client's retry_after wait). It only reads, so it may be
        // repeated while the pool has no room to restore into.
        absl::Status resume;
        for (int a = 0;; ++a) {
          resume = Resume(c, l.h, mc, first - 1);
          if (resume.code() != absl::StatusCode::kResourceExhausted ||
              a >= retries) {
            break;
          }
          ++r->retry_waits;
          std::this_thread::sleep_for(wait);
        }
        if (!resume.ok()) {
          const bool exhausted =
              resume.code() == absl::StatusCode::kResourceExhausted;
          ++(exhausted ? r->rejected_resume : r->failed);
          std::printf(
              "  [%s] %s turn %d: resume %s %s\n", row.mode.c_str(),
              s.bfcl.id.c_str(), step.turn,
              exhausted ? "rejected:" : "FAILED:", resume.ToString().c_str());
          stop(l);
          continue;
        }
      }
      // The turn's prefill through the service.
      ServiceKvStore kv(c, &l.h, mc.n_kv_heads, mc.head_dim());
      std::vector<float> logits;
      absl::Status pf = tf.Prefill(
          absl::MakeConstSpan(s.bfcl.tokens).subspan(first, end - first), first,
          setup.chunk, &kv, &logits);
      if (!pf.ok()) {
        ++r->failed;
        std::printf("  [%s] %s turn %d: prefill FAILED: %s\n", row.mode.c_str(),
                    s.bfcl.id.c_str(), step.turn, pf.ToString().c_str());
        stop(l);
        continue;
      }
      if (report_mass) {
        // What the turn attended: its queries' mass on the live blocks.
        std::vector<BlockSpan> spans;
        for (const auto& b : l.h.blocks) {
          spans.push_back({b.lineage_id(),
                           static_cast<int64_t>(b.first_token()),
                           static_cast<int64_t>(b.num_tokens()), !b.evicted()});
        }
        AccessReport rep = BlockWeights(spans, s.turn_mass[step.turn]);
        if (rep.lineage_ids.size() > 4096) {
          rep.lineage_ids.resize(4096);
          rep.weights.resize(4096);
        }
        auto n = c->ReportAccess(l.h, rep.lineage_ids, rep.weights,
                                 /*active=*/false);
        if (!n.ok() && !warned_report) {
          std::fprintf(stderr, "  [%s] ReportAccess (mass): %s (continuing)\n",
                       row.mode.c_str(), n.status().ToString().c_str());
          warned_report = true;
        }
      }
      double d = 0;
      int n = 0;
      ScoreTurn(s, first, end, logits, vocab, [&](int64_t t, double nll) {
        r->AddScore(step.session, step.turn, nll, s.ref_nll[t]);
        d += nll - s.ref_nll[t];
        ++n;
      });
      ++r->turns;
      r->tokens += end - first;
      if (step.turn + 1 == turns[step.session]) ++r->completed;
      sampler.Sample();
      std::printf(
          "  [%s] step %zu/%zu %s turn %d: %d tokens, ΔNLL %+.4f over %d, "
          "peak %.1f MiB, %.1f s\n",
          row.mode.c_str(), k + 1, steps.size(), s.bfcl.id.c_str(), step.turn,
          static_cast<int>(end - first), n ? d / n : 0.0, n,
          sampler.peak() / 1048576.0, Seconds(ts));
      std::fflush(stdout);
    }
    sampler.Stop();
    r->peak_device_bytes = sampler.peak();

    // Counters: the manager's applied actions, the worker's tier moves.
    auto p = c->GetPressure(0);
    if (p.ok()) {
      r->demotions = p->demotions();
      r->spills = p->spills();
      r->restores = p->restores();
      r->evictions = p->evictions();
    } else {
      std::fprintf(stderr, "  [%s] GetPressure: %s\n", row.mode.c_str(),
                   p.status().ToString().c_str());
    }
    TRIAX_ASSIGN_OR_RETURN(v1::Inventory inv, Inventory(c, w0.address()));
    r->worker_spills = inv.spills();
    r->worker_restores = inv.restores();
    r->worker_evictions = inv.evictions();
    r->checksum_failures = inv.checksum_failures();
    // Final plans of the sessions still open, then close them.
    absl::Status first_err;
    for (Live& l : live) {
      if (!l.open) continue;
      auto info = c->GetSequence(l.h.sequence_id);
      if (info.ok()) {
        for (const auto& b : info->blocks()) {
          std::string key;
          if (b.evicted()) {
            key = "evicted";
          } else if (b.tier() == v1::TIER_HOST) {
            key = "host";
          } else if (b.tier() == v1::TIER_DISK) {
            key = "disk";
          } else {
            key = client::EncodingLabel(EncodingFromProto(b));
          }
          ++r->final_blocks[key];
        }
      } else if (first_err.ok()) {
        first_err = info.status();
      }
      absl::Status cs = c->Close(l.h);
      if (!cs.ok() && first_err.ok()) first_err = cs;
      l.open = false;
    }
    return first_err;
  }();
  cleanup_disk();
  r->seconds = Seconds(t0);
  return st;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "pressure_replay: %s: %s\n", what.c_str(),
               s.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  const auto t_all = Clock::now();
  const std::string command =
      absl::StrJoin(std::vector<std::string>(argv, argv + argc), " ");
  Setup setup;
  auto dir = CompleteDataDir(absl::GetFlag(FLAGS_data_dir));
  if (!dir.ok()) return Fail("data directory", dir.status());
  setup.dir = *dir;
  setup.chunk = absl::GetFlag(FLAGS_chunk);
  if (setup.chunk < 1 || setup.chunk > 256) {
    return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                             "--chunk=", setup.chunk, "; must be 1..256")));
  }
  setup.threads = absl::GetFlag(FLAGS_threads);
  const int block_tokens = absl::GetFlag(FLAGS_block_tokens);
  if (block_tokens < 1 || block_tokens > 4096) {
    return Fail("flags",
                absl::InvalidArgumentError(absl::StrCat(
                    "--block_tokens=", block_tokens, "; must be 1..4096")));
  }
  auto ids = ParseSessionIds("--bfcl_ids", absl::GetFlag(FLAGS_bfcl_ids),
                             absl::GetFlag(FLAGS_sessions));
  if (!ids.ok()) return Fail("flags", ids.status());
  std::vector<Row> rows;
  for (const std::string& m : SplitFlags(absl::GetFlag(FLAGS_modes))) {
    if (m != "lru" && m != "graph-evict" && m != "demote-first") {
      return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                               "--modes: \"", m,
                               "\"; want lru, graph-evict or demote-first")));
    }
    rows.push_back({m, "bf16", {}});
  }
  if (absl::GetFlag(FLAGS_triaxial_row)) {
    Row t;
    t.mode = "demote-first";
    t.policy =
        absl::StrFormat("rp-tri-%g", absl::GetFlag(FLAGS_triaxial_budget));
    t.to_put.set_name(t.policy);
    t.to_put.set_budget_bits(absl::GetFlag(FLAGS_triaxial_budget));
    t.to_put.set_calibration_model(kModel);
    rows.push_back(std::move(t));
  }
  if (rows.empty()) {
    return Fail("flags", absl::InvalidArgumentError("--modes names no mode"));
  }

  auto table = ReadCalibrationTable(absl::GetFlag(FLAGS_calibration), kModel);
  if (!table.ok()) return Fail("calibration", table.status());
  setup.table = std::move(*table);

  DefaultBinDirToSelf();

  auto m = frontend::LoadModel(setup.dir + "/models/kvproxy-18m/model.bin");
  if (!m.ok()) return Fail("load kvproxy-18m", m.status());
  (*m)->name = kModel;
  setup.model = m->get();
  const auto& mc = (*m)->config;
  auto bfcl = BfclData::Load(setup.dir);
  if (!bfcl.ok()) return Fail("load BFCL", bfcl.status());

  // Sessions and their local fp32 reference.
  std::vector<Session> sessions;
  Transformer ref_tf(setup.model, setup.threads);
  const auto t_ref = Clock::now();
  uint64_t total_tokens = 0, total_bf16 = 0;
  kernels::PageShape ps;
  ps.tokens = block_tokens;
  ps.heads = mc.n_kv_heads;
  ps.head_dim = mc.head_dim();
  const uint64_t bf16_block = kernels::PageBytes(kernels::Encoding(), ps);
  const std::string ref_file = absl::GetFlag(FLAGS_reference_file);
  const bool dry = absl::GetFlag(FLAGS_dry_run);
  for (const std::string& id : *ids) {
    auto s = MakeSession(*bfcl, id, absl::GetFlag(FLAGS_bfcl_max_context),
                         absl::GetFlag(FLAGS_max_turns));
    if (!s.ok()) return Fail(absl::StrCat("render ", id), s.status());
    total_tokens += s->bfcl.tokens.size();
    total_bf16 += Bf16PlanBytes(s->bfcl.tokens.size(), block_tokens, bf16_block,
                                mc.n_layers);
    std::printf("session %s\n", s->note.c_str());
    std::fflush(stdout);
    sessions.push_back(std::move(*s));
  }
  std::vector<size_t> token_counts;
  token_counts.reserve(sessions.size());
  for (const Session& s : sessions)
    token_counts.push_back(s.bfcl.tokens.size());
  absl::StatusOr<std::vector<SessionReference>> loaded =
      absl::NotFoundError("no --reference_file");
  if (!dry && !ref_file.empty()) {
    loaded = ReadReferences(ref_file, *ids, token_counts);
    if (!loaded.ok() && !absl::IsNotFound(loaded.status())) {
      return Fail("--reference_file", loaded.status());
    }
  }
  if (loaded.ok()) {
    for (size_t i = 0; i < sessions.size(); ++i) {
      sessions[i].ref_nll = std::move((*loaded)[i].nll);
      sessions[i].turn_mass = std::move((*loaded)[i].turn_mass);
      if (absl::GetFlag(FLAGS_report_mass) &&
          sessions[i].turn_mass.size() != sessions[i].bfcl.turns.size()) {
        return Fail("--reference_file",
                    absl::FailedPreconditionError(absl::StrCat(
                        ref_file, " has no attention mass for ",
                        sessions[i].bfcl.id, "; --report_mass needs it")));
      }
    }
    std::printf("local fp32 references: read from %s\n", ref_file.c_str());
  } else if (!dry) {
    std::vector<SessionReference> refs;
    for (Session& s : sessions) {
      // The mass is tracked whenever the references are written, so that
      // one file serves runs with and without --report_mass.
      const bool mass = absl::GetFlag(FLAGS_report_mass) || !ref_file.empty();
      if (absl::Status st =
              ComputeReference(&ref_tf, setup.chunk, setup.threads, mass, &s);
          !st.ok()) {
        return Fail(absl::StrCat("reference ", s.bfcl.id), st);
      }
      refs.push_back({s.bfcl.id, s.ref_nll, s.turn_mass});
    }
    if (!ref_file.empty()) {
      if (absl::Status st = WriteReferences(ref_file, refs); !st.ok()) {
        return Fail("--reference_file", st);
      }
      std::printf("local fp32 references written to %s\n", ref_file.c_str());
    }
  }
  std::printf("local fp32 references: %.1f s\n", Seconds(t_ref));

  // The pool: BF16 holds about --pool_fraction of the final KV.
  auto pool = SizePool(total_bf16, absl::GetFlag(FLAGS_pool_fraction));
  if (!pool.ok()) return Fail("pool size", pool.status());
  std::string arithmetic = absl::StrFormat(
      "BF16 block of %d tokens = %d bytes per layer (%d KV heads x %d dims x "
      "K,V x 2 bytes) x %d layers; ",
      block_tokens, bf16_block, mc.n_kv_heads, mc.head_dim(), mc.n_layers);
  arithmetic += pool->Explain(static_cast<int>(sessions.size()), total_tokens);
  setup.pool_mb = pool->pool_mb;
  if (absl::GetFlag(FLAGS_pool_mb) > 0) {
    setup.pool_mb = absl::GetFlag(FLAGS_pool_mb);
    arithmetic += absl::StrFormat(
        "; overridden by --pool_mb=%d (holds %.1f%%)", setup.pool_mb,
        100.0 * (static_cast<double>(setup.pool_mb) * 1048576.0) / total_bf16);
  }
  const int host = absl::GetFlag(FLAGS_host_tier_mb);
  const int disk = absl::GetFlag(FLAGS_disk_tier_mb);
  setup.host_mb = host < 0 ? std::max(1, setup.pool_mb / 2) : host;
  setup.disk_mb = disk < 0 ? setup.pool_mb : disk;
  arithmetic += absl::StrFormat("; host tier %d MiB, disk tier %d MiB",
                                setup.host_mb, setup.disk_mb);
  std::printf("pool: %s\n", arithmetic.c_str());
  std::fflush(stdout);
  if (absl::GetFlag(FLAGS_dry_run) || absl::GetFlag(FLAGS_references_only)) {
    return 0;
  }
  setup.sessions = &sessions;

  std::vector<ModeResult> results;
  for (const Row& row : rows) {
    ModeResult r;
    std::printf("== mode %s, policy %s\n", row.mode.c_str(),
                row.policy.c_str());
    std::fflush(stdout);
    if (absl::Status st = RunRow(setup, row, &r); !st.ok()) {
      return Fail(absl::StrCat("mode ", row.mode, " policy ", row.policy), st);
    }
    std::printf(
        "== %s/%s: admitted %d/%d, rejected %d+%d+%d, failed %d, "
        "ΔNLL %+.4f (%lld tokens), %.0f s\n",
        row.mode.c_str(), row.policy.c_str(), r.admitted, r.sessions,
        r.rejected_open, r.rejected_extend, r.rejected_resume, r.failed,
        r.mean_dnll(), static_cast<long long>(r.scored), r.seconds);
    results.push_back(std::move(r));
  }

  const double total = Seconds(t_all);
  std::vector<std::string> notes;
  notes.reserve(sessions.size());
  for (const auto& s : sessions) notes.push_back(s.note);
  std::string md = absl::StrCat(
      "## BFCL replay\n\n", GeneratedBy("pressure_replay", total),
      CommandBlock(command),
      "Sessions (kvproxy-18m, BFCL multi_turn_base, none of the calibration "
      "set, cut to the context, round-robin turn by turn): ",
      absl::StrJoin(notes, "; "), ".\n\n", "Pool: ", arithmetic, ".\n\n",
      absl::StrFormat(
          "Manager: --high_watermark=%g --low_watermark=%g "
          "--pressure_interval_ms=%d --protected_roles=%s --evict_factor=%g; "
          "calibration `%s` put with PutCalibration. Worker: "
          "--restore_on_attend=%s, --window_tokens=0. Admission: "
          "RESOURCE_EXHAUSTED retried %d times %d ms apart. Schedule: %s. "
          "Access reports: %s.\n\n",
          absl::GetFlag(FLAGS_high_watermark),
          absl::GetFlag(FLAGS_low_watermark),
          absl::GetFlag(FLAGS_pressure_interval_ms),
          absl::GetFlag(FLAGS_protected_roles),
          absl::GetFlag(FLAGS_evict_factor), absl::GetFlag(FLAGS_calibration),
          absl::GetFlag(FLAGS_restore_on_attend) ? "true" : "false",
          absl::GetFlag(FLAGS_admit_retries),
          absl::GetFlag(FLAGS_admit_wait_ms),
          absl::GetFlag(FLAGS_active_fraction) >= 1
              ? std::string("round robin (every session every round)")
              : absl::StrFormat(
                    "turn 0 of every session, then rounds in which each "
                    "session is active with probability %g (seed %u, idle "
                    "at most %d rounds in a row)",
                    absl::GetFlag(FLAGS_active_fraction),
                    absl::GetFlag(FLAGS_idle_seed),
                    absl::GetFlag(FLAGS_max_idle_rounds)),
          absl::GetFlag(FLAGS_report_mass)
              ? "after each turn, the live blocks with the attention mass "
                "the turn's queries put on them (all layers and heads, "
                "measured in the local fp32 pass of the same tokens); "
                "ReportAccess(active=true) before a later turn names no "
                "blocks"
              : "before each later turn, ReportAccess(active=true) with the "
                "plan's live blocks, equal shares"),
      "ΔNLL: teacher-forced NLL (nats) of the assistant and tool-call tokens "
      "with the KV held by the service, minus the same session's NLL with a "
      "local fp32 KV; \"turns ≥ 2\" only the later turns, whose attention "
      "reads KV the pressure response acted on; the rows admit different "
      "sessions, so the column \"on the later turns every row replayed\" "
      "compares them on the same tokens. Counters: the manager's "
      "applied actions (GetPressure) and the worker's (Inventory).\n\n",
      ResultsTable(results), "\n");
  if (absl::Status st = EmitReport(md, absl::GetFlag(FLAGS_out)); !st.ok()) {
    return Fail("write report", st);
  }
  std::printf("total %.1f s\n", total);
  return 0;
}

}  // namespace
}  // namespace triax::bench::replay

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return triax::bench::replay::Main(argc, argv);
}
