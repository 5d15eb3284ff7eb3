// The --local_listen checks, the socket mode, and a real gRPC server on a
// Unix-domain socket with local credentials dialed through
// ChannelCredentialsFor.
#include "common/local_socket.h"

#include <gmock/gmock.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/health_check.h"
#include "common/status_matchers.h"

namespace triax {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

// A fresh directory under TEST_TMPDIR or /tmp, removed with its files.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern =
        absl::StrCat(base != nullptr ? base : "/tmp", "/triax-sock-XXXXXX");
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() {
    // Only flat files are made here.
    std::string cmd = absl::StrCat("rm -rf '", path_, "'");
    (void)std::system(cmd.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A socket bound (and listening when `listen_too`) at `path`; closed by the
// caller.
int BoundSocket(const std::string& path, bool listen_too) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)),
            0);
  if (listen_too) {
    EXPECT_EQ(listen(fd, 4), 0);
  }
  return fd;
}

TEST(LocalSocketTest, AddressesAndPaths) {
  EXPECT_TRUE(IsUnixAddress("unix:/run/w.sock"));
  EXPECT_FALSE(IsUnixAddress("127.0.0.1:7071"));
  EXPECT_FALSE(IsUnixAddress("dns:///unix:x"));
  EXPECT_EQ(UnixSocketPath("unix:/run/w.sock"), "/run/w.sock");
  EXPECT_EQ(UnixSocketPath("unix:///run/w.sock"), "/run/w.sock");
}

TEST(LocalSocketTest, CheckLocalListenNamesTheFlagAndValue) {
  EXPECT_THAT(CheckLocalListen("local_listen", "127.0.0.1:9"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--local_listen=\"127.0.0.1:9\""),
                             HasSubstr("unix:/ABSOLUTE/PATH"))));
  EXPECT_THAT(CheckLocalListen("local_listen", "unix:w.sock"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("names no absolute path")));
  EXPECT_THAT(CheckLocalListen("local_listen",
                               absl::StrCat("unix:/", std::string(120, 'a'))),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a socket path holds at most 107")));
  EXPECT_THAT(CheckLocalListen("local_listen", "unix:/no/such/dir/w.sock"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("the directory \"/no/such/dir\" does not "
                                 "exist")));
}

TEST(LocalSocketTest, CheckLocalListenRefusesAFileAndALiveSocket) {
  TempDir dir;
  const std::string file = dir.path() + "/plain";
  std::ofstream(file) << "data";
  EXPECT_THAT(CheckLocalListen("local_listen", "unix:" + file),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("exists and is not a socket")));

  const std::string live = dir.path() + "/live.sock";
  const int fd = BoundSocket(live, /*listen_too=*/true);
  EXPECT_THAT(CheckLocalListen("local_listen", "unix:" + live),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("another process serves on")));
  close(fd);
  // Closed: the file stays, stale, and may be taken over.
  EXPECT_THAT(CheckLocalListen("local_listen", "unix:" + live), IsOk());
  EXPECT_THAT(
      CheckLocalListen("local_listen", "unix:" + dir.path() + "/fresh.sock"),
      IsOk());
}

TEST(LocalSocketTest, ParseSocketMode) {
  EXPECT_THAT(ParseSocketMode("local_listen_mode", "0660"), IsOk());
  EXPECT_EQ(*ParseSocketMode("m", "0660"), 0660u);
  EXPECT_EQ(*ParseSocketMode("m", "600"), 0600u);
  EXPECT_EQ(*ParseSocketMode("m", "0777"), 0777u);
  for (const char* bad : {"", "0999", "rw", "07777", "-1", "0x1ff"}) {
    EXPECT_THAT(
        ParseSocketMode("local_listen_mode", bad),
        StatusIs(
            absl::StatusCode::kInvalidArgument,
            AllOf(HasSubstr(absl::StrCat("--local_listen_mode=\"", bad, "\"")),
                  HasSubstr("octal file mode"))))
        << bad;
  }
}

TEST(LocalSocketTest, ServesOverLocalCredentialsWithTheModeSet) {
  TempDir dir;
  const std::string address = absl::StrCat("unix:", dir.path(), "/h.sock");
  ASSERT_THAT(CheckLocalListen("local_listen", address), IsOk());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, LocalSocketServerCredentials());
  grpc::CallbackGenericService generic;  // some service to poll for
  builder.RegisterCallbackGenericService(&generic);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_THAT(RestrictSocket(address, 0600), IsOk());
  struct stat st {};
  ASSERT_EQ(stat(UnixSocketPath(address).c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A second server may not take the live socket.
  EXPECT_THAT(CheckLocalListen("local_listen", address),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("another process serves on")));

  // TLS settings of TCP addresses do not apply to a unix: address.
  auto channel = grpc::CreateChannel(
      address,
      ChannelCredentialsFor(address, grpc::SslCredentials({"not a PEM"})));
  absl::StatusOr<ServingStatus> health =
      CheckHealth(channel, "", absl::Seconds(10));
  ASSERT_THAT(health, IsOk());
  EXPECT_EQ(*health, ServingStatus::kServing);

  server->Shutdown();
  server->Wait();
  RemoveSocket(address);
  EXPECT_NE(lstat(UnixSocketPath(address).c_str(), &st), 0);
}

}  // namespace
}  // namespace triax
