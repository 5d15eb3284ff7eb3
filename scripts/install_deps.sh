#!/usr/bin/env bash
# Installs the Debian 12 packages triaxkv builds with, only when missing.
set -euo pipefail

pkgs=(
  build-essential cmake pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libboost-dev
  cppzmq-dev libzmq3-dev libmsgpack-cxx-dev
  prometheus-cpp-dev libprometheus-cpp-core1.0 prometheus
  etcd-server zlib1g-dev
  # OpenSSL: HTTPS of the operator endpoints and the TLS files' checks
  # (common/tls.h); the openssl CLI makes tls_test's certificates at run
  # time, curl fetches its HTTPS /metrics.
  libssl-dev openssl curl
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-yaml
  python3-zmq python3-msgpack
  # clang with libFuzzer and the sanitizer runtimes: scripts/fuzz.sh (the
  # normal build uses g++).
  clang libclang-rt-14-dev
  # Headless browser for dashboard_test (label browser): ~100 MB download,
  # ~360 MB installed with chromium-common; the test skips without it.
  chromium
)

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#pkgs[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
