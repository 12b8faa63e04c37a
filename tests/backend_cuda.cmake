# The CUDA backend (daemon/backend/cuda_*.c) judged against the CPU backend on
# the same jobs.
#
# test_backend_cuda: the real thing. Built in every configuration (it links
# the backend library, with or without CUDA) and skipped at run time when no
# CUDA device answers; the GPU round runs it on the H200 from build-gpu/, so it
# finds libcmocka and libuv beside itself.
attnd_add_test(test_backend_cuda SOURCES test_backend_cuda.c test_backend_cuda_ring.c backend_cuda_fixture.c
                       backend_cuda_ipc.c backend_cuda_fault.c test_backend_cuda_small.c
               LIBS attnd_backend TIMEOUT 300
               LABELS "gpu;backend")
set_target_properties(test_backend_cuda PROPERTIES BUILD_RPATH "\$ORIGIN" INSTALL_RPATH "\$ORIGIN")
set_tests_properties(test_backend_cuda PROPERTIES SKIP_RETURN_CODE 77)

# test_backend_cuda_mock: the same test and the real CUDA backend sources,
# compiled with ATTND_HAVE_CUDA, over tests/cuda_mock.c (streams as host
# threads, the CPU kernels as the "device"), so the backend's staging, stream
# ordering, completion, sticky-error and teardown logic runs on machines
# without a GPU. It needs only the CUDA runtime's header, not nvcc or a device.
find_path(ATTND_CUDART_INCLUDE_DIR cuda_runtime_api.h
          HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
if(ATTND_CUDART_INCLUDE_DIR)
  attnd_add_test(test_backend_cuda_mock TIMEOUT 120 LABELS backend
                 SOURCES test_backend_cuda.c test_backend_cuda_ring.c backend_cuda_fixture.c
                         backend_cuda_ipc.c backend_cuda_fault.c test_backend_cuda_small.c cuda_mock.c
                         ${ATTND_BACKEND_CUDA_SRC}
                         ${PROJECT_SOURCE_DIR}/daemon/backend/backend.c
                         ${PROJECT_SOURCE_DIR}/daemon/backend/cpu.c
                 LIBS attnd_base attnd_kernels_cpu PkgConfig::LIBUV Threads::Threads)
  target_compile_definitions(test_backend_cuda_mock PRIVATE ATTND_HAVE_CUDA=1)
  target_include_directories(test_backend_cuda_mock PRIVATE ${PROJECT_SOURCE_DIR}/daemon/backend
                             ${PROJECT_SOURCE_DIR}/kernels/cuda ${ATTND_CUDART_INCLUDE_DIR})
  # A second run: a kernel fault must fail the job and every later one with
  # ATTND_EDEVICE, and teardown must not hang.
  add_test(NAME test_backend_cuda_mock_fault COMMAND test_backend_cuda_mock --fault)
  set_tests_properties(test_backend_cuda_mock_fault PROPERTIES TIMEOUT 60 LABELS backend
                       ENVIRONMENT "ATTND_CUDA_MOCK_FAULT_BLOCK=100000")
  # The same with q, k and v staged by host functions, which a sticky error skips.
  add_test(NAME test_backend_cuda_mock_fault_hostfn
           COMMAND test_backend_cuda_mock --fault --hostfn-min=0)
  set_tests_properties(test_backend_cuda_mock_fault_hostfn PROPERTIES TIMEOUT 60 LABELS backend
                       ENVIRONMENT "ATTND_CUDA_MOCK_FAULT_BLOCK=100000")
  # A fault in a later chunk of a large step staged through the ring.
  add_test(NAME test_backend_cuda_mock_ring_fault COMMAND test_backend_cuda_mock --ring-fault)
  set_tests_properties(test_backend_cuda_mock_ring_fault PROPERTIES TIMEOUT 60 LABELS backend
                       ENVIRONMENT "ATTND_CUDA_MOCK_FAULT_BLOCK=100000")
  # The same with the step's frame and output in the pinned frame pool.
  add_test(NAME test_backend_cuda_mock_ring_fault_pinned
           COMMAND test_backend_cuda_mock --ring-fault-pinned)
  set_tests_properties(test_backend_cuda_mock_ring_fault_pinned PROPERTIES TIMEOUT 60
                       LABELS backend ENVIRONMENT "ATTND_CUDA_MOCK_FAULT_BLOCK=100000")
  # Completion through stream callbacks (--cuda-completion callback) instead of
  # the event poller, with the per-step trace on: the whole test, then the fault.
  add_test(NAME test_backend_cuda_mock_callback COMMAND test_backend_cuda_mock --callback --trace)
  set_tests_properties(test_backend_cuda_mock_callback PROPERTIES TIMEOUT 120 LABELS backend)
  add_test(NAME test_backend_cuda_mock_callback_fault
           COMMAND test_backend_cuda_mock --fault --callback)
  set_tests_properties(test_backend_cuda_mock_callback_fault PROPERTIES TIMEOUT 60 LABELS backend
                       ENVIRONMENT "ATTND_CUDA_MOCK_FAULT_BLOCK=100000")
  # Completion polled by the loop thread too (--cuda-completion loop), with
  # the trace on; then with every output copy left to the poller thread
  # (--hostfn-min=0); then the fault.
  add_test(NAME test_backend_cuda_mock_loop COMMAND test_backend_cuda_mock --loop --trace)
  set_tests_properties(test_backend_cuda_mock_loop PROPERTIES TIMEOUT 120 LABELS backend)
  add_test(NAME test_backend_cuda_mock_loop_handoff
           COMMAND test_backend_cuda_mock --loop --hostfn-min=0)
  set_tests_properties(test_backend_cuda_mock_loop_handoff PROPERTIES TIMEOUT 120 LABELS backend)
  add_test(NAME test_backend_cuda_mock_loop_fault COMMAND test_backend_cuda_mock --fault --loop)
  set_tests_properties(test_backend_cuda_mock_loop_fault PROPERTIES TIMEOUT 60 LABELS backend
                       ENVIRONMENT "ATTND_CUDA_MOCK_FAULT_BLOCK=100000")
  # Small steps as graph launches (--cuda-graphs, here from a shape's first
  # step), with the loop's polling and the trace; then a faulting graph.
  add_test(NAME test_backend_cuda_mock_graphs COMMAND test_backend_cuda_mock --graphs --loop --trace)
  set_tests_properties(test_backend_cuda_mock_graphs PROPERTIES TIMEOUT 120 LABELS backend)
  add_test(NAME test_backend_cuda_mock_graphs_fault COMMAND test_backend_cuda_mock --fault --graphs)
  set_tests_properties(test_backend_cuda_mock_graphs_fault PROPERTIES TIMEOUT 60 LABELS backend
                       ENVIRONMENT "ATTND_CUDA_MOCK_FAULT_BLOCK=100000")
endif()
