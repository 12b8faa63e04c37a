/* rpc_fixture.h: the shared harness of the RPC layer's tests
 * (tests/test_rpc*.c), which drive it frame by frame without sockets: a fake
 * engine (rpc_fixture.c defines the engine.h functions, so the linker never
 * pulls the real engine in) that records what it was asked and can hold
 * calls in flight, which makes duplicate ids, out-of-order completion, drain
 * and disconnects deterministic; and a fake transport that keeps every
 * response frame. */
#ifndef ATTND_TESTS_RPC_FIXTURE_H
#define ATTND_TESTS_RPC_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pb_decode.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attnd.pb.h"
#include "config.h"
#include "engine.h"
#include "base.h"
#include "rpc.h"
#include "srv_pbw.h"

/* ---- the fake engine ---- */

typedef struct {
  attnd_engine_done_cb cb;
  void *arg;
  attnd_result_t res;
} held_t;

typedef struct {
  int hold; /* 1: calls wait for fake_complete() */
  held_t *held;
  int nheld, capheld;
  /* What the last step saw. */
  attnd_step_req_t step;
  attnd_item_t items[8];
  uint32_t tokens[8][16];
  const uint8_t *frame_lo, *frame_hi;
  int step_in_frame;
  uint64_t last_identity;
  int scales_calls; /* SetScales calls that reached the engine */
  int sinks_calls;  /* SetSinks calls that reached the engine, and the last one's */
  uint32_t sinks_layer;
  size_t sinks_bytes;
  uint64_t closed_conn;
  uint64_t next_plan;
  uint8_t echo[4096];
  /* What the last plan saw: its items' masks, intervals copied. */
  int plans;
  attnd_mask_t plan_mask[8];
  int32_t plan_iv[8][4 * 64];
  uint8_t plan_decode[64]; /* by plan id: every item has n == 1 */
} fake_engine_t;

extern fake_engine_t fe;

/* ---- the fake transport ---- */

typedef struct {
  attnd_rpc_conn_t rc; /* first, so the callbacks can cast */
  uint8_t *out[32];
  size_t outlen[32];
  int close_after[32];
  int nout;
  int released;
  int progress;
  int count_only; /* 1: responses are counted (nresp), not kept */
  long nresp;
} tconn_t;

typedef struct {
  uv_loop_t loop;
  attnd_config_t cfg;
  attnd_rpc_t rpc;
  attnd_engine_t *engine;
  char dir[64];
} fix_t;

/* Completes the i-th held call. */
void fake_complete(int i);
/* Completes every held call, newest first. */
void fake_complete_all(void);

void t_send(attnd_rpc_conn_t *rc, uint8_t *buf, size_t len, int close_after);

void t_released(attnd_rpc_conn_t *rc);

void t_progress(attnd_rpc_conn_t *rc);

void tconn_init(fix_t *f, tconn_t *t, uint64_t identity, int need_hello);

void tconn_free(tconn_t *t);

/* Decodes response i (without its header). */
void resp(tconn_t *t, int i, attnd_v1_Response *r);

/* Hands a copy of w's bytes to rpc as one frame and frees w. */
void send_frame(tconn_t *t, pbw_t *w);

/* Request{id, <call field> = empty message or sub}. */
void send_call(tconn_t *t, uint64_t id, uint32_t call, pbw_t *sub);

int setup(void **state);

int teardown(void **state);

/* One inline item as the wire carries it. */
void put_item(pbw_t *w, uint32_t field, uint64_t session, uint32_t start, uint32_t n,
              int with_tokens);

#endif /* ATTND_TESTS_RPC_FIXTURE_H */
