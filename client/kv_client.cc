#include "client/kv_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/bearer.h"
#include "common/capability.h"
#include "common/grpc_status.h"
#include "common/ids.h"
#include "common/local_socket.h"
#include "common/status_macros.h"
#include "kernels/numeric.h"

namespace triax::client {
namespace {

using triax::v1::BlockPlan;
using triax::v1::SequenceInfo;

// WriteKV chunks carry at most this many tokens, and at most about this many
// bytes, so that big models stay under gRPC's default 4 MiB message limit.
constexpr uint32_t kMaxChunkTokens = 256;
constexpr size_t kMaxChunkBytes = 1 << 20;
// Limits of the manager's ReportAccess and GetPressure (manager.proto).
constexpr size_t kMaxReportedBlocks = 4096;
constexpr uint32_t kMaxPressureTop = 10000;

// Same code, the failing call named in front of the server's message.
absl::Status Prefixed(absl::string_view what, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    const std::string& server_name = "") {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  const bool unix_socket = triax::IsUnixAddress(address);
  if (credentials != nullptr && !server_name.empty() && !unix_socket) {
    args.SetSslTargetNameOverride(server_name);
  }
  // A unix: address (a daemon's --local_listen) dials with local
  // credentials whatever the TLS settings of TCP addresses are.
  return grpc::CreateCustomChannel(
      address, triax::ChannelCredentialsFor(address, credentials), args);
}

std::string Bf16Bytes(const float* src, size_t n) {
  std::string out(n * sizeof(uint16_t), '\0');
  char* dst = out.data();
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = triax::kernels::FloatToBf16(src[i]);
    std::memcpy(dst + i * sizeof(uint16_t), &h, sizeof(h));
  }
  return out;
}

// Elements per token of K (or V) for `model`.
absl::StatusOr<size_t> TokenElems(const triax::v1::ModelShape& model) {
  if (model.n_kv_heads() == 0 || model.head_dim() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model shape has n_kv_heads=", model.n_kv_heads(),
                     " head_dim=", model.head_dim(), "; both must be >= 1"));
  }
  return static_cast<size_t>(model.n_kv_heads()) * model.head_dim();
}

// Appends `bytes` (float32 or BF16 by `dtype`) as floats to `out`.
absl::Status AppendAsFloat(triax::v1::KvDtype dtype, const std::string& bytes,
                           std::vector<float>* out) {
  if (dtype == triax::v1::KV_DTYPE_F32) {
    if (bytes.size() % sizeof(float) != 0) {
      return absl::InternalError(absl::StrCat("F32 chunk of ", bytes.size(),
                                              " bytes is not a multiple of 4"));
    }
    const size_t n = bytes.size() / sizeof(float);
    const size_t old = out->size();
    out->resize(old + n);
    std::memcpy(out->data() + old, bytes.data(), bytes.size());
    return absl::OkStatus();
  }
  if (dtype == triax::v1::KV_DTYPE_BF16) {
    if (bytes.size() % sizeof(uint16_t) != 0) {
      return absl::InternalError(absl::StrCat("BF16 chunk of ", bytes.size(),
                                              " bytes is not a multiple of 2"));
    }
    const size_t n = bytes.size() / sizeof(uint16_t);
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + i * sizeof(uint16_t), sizeof(h));
      out->push_back(triax::kernels::Bf16ToFloat(h));
    }
    return absl::OkStatus();
  }
  return absl::InternalError(
      absl::StrCat("chunk has unsupported dtype ", static_cast<int>(dtype)));
}

void FillHandle(const SequenceInfo& info, SequenceHandle* h) {
  h->sequence_id = info.sequence_id();
  h->worker_address = info.worker_address();
  h->model = info.model();
  h->block_tokens = info.block_tokens();
  h->blocks.assign(info.blocks().begin(), info.blocks().end());
  h->num_tokens = info.num_tokens();
  h->capabilities.assign(info.capabilities().begin(),
                         info.capabilities().end());
}

std::vector<triax::v1::Capability> CapabilitiesOf(const SequenceInfo& info) {
  return {info.capabilities().begin(), info.capabilities().end()};
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const ClientOptions& options) {
  if (options.manager_address.empty()) {
    return absl::InvalidArgumentError(
        "Connect: manager_address is empty; want host:port");
  }
  if (!options.tenant_id.empty()) {
    TRIAX_RETURN_IF_ERROR(
        Prefixed("Connect", ValidateId("tenant_id", options.tenant_id)));
  }
  if (options.attend_retries < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Connect: attend_retries=", options.attend_retries, " must be >= 0"));
  }
  if (options.rpc_timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Connect: rpc_timeout_ms=", options.rpc_timeout_ms, " must be > 0"));
  }
  std::unique_ptr<Client> c(new Client());
  c->options_ = options;
  c->manager_addresses_ =
      absl::StrSplit(options.manager_address, ',', absl::SkipEmpty());
  for (const std::string& a : c->manager_addresses_) {
    c->managers_.push_back(
        triax::v1::Manager::NewStub(MakeChannel(a, options.credentials)));
  }
  if (options.manager_stream) {
    for (const auto& stub : c->managers_) {
      c->call_streams_.push_back(
          std::make_unique<SequenceCallStream>(stub.get(), options.token));
    }
    c->use_call_streams_ = true;
  }
  if (c->managers_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Connect: manager_address \"", options.manager_address,
                     "\" names no host:port"));
  }
  std::random_device rd;
  const uint64_t r =
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(
          std::chrono::steady_clock::now().time_since_epoch().count());
  c->request_prefix_ = absl::StrFormat("c%016x", r);
  return c;
}

std::string Client::NewRequestId() {
  return absl::StrCat(request_prefix_, "-", next_request_.fetch_add(1) + 1);
}

void Client::SetDeadline(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(options_.rpc_timeout_ms));
  Authorize(ctx);
}

void Client::Authorize(grpc::ClientContext* ctx) const {
  AddBearer(ctx, options_.token);
}

bool Client::FollowLeader(const absl::Status& s) {
  const size_t n = manager_addresses_.size();
  if (n < 2) return false;
  size_t next = (current_manager_.load() + 1) % n;
  const absl::string_view m = s.message();
  const size_t at = m.find("the leader is at ");
  if (at != absl::string_view::npos) {
    const absl::string_view leader = m.substr(at + 17);
    for (size_t i = 0; i < n; ++i) {
      if (manager_addresses_[i] == leader) next = i;
    }
  }
  current_manager_ = next;
  return true;
}

namespace {

// A request in its SequenceCall, and the response out of its reply (false
// for a reply of another kind).
void SetCall(const v1::OpenSequenceRequest& r, v1::SequenceCall* c) {
  *c->mutable_open() = r;
}
void SetCall(const v1::ExtendSequenceRequest& r, v1::SequenceCall* c) {
  *c->mutable_extend() = r;
}
void SetCall(const v1::CloseSequenceRequest& r, v1::SequenceCall* c) {
  *c->mutable_close() = r;
}
void SetCall(const v1::ForkSequenceRequest& r, v1::SequenceCall* c) {
  *c->mutable_fork() = r;
}
void SetCall(const v1::TruncateSequenceRequest& r, v1::SequenceCall* c) {
  *c->mutable_truncate() = r;
}
void SetCall(const v1::GetSequenceRequest& r, v1::SequenceCall* c) {
  *c->mutable_get() = r;
}
void SetCall(const v1::ReportAccessRequest& r, v1::SequenceCall* c) {
  *c->mutable_report_access() = r;
}
bool TakeReply(v1::SequenceReply* r, v1::OpenSequenceResponse* out) {
  return r->has_open() && (out->Swap(r->mutable_open()), true);
}
bool TakeReply(v1::SequenceReply* r, v1::ExtendSequenceResponse* out) {
  return r->has_extend() && (out->Swap(r->mutable_extend()), true);
}
bool TakeReply(v1::SequenceReply* r, v1::CloseSequenceResponse* out) {
  return r->has_close() && (out->Swap(r->mutable_close()), true);
}
bool TakeReply(v1::SequenceReply* r, v1::ForkSequenceResponse* out) {
  return r->has_fork() && (out->Swap(r->mutable_fork()), true);
}
bool TakeReply(v1::SequenceReply* r, v1::TruncateSequenceResponse* out) {
  return r->has_truncate() && (out->Swap(r->mutable_truncate()), true);
}
bool TakeReply(v1::SequenceReply* r, v1::GetSequenceResponse* out) {
  return r->has_get() && (out->Swap(r->mutable_get()), true);
}
bool TakeReply(v1::SequenceReply* r, v1::ReportAccessResponse* out) {
  return r->has_report_access() &&
         (out->Swap(r->mutable_report_access()), true);
}

}  // namespace

template <typename Req, typename Resp>
grpc::Status Client::ManagerCall(grpc::Status (v1::Manager::Stub::*rpc)(
                                     grpc::ClientContext*, const Req&, Resp*),
                                 grpc::ClientContext* ctx, const Req& req,
                                 Resp* resp) {
  if (use_call_streams_.load(std::memory_order_relaxed)) {
    v1::SequenceCall call;
    SetCall(req, &call);
    v1::SequenceReply reply;
    grpc::Status s = call_streams_[current_manager_.load()]->Call(
        std::move(call), ctx->deadline(), &reply);
    // UNIMPLEMENTED with no reply (call_id 0) is the stream's own: a
    // manager without SequenceCalls.
    if (s.error_code() != grpc::StatusCode::UNIMPLEMENTED ||
        reply.call_id() != 0) {
      if (s.ok() && !TakeReply(&reply, resp)) {
        return grpc::Status(grpc::StatusCode::INTERNAL,
                            "SequenceCalls: the reply is not of the call's "
                            "kind");
      }
      return s;
    }
    use_call_streams_ = false;  // an older manager: unary from now on
  }
  return (manager_stub()->*rpc)(ctx, req, resp);
}

absl::Status Client::CallWithRetry(
    absl::string_view what, bool retry,
    const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  absl::Status s;
  const absl::Time give_up =
      absl::Now() + absl::Milliseconds(options_.failover_ms);
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    s = FromGrpcStatus(call(&ctx));
    if (s.code() != absl::StatusCode::kUnavailable) break;
    // A standby did not apply the call: always safe to send to the leader.
    // A manager that went away may have: only retried calls go again.
    const bool standby = absl::StrContains(s.message(), "is a standby");
    if (FollowLeader(s) && (standby || retry) && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(std::min(50 * (attempt + 1), 500)));
      continue;
    }
    if (!retry || attempt >= 1) break;
  }
  return Prefixed(what, s);
}

absl::StatusOr<std::map<std::string, std::string>> ParseWorkerSockets(
    absl::string_view flag_value) {
  std::map<std::string, std::string> out;
  for (absl::string_view entry :
       absl::StrSplit(flag_value, ',', absl::SkipWhitespace())) {
    const size_t eq = entry.find('=');
    const absl::string_view address =
        eq == absl::string_view::npos ? entry : entry.substr(0, eq);
    const absl::string_view socket =
        eq == absl::string_view::npos ? "" : entry.substr(eq + 1);
    if (address.empty() || !triax::IsUnixAddress(socket) ||
        triax::UnixSocketPath(socket).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--worker_sockets entry ", Quote(entry),
                       " is not WORKER_ADDRESS=unix:/PATH"));
    }
    if (!out.emplace(std::string(address), std::string(socket)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--worker_sockets names worker address ", Quote(address), " twice"));
    }
  }
  return out;
}

absl::StatusOr<triax::v1::Worker::Stub*> Client::worker(
    const std::string& address) {
  if (address.empty()) {
    return absl::FailedPreconditionError(
        "worker: the sequence has no worker address");
  }
  absl::MutexLock lock(&workers_mu_);
  auto it = workers_.find(address);
  if (it != workers_.end()) return it->second.get();
  // A worker on this host may be dialed on its local socket instead.
  const auto local = options_.worker_sockets.find(address);
  const std::string& dial =
      local != options_.worker_sockets.end() ? local->second : address;
  auto stub = triax::v1::Worker::NewStub(
      MakeChannel(dial, options_.credentials, options_.tls_worker_server_name));
  triax::v1::Worker::Stub* raw = stub.get();
  workers_.emplace(address, std::move(stub));
  return raw;
}

absl::StatusOr<SequenceInfo> Client::GetSequence(
    const std::string& sequence_id) {
  triax::v1::GetSequenceRequest req;
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(sequence_id);
  triax::v1::GetSequenceResponse resp;
  TRIAX_RETURN_IF_ERROR(CallWithRetry(
      "GetSequence", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return ManagerCall(&v1::Manager::Stub::GetSequence, ctx, req, &resp);
      }));
  return resp.sequence();
}

absl::Status Client::RefreshPlan(SequenceHandle* seq) {
  if (seq == nullptr) {
    return absl::InvalidArgumentError("RefreshPlan: seq is null");
  }
  TRIAX_ASSIGN_OR_RETURN(SequenceInfo info, GetSequence(seq->sequence_id));
  const std::optional<uint32_t> window = seq->window_tokens;
  FillHandle(info, seq);
  seq->window_tokens = window;
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Client::ReportAccess(
    const SequenceHandle& seq, const std::vector<uint64_t>& lineage_ids,
    const std::vector<float>& weights, bool active) {
  if (seq.sequence_id.empty()) {
    return absl::InvalidArgumentError("ReportAccess: sequence_id is empty");
  }
  if (lineage_ids.size() > kMaxReportedBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReportAccess: lineage_ids has ", lineage_ids.size(),
                     " entries; at most ", kMaxReportedBlocks));
  }
  if (lineage_ids.empty() && !active) {
    return absl::InvalidArgumentError(
        "ReportAccess: lineage_ids is empty and active=false; nothing to "
        "report");
  }
  for (size_t i = 0; i < lineage_ids.size(); ++i) {
    if (lineage_ids[i] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ReportAccess: lineage_ids[", i, "]=0; lineage ids are >= 1"));
    }
  }
  if (!weights.empty() && weights.size() != lineage_ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReportAccess: weights has ", weights.size(),
                     " entries; want 0 or lineage_ids' ", lineage_ids.size()));
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!(weights[i] >= 0.0f && weights[i] <= 1.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ReportAccess: weights[", i, "]=", weights[i], " is not in [0, 1]"));
    }
  }
  triax::v1::ReportAccessRequest req;
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(seq.sequence_id);
  for (uint64_t id : lineage_ids) req.add_lineage_ids(id);
  for (float w : weights) req.add_weights(w);
  req.set_active(active);
  triax::v1::ReportAccessResponse resp;
  // No request id: a resend would count the hits twice, so it is not retried.
  TRIAX_RETURN_IF_ERROR(CallWithRetry(
      "ReportAccess", /*retry=*/false, [&](grpc::ClientContext* ctx) {
        return ManagerCall(&v1::Manager::Stub::ReportAccess, ctx, req, &resp);
      }));
  return resp.blocks_prefetching();
}

absl::StatusOr<triax::v1::GetPressureResponse> Client::GetPressure(
    uint32_t top) {
  if (top > kMaxPressureTop) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GetPressure: top=", top, " is over the limit of ", kMaxPressureTop));
  }
  triax::v1::GetPressureRequest req;
  req.set_top(top);
  triax::v1::GetPressureResponse resp;
  TRIAX_RETURN_IF_ERROR(CallWithRetry(
      "GetPressure", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return manager_stub()->GetPressure(ctx, req, &resp);
      }));
  return resp;
}

absl::Status Client::AllocateOnWorker(const SequenceInfo& info,
                                      std::optional<uint32_t> window_tokens) {
  TRIAX_ASSIGN_OR_RETURN(triax::v1::Worker::Stub * w,
                         worker(info.worker_address()));
  triax::v1::AllocatePagesRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(info.sequence_id());
  *req.mutable_model() = info.model();
  req.set_block_tokens(info.block_tokens());
  *req.mutable_blocks() = info.blocks();
  if (window_tokens) req.set_window_tokens(*window_tokens);
  triax::v1::AllocatePagesResponse resp;
  return CallWithRetry("AllocatePages", /*retry=*/true,
                       [&](grpc::ClientContext* ctx) {
                         AddCapabilities(ctx, CapabilitiesOf(info));
                         return w->AllocatePages(ctx, req, &resp);
                       });
}

void Client::CloseOnManagerQuietly(const std::string& sequence_id) {
  triax::v1::CloseSequenceRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(sequence_id);
  triax::v1::CloseSequenceResponse resp;
  // Best effort: the caller reports the error that made it undo the open.
  CallWithRetry("CloseSequence", /*retry=*/true, [&](grpc::ClientContext* ctx) {
    return ManagerCall(&v1::Manager::Stub::CloseSequence, ctx, req, &resp);
  }).IgnoreError();
}

std::string EncodingLabel(const kernels::Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

triax::v1::BlockEncoding MakeBlockEncoding(uint64_t lineage_id,
                                           triax::v1::Format format,
                                           triax::v1::Format format_v,
                                           uint32_t group_size,
                                           triax::v1::ScaleDtype scale_dtype) {
  triax::v1::BlockEncoding e;
  e.set_lineage_id(lineage_id);
  e.set_format(format);
  e.set_format_v(format_v);
  e.set_group_size(group_size);
  e.set_scale_dtype(scale_dtype);
  return e;
}

absl::StatusOr<SequenceHandle> Client::Open(
    const triax::v1::ModelShape& model,
    const std::vector<triax::v1::Span>& spans, const std::string& policy,
    uint32_t block_tokens) {
  OpenOptions options;
  options.policy = policy;
  options.block_tokens = block_tokens;
  return Open(model, spans, options);
}

absl::StatusOr<SequenceHandle> Client::Open(
    const triax::v1::ModelShape& model,
    const std::vector<triax::v1::Span>& spans, const OpenOptions& options) {
  const std::string& policy = options.policy;
  const uint32_t block_tokens = options.block_tokens;
  triax::v1::OpenSequenceRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  *req.mutable_model() = model;
  for (const auto& s : spans) *req.add_spans() = s;
  req.set_block_tokens(block_tokens);
  req.set_policy(policy);
  // The manager keeps the window for the sequence's transfers.
  if (options.window_tokens) req.set_window_tokens(*options.window_tokens);
  req.set_worker_id(options.worker_id);
  for (uint32_t t : options.token_ids) req.add_token_ids(t);
  req.set_no_reuse(options.no_reuse);
  triax::v1::OpenSequenceResponse resp;
  TRIAX_RETURN_IF_ERROR(CallWithRetry(
      "OpenSequence", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return ManagerCall(&v1::Manager::Stub::OpenSequence, ctx, req, &resp);
      }));
  const SequenceInfo& info = resp.sequence();
  if (info.prefix_blocks() > 0) {
    absl::Status fork = ForkPrefixOnWorker(info);
    if (!fork.ok()) {
      // The manager's view of the prefix can be ahead of the worker's (not
      // written yet, freed meanwhile): open again without reuse.
      CloseOnManagerQuietly(info.sequence_id());
      OpenOptions again = options;
      again.no_reuse = true;
      return Open(model, spans, again);
    }
    SequenceHandle h;
    FillHandle(info, &h);
    h.window_tokens = options.window_tokens;
    h.prefix_sequence_id = info.prefix_sequence_id();
    h.prefix_tokens = info.prefix_tokens();
    return h;
  }
  absl::Status alloc = AllocateOnWorker(info, options.window_tokens);
  if (!alloc.ok()) {
    // Undo the plan so the tenant is not charged for pages that do not exist.
    CloseOnManagerQuietly(info.sequence_id());
    return alloc;
  }
  SequenceHandle h;
  FillHandle(info, &h);
  h.window_tokens = options.window_tokens;
  return h;
}

absl::Status Client::ForkPrefixOnWorker(const SequenceInfo& info) {
  TRIAX_ASSIGN_OR_RETURN(triax::v1::Worker::Stub * w,
                         worker(info.worker_address()));
  triax::v1::WorkerForkRequest wreq;
  wreq.set_request_id(NewRequestId());
  wreq.set_tenant_id(options_.tenant_id);
  wreq.set_parent_sequence_id(info.prefix_sequence_id());
  if (info.prefix_tenant_id() != options_.tenant_id) {
    wreq.set_parent_tenant_id(info.prefix_tenant_id());
  }
  wreq.set_child_sequence_id(info.sequence_id());
  wreq.set_num_tokens(info.prefix_tokens());
  *wreq.mutable_blocks() = info.blocks();
  triax::v1::WorkerForkResponse wresp;
  return CallWithRetry("Worker.ForkSequence", /*retry=*/true,
                       [&](grpc::ClientContext* ctx) {
                         AddCapabilities(ctx, CapabilitiesOf(info));
                         return w->ForkSequence(ctx, wreq, &wresp);
                       });
}

absl::Status Client::Extend(SequenceHandle* seq,
                            const std::vector<triax::v1::Span>& spans,
                            bool new_turn, bool continue_last_span,
                            const std::vector<uint32_t>& token_ids) {
  if (seq == nullptr) {
    return absl::InvalidArgumentError("ExtendSequence: seq is null");
  }
  triax::v1::ExtendSequenceRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(seq->sequence_id);
  for (const auto& s : spans) *req.add_spans() = s;
  req.set_new_turn(new_turn);
  req.set_continue_last_span(continue_last_span);
  for (uint32_t t : token_ids) req.add_token_ids(t);
  triax::v1::ExtendSequenceResponse resp;
  TRIAX_RETURN_IF_ERROR(CallWithRetry(
      "ExtendSequence", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return ManagerCall(&v1::Manager::Stub::ExtendSequence, ctx, req, &resp);
      }));
  absl::Status alloc = AllocateOnWorker(resp.sequence(), seq->window_tokens);
  if (!alloc.ok()) {
    // The worker allocates all or nothing: take the manager's plan back to
    // what the worker holds, or reclaim would act on blocks it never had.
    uint64_t added = 0;
    for (const auto& s : spans) added += s.num_tokens();
    const uint64_t planned = resp.sequence().num_tokens();
    absl::Status undo =
        added < planned
            ? TruncateOnManager(seq->sequence_id, planned - added)
            : absl::InternalError(absl::StrCat(
                  "the manager's plan has ", planned,
                  " tokens, not more than the ", added, " just added"));
    if (!undo.ok()) {
      return absl::Status(
          alloc.code(),
          absl::StrCat(alloc.message(), "; undoing the manager's extend of ",
                       Quote(seq->sequence_id), " failed too (",
                       undo.ToString(), "): close the sequence"));
    }
    return alloc;
  }
  FillHandle(resp.sequence(), seq);
  return absl::OkStatus();
}

absl::Status Client::TruncateOnManager(const std::string& sequence_id,
                                       uint64_t num_tokens) {
  triax::v1::TruncateSequenceRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(sequence_id);
  req.set_num_tokens(num_tokens);
  triax::v1::TruncateSequenceResponse resp;
  return CallWithRetry(
      "TruncateSequence", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return ManagerCall(&v1::Manager::Stub::TruncateSequence, ctx, req,
                           &resp);
      });
}

absl::StatusOr<SequenceHandle> Client::Fork(const SequenceHandle& parent,
                                            uint64_t num_tokens) {
  triax::v1::ForkSequenceRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_parent_sequence_id(parent.sequence_id);
  req.set_num_tokens(num_tokens);
  triax::v1::ForkSequenceResponse resp;
  TRIAX_RETURN_IF_ERROR(CallWithRetry(
      "ForkSequence", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return ManagerCall(&v1::Manager::Stub::ForkSequence, ctx, req, &resp);
      }));
  const SequenceInfo& child = resp.sequence();
  if (!child.worker_address().empty() &&
      child.worker_address() != parent.worker_address) {
    CloseOnManagerQuietly(child.sequence_id());
    return absl::InternalError(absl::StrCat(
        "ForkSequence: manager placed child ", Quote(child.sequence_id()),
        " on ", Quote(child.worker_address()), " but the parent lives on ",
        Quote(parent.worker_address)));
  }
  TRIAX_ASSIGN_OR_RETURN(triax::v1::Worker::Stub * w,
                         worker(parent.worker_address));
  triax::v1::WorkerForkRequest wreq;
  wreq.set_request_id(NewRequestId());
  wreq.set_tenant_id(options_.tenant_id);
  wreq.set_parent_sequence_id(parent.sequence_id);
  wreq.set_child_sequence_id(child.sequence_id());
  wreq.set_num_tokens(child.num_tokens());
  *wreq.mutable_blocks() = child.blocks();
  triax::v1::WorkerForkResponse wresp;
  absl::Status s = CallWithRetry("Worker.ForkSequence", /*retry=*/true,
                                 [&](grpc::ClientContext* ctx) {
                                   AddCapabilities(ctx, CapabilitiesOf(child));
                                   AddCapabilities(ctx, parent.capabilities);
                                   return w->ForkSequence(ctx, wreq, &wresp);
                                 });
  if (!s.ok()) {
    CloseOnManagerQuietly(child.sequence_id());
    return s;
  }
  SequenceHandle h;
  FillHandle(child, &h);
  if (h.worker_address.empty()) h.worker_address = parent.worker_address;
  h.window_tokens = parent.window_tokens;
  return h;
}

absl::StatusOr<int64_t> Client::DemoteBlocks(
    SequenceHandle* seq,
    const std::vector<triax::v1::BlockEncoding>& encodings) {
  if (seq == nullptr) {
    return absl::InvalidArgumentError("DemoteBlocks: seq is null");
  }
  triax::v1::DemoteBlocksRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(seq->sequence_id);
  for (const auto& e : encodings) *req.add_blocks() = e;
  triax::v1::DemoteBlocksResponse resp;
  TRIAX_RETURN_IF_ERROR(CallWithRetry(
      "DemoteBlocks", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return manager_stub()->DemoteBlocks(ctx, req, &resp);
      }));
  const std::optional<uint32_t> window = seq->window_tokens;
  FillHandle(resp.sequence(), seq);
  seq->window_tokens = window;
  return resp.bytes_delta();
}

absl::StatusOr<triax::v1::TransferSequenceResponse> Client::TransferSequence(
    const std::string& sequence_id, const TransferOptions& options) {
  triax::v1::TransferSequenceRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(sequence_id);
  req.set_destination_worker_id(options.destination_worker_id);
  req.set_destination_policy(options.destination_policy);
  req.set_timeout_ms(options.timeout_ms);
  req.set_follow_writes(options.follow_writes);
  req.set_first_block(options.first_block);
  req.set_destination_prefix_sequence_id(
      options.destination_prefix_sequence_id);
  // The manager answers within the transfer's bound; the margin covers the
  // prepare, the commit and the network.
  const int64_t bound =
      int64_t{options.timeout_ms != 0 ? options.timeout_ms : 10000} + 5000;
  const int64_t deadline_ms = std::max(bound, options_.rpc_timeout_ms);
  triax::v1::TransferSequenceResponse resp;
  absl::Status s;
  // Retried once on UNAVAILABLE with the same request id: a committed
  // transfer answers its reply again, one in flight ABORTED.
  for (int attempt = 0; attempt < 2; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(deadline_ms));
    Authorize(&ctx);
    s = FromGrpcStatus(manager_stub()->TransferSequence(&ctx, req, &resp));
    if (s.code() != absl::StatusCode::kUnavailable) break;
  }
  TRIAX_RETURN_IF_ERROR(Prefixed("TransferSequence", s));
  return resp;
}

absl::StatusOr<triax::v1::TransferSequenceResponse> Client::TransferSequence(
    SequenceHandle* seq, const TransferOptions& options) {
  if (seq == nullptr) {
    return absl::InvalidArgumentError("TransferSequence: seq is null");
  }
  TRIAX_ASSIGN_OR_RETURN(triax::v1::TransferSequenceResponse resp,
                         TransferSequence(seq->sequence_id, options));
  const std::optional<uint32_t> window = seq->window_tokens;
  FillHandle(resp.sequence(), seq);
  seq->window_tokens = window;
  return resp;
}

absl::Status Client::Close(const SequenceHandle& seq) {
  absl::Status worker_status;
  auto w = worker(seq.worker_address);
  if (!w.ok()) {
    worker_status = w.status();
  } else {
    triax::v1::FreePagesRequest req;
    req.set_request_id(NewRequestId());
    req.set_tenant_id(options_.tenant_id);
    req.set_sequence_id(seq.sequence_id);
    triax::v1::FreePagesResponse resp;
    worker_status = CallWithRetry("FreePages", /*retry=*/true,
                                  [&](grpc::ClientContext* ctx) {
                                    AddCapabilities(ctx, seq.capabilities);
                                    return (*w)->FreePages(ctx, req, &resp);
                                  });
  }
  // A worker that is gone (UNAVAILABLE) or already forgot the sequence
  // (NOT_FOUND, e.g. after a restart) holds nothing: the manager still has to
  // release the plan and the budget. Any other worker error is real.
  const bool worker_gone =
      worker_status.code() == absl::StatusCode::kUnavailable ||
      worker_status.code() == absl::StatusCode::kNotFound;
  if (!worker_status.ok() && !worker_gone) return worker_status;

  triax::v1::CloseSequenceRequest req;
  req.set_request_id(NewRequestId());
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(seq.sequence_id);
  triax::v1::CloseSequenceResponse resp;
  return CallWithRetry(
      "CloseSequence", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        return ManagerCall(&v1::Manager::Stub::CloseSequence, ctx, req, &resp);
      });
}

absl::Status Client::WriteKV(const SequenceHandle& seq, uint32_t layer,
                             uint64_t first_token, uint32_t num_tokens,
                             const float* k, const float* v) {
  if (num_tokens == 0) {
    return absl::InvalidArgumentError("WriteKV: num_tokens=0; want >= 1");
  }
  if (k == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("WriteKV: k and v must be non-null");
  }
  auto elems_or = TokenElems(seq.model);
  if (!elems_or.ok()) return Prefixed("WriteKV", elems_or.status());
  const size_t elems = *elems_or;
  TRIAX_ASSIGN_OR_RETURN(triax::v1::Worker::Stub * w,
                         worker(seq.worker_address));
  const size_t token_bytes = elems * sizeof(uint16_t) * 2;
  const uint32_t chunk_tokens = static_cast<uint32_t>(
      std::clamp<size_t>(kMaxChunkBytes / token_bytes, 1, kMaxChunkTokens));

  // Converted once, so a retry resends the same bytes.
  std::vector<triax::v1::WriteKVRequest> msgs;
  for (uint32_t done = 0; done < num_tokens; done += chunk_tokens) {
    const uint32_t n = std::min(chunk_tokens, num_tokens - done);
    triax::v1::WriteKVRequest m;
    m.set_tenant_id(options_.tenant_id);
    m.set_sequence_id(seq.sequence_id);
    triax::v1::KvChunk* c = m.mutable_chunk();
    c->set_layer(layer);
    c->set_first_token(first_token + done);
    c->set_num_tokens(n);
    c->set_dtype(triax::v1::KV_DTYPE_BF16);
    c->set_k(Bf16Bytes(k + static_cast<size_t>(done) * elems, n * elems));
    c->set_v(Bf16Bytes(v + static_cast<size_t>(done) * elems, n * elems));
    msgs.push_back(std::move(m));
  }
  msgs.front().set_request_id(NewRequestId());

  return CallWithRetry("WriteKV", /*retry=*/true,
                       [&](grpc::ClientContext* ctx) {
                         triax::v1::WriteKVResponse resp;
                         AddCapabilities(ctx, seq.capabilities);
                         auto writer = w->WriteKV(ctx, &resp);
                         for (const auto& m : msgs) {
                           // A false Write means the stream is broken; Finish
                           // says why.
                           if (!writer->Write(m)) break;
                         }
                         writer->WritesDone();
                         return writer->Finish();
                       });
}

absl::Status Client::Attend(const SequenceHandle& seq, const AttendArgs& args) {
  if (args.num_queries == 0) {
    return absl::InvalidArgumentError("Attend: num_queries=0; want >= 1");
  }
  if (args.q == nullptr || args.out == nullptr) {
    return absl::InvalidArgumentError("Attend: q and out must be non-null");
  }
  const bool append = args.append_k != nullptr || args.append_v != nullptr;
  if (append && (args.append_k == nullptr || args.append_v == nullptr ||
                 args.append_tokens == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Attend: an append needs append_k, append_v and append_tokens >= 1 "
        "(append_tokens=",
        args.append_tokens, ")"));
  }
  const size_t q_elems = static_cast<size_t>(args.num_queries) *
                         seq.model.n_q_heads() * seq.model.head_dim();
  if (q_elems == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Attend: model shape has n_q_heads=", seq.model.n_q_heads(),
        " head_dim=", seq.model.head_dim(), "; both must be >= 1"));
  }
  TRIAX_ASSIGN_OR_RETURN(triax::v1::Worker::Stub * w,
                         worker(seq.worker_address));

  triax::v1::AttendRequest req;
  req.set_tenant_id(options_.tenant_id);
  triax::v1::AttendItem* item = req.add_items();
  item->set_sequence_id(seq.sequence_id);
  item->set_layer(args.layer);
  item->set_num_queries(args.num_queries);
  if (args.positions != nullptr) {
    for (uint32_t i = 0; i < args.num_queries; ++i) {
      item->add_positions(args.positions[i]);
    }
  }
  item->set_queries(std::string(reinterpret_cast<const char*>(args.q),
                                q_elems * sizeof(float)));
  if (append) {
    const size_t kv_elems = static_cast<size_t>(args.append_tokens) *
                            seq.model.n_kv_heads() * seq.model.head_dim();
    triax::v1::KvChunk* c = item->mutable_append();
    c->set_layer(args.layer);
    c->set_first_token(args.append_first);
    c->set_num_tokens(args.append_tokens);
    c->set_dtype(triax::v1::KV_DTYPE_BF16);
    c->set_k(Bf16Bytes(args.append_k, kv_elems));
    c->set_v(Bf16Bytes(args.append_v, kv_elems));
  }
  // Attend carries no request id; without an append it only reads and may
  // be retried. With one, a transport-level retry could land after the first
  // attempt's write, so it is not retried. An item answered UNAVAILABLE with
  // retry_after_ms (spilled blocks being restored) was refused before the
  // worker wrote anything, so that one is resent with or without an append.
  const auto start = std::chrono::steady_clock::now();
  const auto give_up =
      start + std::chrono::milliseconds(options_.rpc_timeout_ms);
  triax::v1::AttendResponse resp;
  for (int retries = 0;; ++retries) {
    resp.Clear();
    TRIAX_RETURN_IF_ERROR(CallWithRetry(
        "Attend", /*retry=*/!append, [&](grpc::ClientContext* ctx) {
          AddCapabilities(ctx, seq.capabilities);
          return w->Attend(ctx, req, &resp);
        }));
    if (resp.results_size() != 1) {
      return absl::InternalError(absl::StrCat("Attend: worker returned ",
                                              resp.results_size(),
                                              " results for 1 item"));
    }
    const triax::v1::AttendResult& r = resp.results(0);
    const auto code = static_cast<absl::StatusCode>(r.status().code());
    if (code != absl::StatusCode::kUnavailable || r.retry_after_ms() == 0) {
      break;
    }
    // Spilled blocks are being restored: wait and ask again.
    const auto wait = std::chrono::milliseconds(r.retry_after_ms());
    if (retries >= options_.attend_retries ||
        std::chrono::steady_clock::now() + wait > give_up) {
      const int64_t waited_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(
              std::chrono::steady_clock::now() - start)
              .count();
      return absl::UnavailableError(
          absl::StrCat("Attend: ", r.status().message(), " (retry after ",
                       r.retry_after_ms(), " ms; gave up after ", retries,
                       " retries in ", waited_ms, " ms)"));
    }
    std::this_thread::sleep_for(wait);
  }
  const triax::v1::AttendResult& r = resp.results(0);
  if (r.status().code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(r.status().code()),
                        absl::StrCat("Attend: ", r.status().message()));
  }
  if (r.output().size() != q_elems * sizeof(float)) {
    return absl::InternalError(absl::StrCat("Attend: output has ",
                                            r.output().size(), " bytes; want ",
                                            q_elems * sizeof(float)));
  }
  std::memcpy(args.out, r.output().data(), r.output().size());
  return absl::OkStatus();
}

absl::Status Client::ReadKV(const SequenceHandle& seq, uint32_t layer,
                            uint64_t first_token, uint32_t num_tokens,
                            std::vector<float>* k, std::vector<float>* v) {
  if (k == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("ReadKV: k and v must be non-null");
  }
  auto elems_or = TokenElems(seq.model);
  if (!elems_or.ok()) return Prefixed("ReadKV", elems_or.status());
  const size_t elems = *elems_or;
  TRIAX_ASSIGN_OR_RETURN(triax::v1::Worker::Stub * w,
                         worker(seq.worker_address));
  triax::v1::ReadKVRequest req;
  req.set_tenant_id(options_.tenant_id);
  req.set_sequence_id(seq.sequence_id);
  req.set_layer(layer);
  req.set_first_token(first_token);
  req.set_num_tokens(num_tokens);
  req.set_dtype(triax::v1::KV_DTYPE_F32);

  absl::Status content;  // a malformed stream, found while reading it
  TRIAX_RETURN_IF_ERROR(
      CallWithRetry("ReadKV", /*retry=*/true, [&](grpc::ClientContext* ctx) {
        k->clear();
        v->clear();
        content = absl::OkStatus();
        uint64_t next = first_token;
        AddCapabilities(ctx, seq.capabilities);
        auto reader = w->ReadKV(ctx, req);
        triax::v1::KvChunk c;
        while (reader->Read(&c)) {
          if (!content.ok()) continue;  // drain so Finish is clean
          if (c.first_token() != next) {
            content = absl::InternalError(
                absl::StrCat("ReadKV: chunk starts at token ", c.first_token(),
                             "; want ", next));
            continue;
          }
          next += c.num_tokens();
          content = AppendAsFloat(c.dtype(), c.k(), k);
          if (content.ok()) content = AppendAsFloat(c.dtype(), c.v(), v);
        }
        return reader->Finish();
      }));
  TRIAX_RETURN_IF_ERROR(content);
  if (k->size() != v->size() || k->size() % elems != 0) {
    return absl::InternalError(
        absl::StrCat("ReadKV: got ", k->size(), " K and ", v->size(),
                     " V values; want equal multiples of ", elems));
  }
  if (num_tokens != 0 && k->size() != static_cast<size_t>(num_tokens) * elems) {
    return absl::InternalError(absl::StrCat("ReadKV: got ", k->size() / elems,
                                            " tokens; want ", num_tokens));
  }
  return absl::OkStatus();
}

}  // namespace triax::client
