// decode_step_bench's engine, apart from its flags and tables: a batch of
// sequences installed on a real kvworker (AllocatePages + WriteKV of
// synthetic KV, blocks in an encoding mix of bench/transfer/
// transfer_cases.h), and decode steps over them through the worker's
// service, timed here and split with the worker's own measurements.
//
// A step is what a model's attention does for one new token of every
// sequence of the batch: for each layer, in order (a model needs layer l's
// output before layer l + 1), one Attend carrying all batch items, each
// with that layer's K/V of the new token appended (as the reference
// frontend sends them: client/frontend/service_kv_store.h). Paths:
//   unary   one Worker.Attend RPC per layer (client/attend_stream.h's
//           MakeAttendRequest + TakeAttendResponse, as Client::AttendBatch)
//   stream  one AttendStream message per layer on a stream opened once
// and wires: queries and outputs as float32 or BF16 (AttendItem.dtype).
//
// What a step's time is split into, from the worker's /metrics scraped
// before and after each step (outside the timed span):
//   device  triaxkv_worker_attention_seconds_sum: the worker's decode-
//           attention device batches (Device::DecodeAttentionBatch: on
//           CUDA the page tables and queries uploaded, the kernel, the
//           outputs downloaded and the stream synchronized; on the CPU
//           backend the reference kernel). One batch per layer.
//   server  triaxkv_worker_rpc_duration_seconds_sum{method="Attend"}: the
//           worker's time in the Attend calls (unary only: a stream is one
//           call, recorded when it ends).
//   cpu     the bench's and the worker's CPU time over the step (their
//           CPU-time clocks), read around the timed span.
//   overhead = wall - device: everything a step costs beyond the device
//           batches (the client's and the worker's conversions and copies,
//           gRPC, the appends' writes and seals, the batch's preparation).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/transfer/bench_worker.h"
#include "bench/transfer/transfer_cases.h"
#include "client/attend_stream.h"

namespace triax::bench {

struct DecodeShape {
  BenchShape model;          // layers, heads, head_dim, block_tokens
  uint32_t batch = 64;       // sequences
  uint32_t context = 32768;  // tokens written before the first step
};

// Pool bytes a batch needs: every block's pages of the plan of `tokens`
// tokens in `mix`, frames of `frame_bytes` carved per encoding as the
// worker's PageAllocator does (worker/page_allocator.h), plus one BF16
// window page per sequence and layer (the block that appends fill).
uint64_t PoolBytesFor(const DecodeShape& shape, uint32_t tokens, const Mix& mix,
                      uint64_t frame_bytes);

// A layer's Attend: one unary RPC or one message on an AttendStream, over
// TCP or over the worker's Unix-domain socket (--local_listen: a frontend
// on the worker's host).
enum class Path { kUnary, kStream, kUnaryUnix, kStreamUnix };
const char* PathName(Path p);  // "unary", "stream", "unary-unix", ...
bool IsStream(Path p);
bool IsUnix(Path p);
const char* WireName(client::AttendWire w);

// One measured step.
struct StepTimes {
  double wall = 0;    // seconds, here, all layers
  double device = 0;  // worker's device attention batches
  // The kernels alone (triaxkv_worker_attention_kernel_seconds_total: on
  // CUDA device time between events around each launch), a part of device.
  double kernel = 0;
  double server = 0;     // worker's Attend calls (unary), else 0
  uint64_t batches = 0;  // device batches the step ran
  // CPU seconds (every thread) during the step: this process (the
  // frontend's requests, conversions and gRPC), and the worker (on the CPU
  // backend its kernel too; on CUDA also time spent waiting for the GPU
  // where the driver spins). Steadier than wall time on a shared machine.
  double client_cpu = 0, worker_cpu = 0;
};

class DecodeBench {
 public:
  // `worker` serves on 127.0.0.1 with --http_listen, its port in
  // `http_port`; `unix_stub`, when not null, reaches it on its local
  // socket (the *-unix paths).
  DecodeBench(DecodeShape shape, BenchWorker* worker, int http_port,
              uint32_t write_chunk_tokens, int install_threads,
              triax::v1::Worker::Stub* unix_stub = nullptr);

  // Installs `batch` sequences of `context` tokens in `mix` with room for
  // `steps` appended tokens each, writing every layer (install_threads
  // WriteKV streams at once). Frees a batch installed before.
  absl::Status Install(const Mix& mix, uint32_t steps);
  absl::Status FreeAll();

  // Opens the streams of both wires, on TCP and on the socket when there is
  // one (after Install).
  absl::Status OpenStreams();
  // One decode step on `path` and `wire`; `append` false runs the attention
  // alone (no K/V appended: the context does not grow).
  absl::StatusOr<StepTimes> Step(Path path, client::AttendWire wire,
                                 bool append);
  // Request and response bytes of the last unary Attend on `wire` with or
  // without appends (one layer of the batch; a stream's messages are the
  // same).
  std::pair<uint64_t, uint64_t> layer_bytes(client::AttendWire wire,
                                            bool append) const {
    return layer_bytes_[static_cast<int>(wire)][append ? 1 : 0];
  }
  // Ends the streams (half-close; their status).
  absl::Status CloseStreams();

  uint64_t written() const { return written_; }

 private:
  struct Scraped {
    double device = 0, kernel = 0, server = 0, batches = 0;
  };
  absl::StatusOr<Scraped> Scrape() const;
  absl::Status Layer(Path path, client::AttendWire wire, uint32_t layer,
                     bool append);
  void FillItems(uint32_t layer, bool append);

  const DecodeShape shape_;
  BenchWorker* const worker_;
  const int http_port_;
  const uint32_t chunk_tokens_;
  const int install_threads_;
  uint32_t capacity_ = 0;  // tokens each sequence's plan holds
  uint64_t written_ = 0;   // tokens written per sequence and layer
  uint64_t next_lineage_ = 1;
  std::vector<client::SequenceHandle> seqs_;
  std::vector<client::Client::BatchItem> items_;
  std::vector<float> q_, out_, append_k_, append_v_;
  triax::v1::Worker::Stub* const unix_stub_;
  // [unix][wire]
  std::unique_ptr<client::AttendStream> streams_[2][2];
  std::pair<uint64_t, uint64_t> layer_bytes_[2][2] = {};  // [wire][append]
};

}  // namespace triax::bench
