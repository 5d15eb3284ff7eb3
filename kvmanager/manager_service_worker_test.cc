// Manager RPCs over real gRPC that involve policies, a (fake) worker or the
// tagger: PutPolicy/ListPolicies, DemoteBlocks through the worker, Open and
// Extend with rendered text, the calibration RPCs, an Open admitted after a
// reclaim round through the worker (and refused when the worker fails).
#include "kvmanager/manager_service.h"
#include "kvmanager/manager_service_test_util.h"

namespace triax::manager {
namespace {

class FakeWorker final : public v1::Worker::Service {
 public:
  grpc::Status Demote(grpc::ServerContext*, const v1::DemoteRequest* req,
                      v1::DemoteResponse* resp) override {
    absl::MutexLock lock(&mu);
    requests.push_back(*req);
    if (fail) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "pool is full");
    }
    resp->set_pages_reencoded(static_cast<uint64_t>(req->blocks_size()) * 2);
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  std::vector<v1::DemoteRequest> requests ABSL_GUARDED_BY(mu);
  bool fail ABSL_GUARDED_BY(mu) = false;
};

TEST_F(ServiceTest, PutAndListPoliciesIdempotently) {
  v1::PutPolicyRequest req = PolicyReq();
  req.set_request_id("pol-1");
  v1::PutPolicyResponse a, b;
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutPolicy, req, &a).ok());
  EXPECT_EQ(a.policy().name(), "mixed");
  EXPECT_FALSE(a.policy().builtin());
  ASSERT_EQ(a.policy().rules_size(), 2);
  EXPECT_EQ(a.policy().rules(0).format_v(), v1::FORMAT_INT4);
  EXPECT_EQ(a.policy().rules(0).group_size(), 64u);
  EXPECT_EQ(a.policy().rules(0).scale_dtype(), v1::SCALE_DTYPE_FP16);
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutPolicy, req, &b).ok());
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  v1::ListPoliciesResponse list;
  ASSERT_TRUE(
      Call(&v1::Manager::Stub::ListPolicies, v1::ListPoliciesRequest(), &list)
          .ok());
  ASSERT_EQ(list.policies_size(), 10);
  EXPECT_EQ(list.policies(0).name(), "triaxial-static");
  EXPECT_TRUE(list.policies(0).builtin());
  EXPECT_EQ(list.policies(0).rules_size(), 6);
  EXPECT_EQ(list.policies(0).rules(0).temporal(), v1::TEMPORAL_SINK);
  EXPECT_EQ(list.policies(9).name(), "mixed");
  // A sequence under it gets the rule encodings in its plan.
  v1::OpenSequenceRequest open = OpenReq();
  open.set_policy("mixed");
  v1::OpenSequenceResponse o;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, open, &o).ok());
  ASSERT_EQ(o.sequence().blocks_size(), 3);
  const auto& b0 = o.sequence().blocks(0);
  EXPECT_EQ(b0.format(), v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(b0.format_v(), v1::FORMAT_INT4);
  EXPECT_EQ(b0.group_size(), 64u);
  EXPECT_EQ(o.sequence().blocks(2).format(), v1::FORMAT_INT2);
  EXPECT_EQ(o.sequence().blocks(2).format_v(), v1::FORMAT_INT2);
}

TEST_F(ServiceTest, DemoteBlocksGoesThroughTheWorker) {
  FakeWorker fake;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&fake);
  auto worker_server = builder.BuildAndStart();
  ASSERT_NE(worker_server, nullptr);
  v1::RegisterWorkerRequest reg;
  reg.set_worker_id("wd");
  reg.set_address("127.0.0.1:" + std::to_string(port));
  reg.set_backend("cpu");
  reg.set_capacity_bytes(1ull << 41);  // more room: sequences go here
  v1::RegisterWorkerResponse reg_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, reg, &reg_resp).ok());
  v1::OpenSequenceResponse o;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &o).ok());
  ASSERT_EQ(o.sequence().worker_id(), "wd");
  const std::string seq = o.sequence().sequence_id();
  const uint64_t lineage = o.sequence().blocks(2).lineage_id();  // user, bf16
  ASSERT_EQ(o.sequence().blocks(2).format(), v1::FORMAT_BF16);

  // The worker fails: its status comes back, the plan stays.
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = true;
  }
  const std::string before = StateSnapshot();
  v1::DemoteBlocksRequest req = DemoteReq(seq, lineage, v1::FORMAT_INT2);
  req.set_request_id("dem-1");
  v1::DemoteBlocksResponse r1;
  grpc::Status st = Call(&v1::Manager::Stub::DemoteBlocks, req, &r1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(st.error_message(), "worker \"wd\" Demote: pool is full");
  EXPECT_EQ(StateSnapshot(), before);

  // It succeeds: the plan and the usage change; a repeat changes nothing.
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = false;
  }
  ASSERT_TRUE(Call(&v1::Manager::Stub::DemoteBlocks, req, &r1).ok());
  EXPECT_EQ(r1.sequence().blocks(2).format(), v1::FORMAT_INT2);
  EXPECT_EQ(r1.sequence().blocks(2).format_v(), v1::FORMAT_INT2);
  EXPECT_EQ(r1.sequence().blocks(2).group_size(), 32u);
  EXPECT_LT(r1.bytes_delta(), 0);
  EXPECT_EQ(static_cast<int64_t>(r1.sequence().bytes()),
            static_cast<int64_t>(o.sequence().bytes()) + r1.bytes_delta());
  v1::DemoteBlocksResponse r2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::DemoteBlocks, req, &r2).ok());
  EXPECT_EQ(r1.SerializeAsString(), r2.SerializeAsString());
  {
    absl::MutexLock lock(&fake.mu);
    ASSERT_EQ(fake.requests.size(), 2u);  // the failed call and the success
    const v1::DemoteRequest& w = fake.requests[1];
    EXPECT_EQ(w.request_id(), "dem-1");
    EXPECT_EQ(w.tenant_id(), "acme");
    EXPECT_EQ(w.sequence_id(), seq);
    ASSERT_EQ(w.blocks_size(), 1);
    EXPECT_EQ(w.blocks(0).lineage_id(), lineage);
    EXPECT_EQ(w.blocks(0).index(), 2u);
    EXPECT_EQ(w.blocks(0).format(), v1::FORMAT_INT2);
    EXPECT_EQ(w.blocks(0).group_size(), 32u);
  }
  v1::GetSequenceRequest get;
  get.set_tenant_id("acme");
  get.set_sequence_id(seq);
  v1::GetSequenceResponse got;
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &got).ok());
  EXPECT_EQ(got.sequence().SerializeAsString(),
            r1.sequence().SerializeAsString());

  // An unreachable worker: UNAVAILABLE, prefixed, nothing applied.
  worker_server->Shutdown();
  v1::DemoteBlocksRequest again = DemoteReq(seq, lineage, v1::FORMAT_INT4);
  v1::DemoteBlocksResponse r3;
  st = Call(&v1::Manager::Stub::DemoteBlocks, again, &r3);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(st.error_message(), HasSubstr("worker \"wd\" Demote: "));
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &got).ok());
  EXPECT_EQ(got.sequence().blocks(2).format(), v1::FORMAT_INT2);
}

TEST_F(ServiceTest, RefusedOpenReclaimsThenReportsWhatWasFreed) {
  FakeWorker fake;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&fake);
  auto worker_server = builder.BuildAndStart();
  ASSERT_NE(worker_server, nullptr);
  v1::RegisterWorkerRequest reg;
  reg.set_worker_id("wd");
  reg.set_address("127.0.0.1:" + std::to_string(port));
  reg.set_backend("cpu");
  reg.set_capacity_bytes(1ull << 41);  // more room: sequences go here
  v1::RegisterWorkerResponse reg_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, reg, &reg_resp).ok());
  // 33 blocks (28 outside the window guard) of the default policy's
  // encodings, 546304 bytes: a second one is over the tenant's 1 MiB.
  v1::OpenSequenceRequest req = OpenReq();
  req.mutable_spans(1)->set_num_tokens(500);
  v1::OpenSequenceResponse first;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, req, &first).ok());
  EXPECT_FALSE(first.has_reclaimed());  // it fit: no reclaim ran

  // The worker fails every Demote for room: the round plans around the
  // refused blocks for 3 stages, then stops; the refusal says so.
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = true;
  }
  v1::OpenSequenceResponse second;
  grpc::Status st = Call(&v1::Manager::Stub::OpenSequence, req, &second);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(),
              HasSubstr("tenant \"acme\" tier TIER_DEVICE"));
  EXPECT_THAT(st.error_message(),
              HasSubstr("reclaim freed 0 bytes in 3 stages (0 demotions"));
  EXPECT_THAT(st.error_message(), HasSubstr("still short by "));
  EXPECT_THAT(st.error_message(),
              HasSubstr("worker \"wd\" Demote: pool is full"));

  // The worker demotes: the Open is admitted and says what was freed.
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = false;
  }
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, req, &second).ok());
  ASSERT_TRUE(second.has_reclaimed());
  EXPECT_GE(second.reclaimed().stages(), 1u);
  EXPECT_GT(second.reclaimed().demotions(), 0u);
  EXPECT_GE(second.reclaimed().bytes_freed(),
            2 * first.sequence().bytes() - (1u << 20));
  EXPECT_EQ(second.reclaimed().failed_commands(), 0u);
  v1::GetSequenceRequest get;
  get.set_tenant_id("acme");
  get.set_sequence_id(first.sequence().sequence_id());
  v1::GetSequenceResponse got;
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &got).ok());
  // The first sequence gave exactly what the reply reports.
  EXPECT_EQ(got.sequence().bytes() + second.reclaimed().bytes_freed(),
            first.sequence().bytes());
  {
    absl::MutexLock lock(&fake.mu);
    uint32_t demoted = 0;
    for (const v1::DemoteRequest& d : fake.requests) {
      EXPECT_EQ(d.sequence_id(), first.sequence().sequence_id());
      demoted += d.blocks_size();
    }
    EXPECT_GE(demoted, second.reclaimed().demotions());
  }
}

TEST_F(ServiceTest, OpenAndExtendWithRenderedText) {
  // A Llama 3 prompt with tokenizer offsets and a BOS: "<|begin_of_text|>"
  // and each header one token, the contents one token per word.
  const std::string text =
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
      "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
      "Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  v1::OpenSequenceRequest req = OpenReq();
  req.clear_spans();
  req.set_block_tokens(2);
  v1::RenderedText* r = req.mutable_rendered();
  r->set_text(text);
  r->set_chat_template(v1::CHAT_TEMPLATE_LLAMA3);
  r->set_bos_tokens(1);
  for (const char* piece :
       {"<|begin_of_text|>", "<|start_header_id|>system",
        "<|end_header_id|>\n\n", "Be ", "brief.", "<|eot_id|>",
        "<|start_header_id|>user", "<|end_header_id|>\n\n", "Hi ", "there",
        "<|eot_id|>", "<|start_header_id|>assistant",
        "<|end_header_id|>\n\n"}) {
    const size_t at =
        text.find(piece, r->token_offsets_size() == 0
                             ? 0
                             : r->token_offsets(r->token_offsets_size() - 1));
    ASSERT_NE(at, std::string::npos) << piece;
    r->add_token_offsets(static_cast<uint32_t>(at));
  }
  v1::OpenSequenceResponse open;
  grpc::Status s = Call(&v1::Manager::Stub::OpenSequence, req, &open);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // BOS + 3 delimiter tokens, 2 system, 3 delimiter, 2 user, 3 delimiter.
  std::vector<std::pair<v1::Role, uint32_t>> blocks;
  for (const auto& b : open.sequence().blocks()) {
    blocks.emplace_back(b.tag().role(), b.num_tokens());
  }
  EXPECT_EQ(blocks, (std::vector<std::pair<v1::Role, uint32_t>>{
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_SYSTEM, 2},
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_DELIMITER, 1},
                        {v1::ROLE_USER, 2},
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_DELIMITER, 1}}));
  EXPECT_EQ(open.sequence().num_tokens(), 14u);
  EXPECT_EQ(open.sequence().turns(), 1u);

  // Decoded text of the open assistant message, then the next user turn
  // (byte-level: no offsets).
  v1::ExtendSequenceRequest ext;
  ext.set_tenant_id("acme");
  ext.set_sequence_id(open.sequence().sequence_id());
  ext.mutable_rendered()->set_text(
      "Hello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ");
  ext.mutable_rendered()->set_chat_template(v1::CHAT_TEMPLATE_LLAMA3);
  ext.mutable_rendered()->set_continues(v1::ROLE_ASSISTANT);
  v1::ExtendSequenceResponse er;
  s = Call(&v1::Manager::Stub::ExtendSequence, ext, &er);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("the ROLE_USER message has no"));
  ext.mutable_rendered()->set_text(
      "Hello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ"
      "<|eot_id|>");
  s = Call(&v1::Manager::Stub::ExtendSequence, ext, &er);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(er.sequence().turns(), 2u);
  EXPECT_EQ(er.sequence().num_tokens(),
            14u + 6 + 10 + 19 + 4 + 17 + 2 + 1 + 10);
  // The earlier turn aged: its blocks (but the sink) are recent now.
  ASSERT_FALSE(er.retagged_blocks().empty());
  for (const auto& b : er.retagged_blocks()) {
    EXPECT_EQ(b.tag().temporal(), v1::TEMPORAL_RECENT_TURNS);
  }
  EXPECT_EQ(er.new_blocks(0).tag().role(), v1::ROLE_ASSISTANT);
  EXPECT_EQ(er.new_blocks(0).tag().temporal(), v1::TEMPORAL_RECENT_TURNS);
  const auto& last = er.sequence().blocks(er.sequence().blocks_size() - 1);
  EXPECT_EQ(last.tag().role(), v1::ROLE_DELIMITER);
  EXPECT_EQ(last.tag().temporal(), v1::TEMPORAL_CURRENT_TURN);
}

TEST_F(ServiceTest, CalibrationRpcsValidateAndRoundTrip) {
  auto table = [] {
    v1::PutCalibrationRequest req;
    auto* t = req.mutable_table();
    t->set_model("tiny-cal");
    t->mutable_shape()->set_n_layers(2);
    t->mutable_shape()->set_n_kv_heads(2);
    t->mutable_shape()->set_n_q_heads(4);
    t->mutable_shape()->set_head_dim(64);
    t->set_block_tokens(16);
    for (v1::Format f : {v1::FORMAT_BF16, v1::FORMAT_INT4}) {
      auto* e = t->add_entries();
      e->mutable_tag()->set_temporal(v1::TEMPORAL_OLDER);
      e->mutable_tag()->set_role(v1::ROLE_USER);
      e->set_format(f);
      e->set_distortion(f == v1::FORMAT_BF16 ? 0 : 0.25);
    }
    t->mutable_source()->set_tool("calibrate 1.0");
    t->mutable_source()->add_held_out_ids("s9");
    return req;
  };
  struct Case {
    std::function<void(v1::PutCalibrationRequest*)> mutate;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](auto* r) { r->clear_table(); }, "table is not set"},
      {[](auto* r) { r->mutable_table()->clear_shape(); },
       "table.shape is not set"},
      {[](auto* r) { r->mutable_table()->set_model(""); }, "table.model"},
      {[](auto* r) { r->mutable_table()->set_block_tokens(5000); },
       "table.block_tokens 5000"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(1)->set_format(
             static_cast<v1::Format>(42));
       },
       "table.entries[1].format"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(0)->mutable_tag()->set_role(
             v1::ROLE_UNSPECIFIED);
       },
       "table.entries[0].tag.role"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(1)->set_distortion(-2);
       },
       "table.entries[1].distortion is -2"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(1)->set_format(v1::FORMAT_BF16);
       },
       "table.entries[1] repeats table.entries[0]"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::PutCalibrationRequest req = table();
    cases[i].mutate(&req);
    v1::PutCalibrationResponse resp;
    const grpc::Status st =
        Call(&v1::Manager::Stub::PutCalibration, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << i;
    EXPECT_THAT(st.error_message(), HasSubstr(cases[i].message)) << i;
    v1::GetCalibrationRequest get;
    get.set_model("tiny-cal");
    v1::GetCalibrationResponse got;
    EXPECT_EQ(Call(&v1::Manager::Stub::GetCalibration, get, &got).error_code(),
              grpc::StatusCode::NOT_FOUND)
        << i;
  }
  v1::GetCalibrationRequest get;
  get.set_model("tiny-cal");
  v1::GetCalibrationResponse got;
  grpc::Status st = Call(&v1::Manager::Stub::GetCalibration, get, &got);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("\"tiny-cal\""));

  v1::PutCalibrationRequest req = table();
  req.set_request_id("cal-1");
  v1::PutCalibrationResponse resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutCalibration, req, &resp).ok());
  EXPECT_EQ(resp.entries(), 2u);
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetCalibration, get, &got).ok());
  EXPECT_EQ(got.table().model(), "tiny-cal");
  ASSERT_EQ(got.table().entries_size(), 2);
  EXPECT_EQ(got.table().entries(1).format(), v1::FORMAT_INT4);
  EXPECT_EQ(got.table().entries(1).format_v(), v1::FORMAT_INT4);
  EXPECT_EQ(got.table().entries(1).group_size(), 32u);
  EXPECT_EQ(got.table().entries(1).tag().modality(), v1::MODALITY_TEXT);
  EXPECT_DOUBLE_EQ(got.table().entries(1).distortion(), 0.25);
  EXPECT_EQ(got.table().source().tool(), "calibrate 1.0");
  EXPECT_EQ(got.table().source().held_out_ids(0), "s9");

  // An allocation policy round-trips its fields; opening under it works.
  v1::PutPolicyRequest put;
  put.mutable_policy()->set_name("tri-4");
  put.mutable_policy()->set_budget_bits(14);
  put.mutable_policy()->set_calibration_model("tiny-cal");
  put.mutable_policy()->add_candidates()->set_format(v1::FORMAT_INT4);
  v1::PutPolicyResponse put_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutPolicy, put, &put_resp).ok());
  EXPECT_EQ(put_resp.policy().budget_bits(), 14);
  EXPECT_EQ(put_resp.policy().calibration_model(), "tiny-cal");
  ASSERT_EQ(put_resp.policy().candidates_size(), 1);
  EXPECT_EQ(put_resp.policy().candidates(0).format_v(), v1::FORMAT_INT4);
  v1::OpenSequenceRequest open = OpenReq();
  open.set_policy("tri-4");
  v1::OpenSequenceResponse open_resp;
  st = Call(&v1::Manager::Stub::OpenSequence, open, &open_resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  // sink BF16 (pinned), system BF16 (no entries for the role), user INT4
  // (borrowed from OLDER/USER): (16 x 16 + 4 x 16 + 12 x 5.5) / 32 = 12.06.
  ASSERT_EQ(open_resp.sequence().blocks_size(), 3);
  EXPECT_EQ(open_resp.sequence().blocks(0).format(), v1::FORMAT_BF16);
  EXPECT_EQ(open_resp.sequence().blocks(1).format(), v1::FORMAT_BF16);
  EXPECT_EQ(open_resp.sequence().blocks(2).format(), v1::FORMAT_INT4);
}

}  // namespace
}  // namespace triax::manager
