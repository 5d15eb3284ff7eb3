// A first-in first-out queue of background jobs: the sequence store queues
// background restores of spilled blocks here. Jobs run in push order, either
// on the queue's own thread or, when it has none (deterministic tests), on
// whichever thread calls ServeAll.
//
// Thread contract: thread-safe. A job runs without the queue's mutex held, so
// it may take locks ordered before it (the store's sequence mutexes; see the
// lock order on SequenceStore) and may push further jobs. Push may be called
// with such locks held. Stop (also run by the destructor) waits for the
// thread's current job, then destroys the jobs still queued without running
// them; later pushes are refused.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace triax::worker {

class PrefetchQueue {
 public:
  using Job = std::function<void()>;

  // `own_thread`: start a thread that runs jobs as they come; false: jobs
  // wait for ServeAll.
  explicit PrefetchQueue(bool own_thread);
  ~PrefetchQueue();

  PrefetchQueue(const PrefetchQueue&) = delete;
  PrefetchQueue& operator=(const PrefetchQueue&) = delete;

  // Queues `job`; false (nothing queued) when it is empty or the queue is
  // stopped.
  bool Push(Job job);

  // Runs queued jobs on the calling thread until the queue is empty,
  // including jobs pushed meanwhile; returns the number run.
  size_t ServeAll();

  // Returns once the queue is empty and no job runs. Without a thread this
  // only happens after ServeAll emptied it.
  void WaitIdle();

  // Jobs queued and not yet started.
  size_t Queued() const;

  // Joins the thread (after its current job) and destroys the queued jobs
  // unrun; idempotent.
  void Stop();

 private:
  // Pops the next job and counts it as running; false when there is none.
  bool Take(Job* job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace triax::worker
