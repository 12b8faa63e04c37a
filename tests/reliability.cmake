# Reliability and security: bad input over every RPC, load, faults, limits and
# access (end-to-end against the real daemon), and the libFuzzer harness.
set(ATTND_REL_DIR ${CMAKE_CURRENT_SOURCE_DIR})
option(ATTND_FUZZ "Build the libFuzzer harnesses (clang only)" OFF)

# The fuzz harness needs clang's libFuzzer: configure a separate build with
#   CC=clang cmake -S . -B build-fuzz -DATTND_FUZZ=ON -DATTND_CUDA=OFF
# (`make fuzz` does it). The whole tree is then compiled with
# -fsanitize=fuzzer-no-link,address,undefined so coverage reaches the daemon code.
# Every build replays the seed corpus and every input the fuzzer ever crashed
# on (tests/fuzz/regressions/, one file per bug, named after it) through the
# same harness without libFuzzer; under -DATTND_SANITIZE=ON that is the
# regression test for each crash.
if(NOT ATTND_FUZZ)
  add_executable(fuzz_replay ${ATTND_REL_DIR}/fuzz/fuzz_rpc.c ${ATTND_REL_DIR}/fuzz/replay_main.c)
  target_link_libraries(fuzz_replay PRIVATE attnd_net)
  target_link_options(fuzz_replay PRIVATE -Wl,--wrap=attnd_random_id)
  # The engine's internal.h: the harness gives its backend stand-in zero-copy ops.
  target_include_directories(fuzz_replay PRIVATE ${PROJECT_SOURCE_DIR}/daemon/engine)
  add_test(NAME fuzz_replay COMMAND fuzz_replay ${ATTND_REL_DIR}/fuzz/corpus
           ${ATTND_REL_DIR}/fuzz/regressions)
  set_tests_properties(fuzz_replay PROPERTIES TIMEOUT 120 LABELS reliability
    FAIL_REGULAR_EXPRESSION "runtime error|ERROR: AddressSanitizer|ERROR: LeakSanitizer")
  # The same inputs split over two connections (frames in turn), so calls
  # of one pass the other's queued ones.
  add_test(NAME fuzz_replay_2conns COMMAND fuzz_replay ${ATTND_REL_DIR}/fuzz/corpus
           ${ATTND_REL_DIR}/fuzz/regressions)
  set_tests_properties(fuzz_replay_2conns PROPERTIES TIMEOUT 120 LABELS reliability
    ENVIRONMENT ATTND_FUZZ_CONNS=2
    FAIL_REGULAR_EXPRESSION "runtime error|ERROR: AddressSanitizer|ERROR: LeakSanitizer")
endif()

if(ATTND_FUZZ)
  if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ATTND_FUZZ=ON needs clang (CC=clang)")
  endif()
  # kernels/cpu/attend.c uses GCC's __builtin_shuffle: give clang a stand-in.
  set_source_files_properties(${PROJECT_SOURCE_DIR}/kernels/cpu/attend.c
    DIRECTORY ${PROJECT_SOURCE_DIR}/kernels
    PROPERTIES COMPILE_OPTIONS "-include;${ATTND_REL_DIR}/fuzz/clang_compat.h")
  add_executable(fuzz_rpc ${ATTND_REL_DIR}/fuzz/fuzz_rpc.c)
  target_link_libraries(fuzz_rpc PRIVATE attnd_net)
  target_include_directories(fuzz_rpc PRIVATE ${PROJECT_SOURCE_DIR}/daemon/engine)
  # Deterministic session and plan ids within one input (see fuzz_rpc.c).
  target_link_options(fuzz_rpc PRIVATE -fsanitize=fuzzer -Wl,--wrap=attnd_random_id)
endif()

# End-to-end reliability tests against the real daemon (tests/e2e, unittest).
attnd_add_e2e(e2e_rel_badinput test_reliability_badinput)
set_tests_properties(e2e_rel_badinput PROPERTIES LABELS "e2e;reliability")
attnd_add_e2e(e2e_rel_load test_reliability_load)
set_tests_properties(e2e_rel_load PROPERTIES LABELS "e2e;reliability")
attnd_add_e2e(e2e_rel_faults test_reliability_faults)
set_tests_properties(e2e_rel_faults PROPERTIES LABELS "e2e;reliability")
attnd_add_e2e(e2e_rel_limits test_reliability_limits)
set_tests_properties(e2e_rel_limits PROPERTIES LABELS "e2e;reliability")
