# GPU tests: built wherever nvcc is (CI included), skipped at run time when no
# device answers. They judge the CUDA kernels against the float64 oracle.
if(ATTND_HAVE_CUDA AND TARGET attnd_kernels_cuda AND TARGET attnd_oracle)
  attnd_add_test(test_cuda_kernels SOURCES test_cuda_kernels.c
                 LIBS attnd_kernels_cuda attnd_oracle CUDA::cudart_static LABELS gpu TIMEOUT 900)
  # Runs on the GPU machine from a folder of its own (build-gpu/): find libcmocka beside it.
  set_target_properties(test_cuda_kernels PROPERTIES BUILD_RPATH "\$ORIGIN" INSTALL_RPATH "\$ORIGIN")
  set_tests_properties(test_cuda_kernels PROPERTIES SKIP_RETURN_CODE 77)
endif()
