// quality_bench: next-token and attention-output quality of every KV
// encoding on real llama2.c models, with the KV held by a real kvmanager and
// kvworker (started here, from the binaries next to this one), and a
// markdown report. Not a test: a program that measures and writes numbers.
//
// Per model, dataset and configuration (bench/quality/quality_metrics.h):
//   1. a teacher-forced "tee" pass: the forward pass runs on a BF16 sequence
//      (policy q-bf16); at each layer the same K/V is also written to one
//      sequence per configuration and Attend runs there with the same
//      queries (sampled every --query_stride positions); relative L2 error of
//      the attention outputs per layer. Its logits are the reference.
//   2. a local fp32 pass (LocalKvStore): the reference row.
//   3. one pass per configuration with the KV in its policy: NLL, dNLL vs
//      bf16, top-1 agreement and KL(P_bf16 || P_cfg); bytes of the plan and
//      of the worker's pool after the window's prefill.
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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
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
ABSL_FLAG(std::string, models, "stories260k,kvproxy-18m",
          "comma-separated: stories260k, kvproxy-18m");
ABSL_FLAG(int, stories_chars, 10000,
          "characters of tinystories_val.txt (from the start) for "
          "stories260k, in 256-token windows with BOS");
ABSL_FLAG(std::string, stories_bfcl_ids, "multi_turn_base_42",
          "BFCL conversations for stories260k (rendered in ChatML, cut to "
          "--stories_bfcl_bytes, llama2.c BPE tokens, 256-token windows with "
          "BOS); empty: none. Out of domain for a TinyStories model: it "
          "measures how each encoding treats KV of unfamiliar text");
ABSL_FLAG(int, stories_bfcl_bytes, 4096,
          "byte budget of each rendered conversation for stories260k");
ABSL_FLAG(std::string, stories_configs, "all",
          "configurations on stories260k: all, core or a comma list");
ABSL_FLAG(std::string, kvproxy_configs, "core",
          "configurations on kvproxy-18m: all, core or a comma list");
ABSL_FLAG(int, kvproxy_text_bytes, 1023,
          "bytes of each held-out text range (TinyStories from byte 754894, "
          "WikiText-2 from byte 1223534) for kvproxy-18m; 0 skips the text");
ABSL_FLAG(int, kvproxy_window, 1024,
          "tokens per kvproxy-18m text window including BOS (2..2048)");
ABSL_FLAG(std::string, bfcl_ids, "multi_turn_base_42",
          "held-out BFCL conversations for kvproxy-18m (README list only); "
          "empty skips BFCL");
ABSL_FLAG(int, bfcl_max_context, 2048,
          "token budget per BFCL conversation (the converter keeps whole doc "
          "lines and exchanges that fit)");
ABSL_FLAG(int, chunk, 64, "prefill chunk: tokens per forward call (1..256)");
ABSL_FLAG(int, threads, 2, "threads for the matrix products");
ABSL_FLAG(int, query_stride, 4,
          "attention error: queries at positions divisible by this (and each "
          "chunk's last) are compared");
ABSL_FLAG(int, block_tokens, 0, "tokens per block; 0: the manager default");
ABSL_FLAG(int, pool_mb, 1024, "kvworker --pool_mb");
ABSL_FLAG(std::string, out, "",
          "markdown report path; empty: print the report only");

namespace triax::bench {
namespace {

using frontend::BfclData;
using frontend::ByteTokenizer;
using frontend::LocalKvStore;
using frontend::Model;
using frontend::ModelConfig;
using frontend::RenderedConversation;
using frontend::ServiceKvStore;
using frontend::TeeKvStore;
using frontend::Transformer;

using Clock = std::chrono::steady_clock;

// The held-out BFCL conversations of models/kvproxy-18m/README.md (the base
// file; the long_context twins share their user turns).
const std::set<std::string>& HeldOutBfcl() {
  static const auto* ids = new std::set<std::string>{
      "multi_turn_base_3",   "multi_turn_base_8",  "multi_turn_base_15",
      "multi_turn_base_17",  "multi_turn_base_42", "multi_turn_base_46",
      "multi_turn_base_50",  "multi_turn_base_59", "multi_turn_base_121",
      "multi_turn_base_177", "multi_turn_base_181"};
  return *ids;
}
constexpr size_t kTinyStoriesHeldOut = 754894;
constexpr size_t kWikiTextHeldOut = 1223534;

// One forward window: tokens from BOS, the span structure the manager gets,
// and the positions counted in the "focus" NLL.
struct Window {
  std::vector<int> tokens;
  std::vector<v1::Span> spans;
  std::vector<bool> focus;  // by token index (predicted from index - 1)
};

struct Dataset {
  std::string name;    // "tinystories", "wikitext2", "bfcl"
  std::string source;  // what exactly was read
  std::vector<Window> windows;
  bool has_focus = false;
  int64_t predicted() const {
    int64_t n = 0;
    for (const auto& w : windows)
      n += static_cast<int64_t>(w.tokens.size()) - 1;
    return n;
  }
};

Window TextWindow(std::vector<int> tokens) {
  Window w;
  w.spans = {
      frontend::ServiceSpan(Role::kUser, static_cast<uint32_t>(tokens.size()))};
  w.focus.assign(tokens.size(), false);
  w.tokens = std::move(tokens);
  return w;
}

// Windows of `window` tokens: BOS + (window - 1) new ids each.
std::vector<Window> SplitWindows(const std::vector<int>& ids, int bos,
                                 int window) {
  std::vector<Window> out;
  const size_t step = static_cast<size_t>(window - 1);
  for (size_t off = 0; off < ids.size(); off += step) {
    std::vector<int> t = {bos};
    for (size_t i = off; i < std::min(ids.size(), off + step); ++i) {
      t.push_back(ids[i]);
    }
    if (t.size() >= 2) out.push_back(TextWindow(std::move(t)));
  }
  return out;
}

v1::Policy ToPolicy(const QualityConfig& c) {
  v1::Policy p;
  p.set_name(c.policy());
  if (c.sink) {
    v1::PolicyRule* r = p.add_rules();
    r->set_temporal(v1::TEMPORAL_SINK);
    r->set_format(v1::FORMAT_BF16);
  }
  v1::PolicyRule* r = p.add_rules();
  r->set_format(static_cast<v1::Format>(c.enc.k));
  if (c.enc.v != c.enc.k) r->set_format_v(static_cast<v1::Format>(c.enc.v));
  if (kernels::IsIntFormat(c.enc.k) || kernels::IsIntFormat(c.enc.v)) {
    r->set_group_size(static_cast<uint32_t>(c.enc.Group()));
    if (c.enc.scale_dtype == kernels::ScaleDtype::kFP8) {
      r->set_scale_dtype(v1::SCALE_DTYPE_FP8_E4M3);
    }
  }
  return p;
}

// The service: a private kvmanager + kvworker, one tenant, one client.
class Service {
 public:
  static absl::StatusOr<std::unique_ptr<Service>> Start(int pool_mb) {
    auto s = std::unique_ptr<Service>(new Service());
    // window_tokens 0: every sequence names its own window.
    TRIAX_ASSIGN_OR_RETURN(
        s->bench_, StartBenchCluster(OneWorkerOptions(pool_mb), kTenant));
    return s;
  }
  client::Client* client() { return bench_.client.get(); }
  std::string manager_address() const {
    return bench_.cluster->manager_address();
  }

  absl::Status PutPolicy(const v1::Policy& policy) {
    return bench::PutPolicy(client(), policy);
  }

  // Client::Open with the sequence's own BF16 window
  // (AllocatePagesRequest.window_tokens).
  absl::StatusOr<client::SequenceHandle> Open(
      const v1::ModelShape& model, const std::vector<v1::Span>& spans,
      const std::string& policy, uint32_t window, uint32_t block_tokens) {
    client::OpenOptions o;
    o.policy = policy;
    o.block_tokens = block_tokens;
    o.window_tokens = window;
    return client()->Open(model, spans, o);
  }

  absl::StatusOr<v1::Inventory> WorkerInventory(const std::string& address) {
    return bench::WorkerInventory(client(), address);
  }

  static constexpr const char* kTenant = "quality";

 private:
  Service() = default;
  BenchCluster bench_;
};

// Results of one configuration on one dataset.
struct ConfigResult {
  std::string name;
  std::string encoding;
  bool sink = false;
  uint32_t window = 0;
  bool ran = false;
  std::string skipped;  // why not run
  double bits_nominal = 0;
  uint64_t plan_bytes = 0, charged_bytes = 0, worker_bytes = 0,
           window_bytes = 0, tokens = 0;
  NextTokenStats stats;
  std::vector<TeeKvStore::LayerError> attn;  // [layer], summed over windows
  double seconds = 0;
};

struct DatasetResult {
  std::string model, dataset, source;
  int64_t windows = 0, predicted = 0, focus = 0;
  bool has_focus = false;
  ConfigResult fp32;
  std::vector<ConfigResult> configs;  // [0] is bf16
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
};

double RelErr(const TeeKvStore::LayerError& e) {
  return e.queries && e.sum_sq_ref > 0 ? std::sqrt(e.sum_sq_diff / e.sum_sq_ref)
                                       : 0.0;
}

absl::Status AddStats(const std::vector<float>& ref,
                      const std::vector<float>& logits, const Window& w,
                      int vocab, NextTokenStats* s) {
  return s->AddSequence(ref, logits, vocab, w.tokens, w.focus);
}

class Runner {
 public:
  Runner(Service* svc, int chunk, int threads, int query_stride,
         int block_tokens)
      : svc_(svc),
        chunk_(chunk),
        threads_(threads),
        query_stride_(query_stride),
        block_tokens_(block_tokens) {}

  absl::StatusOr<DatasetResult> Run(const Model& model, const Dataset& data,
                                    const std::vector<QualityConfig>& configs,
                                    const std::string& progress_prefix) {
    const ModelConfig& mc = model.config;
    const int vocab = mc.vocab_size;
    const v1::ModelShape shape = frontend::ServiceShape(model);
    Transformer tf(&model, threads_);
    DatasetResult r;
    r.model = model.name;
    r.dataset = data.name;
    r.source = data.source;
    r.windows = static_cast<int64_t>(data.windows.size());
    r.predicted = data.predicted();
    r.has_focus = data.has_focus;
    r.n_layers = mc.n_layers;
    r.n_kv_heads = mc.n_kv_heads;
    r.head_dim = mc.head_dim();
    for (const auto& w : data.windows) {
      for (size_t t = 1; t < w.focus.size(); ++t) r.focus += w.focus[t];
    }
    kernels::PageShape ps;
    ps.tokens = block_tokens_ > 0 ? block_tokens_ : 16;
    ps.heads = mc.n_kv_heads;
    ps.head_dim = mc.head_dim();
    std::vector<int> runnable;  // indices into configs
    for (size_t i = 0; i < configs.size(); ++i) {
      ConfigResult c;
      c.name = configs[i].name;
      c.encoding = client::EncodingLabel(configs[i].enc);
      c.sink = configs[i].sink;
      c.window = configs[i].window;
      c.attn.resize(mc.n_layers);
      if (const char* why = kernels::ValidateEncoding(configs[i].enc, ps)) {
        c.skipped = why;
      } else {
        c.bits_nominal = kernels::EffectiveBits(configs[i].enc, ps);
        runnable.push_back(static_cast<int>(i));
      }
      r.configs.push_back(std::move(c));
    }
    if (runnable.empty() || runnable[0] != 0 || configs[0].name != "bf16") {
      return absl::FailedPreconditionError(
          "the bf16 configuration must come first and be valid");
    }
    const auto t_data = Clock::now();

    // 1. Tee pass: reference logits and attention errors.
    std::vector<std::vector<float>> ref(data.windows.size());
    {
      const auto t0 = Clock::now();
      for (size_t wi = 0; wi < data.windows.size(); ++wi) {
        const Window& w = data.windows[wi];
        std::vector<client::SequenceHandle> seqs;
        absl::Status st = [&]() -> absl::Status {
          // seqs[0]: the primary (bf16); then one per runnable config.
          seqs.reserve(runnable.size() + 1);
          TRIAX_ASSIGN_OR_RETURN(
              auto primary, svc_->Open(shape, w.spans, configs[0].policy(), 0,
                                       block_tokens_));
          seqs.push_back(primary);
          for (int ci : runnable) {
            TRIAX_ASSIGN_OR_RETURN(
                auto h, svc_->Open(shape, w.spans, configs[ci].policy(),
                                   configs[ci].window, block_tokens_));
            seqs.push_back(h);
          }
          std::vector<std::unique_ptr<ServiceKvStore>> stores;
          std::vector<frontend::KvStore*> secondaries;
          stores.reserve(seqs.size());
          for (auto& h : seqs) {
            stores.push_back(std::make_unique<ServiceKvStore>(
                svc_->client(), &h, mc.n_kv_heads, mc.head_dim()));
          }
          for (size_t i = 1; i < stores.size(); ++i) {
            secondaries.push_back(stores[i].get());
          }
          TeeKvStore tee(stores[0].get(), secondaries, mc.n_layers, mc.dim,
                         query_stride_);
          TRIAX_RETURN_IF_ERROR(
              tf.Prefill(w.tokens, 0, chunk_, &tee, &ref[wi]));
          for (size_t j = 0; j < runnable.size(); ++j) {
            auto& attn = r.configs[runnable[j]].attn;
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
        TRIAX_RETURN_IF_ERROR(close);
      }
      std::printf("%s tee pass (bf16 + %zu copies): %.1f s\n",
                  progress_prefix.c_str(), runnable.size(), Seconds(t0));
      std::fflush(stdout);
    }

    // 2. Local fp32.
    {
      const auto t0 = Clock::now();
      r.fp32.name = "fp32 (local)";
      r.fp32.encoding = "fp32";
      r.fp32.ran = true;
      r.fp32.bits_nominal = 32;
      std::vector<float> logits;
      for (size_t wi = 0; wi < data.windows.size(); ++wi) {
        LocalKvStore kv(mc);
        TRIAX_RETURN_IF_ERROR(
            tf.Prefill(data.windows[wi].tokens, 0, chunk_, &kv, &logits));
        TRIAX_RETURN_IF_ERROR(
            AddStats(ref[wi], logits, data.windows[wi], vocab, &r.fp32.stats));
        r.fp32.tokens += data.windows[wi].tokens.size();
      }
      r.fp32.plan_bytes = r.fp32.worker_bytes =
          r.fp32.tokens * 2ull * mc.n_layers * mc.kv_dim() * 4;
      r.fp32.seconds = Seconds(t0);
      std::printf("%s fp32 local: NLL %.4f (%.1f s)\n", progress_prefix.c_str(),
                  r.fp32.stats.nll(), r.fp32.seconds);
      std::fflush(stdout);
    }

    // 3. One pass per configuration.
    for (size_t j = 0; j < runnable.size(); ++j) {
      const QualityConfig& cfg = configs[runnable[j]];
      ConfigResult& cr = r.configs[runnable[j]];
      const auto t0 = Clock::now();
      std::vector<float> logits;
      for (size_t wi = 0; wi < data.windows.size(); ++wi) {
        const Window& w = data.windows[wi];
        TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle h,
                               svc_->Open(shape, w.spans, cfg.policy(),
                                          cfg.window, block_tokens_));
        absl::Status st = [&]() -> absl::Status {
          ServiceKvStore kv(svc_->client(), &h, mc.n_kv_heads, mc.head_dim());
          TRIAX_RETURN_IF_ERROR(tf.Prefill(w.tokens, 0, chunk_, &kv, &logits));
          // Only this sequence is open now: the worker's pool bytes are its.
          TRIAX_ASSIGN_OR_RETURN(v1::Inventory inv,
                                 svc_->WorkerInventory(h.worker_address));
          cr.worker_bytes += inv.used_bytes();
          cr.window_bytes += inv.window_bytes();
          TRIAX_ASSIGN_OR_RETURN(v1::SequenceInfo info,
                                 svc_->client()->GetSequence(h.sequence_id));
          cr.charged_bytes += info.bytes();
          for (const auto& b : info.blocks()) {
            kernels::PageShape bs = ps;
            bs.tokens = static_cast<int>(b.capacity() ? b.capacity()
                                                      : info.block_tokens());
            cr.plan_bytes +=
                kernels::PageBytes(EncodingFromProto(b), bs) * mc.n_layers;
          }
          return absl::OkStatus();
        }();
        absl::Status close = svc_->client()->Close(h);
        TRIAX_RETURN_IF_ERROR(st);
        TRIAX_RETURN_IF_ERROR(close);
        TRIAX_RETURN_IF_ERROR(AddStats(ref[wi], logits, w, vocab, &cr.stats));
        cr.tokens += w.tokens.size();
      }
      cr.ran = true;
      cr.seconds = Seconds(t0);
      std::printf(
          "%s [%zu/%zu] %-22s NLL %.4f dNLL %+.4f top1 %.4f KL %.5f "
          "(%.1f s, %.0f s in dataset)\n",
          progress_prefix.c_str(), j + 1, runnable.size(), cfg.name.c_str(),
          cr.stats.nll(), cr.stats.nll() - r.configs[0].stats.nll(),
          cr.stats.top1(), cr.stats.kl(), cr.seconds, Seconds(t_data));
      std::fflush(stdout);
    }
    return r;
  }

 private:
  Service* svc_;
  int chunk_, threads_, query_stride_, block_tokens_;
};

std::string Table(const DatasetResult& d) {
  const ConfigResult& bf16 = d.configs[0];
  std::string s = absl::StrFormat(
      "### %s / %s\n\n%s; %d windows, %d predicted tokens%s.\n\n", d.model,
      d.dataset, d.source, d.windows, d.predicted,
      d.has_focus ? absl::StrFormat(" (%d of them tool-call tokens)", d.focus)
                  : "");
  s += absl::StrCat(
      "| config | encoding (K/V) | sink | window | bits nominal | bits plan | "
      "bits worker | NLL | ΔNLL vs bf16 |",
      d.has_focus ? " tool-call ΔNLL |" : "",
      " top-1 agree | KL(bf16‖cfg) | attn err mean | attn err max | "
      "attn err per layer |\n|---|---|---|---|---|---|---|---|---|",
      d.has_focus ? "---|" : "", "---|---|---|---|---|\n");
  auto bits = [&](uint64_t bytes, uint64_t tokens) {
    return BitsPerValue(bytes, tokens, d.n_layers, d.n_kv_heads, d.head_dim);
  };
  auto row = [&](const ConfigResult& c, bool is_fp32) {
    if (!c.ran) {
      // 14 columns (15 with the tool-call column); 5 filled here.
      s +=
          absl::StrFormat("| %s | %s | %s | %d | n/a: %s |", c.name, c.encoding,
                          c.sink ? "bf16" : "-", c.window, c.skipped);
      for (int i = 0; i < (d.has_focus ? 10 : 9); ++i) s += " |";
      s += "\n";
      return;
    }
    std::string attn_mean = "-", attn_max = "-", per_layer = "-";
    if (!is_fp32 && !c.attn.empty()) {
      double sum = 0, mx = 0;
      std::vector<std::string> parts;
      for (const auto& e : c.attn) {
        const double v = RelErr(e);
        sum += v;
        mx = std::max(mx, v);
        parts.push_back(absl::StrFormat("%.4f", v));
      }
      attn_mean = absl::StrFormat("%.4f", sum / c.attn.size());
      attn_max = absl::StrFormat("%.4f", mx);
      per_layer = absl::StrJoin(parts, " / ");
    }
    s += absl::StrFormat(
        "| %s | %s | %s | %s | %.2f | %.2f | %.2f | %.4f | %+.4f |", c.name,
        c.encoding, is_fp32 ? "-" : (c.sink ? "bf16" : "-"),
        is_fp32 ? "-" : absl::StrCat(c.window), c.bits_nominal,
        bits(c.plan_bytes, c.tokens), bits(c.worker_bytes, c.tokens),
        c.stats.nll(), c.stats.nll() - bf16.stats.nll());
    if (d.has_focus) {
      s += absl::StrFormat(" %+.4f |",
                           c.stats.focus_nll() - bf16.stats.focus_nll());
    }
    s += absl::StrFormat(" %.4f | %.5f | %s | %s | %s |\n", c.stats.top1(),
                         c.stats.kl(), attn_mean, attn_max, per_layer);
  };
  row(d.fp32, true);
  for (const auto& c : d.configs) row(c, false);
  s += "\n";
  return s;
}

std::string Methods(const std::string& command) {
  return absl::StrCat(
      "## How the numbers are made\n\n"
      "- **Service**: `quality_bench` starts its own `kvmanager` and one "
      "`kvworker` (CPU backend), creates tenant `quality`, and registers one "
      "policy `q-<config>` per configuration with `PutPolicy`: an optional "
      "`temporal=SINK → bf16` rule (the sequence's first block, 16 tokens), "
      "then a catch-all rule with the encoding. The BF16 recent window is "
      "per sequence (`AllocatePagesRequest.window_tokens`; 0 seals a block "
      "into its format as soon as it is full).\n"
      "- **Forward**: `client/frontend` fp32 forward pass; every layer's "
      "K/V goes to the worker with the queries in one Attend RPC per layer "
      "per chunk of ",
      absl::GetFlag(FLAGS_chunk),
      " tokens (`ServiceKvStore`). The worker writes the chunk (quantizing "
      "blocks that leave the window) before attending, so every query sees "
      "the K/V as the service stores it after its chunk was written, "
      "including earlier tokens of its own chunk: a decode-like measurement, "
      "not full-precision prefill.\n"
      "- **Reference**: the `bf16` configuration (BF16 KV on the worker). "
      "ΔNLL, top-1 agreement (argmax equal) and KL(P_bf16 ‖ P_cfg) are per "
      "predicted token, averaged. `fp32 (local)` is the in-process fp32 KV "
      "(`LocalKvStore`), compared against the same bf16 reference.\n"
      "- **Attention error** (teacher-forced): one extra forward pass runs on "
      "a BF16 sequence (`TeeKvStore`); at every layer the same K/V is also "
      "written to one sequence per configuration, and Attend runs there with "
      "the same queries (positions divisible by ",
      absl::GetFlag(FLAGS_query_stride),
      ", plus each chunk's last). Per layer: sqrt(Σ‖o_cfg − o_bf16‖² / "
      "Σ‖o_bf16‖²) over those queries and all query heads; errors do not "
      "compound across layers. \"mean\" averages the layers.\n"
      "- **Bits** per K/V value, all metadata included: *nominal* = "
      "`kernels::EffectiveBits(encoding, T=16)` of the catch-all encoding "
      "(a full page); *plan* = Σ over the sequence's blocks of "
      "`PageBytes(block encoding, T=capacity)` × layers × 8 / (2 × tokens × "
      "layers × KV heads × head_dim), which counts BF16 sink blocks and the "
      "unused slots of partial blocks (span boundaries, the last block); "
      "*worker* = the kvworker's `Inventory.used_bytes` after the window's "
      "prefill with only that sequence open (target pages plus the BF16 "
      "window pages still held), same divisor. Summed over windows.\n\n",
      CommandBlock(command));
}

absl::StatusOr<std::vector<Dataset>> KvproxyDatasets(
    const std::string& dir, int text_bytes, int window,
    const std::vector<std::string>& bfcl_ids, int bfcl_max_context,
    int max_seq_len) {
  std::vector<Dataset> out;
  ByteTokenizer bt;
  if (window < 2 || window > max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kvproxy_window = ", window, "; must be in [2, ", max_seq_len, "]"));
  }
  if (text_bytes > 0) {
    const struct {
      const char* name;
      const char* file;
      size_t offset;
    } texts[] = {{"tinystories", "tinystories_val.txt", kTinyStoriesHeldOut},
                 {"wikitext2", "wikitext2_test.txt", kWikiTextHeldOut}};
    for (const auto& t : texts) {
      TRIAX_ASSIGN_OR_RETURN(std::string text,
                             frontend::ReadFile(dir + "/text/" + t.file));
      if (text.size() <= t.offset) {
        return absl::FailedPreconditionError(
            absl::StrCat(t.file, " has ", text.size(),
                         " bytes; the held-out range starts at ", t.offset));
      }
      const std::string part = text.substr(t.offset, text_bytes);
      Dataset d;
      d.name = t.name;
      d.source = absl::StrFormat(
          "`text/%s` bytes [%d, %d) (held-out range of kvproxy-18m), "
          "byte tokens, windows of %d tokens with BOS",
          t.file, t.offset, t.offset + part.size(), window);
      d.windows = SplitWindows(bt.Encode(part, false), bt.bos_id(), window);
      out.push_back(std::move(d));
    }
  }
  if (!bfcl_ids.empty()) {
    if (bfcl_max_context < 2 || bfcl_max_context > max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("--bfcl_max_context = ", bfcl_max_context,
                       "; must be in [2, ", max_seq_len, "]"));
    }
    TRIAX_ASSIGN_OR_RETURN(BfclData bfcl, BfclData::Load(dir));
    Dataset d;
    d.name = "bfcl";
    d.has_focus = true;
    std::vector<std::string> notes;
    for (const std::string& id : bfcl_ids) {
      if (!HeldOutBfcl().count(id)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--bfcl_ids: \"", id,
            "\" is not a held-out conversation of kvproxy-18m; use one of: ",
            absl::StrJoin(HeldOutBfcl(), ", ")));
      }
      TRIAX_ASSIGN_OR_RETURN(RenderedConversation conv,
                             bfcl.Render(id, bfcl_max_context - 1));
      // The whole conversation in one window; BOS joins the first span (the
      // system header delimiter); tool-call tokens are the focus.
      frontend::BfclSessionOptions o;
      o.focus_roles = {Role::kToolCall};
      TRIAX_ASSIGN_OR_RETURN(frontend::BfclSession session,
                             frontend::MakeBfclSession(conv, o));
      Window w;
      w.tokens = std::move(session.tokens);
      w.focus = std::move(session.focus);
      w.spans = frontend::ServiceSpans(session.AllSpans());
      notes.push_back(
          absl::StrFormat("%s (%d tokens; %d/%d doc lines, %d/%d exchanges)",
                          id, w.tokens.size(), conv.docs_kept, conv.docs_total,
                          conv.turns_kept, conv.turns_total));
      d.windows.push_back(std::move(w));
    }
    d.source = absl::StrFormat(
        "held-out BFCL multi-turn conversations rendered in ChatML by "
        "`client/frontend/bfcl.h`, one window each, budget %d tokens, role "
        "spans as the manager's spans: %s; \"tool-call ΔNLL\" is over the "
        "tool-call tokens only",
        bfcl_max_context, absl::StrJoin(notes, ", "));
    out.push_back(std::move(d));
  }
  return out;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "quality_bench: %s: %s\n", what.c_str(),
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
  std::set<std::string> models;
  for (absl::string_view m :
       absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipEmpty())) {
    if (m != "stories260k" && m != "kvproxy-18m") {
      return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                               "--models: unknown model \"", m,
                               "\"; use stories260k and/or kvproxy-18m")));
    }
    models.insert(std::string(m));
  }
  auto stories_cfg =
      SelectConfigs("stories_configs", absl::GetFlag(FLAGS_stories_configs));
  if (!stories_cfg.ok()) return Fail("flags", stories_cfg.status());
  auto kvproxy_cfg =
      SelectConfigs("kvproxy_configs", absl::GetFlag(FLAGS_kvproxy_configs));
  if (!kvproxy_cfg.ok()) return Fail("flags", kvproxy_cfg.status());

  // The cluster launcher finds kvmanager/kvworker in $TRIAX_BIN_DIR; default
  // to this binary's directory.
  DefaultBinDirToSelf();
  std::printf("quality_bench: data %s, bin dir %s\n", dir.c_str(),
              std::getenv("TRIAX_BIN_DIR"));
  auto svc_or = Service::Start(absl::GetFlag(FLAGS_pool_mb));
  if (!svc_or.ok()) return Fail("start kvmanager + kvworker", svc_or.status());
  Service* svc = svc_or->get();
  std::printf("service up: manager %s\n", svc->manager_address().c_str());
  for (const auto& c : AllConfigs()) {
    if (absl::Status s = svc->PutPolicy(ToPolicy(c)); !s.ok()) {
      return Fail(absl::StrCat("PutPolicy ", c.policy()), s);
    }
  }
  std::printf("registered %zu policies\n", AllConfigs().size());

  Runner runner(svc, chunk, absl::GetFlag(FLAGS_threads),
                absl::GetFlag(FLAGS_query_stride),
                absl::GetFlag(FLAGS_block_tokens));
  std::vector<DatasetResult> results;
  std::vector<std::string> data_lines;

  if (models.count("stories260k")) {
    auto m = frontend::LoadModel(dir + "/models/stories260k/model.bin");
    if (!m.ok()) return Fail("load stories260k", m.status());
    (*m)->name = "stories260k";
    auto tok = frontend::BpeTokenizer::Load(
        dir + "/models/stories260k/tokenizer.bin", (*m)->config.vocab_size);
    if (!tok.ok()) return Fail("load stories260k tokenizer", tok.status());
    auto text = frontend::ReadFile(dir + "/text/tinystories_val.txt");
    if (!text.ok()) return Fail("read tinystories_val.txt", text.status());
    size_t n = std::min<size_t>(
        text->size(), std::max(0, absl::GetFlag(FLAGS_stories_chars)));
    while (n > 0 && n < text->size() &&
           (static_cast<unsigned char>((*text)[n]) & 0xC0) == 0x80) {
      --n;  // do not cut a UTF-8 character
    }
    Dataset d;
    d.name = "tinystories";
    d.source = absl::StrFormat(
        "first %d characters of `text/tinystories_val.txt`, llama2.c BPE "
        "tokens, 256-token windows with BOS",
        n);
    d.windows = SplitWindows((*tok)->Encode(text->substr(0, n), false),
                             (*tok)->bos_id(), 256);
    std::printf(
        "\n== stories260k / tinystories: %zu windows, %lld tokens, "
        "%zu configurations ==\n",
        d.windows.size(), static_cast<long long>(d.predicted()),
        stories_cfg->size());
    auto r = runner.Run(**m, d, *stories_cfg, "[stories260k/tinystories]");
    if (!r.ok()) return Fail("stories260k", r.status());
    results.push_back(std::move(*r));

    std::vector<std::string> bfcl_ids;
    for (absl::string_view id : absl::StrSplit(
             absl::GetFlag(FLAGS_stories_bfcl_ids), ',', absl::SkipEmpty())) {
      bfcl_ids.emplace_back(id);
    }
    if (!bfcl_ids.empty()) {
      auto bfcl = BfclData::Load(dir);
      if (!bfcl.ok()) return Fail("load BFCL", bfcl.status());
      Dataset b;
      b.name = "bfcl";
      std::vector<std::string> notes;
      for (const std::string& id : bfcl_ids) {
        auto conv = bfcl->Render(id, absl::GetFlag(FLAGS_stories_bfcl_bytes));
        if (!conv.ok()) return Fail("render " + id, conv.status());
        for (Window& w : SplitWindows((*tok)->Encode(conv->text, false),
                                      (*tok)->bos_id(), 256)) {
          b.windows.push_back(std::move(w));
        }
        notes.push_back(
            absl::StrFormat("%s (%d bytes)", id, conv->text.size()));
      }
      b.source = absl::StrFormat(
          "BFCL conversations rendered in ChatML by `client/frontend/bfcl.h` "
          "(cut to %d bytes: %s), llama2.c BPE tokens, 256-token windows "
          "with BOS; out of domain for stories260k",
          absl::GetFlag(FLAGS_stories_bfcl_bytes), absl::StrJoin(notes, ", "));
      std::printf(
          "\n== stories260k / bfcl: %zu windows, %lld tokens, %zu "
          "configurations ==\n",
          b.windows.size(), static_cast<long long>(b.predicted()),
          stories_cfg->size());
      auto rb = runner.Run(**m, b, *stories_cfg, "[stories260k/bfcl]");
      if (!rb.ok()) return Fail("stories260k bfcl", rb.status());
      results.push_back(std::move(*rb));
    }
  }
  if (models.count("kvproxy-18m")) {
    auto m = frontend::LoadModel(dir + "/models/kvproxy-18m/model.bin");
    if (!m.ok()) return Fail("load kvproxy-18m", m.status());
    (*m)->name = "kvproxy-18m";
    std::vector<std::string> ids;
    for (absl::string_view id : absl::StrSplit(absl::GetFlag(FLAGS_bfcl_ids),
                                               ',', absl::SkipEmpty())) {
      ids.emplace_back(id);
    }
    auto sets = KvproxyDatasets(dir, absl::GetFlag(FLAGS_kvproxy_text_bytes),
                                absl::GetFlag(FLAGS_kvproxy_window), ids,
                                absl::GetFlag(FLAGS_bfcl_max_context),
                                (*m)->config.max_seq_len);
    if (!sets.ok()) return Fail("kvproxy-18m data", sets.status());
    for (const Dataset& d : *sets) {
      const std::string prefix = absl::StrCat("[kvproxy-18m/", d.name, "]");
      std::printf(
          "\n== kvproxy-18m / %s: %zu windows, %lld tokens, %zu "
          "configurations ==\n",
          d.name.c_str(), d.windows.size(),
          static_cast<long long>(d.predicted()), kvproxy_cfg->size());
      auto r = runner.Run(**m, d, *kvproxy_cfg, prefix);
      if (!r.ok()) return Fail(prefix, r.status());
      results.push_back(std::move(*r));
    }
  }

  const double total = Seconds(t_all);
  std::string md = absl::StrCat(
      "# KV quality: every encoding on real models\n\n",
      GeneratedBy("quality_bench", total), Methods(command), "## Results\n\n");
  for (const auto& r : results) md += Table(r);
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
