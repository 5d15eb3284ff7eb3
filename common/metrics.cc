#include "common/metrics.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/port_file.h"
#include "prometheus/text_serializer.h"

namespace triax {
namespace {

// From 100 us (an inventory read) to 30 s (a transfer, a deep reclaim).
const prometheus::Histogram::BucketBoundaries& DurationBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30};
  return *buckets;
}

class RpcInterceptor : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(RpcMetrics* metrics, const char* full_method)
      : metrics_(metrics), start_(absl::Now()) {
    // "/triax.v1.Manager/OpenSequence" -> service, method.
    absl::string_view m = full_method != nullptr ? full_method : "";
    if (absl::StartsWith(m, "/")) m.remove_prefix(1);
    const size_t slash = m.rfind('/');
    if (slash == absl::string_view::npos) {
      method_ = std::string(m);
    } else {
      service_ = std::string(m.substr(0, slash));
      method_ = std::string(m.substr(slash + 1));
    }
  }

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      metrics_->Record(service_, method_, methods->GetSendStatus().error_code(),
                       absl::Now() - start_);
    }
    methods->Proceed();
  }

 private:
  RpcMetrics* const metrics_;
  const absl::Time start_;
  std::string service_;
  std::string method_;
};

class RpcInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcInterceptorFactory(RpcMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(metrics_, info->method());
  }

 private:
  RpcMetrics* const metrics_;
};

}  // namespace

RpcMetrics::RpcMetrics(const std::string& prefix)
    : requests_(prometheus::BuildCounter()
                    .Name(absl::StrCat(prefix, "_rpc_requests_total"))
                    .Help("gRPC calls served, by service, method and status "
                          "code")
                    .Register(registry_)),
      duration_(prometheus::BuildHistogram()
                    .Name(absl::StrCat(prefix, "_rpc_duration_seconds"))
                    .Help("Time from a gRPC call's start to its status, by "
                          "service, method and status code")
                    .Register(registry_)) {}

void RpcMetrics::Record(const std::string& service, const std::string& method,
                        int grpc_code, absl::Duration elapsed) {
  Series series;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = series_.try_emplace(
        std::make_pair(absl::StrCat(service, "/", method), grpc_code));
    if (inserted) {
      const std::map<std::string, std::string> labels = {
          {"service", service},
          {"method", method},
          {"code",
           absl::StatusCodeToString(static_cast<absl::StatusCode>(grpc_code))}};
      it->second.requests = &requests_.Add(labels);
      it->second.duration = &duration_.Add(labels, DurationBuckets());
    }
    series = it->second;
  }
  series.requests->Increment();
  series.duration->Observe(absl::ToDoubleSeconds(elapsed));
}

uint64_t RpcMetrics::Requests(const std::string& method, int grpc_code) const {
  absl::MutexLock lock(&mu_);
  double total = 0;
  const std::string suffix = absl::StrCat("/", method);
  for (const auto& [key, series] : series_) {
    if (key.second == grpc_code && absl::EndsWith(key.first, suffix)) {
      total += series.requests->Value();
    }
  }
  return static_cast<uint64_t>(total);
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
RpcMetrics::InterceptorFactory() {
  return std::make_unique<RpcInterceptorFactory>(this);
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = prometheus::MetricType::Gauge;
  return f;
}

prometheus::MetricFamily CounterFamily(std::string name, std::string help) {
  prometheus::MetricFamily f = GaugeFamily(std::move(name), std::move(help));
  f.type = prometheus::MetricType::Counter;
  return f;
}

void AddSample(prometheus::MetricFamily* family,
               std::vector<prometheus::ClientMetric::Label> labels,
               double value) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (family->type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  family->metric.push_back(std::move(m));
}

HttpResponse MetricsResponse(
    const std::vector<const prometheus::Collectable*>& collectables) {
  std::vector<prometheus::MetricFamily> families;
  for (const prometheus::Collectable* c : collectables) {
    std::vector<prometheus::MetricFamily> f = c->Collect();
    for (prometheus::MetricFamily& one : f) {
      // A family without samples (a label set never seen yet) would print
      // HELP and TYPE lines alone.
      if (!one.metric.empty()) families.push_back(std::move(one));
    }
  }
  HttpResponse r;
  r.content_type = "text/plain; version=0.0.4; charset=utf-8";
  r.body = prometheus::TextSerializer().Serialize(families);
  return r;
}

absl::StatusOr<std::unique_ptr<HttpServer>> StartOperatorHttp(
    const std::string& listen, const std::string& port_file,
    OperatorEndpoints endpoints) {
  HttpServerOptions options;
  options.listen = listen;
  options.tls_cert_pem = std::move(endpoints.tls_cert_pem);
  options.tls_key_pem = std::move(endpoints.tls_key_pem);
  auto server = HttpServer::Start(options,
                                  {{"/metrics", std::move(endpoints.metrics)},
                                   {"/healthz", std::move(endpoints.healthz)},
                                   {"/readyz", std::move(endpoints.readyz)}},
                                  std::move(endpoints.more));
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("--http_listen=", listen, ": ",
                                     server.status().message()));
  }
  if (!port_file.empty()) {
    if (absl::Status s = WritePortFile(port_file, (*server)->port()); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("--http_port_file: ", s.message()));
    }
  }
  return server;
}

}  // namespace triax
