// A daemon's operator HTTP endpoints read from a test or a bench: one
// request per connection to 127.0.0.1:<port> (plain HTTP), the Prometheus
// text of /metrics parsed into series, and the port a daemon wrote to its
// --http_port_file.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace triax::testing {

struct HttpReply {
  int status = 0;
  std::string body;
  std::string allow;  // the Allow header
};

// Sends `raw` (a whole request) on a fresh connection and parses one
// response; UNAVAILABLE with the socket's error text.
absl::StatusOr<HttpReply> HttpExchange(int port, const std::string& raw);
// GET `path` with "Connection: close".
absl::StatusOr<HttpReply> HttpGet(int port, const std::string& path);

// series (name{labels} as printed) -> value; comments and lines without a
// number are skipped.
using Scrape = std::map<std::string, double>;
Scrape ParseScrape(const std::string& text);
// Sum of the series of `name` whose labels contain every one of `has`
// (each as printed: tenant="acme").
double SumSeries(const Scrape& s, const std::string& name,
                 const std::vector<std::string>& has = {});

// The decimal port in the file (a daemon's --http_port_file); 0 when the
// file is missing or holds no number.
int PortFromFile(const std::string& path);

}  // namespace triax::testing
