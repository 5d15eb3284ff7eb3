// Launches real triaxkv binaries (kvmanager, kvworker, kvctl) for integration
// tests: fork/exec from $TRIAX_BIN_DIR, a private temp dir with --port_file,
// waiting for the port, and SIGTERM/SIGKILL + reaping in the destructor so no
// test leaves a process behind. Thread-compatible.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace triax::testing {

// $TRIAX_BIN_DIR, or FAILED_PRECONDITION naming the variable when unset.
absl::StatusOr<std::string> BinDir();

// A fresh directory under $TMPDIR (or /tmp), removed with its files by the
// destructor.
class TempDir {
 public:
  static absl::StatusOr<std::unique_ptr<TempDir>> Create(
      const std::string& prefix);
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// One child process. stdout and stderr go to <dir>/<name>.log, which
// failures quote (Log()).
class Process {
 public:
  // Starts $TRIAX_BIN_DIR/<binary> (or `binary` itself when it is an
  // absolute path) with `args`, in `dir` as its working directory when
  // `dir` is absolute (a daemon's default files stay in the test's dir). When
  // `with_port_file` is set,
  // "--port_file=<dir>/<name>.port" is appended and Start waits up to
  // `timeout` for the file to hold a port; DEADLINE_EXCEEDED (with the log's
  // tail) when it does not, FAILED_PRECONDITION when the process exits first.
  static absl::StatusOr<std::unique_ptr<Process>> Start(
      const std::string& name, const std::string& binary,
      std::vector<std::string> args, const std::string& dir,
      bool with_port_file = true, absl::Duration timeout = absl::Seconds(10));

  ~Process();  // Stop()

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }

  // SIGKILL without grace, then reaps. Idempotent.
  void Kill();
  // SIGTERM (and SIGCONT, should it be paused), up to `grace` for exit,
  // then SIGKILL; reaps. Idempotent.
  void Stop(absl::Duration grace = absl::Seconds(3));
  // SIGSTOP / SIGCONT: the process freezes (its sockets stay open, nothing
  // answers) and goes on where it was. FAILED_PRECONDITION when it is not
  // running.
  absl::Status Pause();
  absl::Status Resume();
  bool running() const { return pid_ > 0; }
  // Waits up to `timeout` for the process to exit by itself; its exit code
  // (or 128 + signal), or DEADLINE_EXCEEDED (the process is then killed).
  absl::StatusOr<int> Wait(absl::Duration timeout);

  // The output so far (at most the last `max_bytes`).
  std::string Log(size_t max_bytes = 4000) const;

 private:
  Process() = default;
  std::string name_;
  std::string log_path_;
  pid_t pid_ = -1;
  int port_ = 0;
};

// Runs `binary` with `args` to completion (bounded by `timeout`); returns its
// exit code, with stdout and stderr in `out` and `err`.
absl::StatusOr<int> RunToCompletion(const std::string& binary,
                                    const std::vector<std::string>& args,
                                    const std::string& dir, std::string* out,
                                    std::string* err,
                                    absl::Duration timeout = absl::Seconds(10));

}  // namespace triax::testing
