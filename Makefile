# Thin front of the CMake build. `make run` and `make test` work on a fresh Debian 12 machine:
# each installs missing Debian packages (scripts/setup.sh), configures, builds and runs.
JOBS ?= $(shell nproc)
BUILD ?= build/release
ASAN_BUILD ?= build/asan
CUDA ?= auto
CTEST_FLAGS ?= --output-on-failure --timeout 120 -j$(JOBS)

.PHONY: all setup build run test test-fast test-asan test-all bench clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/CMakeCache.txt: | setup
	@mkdir -p build && cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DOOMLESS_CUDA=$(CUDA) > $(BUILD).configure.log 2>&1 || (mkdir -p build; cat $(BUILD).configure.log; exit 1)

build: setup $(BUILD)/CMakeCache.txt
	@cmake --build $(BUILD) -j$(JOBS)

run: build
	$(BUILD)/oomless probe

# Fast tests (ctest -LE "gpu|slow") of the Release build, then the same under ASan + UBSan.
test: test-fast test-asan

test-fast: build
	cd $(BUILD) && ctest $(CTEST_FLAGS) -LE "gpu|slow"

test-asan: setup
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DOOMLESS_SANITIZE=ON -DOOMLESS_CUDA=off -DOOMLESS_BENCH=OFF > /dev/null
	@cmake --build $(ASAN_BUILD) -j$(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 ctest $(CTEST_FLAGS) -LE "gpu|slow"

# Everything but GPU tests, the slow ones included (long: all 2^32 float conversions, ...).
test-all: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) -LE gpu

bench: build
	$(BUILD)/bench_kernels

clean:
	rm -rf build
