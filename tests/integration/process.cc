#include "tests/integration/process.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace triax::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int ExitCode(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
  return -1;
}

// fork/exec with stdout and stderr to the given files. -1 with errno on
// failure of fork itself; exec failures show as exit code 127.
// `cwd` (empty: the caller's) is the child's working directory, so that
// what a daemon writes by default relative to it (kvmanager's
// file:kvmanager-metadata) stays in the test's own directory.
pid_t Spawn(const std::string& path, const std::vector<std::string>& args,
            const std::string& out_path, const std::string& err_path,
            const std::string& cwd = "") {
  std::vector<std::string> argv_s;
  argv_s.push_back(path);
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  argv.reserve(argv_s.size() + 1);
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: only async-signal-safe calls until exec.
  const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  const int err =
      err_path == out_path
          ? out
          : open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int in = open("/dev/null", O_RDONLY);
  if (out < 0 || err < 0 || in < 0) _exit(126);
  if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(125);
  dup2(in, 0);
  dup2(out, 1);
  dup2(err, 2);
  execv(path.c_str(), argv.data());
  _exit(127);
}

// Reaps `pid` if it exited; true with its wait status then.
bool TryReap(pid_t pid, int* wstatus) {
  const pid_t r = waitpid(pid, wstatus, WNOHANG);
  return r == pid || (r < 0 && errno == ECHILD);
}

// Waits up to `timeout` for `pid` to exit; true when reaped.
bool ReapWithin(pid_t pid, absl::Duration timeout, int* wstatus) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (TryReap(pid, wstatus)) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

}  // namespace

absl::StatusOr<std::string> BinDir() {
  const char* dir = std::getenv("TRIAX_BIN_DIR");
  if (dir == nullptr || *dir == '\0') {
    return absl::FailedPreconditionError(
        "TRIAX_BIN_DIR is not set; run the test through ctest, or set it to "
        "the build's bin directory");
  }
  return std::string(dir);
}

absl::StatusOr<std::unique_ptr<TempDir>> TempDir::Create(
    const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = absl::StrCat(tmp != nullptr && *tmp ? tmp : "/tmp", "/",
                                   prefix, ".XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("mkdtemp ", templ, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<TempDir>(new TempDir(templ));
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

absl::StatusOr<std::unique_ptr<Process>> Process::Start(
    const std::string& name, const std::string& binary,
    std::vector<std::string> args, const std::string& dir, bool with_port_file,
    absl::Duration timeout) {
  // An absolute path (a system program such as etcd) is used as is.
  std::string path = binary;
  if (binary.empty() || binary[0] != '/') {
    auto bin_dir = BinDir();
    if (!bin_dir.ok()) return bin_dir.status();
    path = absl::StrCat(*bin_dir, "/", binary);
  }
  if (access(path.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "binary ", path, " is not executable: ", std::strerror(errno)));
  }
  std::unique_ptr<Process> p(new Process());
  p->name_ = name;
  p->log_path_ = absl::StrCat(dir, "/", name, ".log");
  const std::string port_path = absl::StrCat(dir, "/", name, ".port");
  if (with_port_file) {
    unlink(port_path.c_str());
    args.push_back(absl::StrCat("--port_file=", port_path));
  }
  // Relative paths among `args` would move with a relative `dir`.
  p->pid_ = Spawn(path, args, p->log_path_, p->log_path_,
                  !dir.empty() && dir[0] == '/' ? dir : "");
  if (p->pid_ < 0) {
    return absl::InternalError(
        absl::StrCat("fork for ", name, ": ", std::strerror(errno)));
  }
  if (!with_port_file) return p;

  const absl::Time deadline = absl::Now() + timeout;
  std::string previous;
  while (true) {
    // The writer may be mid-write: take the number once the line is ended or
    // the content stayed the same across two polls.
    std::string text = ReadFile(port_path);
    if (!text.empty() && (text.back() == '\n' || text == previous)) {
      int port = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) &&
          port > 0 && port < 65536) {
        p->port_ = port;
        return p;
      }
    }
    previous = text;
    int wstatus = 0;
    if (TryReap(p->pid_, &wstatus)) {
      p->pid_ = -1;
      return absl::FailedPreconditionError(
          absl::StrCat(name, " (", binary, " ", absl::StrJoin(args, " "),
                       ") exited with code ", ExitCode(wstatus),
                       " before writing its port file; log:\n", p->Log()));
    }
    if (absl::Now() >= deadline) {
      std::string log = p->Log();
      p->Kill();
      return absl::DeadlineExceededError(
          absl::StrCat(name, " wrote no port to ", port_path, " within ",
                       absl::FormatDuration(timeout), "; log:\n", log));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

Process::~Process() { Stop(); }

void Process::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int wstatus = 0;
  ReapWithin(pid_, absl::Seconds(10), &wstatus);
  pid_ = -1;
}

absl::Status Process::Pause() {
  if (pid_ <= 0 || kill(pid_, SIGSTOP) != 0) {
    return absl::FailedPreconditionError(name_ + " is not running");
  }
  return absl::OkStatus();
}

absl::Status Process::Resume() {
  if (pid_ <= 0 || kill(pid_, SIGCONT) != 0) {
    return absl::FailedPreconditionError(name_ + " is not running");
  }
  return absl::OkStatus();
}

void Process::Stop(absl::Duration grace) {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  kill(pid_, SIGCONT);  // a paused process handles SIGTERM once continued
  int wstatus = 0;
  if (ReapWithin(pid_, grace, &wstatus)) {
    pid_ = -1;
    return;
  }
  Kill();
}

absl::StatusOr<int> Process::Wait(absl::Duration timeout) {
  if (pid_ <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(name_, " is not running"));
  }
  int wstatus = 0;
  if (ReapWithin(pid_, timeout, &wstatus)) {
    pid_ = -1;
    return ExitCode(wstatus);
  }
  Kill();
  return absl::DeadlineExceededError(
      absl::StrCat(name_, " did not exit within ",
                   absl::FormatDuration(timeout), "; killed. log:\n", Log()));
}

std::string Process::Log(size_t max_bytes) const {
  std::string log = ReadFile(log_path_);
  if (log.size() > max_bytes) log = "..." + log.substr(log.size() - max_bytes);
  return log;
}

absl::StatusOr<int> RunToCompletion(const std::string& binary,
                                    const std::vector<std::string>& args,
                                    const std::string& dir, std::string* out,
                                    std::string* err, absl::Duration timeout) {
  // An absolute path (a system program such as etcd) is used as is.
  std::string path = binary;
  if (binary.empty() || binary[0] != '/') {
    auto bin_dir = BinDir();
    if (!bin_dir.ok()) return bin_dir.status();
    path = absl::StrCat(*bin_dir, "/", binary);
  }
  static int counter = 0;
  ++counter;
  const std::string out_path = absl::StrCat(dir, "/run", counter, ".out");
  const std::string err_path = absl::StrCat(dir, "/run", counter, ".err");
  unlink(out_path.c_str());
  const pid_t pid = Spawn(path, args, out_path, err_path);
  if (pid < 0) {
    return absl::InternalError(
        absl::StrCat("fork for ", binary, ": ", std::strerror(errno)));
  }
  int wstatus = 0;
  if (!ReapWithin(pid, timeout, &wstatus)) {
    kill(pid, SIGKILL);
    ReapWithin(pid, absl::Seconds(10), &wstatus);
    return absl::DeadlineExceededError(absl::StrCat(
        binary, " ", absl::StrJoin(args, " "), " did not finish within ",
        absl::FormatDuration(timeout), "; stderr:\n", ReadFile(err_path)));
  }
  if (out != nullptr) *out = ReadFile(out_path);
  if (err != nullptr) *err = ReadFile(err_path);
  return ExitCode(wstatus);
}

}  // namespace triax::testing
