// Timings of the store's device work, for the worker's /metrics
// (worker/metrics.h): decode-attention batches and sequence imports.
//
// Attention: the kernel attends a sequence's pages of mixed encodings in one
// launch, and one DecodeAttentionBatch runs several items, so a batch's time
// cannot be split by format; it is observed under the batch's K-format mix
// ("bf16", "bf16+int4", formats in enum order), and the pages it attended
// are counted per K format. Imports (the destination side of a transfer):
// count, page bytes received and time by data path ("stream", "ipc",
// "link", "none") and result.
//
// The series are prometheus-cpp histograms and counters without a registry;
// WorkerMetrics collects them. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/layout.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"

namespace triax::worker {

class OpTimings {
 public:
  // One DecodeAttentionBatch: `pages_by_format[f]` pages of K format f
  // (index: the Format's value) took `seconds`.
  void RecordAttention(const std::vector<uint64_t>& pages_by_format,
                       double seconds);
  // One import that ended (ok or not) after `seconds`.
  void RecordImport(const std::string& data_path, bool ok, uint64_t wire_bytes,
                    double seconds);

  // The families, named with `prefix` ("triaxkv_worker_").
  std::vector<prometheus::MetricFamily> Collect(
      const std::string& prefix) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<prometheus::Histogram>> attention_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<prometheus::Counter>> pages_
      ABSL_GUARDED_BY(mu_);
  // (data path, result) -> import time; data path -> bytes.
  std::map<std::pair<std::string, std::string>,
           std::unique_ptr<prometheus::Histogram>>
      imports_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<prometheus::Counter>> import_bytes_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace triax::worker
