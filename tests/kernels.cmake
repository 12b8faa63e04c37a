# Kernel tests: the float64 oracle on its own, then the CPU kernels against it.
attnd_add_test(test_oracle SOURCES test_oracle.c LIBS attnd_oracle)
if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/test_kernels_cpu.c)
  attnd_add_test(test_kernels_cpu SOURCES test_kernels_cpu.c
                 LIBS attnd_kernels_cpu attnd_oracle Threads::Threads TIMEOUT 300)
endif()
