// Test helper: a Device that runs everything on a CpuDevice and records the
// batches DecodeAttentionBatch and DemotePages receive; SetUnhealthy makes
// Health() (and every later compute call) report UNAVAILABLE the way a
// poisoned CUDA backend does. Header-only, for worker tests.
//
// Thread contract: thread-safe (the record and health have their own mutex).
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/device.h"

namespace triax::worker {

class RecordingDevice final : public Device {
 public:
  // `share_arena`: CpuDevice's shared-memory arenas (the ipc path).
  explicit RecordingDevice(bool share_arena = false) : cpu_(share_arena) {}
  const char* Name() const override { return "cpu"; }

  // Sizes of the CopyPagesChecked calls so far (the ipc path's copies).
  std::vector<size_t> checked_copies() const {
    absl::MutexLock lock(&mu_);
    return checked_copies_;
  }

  // Sizes of the DecodeAttentionBatch / DemotePages calls so far.
  std::vector<size_t> attention_batches() const {
    absl::MutexLock lock(&mu_);
    return attention_batches_;
  }
  std::vector<size_t> demote_batches() const {
    absl::MutexLock lock(&mu_);
    return demote_batches_;
  }
  // Sizes of the WriteBf16TokensBatch calls, and how many WriteBf16Tokens
  // calls came from elsewhere (one write each).
  std::vector<size_t> token_write_batches() const {
    absl::MutexLock lock(&mu_);
    return token_write_batches_;
  }
  size_t single_token_writes() const {
    absl::MutexLock lock(&mu_);
    return single_token_writes_;
  }
  void ClearRecord() {
    absl::MutexLock lock(&mu_);
    attention_batches_.clear();
    demote_batches_.clear();
    token_write_batches_.clear();
    single_token_writes_ = 0;
  }
  void SetUnhealthy(std::string why) {
    absl::MutexLock lock(&mu_);
    unhealthy_ = std::move(why);
  }

  absl::Status Health() const override {
    absl::MutexLock lock(&mu_);
    if (unhealthy_.empty()) return absl::OkStatus();
    return absl::UnavailableError(unhealthy_);
  }
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    return cpu_.AllocateArena(bytes);
  }
  void FreeArena(uint8_t* base, size_t bytes) override {
    cpu_.FreeArena(base, bytes);
  }
  absl::Status EncodePage(const kernels::Encoding& e,
                          const kernels::PageShape& shape,
                          const uint16_t* k_bf16, const uint16_t* v_bf16,
                          int num_tokens, uint8_t* page) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    return cpu_.EncodePage(e, shape, k_bf16, v_bf16, num_tokens, page);
  }
  absl::Status DecodePage(const kernels::Encoding& e,
                          const kernels::PageShape& shape, const uint8_t* page,
                          int num_tokens, float* k_out, float* v_out) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    return cpu_.DecodePage(e, shape, page, num_tokens, k_out, v_out);
  }
  absl::Status WriteBf16Tokens(const kernels::PageShape& shape,
                               const uint16_t* k_bf16, const uint16_t* v_bf16,
                               int first_slot, int num_tokens,
                               uint8_t* page) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    if (InBatch() == 0) {
      absl::MutexLock lock(&mu_);
      ++single_token_writes_;
    }
    return cpu_.WriteBf16Tokens(shape, k_bf16, v_bf16, first_slot, num_tokens,
                                page);
  }
  absl::Status WriteBf16TokensBatch(
      const kernels::PageShape& shape,
      absl::Span<const TokenWrite> writes) override {
    {
      absl::MutexLock lock(&mu_);
      token_write_batches_.push_back(writes.size());
    }
    ++InBatch();  // this thread's WriteBf16Tokens calls are the batch's
    absl::Status s = Device::WriteBf16TokensBatch(shape, writes);
    --InBatch();
    return s;
  }
  absl::Status CopyPage(uint8_t* dst, const uint8_t* src,
                        size_t bytes) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    return cpu_.CopyPage(dst, src, bytes);
  }
  absl::Status DecodeAttention(const kernels::DecodeParams& p) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    return cpu_.DecodeAttention(p);
  }
  absl::Status DecodeAttentionBatch(
      absl::Span<const kernels::DecodeParams> batch) override {
    {
      absl::MutexLock lock(&mu_);
      attention_batches_.push_back(batch.size());
    }
    return Device::DecodeAttentionBatch(batch);
  }
  absl::Status DemotePages(const kernels::PageShape& shape,
                           absl::Span<const DemoteJob> jobs) override {
    {
      absl::MutexLock lock(&mu_);
      demote_batches_.push_back(jobs.size());
    }
    return Device::DemotePages(shape, jobs);
  }
  absl::Status CopyToHost(void* host_dst, const uint8_t* dev_src,
                          size_t bytes) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    return cpu_.CopyToHost(host_dst, dev_src, bytes);
  }
  absl::Status CopyFromHost(uint8_t* dev_dst, const void* host_src,
                            size_t bytes) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    return cpu_.CopyFromHost(dev_dst, host_src, bytes);
  }
  absl::StatusOr<uint8_t*> AllocateHostTier(size_t bytes) override {
    return cpu_.AllocateHostTier(bytes);
  }
  void FreeHostTier(uint8_t* base, size_t bytes) override {
    cpu_.FreeHostTier(base, bytes);
  }
  absl::Status Checksum(absl::Span<const DeviceBytes> ranges,
                        absl::Span<uint32_t> crcs) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    {
      absl::MutexLock lock(&mu_);
      checksums_.push_back(ranges.size());
    }
    return cpu_.Checksum(ranges, crcs);
  }
  void ClearChecksums() {
    absl::MutexLock lock(&mu_);
    checksums_.clear();
  }
  // Sizes of the Checksum calls so far.
  std::vector<size_t> checksums() const {
    absl::MutexLock lock(&mu_);
    return checksums_;
  }
  // Pretends to be a device whose processes time-slice (as a GPU).
  void set_time_slices_processes(bool on) { time_slices_ = on; }
  bool TimeSlicesProcesses() const override { return time_slices_; }
  absl::Status CopyPagesChecked(absl::Span<const PageCopy> jobs,
                                absl::Span<uint32_t> crcs) override {
    if (absl::Status s = Health(); !s.ok()) return s;
    {
      absl::MutexLock lock(&mu_);
      checked_copies_.push_back(jobs.size());
    }
    return cpu_.CopyPagesChecked(jobs, crcs);
  }
  std::string ShareDomain() const override { return cpu_.ShareDomain(); }
  absl::StatusOr<std::string> ShareArena(const uint8_t* base,
                                         size_t bytes) override {
    return cpu_.ShareArena(base, bytes);
  }
  absl::StatusOr<const uint8_t*> OpenPeerArena(absl::string_view handle,
                                               size_t bytes) override {
    return cpu_.OpenPeerArena(handle, bytes);
  }
  void ClosePeerArena(const uint8_t* base, size_t bytes) override {
    cpu_.ClosePeerArena(base, bytes);
  }
  absl::Status EnableLinks(const LinkOptions& options) override {
    return cpu_.EnableLinks(options);
  }
  std::string LinkBackend() const override { return cpu_.LinkBackend(); }
  absl::StatusOr<std::string> NewLinkId() override { return cpu_.NewLinkId(); }
  absl::StatusOr<std::unique_ptr<DeviceLink>> ConnectLink(
      absl::string_view id, int rank, absl::Time deadline,
      const std::function<bool()>& cancelled) override {
    return cpu_.ConnectLink(id, rank, deadline, cancelled);
  }

 private:
  CpuDevice cpu_;
  mutable absl::Mutex mu_;
  std::vector<size_t> attention_batches_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> token_write_batches_ ABSL_GUARDED_BY(mu_);
  size_t single_token_writes_ ABSL_GUARDED_BY(mu_) = 0;
  static int& InBatch() {
    static thread_local int depth = 0;
    return depth;
  }
  std::vector<size_t> demote_batches_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> checked_copies_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> checksums_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> time_slices_{false};
  std::string unhealthy_ ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
