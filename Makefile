# Convenience wrapper around CMake. `make run` builds if needed and starts the
# daemon with its embedded defaults; `make test` installs missing packages,
# builds and runs every test through ctest.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
ARGS ?=

FUZZ_SECONDS ?= 60

.PHONY: all deps configure build run test asan fuzz clean

all: build

deps:
	@bash scripts/deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DPython3_EXECUTABLE=/usr/bin/python3 $(CMAKE_FLAGS)

configure: $(BUILD)/CMakeCache.txt

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/daemon/attnd $(ARGS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

# CPU-only build with AddressSanitizer and UndefinedBehaviorSanitizer.
asan: deps
	cmake -S . -B build-asan -DPython3_EXECUTABLE=/usr/bin/python3 -DATTND_CUDA=OFF -DATTND_SANITIZE=ON
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ctest --output-on-failure -j $(JOBS) --timeout 900

# libFuzzer over frame reader -> RPC dispatch -> a tiny CPU engine (clang,
# ASan+UBSan), seeded from tests/fuzz/corpus, for FUZZ_SECONDS on one
# connection, then half that with the frames split over two. New inputs go
# to build-fuzz/corpus (the committed seeds are left alone); a crash leaves
# build-fuzz/crash-* and fails the target: add it to tests/fuzz/regressions/.
fuzz: deps
	CC=clang cmake -S . -B build-fuzz -DPython3_EXECUTABLE=/usr/bin/python3 -DATTND_CUDA=OFF \
	  -DATTND_FUZZ=ON -DATTND_SANITIZE=ON -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link
	cmake --build build-fuzz -j $(JOBS) --target fuzz_rpc
	mkdir -p build-fuzz/corpus
	build-fuzz/tests/fuzz_rpc -max_total_time=$(FUZZ_SECONDS) -timeout=20 -rss_limit_mb=3072 \
	  -print_final_stats=1 -artifact_prefix=build-fuzz/ build-fuzz/corpus tests/fuzz/corpus \
	  tests/fuzz/regressions
	ATTND_FUZZ_CONNS=2 build-fuzz/tests/fuzz_rpc -max_total_time=$$(( $(FUZZ_SECONDS) / 2 + 1 )) \
	  -timeout=20 -rss_limit_mb=3072 -print_final_stats=1 -artifact_prefix=build-fuzz/ \
	  build-fuzz/corpus tests/fuzz/corpus tests/fuzz/regressions

clean:
	rm -rf $(BUILD) build-asan build-fuzz
