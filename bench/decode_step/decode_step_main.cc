// decode_step_bench: one decode step of a model's attention through the
// kvworker service (bench/decode_step/decode_step.h), against the worker's
// own device time for the same step, for each path (unary Attend per
// layer, or one AttendStream), wire (float32 or BF16 queries/outputs) and
// append mode (a real step appending each layer's new token, or the
// attention alone, which separates the appends' cost).
// Defaults: the shape, a Llama-3-8B (32 layers, 32 query heads,
// 8 KV heads, head_dim 128, blocks of 16 tokens) at batch 64 x 32k context
// in the tri-3.5 mix; on a small machine give small sizes with
// --backend=cpu. Results and commands: bench/results/decode_step.md.
//
// The configurations run interleaved (round r runs one step of each), so
// drift on a shared machine spreads over all of them. Table (stdout; every
// value also in --tsv): per case, path, wire and mode the medians over --steps
// rounds of the step's wall time, the worker's device attention time and
// the kernels' share of it, its time in Attend calls (unary only),
// overhead = wall - device, overhead / device (with its range over the
// rounds) and (wall - kernel) / kernel, the figure; request and
// response KiB of one layer's Attend; the CPU milliseconds of this process (the
// client) and of the worker over the step; device batches per step (one
// per layer expected). Exit 0 when every step ran; 1 with a message naming the
// flag for bad flags, or the failing call.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/decode_step/decode_step.h"
#include "common/local_socket.h"
#include "tests/integration/http_scrape.h"
#include "tests/integration/process.h"

ABSL_FLAG(std::string, bin_dir, "",
          "directory with kvworker; default: $TRIAX_BIN_DIR, else this "
          "binary's directory");
ABSL_FLAG(std::string, backend, "auto", "the worker's --backend");
ABSL_FLAG(std::string, worker_flags, "",
          "extra flags appended verbatim (split on spaces) to the worker's "
          "command line");
ABSL_FLAG(std::string, cpus_worker, "",
          "pin the worker to these CPUs (\"0\", \"0-3\"); empty: not pinned");
ABSL_FLAG(std::string, cpus_bench, "", "pin this process (the client)");
ABSL_FLAG(int, batch, 64, "sequences per step (1..4096)");
ABSL_FLAG(int, context, 32768, "tokens of each sequence before the steps");
ABSL_FLAG(int, layers, 32, "model layers (1..1024)");
ABSL_FLAG(int, q_heads, 32, "query heads (a multiple of --kv_heads)");
ABSL_FLAG(int, kv_heads, 8, "KV heads (1..256)");
ABSL_FLAG(int, head_dim, 128, "head dimension (1..1024)");
ABSL_FLAG(int, block_tokens, 16, "tokens per block (a power of two, 1..256)");
ABSL_FLAG(std::string, encodings, "tri-3.5",
          "cases, each a batch installed in that encoding: bf16 fp8 int8 "
          "int4 int2 tq4 tq3 tq2, k=..,v=.. (transfer_cases.h), tri-3.5");
ABSL_FLAG(std::string, paths, "unary,stream",
          "comma-separated: unary, stream (over TCP), unary-unix, "
          "stream-unix (over the worker's --local_listen socket, as a "
          "frontend on its host)");
ABSL_FLAG(std::string, wires, "f32,bf16",
          "queries/outputs on the wire: f32, bf16 or both");
ABSL_FLAG(int, steps, 10, "measured rounds (one step of each configuration)");
ABSL_FLAG(int, warmup, 2, "rounds run first and not measured");
ABSL_FLAG(std::string, append, "yes",
          "yes: each step appends one token of K/V per sequence and layer (a "
          "real decode step); no: the attention alone (nothing written, the "
          "context does not grow); yes,no: both, interleaved");
ABSL_FLAG(bool, dry_run, false,
          "check the flags, print the header (with the pool the cases need) "
          "and exit 0 without starting the worker");
ABSL_FLAG(int64_t, pool_mb, 0,
          "the worker's --pool_mb; 0: the largest case's frames + 3% + 64");
ABSL_FLAG(int, frame_kb, 256, "the worker's --frame_kb");
ABSL_FLAG(int, write_chunk_tokens, 1024, "tokens per WriteKV message");
ABSL_FLAG(int, install_threads, 4, "WriteKV streams at once while installing");
ABSL_FLAG(std::string, tsv, "", "also write every value to this TSV file");

namespace triax::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
    }
  }
  return "unknown CPU";
}

std::string CpusOr(const std::string& cpus) {
  return cpus.empty() ? "any" : cpus;
}

absl::Status Fail(const std::string& flag, const std::string& value,
                  const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": \"", value, "\" ", why));
}

// An integer flag in [lo, hi].
absl::Status InRange(const char* flag, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return Fail(flag, std::to_string(value),
              absl::StrCat("must be in ", lo, "..", hi));
}

struct Config {
  Path path;
  client::AttendWire wire;
  bool append;
};

absl::StatusOr<std::vector<Config>> ParseConfigs() {
  std::vector<Path> paths;
  for (absl::string_view p :
       absl::StrSplit(absl::GetFlag(FLAGS_paths), ',', absl::SkipEmpty())) {
    bool known = false;
    for (Path candidate :
         {Path::kUnary, Path::kStream, Path::kUnaryUnix, Path::kStreamUnix}) {
      if (p == PathName(candidate)) {
        paths.push_back(candidate);
        known = true;
      }
    }
    if (!known) {
      return Fail("--paths", std::string(p),
                  "is not unary, stream, unary-unix or stream-unix");
    }
  }
  std::vector<client::AttendWire> wires;
  for (absl::string_view w :
       absl::StrSplit(absl::GetFlag(FLAGS_wires), ',', absl::SkipEmpty())) {
    if (w == "f32") {
      wires.push_back(client::AttendWire::kF32);
    } else if (w == "bf16") {
      wires.push_back(client::AttendWire::kBF16);
    } else {
      return Fail("--wires", std::string(w), "is not f32 or bf16");
    }
  }
  std::vector<bool> appends;
  for (absl::string_view a :
       absl::StrSplit(absl::GetFlag(FLAGS_append), ',', absl::SkipEmpty())) {
    if (a == "yes") {
      appends.push_back(true);
    } else if (a == "no") {
      appends.push_back(false);
    } else {
      return Fail("--append", std::string(a), "is not yes or no");
    }
  }
  if (paths.empty()) return Fail("--paths", "", "names no path");
  if (wires.empty()) return Fail("--wires", "", "names no wire");
  if (appends.empty()) return Fail("--append", "", "names no mode");
  std::vector<Config> out;
  for (bool append : appends) {
    for (client::AttendWire w : wires) {
      for (Path p : paths) out.push_back({p, w, append});
    }
  }
  return out;
}

absl::StatusOr<DecodeShape> ShapeFromFlags() {
  for (const absl::Status& s :
       {InRange("--batch", absl::GetFlag(FLAGS_batch), 1, 4096),
        InRange("--context", absl::GetFlag(FLAGS_context), 1, 1 << 22),
        InRange("--layers", absl::GetFlag(FLAGS_layers), 1, 1024),
        InRange("--kv_heads", absl::GetFlag(FLAGS_kv_heads), 1, 256),
        InRange("--q_heads", absl::GetFlag(FLAGS_q_heads), 1, 4096),
        InRange("--head_dim", absl::GetFlag(FLAGS_head_dim), 1, 1024)}) {
    if (!s.ok()) return s;
  }
  const int t = absl::GetFlag(FLAGS_block_tokens);
  if (t < 1 || t > 256 || (t & (t - 1)) != 0) {
    return Fail("--block_tokens", std::to_string(t),
                "must be a power of two in 1..256");
  }
  const int q = absl::GetFlag(FLAGS_q_heads);
  const int kv = absl::GetFlag(FLAGS_kv_heads);
  if (q % kv != 0) {
    return Fail("--q_heads", std::to_string(q),
                absl::StrCat("is not a multiple of --kv_heads=", kv));
  }
  DecodeShape shape;
  shape.model.n_layers = static_cast<uint32_t>(absl::GetFlag(FLAGS_layers));
  shape.model.n_q_heads = static_cast<uint32_t>(q);
  shape.model.n_kv_heads = static_cast<uint32_t>(kv);
  shape.model.head_dim = static_cast<uint32_t>(absl::GetFlag(FLAGS_head_dim));
  shape.model.block_tokens = static_cast<uint32_t>(t);
  shape.batch = static_cast<uint32_t>(absl::GetFlag(FLAGS_batch));
  shape.context = static_cast<uint32_t>(absl::GetFlag(FLAGS_context));
  return shape;
}

struct Row {
  std::string encoding;
  Config config;
  std::vector<StepTimes> steps;
  std::pair<uint64_t, uint64_t> layer_bytes;
};

void Print(const std::vector<Row>& rows, std::ofstream* tsv) {
  std::cout << absl::StrFormat(
      "%-9s %-11s %-4s %-6s %7s %7s %9s %9s %9s %9s %9s %8s %13s %8s %8s %8s "
      "%7s\n",
      "case", "path", "wire", "append", "req_KiB", "resp_KiB", "step_ms",
      "device_ms", "kernel_ms", "server_ms", "overhd_ms", "ovh/dev",
      "ovh/dev range", "ovh/krn", "cli_cpu", "wrk_cpu", "batches");
  for (const Row& r : rows) {
    std::vector<double> wall, device, kernel, krn_ratio, server, over, ratio,
        batches, cli, wrk;
    for (const StepTimes& t : r.steps) {
      wall.push_back(t.wall * 1e3);
      device.push_back(t.device * 1e3);
      kernel.push_back(t.kernel * 1e3);
      krn_ratio.push_back(t.kernel > 0 ? (t.wall - t.kernel) / t.kernel : 0);
      server.push_back(t.server * 1e3);
      over.push_back((t.wall - t.device) * 1e3);
      ratio.push_back(t.device > 0 ? (t.wall - t.device) / t.device : 0);
      batches.push_back(static_cast<double>(t.batches));
      cli.push_back(t.client_cpu * 1e3);
      wrk.push_back(t.worker_cpu * 1e3);
    }
    const bool unary = !IsStream(r.config.path);
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    std::cout << absl::StrFormat(
        "%-9s %-11s %-4s %-6s %7.1f %7.1f %9.3f %9.3f %9.3f %9s %9.3f %8.3f "
        "%6.3f-%-6.3f %8.3f %8.2f %8.2f %7.0f\n",
        r.encoding, PathName(r.config.path), WireName(r.config.wire),
        r.config.append ? "yes" : "no", r.layer_bytes.first / 1024.0,
        r.layer_bytes.second / 1024.0, Median(wall), Median(device),
        Median(kernel),
        unary ? absl::StrFormat("%.3f", Median(server)) : std::string("-"),
        Median(over), Median(ratio), *lo, *hi, Median(krn_ratio), Median(cli),
        Median(wrk), Median(batches));
    if (tsv != nullptr) {
      auto put = [&](const char* metric, double value, const char* unit) {
        *tsv << r.encoding << '\t' << PathName(r.config.path) << '\t'
             << WireName(r.config.wire) << '\t'
             << (r.config.append ? "yes" : "no") << '\t' << metric << '\t'
             << absl::StrFormat("%.9g", value) << '\t' << unit << '\n';
      };
      put("step_ms", Median(wall), "ms");
      put("device_ms", Median(device), "ms");
      put("kernel_ms", Median(kernel), "ms");
      put("overhead_over_kernel", Median(krn_ratio), "ratio");
      if (unary) put("server_ms", Median(server), "ms");
      put("overhead_ms", Median(over), "ms");
      put("overhead_over_device", Median(ratio), "ratio");
      put("overhead_over_device_min", *lo, "ratio");
      put("overhead_over_device_max", *hi, "ratio");
      put("device_batches", Median(batches), "count");
      put("client_cpu_ms", Median(cli), "ms");
      put("worker_cpu_ms", Median(wrk), "ms");
      put("layer_request_bytes", static_cast<double>(r.layer_bytes.first), "B");
      put("layer_response_bytes", static_cast<double>(r.layer_bytes.second),
          "B");
    }
  }
}

int Run() {
  auto shape = ShapeFromFlags();
  absl::Status bad = shape.status();
  absl::StatusOr<std::vector<EncodingCase>> cases =
      absl::InvalidArgumentError("");
  if (bad.ok()) {
    cases = ParseEncodingCases(absl::GetFlag(FLAGS_encodings), shape->model,
                               "--encodings");
    bad = cases.status();
  }
  if (bad.ok()) {
    for (const EncodingCase& c : *cases) {
      if (c.source.name != c.destination.name) {
        bad = Fail("--encodings", c.name,
                   "names a transfer (a->b); give one encoding per case");
        break;
      }
    }
  }
  auto configs = ParseConfigs();
  if (bad.ok()) bad = configs.status();
  for (const absl::Status& s :
       {InRange("--steps", absl::GetFlag(FLAGS_steps), 1, 100000),
        InRange("--warmup", absl::GetFlag(FLAGS_warmup), 0, 100000),
        InRange("--pool_mb", absl::GetFlag(FLAGS_pool_mb), 0, 16777216),
        InRange("--write_chunk_tokens", absl::GetFlag(FLAGS_write_chunk_tokens),
                1, 65536),
        InRange("--install_threads", absl::GetFlag(FLAGS_install_threads), 1,
                256)}) {
    if (bad.ok()) bad = s;
  }
  const int frame_kb = absl::GetFlag(FLAGS_frame_kb);
  if (bad.ok() && (frame_kb < 16 || frame_kb % 16 != 0)) {
    bad = Fail("--frame_kb", std::to_string(frame_kb),
               "must be a positive multiple of 16");
  }
  for (const auto& [flag, value] :
       {std::pair{"--cpus_worker", absl::GetFlag(FLAGS_cpus_worker)},
        std::pair{"--cpus_bench", absl::GetFlag(FLAGS_cpus_bench)}}) {
    if (bad.ok() && !value.empty()) bad = CheckCpuList(value, flag);
  }
  if (!bad.ok()) {
    std::cerr << "decode_step_bench: " << bad.message() << "\n";
    return 1;
  }
  if (const std::string cpus = absl::GetFlag(FLAGS_cpus_bench); !cpus.empty()) {
    if (absl::Status s = PinProcess(getpid(), cpus, "--cpus_bench"); !s.ok()) {
      std::cerr << "decode_step_bench: " << s.message() << "\n";
      return 1;
    }
  }

  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  // Tokens each plan holds beyond the context: one per appending step.
  uint32_t appended = 0;
  for (const Config& c : *configs) {
    if (c.append) appended += static_cast<uint32_t>(steps + warmup);
  }
  const uint64_t frame_bytes = uint64_t{static_cast<uint32_t>(frame_kb)} << 10;
  uint64_t need = 0;
  for (const EncodingCase& c : *cases) {
    need = std::max(need, PoolBytesFor(*shape, shape->context + appended,
                                       c.source, frame_bytes));
  }
  WorkerLaunch launch;
  launch.backend = absl::GetFlag(FLAGS_backend);
  launch.pool_mb = absl::GetFlag(FLAGS_pool_mb);
  if (launch.pool_mb == 0) {
    launch.pool_mb = static_cast<int64_t>(need * 1.03 / kMiB) + 64;
  }
  std::string bin_dir = absl::GetFlag(FLAGS_bin_dir);
  if (bin_dir.empty() && std::getenv("TRIAX_BIN_DIR") != nullptr) {
    bin_dir = std::getenv("TRIAX_BIN_DIR");
  }
  if (bin_dir.empty()) bin_dir = SelfDir();
  const BenchShape& m = shape->model;
  std::cout << "# decode_step_bench: kvworker from " << bin_dir
            << ", --backend=" << launch.backend
            << " --pool_mb=" << launch.pool_mb << " (the cases need "
            << static_cast<int64_t>(need / kMiB)
            << " MiB) --frame_kb=" << frame_kb << " "
            << absl::GetFlag(FLAGS_worker_flags)
            << "\n# machine: " << CpuModel() << ", "
            << sysconf(_SC_NPROCESSORS_ONLN) << " online CPUs; worker cpus "
            << CpusOr(absl::GetFlag(FLAGS_cpus_worker)) << ", bench cpus "
            << CpusOr(absl::GetFlag(FLAGS_cpus_bench)) << "\n# model "
            << m.n_layers << " layers x " << m.n_q_heads << " query / "
            << m.n_kv_heads << " KV heads x head_dim " << m.head_dim
            << ", blocks of " << m.block_tokens << "; batch " << shape->batch
            << " x context " << shape->context
            << " (append yes: +1 token a step; no: the attention alone); "
            << warmup << " warm-up + " << steps
            << " measured rounds; medians; KiB = 1024 B\n";
  for (const EncodingCase& c : *cases) {
    const uint64_t bytes =
        PoolBytesFor(*shape, shape->context + appended, c.source, frame_bytes);
    const double bf16 = static_cast<double>(m.Bf16BytesPerToken()) *
                        (shape->context + appended) * shape->batch;
    std::cout << absl::StrFormat(
        "# %s: %.0f MiB of pool, %.3f of the same tokens in BF16\n", c.name,
        bytes / kMiB, bytes / bf16);
  }
  if (absl::GetFlag(FLAGS_dry_run)) return 0;

  auto dir = testing::TempDir::Create("decode_step_bench");
  if (!dir.ok()) {
    std::cerr << "decode_step_bench: " << dir.status() << "\n";
    return 1;
  }
  const std::string http_port_file = (*dir)->path() + "/worker.http";
  launch.extra_flags = {absl::StrCat("--frame_kb=", frame_kb),
                        "--http_listen=127.0.0.1:0",
                        "--http_port_file=" + http_port_file};
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_worker_flags),
                                            ' ', absl::SkipEmpty())) {
    launch.extra_flags.emplace_back(f);
  }
  const bool any_unix =
      std::any_of(configs->begin(), configs->end(),
                  [](const Config& c) { return IsUnix(c.path); });
  const std::string socket = "unix:" + (*dir)->path() + "/worker.sock";
  if (any_unix) launch.extra_flags.push_back("--local_listen=" + socket);
  launch.cpus = absl::GetFlag(FLAGS_cpus_worker);
  launch.cpus_flag = "--cpus_worker";
  setenv("TRIAX_BIN_DIR", bin_dir.c_str(), 1);
  auto worker = BenchWorker::Start("worker", launch, (*dir)->path());
  if (!worker.ok()) {
    std::cerr << "decode_step_bench: starting the worker: " << worker.status()
              << "\n";
    return 1;
  }
  const int http_port = testing::PortFromFile(http_port_file);
  if (http_port == 0) {
    std::cerr << "decode_step_bench: the worker wrote no HTTP port to "
              << http_port_file << "\n";
    return 1;
  }
  std::cout << "# worker " << (*worker)->address() << ", /metrics on port "
            << http_port << "\n";

  std::ofstream tsv;
  if (const std::string path = absl::GetFlag(FLAGS_tsv); !path.empty()) {
    tsv.open(path);
    tsv << "case\tpath\twire\tappend\tmetric\tvalue\tunit\n";
  }
  std::unique_ptr<v1::Worker::Stub> unix_stub;
  if (any_unix) {
    grpc::ChannelArguments ch;
    ch.SetMaxReceiveMessageSize(64 << 20);
    unix_stub = v1::Worker::NewStub(grpc::CreateCustomChannel(
        socket, ChannelCredentialsFor(socket, nullptr), ch));
  }
  DecodeBench bench(
      *shape, worker->get(), http_port,
      static_cast<uint32_t>(absl::GetFlag(FLAGS_write_chunk_tokens)),
      absl::GetFlag(FLAGS_install_threads), unix_stub.get());
  auto fail = [&](const absl::Status& s) {
    std::cerr << "decode_step_bench: " << s << "\n--- worker log:\n"
              << (*worker)->Log() << "\n";
    return 1;
  };
  std::vector<Row> rows;
  for (const EncodingCase& c : *cases) {
    const auto start = std::chrono::steady_clock::now();
    if (absl::Status s = bench.Install(c.source, appended); !s.ok()) {
      return fail(s);
    }
    const double install =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    const double bf16 = static_cast<double>(m.Bf16BytesPerToken()) *
                        shape->context * shape->batch;
    std::cout << absl::StrFormat(
        "# %s: installed in %.1f s (%.2f GB/s of BF16 K/V written)\n", c.name,
        install, bf16 / install / 1e9);
    if (absl::Status s = bench.OpenStreams(); !s.ok()) return fail(s);
    const size_t first = rows.size();
    for (const Config& config : *configs) {
      rows.push_back(Row{c.name, config, {}, {}});
    }
    for (int round = 0; round < warmup + steps; ++round) {
      for (size_t i = 0; i < configs->size(); ++i) {
        Row& row = rows[first + i];
        auto t =
            bench.Step(row.config.path, row.config.wire, row.config.append);
        if (!t.ok()) return fail(t.status());
        if (round >= warmup) row.steps.push_back(*t);
      }
    }
    for (size_t i = first; i < rows.size(); ++i) {
      rows[i].layer_bytes =
          bench.layer_bytes(rows[i].config.wire, rows[i].config.append);
    }
    if (absl::Status s = bench.CloseStreams(); !s.ok()) return fail(s);
    if (absl::Status s = bench.FreeAll(); !s.ok()) return fail(s);
  }
  Print(rows, tsv.is_open() ? &tsv : nullptr);
  if (tsv.is_open()) {
    tsv.close();
    if (!tsv) {
      std::cerr << "decode_step_bench: --tsv: cannot write \""
                << absl::GetFlag(FLAGS_tsv) << "\"\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace triax::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "decode_step_bench: decode steps of a model's attention through the "
      "kvworker service against the worker's device time (see "
      "bench/results/decode_step.md)");
  absl::ParseCommandLine(argc, argv);
  return triax::bench::Run();
}
