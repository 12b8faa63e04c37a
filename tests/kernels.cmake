# Kernel tests: the float64 oracle on its own, then the CPU kernels against it.
attnd_add_test(test_oracle SOURCES test_oracle.c LIBS attnd_oracle)
if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/test_kernels_cpu.c)
  attnd_add_test(test_kernels_cpu SOURCES test_kernels_cpu.c
                 LIBS attnd_kernels_cpu attnd_oracle Threads::Threads TIMEOUT 300)
  # The same tests on the kernels built without CPU dispatch: the baseline
  # x86-64 code path is what runs where AVX2/FMA are absent (many VM CPU
  # models), and the dispatched build never executes it on a modern machine.
  file(GLOB ATTND_KCPU_TEST_SRC CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/kernels/*.c
       ${PROJECT_SOURCE_DIR}/kernels/cpu/*.c)
  attnd_add_test(test_kernels_cpu_baseline SOURCES test_kernels_cpu.c ${ATTND_KCPU_TEST_SRC}
                 LIBS attnd_oracle Threads::Threads m TIMEOUT 300)
  target_compile_definitions(test_kernels_cpu_baseline PRIVATE ATTND_KC_BASELINE)
  target_compile_options(test_kernels_cpu_baseline PRIVATE -O3)
endif()
# The CPU kernels at the largest magnitudes they promise to compute faithfully.
attnd_add_test(test_kernels_cpu_bound SOURCES test_kernels_cpu_bound.c LIBS attnd_kernels_cpu attnd_oracle m)
