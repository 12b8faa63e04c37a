# The engine (daemon/engine/), one test per module, on the CPU backend and
# judged against the float64 oracle through the shared fixture
# (engine_fixture.c). The module tests of the engine's private parts (pool,
# prefix index, scales table) see daemon/engine/internal.h.
add_library(attnd_engine_fixture STATIC ${CMAKE_CURRENT_SOURCE_DIR}/engine_fixture.c)
target_link_libraries(attnd_engine_fixture PUBLIC attnd_engine attnd_oracle PkgConfig::CMOCKA)
target_include_directories(attnd_engine_fixture PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})

foreach(m step plan session kvcache jobs queue order check scales)
  attnd_add_test(test_engine_${m} SOURCES test_engine_${m}.c LIBS attnd_engine_fixture TIMEOUT 120)
endforeach()
attnd_add_test(test_engine_blocks SOURCES test_engine_blocks.c LIBS attnd_engine TIMEOUT 60)
attnd_add_test(test_engine_prefix SOURCES test_engine_prefix.c LIBS attnd_engine TIMEOUT 60)
attnd_add_test(test_engine_perf SOURCES test_engine_perf.c LIBS attnd_engine TIMEOUT 60)
# The attention sinks table: validation, versions, its file (daemon/engine/sinks.c).
attnd_add_test(test_engine_sinks SOURCES test_engine_sinks.c LIBS attnd_engine TIMEOUT 60)
attnd_add_test(test_engine_scan SOURCES test_engine_scan.c LIBS attnd_engine TIMEOUT 60)
# Host memory of frames and outputs: large plain buffers kept for reuse (daemon/engine/hostmem.c).
attnd_add_test(test_engine_hostmem SOURCES test_engine_hostmem.c LIBS attnd_engine_fixture TIMEOUT 60)
# Same-host zero-copy: the engine's mappings and device steps (daemon/engine/ipc.c),
# over the CPU backend given stand-in zero-copy ops.
attnd_add_test(test_engine_ipc SOURCES test_engine_ipc.c LIBS attnd_engine_fixture TIMEOUT 60)
foreach(t test_engine_blocks test_engine_prefix test_engine_scales test_engine_kvcache
        test_engine_sinks test_engine_scan test_engine_ipc test_engine_order test_engine_hostmem)
  target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/daemon/engine)
endforeach()
