# syntax=docker/dockerfile:1
# The image the Helm chart (helm/triaxkv) runs: kvmanager, kvworker (CUDA
# backend, kernels built for the chart's GPUs) and kvctl, as user 10001.
#
#   docker build -t triaxkv:0.1.0 .
#   docker build --build-arg CUDA_ARCHS="90a;100a" -t triaxkv:0.1.0 .
#
# CUDA_ARCHS is TRIAX_CUDA_ARCHS (CMAKE_CUDA_ARCHITECTURES): 90a for H100 /
# H200 (the default; sm_90a kernels use Hopper-only instructions and run on
# nothing else), several separated by ";". The CUDA runtime is linked
# statically; the runtime stage adds NCCL (the workers' link transfers,
# loaded at run time as libnccl.so.2) and takes the driver from the host
# through the NVIDIA container toolkit. Dockerfile.cpu builds the CPU-only
# image.
ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG CUDA_ARCHS=90a
# Ubuntu 24.04 carries the versions the project is built with on Debian 12:
# gRPC 1.51, protobuf 3.21, Abseil 20220623.
RUN apt-get update -qq && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      build-essential cmake ninja-build pkg-config git \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libabsl-dev libssl-dev libboost-dev nlohmann-json3-dev \
      cppzmq-dev libzmq3-dev libmsgpack-cxx-dev \
      prometheus-cpp-dev zlib1g-dev && \
    rm -rf /var/lib/apt/lists/*
WORKDIR /src
# .dockerignore keeps build trees, .git, device bundles and tools out.
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DTRIAX_WITH_CUDA=ON -DTRIAX_CUDA_ARCHS="${CUDA_ARCHS}" \
      -DTRIAX_BUILD_TESTS=OFF -DTRIAX_BUILD_BENCH=OFF && \
    cmake --build /build --target kvmanager kvworker kvctl && \
    mkdir -p /out && \
    cp /build/bin/kvmanager /build/bin/kvworker /build/bin/kvctl /out/ && \
    strip /out/*
# The Ubuntu packages the binaries load (gRPC, protobuf, Abseil, OpenSSL...),
# found from their shared libraries, so the runtime stage installs exactly
# those; libraries of the CUDA image itself (cuda-*, NCCL) are left to it.
# (The devel image also has NCCL's header, which link_nccl.cc includes.)
RUN set -eu; \
    for lib in $(ldd /out/kvmanager /out/kvworker /out/kvctl | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u); do \
      dpkg -S "$lib" 2>/dev/null || dpkg -S "$(realpath "$lib")" 2>/dev/null || \
        dpkg -S "/usr$lib" 2>/dev/null || true; \
    done | cut -d: -f1 | sort -u | grep -v -E '^(cuda-|libcuda|libnccl|libc6$)' \
      > /out/runtime-packages.txt; \
    cat /out/runtime-packages.txt; \
    grep -q '^libgrpc++' /out/runtime-packages.txt

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update -qq && \
    DEBIAN_FRONTEND=noninteractive xargs -a /tmp/runtime-packages.txt \
      apt-get install -y -qq --no-install-recommends && \
    rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt && \
    groupadd --gid 10001 triax && \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin triax && \
    install -d -o 10001 -g 10001 /var/lib/triaxkv /var/cache/triaxkv
COPY --from=build /out/kvmanager /out/kvworker /out/kvctl /usr/local/bin/
# Numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
# kvmanager's embedded store (--metadata=file:/var/lib/triaxkv) and the
# workers' disk tier; the chart mounts volumes here.
VOLUME ["/var/lib/triaxkv"]
EXPOSE 7070 7071
ENTRYPOINT []
CMD ["/usr/local/bin/kvworker", "--help"]
