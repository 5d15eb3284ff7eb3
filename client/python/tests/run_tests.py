"""ctest entry of the Python client's suite (python_client_test): runs pytest
over this directory against real kvmanager / kvworker processes from
$TRIAX_BIN_DIR. Exits 77 (ctest: skipped) only when grpcio is missing."""

import os
import sys

try:
    import grpc  # noqa: F401
except ImportError:
    print("python_client_test: grpcio is not importable by "
          f"{sys.executable} (Debian: python3-grpcio); skipped")
    sys.exit(77)

import pytest  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
sys.exit(pytest.main([here, "-q", "-rs", "-p", "no:cacheprovider"]))
