#include "worker/metrics.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "kernels/layout.h"

namespace triax::worker {
namespace {

using prometheus::MetricFamily;

std::string Name(absl::string_view suffix) {
  return absl::StrCat("triaxkv_worker_", suffix);
}

std::string EncodingLabel(const kernels::Encoding& e) {
  char buf[64];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

double D(uint64_t v) { return static_cast<double>(v); }

}  // namespace

std::vector<MetricFamily> WorkerMetrics::Collect() const {
  const InventorySnapshot inv = core_->Inventory();
  const AllocatorStats& a = inv.arena;
  std::vector<MetricFamily> out;
  auto gauge = [&out](const char* name, const char* help, double v) {
    MetricFamily f = GaugeFamily(Name(name), help);
    AddSample(&f, {}, v);
    out.push_back(std::move(f));
  };
  auto counter = [&out](const char* name, const char* help, double v) {
    MetricFamily f = CounterFamily(Name(name), help);
    AddSample(&f, {}, v);
    out.push_back(std::move(f));
  };
  gauge("pool_capacity_bytes", "Bytes of the device page arena.",
        D(inv.capacity_bytes));
  gauge("pool_used_bytes",
        "Bytes of the arena's pages in use (target and window pages).",
        D(inv.used_bytes));
  gauge("window_bytes", "Bytes of BF16 recent-window pages in use.",
        D(inv.window_bytes));
  gauge("pool_free_bytes", "Arena bytes not in pages in use.", D(a.free_bytes));
  gauge("pool_tail_bytes",
        "Arena bytes no page can use (frame tails and the arena tail).",
        D(a.tail_bytes));
  gauge("fragmentation_ratio",
        "Fraction of the free arena bytes not in whole free frames.",
        a.fragmentation);
  gauge("sequences", "Sequences the worker holds.", D(inv.sequence_ids.size()));
  gauge("device_healthy",
        "1 while the device serves; 0 after a sticky device error.",
        inv.device_error.empty() ? 1 : 0);

  MetricFamily frames =
      GaugeFamily(Name("frames"),
                  "Arena frames: total, free (held by no pool), and free "
                  "once compacted.");
  AddSample(&frames, {{"state", "total"}}, D(a.frames));
  AddSample(&frames, {{"state", "free"}}, D(a.free_frames));
  AddSample(&frames, {{"state", "free_compacted"}}, D(a.free_frames_compacted));
  out.push_back(std::move(frames));

  MetricFamily fpages =
      GaugeFamily(Name("pages"),
                  "Target pages in use by K format (window pages: "
                  "format=\"window\").");
  MetricFamily fbytes =
      GaugeFamily(Name("page_bytes"),
                  "Bytes of the pages in use by K format (window "
                  "pages: format=\"window\").");
  for (const auto& [format, usage] : inv.formats) {
    AddSample(&fpages, {{"format", kernels::FormatName(format)}},
              D(usage.pages));
    AddSample(&fbytes, {{"format", kernels::FormatName(format)}},
              D(usage.bytes));
  }
  AddSample(&fpages, {{"format", "window"}}, D(a.window.pages));
  AddSample(&fbytes, {{"format", "window"}}, D(a.window.bytes));
  out.push_back(std::move(fpages));
  out.push_back(std::move(fbytes));

  MetricFamily epages =
      GaugeFamily(Name("encoding_pages"), "Target pages in use by encoding.");
  MetricFamily ebytes = GaugeFamily(
      Name("encoding_bytes"), "Bytes of the target pages in use by encoding.");
  for (const auto& [encoding, usage] : inv.encodings) {
    AddSample(&epages, {{"encoding", EncodingLabel(encoding)}}, D(usage.pages));
    AddSample(&ebytes, {{"encoding", EncodingLabel(encoding)}}, D(usage.bytes));
  }
  out.push_back(std::move(epages));
  out.push_back(std::move(ebytes));

  MetricFamily pframes = GaugeFamily(
      Name("pool_frames"), "Frames held by the page pool of an encoding.");
  MetricFamily pused = GaugeFamily(
      Name("pool_pages_used"),
      "Pages in use in the pool of an encoding (target and window).");
  MetricFamily pfree =
      GaugeFamily(Name("pool_free_slots"),
                  "Free pages inside the frames of an encoding's pool.");
  for (const PoolStats& p : a.pools) {
    const std::string e = EncodingLabel(p.encoding);
    AddSample(&pframes, {{"encoding", e}}, D(p.frames));
    AddSample(&pused, {{"encoding", e}}, D(p.pages_used));
    AddSample(&pfree, {{"encoding", e}}, D(p.free_slots));
  }
  out.push_back(std::move(pframes));
  out.push_back(std::move(pused));
  out.push_back(std::move(pfree));

  MetricFamily tcap = GaugeFamily(Name("tier_capacity_bytes"),
                                  "Capacity of a spill tier (0: disabled).");
  MetricFamily tused =
      GaugeFamily(Name("tier_used_bytes"), "Page bytes a spill tier holds.");
  MetricFamily tblocks =
      GaugeFamily(Name("tier_blocks"), "Blocks a spill tier holds.");
  for (const auto& [tier, u] :
       {std::make_pair("host", &inv.host), std::make_pair("disk", &inv.disk)}) {
    AddSample(&tcap, {{"tier", tier}}, D(u->capacity_bytes));
    AddSample(&tused, {{"tier", tier}}, D(u->used_bytes));
    AddSample(&tblocks, {{"tier", tier}}, D(u->blocks));
  }
  out.push_back(std::move(tcap));
  out.push_back(std::move(tused));
  out.push_back(std::move(tblocks));

  counter("spills_total",
          "Blocks spilled (device to a tier, or between tiers).",
          D(inv.spills));
  counter("restores_total", "Blocks restored to the device.", D(inv.restores));
  counter("evictions_total", "Blocks evicted (pages dropped).",
          D(inv.evictions));
  counter("checksum_failures_total",
          "Restores refused for a bad CRC32C of the spilled pages.",
          D(inv.checksum_failures));
  counter("compactions_total", "Arena compactions that moved pages.",
          D(a.compactions));
  counter("compaction_moved_bytes_total", "Bytes compactions moved.",
          D(a.bytes_moved));
  counter("attention_kernel_seconds_total",
          "Time of the decode-attention kernels themselves (CUDA: device "
          "time between events around each launch; CPU: the reference "
          "kernel), a part of attention_seconds.",
          core_->AttentionKernelSeconds());
  for (MetricFamily& f : core_->timings().Collect("triaxkv_worker_")) {
    out.push_back(std::move(f));
  }
  return out;
}

HttpResponse WorkerReadiness::Health() const {
  if (absl::Status s = core_->DeviceHealth(); !s.ok()) {
    return ProbeResponse(false,
                         absl::StrCat("device unhealthy: ", s.message()));
  }
  return ProbeResponse(true, "");
}

HttpResponse WorkerReadiness::Ready() const {
  if (!serving_.load()) return ProbeResponse(false, "not serving");
  if (absl::Status s = core_->DeviceHealth(); !s.ok()) {
    return ProbeResponse(false,
                         absl::StrCat("device unhealthy: ", s.message()));
  }
  if (registered_ && !registered_()) {
    return ProbeResponse(false, "not registered with the manager yet");
  }
  return ProbeResponse(true, "");
}

}  // namespace triax::worker
