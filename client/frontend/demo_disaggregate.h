// kvdemo's prefill-on-one-worker, decode-on-another (TransferSequence):
// step (a)'s greedy run, the choice of the decode worker, and what a failed
// transfer does under --transfer_failure_policy (as vLLM's
// kv_load_failure_policy: "recompute" prefills again on the decode worker,
// "fail" returns the transfer's status).
//
// Thread contract: functions of one client, not for concurrent use of it.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "client/kv_client.h"
#include "triax/v1/manager.pb.h"

namespace triax::frontend {

// How many workers are UP.
absl::StatusOr<int> UpWorkers(client::Client* c);
// The first UP worker by id other than `not_this`; FAILED_PRECONDITION when
// there is none.
absl::StatusOr<std::string> OtherUpWorker(client::Client* c,
                                          const std::string& not_this);
// The id of the worker an open sequence is on (the manager's view).
absl::StatusOr<std::string> WorkerOf(client::Client* c,
                                     const client::SequenceHandle& seq);

// Prints "transfer failed: STATUS; the sequence stays on SOURCE
// (--transfer_failure_policy=...)" and returns `recompute`.
bool RecomputeAfterFailedTransfer(bool recompute, const absl::Status& error,
                                  const std::string& source);

// A sequence prefilled on one worker and moved to (or, after a failed
// transfer under "recompute", prefilled again on) another.
struct DisaggregatedResult {
  std::string text;                       // greedy text (step (a))
  v1::TransferSequenceResponse transfer;  // empty when the transfer failed
  std::string prefill_worker, decode_worker;
  absl::Status transfer_error;  // OK when the transfer succeeded
  bool recomputed = false;
  double prefill_seconds = 0, transfer_seconds = 0, decode_seconds = 0;
  double recompute_seconds = 0;
  int decode_steps = 0;
};

// The first `prefill` of `tokens` (a local greedy run's inputs: BOS and
// what it generated; `pieces` the text each step added) are prefilled in
// one forward pass into a sequence (policy bf16) on the worker placement
// picks; the sequence moves to the decode worker (OtherUpWorker) and greedy
// decoding goes on there up to `steps` steps in all. The text equals the
// local run's when the transfer moved every byte. When the transfer fails:
// `recompute` false returns its status; true opens a new sequence on the
// decode worker, closes the first one (which kept serving until then),
// prefills again there and decodes. The sequence is closed at the end
// either way.
absl::StatusOr<DisaggregatedResult> PrefillThenDecodeElsewhere(
    Transformer* tf, const Tokenizer& tok, client::Client* c,
    const Model& model, const std::vector<int>& tokens,
    const std::vector<std::string>& pieces, int prefill, int steps,
    bool recompute);

}  // namespace triax::frontend
