// transfer_bench: the worker-to-worker transfer data path, measured between
// two real kvworker processes on loopback, driven directly over the worker
// API (no manager): the source ("src") holds a sequence written with
// AllocatePages + WriteKV, the destination ("dst") pulls it with
// ImportSequence (which streams the source's ExportPages), then frees it.
//
// Tables (stdout; every row also in --tsv as one value per line):
//   transfer  per size x encoding: seconds per sequence (median of
//             --repeats ImportSequence calls, timed here), the worker's own
//             seconds, wire and BF16 bytes, their ratio, GB/s of BF16-equal
//             KV and of wire bytes, and two baselines measured on the same
//             bytes (the case's wire bytes) in the same run: a bare gRPC
//             server stream between two processes (a child transfer_bench
//             --probe_server pinned like the source, probe.proto), a
//             single-threaded host memcpy in this process and, in a CUDA
//             build on a GPU machine, the device's own device-to-device
//             copy (device_copy_probe, a child process per case).
//   overlap   per --overlap_sizes x --overlap_encodings, "serial" (every
//             layer written, then ImportSequence) and "overlap"
//             (ImportSequence with follow_writes started first, then the
//             layers written): a prefill that spends --layer_compute_ms
//             per layer (a sleep standing in for the layer's compute) then
//             writes the layer with its own WriteKV stream; "prefill done"
//             is the last layer's WriteKV returning, "decode can start" is
//             ImportSequence returning (the sequence committed on dst).
//   layers    for the overlap cases (the run with the median time): when
//             each layer's write returned and when it had landed on dst
//             (ImportSequenceResponse.layer_done_seconds after the import
//             was called), both from the start of the prefill.
//
// The model is Llama-3-8B-shaped (transfer_cases.h); blocks seal as soon as
// they are full (window_tokens 0), so every page is in its plan encoding.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/transfer/bench_worker.h"
#include "bench/transfer/probe.h"
#include "bench/transfer/transfer_cases.h"
#include "tests/integration/process.h"

ABSL_FLAG(std::string, bin_dir, "",
          "directory with kvworker; default: $TRIAX_BIN_DIR, else this "
          "binary's directory");
ABSL_FLAG(std::string, backend, "auto", "--backend of both workers");
ABSL_FLAG(std::string, worker_flags, "",
          "extra flags appended verbatim (split on spaces) to both workers' "
          "command lines, e.g. \"--transfer_path=ipc\"");
ABSL_FLAG(std::string, cpus_src, "",
          "pin the source worker and the probe server to these CPUs "
          "(\"0\", \"0-3\"); empty: not pinned");
ABSL_FLAG(std::string, cpus_dst, "", "pin the destination worker");
ABSL_FLAG(std::string, cpus_bench, "",
          "pin this process (the probe's receiver and the memcpy)");
ABSL_FLAG(std::string, sizes, "1M,16M,256M,1G,4G",
          "sequence sizes in BF16 KV bytes (K/M/G suffixes)");
ABSL_FLAG(std::string, encodings, "bf16,int4,bf16->int4,tri-3.5,bf16->tri-3.5",
          "transfer cases: <source>-><destination> or one encoding for both; "
          "bf16 fp8 int8 int4 int2 tq4 tq3 tq2 tri-3.5");
ABSL_FLAG(std::string, overlap_sizes, "256M,4G",
          "sizes of the layer-by-layer cases; empty: none");
ABSL_FLAG(std::string, overlap_encodings, "bf16,bf16->tri-3.5",
          "encodings of the layer-by-layer cases");
ABSL_FLAG(double, layer_compute_ms, 2.0,
          "layer-by-layer: prefill compute per layer (a sleep), >= 0");
ABSL_FLAG(int, repeats, 5, "runs per case; the tables give medians");
ABSL_FLAG(int64_t, pool_mb, 0,
          "workers' --pool_mb; 0: the largest case's BF16 bytes + 15% + 256");
ABSL_FLAG(int, import_timeout_ms, 600000, "ImportSequence timeout_ms");
ABSL_FLAG(int, probe_message_bytes, 4 << 20,
          "probe message size (ExportPages batches up to 4 MiB)");
ABSL_FLAG(int, write_chunk_tokens, 256, "tokens per WriteKV message");
ABSL_FLAG(int, block_tokens, 16,
          "tokens per block (1..256; a power of two): a page is one layer of "
          "a block, so larger blocks mean fewer, larger pages (a BF16 page "
          "of 64 tokens is 256 KiB: give the workers --frame_kb to hold it)");
ABSL_FLAG(std::string, device_copy, "auto",
          "auto: also time device_copy_probe (a CUDA build's device-to-device "
          "copy of the same bytes) when it is in --bin_dir and runs; off");
ABSL_FLAG(int, cuda_device, 0, "device of device_copy_probe");
ABSL_FLAG(std::string, tsv, "", "also write every value to this TSV file");
ABSL_FLAG(bool, probe_server, false,
          "internal: serve the streaming probe (with --listen, --port_file)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "internal: probe server address");
ABSL_FLAG(std::string, port_file, "", "internal: probe server port file");

namespace triax::bench {
namespace {

namespace v1 = triax::v1;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double GBps(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

// One measured value, as a TSV line: what was measured and its unit.
struct Value {
  std::string table, size, encoding, mode;
  uint32_t tokens = 0;
  int layer = -1;
  std::string metric;
  double value = 0;
  std::string unit;
};

struct TransferRow {
  SizeCase size;
  std::string encoding;
  std::string path;  // ImportSequenceResponse.data_path: stream or ipc
  double seconds = 0, worker_seconds = 0, probe_seconds = 0, memcpy_seconds = 0;
  double device_copy_seconds = 0;  // 0: not measured
  double copy_seconds = 0;         // dst's device copies (ipc path), median
  // dst's split of worker_seconds (medians): reserving, waiting for src,
  // committing.
  double reserve_seconds = 0, wait_seconds = 0, commit_seconds = 0;
  uint64_t wire = 0, bf16 = 0, page_bytes = 0;
};

struct OverlapRun {
  double prefill = 0, done_to_decode = 0, start_to_decode = 0;
  std::vector<double> written_ms, landed_ms;
};

struct OverlapRow {
  SizeCase size;
  std::string encoding, mode;
  OverlapRun run;  // the run with the median done_to_decode
};

class Bench {
 public:
  Bench(BenchShape shape, std::unique_ptr<BenchWorker> src,
        std::unique_ptr<BenchWorker> dst, const std::string& probe_address,
        std::string dir)
      : shape_(shape),
        pattern_(
            KvPattern::Make(shape, absl::GetFlag(FLAGS_write_chunk_tokens), 7)),
        src_(std::move(src)),
        dst_(std::move(dst)),
        probe_(probe_address),
        repeats_(absl::GetFlag(FLAGS_repeats)),
        dir_(std::move(dir)) {}

  // Whether device_copy_probe is used: --device_copy=auto, the binary is in
  // the bin directory and a 1 MiB copy runs (it does not without a GPU).
  // The reason otherwise, for the header.
  std::string SetUpDeviceCopy() {
    if (absl::GetFlag(FLAGS_device_copy) == "off") return "off";
    auto bin = testing::BinDir();
    if (!bin.ok() || access((*bin + "/device_copy_probe").c_str(), X_OK) != 0) {
      return "none (no device_copy_probe: not a CUDA build)";
    }
    auto s = DeviceCopySeconds(1 << 20);
    device_copy_ = s.ok();
    return s.ok()
               ? "device_copy_probe"
               : absl::StrCat(
                     "none (",
                     absl::StripTrailingAsciiWhitespace(s.status().message()),
                     ")");
  }

  BenchWorker& src() { return *src_; }
  BenchWorker& dst() { return *dst_; }

  // One small transfer and one probe stream, untimed: the channels between
  // the processes are connected before anything is measured.
  absl::Status Warmup() {
    SizeCase one{"warmup", 0, shape_.block_tokens};
    EncodingCase bf16{"bf16", Mix{"bf16", {{kernels::Format::kBF16, 1}}},
                      Mix{"bf16", {{kernels::Format::kBF16, 1}}}};
    const int repeats = repeats_;
    repeats_ = 1;
    auto row = Transfer(one, bf16);
    repeats_ = repeats;
    return row.status();
  }

  absl::StatusOr<TransferRow> Transfer(const SizeCase& size,
                                       const EncodingCase& enc) {
    TransferRow row;
    row.size = size;
    row.encoding = enc.name;
    const uint32_t blocks = size.tokens / shape_.block_tokens;
    const std::string seq = absl::StrCat("t", ++next_id_);
    const uint64_t lineage = next_id_ << 24;
    const auto dst_plan =
        MakePlan(size.tokens, shape_, enc.destination.Assign(blocks), lineage);
    absl::Status s = src_->Allocate(
        seq, shape_,
        MakePlan(size.tokens, shape_, enc.source.Assign(blocks), lineage));
    for (uint32_t l = 0; s.ok() && l < shape_.n_layers; ++l) {
      s = src_->WriteLayer(seq, l, size.tokens, pattern_);
    }
    std::vector<double> seconds, worker_seconds, copy_seconds, reserve, wait,
        commit;
    for (int r = 0; s.ok() && r < repeats_; ++r) {
      const auto start = Clock::now();
      auto resp = dst_->Import(ImportRequest(seq, dst_plan, false));
      if (!resp.ok()) {
        s = resp.status();
        break;
      }
      seconds.push_back(Since(start));
      worker_seconds.push_back(resp->seconds());
      copy_seconds.push_back(resp->copy_seconds());
      reserve.push_back(resp->reserve_seconds());
      wait.push_back(resp->wait_seconds());
      commit.push_back(resp->commit_seconds());
      row.wire = resp->wire_bytes();
      row.path = resp->data_path();
      row.bf16 = resp->bf16_bytes();
      row.page_bytes = resp->page_bytes();
      s = dst_->Free(seq);
    }
    if (absl::Status f = src_->Free(seq); s.ok()) s = f;
    if (!s.ok()) return s;
    row.seconds = Median(seconds);
    row.worker_seconds = Median(worker_seconds);
    row.copy_seconds = Median(copy_seconds);
    row.reserve_seconds = Median(reserve);
    row.wait_seconds = Median(wait);
    row.commit_seconds = Median(commit);
    std::vector<double> probe, copy;
    for (int r = 0; r < repeats_; ++r) {
      auto p =
          probe_.Stream(row.wire, absl::GetFlag(FLAGS_probe_message_bytes));
      if (!p.ok()) return p.status();
      probe.push_back(*p);
      copy.push_back(MemcpySeconds(row.wire));
    }
    row.probe_seconds = Median(probe);
    row.memcpy_seconds = Median(copy);
    if (device_copy_) {
      auto d = DeviceCopySeconds(row.wire);
      if (!d.ok()) return d.status();
      row.device_copy_seconds = *d;
    }
    return row;
  }

  absl::StatusOr<OverlapRow> Overlap(const SizeCase& size,
                                     const EncodingCase& enc, bool overlap) {
    OverlapRow row;
    row.size = size;
    row.encoding = enc.name;
    row.mode = overlap ? "overlap" : "serial";
    std::vector<OverlapRun> runs;
    for (int r = 0; r < repeats_; ++r) {
      auto run = OverlapOnce(size, enc, overlap);
      if (!run.ok()) return run.status();
      runs.push_back(*std::move(run));
    }
    std::sort(runs.begin(), runs.end(),
              [](const OverlapRun& a, const OverlapRun& b) {
                return a.done_to_decode < b.done_to_decode;
              });
    row.run = runs[runs.size() / 2];
    return row;
  }

 private:
  v1::ImportSequenceRequest ImportRequest(
      const std::string& seq,
      const google::protobuf::RepeatedPtrField<v1::BlockPlan>& plan,
      bool follow_writes) {
    v1::ImportSequenceRequest r;
    const std::string id = absl::StrCat("bench-", seq, "-", ++next_id_);
    r.set_request_id(id);
    r.set_transfer_id(id);
    r.set_tenant_id(kTenant);
    r.set_sequence_id(seq);
    *r.mutable_model() = ModelProto(shape_);
    r.set_block_tokens(shape_.block_tokens);
    r.set_window_tokens(0);
    *r.mutable_blocks() = plan;
    r.set_source_address(src_->address());
    r.set_source_worker_id(src_->id());
    r.set_timeout_ms(absl::GetFlag(FLAGS_import_timeout_ms));
    r.set_follow_writes(follow_writes);
    return r;
  }

  absl::StatusOr<OverlapRun> OverlapOnce(const SizeCase& size,
                                         const EncodingCase& enc,
                                         bool overlap) {
    const uint32_t blocks = size.tokens / shape_.block_tokens;
    const std::string seq = absl::StrCat("o", ++next_id_);
    const uint64_t lineage = next_id_ << 24;
    const auto request = ImportRequest(
        seq,
        MakePlan(size.tokens, shape_, enc.destination.Assign(blocks), lineage),
        overlap);
    absl::Status s = src_->Allocate(
        seq, shape_,
        MakePlan(size.tokens, shape_, enc.source.Assign(blocks), lineage));
    if (!s.ok()) return s;
    const absl::Duration compute =
        absl::Microseconds(absl::GetFlag(FLAGS_layer_compute_ms) * 1000);
    OverlapRun run;
    const auto start = Clock::now();
    Clock::time_point import_end;
    absl::StatusOr<v1::ImportSequenceResponse> resp;
    auto import = [&] {
      resp = dst_->Import(request);
      import_end = Clock::now();
    };
    std::thread follower;
    if (overlap) follower = std::thread(import);
    for (uint32_t l = 0; s.ok() && l < shape_.n_layers; ++l) {
      absl::SleepFor(compute);
      s = src_->WriteLayer(seq, l, size.tokens, pattern_);
      run.written_ms.push_back(Since(start) * 1000);
    }
    const auto done = Clock::now();
    if (overlap) {
      // A failed write leaves the follower waiting for the layer: freeing
      // the source sequence ends its export.
      if (!s.ok()) (void)src_->Free(seq);
      follower.join();
    } else if (s.ok()) {
      import();
    }
    if (s.ok() && !resp.ok()) s = resp.status();
    if (s.ok()) s = dst_->Free(seq);
    if (absl::Status f = src_->Free(seq); s.ok()) s = f;
    if (!s.ok()) return s;
    auto secs = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    run.prefill = secs(start, done);
    run.done_to_decode = secs(done, import_end);
    run.start_to_decode = secs(start, import_end);
    // The worker's clock of the import (layer_done_seconds, seconds) is
    // anchored at the reply's arrival here: a landing time is then late by
    // at most the reply's trip, never early.
    const double anchor = secs(start, import_end) - resp->seconds();
    for (double t : resp->layer_done_seconds()) {
      run.landed_ms.push_back((anchor + t) * 1000);
    }
    return run;
  }

  // device_copy_probe's median seconds for `bytes` (its own repeats).
  absl::StatusOr<double> DeviceCopySeconds(uint64_t bytes) {
    std::string out, err;
    auto rc = testing::RunToCompletion(
        "device_copy_probe",
        {std::to_string(bytes), std::to_string(repeats_),
         std::to_string(absl::GetFlag(FLAGS_cuda_device))},
        dir_, &out, &err, absl::Minutes(10));
    if (!rc.ok()) return rc.status();
    const size_t at = out.find("seconds=");
    double seconds = 0;
    if (*rc != 0 || at == std::string::npos ||
        !absl::SimpleAtod(
            absl::string_view(out).substr(at + 8, out.find(' ', at) - at - 8),
            &seconds)) {
      return absl::InternalError(
          absl::StrCat("device_copy_probe exited ", *rc, ": ", out, err));
    }
    return seconds;
  }

  // Single-threaded memcpy of `bytes` through buffers of at most 1 GiB
  // (touched before timing), copied over until `bytes` have moved.
  double MemcpySeconds(uint64_t bytes) {
    const size_t buffer = std::min<uint64_t>(bytes, uint64_t{1} << 30);
    if (buffer > buffer_bytes_) {
      from_.reset(new char[buffer]);
      to_.reset(new char[buffer]);
      std::memset(from_.get(), 0x5a, buffer);
      std::memset(to_.get(), 0, buffer);
      buffer_bytes_ = buffer;
    }
    const auto start = Clock::now();
    for (uint64_t done = 0; done < bytes;) {
      const size_t n = std::min<uint64_t>(buffer, bytes - done);
      std::memcpy(to_.get(), from_.get(), n);
      done += n;
    }
    const double seconds = Since(start);
    volatile char sink = to_[buffer / 2];  // the copy is observed
    (void)sink;
    return seconds;
  }

  const BenchShape shape_;
  const KvPattern pattern_;
  std::unique_ptr<BenchWorker> src_, dst_;
  ProbeClient probe_;
  int repeats_;
  const std::string dir_;
  bool device_copy_ = false;
  uint64_t next_id_ = 0;
  std::unique_ptr<char[]> from_, to_;
  size_t buffer_bytes_ = 0;
};

constexpr double kMiB = 1 << 20;

void PrintTransfer(const std::vector<TransferRow>& rows,
                   std::vector<Value>* values) {
  std::cout << "\n## transfer: ImportSequence on dst pulling src's pages "
               "(median of runs); baselines on the same wire bytes\n";
  std::cout << absl::StrFormat(
      "%-6s %7s %-15s %-6s %9s %9s %9s %9s %6s %8s %8s %8s %6s %8s %11s "
      "%8s %9s %8s\n",
      "size", "tokens", "encoding", "path", "s/seq", "worker_s", "wire_MiB",
      "bf16_MiB", "wire/bf16", "bf16eqGB/s", "wireGB/s", "probeGB/s", "w/probe",
      "memcpyGB/s", "devcopyGB/s", "w/devcopy", "ipccpGB/s", "cp/devcp");
  for (const TransferRow& r : rows) {
    const double wire_gbps = GBps(r.wire, r.seconds);
    const double probe_gbps = GBps(r.wire, r.probe_seconds);
    const double dev_gbps = GBps(r.wire, r.device_copy_seconds);
    const double copy_gbps = GBps(r.wire, r.copy_seconds);
    std::cout << absl::StrFormat(
        "%-6s %7u %-15s %-6s %9.4f %9.4f %9.1f %9.1f %9.3f %10.3f %8.3f "
        "%9.3f %7.3f %10.3f %11s %9s %9s %8s\n",
        r.size.label, r.size.tokens, r.encoding, r.path, r.seconds,
        r.worker_seconds, r.wire / kMiB, r.bf16 / kMiB, double(r.wire) / r.bf16,
        GBps(r.bf16, r.seconds), wire_gbps, probe_gbps, wire_gbps / probe_gbps,
        GBps(r.wire, r.memcpy_seconds),
        dev_gbps > 0 ? absl::StrFormat("%.2f", dev_gbps) : "-",
        dev_gbps > 0 ? absl::StrFormat("%.3f", wire_gbps / dev_gbps) : "-",
        copy_gbps > 0 ? absl::StrFormat("%.2f", copy_gbps) : "-",
        copy_gbps > 0 && dev_gbps > 0
            ? absl::StrFormat("%.3f", copy_gbps / dev_gbps)
            : "-");
    auto add = [&](const std::string& metric, double v, const char* unit) {
      values->push_back({"transfer", r.size.label, r.encoding, "",
                         r.size.tokens, -1, metric, v, unit});
    };
    add("seconds_per_sequence", r.seconds, "s");
    add("worker_seconds", r.worker_seconds, "s");
    add("wire_bytes", r.wire, "B");
    add("bf16_bytes", r.bf16, "B");
    add("dst_page_bytes", r.page_bytes, "B");
    add("wire_over_bf16", double(r.wire) / r.bf16, "ratio");
    add("bf16_equivalent_throughput", GBps(r.bf16, r.seconds), "GB/s");
    add("wire_throughput", wire_gbps, "GB/s");
    add("probe_seconds", r.probe_seconds, "s");
    add("probe_throughput", probe_gbps, "GB/s");
    add("wire_over_probe_throughput", wire_gbps / probe_gbps, "ratio");
    add("memcpy_seconds", r.memcpy_seconds, "s");
    add("memcpy_throughput", GBps(r.wire, r.memcpy_seconds), "GB/s");
    if (dev_gbps > 0) {
      add("device_copy_seconds", r.device_copy_seconds, "s");
      add("device_copy_throughput", dev_gbps, "GB/s");
      add("wire_over_device_copy_throughput", wire_gbps / dev_gbps, "ratio");
    }
    add("dst_reserve_seconds", r.reserve_seconds, "s");
    add("dst_wait_seconds", r.wait_seconds, "s");
    add("dst_commit_seconds", r.commit_seconds, "s");
    if (copy_gbps > 0) {
      add("ipc_copy_seconds", r.copy_seconds, "s");
      add("ipc_copy_throughput", copy_gbps, "GB/s");
      if (dev_gbps > 0) {
        add("ipc_copy_over_device_copy_throughput", copy_gbps / dev_gbps,
            "ratio");
      }
    }
  }
}

// Where the destination's time went (ImportSequenceResponse's split).
void PrintSplit(const std::vector<TransferRow>& rows) {
  std::cout << "\n## dst's time (ms, medians): reserve pages, wait for src "
               "(its export and checksums, the network), copy + CRC32C "
               "(ipc, link), commit; other = worker - the four (per-page "
               "checks and installs, set-up)\n";
  std::cout << absl::StrFormat("%-6s %-15s %-6s %9s %9s %9s %9s %9s %9s\n",
                               "size", "encoding", "path", "worker", "reserve",
                               "wait", "copy", "commit", "other");
  for (const TransferRow& r : rows) {
    const double other = r.worker_seconds - r.reserve_seconds - r.wait_seconds -
                         r.copy_seconds - r.commit_seconds;
    std::cout << absl::StrFormat(
        "%-6s %-15s %-6s %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", r.size.label,
        r.encoding, r.path, 1e3 * r.worker_seconds, 1e3 * r.reserve_seconds,
        1e3 * r.wait_seconds, 1e3 * r.copy_seconds, 1e3 * r.commit_seconds,
        1e3 * other);
  }
}

void PrintOverlap(const std::vector<OverlapRow>& rows, double compute_ms,
                  std::vector<Value>* values) {
  std::cout << absl::StrFormat(
      "\n## overlap: prefill of %.3g ms compute + one WriteKV per layer; "
      "\"done\" = last layer written, \"decode\" = ImportSequence returned "
      "(median run)\n",
      compute_ms);
  std::cout << absl::StrFormat("%-6s %7s %-15s %-8s %10s %12s %13s\n", "size",
                               "tokens", "encoding", "mode", "prefill_s",
                               "done->decode", "start->decode");
  for (const OverlapRow& r : rows) {
    std::cout << absl::StrFormat("%-6s %7u %-15s %-8s %10.4f %12.4f %13.4f\n",
                                 r.size.label, r.size.tokens, r.encoding,
                                 r.mode, r.run.prefill, r.run.done_to_decode,
                                 r.run.start_to_decode);
    auto add = [&](int layer, const std::string& metric, double v,
                   const char* unit) {
      values->push_back({layer < 0 ? "overlap" : "layers", r.size.label,
                         r.encoding, r.mode, r.size.tokens, layer, metric, v,
                         unit});
    };
    add(-1, "layer_compute", compute_ms, "ms");
    add(-1, "prefill_seconds", r.run.prefill, "s");
    add(-1, "done_to_decode_seconds", r.run.done_to_decode, "s");
    add(-1, "start_to_decode_seconds", r.run.start_to_decode, "s");
    for (size_t l = 0; l < r.run.written_ms.size(); ++l) {
      add(static_cast<int>(l), "written_ms", r.run.written_ms[l], "ms");
      if (l < r.run.landed_ms.size()) {
        add(static_cast<int>(l), "landed_ms", r.run.landed_ms[l], "ms");
      }
    }
  }
  for (const OverlapRow& r : rows) {
    if (r.mode != "overlap") continue;
    std::cout << "\n## layers: " << r.size.label << " " << r.encoding
              << " overlap: ms from the prefill's start\n";
    std::cout << absl::StrFormat("%5s %10s %10s %8s\n", "layer", "written",
                                 "landed", "lag");
    for (size_t l = 0;
         l < r.run.written_ms.size() && l < r.run.landed_ms.size(); ++l) {
      std::cout << absl::StrFormat("%5u %10.2f %10.2f %8.2f\n", l,
                                   r.run.written_ms[l], r.run.landed_ms[l],
                                   r.run.landed_ms[l] - r.run.written_ms[l]);
    }
  }
}

absl::Status WriteTsv(const std::string& path,
                      const std::vector<Value>& values) {
  std::ofstream out(path);
  out << "table\tsize\ttokens\tencoding\tmode\tlayer\tmetric\tvalue\tunit\n";
  for (const Value& v : values) {
    out << v.table << '\t' << v.size << '\t' << v.tokens << '\t' << v.encoding
        << '\t' << (v.mode.empty() ? "-" : v.mode) << '\t'
        << (v.layer < 0 ? std::string("-") : std::to_string(v.layer)) << '\t'
        << v.metric << '\t' << absl::StrFormat("%.9g", v.value) << '\t'
        << v.unit << '\n';
  }
  out.close();
  if (!out) {
    return absl::InternalError(
        absl::StrCat("--tsv: cannot write \"", path, "\""));
  }
  return absl::OkStatus();
}

absl::Status Fail(const std::string& flag, const std::string& value,
                  const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": \"", value, "\" ", why));
}

BenchShape ShapeFromFlags(absl::Status* bad) {
  BenchShape shape;
  const int t = absl::GetFlag(FLAGS_block_tokens);
  if (t < 1 || t > 256 || (t & (t - 1)) != 0) {
    *bad = Fail("--block_tokens", std::to_string(t),
                "must be a power of two in 1..256");
    return shape;
  }
  shape.block_tokens = static_cast<uint32_t>(t);
  return shape;
}

int Run() {
  absl::Status bad_shape;
  const BenchShape shape = ShapeFromFlags(&bad_shape);
  if (!bad_shape.ok()) {
    std::cerr << "transfer_bench: " << bad_shape.message() << "\n";
    return 1;
  }
  auto sizes = ParseSizes(absl::GetFlag(FLAGS_sizes), shape, "--sizes");
  auto encodings =
      ParseEncodingCases(absl::GetFlag(FLAGS_encodings), shape, "--encodings");
  const std::string overlap_list = absl::GetFlag(FLAGS_overlap_sizes);
  absl::StatusOr<std::vector<SizeCase>> overlap_sizes = std::vector<SizeCase>{};
  if (!overlap_list.empty()) {
    overlap_sizes = ParseSizes(overlap_list, shape, "--overlap_sizes");
  }
  auto overlap_encodings = ParseEncodingCases(
      absl::GetFlag(FLAGS_overlap_encodings), shape, "--overlap_encodings");
  const double compute_ms = absl::GetFlag(FLAGS_layer_compute_ms);
  absl::Status bad;
  for (const absl::Status& s :
       {sizes.status(), encodings.status(), overlap_sizes.status(),
        overlap_encodings.status()}) {
    if (bad.ok()) bad = s;
  }
  if (bad.ok() && absl::GetFlag(FLAGS_repeats) < 1) {
    bad = Fail("--repeats", std::to_string(absl::GetFlag(FLAGS_repeats)),
               "must be >= 1");
  }
  if (bad.ok() && !(compute_ms >= 0 && compute_ms <= 60000)) {
    bad = Fail("--layer_compute_ms", absl::StrCat(compute_ms),
               "must be in 0..60000");
  }
  const int timeout_ms = absl::GetFlag(FLAGS_import_timeout_ms);
  if (bad.ok() && (timeout_ms < 1 || timeout_ms > 3600000)) {
    bad = Fail("--import_timeout_ms", std::to_string(timeout_ms),
               "must be in 1..3600000");
  }
  const int message_bytes = absl::GetFlag(FLAGS_probe_message_bytes);
  if (bad.ok() && (message_bytes < 1 || message_bytes > (64 << 20))) {
    bad = Fail("--probe_message_bytes", std::to_string(message_bytes),
               "must be in 1..67108864");
  }
  const int chunk = absl::GetFlag(FLAGS_write_chunk_tokens);
  if (bad.ok() && (chunk < 1 || chunk > 8192)) {
    bad = Fail("--write_chunk_tokens", std::to_string(chunk),
               "must be in 1..8192");
  }
  if (const std::string d = absl::GetFlag(FLAGS_device_copy);
      bad.ok() && d != "auto" && d != "off") {
    bad = Fail("--device_copy", d, "must be auto or off");
  }
  if (bad.ok() && absl::GetFlag(FLAGS_pool_mb) < 0) {
    bad = Fail("--pool_mb", std::to_string(absl::GetFlag(FLAGS_pool_mb)),
               "must be >= 0");
  }
  for (const auto& [flag, value] :
       {std::pair{"--cpus_src", absl::GetFlag(FLAGS_cpus_src)},
        std::pair{"--cpus_dst", absl::GetFlag(FLAGS_cpus_dst)},
        std::pair{"--cpus_bench", absl::GetFlag(FLAGS_cpus_bench)}}) {
    if (bad.ok() && !value.empty()) bad = CheckCpuList(value, flag);
  }
  if (!bad.ok()) {
    std::cerr << "transfer_bench: " << bad.message() << "\n";
    return 1;
  }

  if (const std::string cpus = absl::GetFlag(FLAGS_cpus_bench); !cpus.empty()) {
    if (absl::Status s = PinProcess(getpid(), cpus, "--cpus_bench"); !s.ok()) {
      std::cerr << "transfer_bench: " << s.message() << "\n";
      return 1;
    }
  }
  uint64_t largest = 0;
  for (const auto* list : {&*sizes, &*overlap_sizes}) {
    for (const SizeCase& c : *list) {
      largest =
          std::max<uint64_t>(largest, c.tokens * shape.Bf16BytesPerToken());
    }
  }
  WorkerLaunch launch;
  launch.backend = absl::GetFlag(FLAGS_backend);
  launch.pool_mb = absl::GetFlag(FLAGS_pool_mb);
  if (launch.pool_mb == 0) {
    launch.pool_mb = static_cast<int64_t>(largest * 1.15 / kMiB) + 256;
  }
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_worker_flags),
                                            ' ', absl::SkipEmpty())) {
    launch.extra_flags.emplace_back(f);
  }

  auto dir = testing::TempDir::Create("transfer_bench");
  if (!dir.ok()) {
    std::cerr << "transfer_bench: " << dir.status() << "\n";
    return 1;
  }
  std::string bin_dir = absl::GetFlag(FLAGS_bin_dir);
  if (bin_dir.empty() && std::getenv("TRIAX_BIN_DIR") != nullptr) {
    bin_dir = std::getenv("TRIAX_BIN_DIR");
  }
  if (bin_dir.empty()) bin_dir = SelfDir();
  // The probe server is this binary; the workers come from bin_dir. Both
  // start before this process opens any channel.
  setenv("TRIAX_BIN_DIR", SelfDir().c_str(), 1);
  auto probe = testing::Process::Start(
      "probe", "transfer_bench", {"--probe_server", "--listen=127.0.0.1:0"},
      (*dir)->path());
  setenv("TRIAX_BIN_DIR", bin_dir.c_str(), 1);
  if (!probe.ok()) {
    std::cerr << "transfer_bench: probe server: " << probe.status() << "\n";
    return 1;
  }
  launch.cpus = absl::GetFlag(FLAGS_cpus_src);
  launch.cpus_flag = "--cpus_src";
  if (!launch.cpus.empty()) {
    if (absl::Status s = PinProcess((*probe)->pid(), launch.cpus, "--cpus_src");
        !s.ok()) {
      std::cerr << "transfer_bench: " << s.message() << "\n";
      return 1;
    }
  }
  auto src = BenchWorker::Start("src", launch, (*dir)->path());
  launch.cpus = absl::GetFlag(FLAGS_cpus_dst);
  launch.cpus_flag = "--cpus_dst";
  auto dst = src.ok()
                 ? BenchWorker::Start("dst", launch, (*dir)->path())
                 : absl::StatusOr<std::unique_ptr<BenchWorker>>(src.status());
  if (!dst.ok()) {
    std::cerr << "transfer_bench: starting the workers: " << dst.status()
              << "\n";
    return 1;
  }

  std::cout << "# transfer_bench: kvworker from " << bin_dir
            << ", --backend=" << launch.backend
            << " --pool_mb=" << launch.pool_mb << " "
            << absl::GetFlag(FLAGS_worker_flags) << "\n# src "
            << (*src)->address() << " (cpus " << absl::GetFlag(FLAGS_cpus_src)
            << "), dst " << (*dst)->address() << " (cpus "
            << absl::GetFlag(FLAGS_cpus_dst) << "), bench cpus "
            << absl::GetFlag(FLAGS_cpus_bench) << ", online CPUs "
            << sysconf(_SC_NPROCESSORS_ONLN) << "\n# model " << shape.n_layers
            << " layers x " << shape.n_kv_heads << " KV heads x head_dim "
            << shape.head_dim << ", blocks of " << shape.block_tokens
            << " tokens (" << shape.Bf16BytesPerToken() / 1024
            << " KiB BF16 per token); repeats " << absl::GetFlag(FLAGS_repeats)
            << "; GB = 1e9 bytes\n";

  Bench bench(shape, *std::move(src), *std::move(dst), (*probe)->address(),
              (*dir)->path());
  std::cout << "# device copy baseline: " << bench.SetUpDeviceCopy() << "\n";
  std::vector<Value> values;
  auto fail = [&](const absl::Status& s) {
    std::cerr << "transfer_bench: " << s << "\n--- src log:\n"
              << bench.src().Log() << "\n--- dst log:\n"
              << bench.dst().Log() << "\n";
    return 1;
  };
  if (absl::Status s = bench.Warmup(); !s.ok()) return fail(s);
  std::vector<TransferRow> transfers;
  for (const SizeCase& size : *sizes) {
    for (const EncodingCase& enc : *encodings) {
      auto row = bench.Transfer(size, enc);
      if (!row.ok()) return fail(row.status());
      transfers.push_back(*std::move(row));
    }
  }
  PrintTransfer(transfers, &values);
  PrintSplit(transfers);
  std::vector<OverlapRow> overlaps;
  for (const SizeCase& size : *overlap_sizes) {
    for (const EncodingCase& enc : *overlap_encodings) {
      for (bool overlap : {false, true}) {
        auto row = bench.Overlap(size, enc, overlap);
        if (!row.ok()) return fail(row.status());
        overlaps.push_back(*std::move(row));
      }
    }
  }
  if (!overlaps.empty()) PrintOverlap(overlaps, compute_ms, &values);
  if (const std::string tsv = absl::GetFlag(FLAGS_tsv); !tsv.empty()) {
    if (absl::Status s = WriteTsv(tsv, values); !s.ok()) {
      std::cerr << "transfer_bench: " << s.message() << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace triax::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "transfer_bench: worker-to-worker KV transfer between two kvworker "
      "processes (see bench/results/transfer.md)");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_probe_server)) {
    return triax::bench::RunProbeServer(absl::GetFlag(FLAGS_listen),
                                        absl::GetFlag(FLAGS_port_file));
  }
  return triax::bench::Run();
}
