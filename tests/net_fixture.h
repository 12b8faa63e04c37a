/* net_fixture.h: the shared harness of the transport's tests
 * (tests/test_net_*.c): a server (daemon/net/) with the real engine,
 * configured tiny, running its loop on a second thread, and blocking-socket
 * helpers the tests talk to it with, in raw frames, as any client would. */
#ifndef ATTND_TESTS_NET_FIXTURE_H
#define ATTND_TESTS_NET_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pb_decode.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "attnd.pb.h"
#include "config.h"
#include "engine.h"
#include "base.h"
#include "net.h"
#include "srv_pbw.h"

/* ---- a server on its own loop thread ---- */

typedef struct {
  uv_loop_t loop;
  attnd_config_t cfg;
  attnd_engine_t *engine;
  attnd_server_t *srv;
  attnd_metrics_t *metrics;
  uv_async_t async;
  uv_sem_t sem;
  pthread_t th;
  void (*fn)(void *h);
  int stop;
  int start_rc;
  int loop_close_rc;
  int tcp_port, metrics_port;
  uint64_t epoch;
  attnd_server_stats_t stats;
  char dir[64];
} harness_t;

void h_engine_closed(void *arg);

void h_drained(void *arg);

void h_async_cb(uv_async_t *a);

void *h_thread(void *arg);

/* A small model so the real engine's pool is tiny. */
void small_config(attnd_config_t *c, const char *dir);

harness_t *h_new(void (*tweak)(attnd_config_t *));

void h_start(harness_t *h);

harness_t *h_up(void (*tweak)(attnd_config_t *));

/* Runs fn on the loop thread and waits for it. */
void h_call(harness_t *h, void (*fn)(void *));

void snap_stats(void *arg);

void h_down(harness_t *h);

void sun_set(struct sockaddr_un *a, const char *path);

int connect_unix(const char *path);

int connect_tcp_addr(const char *ip, int port);

void write_all(int fd, const void *p, size_t n);

/* Reads exactly n bytes; 0 on success, 1 on EOF, -1 on timeout. */
int read_all(int fd, void *p, size_t n, int timeout_ms);

void send_raw_frame(int fd, const void *body, size_t n);

/* Like send_call, but a peer that already closed is not a failure: -1. */
int try_send_call(int fd, uint64_t id, uint32_t call);

void send_call(int fd, uint64_t id, uint32_t call);

/* Reads one response; 0, or 1 on EOF. */
int recv_resp(int fd, attnd_v1_Response *r);

void expect_eof(int fd);

void health_ok(int fd, uint64_t id, attnd_v1_Response *r);

uint16_t bf16_rand(void);

/* Request{id, step{layer 0, one inline item (session, start 0, n tokens), q, k, v}}. */
void build_step(pbw_t *w, uint64_t id, uint64_t session, uint32_t n);

uint64_t open_session(int fd, uint64_t id);

void append_frame(pbw_t *all, pbw_t *w);
double now_s(void);

#endif /* ATTND_TESTS_NET_FIXTURE_H */
