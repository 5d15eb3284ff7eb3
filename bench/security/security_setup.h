// The security configurations that manager_bench and attend_bench compare
// in one run (docs/security.md; bench/results/manager.md "Security on and
// off", bench/results/attend_security.md): the daemons' flags of each, the
// certificates (tests/tls/make_certs.sh's set), the channel credentials of
// a client and of a worker, the tokens issued through the manager, and the
// table of each configuration's throughput and latency against the first.
//
// A configuration is named by its parts joined with '+':
//   plain   nothing (the default of the daemons)
//   tls     every listener over TLS with --tls_ca (the manager guards
//           RegisterWorker/Heartbeat by certificate name, so the workers'
//           links present the worker certificate); clients verify the
//           server and present none
//   mtls    tls, and --tls_require_client_cert everywhere: clients present
//           client.crt (CN frontend), workers worker.crt (CN kvworker)
//   token   kvmanager --auth=token: every manager call carries a bearer
//           token (tenant tokens for the clients, a worker token for the
//           worker), workers take --token_file and serve only calls that
//           carry the manager's capabilities
//   local   the server also listens on a Unix-domain socket
//           (--local_listen, gRPC local credentials) and the bench's
//           clients, a frontend on the same host, call over it; the
//           manager's links with the workers stay on TCP (with tls / mtls)
// e.g. "plain,tls,mtls,token,mtls+token,mtls+local+token".
// Thread-compatible.
#pragma once

#include <grpcpp/security/credentials.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "triax/v1/manager.grpc.pb.h"

namespace triax::bench {

enum class TlsMode { kOff, kServer, kMutual };

struct SecurityConfig {
  std::string name;  // as listed: "plain", "mtls+token", ...
  TlsMode tls = TlsMode::kOff;
  bool tokens = false;
  bool local = false;  // clients on the server's Unix-domain socket
};

// "plain,tls,mtls+token" -> configurations in that order (the first is the
// baseline of the ratios). INVALID_ARGUMENT naming `flag` and the entry for
// an empty list, an unknown part, "plain" joined with another part, both
// tls and mtls, a part repeated, or a configuration listed twice.
absl::StatusOr<std::vector<SecurityConfig>> ParseSecurityList(
    absl::string_view list, absl::string_view flag);

bool AnyTls(const std::vector<SecurityConfig>& configs);

// The files of tests/tls/make_certs.sh in `dir`.
struct CertFiles {
  std::string dir;
  std::string ca() const { return dir + "/ca.crt"; }
  std::string cert(absl::string_view who) const;  // manager, worker, client
  std::string key(absl::string_view who) const;
};

// `dir` holding make_certs.sh's files: when it has no ca.crt, runs
// `bash make_certs dir` first. INVALID_ARGUMENT naming `make_certs_flag`
// when the script is missing, or the script's exit status and output
// when it fails.
absl::StatusOr<CertFiles> PrepareCerts(const std::string& dir,
                                       const std::string& make_certs,
                                       absl::string_view make_certs_flag);

// The --local_listen address of a server started in `dir` (local
// configurations): "unix:<dir>/<name>.sock".
std::string LocalSocket(const std::string& dir, absl::string_view name);

// kvmanager's flags for `config`; `admin_token_file` is where the manager
// writes its bootstrap admin token (token configurations).
std::vector<std::string> ManagerSecurityFlags(
    const SecurityConfig& config, const CertFiles& certs,
    const std::string& admin_token_file);
// kvworker's flags; `token_file` holds a worker token (token
// configurations).
std::vector<std::string> WorkerSecurityFlags(const SecurityConfig& config,
                                             const CertFiles& certs,
                                             const std::string& token_file);

// Who a channel is from: a frontend (client.crt under mtls, no certificate
// under tls) or a worker (worker.crt whenever TLS is on).
enum class Peer { kClient, kWorker };
// Insecure credentials without TLS; the files' errors (LoadTls) otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CredentialsFor(
    const SecurityConfig& config, const CertFiles& certs, Peer peer);

// Issues a token through the manager (IssueToken under `admin_token`):
// role "tenant" (for `tenant_id`) or "worker". The manager's error,
// prefixed "IssueToken: ".
absl::StatusOr<std::string> IssueToken(triax::v1::Manager::Stub* manager,
                                       const std::string& admin_token,
                                       const std::string& role,
                                       const std::string& tenant_id);
// Writes `token` to `path`, mode 0600 (kvworker --token_file refuses a
// file others may read).
absl::Status WriteTokenFile(const std::string& path, const std::string& token);

// One timed run of one configuration at one level.
struct Measurement {
  uint64_t ops = 0;  // calls that succeeded
  double seconds = 0;
  std::vector<double> latency_ms;  // one per call that succeeded
  uint64_t errors = 0;
  // CPU seconds used during the run by the server process that answers the
  // calls (the manager, the worker) and by the bench process (the clients
  // and their gRPC threads): on a shared machine the CPU a call costs is
  // steadier than its wall time.
  double server_cpu_s = 0;
  double client_cpu_s = 0;
};

// Measurements of every configuration at every level, run `repeats` times
// in turn (level by level; within a repeat, every configuration one after
// the other, so that all see the same machine), and their comparison with
// the first configuration.
class CostReport {
 public:
  CostReport(std::vector<SecurityConfig> configs,
             std::vector<std::string> levels);

  void Add(size_t level, size_t config, Measurement m);

  // One row per level and configuration:
  //   | <level_header> | security | <ops>/s | vs <first> | median (range) |
  //   p50 ms | p99 ms | p50 vs <first> | <server> CPU us/op | vs <first> |
  //   client CPU us/op | vs <first> | errors |
  // "vs" of <ops>/s: pooled throughput (every repeat's calls over their
  // seconds) over the first configuration's; "median (range)": the median,
  // lowest and highest of the ratios of one repeat (against the first
  // configuration's run of the same repeat); p50 and p99 over every call of
  // every repeat; CPU per call pooled over the repeats.
  std::string Markdown(absl::string_view level_header, absl::string_view ops,
                       absl::string_view server) const;

  // Every run as a row, and one pooled row per level and configuration
  // (repeat "all"): bench, level, security, repeat, ops, seconds,
  // ops_per_s, p50_ms, p99_ms, errors, ratio (ops/s over the first
  // configuration's in the same repeat, or pooled), server_cpu_us and
  // client_cpu_us (per call), server_cpu_ratio (over the first
  // configuration's, same repeat or pooled).
  absl::Status WriteTsv(const std::string& path, absl::string_view bench) const;

  uint64_t errors() const;

 private:
  struct Pooled {
    uint64_t ops = 0, errors = 0;
    double seconds = 0, p50 = 0, p99 = 0, server_cpu_s = 0, client_cpu_s = 0;
    double rate() const { return seconds > 0 ? ops / seconds : 0; }
  };
  Pooled Pool(size_t level, size_t config) const;

  std::vector<SecurityConfig> configs_;
  std::vector<std::string> levels_;
  // [level][config][repeat]
  std::vector<std::vector<std::vector<Measurement>>> runs_;
};

// The p-th quantile (0..1) of `v` (sorted in place); 0 when empty.
double Quantile(std::vector<double>* v, double p);

}  // namespace triax::bench
