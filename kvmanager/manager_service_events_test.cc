// WatchEvents over real gRPC: replay, live events up to max_events, a worker
// failure's lineage ids, and a cancelled watcher unsubscribing.
#include "kvmanager/manager_service.h"
#include "kvmanager/manager_service_test_util.h"

namespace triax::manager {
namespace {

TEST_F(ServiceTest, WatchEventsReplaysThenStreamsLiveUpToMaxEvents) {
  const std::string seq = Open("acme");  // 3 blocks + SEQUENCE_OPENED
  // Replay everything for this sequence, then two live events, then stop.
  grpc::ClientContext ctx;
  v1::WatchEventsRequest w;
  w.set_from_id(1);
  w.set_sequence_id(seq);
  w.set_max_events(6);
  auto reader = stub_->WatchEvents(&ctx, w);
  std::vector<v1::Event> got;
  v1::Event e;
  for (int i = 0; i < 4 && reader->Read(&e); ++i) got.push_back(e);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0].kind(), v1::EVENT_BLOCK_CREATED);
  EXPECT_EQ(got[0].lineage_id(), 1u);
  EXPECT_EQ(got[0].tag().temporal(), v1::TEMPORAL_SINK);
  EXPECT_EQ(got[3].kind(), v1::EVENT_SEQUENCE_OPENED);
  // Live: an event of another sequence is filtered out; closing ours yields
  // BLOCK_RELEASED, BLOCK_FREED for block 1, then the stream ends at 6.
  Open("other");
  v1::CloseSequenceRequest close;
  close.set_tenant_id("acme");
  close.set_sequence_id(seq);
  v1::CloseSequenceResponse close_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &close_resp).ok());
  while (reader->Read(&e)) got.push_back(e);
  EXPECT_TRUE(reader->Finish().ok());
  ASSERT_EQ(got.size(), 6u);
  EXPECT_EQ(got[4].kind(), v1::EVENT_BLOCK_RELEASED);
  EXPECT_EQ(got[5].kind(), v1::EVENT_BLOCK_FREED);
  EXPECT_EQ(got[5].lineage_id(), 1u);
  for (size_t i = 1; i < got.size(); ++i)
    EXPECT_GT(got[i].id(), got[i - 1].id());
  for (const auto& ev : got) EXPECT_EQ(ev.sequence_id(), seq);
}

TEST_F(ServiceTest, LiveWatcherSeesWorkerFailureWithLineageIds) {
  const std::string seq = Open("acme");
  grpc::ClientContext ctx;
  v1::WatchEventsRequest w;  // live only
  w.set_lineage_id(2);
  w.set_max_events(2);
  auto reader = stub_->WatchEvents(&ctx, w);
  // Make sure the stream is established before the failure happens.
  while (core_->events().subscribers() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  clock_.AdvanceMs(3001);
  ASSERT_EQ(core_->CheckWorkers().size(), 0u);  // SUSPECT: nothing lost
  clock_.AdvanceMs(27000);
  ASSERT_EQ(core_->CheckWorkers().size(), 1u);
  v1::Event e;
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.kind(), v1::EVENT_BLOCK_LOST);
  EXPECT_EQ(e.lineage_id(), 2u);
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.kind(), v1::EVENT_SEQUENCE_LOST);
  EXPECT_EQ(e.lineage_ids_size(), 3);
  EXPECT_FALSE(reader->Read(&e));
  EXPECT_TRUE(reader->Finish().ok());
  v1::GetSequenceRequest get;
  get.set_sequence_id(seq);
  v1::GetSequenceResponse got;
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &got).ok());
  EXPECT_EQ(got.sequence().state(), v1::SEQUENCE_STATE_LOST);
  EXPECT_EQ(got.sequence().lost_lineage_ids_size(), 3);
  // Opening now has nowhere to go.
  v1::OpenSequenceResponse resp;
  EXPECT_EQ(
      Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &resp).error_code(),
      grpc::StatusCode::UNAVAILABLE);
}

TEST_F(ServiceTest, CancelledWatcherUnsubscribes) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  v1::WatchEventsRequest w;
  auto reader = stub_->WatchEvents(ctx.get(), w);
  while (core_->events().subscribers() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ctx->TryCancel();
  v1::Event e;
  EXPECT_FALSE(reader->Read(&e));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 2000 && core_->events().subscribers() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(core_->events().subscribers(), 0u);
}

// A worker that only answers Demote: records the requests and fails while
// `fail` is set.

}  // namespace
}  // namespace triax::manager
