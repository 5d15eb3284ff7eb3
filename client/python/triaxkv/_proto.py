"""The generated triax.v1 modules (see setup.py and client/python/CMakeLists.txt).

A pip install puts them next to triaxkv; in a source tree they are in the
CMake build directory, build/python, which must then be on sys.path.
"""

try:
    from triax.v1 import manager_pb2, manager_pb2_grpc  # noqa: F401
    from triax.v1 import types_pb2, worker_pb2, worker_pb2_grpc  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "triaxkv: the generated stubs (package triax.v1) are not importable "
        f"({e}); install with `pip install ./client/python`, or build the "
        "CMake target triaxkv_python and put build/python on PYTHONPATH"
    ) from e
