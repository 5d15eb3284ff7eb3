#include "worker/link_tcp.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <deque>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/ids.h"

namespace triax::worker {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

constexpr size_t kTokenBytes = 16;
constexpr absl::Duration kPollSlice = absl::Milliseconds(50);

std::string RandomToken() {
  std::random_device rd;
  std::string token(kTokenBytes, '\0');
  for (char& c : token) c = static_cast<char>(rd() & 0xff);
  return absl::BytesToHexString(token);
}

bool WouldBlock(const boost::system::error_code& ec) {
  return ec == asio::error::would_block || ec == asio::error::try_again ||
         ec == asio::error::in_progress;
}

// Waits up to one poll slice (or until `deadline`) for `events` on `fd`.
// DEADLINE_EXCEEDED / CANCELLED when the wait as a whole is over.
absl::Status PollSlice(int fd, short events, absl::Time deadline,
                       const std::function<bool()>& cancelled,
                       absl::string_view what) {
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat("tcp link: ", what, " cancelled"));
  }
  const absl::Time now = absl::Now();
  if (now >= deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("tcp link: ", what, " did not complete in time"));
  }
  const absl::Duration slice = std::min(kPollSlice, deadline - now);
  pollfd p{fd, events, 0};
  ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(slice)) + 1);
  return absl::OkStatus();
}

// Reads or writes exactly `n` bytes on a non-blocking socket by `deadline`.
absl::Status ExactIo(tcp::socket& socket, bool write, uint8_t* data, size_t n,
                     absl::Time deadline,
                     const std::function<bool()>& cancelled,
                     absl::string_view what) {
  size_t done = 0;
  while (done < n) {
    boost::system::error_code ec;
    const size_t got =
        write ? socket.write_some(asio::buffer(data + done, n - done), ec)
              : socket.read_some(asio::buffer(data + done, n - done), ec);
    done += got;
    if (!ec) continue;
    if (!WouldBlock(ec)) {
      return absl::UnavailableError(
          absl::StrCat("tcp link: ", what, ": ", ec.message()));
    }
    if (absl::Status s =
            PollSlice(socket.native_handle(), write ? POLLOUT : POLLIN,
                      deadline, cancelled, what);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

class TcpLink final : public DeviceLink {
 public:
  TcpLink(std::unique_ptr<asio::io_context> io, tcp::socket socket)
      : io_(std::move(io)), socket_(std::move(socket)) {
    boost::system::error_code ec;
    socket_.non_blocking(false, ec);
    socket_.set_option(tcp::no_delay(true), ec);
    thread_ = std::thread([this] { Run(); });
  }

  ~TcpLink() override {
    Abort("the link was closed");
    thread_.join();
  }

  const char* backend() const override { return "tcp"; }

  // Queuing never waits here: the thread does the I/O.
  absl::StatusOr<uint64_t> PostSend(const uint8_t* src, size_t bytes,
                                    absl::Time) override {
    return Post(Op{true, src, nullptr, bytes});
  }
  absl::StatusOr<uint64_t> PostRecv(uint8_t* dst, size_t bytes,
                                    absl::Time) override {
    return Post(Op{false, nullptr, dst, bytes});
  }

  absl::Status Wait(uint64_t ticket, absl::Time deadline,
                    const std::function<bool()>& cancelled) override {
    absl::MutexLock lock(&mu_);
    if (ticket == 0 || ticket > posted_) {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp link: ticket ", ticket, " was not issued (",
                       posted_, " operations posted)"));
    }
    while (true) {
      if (done_ >= ticket) return absl::OkStatus();
      if (!error_.ok()) return error_;
      if (cancelled && cancelled()) {
        AbortLocked("the transfer was cancelled");
        return absl::CancelledError(
            "tcp link: the transfer was cancelled; the link is aborted");
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        AbortLocked("an operation missed its deadline");
        return absl::DeadlineExceededError(absl::StrCat(
            "tcp link: operation ", ticket,
            " did not complete by its "
            "deadline (",
            done_, " of ", posted_, " done); the link is aborted"));
      }
      cv_.WaitWithTimeout(&mu_, std::min(kPollSlice, deadline - now));
    }
  }

  void Abort(absl::string_view why) override {
    absl::MutexLock lock(&mu_);
    AbortLocked(why);
  }

  bool aborted() const override {
    absl::MutexLock lock(&mu_);
    return stop_;
  }

 private:
  struct Op {
    bool send = false;
    const uint8_t* src = nullptr;
    uint8_t* dst = nullptr;
    size_t bytes = 0;
  };

  absl::StatusOr<uint64_t> Post(const Op& op) {
    if (op.bytes == 0) {
      return absl::InvalidArgumentError("tcp link: an operation of 0 bytes");
    }
    absl::MutexLock lock(&mu_);
    if (!error_.ok()) return error_;
    queue_.push_back(op);
    cv_.SignalAll();
    return ++posted_;
  }

  void AbortLocked(absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stop_) return;
    stop_ = true;
    if (error_.ok()) {
      error_ = absl::UnavailableError(absl::StrCat("tcp link aborted: ", why));
    }
    // Ends a read or write blocked on the socket; the thread closes it.
    ::shutdown(socket_.native_handle(), SHUT_RDWR);
    cv_.SignalAll();
  }

  void Run() {
    while (true) {
      Op op;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](TcpLink* l) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return l->stop_ || !l->queue_.empty();
            },
            this));
        if (stop_) break;
        op = queue_.front();
      }
      boost::system::error_code ec;
      if (op.send) {
        asio::write(socket_, asio::buffer(op.src, op.bytes), ec);
      } else {
        asio::read(socket_, asio::buffer(op.dst, op.bytes), ec);
      }
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      if (ec) {
        if (error_.ok()) {
          error_ = absl::UnavailableError(
              absl::StrCat("tcp link: ", op.send ? "send" : "receive", " of ",
                           op.bytes, " bytes failed: ",
                           ec == asio::error::eof ? "the peer closed the link"
                                                  : ec.message()));
        }
        stop_ = true;
        cv_.SignalAll();
        break;
      }
      ++done_;
      cv_.SignalAll();
    }
    boost::system::error_code ec;
    socket_.close(ec);
  }

  std::unique_ptr<asio::io_context> io_;  // outlives socket_
  tcp::socket socket_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<Op> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t posted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

struct ParsedId {
  std::string host;
  uint16_t port = 0;
  std::string token;  // hex
};

absl::StatusOr<ParsedId> ParseId(absl::string_view id) {
  std::vector<std::string> parts = absl::StrSplit(id, ' ');
  uint32_t port = 0;
  if (parts.size() != 4 || parts[0] != "tcp" || parts[1].empty() ||
      !absl::SimpleAtoi(parts[2], &port) || port == 0 || port > 65535 ||
      parts[3].size() != 2 * kTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("link id ", Quote(id),
                     " is not \"tcp <host> <port> <32 hex digits>\""));
  }
  return ParsedId{parts[1], static_cast<uint16_t>(port), parts[3]};
}

}  // namespace

struct TcpLinkFactory::Listener {
  std::unique_ptr<asio::io_context> io = std::make_unique<asio::io_context>();
  tcp::acceptor acceptor{*io};
  absl::Time made;
};

absl::Status TcpLinkFactory::CheckHost(const std::string& host) {
  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(host, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat(
        "link host ", Quote(host), " is not an IP address: ", ec.message()));
  }
  if (address.is_unspecified()) {
    return absl::InvalidArgumentError(
        absl::StrCat("link host ", Quote(host),
                     " is a wildcard address, which peers cannot connect to"));
  }
  return absl::OkStatus();
}

TcpLinkFactory::TcpLinkFactory(std::string host) : host_(std::move(host)) {}
TcpLinkFactory::~TcpLinkFactory() = default;

absl::StatusOr<std::string> TcpLinkFactory::NewLinkId() {
  auto listener = std::make_unique<Listener>();
  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(host_, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("tcp link: host ", Quote(host_),
                     " is not an IP address: ", ec.message()));
  }
  const tcp::endpoint endpoint(address, 0);
  listener->acceptor.open(endpoint.protocol(), ec);
  if (!ec) listener->acceptor.bind(endpoint, ec);
  if (!ec)
    listener->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) listener->acceptor.non_blocking(true, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("tcp link: cannot listen on ", host_, ": ", ec.message()));
  }
  const uint16_t port = listener->acceptor.local_endpoint(ec).port();
  const std::string token = RandomToken();
  listener->made = absl::Now();
  absl::MutexLock lock(&mu_);
  // Listeners whose rank 0 never came are closed.
  for (auto it = listeners_.begin(); it != listeners_.end();) {
    if (listener->made - it->second->made > kListenerTtl) {
      listeners_.erase(it++);
    } else {
      ++it;
    }
  }
  listeners_[token] = std::move(listener);
  return absl::StrCat("tcp ", host_, " ", port, " ", token);
}

absl::StatusOr<std::unique_ptr<DeviceLink>> TcpLinkFactory::Connect(
    absl::string_view id, int rank, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("link rank ", rank, " is not 0 or 1"));
  }
  absl::StatusOr<ParsedId> parsed = ParseId(id);
  if (!parsed.ok()) return parsed.status();
  const bool hex = std::all_of(parsed->token.begin(), parsed->token.end(),
                               [](char c) { return absl::ascii_isxdigit(c); });
  std::string token_bytes =
      hex ? absl::HexStringToBytes(parsed->token) : std::string();
  if (token_bytes.size() != kTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("link id ", Quote(id), ": the token is not hex"));
  }
  if (rank == 1) {
    auto io = std::make_unique<asio::io_context>();
    tcp::socket socket(*io);
    boost::system::error_code ec;
    const asio::ip::address address = asio::ip::make_address(parsed->host, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("link id ", Quote(id), ": host is not an IP address"));
    }
    const tcp::endpoint endpoint(address, parsed->port);
    socket.open(endpoint.protocol(), ec);
    if (!ec) socket.non_blocking(true, ec);
    if (!ec) socket.connect(endpoint, ec);
    const std::string what =
        absl::StrCat("connect to ", parsed->host, ":", parsed->port);
    while (ec && WouldBlock(ec)) {
      if (absl::Status s = PollSlice(socket.native_handle(), POLLOUT, deadline,
                                     cancelled, what);
          !s.ok()) {
        return s;
      }
      pollfd p{socket.native_handle(), POLLOUT, 0};
      if (::poll(&p, 1, 0) <= 0) continue;  // still connecting
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(socket.native_handle(), SOL_SOCKET, SO_ERROR, &err, &len);
      ec = err == 0 ? boost::system::error_code()
                    : boost::system::error_code(
                          err, boost::system::system_category());
      break;
    }
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("tcp link: ", what, ": ", ec.message()));
    }
    if (absl::Status s = ExactIo(
            socket, true, reinterpret_cast<uint8_t*>(token_bytes.data()),
            kTokenBytes, deadline, cancelled, "sending the token");
        !s.ok()) {
      return s;
    }
    // Rank 0 acknowledges a token it accepted: until then the link is not
    // made (a listener's backlog completes the TCP handshake by itself).
    uint8_t ack = 0;
    if (absl::Status s = ExactIo(socket, false, &ack, 1, deadline, cancelled,
                                 "waiting for the peer to accept the token");
        !s.ok()) {
      return s;
    }
    return std::unique_ptr<DeviceLink>(
        new TcpLink(std::move(io), std::move(socket)));
  }
  std::unique_ptr<Listener> listener;
  {
    absl::MutexLock lock(&mu_);
    auto it = listeners_.find(parsed->token);
    if (it != listeners_.end()) {
      listener = std::move(it->second);
      listeners_.erase(it);
    }
  }
  if (listener == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "link id ", Quote(id), " names no listener of this worker"));
  }
  while (true) {
    tcp::socket socket(*listener->io);
    boost::system::error_code ec;
    listener->acceptor.accept(socket, ec);
    if (ec) {
      if (!WouldBlock(ec)) {
        return absl::UnavailableError(
            absl::StrCat("tcp link: accept: ", ec.message()));
      }
      if (absl::Status s =
              PollSlice(listener->acceptor.native_handle(), POLLIN, deadline,
                        cancelled, "waiting for the peer to connect");
          !s.ok()) {
        return s;
      }
      continue;
    }
    socket.non_blocking(true, ec);
    std::string got(kTokenBytes, '\0');
    absl::Status s =
        ExactIo(socket, false, reinterpret_cast<uint8_t*>(got.data()),
                kTokenBytes, std::min(deadline, absl::Now() + absl::Seconds(5)),
                cancelled, "reading the peer's token");
    if (s.ok() && got == token_bytes) {
      uint8_t ack = 1;
      s = ExactIo(socket, true, &ack, 1, deadline, cancelled,
                  "acknowledging the token");
    }
    if (s.ok() && got == token_bytes) {
      boost::system::error_code ignored;
      listener->acceptor.close(ignored);
      std::unique_ptr<asio::io_context> io = std::move(listener->io);
      // The acceptor goes before the io_context it was made on.
      tcp::socket kept(std::move(socket));
      listener.reset();
      return std::unique_ptr<DeviceLink>(
          new TcpLink(std::move(io), std::move(kept)));
    }
    if (s.code() == absl::StatusCode::kCancelled) return s;
    // A stray connection (no or another token): closed, keep accepting.
  }
}

}  // namespace triax::worker
