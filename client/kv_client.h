// C++ client library for inference frontends: one object that talks to the
// manager (plans, budgets) and to the worker a sequence is placed on (KV
// bytes, attention). Thread-safe: methods may run concurrently (the worker
// stub cache is locked; request ids come from an atomic counter), but one
// SequenceHandle must not be passed to Extend while another thread uses it.
//
// Every method returns absl::Status / StatusOr with the server's canonical
// code and message, prefixed with the call that failed, e.g.
// "OpenSequence: tenant budget ..." or "AllocatePages: ...". Every RPC has a
// deadline of rpc_timeout_ms (DEADLINE_EXCEEDED past it). Mutating calls get a
// fresh request id per call and are retried once on UNAVAILABLE with the same
// id (safe: servers are idempotent). Reads are retried once too; an Attend
// that appends K/V is not (it carries no request id).
//
// Attend and spilled blocks: when the worker answers an item with
// UNAVAILABLE and retry_after_ms > 0 (blocks of the sequence are spilled to
// the host or disk tier, the worker runs with restore-on-attend off and has
// queued their restore), the Attend is sent again after that delay, at most
// ClientOptions::attend_retries times and never past rpc_timeout_ms counted
// from the first attempt; then the UNAVAILABLE is returned with the delay in
// the message ("retry after N ms; gave up after R retries ..."). This holds
// for Attends that carry an append too: the worker checks residency before
// it writes (worker/store_attend.cc, EnsureResident ahead of the append),
// so that answer means nothing was written. A transport-level UNAVAILABLE of
// an appending Attend is still not retried (the write may have landed).
//
// Connect does not dial: channels connect lazily, so an unreachable manager
// or worker surfaces as UNAVAILABLE on the first call that needs it.
//
// Compound calls and their partial failures:
//   Open   = manager OpenSequence + worker AllocatePages; when the worker
//            fails, the manager sequence is closed again (best effort).
//            When the manager reused a cached prefix, worker ForkSequence
//            of the prefix's sequence (the prefix's pages shared, the rest
//            allocated) instead of AllocatePages; when the worker refuses
//            the fork (e.g. the prefix is not written yet), the sequence is
//            closed and opened again with no_reuse.
//   Extend = manager ExtendSequence + worker AllocatePages of the full plan;
//            the handle is updated only when both succeed. When the worker
//            refuses, the manager's plan is truncated back to the tokens it
//            had (TruncateSequence), so the sequence stays usable and the
//            call can be retried; the worker's error is returned (with a
//            note if the truncation failed too: then Close the sequence).
//   Fork   = manager ForkSequence + worker ForkSequence on the parent's
//            worker; on a worker failure the child is closed again.
//   DemoteBlocks = manager DemoteBlocks (which itself drives the worker's
//            Demote and commits the plan); the handle's plan is refreshed
//            from the reply. A failure leaves the handle unchanged.
//   TransferSequence = manager TransferSequence (which itself drives the
//            destination worker's ImportSequence, commits and frees the
//            source); the handle's plan and worker address are refreshed
//            from the reply. A failure leaves the handle unchanged (the
//            source copy stays authoritative).
//   Close  = worker FreePages + manager CloseSequence; the manager is told
//            even when the worker answers NOT_FOUND or UNAVAILABLE (a gone
//            worker holds nothing); any other worker error is returned
//            without closing on the manager.
#pragma once

#include <grpcpp/security/credentials.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/sequence_call_stream.h"
#include "common/model_proto.h"
#include "kernels/layout.h"
#include "triax/v1/manager.grpc.pb.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::client {

struct ClientOptions {
  // host:port, or several comma-separated (managers on etcd: calls move to
  // the leader — a standby's UNAVAILABLE names it — and are retried there;
  // see Client::CallWithRetry).
  std::string manager_address;
  // How long a call keeps looking for a leader across several managers
  // (a failover takes about the leader lease's TTL).
  int failover_ms = 15000;
  std::string tenant_id;
  // Bearer token every call carries (kvmanager --auth=token;
  // docs/security.md); empty: none.
  std::string token;
  int64_t rpc_timeout_ms = 30000;
  // Read-only Attends answered UNAVAILABLE with retry_after_ms > 0 are sent
  // again at most this many times (>= 0; 0: never).
  int attend_retries = 50;
  // Of the channels to the managers and workers: TLS (and a client
  // certificate) from triax::ChannelCredentials (common/tls.h); null:
  // plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // With TLS: the name workers' certificates are verified against instead
  // of the address dialed (docs/security.md); empty: the address.
  std::string tls_worker_server_name;
  // Workers on this host served on their --local_listen sockets: worker
  // address (as the manager gives it) -> "unix:/PATH". The data-plane calls
  // to such a worker go over the socket (no TCP, no TLS); others as above.
  // ParseWorkerSockets reads the flag form.
  std::map<std::string, std::string> worker_sockets;
  // The sequence calls to the manager (Open, Extend, Close, Fork, Truncate,
  // GetSequence, ReportAccess) on one Manager.SequenceCalls stream per
  // manager address, shared by this client's threads (client/
  // sequence_call_stream.h), instead of one unary RPC each: fewer bytes and
  // far less of the manager's CPU per call when a frontend makes many calls
  // a second (bench/results/manager.md "Call streams"). Same answers,
  // deadlines and retries; a manager without the stream (UNIMPLEMENTED)
  // gets the unary RPCs from then on.
  bool manager_stream = false;
};

// "ADDRESS=unix:/PATH,..." (kvctl's and kvdemo's --worker_sockets) as
// ClientOptions::worker_sockets: INVALID_ARGUMENT naming the entry for one
// without '=', an address given twice, or a socket that is not "unix:/...".
absl::StatusOr<std::map<std::string, std::string>> ParseWorkerSockets(
    absl::string_view flag_value);

// A sequence opened through the client: its plan and the worker it lives on.
struct SequenceHandle {
  std::string sequence_id;
  std::string worker_address;
  triax::v1::ModelShape model;
  uint32_t block_tokens = 0;
  std::vector<triax::v1::BlockPlan> blocks;  // current plan
  uint64_t num_tokens = 0;                   // planned tokens
  // BF16 recent window asked for at Open (sent with every AllocatePages);
  // empty: the worker's --window_tokens.
  std::optional<uint32_t> window_tokens;
  // Prefix reuse: Open shared tokens [0, prefix_tokens) with
  // prefix_sequence_id (their KV is there already: prefill from
  // prefix_tokens on); 0 when nothing was reused.
  std::string prefix_sequence_id;
  uint64_t prefix_tokens = 0;
  // With kvmanager --auth=token: the manager's capabilities for this
  // sequence's worker calls (SequenceInfo.capabilities, renewed by every
  // reply that refreshes the handle); sent with each worker call.
  std::vector<triax::v1::Capability> capabilities;
};

// Options of Open beyond the model and spans.
struct OpenOptions {
  std::string policy;         // empty: the tenant's default policy
  uint32_t block_tokens = 0;  // 0: the manager's default
  // BF16 recent window of the sequence on the worker, in tokens (0: none);
  // empty: the worker's --window_tokens. The manager keeps it for the
  // sequence's transfers.
  std::optional<uint32_t> window_tokens;
  // The worker to open on; empty: the manager's placement.
  std::string worker_id;
  // Prefix reuse (docs/client.md "Prefix reuse"): the prompt's token ids,
  // one per token of the spans (or none). The manager shares the longest
  // cached prefix of the tenant's open sequences; Open then forks the
  // worker's pages of that prefix instead of allocating them, and the
  // handle's prefix_tokens says where the prefill starts. no_reuse
  // registers the hashes but shares nothing.
  std::vector<uint32_t> token_ids;
  bool no_reuse = false;
};

// kernels::EncodingName as a string ("int4", "k=int4,v=int2,g=64", ...).
// A block plan's encoding is triax::EncodingFromProto(plan)
// (common/model_proto.h).
std::string EncodingLabel(const kernels::Encoding& e);

// The new encoding of one block for DemoteBlocks. format_v
// FORMAT_UNSPECIFIED means "same as format"; group_size 0 the default (32);
// scale_dtype unspecified FP16.
triax::v1::BlockEncoding MakeBlockEncoding(
    uint64_t lineage_id, triax::v1::Format format,
    triax::v1::Format format_v = triax::v1::FORMAT_UNSPECIFIED,
    uint32_t group_size = 0,
    triax::v1::ScaleDtype scale_dtype = triax::v1::SCALE_DTYPE_UNSPECIFIED);

// How Attend's queries and outputs travel (AttendItem.dtype): float32, or
// BF16 (half the bytes: the client rounds the queries to BF16, the worker
// attends in float32 and rounds its output to BF16; both roundings to
// nearest even).
enum class AttendWire { kF32, kBF16 };

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const ClientOptions& options);

  // Manager-side plan + worker-side page allocation, in one call.
  absl::StatusOr<SequenceHandle> Open(const triax::v1::ModelShape& model,
                                      const std::vector<triax::v1::Span>& spans,
                                      const std::string& policy = "",
                                      uint32_t block_tokens = 0);
  absl::StatusOr<SequenceHandle> Open(const triax::v1::ModelShape& model,
                                      const std::vector<triax::v1::Span>& spans,
                                      const OpenOptions& options);
  // Plans more tokens (a new turn, or decoded tokens) and allocates them.
  // token_ids (one per new token, or none) grow the sequence's prefix hash
  // chain (ExtendSequenceRequest.token_ids).
  absl::Status Extend(SequenceHandle* seq,
                      const std::vector<triax::v1::Span>& spans, bool new_turn,
                      bool continue_last_span,
                      const std::vector<uint32_t>& token_ids = {});
  absl::StatusOr<SequenceHandle> Fork(const SequenceHandle& parent,
                                      uint64_t num_tokens);
  absl::Status Close(const SequenceHandle& seq);
  // Re-encodes blocks of `seq` in place through the manager (each entry names
  // a block by lineage id; see MakeBlockEncoding) and refreshes seq->blocks
  // from the committed plan. Returns the change of the tenant's device bytes
  // (negative when freed). Errors: the manager's (INVALID_ARGUMENT for an
  // encoding invalid for the model, PERMISSION_DENIED, RESOURCE_EXHAUSTED
  // when growth is over budget, ABORTED when the sequence changed meanwhile:
  // retry) or the worker's, prefixed "DemoteBlocks: ".
  absl::StatusOr<int64_t> DemoteBlocks(
      SequenceHandle* seq,
      const std::vector<triax::v1::BlockEncoding>& encodings);

  // Moves a sequence to another worker (manager TransferSequence; see
  // docs/manager.md "Transfers"). The call's deadline is the transfer's bound
  // (timeout_ms, or 10000 when 0: the manager's default) plus 5 s, and at
  // least rpc_timeout_ms. Returns the manager's reply (the sequence after the
  // commit and the figures: blocks, pages, wire and BF16 bytes, seconds).
  // Errors: the manager's (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED,
  // FAILED_PRECONDITION, UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED) or the
  // destination worker's (DATA_LOSS for a checksum mismatch,
  // DEADLINE_EXCEEDED past the bound), prefixed "TransferSequence: ".
  struct TransferOptions {
    std::string destination_worker_id;  // empty: placement chooses
    std::string destination_policy;     // empty: encodings unchanged
    uint32_t timeout_ms = 0;            // 0: the manager's default
    bool follow_writes = false;         // layer by layer behind the writes
    // A prefix hit: blocks [0, first_block) are on the destination already,
    // held by its sequence destination_prefix_sequence_id; only the others
    // move (reply: shared_blocks). 0: every block moves.
    uint32_t first_block = 0;
    std::string destination_prefix_sequence_id;
  };
  absl::StatusOr<triax::v1::TransferSequenceResponse> TransferSequence(
      const std::string& sequence_id, const TransferOptions& options);
  // The same for a handle: on success seq's plan and worker address are the
  // destination's (window_tokens kept). INVALID_ARGUMENT for null.
  absl::StatusOr<triax::v1::TransferSequenceResponse> TransferSequence(
      SequenceHandle* seq, const TransferOptions& options);

  // Writes K/V for tokens [first_token, first_token + num_tokens) of `layer`.
  // k, v: float32 [num_tokens][n_kv_heads][head_dim]; sent as BF16.
  absl::Status WriteKV(const SequenceHandle& seq, uint32_t layer,
                       uint64_t first_token, uint32_t num_tokens,
                       const float* k, const float* v);
  // Attention for `num_queries` queries of `layer`; query i attends to tokens
  // [0, positions[i]]. q, out: float32 [num_queries][n_q_heads][head_dim].
  // When append_k/append_v are given, tokens [append_first, append_first +
  // append_tokens) are written first in the same RPC. Spilled blocks: see
  // the header comment (waits and retries on retry_after_ms).
  struct AttendArgs {
    uint32_t layer = 0;
    uint32_t num_queries = 1;
    const uint64_t* positions = nullptr;
    const float* q = nullptr;
    float* out = nullptr;
    const float* append_k = nullptr;
    const float* append_v = nullptr;
    uint64_t append_first = 0;
    uint32_t append_tokens = 0;
  };
  absl::Status Attend(const SequenceHandle& seq, const AttendArgs& args);
  // A decode step's layer for a batch: one Attend RPC carrying every item
  // (each a sequence's queries of one layer, with its append), which the
  // worker runs as one device batch (docs/worker.md "Semantics"). Every
  // item's sequence must be on the same worker, and their capabilities go
  // with the call. `wire`: queries and outputs as float32 or BF16 on the
  // wire (q and out stay float32 here). Returns one status per item (OK:
  // its out filled; else the worker's code and "AttendBatch: items[<i>]:
  // ...");
  // the call's own status for what fails them all: INVALID_ARGUMENT
  // checked locally naming the item (no items, a null seq, q or out, a
  // bad append, sequences on several workers), transport errors and the
  // worker's refusals of the whole call (tenant, capabilities). Unlike
  // Attend, items answered UNAVAILABLE for spilled blocks are not
  // retried: their message says "retry after <N> ms". Retried once on a
  // transport UNAVAILABLE only when no item appends. For the layers of a
  // step one after another, AttendStream (client/attend_stream.h) keeps
  // them on one stream.
  struct BatchItem {
    const SequenceHandle* seq = nullptr;
    AttendArgs args;
  };
  absl::StatusOr<std::vector<absl::Status>> AttendBatch(
      const std::vector<BatchItem>& items, AttendWire wire = AttendWire::kF32);
  // Reads back K/V as float32 [num_tokens][n_kv_heads][head_dim].
  absl::Status ReadKV(const SequenceHandle& seq, uint32_t layer,
                      uint64_t first_token, uint32_t num_tokens,
                      std::vector<float>* k, std::vector<float>* v);

  // The manager's view of a sequence of this tenant (plan, state, lost
  // lineage ids).
  absl::StatusOr<triax::v1::SequenceInfo> GetSequence(
      const std::string& sequence_id);
  // Replaces seq's plan (blocks with their tier and evicted flag, tokens,
  // worker address) with the manager's current one, keeping window_tokens.
  // The manager changes plans on its own under memory pressure (demotions,
  // spills, evictions). Errors as GetSequence; INVALID_ARGUMENT for null.
  absl::Status RefreshPlan(SequenceHandle* seq);

  // Memory pressure (manager ReportAccess): `lineage_ids` (blocks of seq's
  // plan, at most 4096) were attended together; `weights` is empty (equal
  // shares) or one attention share in [0, 1] per id. `active` says the
  // sequence is about to be used, so the manager prefetches its spilled
  // blocks; lineage_ids may then be empty. Returns the number of restores
  // the report started. INVALID_ARGUMENT (checked locally, naming the field
  // and value) for an empty sequence id, a zero lineage id, more than 4096
  // ids, weights of another length or outside [0, 1], or no ids without
  // `active`; otherwise the manager's errors (NOT_FOUND unknown sequence,
  // PERMISSION_DENIED another tenant's), prefixed "ReportAccess: ".
  absl::StatusOr<uint32_t> ReportAccess(
      const SequenceHandle& seq, const std::vector<uint64_t>& lineage_ids,
      const std::vector<float>& weights, bool active);
  // The manager's pressure view: pools, tenants against floor/ceiling, mode,
  // counters and the `top` cheapest ranked actions (0: the manager's default
  // of 20). INVALID_ARGUMENT for top > 10000; the manager's errors prefixed
  // "GetPressure: " (UNIMPLEMENTED from a manager without pressure support).
  absl::StatusOr<triax::v1::GetPressureResponse> GetPressure(uint32_t top);

  // Operator lists (the manager's List RPCs and QueryTrace, which answer a
  // page at a time: docs/manager.md "Paging"). Each follows next_page_token
  // until the last page, asking `page_size` items a page (0: the manager's
  // default, 1000), and returns every item in one response, in the
  // manager's order, with next_page_token empty. A page that fails
  // UNAVAILABLE is asked once more; errors are prefixed with the RPC's name
  // (INVALID_ARGUMENT for a negative page_size, checked locally; INTERNAL
  // when the manager hands back the token it was given, which would never
  // end). Items added or removed during the walk may or may not appear;
  // every item present throughout appears once.
  absl::StatusOr<triax::v1::ListWorkersResponse> ListWorkers(
      int32_t page_size = 0);
  absl::StatusOr<triax::v1::ListTenantsResponse> ListTenants(
      int32_t page_size = 0);
  absl::StatusOr<triax::v1::ListSequencesResponse> ListSequences(
      const std::string& tenant_id, bool include_closed, int32_t page_size = 0);
  absl::StatusOr<triax::v1::ListPoliciesResponse> ListPolicies(
      int32_t page_size = 0);
  // Every page's block and sequence_id are the same; the events add up.
  absl::StatusOr<triax::v1::QueryTraceResponse> QueryTrace(
      uint64_t lineage_id, int32_t page_size = 0);

  // The manager calls go to now (the leader, when several are given).
  triax::v1::Manager::Stub* manager() { return manager_stub(); }
  // Stub for a worker address (cached). FAILED_PRECONDITION for "".
  absl::StatusOr<triax::v1::Worker::Stub*> worker(const std::string& address);
  const ClientOptions& options() const { return options_; }

  // A fresh request id, unique across clients: "c<16 hex>-<counter>".
  std::string NewRequestId();

  // Adds the bearer token (ClientOptions::token) to a call made on a stub
  // of this client (kvctl's own calls).
  void Authorize(grpc::ClientContext* ctx) const;

 private:
  Client() = default;

  void SetDeadline(grpc::ClientContext* ctx) const;
  // The walk of the List functions above (kv_client_list.cc): `page(req,
  // resp)` asks one page of req (page fields set) into resp; `append(resp,
  // all)` moves the page's items into all.
  template <typename Req, typename Resp>
  absl::StatusOr<Resp> AllPages(
      absl::string_view what, Req req,
      const std::function<grpc::Status(grpc::ClientContext*, const Req&,
                                       Resp*)>& page,
      const std::function<void(Resp*, Resp*)>& append);
  // Runs `call` with a fresh context and deadline; once more when it fails
  // with UNAVAILABLE and `retry` is set. The status is prefixed with `what`.
  absl::Status CallWithRetry(
      absl::string_view what, bool retry,
      const std::function<grpc::Status(grpc::ClientContext*)>& call);
  // A sequence call to the manager in use: on its SequenceCalls stream
  // with ClientOptions::manager_stream (ctx's deadline is the call's), else
  // the unary `rpc`.
  template <typename Req, typename Resp>
  grpc::Status ManagerCall(grpc::Status (triax::v1::Manager::Stub::*rpc)(
                               grpc::ClientContext*, const Req&, Resp*),
                           grpc::ClientContext* ctx, const Req& req,
                           Resp* resp);
  // AllocatePages of the full plan in `info` on its worker.
  absl::Status AllocateOnWorker(const triax::v1::SequenceInfo& info,
                                std::optional<uint32_t> window_tokens);
  // Undoes a manager-side open/fork after a worker failure; errors dropped.
  void CloseOnManagerQuietly(const std::string& sequence_id);
  // Worker ForkSequence of info's reused prefix (prefix_sequence_id's first
  // prefix_tokens tokens) into info's sequence, with info's whole plan.
  absl::Status ForkPrefixOnWorker(const triax::v1::SequenceInfo& info);
  // Undoes a manager-side extend after a worker failure: the plan back to
  // `num_tokens` tokens.
  absl::Status TruncateOnManager(const std::string& sequence_id,
                                 uint64_t num_tokens);

  ClientOptions options_;
  // One stub per manager address; calls use managers_[current_manager_].
  std::vector<std::string> manager_addresses_;
  std::vector<std::unique_ptr<triax::v1::Manager::Stub>> managers_;
  std::atomic<size_t> current_manager_{0};
  // With manager_stream: one per manager address (managers_' order);
  // false once a manager answered the stream UNIMPLEMENTED.
  std::vector<std::unique_ptr<SequenceCallStream>> call_streams_;
  std::atomic<bool> use_call_streams_{false};
  triax::v1::Manager::Stub* manager_stub() const {
    return managers_[current_manager_.load()].get();
  }
  // After an UNAVAILABLE from the manager in use: moves to the leader the
  // answer names, else to the next address. False with one address.
  bool FollowLeader(const absl::Status& s);
  std::string request_prefix_;
  std::atomic<uint64_t> next_request_{0};
  absl::Mutex workers_mu_;
  std::map<std::string, std::unique_ptr<triax::v1::Worker::Stub>> workers_
      ABSL_GUARDED_BY(workers_mu_);
};

}  // namespace triax::client
