// transfer_bench's processes and the worker RPCs it drives directly (no
// manager): a kvworker process started from the bin directory with the
// bench's flags, optionally pinned to CPUs, and the calls a transfer needs
// (AllocatePages, WriteKV, ImportSequence, FreePages), each returning
// absl::Status with the worker's code and message. Thread-compatible; one
// BenchWorker may serve calls from two threads at once (the gRPC stub is
// thread-safe), as the layer-by-layer case does (writes on one thread, the
// import on another).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "bench/common/process.h"
#include "bench/transfer/transfer_cases.h"
#include "tests/integration/process.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::bench {

inline constexpr char kTenant[] = "bench";

struct WorkerLaunch {
  std::string backend = "cpu";           // --backend
  int64_t pool_mb = 1024;                // --pool_mb
  std::vector<std::string> extra_flags;  // appended verbatim, last
  std::string cpus;                      // empty: not pinned
  std::string cpus_flag;                 // the flag that gave `cpus`
};

// BF16 K and V of `chunk_tokens` tokens ([token][kv head][head_dim]),
// normal(0, 1) from a fixed seed: every WriteKV message carries these bytes
// (or a prefix), whatever its layer and position.
struct KvPattern {
  uint32_t chunk_tokens = 0;
  std::string k, v;
  static KvPattern Make(const BenchShape& shape, uint32_t chunk_tokens,
                        uint32_t seed);
};

triax::v1::ModelShape ModelProto(const BenchShape& shape);

// Blocks of `shape.block_tokens` over [0, tokens), block i in encodings[i],
// lineage ids from `first_lineage`.
google::protobuf::RepeatedPtrField<triax::v1::BlockPlan> MakePlan(
    uint32_t tokens, const BenchShape& shape,
    const std::vector<kernels::Encoding>& encodings, uint64_t first_lineage);

class BenchWorker {
 public:
  // Starts kvworker from $TRIAX_BIN_DIR on 127.0.0.1 port 0 with
  // --worker_id=<id>, --backend, --pool_mb, --host_tier_mb=0 and the extra
  // flags, waits for its port, then pins it.
  static absl::StatusOr<std::unique_ptr<BenchWorker>> Start(
      const std::string& id, const WorkerLaunch& launch,
      const std::string& dir);

  const std::string& id() const { return id_; }
  std::string address() const { return process_->address(); }
  std::string Log() const { return process_->Log(); }

  // AllocatePages with window_tokens 0 (blocks seal as soon as they are
  // full).
  absl::Status Allocate(
      const std::string& sequence_id, const BenchShape& shape,
      const google::protobuf::RepeatedPtrField<triax::v1::BlockPlan>& plan);
  // One WriteKV stream: tokens [0, tokens) of `layer` in BF16 messages of
  // `pattern.chunk_tokens` tokens; returns when the worker answered.
  absl::Status WriteLayer(const std::string& sequence_id, uint32_t layer,
                          uint32_t tokens, const KvPattern& pattern);
  absl::StatusOr<triax::v1::ImportSequenceResponse> Import(
      const triax::v1::ImportSequenceRequest& request);
  absl::Status Free(const std::string& sequence_id);
  // The worker's stub (thread-safe), for calls the bench makes itself.
  triax::v1::Worker::Stub* stub() const { return stub_.get(); }
  pid_t pid() const { return process_->pid(); }

 private:
  BenchWorker() = default;
  std::string id_;
  std::unique_ptr<testing::Process> process_;
  std::unique_ptr<triax::v1::Worker::Stub> stub_;
};

}  // namespace triax::bench
