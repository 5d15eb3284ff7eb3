# The two commands:
#   make demo   install what is missing, build, run manager + CPU worker + reference frontend
#   make test   install what is missing, build everything, run the whole suite with ctest
#   make lint   clang-tidy (.clang-tidy) over the project's C++ sources
#   make asan   the unit suite under ASan + UBSan (build-asan), fuzz corpora
#               replayed included; ASAN_TARGETS / ASAN_TESTS narrow it
#   make fuzz   scripts/fuzz.sh: each libFuzzer target FUZZ_SECONDS (60)
#
# Variables: BUILD_DIR (build), BUILD_TYPE (Release), JOBS (nproc),
# TRIAX_DATA_DIR (../shared/data), CMAKE_ARGS (extra configure flags).

BUILD_DIR  ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
TRIAX_DATA_DIR ?= $(abspath $(CURDIR)/../shared/data)
CMAKE_ARGS ?=

ASAN_DIR     ?= build-asan
ASAN_TARGETS ?= all
ASAN_TESTS   ?= .
FUZZ_SECONDS ?= 60

.PHONY: all deps configure build demo test lint clean format asan fuzz

all: build

deps:
	@bash scripts/install_deps.sh

$(BUILD_DIR)/CMakeCache.txt: CMakeLists.txt
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DTRIAX_DATA_DIR=$(TRIAX_DATA_DIR) $(CMAKE_ARGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The demo needs only the three programs it runs.
demo: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target kvmanager kvworker kvdemo
	TRIAX_DATA_DIR=$(TRIAX_DATA_DIR) bash scripts/demo.sh $(BUILD_DIR)/bin

# helm for the chart test (label helm); without network it skips, saying so.
test: build
	@bash scripts/install_helm.sh || echo "make test: no helm; helm_chart_test will skip"
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# clang-tidy with .clang-tidy's checks over every compiled C++ source.
lint: configure
	bash scripts/lint.sh $(BUILD_DIR)

# The unit-labelled tests (fuzz replays included) built with
# -fsanitize=address,undefined in their own build directory. On a small
# machine narrow it: make asan ASAN_TARGETS="tagger_test fuzz_tagger_replay"
# ASAN_TESTS="tagger|fuzz_tagger".
asan: deps
	cmake -S . -B $(ASAN_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTRIAX_SANITIZE=ON -DTRIAX_BUILD_BENCH=OFF \
	  -DTRIAX_DATA_DIR=$(TRIAX_DATA_DIR) $(CMAKE_ARGS)
	cmake --build $(ASAN_DIR) -j $(JOBS) --target $(ASAN_TARGETS)
	cd $(ASAN_DIR) && ASAN_OPTIONS=detect_leaks=1 \
	  ctest -L unit -R '$(ASAN_TESTS)' --output-on-failure -j $(JOBS)

# libFuzzer targets (clang), each run FUZZ_SECONDS (docs/fuzzing.md).
fuzz: deps
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

format:
	find common kernels kvmanager worker client tests bench \
	  \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) \
	  -exec clang-format -i --style=file {} +

clean:
	rm -rf $(BUILD_DIR)
