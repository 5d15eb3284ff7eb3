// kvdemo: runs real llama2.c models with their KV cache held by the triaxkv
// service and checks the results against known answers and a local fp32 KV
// cache. Exit code 0 only when every check passed.
//
//   (a) stories260k greedy decoding from BOS, KV local and through the
//       service (policy bf16), compared byte for byte with
//       expected_greedy_200.txt;
//   (b) a held-out BFCL agentic conversation on kvproxy-18m, turn by turn,
//       under the triaxial allocation policy (the committed calibration
//       table, --budget_bits, re-solved and aged at every turn; without
//       --calibration the static table triaxial-static): KV bytes per
//       encoding and next-token NLL on the tool-call tokens against the
//       local fp32 KV;
//   (c) stories260k NLL on TinyStories with policies bf16, int4, int2 and
//       local fp32, plus prefill and decode throughput.
// Without the data directory everything runs on a synthetic model instead.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/data_dir.h"
#include "client/frontend/demo_disaggregate.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "client/frontend/service_kv_store.h"
#include "client/frontend/service_types.h"
#include "client/kv_client.h"
#include "common/bearer.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "google/protobuf/text_format.h"
#include "kernels/layout.h"

ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificates: talk TLS to the manager and workers, "
          "verified by them; empty: plaintext (docs/security.md)");
ABSL_FLAG(std::string, tls_cert, "",
          "with --tls_ca: PEM client certificate for servers that ask for one");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, worker_sockets, "",
          "workers on this host to reach on their --local_listen sockets: "
          "WORKER_ADDRESS=unix:/PATH,... (no TCP, no TLS to them)");
ABSL_FLAG(std::string, tls_worker_server_name, "",
          "with --tls_ca: verify workers' certificates against this DNS name "
          "instead of their address");
ABSL_FLAG(std::string, token_file, "",
          "bearer token (role tenant or admin) for a kvmanager with "
          "--auth=token");
ABSL_FLAG(std::string, manager, "127.0.0.1:7070",
          "kvmanager address host:port");
ABSL_FLAG(std::string, tenant, "demo", "tenant id (created when missing)");
ABSL_FLAG(std::string, data_dir, "",
          "data directory; empty: $TRIAX_DATA_DIR, else ../shared/data");
ABSL_FLAG(int, nll_chars, 20000,
          "characters of tinystories_val.txt for the NLL step (c)");
ABSL_FLAG(int, greedy_steps, 200, "greedy decoding steps for step (a)");
ABSL_FLAG(int, disaggregate_prefill, 100,
          "step (a): also prefill this many tokens on one worker and decode "
          "the rest on another (TransferSequence); runs when two workers "
          "are up; 0: off");
ABSL_FLAG(std::string, transfer_failure_policy, "recompute",
          "what step (a)'s prefill-on-one-worker, decode-on-another does "
          "when TransferSequence fails (as vLLM's kv_load_failure_policy, "
          "whose default is also recompute): \"recompute\" closes the "
          "sequence on the prefill worker (it kept serving: nothing was "
          "lost) and prefills again into a new sequence, which placement "
          "puts on the worker without the partial copy, then decodes there; "
          "\"fail\" stops the step with the transfer's status (exit code "
          "1)");
ABSL_FLAG(std::string, bfcl_id, "multi_turn_base_42",
          "held-out BFCL conversation for step (b) (kvproxy README list)");
ABSL_FLAG(int, max_context, 2048,
          "token budget of step (b); longer conversations keep whole doc "
          "lines and exchanges that fit");
ABSL_FLAG(int, chunk, 64, "prefill chunk (tokens per forward call, <= 256)");
ABSL_FLAG(int, threads, 2, "threads for the matrix products");
ABSL_FLAG(int, decode_steps, 64, "decode steps timed per policy in step (c)");
ABSL_FLAG(std::string, calibration,
          "bench/results/calibration_kvproxy-18m-output.txtpb",
          "calibration table (text triax.v1.CalibrationTable) for step (b)'s "
          "triaxial allocation policy (an output-metric table: the policy "
          "minimizes its next-token NLL increase, OBJECTIVE_DNLL; any other: "
          "its distortion); empty: use the static table triaxial-static");
ABSL_FLAG(double, budget_bits, 3.5,
          "step (b): effective bits per value of the triaxial policy");
ABSL_FLAG(std::string, steps, "abc",
          "which steps to run: any of a (greedy), b (BFCL), c (NLL); step b "
          "needs kvproxy-18m, a and c only stories260k");

namespace triax::frontend {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Prints the failing step with its status; the caller exits non-zero.
int Fail(const std::string& step, const absl::Status& s) {
  std::printf("\nFAILED at %s: %s\n", step.c_str(), s.ToString().c_str());
  std::fflush(stdout);
  return 1;
}

struct Check {
  std::string name;
  bool passed;
  std::string detail;
};

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(30));
}

absl::Status EnsureTenant(client::Client* c, const std::string& tenant) {
  {
    TRIAX_ASSIGN_OR_RETURN(const v1::ListTenantsResponse resp,
                           c->ListTenants());
    for (const auto& t : resp.tenants()) {
      if (t.tenant_id() == tenant) {
        std::printf("tenant %s exists\n", tenant.c_str());
        return absl::OkStatus();
      }
    }
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::CreateTenantRequest req;
  req.set_request_id(absl::StrCat("kvdemo-create-", tenant));
  req.set_tenant_id(tenant);
  v1::CreateTenantResponse resp;
  absl::Status s = FromGrpcStatus(c->manager()->CreateTenant(&ctx, req, &resp));
  if (s.code() == absl::StatusCode::kAlreadyExists) return absl::OkStatus();
  if (s.ok()) std::printf("created tenant %s\n", tenant.c_str());
  return s;
}

absl::StatusOr<v1::SequenceInfo> GetSequence(client::Client* c,
                                             const std::string& tenant,
                                             const std::string& id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::GetSequenceRequest req;
  req.set_tenant_id(tenant);
  req.set_sequence_id(id);
  v1::GetSequenceResponse resp;
  TRIAX_RETURN_IF_ERROR(
      FromGrpcStatus(c->manager()->GetSequence(&ctx, req, &resp)));
  return resp.sequence();
}

// KV bytes of a sequence's plan per format, from kernels/layout.h.
struct KvBytes {
  std::map<std::string, uint64_t> by_format;
  uint64_t total = 0;
  uint64_t bf16_equivalent = 0;
  uint64_t charged = 0;  // SequenceInfo.bytes
};

KvBytes CountKvBytes(const v1::SequenceInfo& info, const ModelConfig& c) {
  KvBytes kb;
  kb.charged = info.bytes();
  for (const auto& b : info.blocks()) {
    kernels::PageShape shape;
    shape.tokens =
        static_cast<int>(b.capacity() ? b.capacity() : info.block_tokens());
    shape.heads = c.n_kv_heads;
    shape.head_dim = c.head_dim();
    const kernels::Encoding e = EncodingFromProto(b);
    const bool valid = kernels::ValidateEncoding(e, shape) == nullptr;
    const std::string name =
        valid ? client::EncodingLabel(e)
              : absl::StrCat("format#", static_cast<int>(b.format()));
    const uint64_t bytes =
        valid ? kernels::PageBytes(e, shape) * c.n_layers : 0;
    kb.by_format[name] += bytes;
    kb.total += bytes;
    kb.bf16_equivalent +=
        kernels::PageBytes(kernels::Format::kBF16, shape) * c.n_layers;
  }
  return kb;
}

std::string FormatKvBytes(const KvBytes& kb) {
  std::vector<std::string> parts;
  for (const auto& [f, b] : kb.by_format)
    parts.push_back(absl::StrCat(f, "=", b));
  return absl::StrFormat(
      "%s total=%d bf16=%d ratio=%.2fx charged=%d", absl::StrJoin(parts, " "),
      kb.total, kb.bf16_equivalent,
      kb.total ? static_cast<double>(kb.bf16_equivalent) / kb.total : 0.0,
      kb.charged);
}

// Greedy decoding from BOS, printing like run.c. `seq` non-null: the KV is on
// the service and the plan grows one token per step.
struct GreedyResult {
  std::string text;
  int steps = 0;
  double seconds = 0;
  std::vector<int> tokens;          // the input token of each step
  std::vector<std::string> pieces;  // the text each step added
};

absl::StatusOr<GreedyResult> Greedy(Transformer* tf, const Tokenizer& tok,
                                    KvStore* kv, client::Client* c,
                                    client::SequenceHandle* seq, int steps,
                                    bool echo) {
  GreedyResult r;
  std::vector<float> logits;
  int token = tok.bos_id();
  const int vocab = tf->model().config.vocab_size;
  const auto t0 = Clock::now();
  for (int pos = 0; pos < steps; ++pos) {
    if (seq != nullptr && pos > 0) {
      TRIAX_RETURN_IF_ERROR(c->Extend(seq, {ServiceSpan(Role::kAssistant, 1)},
                                      /*new_turn=*/false,
                                      /*continue_last_span=*/true));
    }
    TRIAX_RETURN_IF_ERROR(tf->Forward({&token, 1}, pos, kv, &logits));
    const int next = Argmax(logits.data(), vocab);
    ++r.steps;
    r.tokens.push_back(token);
    if (next == tok.bos_id()) break;
    const std::string piece = tok.Printable(token, next);
    r.pieces.push_back(piece);
    if (echo) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    r.text += piece;
    token = next;
  }
  if (echo) std::printf("\n");
  r.seconds = Seconds(t0);
  return r;
}

// --transfer_failure_policy (validated by Main).
bool RecomputeOnFailure() {
  return absl::GetFlag(FLAGS_transfer_failure_policy) == "recompute";
}

std::string DiffPosition(const std::string& got, const std::string& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return absl::StrFormat(
      "first difference at byte %d (got %d bytes, want %d): got \"%s\" want "
      "\"%s\"",
      i, got.size(), want.size(), absl::CEscape(got.substr(i, 24)),
      absl::CEscape(want.substr(i, 24)));
}

// Step (a).
absl::Status StepGreedy(const Model& model, const Tokenizer& tok,
                        client::Client* c, const std::string& expected,
                        bool have_expected, int steps, int threads,
                        std::vector<Check>* checks,
                        std::vector<std::string>* report) {
  Transformer tf(&model, threads);
  std::printf("\n== (a) greedy decoding, %d steps from BOS, model %s ==\n",
              steps, model.name.c_str());
  std::printf("-- local fp32 KV:\n");
  LocalKvStore local(model.config);
  TRIAX_ASSIGN_OR_RETURN(
      GreedyResult lr, Greedy(&tf, tok, &local, nullptr, nullptr, steps, true));
  std::printf("-- service KV, policy bf16:\n");
  TRIAX_ASSIGN_OR_RETURN(
      client::SequenceHandle seq,
      c->Open(ServiceShape(model), {ServiceSpan(Role::kUser, 1)}, "bf16"));
  ServiceKvStore remote(c, &seq, model.config.n_kv_heads,
                        model.config.head_dim());
  auto sr = Greedy(&tf, tok, &remote, c, &seq, steps, true);
  absl::Status close = c->Close(seq);
  if (!sr.ok()) return sr.status();
  TRIAX_RETURN_IF_ERROR(close);

  auto verdict = [&](const std::string& got, const std::string& want) {
    return got == want ? std::string("MATCH")
                       : "MISMATCH: " + DiffPosition(got, want);
  };
  if (have_expected) {
    const std::string lv = verdict(lr.text, expected);
    const std::string sv = verdict(sr->text, expected);
    std::printf("local fp32 vs expected_greedy_200.txt: %s\n", lv.c_str());
    std::printf("service bf16 vs expected_greedy_200.txt: %s\n", sv.c_str());
    checks->push_back({"greedy local fp32 == expected_greedy_200.txt",
                       lr.text == expected, lv});
    checks->push_back({"greedy service bf16 == expected_greedy_200.txt",
                       sr->text == expected, sv});
  } else {
    const std::string v = verdict(sr->text, lr.text);
    std::printf(
        "service bf16 vs local fp32 (synthetic model, no known answer): %s\n",
        v.c_str());
  }
  report->push_back(absl::StrFormat(
      "(a) greedy %d steps: local fp32 %.1f tok/s, service bf16 %.1f tok/s "
      "(%d Attend RPCs)",
      steps, lr.steps / lr.seconds, sr->steps / sr->seconds, remote.rpcs()));

  // Prefill on one worker, decode on another (needs two workers UP).
  TRIAX_ASSIGN_OR_RETURN(const int up, UpWorkers(c));
  const int prefill = absl::GetFlag(FLAGS_disaggregate_prefill);
  if (prefill <= 0 || up < 2) {
    report->push_back(
        absl::StrFormat("(a) prefill/decode on two workers: not run (%s)",
                        prefill <= 0 ? "--disaggregate_prefill=0"
                                     : absl::StrCat(up, " worker(s) up")));
    return absl::OkStatus();
  }
  std::printf("-- prefill %d tokens on one worker, decode on another:\n",
              prefill);
  TRIAX_ASSIGN_OR_RETURN(
      DisaggregatedResult dr,
      PrefillThenDecodeElsewhere(&tf, tok, c, model, lr.tokens, lr.pieces,
                                 prefill, steps, RecomputeOnFailure()));
  std::printf("%s\n", dr.text.c_str());
  const std::string want = have_expected ? expected : lr.text;
  const std::string dv = verdict(dr.text, want);
  std::printf("prefill on %s, decode on %s%s vs %s: %s\n",
              dr.prefill_worker.c_str(), dr.decode_worker.c_str(),
              dr.recomputed ? " (prefill recomputed there)" : "",
              have_expected ? "expected_greedy_200.txt" : "local fp32",
              dv.c_str());
  checks->push_back(
      {have_expected
           ? "greedy prefill on one worker, decode on another == "
             "expected_greedy_200.txt"
           : "greedy prefill on one worker, decode on another == local fp32",
       dr.text == want, dv});
  if (dr.recomputed) {
    report->push_back(absl::StrFormat(
        "(a) prefill %d tokens on %s (%.3f s); transfer failed after %.3f s "
        "(%s); recomputed the prefill on %s (%.3f s), decode %d steps there "
        "(%.1f tok/s)",
        prefill, dr.prefill_worker, dr.prefill_seconds, dr.transfer_seconds,
        dr.transfer_error.ToString(), dr.decode_worker, dr.recompute_seconds,
        dr.decode_steps, dr.decode_steps / dr.decode_seconds));
    return absl::OkStatus();
  }
  report->push_back(absl::StrFormat(
      "(a) prefill %d tokens on %s (%.3f s), transfer to %s (%.3f s: %d "
      "blocks, %d wire bytes, %d as BF16), decode %d steps there (%.1f "
      "tok/s)",
      prefill, dr.transfer.source_worker_id(), dr.prefill_seconds,
      dr.transfer.destination_worker_id(), dr.transfer_seconds,
      dr.transfer.blocks(), dr.transfer.wire_bytes(), dr.transfer.bf16_bytes(),
      dr.decode_steps, dr.decode_steps / dr.decode_seconds));
  return absl::OkStatus();
}

// NLL of `targets` (token index -> counted) given logits [n][vocab] for
// tokens[0..n).
NllResult NllAt(const std::vector<float>& logits,
                const std::vector<int>& tokens, int vocab,
                const std::vector<bool>& counted) {
  NllResult r;
  for (size_t t = 1; t < tokens.size(); ++t) {
    if (!counted[t]) continue;
    r.sum += TokenNll(&logits[(t - 1) * vocab], vocab, tokens[t]);
    ++r.count;
  }
  return r;
}

// Stores the calibration table and an allocation policy "triaxial-<bits>b"
// with the manager; returns the policy name, or "triaxial-static" when no
// table is configured.
absl::StatusOr<std::string> SetUpTriaxialPolicy(client::Client* c,
                                                const std::string& path,
                                                double budget_bits) {
  if (path.empty()) return std::string("triaxial-static");
  TRIAX_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  v1::CalibrationTable table;
  if (!google::protobuf::TextFormat::ParseFromString(text, &table)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--calibration: ", path, " is not a text-format CalibrationTable"));
  }
  {
    grpc::ClientContext ctx;
    v1::PutCalibrationRequest req;
    req.set_request_id(c->NewRequestId());
    *req.mutable_table() = table;
    v1::PutCalibrationResponse resp;
    TRIAX_RETURN_IF_ERROR(
        FromGrpcStatus(c->manager()->PutCalibration(&ctx, req, &resp)));
  }
  const std::string name = absl::StrFormat("triaxial-%.2gb", budget_bits);
  grpc::ClientContext ctx;
  v1::PutPolicyRequest req;
  req.set_request_id(c->NewRequestId());
  req.mutable_policy()->set_name(name);
  req.mutable_policy()->set_budget_bits(budget_bits);
  req.mutable_policy()->set_calibration_model(table.model());
  const bool output = absl::StartsWith(table.source().metric(), "output-kl");
  req.mutable_policy()->set_objective(output ? v1::OBJECTIVE_DNLL
                                             : v1::OBJECTIVE_KL);
  v1::PutPolicyResponse resp;
  TRIAX_RETURN_IF_ERROR(
      FromGrpcStatus(c->manager()->PutPolicy(&ctx, req, &resp)));
  std::printf(
      "policy %s: budget %.2f effective bits/value, calibration of %s "
      "(%d entries, from %s), minimizing %s\n",
      name.c_str(), budget_bits, table.model().c_str(), table.entries_size(),
      path.c_str(), output ? "the next-token NLL increase" : "distortion");
  return name;
}

// Step (b).
absl::Status StepBfcl(const std::string& data_dir, client::Client* c,
                      const std::string& tenant, const std::string& policy,
                      const std::string& id, int max_context, int chunk,
                      int threads, std::vector<Check>* checks,
                      std::vector<std::string>* report) {
  std::printf("\n== (b) BFCL agentic session %s on kvproxy-18m, policy %s ==\n",
              id.c_str(), policy.c_str());
  TRIAX_ASSIGN_OR_RETURN(auto model,
                         LoadModel(data_dir + "/models/kvproxy-18m/model.bin"));
  model->name = "kvproxy-18m";
  TRIAX_ASSIGN_OR_RETURN(BfclData data, BfclData::Load(data_dir));
  if (max_context < 2 || max_context > model->config.max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_context = ", max_context, "; must be in [2, ",
                     model->config.max_seq_len, "]"));
  }
  TRIAX_ASSIGN_OR_RETURN(RenderedConversation conv,
                         data.Render(id, max_context - 1));
  if (conv.truncated()) {
    std::printf(
        "NOTE: rendered conversation does not fit --max_context=%d: kept "
        "%d of %d function doc lines and %d of %d exchanges (%zu bytes "
        "+ BOS)\n",
        max_context, conv.docs_kept, conv.docs_total, conv.turns_kept,
        conv.turns_total, conv.text.size());
  }
  ByteTokenizer bt;
  const std::vector<int> tokens = bt.Encode(conv.text, true);
  // Counted targets: the tool-call bytes (token index = byte offset + 1).
  std::vector<bool> counted(tokens.size(), false);
  for (const RoleSpan& s : conv.AllSpans()) {
    if (s.role != Role::kToolCall) continue;
    for (size_t b = s.begin; b < s.begin + s.length; ++b) counted[b + 1] = true;
  }
  Transformer tf(model.get(), threads);
  const int vocab = model->config.vocab_size;

  // The spans of turn t (BOS joins the first span: the system header
  // delimiter).
  auto spans_of = [&](size_t t) {
    std::vector<v1::Span> spans;
    for (const RoleSpan& s : conv.turns[t].spans) {
      const uint32_t n =
          static_cast<uint32_t>(s.length + (s.begin == 0 ? 1 : 0));
      spans.push_back(ServiceSpan(s.role, n));
    }
    return spans;
  };
  // Service run, turn by turn. transfer_after >= 0: after that turn's
  // prefill the sequence moves to another worker (TransferSequence), which
  // serves the later turns; when the transfer fails, --transfer_failure_policy
  // says whether to stop or to prefill turns 0..transfer_after again on
  // that worker (in a new sequence; the first one is closed).
  int64_t pos = 0;
  int64_t rpcs = 0;
  double service_seconds = 0;
  auto service_run = [&](int transfer_after, bool print,
                         std::vector<float>* service_logits,
                         DisaggregatedResult* moved) -> absl::Status {
    std::vector<float> part;
    client::SequenceHandle seq;
    std::unique_ptr<ServiceKvStore> kv;
    absl::Status run_status;
    if (print) {
      std::printf("%-5s %-7s %-8s %s\n", "turn", "tokens", "context",
                  "KV bytes per format (manager plan)");
    }
    // The move after turn t (prefilled up to token `end`).
    auto move = [&](size_t t, int64_t end) -> absl::Status {
      TRIAX_ASSIGN_OR_RETURN(moved->prefill_worker, WorkerOf(c, seq));
      TRIAX_ASSIGN_OR_RETURN(moved->decode_worker,
                             OtherUpWorker(c, moved->prefill_worker));
      client::Client::TransferOptions to;
      to.destination_worker_id = moved->decode_worker;
      absl::StatusOr<v1::TransferSequenceResponse> r =
          c->TransferSequence(&seq, to);
      if (r.ok()) {
        moved->transfer = *std::move(r);
        return absl::OkStatus();
      }
      moved->transfer_error = r.status();
      if (!RecomputeAfterFailedTransfer(RecomputeOnFailure(), r.status(),
                                        moved->prefill_worker)) {
        return r.status();
      }
      client::OpenOptions on_decode;
      on_decode.policy = policy;
      on_decode.worker_id = moved->decode_worker;
      TRIAX_ASSIGN_OR_RETURN(
          client::SequenceHandle again,
          c->Open(ServiceShape(*model), spans_of(0), on_decode));
      absl::Status st;
      for (size_t u = 1; u <= t && st.ok(); ++u) {
        st = c->Extend(&again, spans_of(u), /*new_turn=*/true,
                       /*continue_last_span=*/false);
      }
      const absl::Status closed = c->Close(seq);
      seq = std::move(again);  // closed by the caller whatever happens next
      TRIAX_RETURN_IF_ERROR(st);
      TRIAX_RETURN_IF_ERROR(closed);
      kv = std::make_unique<ServiceKvStore>(c, &seq, model->config.n_kv_heads,
                                            model->config.head_dim());
      std::vector<float> again_logits;  // equal to the first run's
      const auto t0 = Clock::now();
      TRIAX_RETURN_IF_ERROR(
          tf.Prefill(absl::MakeConstSpan(tokens).subspan(0, end), 0, chunk,
                     kv.get(), &again_logits));
      moved->recompute_seconds = Seconds(t0);
      moved->recomputed = true;
      std::printf("recomputed the prefill of turns 0-%zu (%lld tokens) on %s\n",
                  t, static_cast<long long>(end), moved->decode_worker.c_str());
      return absl::OkStatus();
    };
    for (size_t t = 0; t < conv.turns.size() && run_status.ok(); ++t) {
      const RenderedTurn& turn = conv.turns[t];
      const std::vector<v1::Span> spans = spans_of(t);
      const int64_t first = t == 0 ? 0 : static_cast<int64_t>(turn.begin) + 1;
      const int64_t end = static_cast<int64_t>(turn.end) + 1;
      if (t == 0) {
        auto opened = c->Open(ServiceShape(*model), spans, policy);
        if (!opened.ok()) return opened.status();
        seq = *opened;
        kv = std::make_unique<ServiceKvStore>(c, &seq, model->config.n_kv_heads,
                                              model->config.head_dim());
      } else {
        run_status = c->Extend(&seq, spans, /*new_turn=*/true,
                               /*continue_last_span=*/false);
        if (!run_status.ok()) break;
      }
      const auto t0 = Clock::now();
      run_status =
          tf.Prefill(absl::MakeConstSpan(tokens).subspan(first, end - first),
                     first, chunk, kv.get(), &part);
      if (print) service_seconds += Seconds(t0);
      if (!run_status.ok()) break;
      service_logits->insert(service_logits->end(), part.begin(), part.end());
      pos = end;
      if (static_cast<int>(t) == transfer_after) {
        run_status = move(t, end);
        if (!run_status.ok()) break;
      }
      if (!print) continue;
      auto info = GetSequence(c, tenant, seq.sequence_id);
      if (!info.ok()) {
        run_status = info.status();
        break;
      }
      const KvBytes kb = CountKvBytes(*info, model->config);
      std::printf("%-5zu %-7lld %-8lld %s\n", t,
                  static_cast<long long>(end - first),
                  static_cast<long long>(pos), FormatKvBytes(kb).c_str());
      if (t + 1 == conv.turns.size()) {
        report->push_back(
            absl::StrFormat("(b) %s: %d turns, %d tokens; final KV %s", id,
                            conv.turns.size(), pos, FormatKvBytes(kb)));
      }
    }
    if (kv && print) rpcs = kv->rpcs();
    if (!seq.sequence_id.empty()) {
      absl::Status close = c->Close(seq);
      if (run_status.ok()) run_status = close;
    }
    return run_status;
  };
  std::vector<float> service_logits;
  DisaggregatedResult unused;
  TRIAX_RETURN_IF_ERROR(service_run(-1, true, &service_logits, &unused));

  // Local fp32 reference over the same tokens and chunks.
  LocalKvStore local(model->config);
  std::vector<float> local_logits;
  const auto t0 = Clock::now();
  TRIAX_RETURN_IF_ERROR(tf.Prefill(tokens, 0, chunk, &local, &local_logits));
  const double local_seconds = Seconds(t0);
  const NllResult ls = NllAt(local_logits, tokens, vocab, counted);
  const NllResult ss = NllAt(service_logits, tokens, vocab, counted);
  std::vector<bool> all(tokens.size(), true);
  const NllResult la = NllAt(local_logits, tokens, vocab, all);
  const NllResult sa = NllAt(service_logits, tokens, vocab, all);
  std::printf(
      "tool-call tokens: %lld; NLL local fp32 %.4f, service %.4f, dNLL "
      "%+.4f nats/token\n",
      static_cast<long long>(ls.count), ls.mean(), ss.mean(),
      ss.mean() - ls.mean());
  std::printf("all tokens: NLL local fp32 %.4f, service %.4f, dNLL %+.4f\n",
              la.mean(), sa.mean(), sa.mean() - la.mean());
  std::printf(
      "prefill: service %.1f tok/s (%lld Attend RPCs), local %.1f tok/s\n",
      tokens.size() / service_seconds, static_cast<long long>(rpcs),
      tokens.size() / local_seconds);
  report->push_back(
      absl::StrFormat("(b) tool-call NLL (%d tokens): local fp32 %.4f, service "
                      "%.4f, dNLL %+.4f; "
                      "all-token dNLL %+.4f",
                      ls.count, ls.mean(), ss.mean(), ss.mean() - ls.mean(),
                      sa.mean() - la.mean()));
  const bool finite =
      std::isfinite(ss.mean()) && std::isfinite(ls.mean()) && ls.count > 0;
  checks->push_back({"BFCL session NLL finite, tool-call tokens present",
                     finite, absl::StrCat(ls.count, " tool-call tokens")});

  // The same session with its first turn prefilled on one worker and the
  // later turns on another (needs two workers up and two turns).
  TRIAX_ASSIGN_OR_RETURN(const int up, UpWorkers(c));
  if (up < 2 || conv.turns.size() < 2 ||
      absl::GetFlag(FLAGS_disaggregate_prefill) <= 0) {
    report->push_back(absl::StrFormat(
        "(b) later turns on a second worker: not run (%d worker(s) up, %d "
        "turns)",
        up, conv.turns.size()));
    return absl::OkStatus();
  }
  std::vector<float> moved_logits;
  DisaggregatedResult moved;
  TRIAX_RETURN_IF_ERROR(service_run(0, false, &moved_logits, &moved));
  const NllResult ms = NllAt(moved_logits, tokens, vocab, counted);
  const NllResult ma = NllAt(moved_logits, tokens, vocab, all);
  const bool same = moved_logits == service_logits;
  std::printf(
      "turn 0 on %s, turns 1-%zu on %s: tool-call dNLL %+.4f, all-token dNLL "
      "%+.4f (one worker: %+.4f, %+.4f); logits %s\n",
      moved.prefill_worker.c_str(), conv.turns.size() - 1,
      moved.decode_worker.c_str(), ms.mean() - ls.mean(), ma.mean() - la.mean(),
      ss.mean() - ls.mean(), sa.mean() - la.mean(),
      same ? "bit-identical" : "DIFFER");
  const std::string how =
      moved.recomputed
          ? absl::StrFormat("transfer failed (%s); turn 0 recomputed there",
                            moved.transfer_error.ToString())
          : absl::StrFormat("transfer: %d blocks, %d wire bytes, %d as BF16",
                            moved.transfer.blocks(),
                            moved.transfer.wire_bytes(),
                            moved.transfer.bf16_bytes());
  report->push_back(absl::StrFormat(
      "(b) turn 0 on %s, later turns on %s (%s): all-token dNLL %+.4f vs "
      "%+.4f on one worker",
      moved.prefill_worker, moved.decode_worker, how, ma.mean() - la.mean(),
      sa.mean() - la.mean()));
  checks->push_back(
      {"BFCL later turns on a second worker: logits equal one worker's", same,
       absl::StrFormat("all-token dNLL %+.6f vs %+.6f", ma.mean() - la.mean(),
                       sa.mean() - la.mean())});
  return absl::OkStatus();
}

// Step (c).
absl::Status StepNll(const Model& model, const Tokenizer& tok,
                     const std::string& text, client::Client* c, int chunk,
                     int threads, int decode_steps, std::vector<Check>* checks,
                     std::vector<std::string>* report) {
  std::printf(
      "\n== (c) NLL of %s on %zu characters, 256-token windows with BOS ==\n",
      model.name.c_str(), text.size());
  const std::vector<int> ids = tok.Encode(text, false);
  std::vector<std::vector<int>> windows;
  for (size_t off = 0; off < ids.size(); off += 255) {
    std::vector<int> w = {tok.bos_id()};
    for (size_t i = off; i < std::min(ids.size(), off + 255); ++i)
      w.push_back(ids[i]);
    if (w.size() >= 2) windows.push_back(std::move(w));
  }
  Transformer tf(&model, threads);
  const int vocab = model.config.vocab_size;
  std::printf("%-10s %-10s %-10s %-14s %-14s\n", "KV", "NLL", "dNLL",
              "prefill tok/s", "decode tok/s");
  double local_nll = 0;
  for (const std::string policy : {"local-fp32", "bf16", "int4", "int2"}) {
    const bool local = policy == "local-fp32";
    NllResult r;
    int64_t tokens = 0;
    double seconds = 0;
    std::vector<float> logits;
    for (const auto& w : windows) {
      std::vector<bool> counted(w.size(), true);
      if (local) {
        LocalKvStore kv(model.config);
        const auto t0 = Clock::now();
        TRIAX_RETURN_IF_ERROR(tf.Prefill(w, 0, chunk, &kv, &logits));
        seconds += Seconds(t0);
      } else {
        TRIAX_ASSIGN_OR_RETURN(
            client::SequenceHandle seq,
            c->Open(ServiceShape(model),
                    {ServiceSpan(Role::kUser, static_cast<uint32_t>(w.size()))},
                    policy));
        ServiceKvStore kv(c, &seq, model.config.n_kv_heads,
                          model.config.head_dim());
        const auto t0 = Clock::now();
        absl::Status s = tf.Prefill(w, 0, chunk, &kv, &logits);
        seconds += Seconds(t0);
        absl::Status close = c->Close(seq);
        TRIAX_RETURN_IF_ERROR(s);
        TRIAX_RETURN_IF_ERROR(close);
      }
      const NllResult wr = NllAt(logits, w, vocab, counted);
      r.sum += wr.sum;
      r.count += wr.count;
      tokens += w.size();
    }
    // Decode throughput: greedy steps from BOS with this KV.
    GreedyResult g;
    if (local) {
      LocalKvStore kv(model.config);
      TRIAX_ASSIGN_OR_RETURN(
          g, Greedy(&tf, tok, &kv, nullptr, nullptr, decode_steps, false));
    } else {
      TRIAX_ASSIGN_OR_RETURN(
          client::SequenceHandle seq,
          c->Open(ServiceShape(model), {ServiceSpan(Role::kUser, 1)}, policy));
      ServiceKvStore kv(c, &seq, model.config.n_kv_heads,
                        model.config.head_dim());
      auto gr = Greedy(&tf, tok, &kv, c, &seq, decode_steps, false);
      absl::Status close = c->Close(seq);
      if (!gr.ok()) return gr.status();
      TRIAX_RETURN_IF_ERROR(close);
      g = *gr;
    }
    if (local) local_nll = r.mean();
    const std::string row = absl::StrFormat(
        "%-10s %-10.4f %-+10.4f %-14.1f %-14.1f", policy, r.mean(),
        r.mean() - local_nll, tokens / seconds, g.steps / g.seconds);
    std::printf("%s\n", row.c_str());
    report->push_back("(c) " + row);
    checks->push_back({absl::StrCat("NLL with KV ", policy, " is finite"),
                       std::isfinite(r.mean()) && r.count > 0,
                       absl::StrCat(r.count, " tokens")});
  }
  return absl::OkStatus();
}

int Main() {
  const std::string data_dir = ResolveDataDir(absl::GetFlag(FLAGS_data_dir));
  const std::string steps_flag = absl::GetFlag(FLAGS_steps);
  if (steps_flag.empty() ||
      steps_flag.find_first_not_of("abc") != std::string::npos) {
    return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                             "--steps = \"", steps_flag,
                             "\"; must be a non-empty subset of \"abc\"")));
  }
  const bool run_a = steps_flag.find('a') != std::string::npos;
  const bool run_b = steps_flag.find('b') != std::string::npos;
  const bool run_c = steps_flag.find('c') != std::string::npos;
  // Step (b) is the only one that needs kvproxy-18m and BFCL.
  const bool real = DataDirComplete(data_dir, /*need_kvproxy=*/run_b);
  const std::string failure_policy =
      absl::GetFlag(FLAGS_transfer_failure_policy);
  if (failure_policy != "recompute" && failure_policy != "fail") {
    return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                             "--transfer_failure_policy = \"", failure_policy,
                             "\"; must be \"recompute\" or \"fail\"")));
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  const int chunk = absl::GetFlag(FLAGS_chunk);
  if (chunk < 1 || chunk > 256) {
    return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                             "--chunk = ", chunk, "; must be 1..256")));
  }
  std::printf("kvdemo: manager %s, tenant %s, data dir %s\n",
              absl::GetFlag(FLAGS_manager).c_str(),
              absl::GetFlag(FLAGS_tenant).c_str(), data_dir.c_str());
  if (!real) {
    std::printf(
        "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        "!\n"
        "!! DATA DIRECTORY '%s' IS MISSING OR INCOMPLETE.\n"
        "!! Running on a SYNTHETIC model (random weights, seed 1234, byte\n"
        "!! tokenizer). No known-answer checks; no BFCL step.\n"
        "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        "\n",
        data_dir.c_str());
  }
  client::ClientOptions opts;
  opts.manager_address = absl::GetFlag(FLAGS_manager);
  opts.tenant_id = absl::GetFlag(FLAGS_tenant);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> token =
        triax::ReadBearerToken("token_file", path);
    if (!token.ok()) return Fail("read the token", token.status());
    opts.token = *std::move(token);
  }
  {
    auto tls = triax::LoadTls({absl::GetFlag(FLAGS_tls_cert),
                               absl::GetFlag(FLAGS_tls_key),
                               absl::GetFlag(FLAGS_tls_ca), false});
    if (!tls.ok()) return Fail("TLS flags", tls.status());
    if (!tls->cert_pem.empty() && !tls->client_enabled()) {
      return Fail("TLS flags",
                  absl::InvalidArgumentError("--tls_cert needs --tls_ca"));
    }
    opts.credentials = triax::ChannelCredentials(*tls);
    opts.tls_worker_server_name = absl::GetFlag(FLAGS_tls_worker_server_name);
    auto sockets =
        triax::client::ParseWorkerSockets(absl::GetFlag(FLAGS_worker_sockets));
    if (!sockets.ok()) return Fail("--worker_sockets", sockets.status());
    opts.worker_sockets = *std::move(sockets);
  }
  auto client_or = client::Client::Connect(opts);
  if (!client_or.ok())
    return Fail("connect to the manager", client_or.status());
  client::Client* c = client_or->get();
  if (absl::Status s = EnsureTenant(c, opts.tenant_id); !s.ok()) {
    return Fail("ensure tenant", s);
  }

  std::vector<Check> checks;
  std::vector<std::string> report;
  const auto t_all = Clock::now();

  std::unique_ptr<Model> stories;
  std::unique_ptr<Tokenizer> tok;
  std::string expected, nll_text;
  if (real) {
    auto m = LoadModel(data_dir + "/models/stories260k/model.bin");
    if (!m.ok()) return Fail("load stories260k", m.status());
    stories = std::move(*m);
    stories->name = "stories260k";
    auto t = BpeTokenizer::Load(data_dir + "/models/stories260k/tokenizer.bin",
                                stories->config.vocab_size);
    if (!t.ok()) return Fail("load stories260k tokenizer", t.status());
    tok = std::move(*t);
    auto e = ReadFile(data_dir + "/models/stories260k/expected_greedy_200.txt");
    if (!e.ok()) return Fail("read expected_greedy_200.txt", e.status());
    expected = *e;
    auto text = ReadFile(data_dir + "/text/tinystories_val.txt");
    if (!text.ok()) return Fail("read tinystories_val.txt", text.status());
    size_t n = std::min<size_t>(text->size(),
                                std::max(0, absl::GetFlag(FLAGS_nll_chars)));
    // Do not cut a UTF-8 character.
    while (n > 0 && n < text->size() &&
           (static_cast<unsigned char>((*text)[n]) & 0xC0) == 0x80) {
      --n;
    }
    nll_text = text->substr(0, n);
  } else {
    ModelConfig sc;
    sc.dim = 64;
    sc.hidden_dim = 160;
    sc.n_layers = 2;
    sc.n_heads = 4;
    sc.n_kv_heads = 2;
    sc.vocab_size = 260;
    sc.max_seq_len = 512;
    stories = MakeSyntheticModel(sc, 1234);
    tok = std::make_unique<ByteTokenizer>();
    for (int i = 0; static_cast<int>(nll_text.size()) <
                    std::min(4000, absl::GetFlag(FLAGS_nll_chars));
         ++i) {
      nll_text +=
          absl::StrCat("The quick brown fox jumps over the lazy dog ", i, ". ");
    }
  }

  // (a)
  if (run_a) {
    const int steps = real ? absl::GetFlag(FLAGS_greedy_steps)
                           : std::min(64, absl::GetFlag(FLAGS_greedy_steps));
    if (absl::Status s =
            StepGreedy(*stories, *tok, c, expected, real && steps == 200, steps,
                       threads, &checks, &report);
        !s.ok()) {
      return Fail("(a) greedy decoding", s);
    }
    if (real && steps != 200) {
      std::printf(
          "NOTE: --greedy_steps=%d, the known answer is for 200 steps; not "
          "compared\n",
          steps);
    }
  }
  // (b)
  if (!run_b) {
    std::printf("\n== (b) BFCL session not requested (--steps) ==\n");
    report.emplace_back("(b) not run (--steps)");
  } else if (real) {
    auto policy = SetUpTriaxialPolicy(c, absl::GetFlag(FLAGS_calibration),
                                      absl::GetFlag(FLAGS_budget_bits));
    if (!policy.ok()) return Fail("(b) triaxial policy", policy.status());
    if (absl::Status s = StepBfcl(
            data_dir, c, opts.tenant_id, *policy, absl::GetFlag(FLAGS_bfcl_id),
            absl::GetFlag(FLAGS_max_context), chunk, threads, &checks, &report);
        !s.ok()) {
      return Fail("(b) BFCL session", s);
    }
  } else {
    std::printf("\n== (b) BFCL session SKIPPED: no data directory ==\n");
    report.emplace_back("(b) SKIPPED (no data directory)");
  }
  // (c)
  if (!run_c) {
    report.emplace_back("(c) not run (--steps)");
  } else if (absl::Status s =
                 StepNll(*stories, *tok, nll_text, c, chunk, threads,
                         absl::GetFlag(FLAGS_decode_steps), &checks, &report);
             !s.ok()) {
    return Fail("(c) NLL", s);
  }

  bool ok = true;
  std::printf("\n================ kvdemo report ================\n");
  if (!real) std::printf("*** SYNTHETIC MODEL: data directory missing ***\n");
  for (const auto& line : report) std::printf("%s\n", line.c_str());
  std::printf("-- checks --\n");
  for (const auto& ch : checks) {
    std::printf("[%s] %s (%s)\n", ch.passed ? "PASS" : "FAIL", ch.name.c_str(),
                ch.detail.c_str());
    ok = ok && ch.passed;
  }
  std::printf("total time %.1f s; result: %s\n", Seconds(t_all),
              ok ? "ALL CHECKS PASSED" : "FAILED");
  return ok ? 0 : 2;
}

}  // namespace
}  // namespace triax::frontend

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return triax::frontend::Main();
}
