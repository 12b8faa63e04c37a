# bench_kernels: the CUDA kernel benchmark (bench/README.md). Built with the
# CUDA backend; run on the GPU machine (bench/README.md, "One GPU round").
if(ATTND_HAVE_CUDA AND TARGET attnd_kernels_cuda)
  add_executable(bench_kernels ${CMAKE_CURRENT_SOURCE_DIR}/bench_kernels.cu
                 ${CMAKE_CURRENT_SOURCE_DIR}/bench_decode.cu
                 ${CMAKE_CURRENT_SOURCE_DIR}/bench_common.cu)
  target_link_libraries(bench_kernels PRIVATE attnd_kernels_cuda)
  set_target_properties(bench_kernels PROPERTIES CUDA_RUNTIME_LIBRARY Static)
endif()
