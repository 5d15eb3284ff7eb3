#include "common/http_server.h"

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace triax {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

absl::StatusOr<tcp::endpoint> ParseListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address \"", listen, "\" is not host:port"));
  }
  absl::string_view host(listen.data(), colon);
  int port = 0;
  if (!absl::SimpleAtoi(absl::string_view(listen).substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address \"", listen, "\" has no port in 0..65535"));
  }
  if (absl::ConsumePrefix(&host, "[") && !absl::ConsumeSuffix(&host, "]")) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address \"", listen, "\" has an unclosed ["));
  }
  if (host == "localhost") host = "127.0.0.1";
  boost::system::error_code ec;
  const asio::ip::address address =
      asio::ip::make_address(std::string(host), ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address \"", listen, "\": \"", host,
                     "\" is not an IP address (", ec.message(), ")"));
  }
  return tcp::endpoint(address, static_cast<uint16_t>(port));
}

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options,
       std::map<std::string, HttpRequestHandler> routes)
      : options_(std::move(options)),
        routes_(std::move(routes)),
        acceptor_(ctx_) {}

  // HTTPS from here on; INVALID_ARGUMENT when OpenSSL refuses the PEMs.
  absl::Status UseTls(const std::string& cert_pem, const std::string& key_pem) {
    auto ssl =
        std::make_unique<asio::ssl::context>(asio::ssl::context::tls_server);
    boost::system::error_code ec;
    ssl->set_options(
        asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
            asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 |
            asio::ssl::context::no_tlsv1_1,
        ec);
    if (!ec) {
      ssl->use_certificate_chain(asio::buffer(cert_pem.data(), cert_pem.size()),
                                 ec);
      if (ec) {
        return absl::InvalidArgumentError(
            absl::StrCat("the TLS certificate: ", ec.message()));
      }
    }
    if (!ec) {
      ssl->use_private_key(asio::buffer(key_pem.data(), key_pem.size()),
                           asio::ssl::context::pem, ec);
      if (ec) {
        return absl::InvalidArgumentError(
            absl::StrCat("the TLS key: ", ec.message()));
      }
    }
    if (ec) return absl::InvalidArgumentError(ec.message());
    ssl_ = std::move(ssl);
    return absl::OkStatus();
  }

  absl::Status Listen(const tcp::endpoint& endpoint) {
    boost::system::error_code ec;
    acceptor_.open(endpoint.protocol(), ec);
    // SO_REUSEADDR only lets a restart bind over connections in TIME_WAIT;
    // on Linux it does not let two sockets listen on one port.
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", options_.listen, ": ", ec.message(),
                       " (the port is in use or the host is "
                       "not an address of this machine)"));
    }
    port_ = acceptor_.local_endpoint(ec).port();
    if (ec) return absl::InternalError(ec.message());
    return absl::OkStatus();
  }

  void Run() {
    Accept();
    thread_ = std::thread([this] { ctx_.run(); });
  }

  void Stop() {
    if (!thread_.joinable()) return;
    ctx_.stop();
    thread_.join();
    boost::system::error_code ec;
    acceptor_.close(ec);
  }

  int port() const { return port_; }

  // Builds the answer to one parsed request.
  http::response<http::string_body> Answer(
      const http::request<http::empty_body>& req) const {
    HttpResponse r;
    absl::string_view target(req.target().data(), req.target().size());
    absl::string_view query;
    if (const size_t q = target.find('?'); q != absl::string_view::npos) {
      query = target.substr(q + 1);
      target = target.substr(0, q);
    }
    auto it = routes_.find(std::string(target));
    std::string allow;
    if (it == routes_.end()) {
      r.status = 404;
      r.body = absl::StrCat("no such path: ", target, "\n");
    } else if (req.method() != http::verb::get) {
      r.status = 405;
      r.body = absl::StrCat("method ", std::string(req.method_string()),
                            " is not allowed on ", target, "; use GET\n");
      allow = "GET";
    } else {
      r = it->second(HttpRequest{std::string(target), std::string(query),
                                 std::string(req[http::field::authorization])});
    }
    http::response<http::string_body> res(static_cast<http::status>(r.status),
                                          req.version());
    res.set(http::field::content_type, r.content_type);
    if (!allow.empty()) res.set(http::field::allow, allow);
    res.keep_alive(req.keep_alive());
    res.body() = std::move(r.body);
    res.prepare_payload();
    return res;
  }

  const HttpServerOptions& options() const { return options_; }
  std::atomic<size_t>& connections() { return connections_; }

 private:
  void Accept();

  const HttpServerOptions options_;
  const std::map<std::string, HttpRequestHandler> routes_;
  // Before ctx_: sessions still queued in ctx_ decrement it when ctx_ is
  // destroyed.
  std::atomic<size_t> connections_{0};
  std::unique_ptr<asio::ssl::context> ssl_;  // null: plain HTTP
  asio::io_context ctx_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  int port_ = 0;
};

namespace {

// One connection: read a request (bounded header, no body, read timeout),
// answer it, and read the next while the client keeps the connection alive.
// Stream: beast::tcp_stream (HTTP) or beast::ssl_stream over one (HTTPS).
template <class Stream>
class Session : public std::enable_shared_from_this<Session<Stream>> {
 public:
  template <class... Args>
  Session(HttpServer::Impl* server, Args&&... args)
      : stream_(std::forward<Args>(args)...), server_(server) {
    server_->connections().fetch_add(1);
  }
  ~Session() { server_->connections().fetch_sub(1); }

  // HTTPS: the handshake, bounded by read_timeout like a request, then
  // Read(); a failed handshake closes the connection.
  void Handshake() {
    beast::get_lowest_layer(stream_).expires_after(
        ToChrono(server_->options().read_timeout));
    stream_.async_handshake(
        asio::ssl::stream_base::server,
        [self = this->shared_from_this()](beast::error_code ec) {
          if (ec) {
            self->Close();
          } else {
            self->Read();
          }
        });
  }

  void Read() {
    parser_.emplace();
    parser_->header_limit(
        static_cast<uint32_t>(server_->options().max_header_bytes));
    // Probes and scrapes carry no body; a body is refused, not buffered.
    parser_->body_limit(0);
    beast::get_lowest_layer(stream_).expires_after(
        ToChrono(server_->options().read_timeout));
    http::async_read(stream_, buffer_, *parser_,
                     [self = this->shared_from_this()](
                         beast::error_code ec, size_t) { self->OnRead(ec); });
  }

 private:
  void OnRead(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
        ec == asio::error::operation_aborted ||
        ec == asio::error::connection_reset || ec == asio::error::eof ||
        ec == asio::ssl::error::stream_truncated) {
      Close();
      return;
    }
    if (ec) {
      // A malformed or oversized request: say why, then close, since the
      // rest of the stream cannot be framed.
      http::response<http::string_body> res(http::status::bad_request, 11);
      res.set(http::field::content_type, "text/plain; charset=utf-8");
      res.body() = absl::StrCat("bad request: ", ec.message(), "\n");
      res.keep_alive(false);
      res.prepare_payload();
      Write(std::move(res));
      return;
    }
    Write(server_->Answer(parser_->get()));
  }

  void Write(http::response<http::string_body> res) {
    response_ =
        std::make_unique<http::response<http::string_body>>(std::move(res));
    beast::get_lowest_layer(stream_).expires_after(
        ToChrono(server_->options().write_timeout));
    http::async_write(
        stream_, *response_,
        [self = this->shared_from_this()](beast::error_code ec, size_t) {
          const bool keep = self->response_->keep_alive();
          self->response_.reset();
          if (ec || !keep) {
            self->Close();
          } else {
            self->Read();
          }
        });
  }

  // Over TLS without a close_notify: the answer is framed by
  // Content-Length, and a peer that waits for the alert must not hold
  // the server's only thread.
  void Close() {
    beast::error_code ec;
    tcp::socket& socket = beast::get_lowest_layer(stream_).socket();
    socket.shutdown(tcp::socket::shutdown_send, ec);
    socket.close(ec);
  }

  Stream stream_;
  HttpServer::Impl* server_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::empty_body>> parser_;
  std::unique_ptr<http::response<http::string_body>> response_;
};

}  // namespace

void HttpServer::Impl::Accept() {
  acceptor_.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) {
      if (connections_.load() >= options_.max_connections) {
        beast::error_code ignored;
        socket.close(ignored);
      } else if (ssl_ != nullptr) {
        std::make_shared<Session<beast::ssl_stream<beast::tcp_stream>>>(
            this, std::move(socket), *ssl_)
            ->Handshake();
      } else {
        std::make_shared<Session<beast::tcp_stream>>(this, std::move(socket))
            ->Read();
      }
    }
    Accept();
  });
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const HttpServerOptions& options,
    const std::map<std::string, HttpHandler>& routes) {
  return Start(options, routes, {});
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const HttpServerOptions& options,
    const std::map<std::string, HttpHandler>& routes,
    std::map<std::string, HttpRequestHandler> request_routes) {
  for (const auto& [path, handler] : routes) {
    if (handler == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "route \"", path, "\" must start with / and have a handler"));
    }
    if (request_routes.count(path) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("route \"", path, "\" is given twice"));
    }
    request_routes[path] = [h = handler](const HttpRequest&) { return h(); };
  }
  for (const auto& [path, handler] : request_routes) {
    if (path.empty() || path[0] != '/' || handler == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "route \"", path, "\" must start with / and have a handler"));
    }
  }
  auto endpoint = ParseListen(options.listen);
  if (!endpoint.ok()) return endpoint.status();
  auto impl = std::make_unique<Impl>(options, std::move(request_routes));
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "HTTPS needs both a certificate and a key (one is empty)");
  }
  if (!options.tls_cert_pem.empty()) {
    if (absl::Status s =
            impl->UseTls(options.tls_cert_pem, options.tls_key_pem);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = impl->Listen(*endpoint); !s.ok()) return s;
  impl->Run();
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::port() const { return impl_->port(); }

void HttpServer::Stop() { impl_->Stop(); }

namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// '+' -> ' ' and %XX -> the byte; false for a malformed escape.
bool Unescape(absl::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '+') {
      out->push_back(' ');
    } else if (in[i] != '%') {
      out->push_back(in[i]);
    } else {
      if (i + 2 >= in.size()) return false;
      const int hi = HexValue(in[i + 1]);
      const int lo = HexValue(in[i + 2]);
      if (hi < 0 || lo < 0) return false;
      out->push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseQuery(
    absl::string_view query) {
  std::map<std::string, std::string> out;
  for (absl::string_view part : absl::StrSplit(query, '&')) {
    if (part.empty()) continue;
    const size_t eq = part.find('=');
    const absl::string_view raw_key = part.substr(0, eq);
    const absl::string_view raw_value = eq == absl::string_view::npos
                                            ? absl::string_view()
                                            : part.substr(eq + 1);
    std::string key, value;
    if (!Unescape(raw_key, &key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "query parameter \"", raw_key, "\" has a malformed %-escape"));
    }
    if (!Unescape(raw_value, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("query parameter ", key, "=\"", raw_value,
                       "\" has a malformed %-escape"));
    }
    if (!out.emplace(key, std::move(value)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("query parameter ", key, " is given twice"));
    }
  }
  return out;
}

HttpResponse ProbeResponse(bool ok, const std::string& reason) {
  HttpResponse r;
  r.status = ok ? 200 : 503;
  r.body = ok ? "ok\n" : absl::StrCat(reason, "\n");
  return r;
}

}  // namespace triax
