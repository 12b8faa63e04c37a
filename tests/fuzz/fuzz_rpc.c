/* fuzz_rpc: a libFuzzer harness over the daemon's real request path.
 *
 * One input is the byte stream a client would send on one connection: frames
 * (4-byte big-endian length, then a Request). The bytes go through the real
 * frame reader (daemon/net/frame.c), every frame through the real RPC layer
 * (daemon/rpc/: the method table, decoding, encoding) into a real engine
 * (daemon/engine/) on the CPU backend (daemon/backend/cpu.c) with a tiny
 * model, exactly as daemon/net/ wires them, minus the socket.
 *
 * Session and plan ids are random in the daemon, which a fuzzer cannot guess;
 * the link wraps attnd_random_id() (-Wl,--wrap) so that, within one input, the
 * ids drawn are 1, 2, 3, ... in order. Seeds (gen_corpus.py) name session 1,
 * plan 2, and so on.
 *
 * After each input the harness checks what must hold whatever the bytes were:
 * every response decodes as a Response, every request that reached dispatch
 * is answered exactly once (a connection that ends, on a framing error or a
 * failed Hello, still answers every call admitted before it), and
 * once every session is closed the engine's bookkeeping passes
 * attnd_engine_check() and no block stays in use. Any failure aborts, so
 * libFuzzer records the input as a crash.
 *
 * Environment: ATTND_FUZZ_KV_CACHE picks the cache type (default bf16);
 * ATTND_FUZZ_SINKS=1 starts the daemon with attention sinks (steps then need
 * SetSinks first; the set_sinks seed does it). Layer 0 always slides by 5
 * keys and scores are soft-capped at 30 (docs/numerics.md §5);
 * ATTND_FUZZ_VERBOSE=1 prints every response's status (to check seeds);
 * ATTND_FUZZ_CONNS=2 hands the frames to two connections of the same
 * identity in turn (even frames to the first), so calls of one connection
 * pass another's queued ones (docs/sessions.md §5). Steps of more than
 * OFFLOAD bytes are scanned on the worker pool and queued, as 1 MiB ones are
 * in the daemon. The CPU backend has stand-in zero-copy ops over an arena
 * (give_ipc_ops), so steps by reference run too. */
#include <pb_decode.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "attnd.pb.h"
#include "config.h"
#include "engine.h"
#include "base.h"
#include "internal.h" /* daemon/engine: its backend, given stand-in zero-copy ops */
#include "net.h"
#include "rpc.h"

/* The connection is the daemon's own uid on the Unix socket: an operator, so
 * SetScales seeds reach the engine (docs/protocol.md section 1). */
#define FUZZ_IDENTITY ((uint64_t)geteuid())

/* ---- deterministic ids ----------------------------------------------------- */

static uint64_t next_id;
uint64_t __real_attnd_random_id(void);
uint64_t __wrap_attnd_random_id(void);
uint64_t __wrap_attnd_random_id(void) {
  return ++next_id;
}

/* ---- stand-in zero-copy ---------------------------------------------------- */

/* The CPU backend given zero-copy ops, as in test_engine_ipc: every handle
 * (but one whose first byte is 0xff: "the driver cannot open it") maps this
 * arena, so RegisterBuffer, refs, their bounds, the device check (a CHECK
 * job, run by the CPU backend over host memory) and steps that read and
 * write client memory are fuzzed too; a region past the registration would
 * be an ASan report, not a silent read. The backend's device UUID is the
 * seeds' (gen_corpus.py). */
enum { ARENA_BYTES = 1 << 20 };
static _Alignas(256) uint8_t arena[ARENA_BYTES];
static attnd_backend_ops_t ipc_ops;

static int f_ipc_open(attnd_backend_t *b, const uint8_t *handle, void **base, size_t *size,
                      char *err, size_t errlen) {
  if (handle[0] == 0xff) {
    snprintf(err, errlen, "stand-in: no such handle");
    return ATTND_EPRECOND;
  }
  *base = arena;
  *size = ARENA_BYTES;
  return 0;
}

static void f_ipc_close(attnd_backend_t *b, void *base) {}

static void give_ipc_ops(attnd_engine_t *e) {
  ipc_ops = *e->be->ops;
  ipc_ops.ipc_open = f_ipc_open;
  ipc_ops.ipc_close = f_ipc_close;
  e->be->ops = &ipc_ops;
  snprintf(e->be->device_uuid, sizeof(e->be->device_uuid),
           "GPU-00000000-0000-0000-0000-000000000000");
}

/* ---- one fake transport --------------------------------------------------- */

typedef struct {
  attnd_rpc_conn_t rc; /* first, so the callbacks can cast */
  uint64_t handed;     /* frames given to attnd_rpc_handle_frame */
  uint64_t answered;   /* responses sent */
  int close_seen;      /* a response asked for the connection to close */
  int released;
} fconn_t;

static struct {
  uv_loop_t loop;
  attnd_config_t cfg;
  attnd_engine_t *engine;
  attnd_rpc_t rpc;
  char state_dir[64];
  int ready;
} F;

static int verbose; /* ATTND_FUZZ_VERBOSE=1: print each response's status */
static int nconns;  /* ATTND_FUZZ_CONNS: 1 or 2 */
enum { OFFLOAD = 2048 };

/* The connections of one input and how many frames went to them. */
static struct {
  fconn_t c[2];
  uint64_t frames;
} P;

static int any_ended(void) {
  for (int i = 0; i < nconns; i++)
    if (P.c[i].close_seen || P.c[i].rc.ending)
      return 1;
  return 0;
}

static void die(const char *what, const char *detail) {
  fprintf(stderr, "fuzz_rpc: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
  abort();
}

static void f_send(attnd_rpc_conn_t *rc, uint8_t *buf, size_t len, int close_after) {
  fconn_t *c = (fconn_t *)rc;
  if (len < 4)
    die("response shorter than its header", NULL);
  uint32_t n =
      ((uint32_t)buf[0] << 24) | ((uint32_t)buf[1] << 16) | ((uint32_t)buf[2] << 8) | buf[3];
  if (n != len - 4)
    die("response header disagrees with its length", NULL);
  /* Every response must decode (its oneof results are plain messages except
   * the callback fields, which nanopb skips when no callback is set). */
  attnd_v1_Response r = attnd_v1_Response_init_zero;
  pb_istream_t s = pb_istream_from_buffer(buf + 4, n);
  if (!pb_decode(&s, attnd_v1_Response_fields, &r))
    die("response does not decode", PB_GET_ERROR(&s));
  if (!r.has_status)
    die("response without status", NULL);
  if (verbose)
    fprintf(stderr, "  id %llu status %d %s%s\n", (unsigned long long)r.id, (int)r.status.code,
            r.status.message, close_after ? " (close)" : "");
  if (close_after)
    c->close_seen = 1;
  c->answered++;
  free(buf);
}
static void f_progress(attnd_rpc_conn_t *rc) {}
static void f_released(attnd_rpc_conn_t *rc) {
  ((fconn_t *)rc)->released = 1;
}

/* Runs the loop until no request is in flight anywhere. */
static void drain(void) {
  while (F.rpc.inflight > 0)
    uv_run(&F.loop, UV_RUN_ONCE);
}

static int frame_cb(void *arg, uint8_t *frame, size_t len) {
  (void)arg;
  /* As the transport does: once a connection ends, nothing more is read
   * (from either: the input is one stream). */
  if (any_ended()) {
    free(frame);
    return -1;
  }
  fconn_t *c = &P.c[P.frames++ % (uint64_t)nconns];
  c->handed++;
  attnd_rpc_handle_frame(&c->rc, frame, len);
  /* Let a few requests pipeline, as a client would, but keep the memory a
   * single input can pin bounded. */
  if (c->rc.pending >= 8)
    drain();
  return any_ended() ? -1 : 0;
}

static void rm_state(void) {
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", F.state_dir);
  if (system(cmd) != 0)
    fprintf(stderr, "fuzz_rpc: could not remove %s\n", F.state_dir);
}

static void setup(void) {
  if (F.ready)
    return;
  snprintf(F.state_dir, sizeof(F.state_dir), "/tmp/attnd-fuzz-XXXXXX");
  if (!mkdtemp(F.state_dir))
    die("mkdtemp", NULL);
  atexit(rm_state);
  if (uv_loop_init(&F.loop) != 0)
    die("uv_loop_init", NULL);
  const char *kv = getenv("ATTND_FUZZ_KV_CACHE");
  verbose = getenv("ATTND_FUZZ_VERBOSE") != NULL;
  const char *nc = getenv("ATTND_FUZZ_CONNS");
  nconns = nc && nc[0] == '2' ? 2 : 1;
  char sd[96];
  snprintf(sd, sizeof(sd), "--state-dir=%s", F.state_dir);
  char kvarg[64];
  snprintf(kvarg, sizeof(kvarg), "--kv-cache=%s", kv && kv[0] ? kv : "bf16");
  const char *sk = getenv("ATTND_FUZZ_SINKS");
  char skarg[64];
  snprintf(skarg, sizeof(skarg), "--attention-sinks=%s", sk && sk[0] == '1' ? "true" : "false");
  /* A tiny model: 2 layers, GQA 4/2, d 64, blocks of 16 tokens, a context of
   * 256 and a pool of 48 blocks, so OUT_OF_RANGE and RESOURCE_EXHAUSTED are
   * a few frames away. */
  char *argv[] = {"fuzz_rpc",
                  "--backend=cpu",
                  "--layers=2",
                  "--q-heads=4",
                  "--kv-heads=2",
                  "--head-dim=64",
                  "--block-size=16",
                  "--max-context=256",
                  "--kv-memory=393216",
                  "--max-sessions=8",
                  "--max-plans=4",
                  "--threads=1",
                  "--max-frame=1M",
                  "--max-inflight=4M",
                  "--log-level=error",
                  "--model-id=fuzz",
                  "--rope=neox",
                  "--attention-windows=5,0",
                  "--softcap=30",
                  sd,
                  kvarg,
                  skarg};
  int argc = (int)(sizeof(argv) / sizeof(argv[0]));
  char err[256];
  attnd_config_defaults(&F.cfg);
  if (attnd_config_parse(&F.cfg, argc, argv, err, sizeof(err)) != 0)
    die("config", err);
  if (attnd_config_validate(&F.cfg, err, sizeof(err)) != 0)
    die("config", err);
  attnd_log_set_level(ATTND_LOG_ERROR);
  if (attnd_engine_init(&F.engine, &F.loop, &F.cfg, err, sizeof(err)) != 0)
    die("engine init", err);
  give_ipc_ops(F.engine);
  if (attnd_rpc_init(&F.rpc, &F.loop, F.engine, &F.cfg, err, sizeof(err)) != 0)
    die("rpc init", err);
  attnd_engine_set_offload_bytes(F.engine, OFFLOAD);
  /* Queued steps' scans in parts on the pool, as on a machine with cores to spare. */
  attnd_engine_set_scan_parts(F.engine, 3, 1);
  F.ready = 1;
}

static void closed_cb(void *arg, attnd_result_t *res) {}

/* Closes every session the input left open and checks the engine. */
static void reset_and_check(void) {
  attnd_session_info_t ss[64];
  uint32_t n;
  while ((n = attnd_engine_list_sessions(F.engine, FUZZ_IDENTITY, ss, 64)) > 0) {
    uint32_t m = n < 64 ? n : 64;
    for (uint32_t i = 0; i < m; i++)
      attnd_engine_close_session(F.engine, FUZZ_IDENTITY, 1, ss[i].session, closed_cb, NULL);
    /* Closes may wait for steps still running on the backend. */
    for (int spins = 0; attnd_engine_list_sessions(F.engine, FUZZ_IDENTITY, ss, 1) == n; spins++) {
      if (spins > 100000)
        die("sessions do not close", NULL);
      uv_run(&F.loop, UV_RUN_NOWAIT);
    }
  }
  /* Let any queued backend work (copy-on-write, scale persistence) finish. */
  attnd_engine_stats_t st;
  char err[256];
  for (int spins = 0;; spins++) {
    uv_run(&F.loop, UV_RUN_NOWAIT);
    attnd_engine_stats(F.engine, &st);
    if (st.blocks_used == 0 && attnd_engine_check(F.engine, err, sizeof(err)) == 0)
      break;
    if (spins > 200000) {
      if (attnd_engine_check(F.engine, err, sizeof(err)) != 0)
        die("engine check", err);
      fprintf(stderr, "fuzz_rpc: %u blocks still used with no session open\n", st.blocks_used);
      abort();
    }
    usleep(10);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  setup();
  next_id = 0;
  memset(&P, 0, sizeof(P));
  for (int i = 0; i < nconns; i++) {
    fconn_t *c = &P.c[i];
    attnd_rpc_conn_init(&c->rc, &F.rpc, FUZZ_IDENTITY, 0);
    c->rc.send = f_send;
    c->rc.progress = f_progress;
    c->rc.released = f_released;
  }

  attnd_frame_reader_t fr;
  attnd_frame_reader_init(&fr, F.cfg.max_frame);
  int rc = attnd_frame_reader_feed(&fr, data, size, frame_cb, NULL);
  int ended = any_ended();
  /* The framing error is answered too, on the connection the frame was for. */
  fconn_t *next = &P.c[P.frames % (uint64_t)nconns];
  if (rc == ATTND_ENOSPC && !ended) {
    next->handed++;
    attnd_rpc_frame_error(&next->rc, ATTND_ENOSPC, "frame too large");
  } else if (rc == ATTND_EINVAL && !ended) {
    next->handed++;
    attnd_rpc_frame_error(&next->rc, ATTND_EINVAL, "zero-length frame");
  } else if (rc < 0 && rc != -1) {
    die("frame reader", attnd_strerror(rc));
  }
  attnd_frame_reader_free(&fr);

  /* Every frame handed over is answered, close or not. */
  drain();
  for (int i = 0; i < nconns; i++) {
    fconn_t *c = &P.c[i];
    if (c->answered != c->handed) {
      fprintf(stderr, "fuzz_rpc: connection %d: %llu requests, %llu responses\n", i,
              (unsigned long long)c->handed, (unsigned long long)c->answered);
      abort();
    }
    if (c->rc.ending && !c->close_seen)
      die("an ended connection was never told to close", NULL);
  }
  /* The transports go away: in-flight results are dropped, plans end. */
  for (int i = 0; i < nconns; i++) {
    fconn_t *c = &P.c[i];
    if (!attnd_rpc_conn_closed(&c->rc)) {
      while (!c->released)
        uv_run(&F.loop, UV_RUN_ONCE);
    }
  }
  drain();
  reset_and_check();
  return 0;
}
