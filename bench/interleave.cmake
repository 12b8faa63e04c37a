# bench_interleave: decode latency beside a long prefill on the same layer,
# through the engine on the CPU backend (bench/README.md). Not a test: run by
# hand, numbers in bench/RESULTS.md.
add_executable(bench_interleave ${CMAKE_CURRENT_SOURCE_DIR}/bench_interleave.c)
target_link_libraries(bench_interleave PRIVATE attnd_engine)
