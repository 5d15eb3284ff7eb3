// Batched decode attention: Client::AttendBatch (one unary Attend with many
// items) and AttendStream (Worker.AttendStream), over the request and
// response halves they share.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attend_stream.h"
#include "client/kv_client.h"
#include "common/capability.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "kernels/numeric.h"

namespace triax::client {
namespace {

absl::Status Prefixed(absl::string_view what, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// n floats as BF16 bytes into *out (its buffer reused).
void PutBf16(const float* src, size_t n, std::string* out) {
  out->resize(n * sizeof(uint16_t));
  char* dst = out->data();
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = kernels::FloatToBf16(src[i]);
    std::memcpy(dst + i * sizeof(uint16_t), &h, sizeof(h));
  }
}

size_t QueryElems(const Client::BatchItem& item) {
  return static_cast<size_t>(item.args.num_queries) *
         item.seq->model.n_q_heads() * item.seq->model.head_dim();
}

// Every capability of the items' sequences, each handle once.
std::vector<v1::Capability> CapabilitiesOf(
    const std::vector<const SequenceHandle*>& seqs) {
  std::vector<v1::Capability> caps;
  std::set<const SequenceHandle*> seen;
  for (const SequenceHandle* h : seqs) {
    if (h == nullptr || !seen.insert(h).second) continue;
    caps.insert(caps.end(), h->capabilities.begin(), h->capabilities.end());
  }
  return caps;
}

}  // namespace

absl::Status MakeAttendRequest(absl::string_view tenant_id,
                               const std::vector<Client::BatchItem>& items,
                               AttendWire wire, v1::AttendRequest* req) {
  if (items.empty()) return absl::InvalidArgumentError("no items");
  req->Clear();
  req->set_tenant_id(std::string(tenant_id));
  for (size_t i = 0; i < items.size(); ++i) {
    const Client::BatchItem& it = items[i];
    const Client::AttendArgs& a = it.args;
    auto bad = [i](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("items[", i, "]: ", why));
    };
    if (it.seq == nullptr) return bad("seq is null");
    if (it.seq->worker_address != items[0].seq->worker_address) {
      return bad(absl::StrCat("sequence ", it.seq->sequence_id,
                              " is on worker ", it.seq->worker_address,
                              ", items[0]'s on ", items[0].seq->worker_address,
                              "; one call goes to one worker"));
    }
    if (a.num_queries == 0) return bad("num_queries=0; want >= 1");
    if (a.q == nullptr || a.out == nullptr) {
      return bad("q and out must be non-null");
    }
    const bool append = a.append_k != nullptr || a.append_v != nullptr;
    if (append && (a.append_k == nullptr || a.append_v == nullptr ||
                   a.append_tokens == 0)) {
      return bad(absl::StrCat(
          "an append needs append_k, append_v and append_tokens >= 1 "
          "(append_tokens=",
          a.append_tokens, ")"));
    }
    const triax::v1::ModelShape& m = it.seq->model;
    if (m.n_q_heads() == 0 || m.head_dim() == 0 ||
        (append && m.n_kv_heads() == 0)) {
      return bad(absl::StrCat("model shape has n_q_heads=", m.n_q_heads(),
                              " n_kv_heads=", m.n_kv_heads(), " head_dim=",
                              m.head_dim(), "; each must be >= 1"));
    }
    v1::AttendItem* item = req->add_items();
    item->set_sequence_id(it.seq->sequence_id);
    item->set_layer(a.layer);
    item->set_num_queries(a.num_queries);
    if (a.positions != nullptr) {
      item->mutable_positions()->Add(a.positions, a.positions + a.num_queries);
    }
    const size_t q_elems = QueryElems(it);
    if (wire == AttendWire::kBF16) {
      item->set_dtype(v1::KV_DTYPE_BF16);
      PutBf16(a.q, q_elems, item->mutable_queries());
    } else {
      item->set_queries(reinterpret_cast<const char*>(a.q),
                        q_elems * sizeof(float));
    }
    if (append) {
      const size_t kv_elems =
          static_cast<size_t>(a.append_tokens) * m.n_kv_heads() * m.head_dim();
      v1::KvChunk* c = item->mutable_append();
      c->set_layer(a.layer);
      c->set_first_token(a.append_first);
      c->set_num_tokens(a.append_tokens);
      c->set_dtype(v1::KV_DTYPE_BF16);
      PutBf16(a.append_k, kv_elems, c->mutable_k());
      PutBf16(a.append_v, kv_elems, c->mutable_v());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<absl::Status>> TakeAttendResponse(
    absl::string_view what, const std::vector<Client::BatchItem>& items,
    AttendWire wire, const v1::AttendResponse& resp) {
  if (static_cast<size_t>(resp.results_size()) != items.size()) {
    return absl::InternalError(
        absl::StrCat(what, ": worker returned ", resp.results_size(),
                     " results for ", items.size(), " items"));
  }
  std::vector<absl::Status> out(items.size());
  const size_t value_bytes = wire == AttendWire::kBF16 ? 2 : 4;
  for (size_t i = 0; i < items.size(); ++i) {
    const v1::AttendResult& r = resp.results(static_cast<int>(i));
    if (r.status().code() != 0) {
      std::string message = absl::StrCat(what, ": ", r.status().message());
      if (r.retry_after_ms() > 0) {
        absl::StrAppend(&message, " (retry after ", r.retry_after_ms(), " ms)");
      }
      out[i] = absl::Status(static_cast<absl::StatusCode>(r.status().code()),
                            message);
      continue;
    }
    const size_t n = QueryElems(items[i]);
    if (r.output().size() != n * value_bytes) {
      return absl::InternalError(
          absl::StrCat(what, ": items[", i, "]: output has ", r.output().size(),
                       " bytes; want ", n * value_bytes));
    }
    float* dst = items[i].args.out;
    if (wire == AttendWire::kBF16) {
      const char* src = r.output().data();
      for (size_t j = 0; j < n; ++j) {
        uint16_t h;
        std::memcpy(&h, src + j * sizeof(uint16_t), sizeof(h));
        dst[j] = kernels::Bf16ToFloat(h);
      }
    } else {
      std::memcpy(dst, r.output().data(), r.output().size());
    }
  }
  return out;
}

absl::StatusOr<std::vector<absl::Status>> Client::AttendBatch(
    const std::vector<BatchItem>& items, AttendWire wire) {
  v1::AttendRequest req;
  TRIAX_RETURN_IF_ERROR(Prefixed(
      "AttendBatch", MakeAttendRequest(options_.tenant_id, items, wire, &req)));
  TRIAX_ASSIGN_OR_RETURN(v1::Worker::Stub * w,
                         worker(items[0].seq->worker_address));
  std::vector<const SequenceHandle*> seqs;
  bool append = false;
  for (const BatchItem& it : items) {
    seqs.push_back(it.seq);
    append = append || it.args.append_k != nullptr;
  }
  const std::vector<v1::Capability> caps = CapabilitiesOf(seqs);
  v1::AttendResponse resp;
  // As Attend: a transport-level retry of an append could land after the
  // first attempt's write, so only reads go again.
  TRIAX_RETURN_IF_ERROR(CallWithRetry("AttendBatch", /*retry=*/!append,
                                      [&](grpc::ClientContext* ctx) {
                                        resp.Clear();
                                        AddCapabilities(ctx, caps);
                                        return w->Attend(ctx, req, &resp);
                                      }));
  return TakeAttendResponse("AttendBatch", items, wire, resp);
}

AttendStream::AttendStream(std::string tenant_id, std::string worker_address,
                           AttendWire wire)
    : tenant_id_(std::move(tenant_id)),
      worker_address_(std::move(worker_address)),
      wire_(wire) {}

absl::StatusOr<std::unique_ptr<AttendStream>> AttendStream::Open(
    Client* client, const std::string& worker_address,
    const std::vector<const SequenceHandle*>& seqs,
    const AttendStreamOptions& options) {
  if (client == nullptr) {
    return absl::InvalidArgumentError("AttendStream: client is null");
  }
  TRIAX_ASSIGN_OR_RETURN(v1::Worker::Stub * stub,
                         client->worker(worker_address));
  return Start(stub, client->options().tenant_id, worker_address,
               CapabilitiesOf(seqs), options);
}

absl::StatusOr<std::unique_ptr<AttendStream>> AttendStream::Open(
    v1::Worker::Stub* stub, const std::string& tenant_id,
    const std::vector<v1::Capability>& capabilities,
    const AttendStreamOptions& options) {
  return Start(stub, tenant_id, "", capabilities, options);
}

absl::StatusOr<std::unique_ptr<AttendStream>> AttendStream::Start(
    v1::Worker::Stub* stub, const std::string& tenant_id,
    const std::string& worker_address,
    const std::vector<v1::Capability>& capabilities,
    const AttendStreamOptions& options) {
  if (stub == nullptr) {
    return absl::InvalidArgumentError("AttendStream: stub is null");
  }
  if (options.timeout_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AttendStream: timeout_ms=", options.timeout_ms,
                     " is negative; 0: no deadline"));
  }
  std::unique_ptr<AttendStream> s(
      new AttendStream(tenant_id, worker_address, options.wire));
  if (options.timeout_ms > 0) {
    s->ctx_.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(options.timeout_ms));
  }
  AddCapabilities(&s->ctx_, capabilities);
  s->stream_ = stub->AttendStream(&s->ctx_);
  return s;
}

AttendStream::~AttendStream() {
  if (!done_ && stream_ != nullptr) {
    ctx_.TryCancel();
    (void)stream_->Finish();
  }
}

absl::Status AttendStream::Ended() {
  done_ = true;
  status_ = FromGrpcStatus(stream_->Finish());
  if (status_.ok()) {
    status_ = absl::InternalError(
        absl::StrCat("the worker ended the stream without answering "
                     "messages[",
                     messages_, "]"));
  }
  status_ = Prefixed("AttendStream", status_);
  return status_;
}

absl::StatusOr<std::vector<absl::Status>> AttendStream::Attend(
    const std::vector<Client::BatchItem>& items) {
  if (done_) return status_;
  TRIAX_RETURN_IF_ERROR(Prefixed(
      "AttendStream", MakeAttendRequest(tenant_id_, items, wire_, &req_)));
  if (!worker_address_.empty() &&
      items[0].seq->worker_address != worker_address_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AttendStream: items are on worker ", items[0].seq->worker_address,
        ", the stream goes to ", worker_address_));
  }
  if (!stream_->Write(req_)) return Ended();
  if (!stream_->Read(&resp_)) return Ended();
  ++messages_;
  return TakeAttendResponse("AttendStream", items, wire_, resp_);
}

absl::Status AttendStream::Finish() {
  if (done_) return status_;
  done_ = true;
  stream_->WritesDone();
  v1::AttendResponse extra;
  bool unexpected = false;
  while (stream_->Read(&extra)) unexpected = true;
  status_ = Prefixed("AttendStream", FromGrpcStatus(stream_->Finish()));
  if (status_.ok() && unexpected) {
    status_ = absl::InternalError(
        "AttendStream: the worker answered a message that was not sent");
  }
  return status_;
}

void AttendStream::Cancel() { ctx_.TryCancel(); }

}  // namespace triax::client
