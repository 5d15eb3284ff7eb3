#include "worker/prefetch_queue.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace triax::worker {
namespace {

using ::testing::ElementsAre;

// Records the order jobs ran in.
class Trace {
 public:
  PrefetchQueue::Job Job(int id) {
    return [this, id] {
      absl::MutexLock lock(&mu_);
      ran_.push_back(id);
    };
  }
  std::vector<int> ran() const {
    absl::MutexLock lock(&mu_);
    return ran_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<int> ran_ ABSL_GUARDED_BY(mu_);
};

TEST(PrefetchQueueTest, WithoutAThreadJobsWaitForServeAllAndRunInOrder) {
  PrefetchQueue q(/*own_thread=*/false);
  Trace trace;
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(q.Push(trace.Job(i)));
  EXPECT_EQ(q.Queued(), 3u);
  EXPECT_TRUE(trace.ran().empty());
  EXPECT_EQ(q.ServeAll(), 3u);
  EXPECT_THAT(trace.ran(), ElementsAre(0, 1, 2));
  EXPECT_EQ(q.Queued(), 0u);
  EXPECT_EQ(q.ServeAll(), 0u);
  q.WaitIdle();  // empty and nothing running: returns at once
}

TEST(PrefetchQueueTest, ServeAllRunsJobsThatJobsPush) {
  PrefetchQueue q(/*own_thread=*/false);
  Trace trace;
  ASSERT_TRUE(q.Push([&] {
    trace.Job(0)();
    EXPECT_TRUE(q.Push(trace.Job(1)));
  }));
  EXPECT_EQ(q.ServeAll(), 2u);
  EXPECT_THAT(trace.ran(), ElementsAre(0, 1));
}

TEST(PrefetchQueueTest, EmptyJobsAreRefused) {
  PrefetchQueue q(/*own_thread=*/false);
  EXPECT_FALSE(q.Push(nullptr));
  EXPECT_FALSE(q.Push(PrefetchQueue::Job()));
  EXPECT_EQ(q.Queued(), 0u);
  EXPECT_EQ(q.ServeAll(), 0u);
}

TEST(PrefetchQueueTest, ThreadRunsJobsInOrderAndWaitIdleWaitsForThem) {
  PrefetchQueue q(/*own_thread=*/true);
  Trace trace;
  absl::Notification started, release;
  auto held = std::make_shared<int>(0);
  ASSERT_TRUE(q.Push([&, held] {
    started.Notify();
    release.WaitForNotification();
    trace.Job(0)();
  }));
  started.WaitForNotification();
  // The first job is running: later ones queue behind it.
  ASSERT_TRUE(q.Push(trace.Job(1)));
  ASSERT_TRUE(q.Push(trace.Job(2)));
  EXPECT_EQ(q.Queued(), 2u);
  release.Notify();
  q.WaitIdle();
  EXPECT_THAT(trace.ran(), ElementsAre(0, 1, 2));
  EXPECT_EQ(q.Queued(), 0u);
  // A finished job's captures are gone by the time WaitIdle returns.
  EXPECT_EQ(held.use_count(), 1);
}

TEST(PrefetchQueueTest, StopDestroysQueuedJobsUnrunAndRefusesLaterPushes) {
  PrefetchQueue q(/*own_thread=*/false);
  Trace trace;
  auto held = std::make_shared<int>(0);
  ASSERT_TRUE(q.Push([&, held] { trace.Job(0)(); }));
  EXPECT_EQ(held.use_count(), 2);
  q.Stop();
  EXPECT_EQ(held.use_count(), 1);
  EXPECT_FALSE(q.Push(trace.Job(1)));
  EXPECT_EQ(q.ServeAll(), 0u);
  q.Stop();  // idempotent
  EXPECT_TRUE(trace.ran().empty());
}

TEST(PrefetchQueueTest, StopWaitsForTheRunningJob) {
  PrefetchQueue q(/*own_thread=*/true);
  absl::Notification started, release;
  bool finished = false;
  ASSERT_TRUE(q.Push([&] {
    started.Notify();
    release.WaitForNotification();
    finished = true;
  }));
  started.WaitForNotification();
  std::thread stopper([&] { q.Stop(); });
  release.Notify();
  stopper.join();
  EXPECT_TRUE(finished);  // Stop returned only after the job did
  EXPECT_FALSE(q.Push([] {}));
}

}  // namespace
}  // namespace triax::worker
