# Engine area: block pool, prefix index, static scales, and the engine itself
# (sessions, plans, steps on the CPU backend, checked against the oracle).
attnd_add_test(test_blocks SOURCES test_blocks.c LIBS attnd_core TIMEOUT 60)
attnd_add_test(test_prefix SOURCES test_prefix.c LIBS attnd_core TIMEOUT 60)
attnd_add_test(test_scales SOURCES test_scales.c LIBS attnd_core TIMEOUT 60)
attnd_add_test(test_engine SOURCES test_engine.c LIBS attnd_core attnd_oracle TIMEOUT 120)
attnd_add_test(test_engine_perf SOURCES test_engine_perf.c LIBS attnd_core TIMEOUT 60)
