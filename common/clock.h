// Time sources. Core logic takes a Clock* so policy tests run on a FakeClock
// with no sleeps.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace triax {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  // Milliseconds since the Unix epoch.
  virtual int64_t NowMs() const = 0;
};

class RealClock final : public Clock {
 public:
  int64_t NowMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  static RealClock* Get() {
    static RealClock clock;
    return &clock;
  }
};

// Manually advanced; thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_(start_ms) {}
  int64_t NowMs() const override { return now_.load(); }
  void AdvanceMs(int64_t ms) { now_.fetch_add(ms); }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace triax
