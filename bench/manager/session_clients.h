// manager_bench's client threads (bench/manager/manager_bench.cc): each on
// a channel of its own, against a kvmanager set up with the bench's
// tenants ("bench-t<i>") and a fake worker.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "triax/v1/manager.grpc.pb.h"

namespace triax::bench::manager {

using Clock = std::chrono::steady_clock;

// A channel to `target` that shares no connection with another client's
// (a distinct channel argument per `index`).
std::shared_ptr<grpc::Channel> NewChannel(
    const std::string& target, int index,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials =
        grpc::InsecureChannelCredentials());

// How one manager is reached: the credentials of the clients' channels and
// the tenants' tokens ("bench-t<i>"; empty without tokens).
struct Access {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  std::vector<std::string> tenant_tokens;
};

// One client's calls: latencies in ms per kind (the floor's go to
// open_ms), blocks planned, errors and the first one.
struct ClientStats {
  std::vector<double> open_ms, extend_ms, close_ms;
  uint64_t blocks = 0;
  uint64_t errors = 0;
  std::string first_error;
};

// The sessions' model: 32 layers, 8 KV heads, 32 query heads, head_dim 128.
void SetBenchModel(triax::v1::ModelShape* m);
// A text span of `n` tokens with `role`.
void AddSpan(google::protobuf::RepeatedPtrField<triax::v1::Span>* spans,
             triax::v1::Role role, uint32_t n);

// One client on its own `channel` (connected already, so that the
// handshakes stay out of the timed window), tenant bench-t<index % tenants>.
// Runs sessions (Open 41 blocks, Extend 7, Close; request ids unique to
// `run`) until `deadline`, or `sessions` of them when >= 0.
void RunClient(const std::shared_ptr<grpc::Channel>& channel, int index,
               const Access& access, int tenants, Clock::time_point deadline,
               int sessions, int run, ClientStats* stats);

// --floor: GetSequence of a sequence that does not exist, until `deadline`;
// the latencies go to stats->open_ms. NOT_FOUND is the expected answer; any
// other counts as an error.
void RunFloorClient(const std::shared_ptr<grpc::Channel>& channel, int index,
                    const Access& access, int tenants,
                    Clock::time_point deadline, ClientStats* stats);

}  // namespace triax::bench::manager
