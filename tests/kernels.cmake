# Kernel tests: the float64 oracle on its own, then the CPU kernels against it
# through the harness of kernels_fixture.c (test_kernels_cpu: write and attend;
# test_kernels_cpu_bounds: inputs at the bounds of docs/numerics.md section 6;
# test_kernels_cpu_numeric: the element conversions, the finiteness check and
# RoPE's fp32 evaluation).
attnd_add_test(test_oracle SOURCES test_oracle.c LIBS attnd_oracle)
if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/test_kernels_cpu.c)
  # The same tests again on the kernels built without CPU dispatch: the
  # baseline x86-64 code path is what runs where AVX2/FMA are absent (many VM
  # CPU models), and the dispatched build never executes it on a modern machine.
  file(GLOB ATTND_KCPU_TEST_SRC CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/kernels/*.c
       ${PROJECT_SOURCE_DIR}/kernels/cpu/*.c)
  foreach(t test_kernels_cpu test_kernels_cpu_bounds test_kernels_cpu_numeric
            test_kernels_cpu_variants)
    attnd_add_test(${t} SOURCES ${t}.c kernels_fixture.c
                   LIBS attnd_kernels_cpu attnd_oracle Threads::Threads TIMEOUT 300)
    attnd_add_test(${t}_baseline SOURCES ${t}.c kernels_fixture.c ${ATTND_KCPU_TEST_SRC}
                   LIBS attnd_oracle Threads::Threads m TIMEOUT 300)
    target_compile_definitions(${t}_baseline PRIVATE ATTND_KC_BASELINE)
    target_compile_options(${t}_baseline PRIVATE -O3)
  endforeach()
endif()
# The CPU kernels at the largest magnitudes they promise to compute faithfully.
attnd_add_test(test_kernels_cpu_bound SOURCES test_kernels_cpu_bound.c LIBS attnd_kernels_cpu attnd_oracle m)
