# The CUDA backend (daemon/backend_cuda.c) judged against the CPU backend on the
# same jobs. Built in every configuration (it links attnd_core, with or without
# CUDA) and skipped at run time when no CUDA device answers; the GPU round runs
# it on the H200 from build-gpu/, so it finds libcmocka and libuv beside itself.
attnd_add_test(test_backend_cuda SOURCES test_backend_cuda.c LIBS attnd_core TIMEOUT 300
               LABELS "gpu;backend")
set_target_properties(test_backend_cuda PROPERTIES BUILD_RPATH "\$ORIGIN" INSTALL_RPATH "\$ORIGIN")
