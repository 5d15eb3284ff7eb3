#include "worker/op_timings.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace triax::worker {
namespace {

// Attention batches: 10 us (one short CPU item) to 1 s.
const prometheus::Histogram::BucketBoundaries& AttentionBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
      0.005,   0.01,     0.025,   0.05,   0.1,     0.25,   0.5,   1};
  return *b;
}

// Imports: 1 ms to 60 s.
const prometheus::Histogram::BucketBoundaries& ImportBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
      0.5,   1,      2.5,   5,    10,    30,   60};
  return *b;
}

template <typename Map, typename Key, typename... Args>
auto& Get(Map& map, const Key& key, Args&&... args) {
  auto& slot = map[key];
  if (slot == nullptr) {
    slot = std::make_unique<typename Map::mapped_type::element_type>(
        std::forward<Args>(args)...);
  }
  return *slot;
}

void Append(prometheus::MetricFamily* f,
            std::vector<prometheus::ClientMetric::Label> labels,
            prometheus::ClientMetric m) {
  m.label = std::move(labels);
  f->metric.push_back(std::move(m));
}

}  // namespace

void OpTimings::RecordAttention(const std::vector<uint64_t>& pages_by_format,
                                double seconds) {
  std::string mix;
  for (size_t f = 0; f < pages_by_format.size(); ++f) {
    if (pages_by_format[f] == 0) continue;
    absl::StrAppend(&mix, mix.empty() ? "" : "+",
                    kernels::FormatName(static_cast<kernels::Format>(f)));
  }
  if (mix.empty()) return;
  absl::MutexLock lock(&mu_);
  Get(attention_, mix, AttentionBuckets()).Observe(seconds);
  for (size_t f = 0; f < pages_by_format.size(); ++f) {
    if (pages_by_format[f] == 0) continue;
    Get(pages_,
        std::string(kernels::FormatName(static_cast<kernels::Format>(f))))
        .Increment(static_cast<double>(pages_by_format[f]));
  }
}

void OpTimings::RecordImport(const std::string& data_path, bool ok,
                             uint64_t wire_bytes, double seconds) {
  absl::MutexLock lock(&mu_);
  Get(imports_, std::make_pair(data_path, std::string(ok ? "ok" : "error")),
      ImportBuckets())
      .Observe(seconds);
  Get(import_bytes_, data_path).Increment(static_cast<double>(wire_bytes));
}

std::vector<prometheus::MetricFamily> OpTimings::Collect(
    const std::string& prefix) const {
  prometheus::MetricFamily attention;
  attention.name = absl::StrCat(prefix, "attention_seconds");
  attention.help =
      "Time of decode-attention device batches, by the batch's K-format mix "
      "(pages of mixed formats run in one kernel launch).";
  attention.type = prometheus::MetricType::Histogram;
  prometheus::MetricFamily pages;
  pages.name = absl::StrCat(prefix, "attention_pages_total");
  pages.help = "Pages attended by decode-attention batches, by K format.";
  pages.type = prometheus::MetricType::Counter;
  prometheus::MetricFamily imports;
  imports.name = absl::StrCat(prefix, "import_seconds");
  imports.help =
      "Time of sequence imports (the destination side of a transfer), by "
      "data path and result.";
  imports.type = prometheus::MetricType::Histogram;
  prometheus::MetricFamily bytes;
  bytes.name = absl::StrCat(prefix, "import_wire_bytes_total");
  bytes.help = "Page bytes imports received, by data path.";
  bytes.type = prometheus::MetricType::Counter;
  absl::MutexLock lock(&mu_);
  for (const auto& [mix, h] : attention_) {
    Append(&attention, {{"formats", mix}}, h->Collect());
  }
  for (const auto& [format, c] : pages_) {
    Append(&pages, {{"format", format}}, c->Collect());
  }
  for (const auto& [key, h] : imports_) {
    Append(&imports, {{"path", key.first}, {"result", key.second}},
           h->Collect());
  }
  for (const auto& [path, c] : import_bytes_) {
    Append(&bytes, {{"path", path}}, c->Collect());
  }
  return {attention, pages, imports, bytes};
}

}  // namespace triax::worker
