#include "common/metrics.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <string>

#include "common/health_check.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A service for the server to poll with (the health service alone does not
// start a gRPC server): every call ends UNIMPLEMENTED.
class NoMethods : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext*) override {
    class Reactor : public grpc::ServerGenericBidiReactor {
     public:
      Reactor() { Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "")); }
      void OnDone() override { delete this; }
    };
    return new Reactor;
  }
};

// The RPC series of a real gRPC server (its health service) through the
// interceptor, as /metrics prints them.
TEST(RpcMetricsTest, CountsCallsByMethodAndCode) {
  RpcMetrics metrics("triaxkv_test");
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      creators;
  creators.push_back(metrics.InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(creators));
  NoMethods no_methods;
  builder.RegisterCallbackGenericService(&no_methods);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  ASSERT_TRUE(CheckHealth(channel, "").ok());
  ASSERT_TRUE(CheckHealth(channel, "").ok());
  EXPECT_EQ(CheckHealth(channel, "no.such.Service").status().code(),
            absl::StatusCode::kNotFound);
  server->Shutdown();

  EXPECT_EQ(metrics.Requests("Check", 0), 2u);
  EXPECT_EQ(metrics.Requests("Check", 5), 1u);
  EXPECT_EQ(metrics.Requests("Watch", 0), 0u);
  const std::string text = MetricsResponse({&metrics.registry()}).body;
  EXPECT_THAT(text,
              HasSubstr("# TYPE triaxkv_test_rpc_requests_total counter"));
  EXPECT_THAT(text, HasSubstr("triaxkv_test_rpc_requests_total{code=\"OK\","
                              "method=\"Check\",service=\"grpc.health.v1."
                              "Health\"} 2"));
  EXPECT_THAT(text, HasSubstr("triaxkv_test_rpc_requests_total{code=\"NOT_"
                              "FOUND\",method=\"Check\",service=\"grpc."
                              "health.v1.Health\"} 1"));
  EXPECT_THAT(text,
              HasSubstr("# TYPE triaxkv_test_rpc_duration_seconds histogram"));
  EXPECT_THAT(text, HasSubstr("triaxkv_test_rpc_duration_seconds_count{code="
                              "\"OK\",method=\"Check\",service=\"grpc."
                              "health.v1.Health\"} 2"));
  EXPECT_THAT(text, HasSubstr("le=\"+Inf\""));
}

class FixedCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily g = GaugeFamily("x_bytes", "Bytes of x.");
    AddSample(&g, {{"tier", "device"}}, 42);
    AddSample(&g, {{"tier", "host"}}, 0.5);
    prometheus::MetricFamily c = CounterFamily("x_events_total", "Events.");
    AddSample(&c, {}, 7);
    prometheus::MetricFamily empty = GaugeFamily("x_empty", "Never set.");
    return {g, c, empty};
  }
};

TEST(MetricsResponseTest, SerializesCollectorsAndDropsEmptyFamilies) {
  FixedCollector c;
  const HttpResponse r = MetricsResponse({&c});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_THAT(r.body, HasSubstr("# HELP x_bytes Bytes of x.\n# TYPE x_bytes "
                                "gauge\nx_bytes{tier=\"device\"} 42\n"
                                "x_bytes{tier=\"host\"} 0.5\n"));
  EXPECT_THAT(r.body, HasSubstr("# TYPE x_events_total counter\n"
                                "x_events_total 7\n"));
  EXPECT_THAT(r.body, Not(HasSubstr("x_empty")));
}

}  // namespace
}  // namespace triax
