// policy_bench: the triaxial allocation policy (budget_bits + calibration
// table, solved by the manager per turn, blocks demoted as turns age)
// against uniform baselines (BF16, FP8, INT4, KIVI-style INT2 with a BF16
// residual window) on held-out BFCL sessions of kvproxy-18m, processed turn
// by turn through a real kvmanager and kvworker (started here). Also the
// ablations that collapse one tag axis of the calibration table, and the
// memory reduction against BF16 at matched quality. Writes a markdown report.
// Exit code 0 when the report was written, 1 on any failure.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
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
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/policy/policy_tables.h"
#include "bench/quality/quality_metrics.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/data_dir.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "client/frontend/service_kv_store.h"
#include "client/frontend/tee_kv_store.h"
#include "client/kv_client.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "google/protobuf/text_format.h"
#include "kernels/layout.h"
#include "tests/integration/cluster.h"

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
using frontend::ByteTokenizer;
using frontend::Model;
using frontend::RenderedConversation;
using frontend::RoleSpan;
using frontend::ServiceKvStore;
using frontend::SpanRole;
using frontend::TeeKvStore;
using frontend::Transformer;

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

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

v1::Span MakeSpan(SpanRole role, uint32_t n) {
  v1::Span s;
  s.set_role(static_cast<v1::Role>(role));
  s.set_modality(v1::MODALITY_TEXT);
  s.set_num_tokens(n);
  return s;
}

// One session: tokens from BOS, per turn the spans and the token range.
struct Session {
  std::string id, note;
  std::vector<int> tokens;
  std::vector<std::vector<v1::Span>> turn_spans;
  std::vector<std::pair<int64_t, int64_t>> turn_range;  // [first, end)
  std::vector<bool> focus;  // by token index: assistant or tool-call token
};

absl::StatusOr<Session> MakeSession(const BfclData& bfcl, const std::string& id,
                                    int max_context) {
  TRIAX_ASSIGN_OR_RETURN(RenderedConversation conv,
                         bfcl.Render(id, max_context - 1));
  ByteTokenizer bt;
  Session s;
  s.id = id;
  s.tokens = bt.Encode(conv.text, true);
  s.focus.assign(s.tokens.size(), false);
  for (size_t t = 0; t < conv.turns.size(); ++t) {
    const auto& turn = conv.turns[t];
    std::vector<v1::Span> spans;
    for (const RoleSpan& r : turn.spans) {
      spans.push_back(MakeSpan(
          r.role, static_cast<uint32_t>(r.length + (r.begin == 0 ? 1 : 0))));
      if (r.role == SpanRole::kToolCall || r.role == SpanRole::kAssistant) {
        for (size_t b = r.begin; b < r.begin + r.length; ++b) {
          s.focus[b + 1] = true;
        }
      }
    }
    s.turn_spans.push_back(std::move(spans));
    s.turn_range.push_back({t == 0 ? 0 : static_cast<int64_t>(turn.begin) + 1,
                            static_cast<int64_t>(turn.end) + 1});
  }
  int64_t focus = 0;
  for (bool f : s.focus) focus += f;
  s.note = absl::StrFormat(
      "%s (%d tokens, %d turns, %d assistant/tool-call tokens; %d/%d doc "
      "lines, %d/%d exchanges)",
      id, s.tokens.size(), conv.turns.size(), focus, conv.docs_kept,
      conv.docs_total, conv.turns_kept, conv.turns_total);
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

class Service {
 public:
  static absl::StatusOr<std::unique_ptr<Service>> Start(int pool_mb) {
    auto s = std::unique_ptr<Service>(new Service());
    testing::ClusterOptions o;
    o.num_workers = 1;
    o.pool_mb = pool_mb;
    o.window_tokens = 0;
    TRIAX_ASSIGN_OR_RETURN(s->cluster_, testing::Cluster::Start(o));
    TRIAX_RETURN_IF_ERROR(s->cluster_->CreateTenant(kTenant));
    TRIAX_ASSIGN_OR_RETURN(s->client_, s->cluster_->NewClient(kTenant));
    return s;
  }
  client::Client* client() { return client_.get(); }

  absl::Status PutPolicy(const v1::Policy& policy) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    v1::PutPolicyRequest req;
    req.set_request_id(client_->NewRequestId());
    *req.mutable_policy() = policy;
    v1::PutPolicyResponse resp;
    return FromGrpcStatus(client_->manager()->PutPolicy(&ctx, req, &resp));
  }
  absl::Status PutCalibration(const v1::CalibrationTable& table) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    v1::PutCalibrationRequest req;
    req.set_request_id(client_->NewRequestId());
    *req.mutable_table() = table;
    v1::PutCalibrationResponse resp;
    return FromGrpcStatus(client_->manager()->PutCalibration(&ctx, req, &resp));
  }
  absl::StatusOr<v1::Inventory> WorkerInventory(const std::string& address) {
    TRIAX_ASSIGN_OR_RETURN(v1::Worker::Stub * w, client_->worker(address));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    v1::Inventory inv;
    TRIAX_RETURN_IF_ERROR(
        FromGrpcStatus(w->GetInventory(&ctx, v1::GetInventoryRequest(), &inv)));
    return inv;
  }

 private:
  Service() = default;
  std::unique_ptr<testing::Cluster> cluster_;
  std::unique_ptr<client::Client> client_;
};

v1::ModelShape Shape(const Model& m) {
  v1::ModelShape s;
  s.set_name(kModel);
  s.set_n_layers(m.config.n_layers);
  s.set_n_kv_heads(m.config.n_kv_heads);
  s.set_n_q_heads(m.config.n_heads);
  s.set_head_dim(m.config.head_dim());
  return s;
}

class Runner {
 public:
  Runner(Service* svc, const Model* model, int chunk, int threads,
         int query_stride)
      : svc_(svc),
        model_(model),
        tf_(model, threads),
        chunk_(chunk),
        query_stride_(query_stride),
        shape_(Shape(*model)) {}

  absl::StatusOr<client::SequenceHandle> Open(const Session& s,
                                              const Config& c) {
    client::OpenOptions o;
    o.policy = c.policy;
    o.window_tokens = c.window;
    return svc_->client()->Open(shape_, s.turn_spans[0], o);
  }

  // Turn-by-turn forward of `s` with the KV in `c`'s policy; logits of every
  // position into *logits; final plan bytes into `c`.
  absl::Status RunConfig(const Session& s, Config* c,
                         std::vector<float>* logits) {
    const auto& mc = model_->config;
    TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle h, Open(s, *c));
    absl::Status st = [&]() -> absl::Status {
      ServiceKvStore kv(svc_->client(), &h, mc.n_kv_heads, mc.head_dim());
      logits->clear();
      std::vector<float> part;
      for (size_t t = 0; t < s.turn_spans.size(); ++t) {
        if (t > 0) {
          TRIAX_RETURN_IF_ERROR(
              svc_->client()->Extend(&h, s.turn_spans[t], /*new_turn=*/true,
                                     /*continue_last_span=*/false));
        }
        const auto [first, end] = s.turn_range[t];
        TRIAX_RETURN_IF_ERROR(tf_.Prefill(
            absl::MakeConstSpan(s.tokens).subspan(first, end - first), first,
            chunk_, &kv, &part));
        logits->insert(logits->end(), part.begin(), part.end());
      }
      TRIAX_ASSIGN_OR_RETURN(v1::Inventory inv,
                             svc_->WorkerInventory(h.worker_address));
      c->worker_bytes += inv.used_bytes();
      TRIAX_ASSIGN_OR_RETURN(v1::SequenceInfo info,
                             svc_->client()->GetSequence(h.sequence_id));
      for (const auto& b : info.blocks()) {
        kernels::PageShape ps;
        ps.tokens =
            static_cast<int>(b.capacity() ? b.capacity() : info.block_tokens());
        ps.heads = mc.n_kv_heads;
        ps.head_dim = mc.head_dim();
        const kernels::Encoding e = client::PlanEncoding(b);
        c->plan_bytes += kernels::PageBytes(e, ps) * mc.n_layers;
        c->tokens_by_encoding[client::EncodingLabel(e)] += b.num_tokens();
      }
      c->tokens += s.tokens.size();
      return absl::OkStatus();
    }();
    absl::Status close = svc_->client()->Close(h);
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
      for (auto& h : seqs) {
        stores.push_back(std::make_unique<ServiceKvStore>(
            svc_->client(), &h, mc.n_kv_heads, mc.head_dim()));
      }
      std::vector<frontend::KvStore*> secondaries;
      for (size_t i = 1; i < stores.size(); ++i) {
        secondaries.push_back(stores[i].get());
      }
      TeeKvStore tee(stores[0].get(), secondaries, mc.n_layers, mc.dim,
                     query_stride_);
      std::vector<float> part;
      for (size_t t = 0; t < s.turn_spans.size(); ++t) {
        if (t > 0) {
          for (auto& h : seqs) {
            TRIAX_RETURN_IF_ERROR(
                svc_->client()->Extend(&h, s.turn_spans[t], true, false));
          }
        }
        const auto [first, end] = s.turn_range[t];
        TRIAX_RETURN_IF_ERROR(tf_.Prefill(
            absl::MakeConstSpan(s.tokens).subspan(first, end - first), first,
            chunk_, &tee, &part));
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
      absl::Status c = svc_->client()->Close(h);
      if (close.ok()) close = c;
    }
    TRIAX_RETURN_IF_ERROR(st);
    return close;
  }

 private:
  Service* svc_;
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

std::string MachineLine() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return absl::StrFormat("%s, %d online CPUs, no GPU (kvworker CPU backend)",
                         model.empty() ? "unknown CPU" : model,
                         static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
}

int Main(int argc, char** argv) {
  const auto t_all = Clock::now();
  std::vector<std::string> args(argv, argv + argc);
  const std::string command = absl::StrJoin(args, " ");
  const std::string dir =
      frontend::ResolveDataDir(absl::GetFlag(FLAGS_data_dir));
  if (!frontend::DataDirComplete(dir)) {
    return Fail("data directory",
                absl::NotFoundError(
                    absl::StrCat("'", dir,
                                 "' lacks the models/text/bfcl files; pass "
                                 "--data_dir or set TRIAX_DATA_DIR")));
  }
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
  std::ifstream cal_in(absl::GetFlag(FLAGS_calibration));
  if (!cal_in) {
    return Fail("calibration", absl::NotFoundError(absl::StrCat(
                                   "cannot read --calibration = ",
                                   absl::GetFlag(FLAGS_calibration))));
  }
  std::stringstream cal_text;
  cal_text << cal_in.rdbuf();
  v1::CalibrationTable table;
  if (!google::protobuf::TextFormat::ParseFromString(cal_text.str(), &table)) {
    return Fail("calibration",
                absl::InvalidArgumentError(absl::StrCat(
                    absl::GetFlag(FLAGS_calibration),
                    " is not a text-format triax.v1.CalibrationTable")));
  }
  if (table.model() != kModel) {
    return Fail("calibration", absl::InvalidArgumentError(absl::StrCat(
                                   "table model is \"", table.model(),
                                   "\"; expected \"", kModel, "\"")));
  }
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

  if (const char* b = std::getenv("TRIAX_BIN_DIR"); b == nullptr || !*b) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
      self[n] = '\0';
      std::string path(self);
      setenv("TRIAX_BIN_DIR", path.substr(0, path.rfind('/')).c_str(), 1);
    }
  }
  auto svc_or = Service::Start(absl::GetFlag(FLAGS_pool_mb));
  if (!svc_or.ok()) return Fail("start kvmanager + kvworker", svc_or.status());
  Service* svc = svc_or->get();
  if (absl::Status s = svc->PutCalibration(table); !s.ok()) {
    return Fail("PutCalibration", s);
  }
  for (const auto& ab : ablations) {
    if (absl::Status s = svc->PutCalibration(ab.table); !s.ok()) {
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
      vacuous.push_back(TagAxisName(ab.axis));
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
    if (absl::Status s = svc->PutPolicy(p); !s.ok()) {
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
        return Fail("tee pass " + s.id, st);
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
      std::printf("[%s] tee pass: %.1f s\n", s.id.c_str(), Seconds(t0));
      std::fflush(stdout);
    }
    std::vector<float> ref, logits;
    for (size_t i = 0; i < cfgs.size(); ++i) {
      Config& c = cfgs[i];
      const auto t1 = Clock::now();
      if (absl::Status st = runner.RunConfig(s, &c, i == 0 ? &ref : &logits);
          !st.ok()) {
        return Fail(absl::StrCat(s.id, " ", c.name), st);
      }
      const std::vector<float>& mine = i == 0 ? ref : logits;
      NextTokenStats one;
      for (size_t t = 1; t < s.tokens.size(); ++t) {
        one.Add(&ref[(t - 1) * vocab], &mine[(t - 1) * vocab], vocab,
                s.tokens[t], s.focus[t]);
      }
      c.stats.Merge(one);
      c.seconds += Seconds(t1);
      std::printf("[%s] %-22s NLL %.4f focus %.4f KL %.5f (%.1f s)\n",
                  s.id.c_str(), c.name.c_str(), one.nll(), one.focus_nll(),
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
  char date[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::vector<std::string> notes;
  for (const auto& s : sessions) notes.push_back(s.note);
  std::string md = absl::StrCat(
      "# Triaxial allocation policy vs uniform baselines (kvproxy-18m, "
      "held-out BFCL)\n\n",
      absl::StrFormat("Generated by `policy_bench` on %s; machine: %s; run "
                      "time %.0f s.\n\nCommand:\n\n```\n%s\n```\n\n",
                      date, MachineLine(), total, command),
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
  std::printf("\n%s", md.c_str());
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::ofstream f(out, std::ios::binary | std::ios::trunc);
    f << md;
    f.close();
    if (!f) {
      return Fail("write report",
                  absl::InternalError(absl::StrCat("cannot write ", out)));
    }
    std::printf("report written to %s\n", out.c_str());
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
