// manager_bench's client threads (bench/manager/manager_bench.cc): each on
// a channel of its own (or a SequenceCalls stream shared by several), against a
// kvmanager set up with the bench's tenants ("bench-t<i>") and a fake worker.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/sequence_call_stream.h"
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

// How one client's session calls reach the manager: a unary RPC each on
// the client's own channel, or a call on a SequenceCalls stream (which
// several clients may share: a frontend process multiplexing its sessions).
class SessionCalls {
 public:
  virtual ~SessionCalls() = default;
  virtual grpc::Status Open(const triax::v1::OpenSequenceRequest& req,
                            triax::v1::OpenSequenceResponse* resp) = 0;
  virtual grpc::Status Extend(const triax::v1::ExtendSequenceRequest& req,
                              triax::v1::ExtendSequenceResponse* resp) = 0;
  virtual grpc::Status Close(const triax::v1::CloseSequenceRequest& req,
                             triax::v1::CloseSequenceResponse* resp) = 0;
  virtual grpc::Status Get(const triax::v1::GetSequenceRequest& req,
                           triax::v1::GetSequenceResponse* resp) = 0;
};
// Unary RPCs on `channel` with the bearer `token` (empty: none).
std::unique_ptr<SessionCalls> UnaryCalls(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& token);
// Calls on `stream` (outliving the result), 30 s deadline each.
std::unique_ptr<SessionCalls> StreamCalls(
    triax::client::SequenceCallStream* stream);

// One client's sessions through `calls` (connected already, so that the
// handshakes stay out of the timed window) as tenant bench-t<tenant>: Open
// 41 blocks, Extend 7, Close (request ids unique to `run` and `index`),
// until `deadline`, or `sessions` of them when >= 0.
void RunClient(SessionCalls* calls, int index, int tenant,
               Clock::time_point deadline, int sessions, int run,
               ClientStats* stats);

// --floor: GetSequence of a sequence that does not exist through `calls`,
// as tenant bench-t<tenant>, until `deadline`; the latencies go to
// stats->open_ms. NOT_FOUND is the expected answer; any other counts as an
// error.
void RunFloorClient(SessionCalls* calls, int index, int tenant,
                    Clock::time_point deadline, ClientStats* stats);

}  // namespace triax::bench::manager
