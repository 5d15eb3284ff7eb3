// policy_bench: the triaxial allocation policy (budget_bits + calibration
// table, solved by the manager per turn, blocks demoted as turns age)
// against uniform baselines (BF16, FP8, INT4, KIVI-style INT2 with a BF16
// residual window) on held-out BFCL sessions of kvproxy-18m, processed turn
// by turn through a real kvmanager and kvworker (started here). Also the
// ablations that collapse one tag axis of the calibration table, and the
// memory reduction against BF16 at matched quality. Writes a markdown report.
// Exit code 0 when the report was written, 1 on any failure.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/policy/policy_tables.h"
#include "bench/quality/bench_service.h"
#include "bench/quality/harness.h"
#include "bench/quality/quality_metrics.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/bfcl_session.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "client/frontend/service_kv_store.h"
#include "client/frontend/service_types.h"
#include "client/frontend/tee_kv_store.h"
#include "client/kv_client.h"
#include "common/status_macros.h"
#include "kernels/layout.h"

ABSL_FLAG(std::string, data_dir, "",
          "data directory; empty: $TRIAX_DATA_DIR, else ../shared/data");
ABSL_FLAG(std::string, calibration,
          "bench/results/calibration_kvproxy-18m.txtpb",
          "text-format triax.v1.CalibrationTable of kvproxy-18m");
ABSL_FLAG(std::string, bfcl_ids, "multi_turn_base_42,multi_turn_base_8",
          "held-out BFCL conversations of kvproxy-18m (README list only)");
ABSL_FLAG(int, bfcl_max_context, 2048, "token budget per conversation");
ABSL_FLAG(std::string, budgets, "2.5,3,3.5,4,4.5,5",
          "budget_bits of the triaxial policy sweep");
ABSL_FLAG(double, ablation_budget, 3.5, "budget_bits of the ablations");
ABSL_FLAG(std::string, tri_windows, "0",
          "BF16 residual windows (tokens) the triaxial sweep runs with, "
          "comma-separated (e.g. 0,32)");
ABSL_FLAG(int, kivi_window, 32, "BF16 residual window of KIVI-2 (tokens)");
ABSL_FLAG(int, chunk, 64, "prefill chunk: tokens per forward call (1..256)");
ABSL_FLAG(int, threads, 2, "threads for the matrix products");
ABSL_FLAG(int, query_stride, 4,
          "attention error: queries at positions divisible by this");
ABSL_FLAG(bool, attention_error, true,
          "run the teacher-forced attention-error pass");
ABSL_FLAG(int, pool_mb, 1024, "kvworker --pool_mb");
ABSL_FLAG(std::string, out, "", "markdown report path; empty: print only");

namespace triax::bench {
namespace {

using frontend::BfclData;
using frontend::Model;
using frontend::RenderedConversation;
using frontend::ServiceKvStore;
using frontend::ServiceSpans;
using frontend::TeeKvStore;
using frontend::Transformer;

using Clock = std::chrono::steady_clock;

constexpr const char* kModel = "kvproxy-18m";
constexpr const char* kTenant = "policy";

const std::set<std::string>& HeldOutBfcl() {
  static const auto* ids = new std::set<std::string>{
      "multi_turn_base_3",   "multi_turn_base_8",  "multi_turn_base_15",
      "multi_turn_base_17",  "multi_turn_base_42", "multi_turn_base_46",
      "multi_turn_base_50",  "multi_turn_base_59", "multi_turn_base_121",
      "multi_turn_base_177", "multi_turn_base_181"};
  return *ids;
}

// One session: the BFCL session (tokens from BOS, per turn the spans and the
// token range, assistant and tool-call tokens as focus) and its note.
struct Session {
  frontend::BfclSession bfcl;
  std::string note;
};

absl::StatusOr<Session> MakeSession(const BfclData& bfcl, const std::string& id,
                                    int max_context) {
  TRIAX_ASSIGN_OR_RETURN(RenderedConversation conv,
                         bfcl.Render(id, max_context - 1));
  Session s;
  TRIAX_ASSIGN_OR_RETURN(s.bfcl, frontend::MakeBfclSession(conv));
  s.note = absl::StrFormat(
      "%s (%d tokens, %d turns, %d assistant/tool-call tokens; %d/%d doc "
      "lines, %d/%d exchanges)",
      id, s.bfcl.tokens.size(), s.bfcl.turns.size(), s.bfcl.num_focus(),
      conv.docs_kept, conv.docs_total, conv.turns_kept, conv.turns_total);
  return s;
}

// One configuration of the comparison.
struct Config {
  std::string name;    // row label
  std::string policy;  // policy registered with PutPolicy
  uint32_t window = 0;
  std::string kind;  // "baseline", "triaxial", "ablation"
  double budget = 0;
  std::string note;
  // Results, summed over sessions.
  NextTokenStats stats;
  std::vector<TeeKvStore::LayerError> attn;
  uint64_t plan_bytes = 0, worker_bytes = 0, tokens = 0;
  std::map<std::string, uint64_t> tokens_by_encoding;  // final plan
  double seconds = 0;
};

v1::Policy RulePolicy(const std::string& name, v1::Format f) {
  v1::Policy p;
  p.set_name(name);
  v1::PolicyRule* r = p.add_rules();
  r->set_format(f);
  if (f == v1::FORMAT_INT4 || f == v1::FORMAT_INT2) r->set_group_size(32);
  return p;
}

v1::Policy AllocPolicy(const std::string& name, double budget,
                       const std::string& calibration_model) {
  v1::Policy p;
  p.set_name(name);
  p.set_budget_bits(budget);
  p.set_calibration_model(calibration_model);
  return p;  // candidates empty: every encoding of the table
}

class Runner {
 public:
  Runner(client::Client* client, const Model* model, int chunk, int threads,
         int query_stride)
      : client_(client),
        model_(model),
        tf_(model, threads),
        chunk_(chunk),
        query_stride_(query_stride),
        shape_(frontend::ServiceShape(*model)) {}

  absl::StatusOr<client::SequenceHandle> Open(const Session& s,
                                              const Config& c) {
    client::OpenOptions o;
    o.policy = c.policy;
    o.window_tokens = c.window;
    return client_->Open(shape_, ServiceSpans(s.bfcl.turns[0].spans), o);
  }

  // Turn-by-turn forward of `s` with the KV in `c`'s policy; logits of every
  // position into *logits; final plan bytes into `c`.
  absl::Status RunConfig(const Session& s, Config* c,
                         std::vector<float>* logits) {
    const auto& mc = model_->config;
    TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle h, Open(s, *c));
    absl::Status st = [&]() -> absl::Status {
      ServiceKvStore kv(client_, &h, mc.n_kv_heads, mc.head_dim());
      logits->clear();
      std::vector<float> part;
      for (size_t t = 0; t < s.bfcl.turns.size(); ++t) {
        const frontend::BfclSessionTurn& turn = s.bfcl.turns[t];
        if (t > 0) {
          TRIAX_RETURN_IF_ERROR(client_->Extend(&h, ServiceSpans(turn.spans),
                                                /*new_turn=*/true,
                                                /*continue_last_span=*/false));
        }
        TRIAX_RETURN_IF_ERROR(
            tf_.Prefill(absl::MakeConstSpan(s.bfcl.tokens)
                            .subspan(turn.first, turn.end - turn.first),
                        turn.first, chunk_, &kv, &part));
        logits->insert(logits->end(), part.begin(), part.end());
      }
      TRIAX_ASSIGN_OR_RETURN(v1::Inventory inv,
                             WorkerInventory(client_, h.worker_address));
      c->worker_bytes += inv.used_bytes();
      TRIAX_ASSIGN_OR_RETURN(v1::SequenceInfo info,
                             client_->GetSequence(h.sequence_id));
      for (const auto& b : info.blocks()) {
        kernels::PageShape ps;
        ps.tokens =
            static_cast<int>(b.capacity() ? b.capacity() : info.block_tokens());
        ps.heads = mc.n_kv_heads;
        ps.head_dim = mc.head_dim();
        const kernels::Encoding e = EncodingFromProto(b);
        c->plan_bytes += kernels::PageBytes(e, ps) * mc.n_layers;
        c->tokens_by_encoding[client::EncodingLabel(e)] += b.num_tokens();
      }
      c->tokens += s.bfcl.tokens.size();
      return absl::OkStatus();
    }();
    absl::Status close = client_->Close(h);
    TRIAX_RETURN_IF_ERROR(st);
    return close;
  }

  // Teacher-forced attention error: a BF16 primary and one sequence per
  // config, all extended turn by turn (so the secondaries age and demote as
  // in a real session); errors added into each config.
  absl::Status RunTee(const Session& s, const Config& bf16,
                      std::vector<Config>* configs) {
    const auto& mc = model_->config;
    std::vector<client::SequenceHandle> seqs;
    absl::Status st = [&]() -> absl::Status {
      TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle p, Open(s, bf16));
      seqs.push_back(p);
      for (const Config& c : *configs) {
        TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle h, Open(s, c));
        seqs.push_back(h);
      }
      std::vector<std::unique_ptr<ServiceKvStore>> stores;
      stores.reserve(seqs.size());
      for (auto& h : seqs) {
        stores.push_back(std::make_unique<ServiceKvStore>(
            client_, &h, mc.n_kv_heads, mc.head_dim()));
      }
      std::vector<frontend::KvStore*> secondaries;
      for (size_t i = 1; i < stores.size(); ++i) {
        secondaries.push_back(stores[i].get());
      }
      TeeKvStore tee(stores[0].get(), secondaries, mc.n_layers, mc.dim,
                     query_stride_);
      std::vector<float> part;
      for (size_t t = 0; t < s.bfcl.turns.size(); ++t) {
        const frontend::BfclSessionTurn& turn = s.bfcl.turns[t];
        if (t > 0) {
          const std::vector<v1::Span> spans = ServiceSpans(turn.spans);
          for (auto& h : seqs) {
            TRIAX_RETURN_IF_ERROR(client_->Extend(&h, spans, true, false));
          }
        }
        TRIAX_RETURN_IF_ERROR(
            tf_.Prefill(absl::MakeConstSpan(s.bfcl.tokens)
                            .subspan(turn.first, turn.end - turn.first),
                        turn.first, chunk_, &tee, &part));
      }
      for (size_t j = 0; j < configs->size(); ++j) {
        auto& attn = (*configs)[j].attn;
        attn.resize(mc.n_layers);
        for (int l = 0; l < mc.n_layers; ++l) {
          const auto& e = tee.error(static_cast<int>(j), l);
          attn[l].sum_sq_diff += e.sum_sq_diff;
          attn[l].sum_sq_ref += e.sum_sq_ref;
          attn[l].queries += e.queries;
        }
      }
      return absl::OkStatus();
    }();
    absl::Status close;
    for (const auto& h : seqs) {
      absl::Status c = client_->Close(h);
      if (close.ok()) close = c;
    }
    TRIAX_RETURN_IF_ERROR(st);
    return close;
  }

 private:
  client::Client* client_;
  const Model* model_;
  Transformer tf_;
  int chunk_, query_stride_;
  v1::ModelShape shape_;
};

double MeanAttnErr(const Config& c) {
  if (c.attn.empty()) return std::nan("");
  double sum = 0;
  for (const auto& e : c.attn) {
    sum += e.queries && e.sum_sq_ref > 0
               ? std::sqrt(e.sum_sq_diff / e.sum_sq_ref)
               : 0.0;
  }
  return sum / c.attn.size();
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "policy_bench: %s: %s\n", what.c_str(),
               s.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  const auto t_all = Clock::now();
  std::vector<std::string> args(argv, argv + argc);
  const std::string command = absl::StrJoin(args, " ");
  const auto dir_or = CompleteDataDir(absl::GetFlag(FLAGS_data_dir));
  if (!dir_or.ok()) return Fail("data directory", dir_or.status());
  const std::string& dir = *dir_or;
  const int chunk = absl::GetFlag(FLAGS_chunk);
  if (chunk < 1 || chunk > 256) {
    return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                             "--chunk = ", chunk, "; must be 1..256")));
  }
  std::vector<double> budgets;
  for (absl::string_view b :
       absl::StrSplit(absl::GetFlag(FLAGS_budgets), ',', absl::SkipEmpty())) {
    double v;
    if (!absl::SimpleAtod(b, &v) || !(v > 0) || v > 64) {
      return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                               "--budgets: \"", b, "\" is not in (0, 64]")));
    }
    budgets.push_back(v);
  }
  std::vector<uint32_t> tri_windows;
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_tri_windows),
                                            ',', absl::SkipEmpty())) {
    uint32_t v;
    if (!absl::SimpleAtoi(w, &v) || v > 2048) {
      return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                               "--tri_windows: \"", w,
                               "\" is not a window in [0, 2048]")));
    }
    tri_windows.push_back(v);
  }
  const int kivi_window = absl::GetFlag(FLAGS_kivi_window);
  if (kivi_window < 0 || kivi_window > 2048) {
    return Fail("flags", absl::InvalidArgumentError(
                             absl::StrCat("--kivi_window = ", kivi_window,
                                          "; must be in [0, 2048]")));
  }

  // Calibration table and its ablations.
  auto table_or =
      ReadCalibrationTable(absl::GetFlag(FLAGS_calibration), kModel);
  if (!table_or.ok()) return Fail("calibration", table_or.status());
  const v1::CalibrationTable& table = *table_or;
  struct Ablation {
    TagAxis axis;
    v1::CalibrationTable table;
    int merged = 0;
  };
  std::vector<Ablation> ablations;
  for (TagAxis a : {TagAxis::kTemporal, TagAxis::kRole, TagAxis::kModality}) {
    Ablation ab;
    ab.axis = a;
    auto t = CollapseAxis(
        table, a, absl::StrCat(kModel, "-no-", TagAxisName(a)), &ab.merged);
    if (!t.ok()) return Fail("ablation table", t.status());
    ab.table = std::move(*t);
    ablations.push_back(std::move(ab));
  }

  DefaultBinDirToSelf();
  auto svc_or = StartBenchCluster(
      OneWorkerOptions(absl::GetFlag(FLAGS_pool_mb)), kTenant);
  if (!svc_or.ok()) return Fail("start kvmanager + kvworker", svc_or.status());
  client::Client* svc = svc_or->client.get();
  if (absl::Status s = PutCalibration(svc, table); !s.ok()) {
    return Fail("PutCalibration", s);
  }
  for (const auto& ab : ablations) {
    if (absl::Status s = PutCalibration(svc, ab.table); !s.ok()) {
      return Fail("PutCalibration " + ab.table.model(), s);
    }
  }

  // Configurations; [0] is the BF16 reference.
  std::vector<Config> cfgs;
  std::vector<v1::Policy> policies;
  auto add_rule = [&](const std::string& name, v1::Format f, uint32_t window,
                      const std::string& note) {
    const std::string pol =
        absl::StrCat("pb-", absl::AsciiStrToLower(v1::Format_Name(f)));
    bool have = false;
    for (const auto& p : policies) have |= p.name() == pol;
    if (!have) policies.push_back(RulePolicy(pol, f));
    Config c;
    c.name = name;
    c.policy = pol;
    c.window = window;
    c.kind = "baseline";
    c.note = note;
    cfgs.push_back(std::move(c));
  };
  add_rule("bf16", v1::FORMAT_BF16, 0, "reference");
  add_rule("fp8", v1::FORMAT_FP8_E4M3, 0, "uniform FP8 E4M3");
  add_rule("int4", v1::FORMAT_INT4, 0, "uniform INT4 g32 fp16 scales");
  add_rule(
      absl::StrCat("kivi2 (w", kivi_window, ")"), v1::FORMAT_INT2, kivi_window,
      absl::StrFormat("uniform INT2 g32 + %d-token BF16 window", kivi_window));
  for (uint32_t w : tri_windows) {
    for (double b : budgets) {
      Config c;
      c.policy = absl::StrFormat("tri-%g", b);
      c.name = w ? absl::StrFormat("tri-%g (w%d)", b, w) : c.policy;
      c.window = w;
      c.kind = "triaxial";
      c.budget = b;
      bool have = false;
      for (const auto& p : policies) have |= p.name() == c.policy;
      if (!have) policies.push_back(AllocPolicy(c.policy, b, kModel));
      cfgs.push_back(std::move(c));
    }
  }
  const double ab_budget = absl::GetFlag(FLAGS_ablation_budget);
  std::vector<std::string> vacuous;
  for (const auto& ab : ablations) {
    if (ab.merged == 0) {
      vacuous.emplace_back(TagAxisName(ab.axis));
      continue;
    }
    Config c;
    c.policy = absl::StrFormat("tri-%g-no-%s", ab_budget, TagAxisName(ab.axis));
    c.name = c.policy;
    c.window = tri_windows.empty() ? 0 : tri_windows[0];
    c.kind = "ablation";
    c.budget = ab_budget;
    c.note = absl::StrFormat("%d tag groups merged", ab.merged);
    policies.push_back(AllocPolicy(c.policy, ab_budget, ab.table.model()));
    cfgs.push_back(std::move(c));
  }
  for (const auto& p : policies) {
    if (absl::Status s = PutPolicy(svc, p); !s.ok()) {
      return Fail("PutPolicy " + p.name(), s);
    }
  }
  std::printf("policy_bench: %zu configurations, %zu policies\n", cfgs.size(),
              policies.size());

  auto m = frontend::LoadModel(dir + "/models/kvproxy-18m/model.bin");
  if (!m.ok()) return Fail("load kvproxy-18m", m.status());
  (*m)->name = kModel;
  const auto& mc = (*m)->config;
  const int vocab = mc.vocab_size;
  auto bfcl = BfclData::Load(dir);
  if (!bfcl.ok()) return Fail("load BFCL", bfcl.status());
  std::vector<Session> sessions;
  for (absl::string_view id :
       absl::StrSplit(absl::GetFlag(FLAGS_bfcl_ids), ',', absl::SkipEmpty())) {
    if (!HeldOutBfcl().count(std::string(id))) {
      return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                               "--bfcl_ids: \"", id,
                               "\" is not a held-out conversation of "
                               "kvproxy-18m; use one of: ",
                               absl::StrJoin(HeldOutBfcl(), ", "))));
    }
    auto s = MakeSession(*bfcl, std::string(id),
                         absl::GetFlag(FLAGS_bfcl_max_context));
    if (!s.ok()) return Fail(absl::StrCat("render ", id), s.status());
    std::printf("session %s\n", s->note.c_str());
    sessions.push_back(std::move(*s));
  }

  Runner runner(svc, m->get(), chunk, absl::GetFlag(FLAGS_threads),
                absl::GetFlag(FLAGS_query_stride));
  for (const Session& s : sessions) {
    const auto t0 = Clock::now();
    if (absl::GetFlag(FLAGS_attention_error)) {
      std::vector<Config> others(cfgs.begin() + 1, cfgs.end());
      for (auto& o : others) o.attn.clear();
      if (absl::Status st = runner.RunTee(s, cfgs[0], &others); !st.ok()) {
        return Fail("tee pass " + s.bfcl.id, st);
      }
      for (size_t i = 1; i < cfgs.size(); ++i) {
        auto& attn = cfgs[i].attn;
        attn.resize(mc.n_layers);
        for (int l = 0; l < mc.n_layers; ++l) {
          attn[l].sum_sq_diff += others[i - 1].attn[l].sum_sq_diff;
          attn[l].sum_sq_ref += others[i - 1].attn[l].sum_sq_ref;
          attn[l].queries += others[i - 1].attn[l].queries;
        }
      }
      std::printf("[%s] tee pass: %.1f s\n", s.bfcl.id.c_str(), Seconds(t0));
      std::fflush(stdout);
    }
    std::vector<float> ref, logits;
    for (size_t i = 0; i < cfgs.size(); ++i) {
      Config& c = cfgs[i];
      const auto t1 = Clock::now();
      if (absl::Status st = runner.RunConfig(s, &c, i == 0 ? &ref : &logits);
          !st.ok()) {
        return Fail(absl::StrCat(s.bfcl.id, " ", c.name), st);
      }
      const std::vector<float>& mine = i == 0 ? ref : logits;
      NextTokenStats one;
      if (absl::Status st =
              one.AddSequence(ref, mine, vocab, s.bfcl.tokens, s.bfcl.focus);
          !st.ok()) {
        return Fail(absl::StrCat(s.bfcl.id, " ", c.name, " stats"), st);
      }
      c.stats.Merge(one);
      c.seconds += Seconds(t1);
      std::printf("[%s] %-22s NLL %.4f focus %.4f KL %.5f (%.1f s)\n",
                  s.bfcl.id.c_str(), c.name.c_str(), one.nll(), one.focus_nll(),
                  one.kl(), Seconds(t1));
      std::fflush(stdout);
    }
  }

  // Report.
  const Config& bf = cfgs[0];
  auto bits = [&](const Config& c, uint64_t bytes) {
    return BitsPerValue(bytes, c.tokens, mc.n_layers, mc.n_kv_heads,
                        mc.head_dim());
  };
  auto dn = [&](const Config& c) { return c.stats.nll() - bf.stats.nll(); };
  auto dnf = [&](const Config& c) {
    return c.stats.focus_nll() - bf.stats.focus_nll();
  };
  auto mix = [&](const Config& c) {
    std::vector<std::string> parts;
    uint64_t total = 0;
    for (const auto& [k, v] : c.tokens_by_encoding) total += v;
    for (const auto& [k, v] : c.tokens_by_encoding) {
      parts.push_back(absl::StrFormat("%s %.0f%%", k, 100.0 * v / total));
    }
    return absl::StrJoin(parts, ", ");
  };
  std::string table_md =
      "| config | budget | window | bits/value (plan) | KV bytes (plan) | "
      "vs bf16 | worker bytes | ΔNLL all | ΔNLL assistant+tool-call | "
      "top-1 agree | KL(bf16‖cfg) | attn err mean | final plan mix (tokens) "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto row = [&](const Config& c) {
    const double ae = MeanAttnErr(c);
    table_md += absl::StrFormat(
        "| %s | %s | %d | %.3f | %d | %.3f | %d | %+.4f | %+.4f | %.4f | "
        "%.5f | %s | %s |\n",
        c.name, c.budget > 0 ? absl::StrFormat("%g", c.budget) : "-", c.window,
        bits(c, c.plan_bytes), c.plan_bytes,
        static_cast<double>(c.plan_bytes) / bf.plan_bytes, c.worker_bytes,
        dn(c), dnf(c), c.stats.top1(), c.stats.kl(),
        std::isnan(ae) ? "-" : absl::StrFormat("%.4f", ae), mix(c));
  };
  std::string main_rows = table_md, abl_rows = table_md;
  for (const Config& c : cfgs) {
    if (c.kind != "ablation") row(c);
  }
  main_rows = table_md;
  table_md = abl_rows;
  for (const Config& c : cfgs) {
    if (c.kind == "ablation" ||
        (c.kind == "triaxial" && c.budget == ab_budget &&
         c.window == (tri_windows.empty() ? 0u : tri_windows[0]))) {
      row(c);
    }
  }
  abl_rows = table_md;

  // Matched quality: per baseline and per triaxial window.
  std::string matched =
      "| baseline | its ΔNLL (asst+tool) | its KV vs bf16 | triaxial window "
      "| smallest triaxial budget with ΔNLL ≤ baseline | its ΔNLL | its KV "
      "vs bf16 | memory reduction vs bf16 | vs the baseline |\n"
      "|---|---|---|---|---|---|---|---|---|\n";
  for (size_t i = 1; i < cfgs.size(); ++i) {
    const Config& b = cfgs[i];
    if (b.kind != "baseline") continue;
    for (uint32_t w : tri_windows) {
      std::vector<SweepPoint> sweep;
      for (const Config& c : cfgs) {
        if (c.kind == "triaxial" && c.window == w) {
          sweep.push_back(
              {c.budget, dnf(c), static_cast<double>(c.plan_bytes)});
        }
      }
      const auto p = SmallestMatching(sweep, dnf(b));
      const double bratio = static_cast<double>(b.plan_bytes) / bf.plan_bytes;
      if (!p) {
        matched += absl::StrFormat(
            "| %s | %+.4f | %.3f | %d | none of the sweep | - | - | - | - |\n",
            b.name, dnf(b), bratio, w);
        continue;
      }
      matched += absl::StrFormat(
          "| %s | %+.4f | %.3f | %d | %g | %+.4f | %.3f | %.2fx | %.2fx |\n",
          b.name, dnf(b), bratio, w, p->budget_bits, p->dnll,
          p->kv_bytes / bf.plan_bytes, bf.plan_bytes / p->kv_bytes,
          b.plan_bytes / p->kv_bytes);
    }
  }

  const double total = Seconds(t_all);
  std::vector<std::string> notes;
  notes.reserve(sessions.size());
  for (const auto& s : sessions) notes.push_back(s.note);
  std::string md = absl::StrCat(
      "# Triaxial allocation policy vs uniform baselines (kvproxy-18m, "
      "held-out BFCL)\n\n",
      GeneratedBy("policy_bench", total), CommandBlock(command),
      "Sessions: ", absl::StrJoin(notes, "; "), ".\n\n",
      absl::StrFormat(
          "Calibration: `%s` (%d entries), put with `PutCalibration`; "
          "ablation tables `kvproxy-18m-no-<axis>` collapse one axis "
          "(token-weighted mean distortion over the tags that differ only "
          "in that axis).%s\n\n",
          absl::GetFlag(FLAGS_calibration), table.entries_size(),
          vacuous.empty()
              ? ""
              : absl::StrCat(" Vacuous (nothing to merge on this table, so "
                             "not run): ",
                             absl::StrJoin(vacuous, ", "), ".")),
      "## Results (summed over sessions)\n\n", main_rows,
      absl::StrFormat("\n## Ablations at %g bits\n\n", ab_budget), abl_rows,
      "\n## Memory at matched quality (ΔNLL on assistant + tool-call "
      "tokens)\n\n",
      matched, "\n");
  if (absl::Status st = EmitReport(md, absl::GetFlag(FLAGS_out)); !st.ok()) {
    return Fail("write report", st);
  }
  std::printf("total %.1f s\n", total);
  return 0;
}

}  // namespace
}  // namespace triax::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return triax::bench::Main(argc, argv);
}
