# Client-side tests: libattnclient and attnctl (cmocka), the Python end-to-end
# tests (tests/e2e, run with /usr/bin/python3's unittest), the tiny Llama
# example, and the systemd units. Tests that need the daemon start the real
# one ($BUILD/daemon/attnd) and skip (ctest "Skipped", exit 77) until it exists
# or while the engine answers UNIMPLEMENTED.
if(TARGET attnctl)
  attnd_add_test(test_client SOURCES test_client.c LIBS attnd_client TIMEOUT 120 LABELS client)
  add_dependencies(test_client attnctl)
endif()

set(ATTND_E2E_ENV
    "ATTND_BUILD_DIR=${PROJECT_BINARY_DIR}"
    "ATTND_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
    "PYTHONPATH=${PROJECT_BINARY_DIR}/python:${PROJECT_SOURCE_DIR}/client/python"
    "PYTHONDONTWRITEBYTECODE=1")

# attnd_add_e2e(name module...): one ctest running those unittest modules.
function(attnd_add_e2e name)
  add_test(NAME ${name}
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/e2e/run.py ${ARGN}
           WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/e2e)
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${ATTND_E2E_ENV}" SKIP_RETURN_CODE 77
                       TIMEOUT 300 LABELS "e2e;client")
endfunction()

attnd_add_e2e(e2e_client_fake test_client_fake)
attnd_add_e2e(e2e_torch_client test_torch_client)
# The Python client's hand-framed steps and cut answers (attnd/_frames.py), no daemon.
attnd_add_e2e(e2e_frames test_frames)
attnd_add_e2e(e2e_health test_health)
# Same-host zero-copy: RegisterBuffer's refusals here; the IPC path itself on a GPU.
attnd_add_e2e(e2e_ipc test_ipc)
# Per-layer windows, soft-capping and sinks against the numpy reference; SetSinks.
attnd_add_e2e(e2e_variants test_variants)
attnd_add_e2e(e2e_sessions test_sessions)
attnd_add_e2e(e2e_systemd test_systemd)
attnd_add_e2e(e2e_package test_package)
attnd_add_e2e(e2e_scales test_scales)
attnd_add_e2e(e2e_hf_adapter test_hf_adapter)
attnd_add_e2e(e2e_prefix_acceptance test_prefix_acceptance)
# The same sessions and bad inputs with every step admitted through the
# engine's admission queue (finiteness scan on the worker pool,
# docs/sessions.md) and every step's output written to the socket by
# reference (rpc sendv): the thresholds that normally keep small steps on the
# direct paths are 0; and the loop busy-polls after activity (--busy-poll-us).
attnd_add_e2e(e2e_sessions_queued test_sessions test_reliability_badinput)
set_tests_properties(e2e_sessions_queued PROPERTIES ENVIRONMENT "${ATTND_E2E_ENV};ATTND_E2E_DAEMON_ARGS=--engine-offload-bytes 0 --rpc-ref-min 0 --busy-poll-us 200")

add_test(NAME e2e_tiny_llama
         COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/client/python/examples/tiny_llama.py
                 --spawn ${PROJECT_BINARY_DIR}/daemon/attnd)
set_tests_properties(e2e_tiny_llama PROPERTIES ENVIRONMENT "${ATTND_E2E_ENV}" SKIP_RETURN_CODE 77
                     TIMEOUT 300 LABELS "e2e;client")
