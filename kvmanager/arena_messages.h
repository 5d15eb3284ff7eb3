// Request and reply of a callback unary RPC on one protobuf arena, for the
// Manager RPCs whose replies carry block plans (a BlockPlan and its Tag per
// block): their messages are bump-allocated in a block the holder owns and
// dropped at once, instead of one heap allocation and one free per
// sub-message. Holders are pooled, so a call allocates nothing once the
// pool is warm. Measured on manager_bench's sessions (41 blocks opened, 95
// plans in an Extend's reply): bench/results/manager.md "Control plane at
// 40k RPCs/s".
//
// Thread contract: thread-safe (gRPC allocates and releases from any
// thread). The allocator must outlive the server.
#pragma once

#include <google/protobuf/arena.h>
#include <grpcpp/support/message_allocator.h>

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace triax::manager {

template <typename Request, typename Response>
class ArenaMessageAllocator final
    : public grpc::MessageAllocator<Request, Response> {
 public:
  ArenaMessageAllocator() = default;
  ~ArenaMessageAllocator() override {
    for (Holder* h : free_) delete h;
  }
  ArenaMessageAllocator(const ArenaMessageAllocator&) = delete;
  ArenaMessageAllocator& operator=(const ArenaMessageAllocator&) = delete;

  grpc::MessageHolder<Request, Response>* AllocateMessages() override {
    Holder* h = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        h = free_.back();
        free_.pop_back();
      }
    }
    if (h == nullptr) h = new Holder(this);
    h->Start();
    return h;
  }

 private:
  // The first block of each holder's arena: an Open's request and reply of
  // 41 blocks take ~12 KiB, an Extend's of 95 plans ~24 KiB.
  static constexpr size_t kBlockBytes = 32 << 10;
  // Holders kept for reuse (more are freed): beyond the calls in flight.
  static constexpr size_t kMaxFree = 256;

  class Holder final : public grpc::MessageHolder<Request, Response> {
   public:
    explicit Holder(ArenaMessageAllocator* owner)
        : owner_(owner),
          block_(new char[kBlockBytes]),
          arena_(Options(block_.get())) {}
    void Start() {
      this->set_request(
          google::protobuf::Arena::CreateMessage<Request>(&arena_));
      this->set_response(
          google::protobuf::Arena::CreateMessage<Response>(&arena_));
    }
    void Release() override {
      arena_.Reset();  // keeps the first block
      owner_->Recycle(this);
    }

   private:
    static google::protobuf::ArenaOptions Options(char* block) {
      google::protobuf::ArenaOptions o;
      o.initial_block = block;
      o.initial_block_size = kBlockBytes;
      return o;
    }
    ArenaMessageAllocator* const owner_;
    std::unique_ptr<char[]> block_;
    google::protobuf::Arena arena_;
  };

  void Recycle(Holder* h) {
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() < kMaxFree) {
        free_.push_back(h);
        return;
      }
    }
    delete h;
  }

  absl::Mutex mu_;
  std::vector<Holder*> free_ ABSL_GUARDED_BY(mu_);
};

// Arenas with a first block of their own, pooled, for messages that are
// not a unary call's (SequenceCalls' replies: manager_service_stream.cc).
// Take() an arena, create messages on it, Give() it back when they are
// done with: it is Reset (its first block kept) and reused.
//
// Thread contract: thread-safe.
class ArenaPool {
 public:
  class Lease {
   public:
    google::protobuf::Arena* arena() { return &arena_; }

   private:
    friend class ArenaPool;
    Lease() : block_(new char[kBlockBytes]), arena_(Options(block_.get())) {}
    static google::protobuf::ArenaOptions Options(char* b) {
      google::protobuf::ArenaOptions o;
      o.initial_block = b;
      o.initial_block_size = kBlockBytes;
      return o;
    }
    std::unique_ptr<char[]> block_;
    google::protobuf::Arena arena_;
  };

  ArenaPool() = default;
  ~ArenaPool() {
    for (Lease* l : free_) delete l;
  }
  ArenaPool(const ArenaPool&) = delete;
  ArenaPool& operator=(const ArenaPool&) = delete;

  Lease* Take() {
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        Lease* l = free_.back();
        free_.pop_back();
        return l;
      }
    }
    return new Lease();
  }

  // `lease` came from Take(); the messages on its arena are gone after this.
  void Give(Lease* lease) {
    lease->arena_.Reset();  // keeps the first block
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() < kMaxFree) {
        free_.push_back(lease);
        return;
      }
    }
    delete lease;
  }

 private:
  // Smaller than ArenaMessageAllocator's: a lease is held from a call's
  // arrival to its reply's write (bounded by the streams' limits), and a
  // larger reply grows the arena from the heap (freed by Reset).
  static constexpr size_t kBlockBytes = 8 << 10;
  static constexpr size_t kMaxFree = 256;

  absl::Mutex mu_;
  std::vector<Lease*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::manager
