# Tests of what attnd fits into: the installable Python package, attnctl's
# command-line habits, the man pages and completion against the binaries'
# --help, the Debian package under lintian, and the tiny Llama example on the
# daemon's built-in shape (the one `make run` serves). Included after
# client.cmake (tests/CMakeLists.txt includes the parts sorted), whose
# attnd_add_e2e() and ATTND_E2E_ENV it uses.

# The example against the built-in 8B-like shape: 32 layers, 32 q / 8 kv heads, d 128.
add_test(NAME e2e_tiny_llama_default
         COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/client/python/examples/tiny_llama.py
                 --spawn ${PROJECT_BINARY_DIR}/daemon/attnd --default-shape)
set_tests_properties(e2e_tiny_llama_default PROPERTIES ENVIRONMENT "${ATTND_E2E_ENV}"
                     SKIP_RETURN_CODE 77 TIMEOUT 300 LABELS "e2e;client")

# pip install ./client/python into fresh venvs: without network (Debian's
# setuptools, numpy, protobuf), and from PyPI at the dependency floors and at
# the newest releases (Skipped when the package index cannot be reached).
attnd_add_e2e(e2e_python_package test_python_package.OfflineInstallTest)
attnd_add_e2e(e2e_pip_install test_python_package.PyPIInstallTest)
set_tests_properties(e2e_pip_install PROPERTIES TIMEOUT 900)

# attnctl: getopt_long forms, exit codes, --version, health --watch, session ids.
attnd_add_e2e(e2e_attnctl_cli test_attnctl_cli)

# Man pages, example config and bash completion against options.toml and the
# binaries' --help (needs the attnd_docs target, built by default).
attnd_add_e2e(e2e_docs test_docs)

# cpack -G DEB, then lintian on the .deb and its -dbgsym .ddeb (Skipped
# without lintian). RUN_SERIAL: cpack's preinstall step looks over the build
# tree, so it does not run beside tests that build.
attnd_add_e2e(e2e_deb_lintian test_deb)
set_tests_properties(e2e_deb_lintian PROPERTIES RUN_SERIAL TRUE)

# The README's Quick start as printed, against the built-in shape.
attnd_add_e2e(e2e_readme test_readme)

# --model-config: shapes from Hugging Face config.json files, the refusals, and
# attnd.model_shape_from_config deriving the same.
attnd_add_e2e(e2e_model_config test_model_config)

# SIGHUP, the log file, journald priorities, failed calls in the log, the
# probes, the host-memory rule; and promtool on a scrape (e2e_promtool:
# Skipped where promtool, from Debian's prometheus package, is not installed).
attnd_add_e2e(e2e_operations test_operations.OperationsTest)
attnd_add_e2e(e2e_promtool test_operations.PromtoolTest)

# The unit's system call sandbox without systemd: attnd-sandbox-exec
# (deploy/sandbox/, built when libseccomp-dev is installed, its static library
# linked in so that the binary can be copied to a GPU host or a container)
# runs the daemon under the unit's SystemCallFilter= and friends, and the
# tiny Llama example must still compute; the checked-in syscall lists must
# equal what systemd-analyze expands (deploy/sandbox-check.sh --no-systemd).
find_path(ATTND_SECCOMP_INCLUDE seccomp.h)
find_library(ATTND_SECCOMP_STATIC NAMES libseccomp.a)
if(ATTND_SECCOMP_INCLUDE AND ATTND_SECCOMP_STATIC)
  add_executable(attnd-sandbox-exec ${PROJECT_SOURCE_DIR}/deploy/sandbox/attnd_sandbox_exec.c)
  target_include_directories(attnd-sandbox-exec PRIVATE ${ATTND_SECCOMP_INCLUDE})
  target_link_libraries(attnd-sandbox-exec PRIVATE ${ATTND_SECCOMP_STATIC})
  attnd_add_e2e(e2e_sandbox test_sandbox)
  set_tests_properties(e2e_sandbox PROPERTIES ENVIRONMENT
                       "${ATTND_E2E_ENV};ATTND_SANDBOX_EXEC=$<TARGET_FILE:attnd-sandbox-exec>")
else()
  message(STATUS "libseccomp-dev not found: attnd-sandbox-exec not built, e2e_sandbox skips")
  attnd_add_e2e(e2e_sandbox test_sandbox)
endif()
