// manager_bench's clients: the session loop (Open, Extend, Close) and the
// floor loop (GetSequence of an unknown id), each on its own channel.
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

void RunClient(const std::shared_ptr<grpc::Channel>& channel, int index,
               const Access& access, int tenants, Clock::time_point deadline,
               int sessions, int run, ClientStats* stats) {
  const std::string tenant = absl::StrCat("bench-t", index % tenants);
  const std::string token =
      access.tenant_tokens.empty() ? "" : access.tenant_tokens[index % tenants];
  auto stub = v1::Manager::NewStub(channel);
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
  uint64_t n = 0;
  while (sessions >= 0 ? n < static_cast<uint64_t>(sessions)
                       : Clock::now() < deadline) {
    // Unique across runs: a manager keeps answered request ids, and one
    // reused for another request is FAILED_PRECONDITION.
    const std::string rid = absl::StrCat("r", run, "c", index, "-", n++);
    open.set_request_id("o" + rid);
    v1::OpenSequenceResponse open_resp;
    auto t0 = Clock::now();
    grpc::Status s;
    {
      grpc::ClientContext ctx;
      AddBearer(&ctx, token);
      s = stub->OpenSequence(&ctx, open, &open_resp);
    }
    auto t1 = Clock::now();
    if (!s.ok()) {
      fail("OpenSequence", s);
      continue;
    }
    stats->open_ms.push_back(
        std::chrono::duration<double, std::milli>(t1 - t0).count());
    stats->blocks += open_resp.sequence().blocks_size();
    const std::string& seq = open_resp.sequence().sequence_id();

    extend.set_request_id("e" + rid);
    extend.set_sequence_id(seq);
    v1::ExtendSequenceResponse ext_resp;
    t0 = Clock::now();
    {
      grpc::ClientContext ctx;
      AddBearer(&ctx, token);
      s = stub->ExtendSequence(&ctx, extend, &ext_resp);
    }
    t1 = Clock::now();
    if (s.ok()) {
      stats->extend_ms.push_back(
          std::chrono::duration<double, std::milli>(t1 - t0).count());
      stats->blocks += ext_resp.new_blocks_size();
    } else {
      fail("ExtendSequence", s);
    }

    close.set_request_id("x" + rid);
    close.set_sequence_id(seq);
    v1::CloseSequenceResponse close_resp;
    t0 = Clock::now();
    {
      grpc::ClientContext ctx;
      AddBearer(&ctx, token);
      s = stub->CloseSequence(&ctx, close, &close_resp);
    }
    t1 = Clock::now();
    if (s.ok()) {
      stats->close_ms.push_back(
          std::chrono::duration<double, std::milli>(t1 - t0).count());
    } else {
      fail("CloseSequence", s);
    }
  }
}

void RunFloorClient(const std::shared_ptr<grpc::Channel>& channel, int index,
                    const Access& access, int tenants,
                    Clock::time_point deadline, ClientStats* stats) {
  auto stub = v1::Manager::NewStub(channel);
  v1::GetSequenceRequest req;
  req.set_tenant_id(absl::StrCat("bench-t", index % tenants));
  req.set_sequence_id(absl::StrCat("bench-floor-", index));
  const std::string token =
      access.tenant_tokens.empty() ? "" : access.tenant_tokens[index % tenants];
  while (Clock::now() < deadline) {
    v1::GetSequenceResponse resp;
    const auto t0 = Clock::now();
    grpc::ClientContext ctx;
    AddBearer(&ctx, token);
    const grpc::Status s = stub->GetSequence(&ctx, req, &resp);
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
