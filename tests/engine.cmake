# Engine area: block pool, prefix index, static scales, and the engine itself
# (sessions, plans, steps on the CPU backend, checked against the oracle).
attnd_add_test(test_blocks SOURCES test_blocks.c LIBS attnd_engine TIMEOUT 60)
attnd_add_test(test_prefix SOURCES test_prefix.c LIBS attnd_engine TIMEOUT 60)
attnd_add_test(test_scales SOURCES test_scales.c LIBS attnd_engine TIMEOUT 60)
attnd_add_test(test_engine SOURCES test_engine.c LIBS attnd_engine attnd_oracle TIMEOUT 120)
attnd_add_test(test_engine_perf SOURCES test_engine_perf.c LIBS attnd_engine TIMEOUT 60)
# Tests of the engine's private modules see its internal.h.
foreach(t test_blocks test_prefix test_scales test_engine)
  target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/daemon/engine)
endforeach()
