# Image for the Helm chart: kvmanager, kvworker and kvctl on Debian 12.
FROM debian:12 AS build
WORKDIR /src
COPY . .
RUN bash scripts/install_deps.sh && \
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTRIAX_BUILD_TESTS=OFF \
      -DTRIAX_BUILD_BENCH=OFF && \
    cmake --build build -j"$(nproc)" --target kvmanager kvworker kvctl

FROM debian:12
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      libgrpc++1.51 libprotobuf32 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/build/bin/kvmanager /src/build/bin/kvworker /src/build/bin/kvctl /usr/local/bin/
