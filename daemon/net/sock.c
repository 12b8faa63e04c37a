/* sock.c: the one TCP socket helper (internal.h), for the RPC listener and
 * the /metrics listener alike. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

int attnd_net_tcp_listen(uv_loop_t *loop, uv_tcp_t *tcp, const char *hostport, const char *flag,
                         int backlog, uv_connection_cb cb, int *inited, int *port, char *host,
                         size_t hostlen, char *err, size_t errlen) {
  struct sockaddr_storage ss;
  int p, rc;
  *inited = 0;
  if (attnd_config_hostport(hostport, host, hostlen, &p)) {
    snprintf(err, errlen, "%s '%s': expected HOST:PORT", flag, hostport);
    return ATTND_EINVAL;
  }
  if (strcmp(host, "localhost") == 0)
    snprintf(host, hostlen, "127.0.0.1");
  if (uv_ip4_addr(host, p, (struct sockaddr_in *)&ss) != 0 &&
      uv_ip6_addr(host, p, (struct sockaddr_in6 *)&ss) != 0) {
    snprintf(err, errlen, "%s '%s': host must be a numeric address or localhost", flag, hostport);
    return ATTND_EINVAL;
  }
  uv_tcp_init(loop, tcp);
  *inited = 1;
  if ((rc = uv_tcp_bind(tcp, (struct sockaddr *)&ss, 0)) != 0 ||
      (rc = uv_listen((uv_stream_t *)tcp, backlog, cb)) != 0) {
    snprintf(err, errlen, "%s %s: %s", flag, hostport, uv_strerror(rc));
    return ATTND_EIO;
  }
  struct sockaddr_storage bound;
  int bl = sizeof(bound);
  uv_tcp_getsockname(tcp, (struct sockaddr *)&bound, &bl);
  *port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                            : ((struct sockaddr_in *)&bound)->sin_port);
  return 0;
}
