# The daemon's server side: config, framing, RPC dispatch, listeners, metrics.
attnd_add_test(test_frame SOURCES test_frame.c LIBS attnd_net TIMEOUT 30 LABELS server)
attnd_add_test(test_config SOURCES test_config.c LIBS attnd_config TIMEOUT 30 LABELS server)
attnd_add_test(test_rpc SOURCES test_rpc.c LIBS attnd_rpc TIMEOUT 60 LABELS server)
attnd_add_test(test_server SOURCES test_server.c LIBS attnd_net TIMEOUT 120 LABELS server)
# Both spawn the real daemon ($ATTND_BUILD_DIR/daemon/attnd).
add_dependencies(test_config attnd)
add_dependencies(test_server attnd)
