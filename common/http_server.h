// A small HTTP/1.1 server for the daemons' operator endpoints (/metrics,
// /healthz, /readyz), on Boost.Beast over Boost.Asio.
//
// Every route answers GET (HEAD and other methods: 405 with "Allow: GET");
// a path without a route is 404. Routes are matched on the path alone; a
// request route (HttpRequestHandler) is handed the query string, a plain
// route ignores it. A request
// whose header is malformed or longer than max_header_bytes, or that
// carries a body, gets 400 naming the parse error, and its connection is
// closed; the server goes on serving the others. Connections are kept
// alive between requests. A connection that does not deliver a whole
// request within read_timeout (a slow-loris client) is closed; all
// connections are served asynchronously on one thread, so a slow client
// never holds another one up. Past max_connections, new connections are
// closed at once.
//
// The listen socket is exclusive (no SO_REUSEPORT, as the gRPC ports): a
// port another process listens on fails Start with UNAVAILABLE naming the
// address.
//
// Thread contract: Start, port and Stop from one owner thread. Handlers run
// on the server's thread, one at a time; they must not block for long (a
// scrape's collection, not I/O).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace triax {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

using HttpHandler = std::function<HttpResponse()>;

// What a request route sees of a request.
struct HttpRequest {
  std::string path;   // the target before any '?'
  std::string query;  // after the '?', as sent (not decoded); "" when none
  std::string authorization;  // the Authorization header; "" when none
};
using HttpRequestHandler = std::function<HttpResponse(const HttpRequest&)>;

// The parameters of a query string ("a=1&b=x%20y"): split on '&', each
// "key=value" or a bare "key" (value ""), '+' and %XX decoded in keys and
// values, empty parts skipped. INVALID_ARGUMENT naming the parameter for a
// malformed %-escape, and for a key given twice.
absl::StatusOr<std::map<std::string, std::string>> ParseQuery(
    absl::string_view query);

struct HttpServerOptions {
  // host:port (IPv4, or [IPv6]); port 0 picks a free port.
  std::string listen;
  // A whole request (request line and headers) must arrive within this.
  absl::Duration read_timeout = absl::Seconds(10);
  absl::Duration write_timeout = absl::Seconds(10);
  size_t max_header_bytes = 8192;
  size_t max_connections = 256;
  // HTTPS (TLS 1.2 or newer) with this PEM certificate chain and key when
  // both are set, else plain HTTP. A client that does not complete the TLS
  // handshake within read_timeout is closed.
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

class HttpServer {
 public:
  // Binds, listens and starts serving `routes` (path -> handler, paths
  // starting with "/"). INVALID_ARGUMENT for a malformed listen address or
  // route, or a TLS certificate or key OpenSSL refuses; UNAVAILABLE naming the
  // address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const HttpServerOptions& options,
      const std::map<std::string, HttpHandler>& routes);
  // The same with request routes beside the plain ones; a path in both is
  // INVALID_ARGUMENT.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const HttpServerOptions& options,
      const std::map<std::string, HttpHandler>& routes,
      std::map<std::string, HttpRequestHandler> request_routes);
  ~HttpServer();  // Stop()

  int port() const;
  // Closes the listener and every connection and joins the thread;
  // idempotent.
  void Stop();

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The answer of a probe (/healthz, /readyz): 200 "ok\n" when `ok`, else 503
// with `reason` and a newline.
HttpResponse ProbeResponse(bool ok, const std::string& reason);

}  // namespace triax
