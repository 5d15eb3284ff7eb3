// The gRPC streaming probe (probe.proto): the server runs in a child
// process (transfer_bench --probe_server), the bench times how long one
// Stream call takes to deliver a given number of bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "probe.grpc.pb.h"  // generated, bench/transfer/CMakeLists.txt

namespace triax::bench {

// Serves StreamProbe on `listen` ("127.0.0.1:0"), writes the bound port to
// `port_file`, and serves until the process is killed. Returns the exit
// code (1 with a message on stderr when it cannot listen).
int RunProbeServer(const std::string& listen, const std::string& port_file);

class ProbeClient {
 public:
  explicit ProbeClient(const std::string& address);
  // Seconds from the call until its last byte arrived and the stream ended;
  // the server's status (or INTERNAL when the byte count differs) on error.
  absl::StatusOr<double> Stream(uint64_t bytes, uint32_t message_bytes);

 private:
  std::unique_ptr<triax::bench::v1::StreamProbe::Stub> stub_;
};

}  // namespace triax::bench
