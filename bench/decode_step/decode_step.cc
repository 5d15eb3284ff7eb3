#include "bench/decode_step/decode_step.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "kernels/layout.h"
#include "tests/integration/http_scrape.h"

namespace triax::bench {
namespace {

namespace v1 = triax::v1;
using Clock = std::chrono::steady_clock;

int WireIndex(client::AttendWire w) { return static_cast<int>(w); }

// CPU seconds every thread of process `pid` (0: this one) has used.
absl::StatusOr<double> CpuSeconds(pid_t pid) {
  clockid_t clock = CLOCK_PROCESS_CPUTIME_ID;
  if (pid != 0 && clock_getcpuclockid(pid, &clock) != 0) {
    return absl::InternalError(
        absl::StrCat("no CPU-time clock for process ", pid));
  }
  timespec ts{};
  if (clock_gettime(clock, &ts) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot read the CPU-time clock of process ", pid, ": ",
                     std::strerror(errno)));
  }
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace

const char* PathName(Path p) {
  switch (p) {
    case Path::kUnary:
      return "unary";
    case Path::kStream:
      return "stream";
    case Path::kUnaryUnix:
      return "unary-unix";
    case Path::kStreamUnix:
      return "stream-unix";
  }
  return "?";
}
bool IsStream(Path p) { return p == Path::kStream || p == Path::kStreamUnix; }
bool IsUnix(Path p) { return p == Path::kUnaryUnix || p == Path::kStreamUnix; }

const char* WireName(client::AttendWire w) {
  return w == client::AttendWire::kBF16 ? "bf16" : "f32";
}

uint64_t PoolBytesFor(const DecodeShape& shape, uint32_t tokens, const Mix& mix,
                      uint64_t frame_bytes) {
  const BenchShape& m = shape.model;
  const kernels::PageShape page{static_cast<int>(m.block_tokens),
                                static_cast<int>(m.n_kv_heads),
                                static_cast<int>(m.head_dim)};
  const uint32_t blocks = (tokens + m.block_tokens - 1) / m.block_tokens;
  // Pages per page size (one pool per encoding and page size).
  std::map<uint64_t, uint64_t> pages;
  for (const kernels::Encoding& e : mix.Assign(blocks)) {
    pages[kernels::PageBytes(e, page)] += uint64_t{shape.batch} * m.n_layers;
  }
  pages[kernels::PageBytes(kernels::Encoding(kernels::Format::kBF16), page)] +=
      uint64_t{shape.batch} * m.n_layers;
  uint64_t frames = 0;
  for (const auto& [bytes, n] : pages) {
    const uint64_t per_frame = std::max<uint64_t>(1, frame_bytes / bytes);
    frames += (n + per_frame - 1) / per_frame;
  }
  return frames * frame_bytes;
}

DecodeBench::DecodeBench(DecodeShape shape, BenchWorker* worker, int http_port,
                         uint32_t write_chunk_tokens, int install_threads,
                         v1::Worker::Stub* unix_stub)
    : shape_(shape),
      worker_(worker),
      http_port_(http_port),
      chunk_tokens_(write_chunk_tokens),
      install_threads_(install_threads),
      unix_stub_(unix_stub) {}

absl::Status DecodeBench::FreeAll() {
  absl::Status first;
  for (const client::SequenceHandle& h : seqs_) {
    if (absl::Status s = worker_->Free(h.sequence_id); first.ok()) first = s;
  }
  seqs_.clear();
  items_.clear();
  return first;
}

absl::Status DecodeBench::Install(const Mix& mix, uint32_t steps) {
  if (absl::Status s = CloseStreams(); !s.ok()) return s;
  if (absl::Status s = FreeAll(); !s.ok()) return s;
  const BenchShape& m = shape_.model;
  capacity_ = shape_.context + steps;
  written_ = shape_.context;
  const uint32_t blocks = (capacity_ + m.block_tokens - 1) / m.block_tokens;
  const std::vector<kernels::Encoding> encodings = mix.Assign(blocks);
  for (uint32_t b = 0; b < shape_.batch; ++b) {
    client::SequenceHandle h;
    h.sequence_id = absl::StrCat("d", b);
    h.worker_address = worker_->address();
    h.model = ModelProto(m);
    h.block_tokens = m.block_tokens;
    if (absl::Status s = worker_->Allocate(
            h.sequence_id, m, MakePlan(capacity_, m, encodings, next_lineage_));
        !s.ok()) {
      return s;
    }
    next_lineage_ += blocks;
    seqs_.push_back(std::move(h));
  }
  // Every (sequence, layer) once, install_threads_ WriteKV streams at once.
  const KvPattern pattern = KvPattern::Make(m, chunk_tokens_, 7);
  std::atomic<uint64_t> next{0};
  const uint64_t jobs = uint64_t{shape_.batch} * m.n_layers;
  absl::Mutex mu;
  absl::Status failed;
  std::vector<std::thread> threads;
  threads.reserve(install_threads_);
  for (int t = 0; t < install_threads_; ++t) {
    threads.emplace_back([&] {
      for (uint64_t j = next++; j < jobs; j = next++) {
        absl::Status s = worker_->WriteLayer(
            seqs_[j / m.n_layers].sequence_id,
            static_cast<uint32_t>(j % m.n_layers), shape_.context, pattern);
        if (!s.ok()) {
          absl::MutexLock lock(&mu);
          if (failed.ok()) failed = s;
          next = jobs;  // the others stop at their next job
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (!failed.ok()) return failed;

  // The step's tensors: queries normal(0, 1) from a fixed seed, and one
  // token of K/V per sequence (the same for every layer and step).
  const size_t qsz = size_t{m.n_q_heads} * m.head_dim;
  const size_t kvsz = size_t{m.n_kv_heads} * m.head_dim;
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.f, 1.f);
  q_.resize(shape_.batch * qsz);
  for (float& x : q_) x = dist(rng);
  out_.assign(q_.size(), 0.f);
  append_k_.resize(shape_.batch * kvsz);
  append_v_.resize(shape_.batch * kvsz);
  for (float& x : append_k_) x = dist(rng);
  for (float& x : append_v_) x = dist(rng);
  items_.resize(shape_.batch);
  for (uint32_t b = 0; b < shape_.batch; ++b) {
    client::Client::BatchItem& it = items_[b];
    it.seq = &seqs_[b];
    it.args.num_queries = 1;
    it.args.q = q_.data() + b * qsz;
    it.args.out = out_.data() + b * qsz;
  }
  return absl::OkStatus();
}

absl::Status DecodeBench::OpenStreams() {
  for (int unix_socket : {0, 1}) {
    v1::Worker::Stub* stub = unix_socket ? unix_stub_ : worker_->stub();
    if (stub == nullptr) continue;
    for (client::AttendWire wire :
         {client::AttendWire::kF32, client::AttendWire::kBF16}) {
      client::AttendStreamOptions o;
      o.wire = wire;
      auto s = client::AttendStream::Open(stub, kTenant, {}, o);
      if (!s.ok()) return s.status();
      streams_[unix_socket][WireIndex(wire)] = *std::move(s);
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeBench::CloseStreams() {
  absl::Status first;
  for (auto& by_wire : streams_) {
    for (auto& s : by_wire) {
      if (s == nullptr) continue;
      if (absl::Status f = s->Finish(); first.ok()) first = f;
      s.reset();
    }
  }
  return first;
}

void DecodeBench::FillItems(uint32_t layer, bool append) {
  const size_t kvsz = size_t{shape_.model.n_kv_heads} * shape_.model.head_dim;
  for (uint32_t b = 0; b < items_.size(); ++b) {
    client::Client::AttendArgs& a = items_[b].args;
    a.layer = layer;
    a.append_k = append ? append_k_.data() + b * kvsz : nullptr;
    a.append_v = append ? append_v_.data() + b * kvsz : nullptr;
    a.append_first = written_;
    a.append_tokens = append ? 1 : 0;
  }
}

absl::Status DecodeBench::Layer(Path path, client::AttendWire wire,
                                uint32_t layer, bool append) {
  FillItems(layer, append);
  absl::StatusOr<std::vector<absl::Status>> results;
  v1::Worker::Stub* stub = IsUnix(path) ? unix_stub_ : worker_->stub();
  if (stub == nullptr) {
    return absl::FailedPreconditionError(
        "the worker was started without its local socket");
  }
  if (!IsStream(path)) {
    v1::AttendRequest req;
    if (absl::Status s = client::MakeAttendRequest(kTenant, items_, wire, &req);
        !s.ok()) {
      return s;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(600));
    v1::AttendResponse resp;
    if (absl::Status s = FromGrpcStatus(stub->Attend(&ctx, req, &resp));
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("Attend: ", s.message()));
    }
    layer_bytes_[WireIndex(wire)][append ? 1 : 0] = {req.ByteSizeLong(),
                                                     resp.ByteSizeLong()};
    results = client::TakeAttendResponse("Attend", items_, wire, resp);
  } else {
    client::AttendStream* stream =
        streams_[IsUnix(path) ? 1 : 0][WireIndex(wire)].get();
    if (stream == nullptr) {
      return absl::FailedPreconditionError("the streams are not open");
    }
    results = stream->Attend(items_);
  }
  if (!results.ok()) return results.status();
  for (const absl::Status& s : *results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeBench::Scraped> DecodeBench::Scrape() const {
  auto reply = testing::HttpGet(http_port_, "/metrics");
  if (!reply.ok()) {
    return absl::Status(
        reply.status().code(),
        absl::StrCat("the worker's /metrics on port ", http_port_, ": ",
                     reply.status().message()));
  }
  if (reply->status != 200) {
    return absl::InternalError(
        absl::StrCat("the worker's /metrics answered ", reply->status));
  }
  const testing::Scrape s = testing::ParseScrape(reply->body);
  Scraped out;
  out.device = testing::SumSeries(s, "triaxkv_worker_attention_seconds_sum");
  out.batches = testing::SumSeries(s, "triaxkv_worker_attention_seconds_count");
  out.kernel =
      testing::SumSeries(s, "triaxkv_worker_attention_kernel_seconds_total");
  out.server = testing::SumSeries(s, "triaxkv_worker_rpc_duration_seconds_sum",
                                  {"method=\"Attend\""});
  return out;
}

absl::StatusOr<StepTimes> DecodeBench::Step(Path path, client::AttendWire wire,
                                            bool append) {
  if (items_.empty()) return absl::FailedPreconditionError("nothing installed");
  if (append && written_ >= capacity_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the plans hold ", capacity_,
                     " tokens; Install was asked for fewer steps"));
  }
  auto before = Scrape();
  if (!before.ok()) return before.status();
  auto worker_before = CpuSeconds(worker_->pid());
  if (!worker_before.ok()) return worker_before.status();
  const double client_before = *CpuSeconds(0);
  const auto start = Clock::now();
  for (uint32_t l = 0; l < shape_.model.n_layers; ++l) {
    if (absl::Status s = Layer(path, wire, l, append); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat(PathName(path), " ", WireName(wire), " layer ",
                                 l, ": ", s.message()));
    }
  }
  StepTimes t;
  t.wall = std::chrono::duration<double>(Clock::now() - start).count();
  t.client_cpu = *CpuSeconds(0) - client_before;
  auto worker_after = CpuSeconds(worker_->pid());
  if (!worker_after.ok()) return worker_after.status();
  t.worker_cpu = *worker_after - *worker_before;
  if (append) ++written_;
  auto after = Scrape();
  if (!after.ok()) return after.status();
  t.device = after->device - before->device;
  t.kernel = after->kernel - before->kernel;
  t.server = IsStream(path) ? 0 : after->server - before->server;
  t.batches =
      static_cast<uint64_t>(std::llround(after->batches - before->batches));
  return t;
}

}  // namespace triax::bench
