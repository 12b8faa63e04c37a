# bench_window: the CPU kernels' decode on a sliding layer at a long context
# against a full layer at the window's length (docs/numerics.md section 5: a
# window's keys only are read). Not a test: run by hand, numbers in
# bench/RESULTS.md.
add_executable(bench_window ${CMAKE_CURRENT_SOURCE_DIR}/bench_window.c)
target_link_libraries(bench_window PRIVATE attnd_kernels_cpu m)
