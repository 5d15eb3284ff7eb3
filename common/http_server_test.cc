#include "common/http_server.h"

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using ::triax::testing::StatusIs;

// Sends `raw` on a fresh connection and returns everything the server
// writes until it closes the connection.
std::string Exchange(int port, const std::string& raw) {
  asio::io_context ctx;
  tcp::socket socket(ctx);
  boost::system::error_code ec;
  socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                               static_cast<uint16_t>(port)),
                 ec);
  if (ec) return "connect: " + ec.message();
  asio::write(socket, asio::buffer(raw), ec);
  std::string out;
  char buf[4096];
  for (;;) {
    const size_t n = socket.read_some(asio::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  return out;
}

std::string Get(int port, const std::string& path) {
  return Exchange(port, absl::StrCat("GET ", path,
                                     " HTTP/1.1\r\nHost: t\r\n"
                                     "Connection: close\r\n\r\n"));
}

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HttpServerOptions options;
    options.listen = "127.0.0.1:0";
    options.read_timeout = absl::Milliseconds(300);
    options.max_header_bytes = 1024;
    auto server = HttpServer::Start(
        options, {{"/metrics",
                   [this] {
                     ++scrapes_;
                     HttpResponse r;
                     r.content_type = "text/plain; version=0.0.4";
                     r.body = "x_total 1\n";
                     return r;
                   }},
                  {"/readyz", [] { return ProbeResponse(false, "not yet"); }},
                  {"/healthz", [] { return ProbeResponse(true, ""); }}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    port_ = server_->port();
    ASSERT_GT(port_, 0);
  }

  std::atomic<int> scrapes_{0};
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
};

TEST_F(HttpServerTest, ServesRoutesAndIgnoresTheQuery) {
  const std::string r = Get(port_, "/metrics?x=1");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain; version=0.0.4\r\n"));
  EXPECT_THAT(r, HasSubstr("\r\n\r\nx_total 1\n"));
  EXPECT_EQ(scrapes_.load(), 1);
  EXPECT_THAT(Get(port_, "/healthz"), HasSubstr("200 OK\r\n"));
  const std::string ready = Get(port_, "/readyz");
  EXPECT_THAT(ready, StartsWith("HTTP/1.1 503 Service Unavailable\r\n"));
  EXPECT_THAT(ready, HasSubstr("\r\n\r\nnot yet\n"));
}

TEST_F(HttpServerTest, UnknownPathIs404) {
  const std::string r = Get(port_, "/nope");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 404 Not Found\r\n"));
  EXPECT_THAT(r, HasSubstr("no such path: /nope"));
  EXPECT_EQ(scrapes_.load(), 0);
}

TEST_F(HttpServerTest, OtherMethodsAre405WithAllow) {
  for (const char* method : {"POST", "HEAD", "DELETE"}) {
    const std::string r =
        Exchange(port_, absl::StrCat(method,
                                     " /metrics HTTP/1.1\r\nHost: t\r\n"
                                     "Connection: close\r\n\r\n"));
    EXPECT_THAT(r, StartsWith("HTTP/1.1 405 Method Not Allowed\r\n")) << method;
    EXPECT_THAT(r, HasSubstr("Allow: GET\r\n")) << method;
  }
  EXPECT_EQ(scrapes_.load(), 0);
}

TEST_F(HttpServerTest, MalformedRequestsAre400AndServingGoesOn) {
  const std::string garbage = Exchange(port_, "GARBAGE\r\n\r\n");
  EXPECT_THAT(garbage, StartsWith("HTTP/1.1 400 Bad Request\r\n"));
  EXPECT_THAT(garbage, HasSubstr("bad request: "));
  // A request line past the header limit (1 KiB here).
  const std::string long_line =
      Exchange(port_, absl::StrCat("GET /", std::string(4000, 'a'),
                                   " HTTP/1.1\r\nHost: t\r\n\r\n"));
  EXPECT_THAT(long_line, StartsWith("HTTP/1.1 400 Bad Request\r\n"));
  EXPECT_THAT(long_line, HasSubstr("header limit exceeded"));
  // A body is refused rather than buffered.
  const std::string body =
      Exchange(port_,
               "GET /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\n"
               "hello");
  EXPECT_THAT(body, StartsWith("HTTP/1.1 400 Bad Request\r\n"));
  EXPECT_THAT(body, HasSubstr("body limit exceeded"));
  EXPECT_EQ(scrapes_.load(), 0);
  EXPECT_THAT(Get(port_, "/metrics"), StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_EQ(scrapes_.load(), 1);
}

TEST_F(HttpServerTest, KeepsConnectionsAlive) {
  asio::io_context ctx;
  beast::tcp_stream stream(ctx);
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                               static_cast<uint16_t>(port_)));
  beast::flat_buffer buffer;
  for (int i = 0; i < 3; ++i) {
    http::request<http::empty_body> req(http::verb::get, "/metrics", 11);
    req.set(http::field::host, "t");
    http::write(stream, req);
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    EXPECT_EQ(res.result_int(), 200);
    EXPECT_EQ(res.body(), "x_total 1\n");
  }
  EXPECT_EQ(scrapes_.load(), 3);
}

TEST_F(HttpServerTest, SlowClientsDoNotBlockScrapesAndAreTimedOut) {
  // Slow-loris: connections that send half a request and stall.
  asio::io_context ctx;
  std::vector<tcp::socket> slow;
  for (int i = 0; i < 8; ++i) {
    slow.emplace_back(ctx);
    slow.back().connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                                      static_cast<uint16_t>(port_)));
    asio::write(slow.back(),
                asio::buffer(std::string("GET /metrics HTTP/1.1\r\nHost")));
  }
  EXPECT_THAT(Get(port_, "/metrics"), StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_EQ(scrapes_.load(), 1);
  // Each stalled connection is closed by the read timeout without an
  // answer (read_some ends with EOF and nothing read).
  for (tcp::socket& s : slow) {
    char buf[64];
    boost::system::error_code ec;
    const size_t n = s.read_some(asio::buffer(buf), ec);
    EXPECT_EQ(n, 0u);
    EXPECT_EQ(ec, asio::error::eof) << ec.message();
  }
  EXPECT_EQ(scrapes_.load(), 1);
}

TEST_F(HttpServerTest, APortInUseFailsStart) {
  HttpServerOptions options;
  options.listen = absl::StrCat("127.0.0.1:", port_);
  auto second = HttpServer::Start(options, {});
  EXPECT_THAT(
      second.status(),
      StatusIs(absl::StatusCode::kUnavailable,
               HasSubstr(absl::StrCat("cannot listen on 127.0.0.1:", port_))));
  // The first server still answers.
  EXPECT_THAT(Get(port_, "/healthz"), HasSubstr("200 OK\r\n"));
}

TEST(HttpServerStartTest, BadListenAddressesAndRoutes) {
  for (const char* listen :
       {"127.0.0.1", "127.0.0.1:70000", "not-an-ip:80", "[::1:80", ":80"}) {
    HttpServerOptions options;
    options.listen = listen;
    EXPECT_THAT(HttpServer::Start(options, {}).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(listen)))
        << listen;
  }
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  EXPECT_THAT(
      HttpServer::Start(options, {{"metrics", [] { return HttpResponse{}; }}})
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"metrics\"")));
}

// HTTPS itself is served to curl in tests/integration/tls_test.cc, with
// certificates openssl makes at run time; here, what Start refuses.
TEST(HttpServerStartTest, BadTlsCertificatesAndKeysAreRefused) {
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  options.tls_cert_pem = "-----BEGIN CERTIFICATE-----\nnot base64\n";
  EXPECT_THAT(HttpServer::Start(options, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs both a certificate and a key")));
  options.tls_key_pem = "not a key";
  EXPECT_THAT(HttpServer::Start(options, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the TLS certificate")));
}

TEST(HttpServerStartTest, RequestRoutesSeeTheQuery) {
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  auto server = HttpServer::Start(
      options, {{"/healthz", [] { return ProbeResponse(true, ""); }}},
      {{"/api/echo", [](const HttpRequest& req) {
          HttpResponse r;
          r.content_type = "application/json";
          r.body = absl::StrCat(req.path, "|", req.query);
          return r;
        }}});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const std::string reply = Get(port, "/api/echo?id=seq-1&top=5");
  EXPECT_THAT(reply, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(reply, HasSubstr("Content-Type: application/json\r\n"));
  EXPECT_THAT(reply, HasSubstr("\r\n\r\n/api/echo|id=seq-1&top=5"));
  EXPECT_THAT(Get(port, "/api/echo"), HasSubstr("\r\n\r\n/api/echo|"));
  EXPECT_THAT(Get(port, "/healthz?x=1"), HasSubstr("200 OK\r\n"));
  EXPECT_THAT(Get(port, "/api/echo/more"), HasSubstr("404 Not Found\r\n"));

  // A path in both maps is refused.
  EXPECT_THAT(HttpServer::Start(
                  options, {{"/a", [] { return HttpResponse{}; }}},
                  {{"/a", [](const HttpRequest&) { return HttpResponse{}; }}})
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"/a\" is given twice")));
}

TEST(ParseQueryTest, DecodesAndRefusesMalformedParameters) {
  auto q = ParseQuery("a=1&b=x%20y+z&flag&&c=%2Fp%3d&empty=");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(*q, (std::map<std::string, std::string>{{"a", "1"},
                                                    {"b", "x y z"},
                                                    {"flag", ""},
                                                    {"c", "/p="},
                                                    {"empty", ""}}));
  EXPECT_TRUE(ParseQuery("")->empty());
  EXPECT_THAT(ParseQuery("id=%zz").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("id=\"%zz\" has a malformed %-escape")));
  EXPECT_THAT(ParseQuery("id=abc%4").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("id=")));
  EXPECT_THAT(ParseQuery("k%g1=2").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"k%g1\" has a malformed %-escape")));
  EXPECT_THAT(ParseQuery("top=1&top=2").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("top is given twice")));
}

TEST(HttpServerStartTest, StopClosesThePort) {
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  auto server = HttpServer::Start(options, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  (*server)->Stop();
  (*server)->Stop();  // idempotent
  options.listen = absl::StrCat("127.0.0.1:", port);
  auto again = HttpServer::Start(options, {});
  EXPECT_TRUE(again.ok()) << again.status();
}

}  // namespace
}  // namespace triax
