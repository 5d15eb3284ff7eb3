"""Fixtures: a real kvmanager with kvworkers on loopback (ports 0, read back
from --port_file, as tests/integration/process.h does), and the paths that
make triaxkv and its generated stubs importable from the source tree.

Binaries: $TRIAX_BIN_DIR (ctest sets it to build/bin), else <repo>/build/bin.
Stubs: $TRIAX_PYTHON_STUBS (ctest: build/python), else <repo>/build/python.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.environ.get("TRIAX_PYTHON_STUBS", os.path.join(REPO, "build", "python")))
sys.path.insert(0, os.path.dirname(HERE))

import triaxkv  # noqa: E402

MODEL = triaxkv.ModelShape(name="py-small", n_layers=2, n_kv_heads=2, n_q_heads=4,
                           head_dim=32)


def bin_dir():
    d = os.environ.get("TRIAX_BIN_DIR", os.path.join(REPO, "build", "bin"))
    for b in ("kvmanager", "kvworker"):
        if not os.access(os.path.join(d, b), os.X_OK):
            pytest.fail(f"{d}/{b} is not executable; build it and set TRIAX_BIN_DIR")
    return d


class Process:
    """One child process; output in <dir>/<name>.log; stopped with SIGTERM,
    then SIGKILL after 3 s."""

    def __init__(self, name, binary, args, directory, timeout=10.0):
        self.name = name
        self.log_path = os.path.join(directory, name + ".log")
        port_path = os.path.join(directory, name + ".port")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [os.path.join(bin_dir(), binary)] + args + [f"--port_file={port_path}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            text = ""
            if os.path.exists(port_path):
                with open(port_path) as f:
                    text = f.read()
            if text.endswith("\n") and text.strip().isdigit():
                self.port = int(text)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} wrote no port in {timeout} s:\n{self.log()}")
            time.sleep(0.02)

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def log(self, max_bytes=4000):
        with open(self.log_path, "rb") as f:
            return f.read()[-max_bytes:].decode("utf-8", "replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """kvmanager plus `workers` CPU kvworkers ("w0", "w1", ...), all UP."""

    def __init__(self, workers=2, pool_mb=64, window_tokens=16, manager_flags=(),
                 worker_flags=(), client_kwargs=None, directory=None):
        """manager_flags / worker_flags: extra flags (a TLS cluster's);
        client_kwargs: what a triaxkv.Client needs to reach it (tls_ca...).
        directory: where the logs go (default: a fresh temp dir)."""
        self.dir = directory or tempfile.mkdtemp(prefix="triax-py-")
        self.workers = []
        self.client_kwargs = dict(client_kwargs or {})
        self.manager = Process("kvmanager", "kvmanager",
                               ["--listen=127.0.0.1:0", "--heartbeat_interval_ms=100",
                                "--metadata=file:" + os.path.join(self.dir, "metadata")]
                               + list(manager_flags),
                               self.dir)
        try:
            for i in range(workers):
                self.workers.append(Process(
                    f"w{i}", "kvworker",
                    ["--listen=127.0.0.1:0", f"--manager={self.manager.address}",
                     f"--worker_id=w{i}", f"--pool_mb={pool_mb}",
                     f"--window_tokens={window_tokens}"] + list(worker_flags), self.dir))
            self._wait_up([f"w{i}" for i in range(workers)])
        except BaseException:
            self.stop()
            raise

    def _wait_up(self, ids, timeout=10.0):
        with triaxkv.Client(self.manager.address, timeout=5, **self.client_kwargs) as c:
            deadline = time.monotonic() + timeout
            while True:
                up = {w.worker_id for w in c.list_workers()
                      if w.state == triaxkv.types_pb2.WORKER_STATE_UP}
                if set(ids) <= up:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers {sorted(set(ids) - up)} not UP in "
                                       f"{timeout} s; manager log:\n{self.manager.log()}")
                time.sleep(0.05)

    @property
    def address(self):
        return self.manager.address

    def stop(self):
        for w in self.workers:
            w.stop()
        self.manager.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    c = Cluster()
    yield c
    c.stop()


_tenants = iter(range(1, 1 << 30))


@pytest.fixture
def client(cluster):
    """A client of a fresh tenant (no budget) on the shared cluster."""
    c = triaxkv.Client(cluster.address, tenant_id=f"py-t{next(_tenants)}", timeout=10)
    c.create_tenant()
    yield c
    c.close()
