# The daemon's layers other than the engine and the backend (engine.cmake,
# backend_cuda.cmake), one test per layer or module, as the tree reads:
# base, config, rpc, net (framing, then listeners and connections).
attnd_add_test(test_base SOURCES test_base.c LIBS attnd_base TIMEOUT 30)
attnd_add_test(test_base_log SOURCES test_base_log.c LIBS attnd_base TIMEOUT 30)
attnd_add_test(test_config SOURCES test_config.c LIBS attnd_config TIMEOUT 30 LABELS server)
# The RPC layer's tests share a fake engine and transport (rpc_fixture.c),
# compiled into each test so that its engine functions stand in for the real
# engine's.
foreach(t test_rpc test_rpc_methods test_rpc_decode test_rpc_auth)
  attnd_add_test(${t} SOURCES ${t}.c rpc_fixture.c LIBS attnd_rpc TIMEOUT 60 LABELS server)
endforeach()
attnd_add_test(test_net_frame SOURCES test_net_frame.c LIBS attnd_net TIMEOUT 30 LABELS server)
# The transport's tests share a server harness (net_fixture.c).
add_library(attnd_net_fixture STATIC ${CMAKE_CURRENT_SOURCE_DIR}/net_fixture.c)
target_link_libraries(attnd_net_fixture PUBLIC attnd_net PkgConfig::CMOCKA Threads::Threads)
target_include_directories(attnd_net_fixture PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
foreach(m listen conn limits drain metrics)
  attnd_add_test(test_net_${m} SOURCES test_net_${m}.c LIBS attnd_net_fixture TIMEOUT 120
                 LABELS server)
endforeach()
# These spawn the real daemon ($ATTND_BUILD_DIR/daemon/attnd).
add_dependencies(test_config attnd)
add_dependencies(test_net_drain attnd)

# The tree's shape: file sizes, the layers' include and link rules, and no
# reference to anything outside the project (tests/test_layout.py).
add_test(NAME test_layout COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/test_layout.py
         ${PROJECT_SOURCE_DIR})
set_tests_properties(test_layout PROPERTIES TIMEOUT 60 LABELS layout)
