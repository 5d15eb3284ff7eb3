// policy_bench: the triaxial allocation policy (budget_bits + calibration
// table, solved by the manager per turn, blocks demoted as turns age)
// against the uniform formats (BF16, FP8, INT8, INT4 g32/64/128, INT2 with
// and without a BF16 residual window, TQ4/3/2) on held-out BFCL sessions of
// kvproxy-18m, processed turn by turn through a real kvmanager and kvworker
// (started here), and the ablations that collapse one tag axis of the
// calibration table. Keeps per-(conversation, configuration) sums
// (--raw_out writes them as a shard), or builds the report from shards
// without running (--merge). Writes the frontier report (policy_report.h).
// Exit code 0 when the report was written, 1 on any failure or bad flag.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/policy/policy_report.h"
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
          "bench/results/calibration_kvproxy-18m-output.txtpb",
          "text-format triax.v1.CalibrationTable of kvproxy-18m (the "
          "output-metric one: --objectives=dnll needs it)");
ABSL_FLAG(std::string, bfcl_ids,
          "multi_turn_base_3,multi_turn_base_8,multi_turn_base_15,"
          "multi_turn_base_17,multi_turn_base_42,multi_turn_base_46,"
          "multi_turn_base_50,multi_turn_base_59,multi_turn_base_121,"
          "multi_turn_base_177,multi_turn_base_181",
          "held-out BFCL conversations of kvproxy-18m (README list only); "
          "one that does not render is skipped and listed in the report");
ABSL_FLAG(int, bfcl_max_context, 2048, "token budget per conversation");
ABSL_FLAG(std::string, configs, "all",
          "configurations to run, comma-separated names (bf16 always runs: "
          "it is the reference); \"all\": every one");
ABSL_FLAG(std::string, budgets, "2.5,3,3.5,4,4.5,5,5.5,6",
          "budget_bits of the triaxial policy sweep");
ABSL_FLAG(std::string, answer_weights, "0",
          "Policy.answer_weight values the triaxial sweep runs with, "
          "comma-separated (0: all positions only; w > 0 adds w x the "
          "answer-position distortion; needs an output-metric table); the "
          "first also sets the ablations'");
ABSL_FLAG(std::string, objectives, "dnll",
          "Policy.objective of the triaxial sweep, comma-separated: dnll "
          "(the table's next-token NLL increase; needs an output-metric "
          "table) or kl (its distortion). The first names the plain tri-B "
          "points and the ablations; the others add tri-B-<objective>");
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
ABSL_FLAG(std::string, raw_out, "",
          "shard file of per-(conversation, config) sums (tab-separated, "
          "bench/policy/policy_tables.h); rewritten after every run; with "
          "--merge, the merged shards");
ABSL_FLAG(std::string, merge, "",
          "comma-separated shard files: build the report from them and run "
          "nothing");
ABSL_FLAG(int, bootstrap, 2000, "bootstrap resamples of the intervals");
ABSL_FLAG(uint64_t, seed, 1, "bootstrap seed");

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
  std::string name;    // row label and --configs name
  std::string policy;  // policy registered with PutPolicy
  uint32_t window = 0;
  std::string kind;  // "uniform", "triaxial", "ablation"
  double budget = 0;
  std::string note;
};

// A rule policy with one catch-all rule: `f`, INT group `group` (0 for the
// other formats), FP16 scales.
v1::Policy RulePolicy(const std::string& name, v1::Format f, uint32_t group) {
  v1::Policy p;
  p.set_name(name);
  v1::PolicyRule* r = p.add_rules();
  r->set_format(f);
  if (group > 0) {
    r->set_group_size(group);
    r->set_scale_dtype(v1::SCALE_DTYPE_FP16);
  }
  return p;
}

v1::Policy AllocPolicy(const std::string& name, double budget,
                       const std::string& calibration_model,
                       double answer_weight, v1::Objective objective) {
  v1::Policy p;
  p.set_name(name);
  p.set_budget_bits(budget);
  p.set_calibration_model(calibration_model);
  p.set_answer_weight(answer_weight);
  p.set_objective(objective);
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
  // position into *logits; final plan bytes, worker bytes, token counts and
  // plan mix into `row`.
  absl::Status RunConfig(const Session& s, const Config& c, RawRow* row,
                         std::vector<float>* logits) {
    const auto& mc = model_->config;
    TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle h, Open(s, c));
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
      row->worker_bytes = inv.used_bytes();
      TRIAX_ASSIGN_OR_RETURN(v1::SequenceInfo info,
                             client_->GetSequence(h.sequence_id));
      for (const auto& b : info.blocks()) {
        kernels::PageShape ps;
        ps.tokens =
            static_cast<int>(b.capacity() ? b.capacity() : info.block_tokens());
        ps.heads = mc.n_kv_heads;
        ps.head_dim = mc.head_dim();
        const kernels::Encoding e = EncodingFromProto(b);
        row->plan_bytes += kernels::PageBytes(e, ps) * mc.n_layers;
        row->tokens_by_encoding[client::EncodingLabel(e)] += b.num_tokens();
      }
      row->seq_tokens = s.bfcl.tokens.size();
      row->values_per_token = 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim();
      return absl::OkStatus();
    }();
    absl::Status close = client_->Close(h);
    TRIAX_RETURN_IF_ERROR(st);
    return close;
  }

  // Teacher-forced attention error: a BF16 primary and one sequence per
  // config, all extended turn by turn (so the secondaries age and demote as
  // in a real session); (*attn)[j] receives config j's per-layer sums.
  absl::Status RunTee(const Session& s, const Config& bf16,
                      const std::vector<Config>& configs,
                      std::vector<std::vector<LayerErrSums>>* attn) {
    const auto& mc = model_->config;
    std::vector<client::SequenceHandle> seqs;
    absl::Status st = [&]() -> absl::Status {
      TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle p, Open(s, bf16));
      seqs.push_back(p);
      for (const Config& c : configs) {
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
      attn->assign(configs.size(), {});
      for (size_t j = 0; j < configs.size(); ++j) {
        for (int l = 0; l < mc.n_layers; ++l) {
          const auto& e = tee.error(static_cast<int>(j), l);
          (*attn)[j].push_back(
              {e.sum_sq_diff, e.sum_sq_ref, static_cast<int64_t>(e.queries)});
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

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "policy_bench: %s: %s\n", what.c_str(),
               s.ToString().c_str());
  return 1;
}

absl::Status FlagError(const std::string& flag, absl::string_view value,
                       const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": \"", value, "\" ", why));
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read \"", path, "\""));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) {
    return absl::InternalError(absl::StrCat("cannot write \"", path, "\""));
  }
  return absl::OkStatus();
}

// The sweep and ablation parameters of the flags.
struct Plan {
  std::vector<double> budgets;
  std::vector<uint32_t> tri_windows;
  std::vector<double> answer_weights;
  std::vector<std::pair<std::string, v1::Objective>> objectives;
  uint32_t kivi_window = 32;
  double ablation_budget = 3.5;
};

absl::StatusOr<Plan> ParsePlan() {
  Plan p;
  for (absl::string_view b :
       absl::StrSplit(absl::GetFlag(FLAGS_budgets), ',', absl::SkipEmpty())) {
    double v;
    if (!absl::SimpleAtod(b, &v) || !(v > 0) || v > 64) {
      return FlagError("budgets", b, "is not in (0, 64]");
    }
    p.budgets.push_back(v);
  }
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_tri_windows),
                                            ',', absl::SkipEmpty())) {
    uint32_t v;
    if (!absl::SimpleAtoi(w, &v) || v > 2048) {
      return FlagError("tri_windows", w, "is not a window in [0, 2048]");
    }
    p.tri_windows.push_back(v);
  }
  for (absl::string_view a : absl::StrSplit(absl::GetFlag(FLAGS_answer_weights),
                                            ',', absl::SkipEmpty())) {
    double v;
    if (!absl::SimpleAtod(a, &v) || !(v >= 0) || v > 1000) {
      return FlagError("answer_weights", a, "is not in [0, 1000]");
    }
    p.answer_weights.push_back(v);
  }
  if (p.answer_weights.empty()) {
    return FlagError("answer_weights", absl::GetFlag(FLAGS_answer_weights),
                     "names no weight (0: all positions only)");
  }
  for (absl::string_view o : absl::StrSplit(absl::GetFlag(FLAGS_objectives),
                                            ',', absl::SkipEmpty())) {
    if (o != "dnll" && o != "kl") {
      return FlagError("objectives", o, "is not dnll or kl");
    }
    for (const auto& have : p.objectives) {
      if (have.first == o) return FlagError("objectives", o, "is listed twice");
    }
    p.objectives.emplace_back(
        std::string(o), o == "dnll" ? v1::OBJECTIVE_DNLL : v1::OBJECTIVE_KL);
  }
  if (p.objectives.empty()) {
    return FlagError("objectives", absl::GetFlag(FLAGS_objectives),
                     "names no objective (dnll or kl)");
  }
  const int kivi = absl::GetFlag(FLAGS_kivi_window);
  if (kivi < 1 || kivi > 2048) {
    return FlagError("kivi_window", absl::StrCat(kivi),
                     "is not in [1, 2048] (INT2 without a window is \"int2\")");
  }
  p.kivi_window = static_cast<uint32_t>(kivi);
  p.ablation_budget = absl::GetFlag(FLAGS_ablation_budget);
  if (!(p.ablation_budget > 0) || p.ablation_budget > 64) {
    return FlagError("ablation_budget", absl::StrCat(p.ablation_budget),
                     "is not in (0, 64]");
  }
  return p;
}

// Every configuration of `plan`, in report order ([0] is bf16), and the
// policies they use. Ablations only for axes that merge something.
struct Ablation {
  TagAxis axis;
  v1::CalibrationTable table;
  int merged = 0;
};

void BuildConfigs(const Plan& plan, const std::vector<Ablation>& ablations,
                  std::vector<Config>* cfgs,
                  std::map<std::string, v1::Policy>* policies) {
  auto uniform = [&](const std::string& name, v1::Format f, uint32_t group,
                     uint32_t window, const std::string& note) {
    const std::string pol =
        absl::StrCat("pb-", absl::AsciiStrToLower(v1::Format_Name(f)),
                     group ? absl::StrCat("-g", group) : "");
    policies->emplace(pol, RulePolicy(pol, f, group));
    cfgs->push_back({name, pol, window, "uniform", 0, note});
  };
  uniform("bf16", v1::FORMAT_BF16, 0, 0, "reference");
  uniform("fp8", v1::FORMAT_FP8_E4M3, 0, 0, "FP8 E4M3, f32 scale per head");
  uniform("int8", v1::FORMAT_INT8, 32, 0, "INT8 g32, FP16 scales");
  uniform("int4", v1::FORMAT_INT4, 32, 0, "INT4 g32, FP16 scales");
  uniform("int4-g64", v1::FORMAT_INT4, 64, 0, "INT4 g64, FP16 scales");
  uniform("int4-g128", v1::FORMAT_INT4, 128, 0, "INT4 g128, FP16 scales");
  uniform("int2", v1::FORMAT_INT2, 32, 0, "INT2 g32, FP16 scales, no window");
  uniform("kivi2", v1::FORMAT_INT2, 32, plan.kivi_window,
          absl::StrFormat("INT2 g32 + %d-token BF16 window (KIVI-2)",
                          plan.kivi_window));
  uniform("tq4", v1::FORMAT_TQ4, 0, 0, "TQ4 (rotated, Lloyd-Max)");
  uniform("tq3", v1::FORMAT_TQ3, 0, 0, "TQ3 (rotated, Lloyd-Max)");
  uniform("tq2", v1::FORMAT_TQ2, 0, 0, "TQ2 (rotated, Lloyd-Max)");
  for (size_t oi = 0; oi < plan.objectives.size(); ++oi) {
    const auto& [oname, objective] = plan.objectives[oi];
    for (uint32_t w : plan.tri_windows) {
      for (double aw : plan.answer_weights) {
        for (double b : plan.budgets) {
          std::string pol = absl::StrFormat("tri-%g", b);
          if (aw > 0) absl::StrAppendFormat(&pol, "-a%g", aw);
          if (oi > 0) absl::StrAppend(&pol, "-", oname);
          policies->emplace(pol, AllocPolicy(pol, b, kModel, aw, objective));
          std::vector<std::string> note = {absl::StrCat("objective ", oname)};
          if (w) note.push_back(absl::StrFormat("%d-token BF16 window", w));
          if (aw > 0) note.push_back(absl::StrFormat("answer_weight %g", aw));
          cfgs->push_back({w ? absl::StrFormat("%s-w%d", pol, w) : pol, pol, w,
                           "triaxial", b, absl::StrJoin(note, ", ")});
        }
      }
    }
  }
  const uint32_t ab_window = plan.tri_windows.empty() ? 0 : plan.tri_windows[0];
  for (const Ablation& ab : ablations) {
    if (ab.merged == 0) continue;
    const std::string pol = absl::StrFormat(
        "tri-%g-no-%s", plan.ablation_budget, TagAxisName(ab.axis));
    policies->emplace(
        pol, AllocPolicy(pol, plan.ablation_budget, ab.table.model(),
                         plan.answer_weights[0], plan.objectives[0].second));
    cfgs->push_back(
        {ab_window ? absl::StrFormat("%s-w%d", pol, ab_window) : pol, pol,
         ab_window, "ablation", plan.ablation_budget,
         absl::StrFormat("%d tag groups merged", ab.merged)});
  }
}

// --configs: "all" or names of `all` (bf16 added first when missing).
absl::StatusOr<std::vector<Config>> SelectConfigs(
    const std::vector<Config>& all, const std::string& spec) {
  if (spec == "all") return all;
  std::set<std::string> want;
  for (absl::string_view n : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    bool known = false;
    for (const Config& c : all) known |= c.name == n;
    if (!known) {
      std::vector<std::string> names;
      for (const Config& c : all) names.push_back(c.name);
      return FlagError("configs", n,
                       absl::StrCat("is not a configuration of this run; use "
                                    "\"all\" or some of: ",
                                    absl::StrJoin(names, ",")));
    }
    want.insert(std::string(n));
  }
  if (want.empty()) {
    return FlagError("configs", spec, "names no configuration");
  }
  std::vector<Config> out;
  for (const Config& c : all) {
    if (c.name == "bf16" || want.count(c.name)) out.push_back(c);
  }
  return out;
}

// Reads and merges the --merge shards.
absl::StatusOr<RawShard> MergeFiles(const std::string& spec,
                                    std::vector<std::string>* files) {
  std::vector<RawShard> shards;
  for (absl::string_view f : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    files->emplace_back(f);
    auto text = ReadFile(files->back());
    if (!text.ok()) {
      return FlagError("merge", f, std::string(text.status().message()));
    }
    TRIAX_ASSIGN_OR_RETURN(RawShard s, ParseRaw(*text, files->back()));
    shards.push_back(std::move(s));
  }
  if (shards.empty()) return FlagError("merge", spec, "names no file");
  return MergeRaw(shards);
}

// Runs every configuration on every session; rows (and skipped sessions)
// into *shard, rewritten to `raw_out` after every row when not empty.
absl::Status RunAll(const std::vector<Ablation>& ablations,
                    const v1::CalibrationTable& table,
                    const std::vector<Config>& cfgs,
                    const std::map<std::string, v1::Policy>& policies,
                    const std::string& raw_out, RawShard* shard) {
  const std::string dir_flag = absl::GetFlag(FLAGS_data_dir);
  TRIAX_ASSIGN_OR_RETURN(const std::string dir, CompleteDataDir(dir_flag));
  auto m = frontend::LoadModel(dir + "/models/kvproxy-18m/model.bin");
  if (!m.ok()) return m.status();
  (*m)->name = kModel;
  const auto& mc = (*m)->config;
  TRIAX_ASSIGN_OR_RETURN(BfclData bfcl, BfclData::Load(dir));
  std::vector<Session> sessions;
  for (absl::string_view id :
       absl::StrSplit(absl::GetFlag(FLAGS_bfcl_ids), ',', absl::SkipEmpty())) {
    auto s = MakeSession(bfcl, std::string(id),
                         absl::GetFlag(FLAGS_bfcl_max_context));
    if (!s.ok()) {
      std::printf("skip %s: %s\n", std::string(id).c_str(),
                  s.status().ToString().c_str());
      std::fflush(stdout);
      shard->skipped.emplace_back(std::string(id),
                                  std::string(s.status().message()));
      continue;
    }
    std::printf("session %s\n", s->note.c_str());
    std::fflush(stdout);
    shard->sessions.emplace_back(s->bfcl.id, s->note);
    sessions.push_back(std::move(*s));
  }
  if (sessions.empty()) {
    return absl::FailedPreconditionError(
        "no --bfcl_ids conversation renders; nothing to run");
  }

  DefaultBinDirToSelf();
  TRIAX_ASSIGN_OR_RETURN(
      BenchCluster svc_holder,
      StartBenchCluster(OneWorkerOptions(absl::GetFlag(FLAGS_pool_mb)),
                        kTenant));
  client::Client* svc = svc_holder.client.get();
  TRIAX_RETURN_IF_ERROR(PutCalibration(svc, table));
  for (const auto& ab : ablations) {
    TRIAX_RETURN_IF_ERROR(PutCalibration(svc, ab.table));
  }
  std::set<std::string> used;
  for (const Config& c : cfgs) used.insert(c.policy);
  for (const auto& [name, p] : policies) {
    if (used.count(name)) TRIAX_RETURN_IF_ERROR(PutPolicy(svc, p));
  }
  std::printf("policy_bench: %zu configurations, %zu policies, %zu sessions\n",
              cfgs.size(), used.size(), sessions.size());
  std::fflush(stdout);

  Runner runner(svc, m->get(), absl::GetFlag(FLAGS_chunk),
                absl::GetFlag(FLAGS_threads),
                absl::GetFlag(FLAGS_query_stride));
  for (const Session& s : sessions) {
    std::vector<std::vector<LayerErrSums>> attn;
    if (absl::GetFlag(FLAGS_attention_error) && cfgs.size() > 1) {
      const auto t0 = Clock::now();
      std::vector<Config> others(cfgs.begin() + 1, cfgs.end());
      TRIAX_RETURN_IF_ERROR(runner.RunTee(s, cfgs[0], others, &attn));
      std::printf("[%s] tee pass: %.1f s\n", s.bfcl.id.c_str(), Seconds(t0));
      std::fflush(stdout);
    }
    std::vector<float> ref, logits;
    for (size_t i = 0; i < cfgs.size(); ++i) {
      const Config& c = cfgs[i];
      RawRow row;
      row.conversation = s.bfcl.id;
      row.config = c.name;
      row.kind = c.kind;
      row.budget = c.budget;
      row.window = c.window;
      row.note = c.note;
      const auto t1 = Clock::now();
      absl::Status st = runner.RunConfig(s, c, &row, i == 0 ? &ref : &logits);
      if (!st.ok()) {
        return absl::Status(st.code(), absl::StrCat(s.bfcl.id, " ", c.name,
                                                    ": ", st.message()));
      }
      NextTokenStats one;
      TRIAX_RETURN_IF_ERROR(one.AddSequence(ref, i == 0 ? ref : logits,
                                            mc.vocab_size, s.bfcl.tokens,
                                            s.bfcl.focus));
      row.count = one.count;
      row.nll_sum = one.nll_sum;
      row.answer_count = one.focus_count;
      row.answer_nll_sum = one.focus_nll_sum;
      row.kl_sum = one.kl_sum;
      row.top1_agree = one.top1_agree;
      if (i > 0 && i - 1 < attn.size()) row.attn = attn[i - 1];
      row.seconds = Seconds(t1);
      std::printf("[%s] %-22s NLL %.4f answer %.4f KL %.5f (%.1f s)\n",
                  s.bfcl.id.c_str(), c.name.c_str(), one.nll(), one.focus_nll(),
                  one.kl(), row.seconds);
      std::fflush(stdout);
      shard->rows.push_back(std::move(row));
      if (!raw_out.empty()) {
        TRIAX_RETURN_IF_ERROR(WriteFile(raw_out, FormatRaw(*shard)));
      }
    }
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  const auto t_all = Clock::now();
  std::vector<std::string> args(argv, argv + argc);
  const std::string command = absl::StrJoin(args, " ");
  const int chunk = absl::GetFlag(FLAGS_chunk);
  if (chunk < 1 || chunk > 256) {
    return Fail("flags",
                FlagError("chunk", absl::StrCat(chunk), "is not in 1..256"));
  }
  const int resamples = absl::GetFlag(FLAGS_bootstrap);
  if (resamples < 1 || resamples > 1000000) {
    return Fail("flags", FlagError("bootstrap", absl::StrCat(resamples),
                                   "is not in 1..1000000"));
  }
  for (absl::string_view id :
       absl::StrSplit(absl::GetFlag(FLAGS_bfcl_ids), ',', absl::SkipEmpty())) {
    if (!HeldOutBfcl().count(std::string(id))) {
      return Fail("flags",
                  FlagError("bfcl_ids", id,
                            absl::StrCat("is not a held-out conversation of "
                                         "kvproxy-18m; use some of: ",
                                         absl::StrJoin(HeldOutBfcl(), ","))));
    }
  }
  auto plan = ParsePlan();
  if (!plan.ok()) return Fail("flags", plan.status());
  const std::string raw_out = absl::GetFlag(FLAGS_raw_out);
  const std::string merge = absl::GetFlag(FLAGS_merge);

  ReportOptions ro;
  ro.resamples = resamples;
  ro.seed = absl::GetFlag(FLAGS_seed);
  ro.ablation_budget = plan->ablation_budget;
  std::string preface;
  RawShard shard;
  if (!merge.empty()) {
    std::vector<std::string> files;
    auto merged = MergeFiles(merge, &files);
    if (!merged.ok()) return Fail("merge", merged.status());
    shard = std::move(*merged);
    if (!raw_out.empty()) {
      if (absl::Status st = WriteFile(raw_out, FormatRaw(shard)); !st.ok()) {
        return Fail("raw_out", st);
      }
    }
    preface = absl::StrFormat("Merged from %d shard(s): %s (%d rows).\n\n",
                              files.size(), absl::StrJoin(files, ", "),
                              shard.rows.size());
  } else {
    auto table_or =
        ReadCalibrationTable(absl::GetFlag(FLAGS_calibration), kModel);
    if (!table_or.ok()) return Fail("calibration", table_or.status());
    const v1::CalibrationTable& table = *table_or;
    if (!absl::StartsWith(table.source().metric(), "output-kl")) {
      for (const auto& [name, objective] : plan->objectives) {
        if (objective != v1::OBJECTIVE_DNLL) continue;
        return Fail(
            "flags",
            FlagError(
                "objectives", name,
                absl::StrCat("needs an output-metric table; ",
                             absl::GetFlag(FLAGS_calibration), " has metric \"",
                             table.source().metric().substr(0, 40),
                             "...\" (use --objectives=kl)")));
      }
    }
    std::vector<Ablation> ablations;
    std::vector<std::string> vacuous;
    for (TagAxis a : {TagAxis::kTemporal, TagAxis::kRole, TagAxis::kModality}) {
      Ablation ab;
      ab.axis = a;
      auto t = CollapseAxis(
          table, a, absl::StrCat(kModel, "-no-", TagAxisName(a)), &ab.merged);
      if (!t.ok()) return Fail("ablation table", t.status());
      ab.table = std::move(*t);
      if (ab.merged == 0) vacuous.emplace_back(TagAxisName(a));
      ablations.push_back(std::move(ab));
    }
    shard.notes.emplace_back(
        "Calibration",
        absl::StrFormat(
            "`%s` (%d entries), put with `PutCalibration`; "
            "ablation tables `kvproxy-18m-no-<axis>` collapse one axis "
            "(token-weighted mean distortion over the tags that differ only in "
            "that axis).%s",
            absl::GetFlag(FLAGS_calibration), table.entries_size(),
            vacuous.empty()
                ? ""
                : absl::StrCat(
                      " Vacuous (nothing to merge on this table, so not "
                      "run): ",
                      absl::StrJoin(vacuous, ", "), ".")));
    shard.notes.emplace_back(
        "Run settings",
        absl::StrFormat("context %d tokens, prefill chunk %d, attention "
                        "error %s (query stride %d), kvworker pool %d MiB",
                        absl::GetFlag(FLAGS_bfcl_max_context), chunk,
                        absl::GetFlag(FLAGS_attention_error) ? "on" : "off",
                        absl::GetFlag(FLAGS_query_stride),
                        absl::GetFlag(FLAGS_pool_mb)));
    std::vector<Config> all;
    std::map<std::string, v1::Policy> policies;
    BuildConfigs(*plan, ablations, &all, &policies);
    auto cfgs = SelectConfigs(all, absl::GetFlag(FLAGS_configs));
    if (!cfgs.ok()) return Fail("flags", cfgs.status());
    if (absl::Status st =
            RunAll(ablations, table, *cfgs, policies, raw_out, &shard);
        !st.ok()) {
      return Fail("run", st);
    }
  }
  auto body = BuildReport(shard, ro);
  if (!body.ok()) return Fail("report", body.status());
  const double total = Seconds(t_all);
  const std::string md = absl::StrCat(
      "# Triaxial allocation policy vs the uniform formats (kvproxy-18m, "
      "held-out BFCL)\n\n",
      GeneratedBy("policy_bench", total), CommandBlock(command), preface,
      *body);
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
