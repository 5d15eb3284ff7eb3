// manager_bench's clients: the session loop (Open, Extend, Close) over
// unary RPCs or a SequenceCalls stream, and the floor loop (GetSequence of
// an unknown id) on its own channel.
#include "bench/manager/session_clients.h"

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/bearer.h"

namespace triax::bench::manager {

namespace v1 = triax::v1;
using triax::AddBearer;

std::shared_ptr<grpc::Channel> NewChannel(
    const std::string& target, int index,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  // A distinct argument per client keeps channels from sharing a connection.
  args.SetInt("triax.bench.client", index);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, credentials, args);
}

void SetBenchModel(v1::ModelShape* m) {
  m->set_name("bench-8b");
  m->set_n_layers(32);
  m->set_n_kv_heads(8);
  m->set_n_q_heads(32);
  m->set_head_dim(128);
}

void AddSpan(google::protobuf::RepeatedPtrField<v1::Span>* spans, v1::Role role,
             uint32_t n) {
  auto* s = spans->Add();
  s->set_role(role);
  s->set_modality(v1::MODALITY_TEXT);
  s->set_num_tokens(n);
}

namespace {

class Unary final : public SessionCalls {
 public:
  Unary(const std::shared_ptr<grpc::Channel>& channel, std::string token)
      : stub_(v1::Manager::NewStub(channel)), token_(std::move(token)) {}
  grpc::Status Open(const v1::OpenSequenceRequest& req,
                    v1::OpenSequenceResponse* resp) override {
    grpc::ClientContext ctx;
    AddBearer(&ctx, token_);
    return stub_->OpenSequence(&ctx, req, resp);
  }
  grpc::Status Extend(const v1::ExtendSequenceRequest& req,
                      v1::ExtendSequenceResponse* resp) override {
    grpc::ClientContext ctx;
    AddBearer(&ctx, token_);
    return stub_->ExtendSequence(&ctx, req, resp);
  }
  grpc::Status Close(const v1::CloseSequenceRequest& req,
                     v1::CloseSequenceResponse* resp) override {
    grpc::ClientContext ctx;
    AddBearer(&ctx, token_);
    return stub_->CloseSequence(&ctx, req, resp);
  }
  grpc::Status Get(const v1::GetSequenceRequest& req,
                   v1::GetSequenceResponse* resp) override {
    grpc::ClientContext ctx;
    AddBearer(&ctx, token_);
    return stub_->GetSequence(&ctx, req, resp);
  }

 private:
  std::unique_ptr<v1::Manager::Stub> stub_;
  const std::string token_;
};

class Streamed final : public SessionCalls {
 public:
  explicit Streamed(triax::client::SequenceCallStream* stream)
      : stream_(stream) {}
  grpc::Status Open(const v1::OpenSequenceRequest& req,
                    v1::OpenSequenceResponse* resp) override {
    v1::SequenceCall call;
    *call.mutable_open() = req;
    return Run(std::move(call),
               [&](v1::SequenceReply* r) { resp->Swap(r->mutable_open()); });
  }
  grpc::Status Extend(const v1::ExtendSequenceRequest& req,
                      v1::ExtendSequenceResponse* resp) override {
    v1::SequenceCall call;
    *call.mutable_extend() = req;
    return Run(std::move(call),
               [&](v1::SequenceReply* r) { resp->Swap(r->mutable_extend()); });
  }
  grpc::Status Close(const v1::CloseSequenceRequest& req,
                     v1::CloseSequenceResponse* resp) override {
    v1::SequenceCall call;
    *call.mutable_close() = req;
    return Run(std::move(call),
               [&](v1::SequenceReply* r) { resp->Swap(r->mutable_close()); });
  }
  grpc::Status Get(const v1::GetSequenceRequest& req,
                   v1::GetSequenceResponse* resp) override {
    v1::SequenceCall call;
    *call.mutable_get() = req;
    return Run(std::move(call),
               [&](v1::SequenceReply* r) { resp->Swap(r->mutable_get()); });
  }

 private:
  template <typename Take>
  grpc::Status Run(v1::SequenceCall call, const Take& take) {
    v1::SequenceReply reply;
    grpc::Status s = stream_->Call(
        std::move(call),
        std::chrono::system_clock::now() + std::chrono::seconds(30), &reply);
    if (s.ok()) take(&reply);
    return s;
  }
  triax::client::SequenceCallStream* const stream_;
};

}  // namespace

std::unique_ptr<SessionCalls> UnaryCalls(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& token) {
  return std::make_unique<Unary>(channel, token);
}

std::unique_ptr<SessionCalls> StreamCalls(
    triax::client::SequenceCallStream* stream) {
  return std::make_unique<Streamed>(stream);
}

void RunClient(SessionCalls* calls, int index, int tenant_index,
               Clock::time_point deadline, int sessions, int run,
               ClientStats* stats) {
  const std::string tenant = absl::StrCat("bench-t", tenant_index);
  v1::OpenSequenceRequest open;
  open.set_tenant_id(tenant);
  SetBenchModel(open.mutable_model());
  AddSpan(open.mutable_spans(), v1::ROLE_SYSTEM, 200);
  AddSpan(open.mutable_spans(), v1::ROLE_TOOL_SCHEMA, 150);
  AddSpan(open.mutable_spans(), v1::ROLE_USER, 100);
  AddSpan(open.mutable_spans(), v1::ROLE_ASSISTANT, 100);
  AddSpan(open.mutable_spans(), v1::ROLE_USER, 50);
  v1::ExtendSequenceRequest extend;
  extend.set_tenant_id(tenant);
  extend.set_new_turn(true);
  AddSpan(extend.mutable_spans(), v1::ROLE_ASSISTANT, 60);
  AddSpan(extend.mutable_spans(), v1::ROLE_USER, 40);
  v1::CloseSequenceRequest close;
  close.set_tenant_id(tenant);

  auto fail = [&](const char* what, const grpc::Status& s) {
    if (stats->errors++ == 0) {
      stats->first_error =
          absl::StrCat(what, ": ", s.error_code(), " ", s.error_message());
    }
  };
  auto ms = [](Clock::time_point t0, Clock::time_point t1) {
    return std::chrono::duration<double, std::milli>(t1 - t0).count();
  };
  uint64_t n = 0;
  while (sessions >= 0 ? n < static_cast<uint64_t>(sessions)
                       : Clock::now() < deadline) {
    // Unique across runs: a manager keeps answered request ids, and one
    // reused for another request is FAILED_PRECONDITION.
    const std::string rid = absl::StrCat("r", run, "c", index, "-", n++);
    open.set_request_id("o" + rid);
    v1::OpenSequenceResponse open_resp;
    auto t0 = Clock::now();
    grpc::Status s = calls->Open(open, &open_resp);
    auto t1 = Clock::now();
    if (!s.ok()) {
      fail("OpenSequence", s);
      continue;
    }
    stats->open_ms.push_back(ms(t0, t1));
    stats->blocks += open_resp.sequence().blocks_size();
    const std::string& seq = open_resp.sequence().sequence_id();

    extend.set_request_id("e" + rid);
    extend.set_sequence_id(seq);
    v1::ExtendSequenceResponse ext_resp;
    t0 = Clock::now();
    s = calls->Extend(extend, &ext_resp);
    t1 = Clock::now();
    if (s.ok()) {
      stats->extend_ms.push_back(ms(t0, t1));
      stats->blocks += ext_resp.new_blocks_size();
    } else {
      fail("ExtendSequence", s);
    }

    close.set_request_id("x" + rid);
    close.set_sequence_id(seq);
    v1::CloseSequenceResponse close_resp;
    t0 = Clock::now();
    s = calls->Close(close, &close_resp);
    t1 = Clock::now();
    if (s.ok()) {
      stats->close_ms.push_back(ms(t0, t1));
    } else {
      fail("CloseSequence", s);
    }
  }
}

void RunFloorClient(SessionCalls* calls, int index, int tenant,
                    Clock::time_point deadline, ClientStats* stats) {
  v1::GetSequenceRequest req;
  req.set_tenant_id(absl::StrCat("bench-t", tenant));
  req.set_sequence_id(absl::StrCat("bench-floor-", index));
  while (Clock::now() < deadline) {
    v1::GetSequenceResponse resp;
    const auto t0 = Clock::now();
    const grpc::Status s = calls->Get(req, &resp);
    const auto t1 = Clock::now();
    if (s.error_code() != grpc::StatusCode::NOT_FOUND) {
      if (stats->errors++ == 0) {
        stats->first_error =
            absl::StrCat("GetSequence (want NOT_FOUND): ", s.error_code(), " ",
                         s.error_message());
      }
      continue;
    }
    stats->open_ms.push_back(
        std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
}

}  // namespace triax::bench::manager
