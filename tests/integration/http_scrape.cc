#include "tests/integration/http_scrape.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fstream>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace triax::testing {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

}  // namespace

absl::StatusOr<HttpReply> HttpExchange(int port, const std::string& raw) {
  asio::io_context ctx;
  beast::tcp_stream stream(ctx);
  beast::error_code ec;
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                               static_cast<uint16_t>(port)),
                 ec);
  if (ec) return absl::UnavailableError(ec.message());
  asio::write(stream, asio::buffer(raw), ec);
  if (ec) return absl::UnavailableError(ec.message());
  beast::flat_buffer buffer;
  http::response<http::string_body> res;
  http::read(stream, buffer, res, ec);
  if (ec) return absl::UnavailableError(ec.message());
  return HttpReply{static_cast<int>(res.result_int()), res.body(),
                   std::string(res[http::field::allow])};
}

absl::StatusOr<HttpReply> HttpGet(int port, const std::string& path) {
  return HttpExchange(port, absl::StrCat("GET ", path,
                                         " HTTP/1.1\r\nHost: t\r\n"
                                         "Connection: close\r\n\r\n"));
}

Scrape ParseScrape(const std::string& text) {
  Scrape out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (space == absl::string_view::npos ||
        !absl::SimpleAtod(line.substr(space + 1), &v)) {
      continue;
    }
    out[std::string(line.substr(0, space))] = v;
  }
  return out;
}

double SumSeries(const Scrape& s, const std::string& name,
                 const std::vector<std::string>& has) {
  double total = 0;
  for (const auto& [series, v] : s) {
    if (series != name && !absl::StartsWith(series, name + "{")) continue;
    bool ok = true;
    for (const std::string& h : has) ok &= absl::StrContains(series, h);
    if (ok) total += v;
  }
  return total;
}

int PortFromFile(const std::string& path) {
  std::ifstream f(path);
  const std::string text{std::istreambuf_iterator<char>(f), {}};
  int port = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port)) return 0;
  return port;
}

}  // namespace triax::testing
