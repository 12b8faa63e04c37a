# GPU tests: built wherever nvcc is (CI included), skipped at run time when no
# device answers. They judge the CUDA kernels against the float64 oracle (and
# the CPU backend on the same inputs). tests/cuda_harness.c runs one case.
if(ATTND_HAVE_CUDA AND TARGET attnd_kernels_cuda AND TARGET attnd_oracle)
  foreach(t test_cuda_kernels test_cuda_numerics)
    attnd_add_test(${t} SOURCES ${t}.c cuda_harness.c cuda_harness_ref.c
                   LIBS attnd_kernels_cuda attnd_oracle CUDA::cudart_static m LABELS gpu TIMEOUT 900)
    # Runs on the GPU machine from a folder of its own (build-gpu/): find libcmocka beside it.
    set_target_properties(${t} PROPERTIES BUILD_RPATH "\$ORIGIN" INSTALL_RPATH "\$ORIGIN")
    set_tests_properties(${t} PROPERTIES SKIP_RETURN_CODE 77)
  endforeach()
  # Split-context merges and head-sharded bits at the kernel API (docs/scale-out.md).
  attnd_add_test(test_cuda_scaleout SOURCES test_cuda_scaleout.c
                 LIBS attnd_kernels_cuda CUDA::cudart_static m LABELS gpu TIMEOUT 300)
  set_target_properties(test_cuda_scaleout PROPERTIES BUILD_RPATH "\$ORIGIN" INSTALL_RPATH "\$ORIGIN")
  set_tests_properties(test_cuda_scaleout PROPERTIES SKIP_RETURN_CODE 77)
endif()
