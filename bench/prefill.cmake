# bench_prefill: the prefill benchmark of the CUDA kernels (bench/README.md),
# every prefill row beside the Hopper path's variants and the tiled kernel.
if(ATTND_HAVE_CUDA AND TARGET attnd_kernels_cuda)
  add_executable(bench_prefill ${CMAKE_CURRENT_SOURCE_DIR}/bench_prefill.cu
                 ${CMAKE_CURRENT_SOURCE_DIR}/bench_common.cu)
  target_link_libraries(bench_prefill PRIVATE attnd_kernels_cuda)
  set_target_properties(bench_prefill PROPERTIES CUDA_RUNTIME_LIBRARY Static)
endif()
# The "base" variant: another commit's Hopper prefill kernels, built in
# (kernels/cuda/CMakeLists.txt, ATTND_SM90_BASE_DIR).
if(TARGET bench_prefill AND ATTND_SM90_BASE_DIR)
  target_compile_definitions(bench_prefill PRIVATE ATTND_SM90_BASE=1)
endif()
