# The daemon's layers other than the engine and the backend (engine.cmake,
# backend_cuda.cmake), one test per layer or module, as the tree reads:
# base, config, rpc, net (framing, then listeners and connections).
attnd_add_test(test_base SOURCES test_base.c LIBS attnd_base TIMEOUT 30)
attnd_add_test(test_config SOURCES test_config.c LIBS attnd_config TIMEOUT 30 LABELS server)
attnd_add_test(test_rpc SOURCES test_rpc.c LIBS attnd_rpc TIMEOUT 60 LABELS server)
attnd_add_test(test_net_frame SOURCES test_net_frame.c LIBS attnd_net TIMEOUT 30 LABELS server)
attnd_add_test(test_net_server SOURCES test_net_server.c LIBS attnd_net TIMEOUT 120 LABELS server)
# Both spawn the real daemon ($ATTND_BUILD_DIR/daemon/attnd).
add_dependencies(test_config attnd)
add_dependencies(test_net_server attnd)

# The tree's shape: file sizes, the layers' include and link rules, and no
# reference to anything outside the project (tests/test_layout.py).
add_test(NAME test_layout COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/test_layout.py
         ${PROJECT_SOURCE_DIR})
set_tests_properties(test_layout PROPERTIES TIMEOUT 60 LABELS layout)
