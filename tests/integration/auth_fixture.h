// The fixture of the identity tests (auth_test, isolation_test): a
// kvmanager with --auth=token on loopback, tokens issued through kvctl,
// kvworkers started with worker tokens, clients per tenant.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "client/kv_client.h"
#include "common/bearer.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "tests/integration/process.h"
#include "triax/v1/manager.grpc.pb.h"

namespace triax::testing {

class AuthTest : public ::testing::Test {
 protected:
  virtual std::vector<std::string> ExtraManagerFlags() const { return {}; }

  void SetUp() override {
    ClusterOptions o;
    o.num_workers = 0;  // workers need tokens: started by the test
    o.manager_flags = {"--auth=token", "--admin_token_file=$DIR/admin.token"};
    for (const std::string& f : ExtraManagerFlags())
      o.manager_flags.push_back(f);
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    admin_file_ = cluster_->dir() + "/admin.token";
    auto admin = ReadBearerToken("admin_token_file", admin_file_);
    ASSERT_THAT(admin, IsOk());
    admin_ = *admin;
    stub_ = v1::Manager::NewStub(grpc::CreateChannel(
        cluster_->manager_address(), grpc::InsecureChannelCredentials()));
  }

  // kvctl against the manager with the token in `token_file` ("" none).
  int Kvctl(std::vector<std::string> args, const std::string& token_file) {
    args.insert(args.begin(), "--manager=" + cluster_->manager_address());
    if (!token_file.empty()) args.push_back("--token_file=" + token_file);
    auto rc = RunToCompletion("kvctl", args, cluster_->dir(), &out_, &err_);
    EXPECT_THAT(rc, IsOk());
    return rc.ok() ? *rc : -1;
  }

  // Issues a token through kvctl as admin and keeps it in a 0600 file.
  std::string Issue(const std::string& role, const std::string& tenant,
                    const std::string& file,
                    std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"token-issue", role};
    if (!tenant.empty()) args.push_back(tenant);
    args.insert(args.end(), extra.begin(), extra.end());
    EXPECT_EQ(Kvctl(args, admin_file_), 0) << err_;
    const std::string token(absl::StripAsciiWhitespace(out_));
    const std::string path = cluster_->dir() + "/" + file;
    std::ofstream(path) << token << "\n";
    chmod(path.c_str(), 0600);
    return token;
  }

  grpc::Status Call(
      const std::string& token,
      const std::function<grpc::Status(grpc::ClientContext*)>& call) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    AddBearer(&ctx, token);
    return call(&ctx);
  }

  grpc::Status CreateTenant(const std::string& token, const std::string& id) {
    v1::CreateTenantRequest req;
    req.set_tenant_id(id);
    v1::CreateTenantResponse resp;
    return Call(token, [&](grpc::ClientContext* ctx) {
      return stub_->CreateTenant(ctx, req, &resp);
    });
  }

  std::vector<std::string> TenantIds(const std::string& token) {
    v1::ListTenantsResponse resp;
    grpc::Status s = Call(token, [&](grpc::ClientContext* ctx) {
      return stub_->ListTenants(ctx, {}, &resp);
    });
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    std::vector<std::string> ids;
    for (const auto& t : resp.tenants()) ids.push_back(t.tenant_id());
    return ids;
  }

  std::unique_ptr<client::Client> ClientFor(const std::string& tenant,
                                            const std::string& token) {
    client::ClientOptions o;
    o.manager_address = cluster_->manager_address();
    o.tenant_id = tenant;
    o.token = token;
    o.rpc_timeout_ms = 5000;
    auto c = client::Client::Connect(o);
    EXPECT_THAT(c, IsOk());
    return c.ok() ? std::move(*c) : nullptr;
  }

  // A kvworker with the token in `token_file` ("": none).
  std::unique_ptr<Process> StartWorker(const std::string& id,
                                       const std::string& token_file) {
    std::vector<std::string> args = {"--listen=127.0.0.1:0",
                                     "--manager=" + cluster_->manager_address(),
                                     "--worker_id=" + id, "--pool_mb=16"};
    if (!token_file.empty()) {
      args.push_back("--token_file=" + cluster_->dir() + "/" + token_file);
    }
    auto w = Process::Start(id, "kvworker", args, cluster_->dir());
    EXPECT_THAT(w, IsOk());
    return w.ok() ? std::move(*w) : nullptr;
  }

  std::vector<std::string> WorkerIds() {
    v1::ListWorkersResponse resp;
    grpc::Status s = Call(admin_, [&](grpc::ClientContext* ctx) {
      return stub_->ListWorkers(ctx, {}, &resp);
    });
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    std::vector<std::string> ids;
    for (const auto& w : resp.workers()) ids.push_back(w.worker_id());
    return ids;
  }

  absl::Status WaitForWorker(const std::string& id) {
    return Cluster::WaitFor("worker " + id + " registered", absl::Seconds(10),
                            [&]() -> absl::StatusOr<bool> {
                              for (const std::string& w : WorkerIds()) {
                                if (w == id) return true;
                              }
                              return false;
                            });
  }

  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<v1::Manager::Stub> stub_;
  std::string admin_file_, admin_;
  std::string out_, err_;
};

}  // namespace triax::testing
