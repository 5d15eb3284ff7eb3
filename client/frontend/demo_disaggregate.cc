#include "client/frontend/demo_disaggregate.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/frontend/service_kv_store.h"
#include "client/frontend/service_types.h"
#include "common/status_macros.h"

namespace triax::frontend {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// UP workers' ids, ordered by id (as ListWorkers answers; every page).
absl::StatusOr<std::vector<std::string>> UpWorkerIds(client::Client* c) {
  TRIAX_ASSIGN_OR_RETURN(const v1::ListWorkersResponse resp, c->ListWorkers());
  std::vector<std::string> up;
  for (const v1::WorkerInfo& w : resp.workers()) {
    if (w.state() == v1::WORKER_STATE_UP) up.push_back(w.worker_id());
  }
  return up;
}

}  // namespace

absl::StatusOr<int> UpWorkers(client::Client* c) {
  TRIAX_ASSIGN_OR_RETURN(std::vector<std::string> up, UpWorkerIds(c));
  return static_cast<int>(up.size());
}

absl::StatusOr<std::string> OtherUpWorker(client::Client* c,
                                          const std::string& not_this) {
  TRIAX_ASSIGN_OR_RETURN(std::vector<std::string> up, UpWorkerIds(c));
  for (const std::string& id : up) {
    if (id != not_this) return id;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("no UP worker besides \"", not_this, "\" to decode on"));
}

absl::StatusOr<std::string> WorkerOf(client::Client* c,
                                     const client::SequenceHandle& seq) {
  TRIAX_ASSIGN_OR_RETURN(v1::SequenceInfo info,
                         c->GetSequence(seq.sequence_id));
  return info.worker_id();
}

bool RecomputeAfterFailedTransfer(bool recompute, const absl::Status& error,
                                  const std::string& source) {
  std::printf(
      "transfer failed: %s; the sequence stays on %s "
      "(--transfer_failure_policy=%s)\n",
      error.ToString().c_str(), source.c_str(),
      recompute ? "recompute" : "fail");
  std::fflush(stdout);
  return recompute;
}

absl::StatusOr<DisaggregatedResult> PrefillThenDecodeElsewhere(
    Transformer* tf, const Tokenizer& tok, client::Client* c,
    const Model& model, const std::vector<int>& tokens,
    const std::vector<std::string>& pieces, int prefill, int steps,
    bool recompute) {
  prefill = std::min<int>(prefill, static_cast<int>(tokens.size()));
  if (prefill < 1) return absl::InvalidArgumentError("nothing to prefill");
  const int vocab = model.config.vocab_size;
  const std::vector<int> prompt(tokens.begin(), tokens.begin() + prefill);
  const std::vector<v1::Span> spans = {ServiceSpan(Role::kUser, prefill)};
  TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle seq,
                         c->Open(ServiceShape(model), spans, "bf16"));
  auto kv = std::make_unique<ServiceKvStore>(c, &seq, model.config.n_kv_heads,
                                             model.config.head_dim());
  DisaggregatedResult r;
  auto run = [&]() -> absl::Status {
    std::vector<float> logits;
    auto t0 = Clock::now();
    TRIAX_RETURN_IF_ERROR(tf->Forward(prompt, 0, kv.get(), &logits));
    r.prefill_seconds = Seconds(t0);
    TRIAX_ASSIGN_OR_RETURN(r.prefill_worker, WorkerOf(c, seq));
    TRIAX_ASSIGN_OR_RETURN(r.decode_worker, OtherUpWorker(c, r.prefill_worker));
    client::Client::TransferOptions to;
    to.destination_worker_id = r.decode_worker;
    t0 = Clock::now();
    absl::StatusOr<v1::TransferSequenceResponse> moved =
        c->TransferSequence(&seq, to);
    r.transfer_seconds = Seconds(t0);
    if (moved.ok()) {
      r.transfer = *std::move(moved);
    } else {
      r.transfer_error = moved.status();
      if (!RecomputeAfterFailedTransfer(recompute, r.transfer_error,
                                        r.prefill_worker)) {
        return r.transfer_error;
      }
      client::OpenOptions on_decode;
      on_decode.policy = "bf16";
      on_decode.worker_id = r.decode_worker;
      TRIAX_ASSIGN_OR_RETURN(client::SequenceHandle again,
                             c->Open(ServiceShape(model), spans, on_decode));
      const absl::Status closed = c->Close(seq);
      if (!closed.ok()) {
        c->Close(again).IgnoreError();  // the original error is the answer
        return closed;
      }
      seq = std::move(again);
      kv = std::make_unique<ServiceKvStore>(c, &seq, model.config.n_kv_heads,
                                            model.config.head_dim());
      t0 = Clock::now();
      TRIAX_RETURN_IF_ERROR(tf->Forward(prompt, 0, kv.get(), &logits));
      r.recompute_seconds = Seconds(t0);
      r.recomputed = true;
      std::printf("recomputed the prefill of %d tokens on %s (%.3f s)\n",
                  prefill, r.decode_worker.c_str(), r.recompute_seconds);
    }
    for (int i = 0; i + 1 < prefill; ++i) r.text += pieces[i];
    int token = prompt.back();
    const float* last = logits.data() + size_t(prefill - 1) * vocab;
    t0 = Clock::now();
    for (int pos = prefill - 1; pos < steps; ++pos) {
      if (pos >= prefill) {
        TRIAX_RETURN_IF_ERROR(c->Extend(&seq,
                                        {ServiceSpan(Role::kAssistant, 1)},
                                        /*new_turn=*/false,
                                        /*continue_last_span=*/true));
        TRIAX_RETURN_IF_ERROR(tf->Forward({&token, 1}, pos, kv.get(), &logits));
        last = logits.data();
      }
      const int next = Argmax(last, vocab);
      ++r.decode_steps;
      if (next == tok.bos_id()) break;
      r.text += tok.Printable(token, next);
      token = next;
    }
    r.decode_seconds = Seconds(t0);
    return absl::OkStatus();
  };
  const absl::Status s = run();
  const absl::Status close = c->Close(seq);
  TRIAX_RETURN_IF_ERROR(s);
  TRIAX_RETURN_IF_ERROR(close);
  return r;
}

}  // namespace triax::frontend
