/* attnctl_bench.c: `attnctl bench`, a closed-loop load generator.
 *
 * Opens --sessions sessions, prefills each with a --prompt token prompt in one
 * Plan and one Step per layer, then runs --steps decode steps (a Plan for all
 * sessions, one Step per layer with random bf16 q, k, v; --depth layer steps in
 * flight) and prints latency percentiles per layer step and per token, with
 * where a layer step's time went: the client's phases (attnd_client_phases)
 * and the daemon's own total and computing time (Timing). --repeat prefills
 * again after truncating the sessions, for percentiles of large steps. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attnctl.h"

static uint64_t rng_state;
static uint64_t rng_next(void) {
  /* splitmix64: fast, and reproducible from --seed. */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

typedef struct {
  double *v;
  size_t n, cap;
} lat_t;

static void lat_add(lat_t *l, double x) {
  if (l->n == l->cap) {
    l->cap = l->cap ? l->cap * 2 : 256;
    double *nv = realloc(l->v, l->cap * sizeof(double));
    if (!nv)
      abort();
    l->v = nv;
  }
  l->v[l->n++] = x;
}

static double lat_pct(lat_t *l, double p) {
  if (!l->n)
    return NAN;
  size_t i = (size_t)ceil(p / 100.0 * (double)l->n);
  if (i > 0)
    i--;
  if (i >= l->n)
    i = l->n - 1;
  return l->v[i];
}

typedef struct {
  attnd_client_t *c;
  const attnctl_opts_t *o;
  const attnd_v1_HealthResponse *h;
  const uint16_t *pool; /* random bf16 values */
  size_t pool_elems;
  lat_t step_lat;       /* one layer step, seconds */
  int kind;             /* what the layer steps are now: 0 prefill, 1 decode */
  lat_t srv_total[2];   /* the daemon's Timing.total_us of each layer step, seconds */
  lat_t srv_compute[2]; /* its Timing.computing_us */
  lat_t cl[2][5];       /* the client's phases: encode, send, wait, read, parse */
} bench_t;

static const char *const cl_name[5] = {"client encode", "client send", "client wait", "client read",
                                       "client parse"};

static const uint16_t *pool_at(bench_t *b, size_t elems) {
  size_t off = elems < b->pool_elems ? (size_t)(rng_next() % (b->pool_elems - elems + 1)) : 0;
  return b->pool + off;
}

/* One pass of a step through every layer: Plan (unless inline), then one Step per
 * layer with up to --depth in flight. Returns 0 or an attnctl exit code. */
static int bench_pass(bench_t *b, const attnd_client_item_t *items, size_t nitems, uint32_t rows,
                      lat_t *lat) {
  const attnd_v1_ModelShape *m = &b->h->model;
  uint64_t plan = 0;
  double t0 = attnctl_now();
  int rc;
  if (b->o->use_plan && (rc = attnd_client_plan(b->c, items, nitems, &plan)) != 0)
    return attnctl_report(b->c, rc, "bench plan");
  uint32_t layers = m->layers;
  uint64_t *ids = calloc(layers, sizeof(uint64_t));
  double *sent = calloc(layers, sizeof(double));
  if (!ids || !sent)
    abort();
  uint32_t next = 0, done = 0;
  rc = 0;
  while (done < layers && !rc) {
    while (next < layers && next - done < (uint32_t)b->o->depth) {
      attnd_client_step_t s;
      memset(&s, 0, sizeof(s));
      s.layer = next;
      s.plan = plan;
      s.items = items;
      s.nitems = nitems;
      s.dtype =
          strcmp(m->dtype, "fp16") == 0 ? attnd_v1_DType_DTYPE_FP16 : attnd_v1_DType_DTYPE_BF16;
      s.q_heads = m->q_heads;
      s.kv_heads = m->kv_heads;
      s.head_dim = m->head_dim;
      s.q_rows = rows;
      s.kv_rows = rows;
      s.q = pool_at(b, (size_t)rows * m->q_heads * m->head_dim);
      s.k = pool_at(b, (size_t)rows * m->kv_heads * m->head_dim);
      s.v = pool_at(b, (size_t)rows * m->kv_heads * m->head_dim);
      s.want_lse = b->o->want_lse;
      sent[next] = attnctl_now();
      if ((rc = attnd_client_step_send(b->c, &s, &ids[next])) != 0)
        break;
      attnd_client_phases_t ph;
      attnd_client_phases(b->c, &ph);
      lat_add(&b->cl[b->kind][0], ph.encode_us * 1e-6);
      lat_add(&b->cl[b->kind][1], ph.send_us * 1e-6);
      next++;
    }
    if (rc)
      break;
    attnd_client_resp_t r;
    rc = attnd_client_recv(b->c, ids[done], &r);
    if (rc == 0) {
      const uint8_t *out;
      size_t nb;
      if (attnd_client_resp_tensor(&r, 0, &out, &nb, NULL) != 0 ||
          nb != (size_t)rows * m->q_heads * m->head_dim * 2) {
        fprintf(stderr, "attnctl: bench: step output of layer %u has the wrong size\n", done);
        attnd_client_resp_free(&r);
        free(ids);
        free(sent);
        return ATTNCTL_DAEMON;
      }
      lat_add(&b->step_lat, attnctl_now() - sent[done]);
      attnd_client_phases_t ph;
      attnd_client_phases(b->c, &ph);
      lat_add(&b->cl[b->kind][2], ph.wait_us * 1e-6);
      lat_add(&b->cl[b->kind][3], ph.read_us * 1e-6);
      lat_add(&b->cl[b->kind][4], ph.decode_us * 1e-6);
      if (r.msg.has_timing) {
        lat_add(&b->srv_total[b->kind], (double)r.msg.timing.total_us * 1e-6);
        lat_add(&b->srv_compute[b->kind], (double)r.msg.timing.computing_us * 1e-6);
      }
    }
    attnd_client_resp_free(&r);
    done++;
  }
  free(ids);
  free(sent);
  if (rc)
    return attnctl_report(b->c, rc, "bench step");
  lat_add(lat, attnctl_now() - t0);
  return 0;
}

static void print_lat_row(const char *name, lat_t *l, double wall, double tokens_per_unit) {
  if (l->n) /* qsort(NULL, 0) is undefined */
    qsort(l->v, l->n, sizeof(double), cmp_double);
  printf("%-16s %8zu %10.3f %10.3f %10.3f", name, l->n, lat_pct(l, 50) * 1e3, lat_pct(l, 99) * 1e3,
         l->n ? l->v[l->n - 1] * 1e3 : NAN);
  if (wall > 0) /* rates only for rows measured against the wall clock */
    printf(" %10.1f %12.1f\n", (double)l->n / wall, tokens_per_unit * (double)l->n / wall);
  else
    printf(" %10s %12s\n", "-", "-");
}

static void json_lat(const char *name, lat_t *l, double wall, double tokens_per_unit, int *first) {
  if (l->n) /* qsort(NULL, 0) is undefined */
    qsort(l->v, l->n, sizeof(double), cmp_double);
  printf("%s\"%s\":{", *first ? "" : ",", name);
  int f = 1;
  attnctl_json_ku("count", l->n, &f);
  attnctl_json_kf("p50_ms", lat_pct(l, 50) * 1e3, &f);
  attnctl_json_kf("p99_ms", lat_pct(l, 99) * 1e3, &f);
  attnctl_json_kf("max_ms", l->n ? l->v[l->n - 1] * 1e3 : NAN, &f);
  attnctl_json_kf("per_s", wall > 0 ? (double)l->n / wall : 0, &f);
  attnctl_json_kf("tokens_per_s", wall > 0 ? tokens_per_unit * (double)l->n / wall : 0, &f);
  printf("}");
  *first = 0;
}

int attnctl_cmd_bench(attnd_client_t *c, const attnctl_opts_t *o) {
  attnd_v1_HealthResponse h;
  int rc = attnd_client_health(c, &h);
  if (rc)
    return attnctl_report(c, rc, "bench health");
  const attnd_v1_ModelShape *m = &h.model;
  if (!h.has_model || !m->layers || !m->q_heads || !m->kv_heads || !m->head_dim) {
    fprintf(stderr, "attnctl: bench: the daemon reports no model shape\n");
    return ATTNCTL_DAEMON;
  }
  if (m->max_context && (uint64_t)o->prompt + (uint64_t)o->steps > m->max_context) {
    fprintf(stderr, "attnctl: bench: prompt + steps exceeds max_context %u\n", m->max_context);
    return ATTNCTL_USAGE;
  }
  rng_state = o->seed;
  attnd_client_set_spin(c, o->spin);
  int S = o->sessions;
  /* --prefill-sessions: sessions per prefill step (0: all in one). */
  int G = o->prefill_sessions > 0 && o->prefill_sessions < S ? o->prefill_sessions : S;
  uint32_t P = (uint32_t)o->prompt;
  size_t max_rows = (size_t)G * P > (size_t)S ? (size_t)G * P : (size_t)S;
  size_t heads = m->q_heads > m->kv_heads ? m->q_heads : m->kv_heads;
  bench_t b;
  memset(&b, 0, sizeof(b));
  b.c = c;
  b.o = o;
  b.h = &h;
  /* One pool of random values reused at random offsets: generating fresh data for
   * every step would make the client, not the daemon, the bottleneck. */
  b.pool_elems = max_rows * heads * m->head_dim + 4096;
  uint16_t *pool = malloc(b.pool_elems * sizeof(uint16_t));
  uint64_t *sess = calloc((size_t)S, sizeof(uint64_t));
  uint32_t *cached = calloc((size_t)S, sizeof(uint32_t));
  uint32_t *tokens = malloc(((size_t)S * (P + (uint32_t)o->steps) + 1) * sizeof(uint32_t));
  attnd_client_item_t *items = calloc((size_t)S, sizeof(*items));
  if (!pool || !sess || !cached || !tokens || !items)
    abort();
  for (size_t i = 0; i < b.pool_elems; i++) {
    /* Uniform in [-1, 1): finite values of the size real activations have. */
    float x = (float)((double)(rng_next() >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    pool[i] = f32_to_bf16(x);
  }
  b.pool = pool;
  size_t ntok = (size_t)P + (size_t)o->steps;
  for (size_t i = 0; i < (size_t)S * ntok; i++)
    tokens[i] = (uint32_t)(rng_next() % 32000);

  int exit_code = ATTNCTL_OK;
  int opened = 0;
  int tty = isatty(2);
  lat_t prefill = {0}, decode = {0}, prefill_steps = {0};
  double t_prefill = 0, t_decode = 0;
  uint32_t prefill_rows = 0;

  for (; opened < S; opened++) {
    rc = attnd_client_open_session(c, &tokens[(size_t)opened * ntok], P, &sess[opened],
                                   &cached[opened]);
    if (rc) {
      exit_code = attnctl_report(c, rc, "bench open session");
      goto out;
    }
  }
  /* Prefill: every session's uncached prompt tokens in one step per layer;
   * again from 0 after a truncation for each --repeat; --prefill-sessions
   * sessions per step. */
  for (int rep = 0; P > 0 && rep < o->repeat; rep++) {
    for (int g0 = 0; g0 < S; g0 += G) {
      uint32_t rows = 0;
      size_t n = 0;
      for (int i = g0; i < S && i < g0 + G; i++) {
        if (rep > 0) {
          if ((rc = attnd_client_truncate(c, sess[i], 0)) != 0) {
            exit_code = attnctl_report(c, rc, "bench truncate");
            goto out;
          }
          cached[i] = 0;
        }
        if (cached[i] >= P)
          continue;
        items[n].session = sess[i];
        items[n].start = cached[i];
        items[n].n = P - cached[i];
        items[n].tokens = &tokens[(size_t)i * ntok + cached[i]];
        rows += items[n].n;
        n++;
      }
      prefill_rows += rows;
      double t0 = attnctl_now();
      b.kind = 0;
      b.step_lat = prefill_steps;
      if (n > 0 && (exit_code = bench_pass(&b, items, n, rows, &prefill)) != 0)
        goto out;
      t_prefill += attnctl_now() - t0;
      prefill_steps = b.step_lat;
      memset(&b.step_lat, 0, sizeof(b.step_lat));
      if (tty)
        fprintf(stderr, "prefill: %zu sessions x %u tokens in %.3f s\n", n, P, attnctl_now() - t0);
    }
  }
  b.kind = 1;
  double t0 = attnctl_now(), last = 0;
  for (int t = 0; t < o->steps; t++) {
    for (int i = 0; i < S; i++) {
      items[i].session = sess[i];
      items[i].start = P + (uint32_t)t;
      items[i].n = 1;
      items[i].tokens = &tokens[(size_t)i * ntok + P + (size_t)t];
    }
    if ((exit_code = bench_pass(&b, items, (size_t)S, (uint32_t)S, &decode)) != 0)
      goto out;
    double now = attnctl_now();
    if (now - last > 0.2 || t + 1 == o->steps) {
      last = now;
      double el = now - t0;
      if (tty)
        fprintf(stderr, "\rdecode %d/%d  %.1f tokens/s  last %.2f ms   ", t + 1, o->steps,
                el > 0 ? (double)(t + 1) * S / el : 0.0, decode.v[decode.n - 1] * 1e3);
      else if ((t + 1) % (o->steps / 10 ? o->steps / 10 : 1) == 0)
        fprintf(stderr, "decode %d/%d\n", t + 1, o->steps);
    }
  }
  t_decode = attnctl_now() - t0;
  if (tty && o->steps)
    fprintf(stderr, "\n");

  double L = (double)m->layers;
  if (o->json) {
    int f = 1;
    printf("{");
    attnctl_json_ku("sessions", (uint64_t)S, &f);
    attnctl_json_ku("prompt", P, &f);
    attnctl_json_ku("steps", (uint64_t)o->steps, &f);
    attnctl_json_ku("layers", m->layers, &f);
    attnctl_json_ku("depth", (uint64_t)o->depth, &f);
    attnctl_json_kf("prefill_s", t_prefill, &f);
    attnctl_json_kf("decode_s", t_decode, &f);
    attnctl_json_ku("prefill_tokens", prefill_rows, &f);
    json_lat("prefill", &prefill, t_prefill, (double)prefill_rows, &f);
    json_lat("prefill_layer_step", &prefill_steps, t_prefill, (double)prefill_rows / L, &f);
    json_lat("decode_layer_step", &b.step_lat, t_decode, (double)S / L, &f);
    json_lat("prefill_layer_server_total", &b.srv_total[0], 0, 0, &f);
    json_lat("prefill_layer_server_compute", &b.srv_compute[0], 0, 0, &f);
    json_lat("decode_layer_server_total", &b.srv_total[1], t_decode, (double)S / L, &f);
    json_lat("decode_layer_server_compute", &b.srv_compute[1], t_decode, (double)S / L, &f);
    for (int k = 0; k < 2; k++)
      for (int i = 0; i < 5; i++) {
        char name[64];
        snprintf(name, sizeof(name), "%s_layer_%s", k ? "decode" : "prefill", cl_name[i]);
        for (char *p = name; *p; p++)
          if (*p == ' ')
            *p = '_';
        json_lat(name, &b.cl[k][i], 0, 0, &f);
      }
    json_lat("decode_token", &decode, t_decode, (double)S, &f);
    printf("}\n");
  } else {
    printf("bench: %d sessions, prompt %u, %d decode steps, %u layers, %s %s, depth %d, %s\n", S, P,
           o->steps, m->layers, m->dtype, m->kv_cache, o->depth,
           o->use_plan ? "plan" : "inline items");
    printf("%-16s %8s %10s %10s %10s %10s %12s\n", "phase", "count", "p50 ms", "p99 ms", "max ms",
           "per s", "tokens/s");
    print_lat_row("prefill", &prefill, t_prefill, (double)prefill_rows);
    for (int k = 0; k < 2; k++) {
      if (k == 0)
        print_lat_row("prefill layer", &prefill_steps, t_prefill, (double)prefill_rows / L);
      else
        print_lat_row("decode layer", &b.step_lat, t_decode, (double)S / L);
      if (b.srv_total[k].n) {
        /* Where the time goes: the daemon's own view of the same steps. */
        print_lat_row("  in daemon", &b.srv_total[k], 0, 0);
        print_lat_row("  computing", &b.srv_compute[k], 0, 0);
      }
      for (int i = 0; i < 5; i++) {
        char name[32];
        snprintf(name, sizeof(name), "  %s", cl_name[i]);
        if (b.cl[k][i].n)
          print_lat_row(name, &b.cl[k][i], 0, 0);
      }
    }
    print_lat_row("decode token", &decode, t_decode, (double)S);
  }

out:
  for (int i = 0; i < opened; i++)
    attnd_client_close_session(c, sess[i]);
  free(prefill.v);
  free(decode.v);
  free(prefill_steps.v);
  free(b.step_lat.v);
  for (int k = 0; k < 2; k++) {
    free(b.srv_total[k].v);
    free(b.srv_compute[k].v);
    for (int i = 0; i < 5; i++)
      free(b.cl[k][i].v);
  }
  free(pool);
  free(sess);
  free(cached);
  free(tokens);
  free(items);
  return exit_code;
}
