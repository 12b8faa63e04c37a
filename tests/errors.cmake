attnd_add_test(test_errors SOURCES test_errors.c LIBS attnd_base)
