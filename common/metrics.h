// Prometheus metrics shared by the daemons: the families of the gRPC
// server's requests (a server interceptor, so that no handler is touched),
// helpers for collectors that build their samples at scrape time, and the
// text exposition of /metrics. Types and exposition are prometheus-cpp's
// core (Registry, Counter, Histogram, TextSerializer).
//
// RPC series (prefix "triaxkv_manager" or "triaxkv_worker"):
//   <prefix>_rpc_requests_total{service,method,code}   counter
//   <prefix>_rpc_duration_seconds{service,method,code} histogram, from the
//     call's start to its status being sent (streams: the whole stream)
// service is the gRPC service ("triax.v1.Manager", "grpc.health.v1.Health"),
// method its method ("OpenSequence"), code the canonical status name ("OK",
// "RESOURCE_EXHAUSTED"). A call the client cancels before the server
// answers sends no status and is not counted.
//
// Thread contract: RpcMetrics is thread-safe; the interceptors record from
// gRPC's threads.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace triax {

class RpcMetrics {
 public:
  explicit RpcMetrics(const std::string& prefix);

  // Counts one finished call and observes its duration.
  void Record(const std::string& service, const std::string& method,
              int grpc_code, absl::Duration elapsed);
  // Calls of `method` (any service) that ended with `grpc_code`.
  uint64_t Requests(const std::string& method, int grpc_code) const;

  // A factory for grpc::ServerBuilder::experimental().
  // SetInterceptorCreators; the interceptors record here.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  InterceptorFactory();

  const prometheus::Registry& registry() const { return registry_; }

 private:
  struct Series {
    prometheus::Counter* requests = nullptr;
    prometheus::Histogram* duration = nullptr;
  };
  prometheus::Registry registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
  mutable absl::Mutex mu_;
  // (service, method, code) -> its series, so a call hashes one short key.
  absl::flat_hash_map<std::pair<std::string, int>, Series> series_
      ABSL_GUARDED_BY(mu_);
};

// Builders for collectors (prometheus::Collectable) that compute their
// samples at scrape time.
prometheus::MetricFamily GaugeFamily(std::string name, std::string help);
prometheus::MetricFamily CounterFamily(std::string name, std::string help);
// Appends one sample (a gauge or counter, by the family's type).
void AddSample(prometheus::MetricFamily* family,
               std::vector<prometheus::ClientMetric::Label> labels,
               double value);

// The text exposition (version 0.0.4) of everything `collectables` hold, as
// the /metrics answer.
HttpResponse MetricsResponse(
    const std::vector<const prometheus::Collectable*>& collectables);

// The handlers of a daemon's operator endpoints.
struct OperatorEndpoints {
  HttpHandler metrics;  // /metrics
  HttpHandler healthz;  // /healthz
  HttpHandler readyz;   // /readyz
  // Further routes that read the query (the manager's dashboard).
  std::map<std::string, HttpRequestHandler> more;
  // HTTPS with this PEM certificate chain and key (the daemon's --tls_cert
  // and --tls_key) when both are set; plain HTTP when both are empty.
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

// Starts the HTTP server of --http_listen=`listen` with the three routes
// and `more`, and writes its port to `port_file` when not empty (as
// --port_file). UNAVAILABLE naming the flag and the address when it cannot bind
// (a port in use), INVALID_ARGUMENT for a malformed address, INTERNAL when the
// port file cannot be written.
absl::StatusOr<std::unique_ptr<HttpServer>> StartOperatorHttp(
    const std::string& listen, const std::string& port_file,
    OperatorEndpoints endpoints);

}  // namespace triax
