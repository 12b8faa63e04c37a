# bench_loads: the load-mechanism probe over the decode kernel's paged layout
# (bench/bench_loads.cu; bench/README.md). Needs the sm_90a bulk copies, so
# only in builds for that target; no attnd library, only the CUDA runtime.
if(ATTND_HAVE_CUDA AND CMAKE_CUDA_ARCHITECTURES MATCHES "90a")
  add_executable(bench_loads ${CMAKE_CURRENT_SOURCE_DIR}/bench_loads.cu)
  target_include_directories(bench_loads PRIVATE ${PROJECT_SOURCE_DIR}/kernels/cuda ${PROJECT_SOURCE_DIR}/kernels)
  target_compile_options(bench_loads PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  set_target_properties(bench_loads PROPERTIES CUDA_RUNTIME_LIBRARY Static)
endif()
