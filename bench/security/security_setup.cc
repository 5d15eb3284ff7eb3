#include "bench/security/security_setup.h"

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/bearer.h"
#include "common/tls.h"

namespace triax::bench {

namespace v1 = triax::v1;

absl::StatusOr<std::vector<SecurityConfig>> ParseSecurityList(
    absl::string_view list, absl::string_view flag) {
  auto bad = [&](absl::string_view entry, absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", list, ": \"", entry, "\" ", why,
                     " (configurations are plain, or tls / mtls, local and "
                     "token joined with '+', e.g. plain,tls,mtls+token)"));
  };
  std::vector<SecurityConfig> configs;
  std::set<std::tuple<TlsMode, bool, bool>> seen;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    SecurityConfig c;
    c.name = std::string(entry);
    std::set<std::string> parts;
    for (absl::string_view part : absl::StrSplit(entry, '+')) {
      if (!parts.insert(std::string(part)).second) {
        return bad(entry, absl::StrCat("names \"", part, "\" twice"));
      }
      if (part == "plain") {
        continue;
      } else if (part == "tls" || part == "mtls") {
        if (c.tls != TlsMode::kOff) return bad(entry, "names tls twice");
        c.tls = part == "tls" ? TlsMode::kServer : TlsMode::kMutual;
      } else if (part == "token") {
        c.tokens = true;
      } else if (part == "local") {
        c.local = true;
      } else {
        return bad(entry, absl::StrCat("has the unknown part \"", part, "\""));
      }
    }
    if (parts.count("plain") > 0 && parts.size() > 1) {
      return bad(entry, "joins plain with another part");
    }
    if (!seen.insert({c.tls, c.tokens, c.local}).second) {
      return bad(entry, "is listed twice");
    }
    configs.push_back(std::move(c));
  }
  return configs;
}

bool AnyTls(const std::vector<SecurityConfig>& configs) {
  return std::any_of(configs.begin(), configs.end(),
                     [](const auto& c) { return c.tls != TlsMode::kOff; });
}

std::string LocalSocket(const std::string& dir, absl::string_view name) {
  return absl::StrCat("unix:", dir, "/", name, ".sock");
}

std::string CertFiles::cert(absl::string_view who) const {
  return absl::StrCat(dir, "/", who, ".crt");
}
std::string CertFiles::key(absl::string_view who) const {
  return absl::StrCat(dir, "/", who, ".key");
}

absl::StatusOr<CertFiles> PrepareCerts(const std::string& dir,
                                       const std::string& make_certs,
                                       absl::string_view make_certs_flag) {
  CertFiles files{dir};
  if (access(files.ca().c_str(), R_OK) == 0) return files;
  if (access(make_certs.c_str(), R_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        make_certs_flag, "=", make_certs,
        ": cannot be read (tests/tls/make_certs.sh of the source tree makes "
        "the certificates)"));
  }
  auto quote = [](const std::string& s) {
    return "'" + absl::StrReplaceAll(s, {{"'", "'\\''"}}) + "'";
  };
  const std::string command =
      absl::StrCat("bash ", quote(make_certs), " ", quote(dir), " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    return absl::InternalError(absl::StrCat("cannot run ", command));
  }
  std::string output;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0 || access(files.ca().c_str(), R_OK) != 0) {
    return absl::InternalError(absl::StrCat(
        make_certs_flag, "=", make_certs, " ", dir, " failed (status ",
        WIFEXITED(status) ? WEXITSTATUS(status) : -1, "): ", output));
  }
  return files;
}

std::vector<std::string> ManagerSecurityFlags(
    const SecurityConfig& config, const CertFiles& certs,
    const std::string& admin_token_file) {
  std::vector<std::string> flags;
  if (config.tls != TlsMode::kOff) {
    flags = {"--tls_cert=" + certs.cert("manager"),
             "--tls_key=" + certs.key("manager"), "--tls_ca=" + certs.ca()};
    if (config.tls == TlsMode::kMutual) {
      flags.emplace_back("--tls_require_client_cert");
    }
  }
  if (config.tokens) {
    flags.emplace_back("--auth=token");
    flags.push_back("--admin_token_file=" + admin_token_file);
  }
  return flags;
}

std::vector<std::string> WorkerSecurityFlags(const SecurityConfig& config,
                                             const CertFiles& certs,
                                             const std::string& token_file) {
  std::vector<std::string> flags;
  if (config.tls != TlsMode::kOff) {
    flags = {"--tls_cert=" + certs.cert("worker"),
             "--tls_key=" + certs.key("worker"), "--tls_ca=" + certs.ca()};
    if (config.tls == TlsMode::kMutual) {
      flags.emplace_back("--tls_require_client_cert");
    }
  }
  if (config.tokens) flags.push_back("--token_file=" + token_file);
  return flags;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CredentialsFor(
    const SecurityConfig& config, const CertFiles& certs, Peer peer) {
  if (config.tls == TlsMode::kOff) return grpc::InsecureChannelCredentials();
  TlsOptions options;
  options.ca_file = certs.ca();
  if (peer == Peer::kWorker) {
    options.cert_file = certs.cert("worker");
    options.key_file = certs.key("worker");
  } else if (config.tls == TlsMode::kMutual) {
    options.cert_file = certs.cert("client");
    options.key_file = certs.key("client");
  }
  absl::StatusOr<TlsConfig> tls = LoadTls(options);
  if (!tls.ok()) return tls.status();
  return ChannelCredentials(*tls);
}

absl::StatusOr<std::string> IssueToken(v1::Manager::Stub* manager,
                                       const std::string& admin_token,
                                       const std::string& role,
                                       const std::string& tenant_id) {
  v1::IssueTokenRequest req;
  req.set_role(role);
  req.set_tenant_id(tenant_id);
  req.set_description("bench");
  v1::IssueTokenResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  AddBearer(&ctx, admin_token);
  const grpc::Status s = manager->IssueToken(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("IssueToken: ", s.error_message()));
  }
  return resp.token();
}

absl::Status WriteTokenFile(const std::string& path, const std::string& token) {
  {
    std::ofstream out(path, std::ios::trunc);
    out << token << "\n";
    if (!out) {
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
  }
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::InternalError(absl::StrCat("cannot chmod 600 ", path));
  }
  return absl::OkStatus();
}

double Quantile(std::vector<double>* v, double p) {
  if (v->empty()) return 0;
  std::sort(v->begin(), v->end());
  const size_t i = std::min(v->size() - 1, static_cast<size_t>(p * v->size()));
  return (*v)[i];
}

CostReport::CostReport(std::vector<SecurityConfig> configs,
                       std::vector<std::string> levels)
    : configs_(std::move(configs)),
      levels_(std::move(levels)),
      runs_(levels_.size(),
            std::vector<std::vector<Measurement>>(configs_.size())) {}

void CostReport::Add(size_t level, size_t config, Measurement m) {
  runs_.at(level).at(config).push_back(std::move(m));
}

CostReport::Pooled CostReport::Pool(size_t level, size_t config) const {
  Pooled p;
  std::vector<double> latency;
  for (const Measurement& m : runs_[level][config]) {
    p.ops += m.ops;
    p.errors += m.errors;
    p.seconds += m.seconds;
    p.server_cpu_s += m.server_cpu_s;
    p.client_cpu_s += m.client_cpu_s;
    latency.insert(latency.end(), m.latency_ms.begin(), m.latency_ms.end());
  }
  p.p50 = Quantile(&latency, 0.5);
  p.p99 = Quantile(&latency, 0.99);
  return p;
}

uint64_t CostReport::errors() const {
  uint64_t n = 0;
  for (const auto& level : runs_) {
    for (const auto& config : level) {
      for (const Measurement& m : config) n += m.errors;
    }
  }
  return n;
}

namespace {

double Rate(const Measurement& m) {
  return m.seconds > 0 ? m.ops / m.seconds : 0;
}
// CPU microseconds per call.
double PerOp(double cpu_s, uint64_t ops) {
  return ops > 0 ? cpu_s * 1e6 / ops : 0;
}
double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

}  // namespace

std::string CostReport::Markdown(absl::string_view level_header,
                                 absl::string_view ops,
                                 absl::string_view server) const {
  const std::string& base = configs_.front().name;
  std::string out = absl::StrFormat(
      "| %s | security | %s/s | vs %s | median (range) | p50 ms | p99 ms | "
      "p50 vs %s | %s CPU us/op | vs %s | client CPU us/op | vs %s | errors "
      "|\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
      level_header, ops, base, base, server, base, base);
  for (size_t l = 0; l < levels_.size(); ++l) {
    const Pooled first = Pool(l, 0);
    for (size_t c = 0; c < configs_.size(); ++c) {
      const Pooled p = Pool(l, c);
      std::vector<double> ratios;
      const auto& runs = runs_[l][c];
      const auto& base_runs = runs_[l][0];
      for (size_t r = 0; r < runs.size() && r < base_runs.size(); ++r) {
        ratios.push_back(Ratio(Rate(runs[r]), Rate(base_runs[r])));
      }
      const double median = Quantile(&ratios, 0.5);
      const double lo = ratios.empty() ? 0 : ratios.front();
      const double hi = ratios.empty() ? 0 : ratios.back();
      const double server_cpu = PerOp(p.server_cpu_s, p.ops);
      const double client_cpu = PerOp(p.client_cpu_s, p.ops);
      absl::StrAppendFormat(
          &out,
          "| %s | %s | %.0f | %.3f | %.3f (%.3f-%.3f) | %.3f | %.3f | %.3f | "
          "%.1f | %.3f | %.1f | %.3f | %llu |\n",
          levels_[l], configs_[c].name, p.rate(), Ratio(p.rate(), first.rate()),
          median, lo, hi, p.p50, p.p99, Ratio(p.p50, first.p50), server_cpu,
          Ratio(server_cpu, PerOp(first.server_cpu_s, first.ops)), client_cpu,
          Ratio(client_cpu, PerOp(first.client_cpu_s, first.ops)),
          static_cast<unsigned long long>(p.errors));
    }
  }
  return out;
}

absl::Status CostReport::WriteTsv(const std::string& path,
                                  absl::string_view bench) const {
  std::ofstream out(path, std::ios::trunc);
  out << "bench\tlevel\tsecurity\trepeat\tops\tseconds\tops_per_s\tp50_ms\t"
         "p99_ms\terrors\tratio\tserver_cpu_us\tclient_cpu_us\t"
         "server_cpu_ratio\n";
  auto row = [&](size_t l, size_t c, const std::string& repeat, uint64_t ops,
                 double seconds, double p50, double p99, uint64_t errors,
                 double ratio, double server_cpu_s, double client_cpu_s,
                 double server_cpu_ratio) {
    out << absl::StrFormat(
        "%s\t%s\t%s\t%s\t%llu\t%.3f\t%.1f\t%.4f\t%.4f\t%llu\t%.4f\t%.2f\t"
        "%.2f\t%.4f\n",
        bench, levels_[l], configs_[c].name, repeat,
        static_cast<unsigned long long>(ops), seconds,
        seconds > 0 ? ops / seconds : 0, p50, p99,
        static_cast<unsigned long long>(errors), ratio,
        PerOp(server_cpu_s, ops), PerOp(client_cpu_s, ops), server_cpu_ratio);
  };
  for (size_t l = 0; l < levels_.size(); ++l) {
    const Pooled first = Pool(l, 0);
    for (size_t c = 0; c < configs_.size(); ++c) {
      const auto& runs = runs_[l][c];
      for (size_t r = 0; r < runs.size(); ++r) {
        const Measurement& m = runs[r];
        const Measurement* b =
            r < runs_[l][0].size() ? &runs_[l][0][r] : nullptr;
        std::vector<double> latency = m.latency_ms;
        row(l, c, absl::StrCat(r + 1), m.ops, m.seconds,
            Quantile(&latency, 0.5), Quantile(&latency, 0.99), m.errors,
            b != nullptr ? Ratio(Rate(m), Rate(*b)) : 0, m.server_cpu_s,
            m.client_cpu_s,
            b != nullptr ? Ratio(PerOp(m.server_cpu_s, m.ops),
                                 PerOp(b->server_cpu_s, b->ops))
                         : 0);
      }
      const Pooled p = Pool(l, c);
      row(l, c, "all", p.ops, p.seconds, p.p50, p.p99, p.errors,
          Ratio(p.rate(), first.rate()), p.server_cpu_s, p.client_cpu_s,
          Ratio(PerOp(p.server_cpu_s, p.ops),
                PerOp(first.server_cpu_s, first.ops)));
    }
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace triax::bench
