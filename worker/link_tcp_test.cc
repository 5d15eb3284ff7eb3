// TCP links (worker/link_tcp.h) on loopback: the rendezvous, bytes in
// order both ways, a stray connection refused, and the watchdog — a wait
// past its deadline or cancelled aborts the link, a peer gone fails the
// other end, nothing waits without a bound — plus malformed ids and hosts.
#include "worker/link_tcp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace triax::worker {
namespace {

using ::testing::HasSubstr;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

struct Pair {
  std::unique_ptr<DeviceLink> zero, one;
};

// Rank 0 on a thread, rank 1 here, as two workers would.
Pair Connect(TcpLinkFactory& f) {
  absl::StatusOr<std::string> id = f.NewLinkId();
  EXPECT_TRUE(id.ok()) << id.status();
  auto zero = std::async(std::launch::async, [&] {
    return f.Connect(*id, 0, In(absl::Seconds(5)), nullptr);
  });
  absl::StatusOr<std::unique_ptr<DeviceLink>> one =
      f.Connect(*id, 1, In(absl::Seconds(5)), nullptr);
  absl::StatusOr<std::unique_ptr<DeviceLink>> z = zero.get();
  EXPECT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(z.ok()) << z.status();
  Pair p;
  if (z.ok()) p.zero = *std::move(z);
  if (one.ok()) p.one = *std::move(one);
  return p;
}

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed);
  return v;
}

TEST(TcpLinkTest, MovesBytesInOrderBothWays) {
  TcpLinkFactory f("127.0.0.1");
  Pair p = Connect(f);
  ASSERT_NE(p.zero, nullptr);
  ASSERT_NE(p.one, nullptr);
  EXPECT_STREQ(p.zero->backend(), "tcp");
  const std::vector<size_t> sizes = {1, 4096, 3 << 20, 777};
  std::vector<std::vector<uint8_t>> sent, got;
  std::vector<uint64_t> recv_tickets, send_tickets;
  for (size_t i = 0; i < sizes.size(); ++i) {
    sent.push_back(Pattern(sizes[i], static_cast<uint8_t>(i)));
    got.emplace_back(sizes[i], 0);
  }
  // All receives posted ahead of the sends; each lands in its own buffer.
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto t = p.zero->PostRecv(got[i].data(), sizes[i], In(absl::Seconds(5)));
    ASSERT_TRUE(t.ok()) << t.status();
    recv_tickets.push_back(*t);
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto t = p.one->PostSend(sent[i].data(), sizes[i], In(absl::Seconds(5)));
    ASSERT_TRUE(t.ok()) << t.status();
    send_tickets.push_back(*t);
  }
  // Waiting for the last covers every earlier one.
  ASSERT_TRUE(
      p.zero->Wait(recv_tickets.back(), In(absl::Seconds(5)), nullptr).ok());
  EXPECT_TRUE(
      p.zero->Wait(recv_tickets.front(), In(absl::Seconds(5)), nullptr).ok());
  EXPECT_TRUE(
      p.one->Wait(send_tickets.back(), In(absl::Seconds(5)), nullptr).ok());
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(got[i], sent[i]) << i;
  // The other way on the same link.
  std::vector<uint8_t> back(1000, 0);
  const std::vector<uint8_t> reply = Pattern(1000, 9);
  auto r = p.one->PostRecv(back.data(), back.size(), In(absl::Seconds(5)));
  auto s = p.zero->PostSend(reply.data(), reply.size(), In(absl::Seconds(5)));
  ASSERT_TRUE(r.ok() && s.ok());
  ASSERT_TRUE(p.one->Wait(*r, In(absl::Seconds(5)), nullptr).ok());
  EXPECT_EQ(back, reply);
}

TEST(TcpLinkTest, WaitPastItsDeadlineAbortsTheLinkAndThePeerSeesIt) {
  TcpLinkFactory f("127.0.0.1");
  Pair p = Connect(f);
  ASSERT_NE(p.zero, nullptr);
  std::vector<uint8_t> buf(64);
  // No send matches: the wait ends at its deadline, the link aborted.
  auto t = p.zero->PostRecv(buf.data(), buf.size(), In(absl::Seconds(5)));
  ASSERT_TRUE(t.ok());
  const absl::Time start = absl::Now();
  const absl::Status s = p.zero->Wait(*t, In(absl::Milliseconds(200)), nullptr);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("the link is aborted"));
  EXPECT_GE(took, absl::Milliseconds(190));
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_TRUE(p.zero->aborted());
  EXPECT_EQ(
      p.zero->PostRecv(buf.data(), 8, In(absl::Seconds(1))).status().code(),
      absl::StatusCode::kUnavailable);
  // The peer's next receive fails at once: the connection is shut down.
  auto r = p.one->PostRecv(buf.data(), buf.size(), In(absl::Seconds(5)));
  ASSERT_TRUE(r.ok());
  const absl::Status peer = p.one->Wait(*r, In(absl::Seconds(5)), nullptr);
  EXPECT_EQ(peer.code(), absl::StatusCode::kUnavailable) << peer;
  EXPECT_THAT(peer.message(), HasSubstr("the peer closed the link"));
}

TEST(TcpLinkTest, CancelledWaitAbortsTheLink) {
  TcpLinkFactory f("127.0.0.1");
  Pair p = Connect(f);
  ASSERT_NE(p.zero, nullptr);
  std::vector<uint8_t> buf(64);
  auto t = p.zero->PostRecv(buf.data(), buf.size(), In(absl::Seconds(5)));
  ASSERT_TRUE(t.ok());
  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(50));
    cancel = true;
  });
  const absl::Status s =
      p.zero->Wait(*t, In(absl::Seconds(10)), [&] { return cancel.load(); });
  canceller.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_TRUE(p.zero->aborted());
}

TEST(TcpLinkTest, PeerDestroyedFailsTheOtherEnd) {
  TcpLinkFactory f("127.0.0.1");
  Pair p = Connect(f);
  ASSERT_NE(p.zero, nullptr);
  std::vector<uint8_t> buf(1 << 20);
  auto t = p.zero->PostRecv(buf.data(), buf.size(), In(absl::Seconds(5)));
  ASSERT_TRUE(t.ok());
  p.one.reset();  // a worker that goes away
  const absl::Status s = p.zero->Wait(*t, In(absl::Seconds(5)), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST(TcpLinkTest, StrayConnectionCannotTakeTheLink) {
  TcpLinkFactory f("127.0.0.1");
  absl::StatusOr<std::string> id = f.NewLinkId();
  ASSERT_TRUE(id.ok());
  std::vector<std::string> parts = absl::StrSplit(*id, ' ');
  ASSERT_EQ(parts.size(), 4u);
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(parts[2], &port));
  auto zero = std::async(std::launch::async, [&] {
    return f.Connect(*id, 0, In(absl::Seconds(5)), nullptr);
  });
  // A client that connects and sends a wrong token.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string wrong(16, 'x');
  ASSERT_EQ(::write(fd, wrong.data(), wrong.size()), 16);
  // The real rank 1 still gets the link.
  absl::StatusOr<std::unique_ptr<DeviceLink>> one =
      f.Connect(*id, 1, In(absl::Seconds(5)), nullptr);
  ASSERT_TRUE(one.ok()) << one.status();
  absl::StatusOr<std::unique_ptr<DeviceLink>> z = zero.get();
  ASSERT_TRUE(z.ok()) << z.status();
  std::vector<uint8_t> got(4), sent = {1, 2, 3, 4};
  auto r = (*z)->PostRecv(got.data(), 4, In(absl::Seconds(5)));
  auto s = (*one)->PostSend(sent.data(), 4, In(absl::Seconds(5)));
  ASSERT_TRUE(r.ok() && s.ok());
  ASSERT_TRUE((*z)->Wait(*r, In(absl::Seconds(5)), nullptr).ok());
  EXPECT_EQ(got, sent);
  ::close(fd);
}

TEST(TcpLinkTest, RankZeroWithoutAPeerEndsAtItsDeadline) {
  TcpLinkFactory f("127.0.0.1");
  absl::StatusOr<std::string> id = f.NewLinkId();
  ASSERT_TRUE(id.ok());
  const absl::Time start = absl::Now();
  auto z = f.Connect(*id, 0, In(absl::Milliseconds(150)), nullptr);
  EXPECT_EQ(z.status().code(), absl::StatusCode::kDeadlineExceeded)
      << z.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // The listener was claimed: the id cannot be joined as rank 0 again.
  EXPECT_EQ(
      f.Connect(*id, 0, In(absl::Milliseconds(50)), nullptr).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(TcpLinkTest, BadIdsRanksAndHostsAreRefused) {
  TcpLinkFactory f("127.0.0.1");
  for (const char* id :
       {"", "tcp", "tcp 127.0.0.1 0 00112233445566778899aabbccddeeff",
        "udp 127.0.0.1 9 00112233445566778899aabbccddeeff",
        "tcp 127.0.0.1 9 0011",
        "tcp 127.0.0.1 9 zz112233445566778899aabbccddeeff"}) {
    const absl::Status s =
        f.Connect(id, 1, In(absl::Milliseconds(100)), nullptr).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << id << ": " << s;
  }
  EXPECT_THAT(f.Connect("tcp 127.0.0.1 9 00112233445566778899aabbccddeeff", 2,
                        In(absl::Milliseconds(100)), nullptr)
                  .status()
                  .message(),
              HasSubstr("rank 2"));
  // Rank 0 of an id this factory did not make.
  EXPECT_THAT(f.Connect("tcp 127.0.0.1 9 00112233445566778899aabbccddeeff", 0,
                        In(absl::Milliseconds(100)), nullptr)
                  .status()
                  .message(),
              HasSubstr("names no listener"));
  EXPECT_EQ(TcpLinkFactory::CheckHost("0.0.0.0").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TcpLinkFactory::CheckHost("localhost").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TcpLinkFactory::CheckHost("127.0.0.1").ok());
  EXPECT_TRUE(TcpLinkFactory::CheckHost("::1").ok());
  // Nobody listens any more: connecting fails (refused), never hangs.
  absl::StatusOr<std::string> id;
  {
    TcpLinkFactory other("127.0.0.1");
    id = other.NewLinkId();
    ASSERT_TRUE(id.ok());
  }
  EXPECT_EQ(f.Connect(*id, 1, In(absl::Seconds(5)), nullptr).status().code(),
            absl::StatusCode::kUnavailable);
  // Operation argument checks on a live link.
  Pair p = Connect(f);
  ASSERT_NE(p.zero, nullptr);
  uint8_t b = 0;
  EXPECT_EQ(p.zero->PostSend(&b, 0, In(absl::Seconds(1))).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.zero->Wait(7, In(absl::Seconds(1)), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace triax::worker
