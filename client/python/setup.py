"""Builds the triaxkv wheel; its gRPC stubs are generated from the
repository's proto/ at build time (nothing generated is checked in).

The stubs land as the package `triax.v1` next to `triaxkv`: protoc derives
the module path from the proto file's path, and manager.proto imports
"triax/v1/types.proto", so the generated code imports `triax.v1.types_pb2`.

The generator is grpc_tools.protoc when importable, else `protoc` with
`grpc_python_plugin` from PATH (Debian: protobuf-compiler and
protobuf-compiler-grpc). The protos are read from $TRIAXKV_PROTO_DIR, else
from ../../proto (a build from the repository checkout).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTOS = ("types", "manager", "worker")


def _proto_dir():
    d = Path(os.environ.get("TRIAXKV_PROTO_DIR", HERE.parent.parent / "proto"))
    missing = [p for p in PROTOS if not (d / "triax" / "v1" / f"{p}.proto").is_file()]
    if missing:
        raise SystemExit(
            f"triaxkv: proto files {missing} not found under {d}/triax/v1; build "
            "from the repository checkout (pip install ./client/python) or set "
            "TRIAXKV_PROTO_DIR to the repository's proto/ directory")
    return d


def _protoc_command(proto_dir, out):
    files = [str(proto_dir / "triax" / "v1" / f"{p}.proto") for p in PROTOS]
    args = [f"-I{proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}"]
    try:
        import grpc_tools  # noqa: F401  (the pip world's protoc)
        return [sys.executable, "-m", "grpc_tools.protoc"] + args + files
    except ImportError:
        pass
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if not protoc or not plugin:
        raise SystemExit(
            "triaxkv: no stub generator: install grpcio-tools (pip), or protoc and "
            "grpc_python_plugin (Debian: protobuf-compiler protobuf-compiler-grpc)")
    return [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"] + args + files


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        out = Path(self.build_lib)
        (out / "triax" / "v1").mkdir(parents=True, exist_ok=True)
        cmd = _protoc_command(_proto_dir(), out)
        self.announce("generating stubs: " + " ".join(cmd), level=2)
        subprocess.run(cmd, check=True)
        for init in (out / "triax" / "__init__.py", out / "triax" / "v1" / "__init__.py"):
            init.touch()


setup(cmdclass={"build_py": BuildWithStubs})
