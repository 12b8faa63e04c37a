/* cuda_harness_ref.c: the harness's side of the judgement (cuda_harness.h):
 * the float64 reference of the per-layer attention variants, the mask inputs
 * and the lse / fully-masked-row check. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "cuda_harness.h"
#include "oracle.h"

/* The float64 reference of the per-layer variants (docs/numerics.md): the
 * oracle's dequantized session, scores s = softmax_scale q.k, capped to
 * c tanh(s / c) when s->softcap = c > 0 before the mask; the mask intersected
 * with the window (key j > p - window); a sink logit per q head joining the
 * denominator (m = max(max_j s_j, sink), lse = m + log(sum + exp(sink - m)),
 * no visible key: out 0, lse = sink). It is oracle_session_attend's loop with
 * those three steps added, written here so that the CUDA kernels are checked
 * against the semantics while the oracle is extended beside them; novis[r]
 * (row-major [n][q_heads]) is 1 for rows with no visible key. */
void harness_ref_attend(const attnd_kshape_t *s, const oracle_session_t *o, int start, int n,
                        const void *q, int mask_kind, int mask_param, int causal,
                        const int32_t *intervals, int window, const float *sinks, double *out,
                        double *lse, int *novis) {
  const int D = s->head_dim, H = s->kv_heads, QH = s->q_heads, group = QH / H, kv_len = start + n;
  double *in = malloc(sizeof(double) * D), *qr = malloc(sizeof(double) * D);
  double *score = malloc(sizeof(double) * (kv_len ? kv_len : 1));
  const double scale = (double)s->softmax_scale, cap = (double)s->softcap;
  for (int r = 0; r < n; r++) {
    const int p = start + r;
    for (int qh = 0; qh < QH; qh++) {
      const int h = qh / group;
      const size_t qoff = ((size_t)r * QH + qh) * D;
      for (int d = 0; d < D; d++)
        in[d] = oracle_from_dtype(s->dtype, q, qoff + d);
      oracle_rope(s, p, in, qr);
      double m = -INFINITY;
      int any = 0;
      for (int j = 0; j < kv_len; j++) {
        if (!oracle_mask_visible(mask_kind, mask_param, causal, intervals, kv_len, p, j) ||
            (window > 0 && j <= p - window)) {
          score[j] = -INFINITY;
          continue;
        }
        const double *kr = o->K + ((size_t)j * H + h) * D;
        double dot = 0.0;
        for (int d = 0; d < D; d++)
          dot += qr[d] * kr[d];
        double x = scale * dot;
        if (cap > 0)
          x = cap * tanh(x / cap);
        score[j] = x;
        any = 1;
        if (x > m)
          m = x;
      }
      const double sink = sinks ? (double)sinks[qh] : -INFINITY;
      double *orow = out + qoff;
      for (int d = 0; d < D; d++)
        orow[d] = 0.0;
      novis[(size_t)r * QH + qh] = !any;
      if (!any) {
        lse[(size_t)r * QH + qh] = sink;
        continue;
      }
      if (sink > m)
        m = sink;
      double sum = sinks ? exp(sink - m) : 0.0;
      for (int j = 0; j < kv_len; j++) {
        if (score[j] == -INFINITY)
          continue;
        const double w = exp(score[j] - m);
        sum += w;
        const double *vr = o->V + ((size_t)j * H + h) * D;
        for (int d = 0; d < D; d++)
          orow[d] += w * vr[d];
      }
      for (int d = 0; d < D; d++)
        orow[d] /= sum;
      lse[(size_t)r * QH + qh] = m + log(sum);
    }
  }
  free(in);
  free(qr);
  free(score);
}

/* Fills an interval mask for one item: random column intervals, plus rows
 * [start+1, start+3) masked from every key (fully masked rows). */
void harness_make_intervals(int32_t *iv, int kv_len, int start, int n) {
  for (int j = 0; j < kv_len; j++) {
    int a = start + harness_rnd(n + 1), b = a + harness_rnd(n / 2 + 1);
    iv[j] = a;
    iv[kv_len + j] = b;
    if (n >= 4) {
      iv[2 * kv_len + j] = start + 1;
      iv[3 * kv_len + j] = start + 3;
    } else {
      iv[2 * kv_len + j] = 0;
      iv[3 * kv_len + j] = 0;
    }
  }
}

/* Documents of 30..249 tokens tile keys 0 .. kv_len-1; a row sees only its own
 * document's keys (rows after a document: first interval; rows before it:
 * second), so whole key tiles are masked for a query tile and get skipped. */
void harness_make_documents(int32_t *iv, int kv_len) {
  for (int a = 0; a < kv_len;) {
    int e = a + 30 + harness_rnd(220);
    if (e > kv_len)
      e = kv_len;
    for (int j = a; j < e; j++) {
      iv[j] = e;
      iv[kv_len + j] = kv_len;
      iv[2 * kv_len + j] = 0;
      iv[3 * kv_len + j] = a;
    }
    a = e;
  }
}

/* Checks one item's lse against the oracle's, and fully masked rows (novis:
 * rows with no visible key, NULL: those with lse -inf; with a sink their lse
 * is the sink). */
void harness_check_lse(int ncase, const attnd_kshape_t *s, int i, int rows, const float *lse,
                       const double *rl, const int *novis, attnd_dtype_t odt, const void *got,
                       const char *who) {
  const int D = s->head_dim;
  for (int r = 0; r < rows; r++) {
    const float g = lse[r];
    if (novis && novis[r])
      for (int e = 0; e < D; e++)
        if (oracle_from_dtype(odt, got, (size_t)r * D + e) != 0.0)
          fail_msg("%s case %d item %d: row %d with no visible key not zero", who, ncase, i, r);
    if (isinf(rl[r])) {
      if (!(isinf(g) && g < 0))
        fail_msg("%s case %d item %d row %d: lse %g, want -inf", who, ncase, i, r, g);
      for (int e = 0; e < D; e++)
        if (oracle_from_dtype(odt, got, (size_t)r * D + e) != 0.0)
          fail_msg("%s case %d item %d: fully masked row %d not zero", who, ncase, i, r);
    } else if (!(fabs(g - rl[r]) <= 2e-2 + 1e-3 * fabs(rl[r]))) {
      fail_msg("%s case %d kv %s item %d row %d: lse %g, oracle %g", who, ncase,
               attnd_kv_type_name(s->kv), i, r, g, rl[r]);
    }
  }
}
