#include "worker/prefetch_queue.h"

#include <utility>

namespace triax::worker {

PrefetchQueue::PrefetchQueue(bool own_thread) {
  if (own_thread) thread_ = std::thread([this] { Loop(); });
}

PrefetchQueue::~PrefetchQueue() { Stop(); }

bool PrefetchQueue::Push(Job job) {
  if (!job) return false;
  absl::MutexLock lock(&mu_);
  if (stop_) return false;
  jobs_.push_back(std::move(job));
  return true;
}

bool PrefetchQueue::Take(Job* job) {
  if (jobs_.empty()) return false;
  *job = std::move(jobs_.front());
  jobs_.pop_front();
  ++running_;
  return true;
}

size_t PrefetchQueue::ServeAll() {
  size_t ran = 0;
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      if (!Take(&job)) return ran;
    }
    job();
    ++ran;
    // The job's captures go before it counts as done, so that WaitIdle
    // returning means they are released too.
    job = nullptr;
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

void PrefetchQueue::Loop() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](PrefetchQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
            return q->stop_ || !q->jobs_.empty();
          },
          this));
      if (stop_) return;
      Take(&job);
    }
    job();
    job = nullptr;
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

void PrefetchQueue::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](PrefetchQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
        return q->jobs_.empty() && q->running_ == 0;
      },
      this));
}

size_t PrefetchQueue::Queued() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

void PrefetchQueue::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  std::deque<Job> unrun;
  {
    absl::MutexLock lock(&mu_);
    unrun.swap(jobs_);
  }
  // Destroyed here, outside the mutex: a job's captures may own anything.
}

}  // namespace triax::worker
