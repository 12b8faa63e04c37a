# Scale-out tests (docs/scale-out.md): the Python fan-out clients (lse merge,
# placement ring, head-sharded and split-context groups of daemons), the C
# client's sharded mode, and the Kubernetes manifests' schema validation.
# Daemon-backed cases start several small CPU daemons (2-5 per test): head
# shards with --kv-heads A:B and split-context parts against one daemon.
if(COMMAND attnd_add_e2e)
  attnd_add_e2e(e2e_scaleout_merge test_scaleout_merge)
  attnd_add_e2e(e2e_scaleout_placement test_scaleout_placement)
  attnd_add_e2e(e2e_scaleout_sharded test_scaleout_sharded)
  attnd_add_e2e(e2e_scaleout_split test_scaleout_split)
  set_tests_properties(e2e_scaleout_merge e2e_scaleout_placement e2e_scaleout_sharded
                       e2e_scaleout_split PROPERTIES LABELS "e2e;client;scaleout")
endif()

# libattnclient's sharded mode: layout checks without a daemon, then two shard
# daemons against one (skipped when the daemon is not built).
if(TARGET attnd_client)
  attnd_add_test(test_client_shard SOURCES test_client_shard.c LIBS attnd_client TIMEOUT 120
                 LABELS "client;scaleout")
  if(TARGET attnd)
    add_dependencies(test_client_shard attnd)
  endif()
endif()

# The Kubernetes manifests (deploy/k8s), rendered and validated offline.
add_test(NAME scaleout_k8s COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scaleout_k8s.sh)
set_tests_properties(scaleout_k8s PROPERTIES
                     ENVIRONMENT "ATTND_BUILD_DIR=${PROJECT_BINARY_DIR};ATTND_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
                     SKIP_RETURN_CODE 77 TIMEOUT 600 LABELS "deploy;scaleout")
