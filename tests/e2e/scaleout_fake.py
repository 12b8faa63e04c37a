"""A protocol fake with the scale-out fields (docs/scale-out.md), for the Python
fan-out clients' tests while the daemon does not serve them yet.

It extends fake_attnd.FakeAttnd with: a kv-head range reported in Health (the
fake then holds only those heads, as a sharded daemon would), split_context,
OpenSession.base (positions [base, ...), RoPE at absolute positions), q_only
items (attend only), fp32 out and lse. The math is reference.py's, float64 over
the keys held, with the masks evaluated at absolute positions.
"""
import random

import numpy as np

from attnd.client import pb
from fake_attnd import INVALID, PRECOND, Fail, FakeAttnd
from reference import act_round, rope


class Part:
    """What one fake session holds per layer: rotated, rounded K and V for positions base.."""

    def __init__(self, m, base):
        self.base = base
        self.K = [np.zeros((0, m.kv_heads, m.head_dim), np.float32) for _ in range(m.layers)]
        self.V = [np.zeros((0, m.kv_heads, m.head_dim), np.float32) for _ in range(m.layers)]
        self.tokens = [[] for _ in range(m.layers)]

    def length(self, layer=0):
        return self.base + self.K[layer].shape[0]


def visible(qpos, kpos, mask):
    p, j = qpos[:, None], kpos[None, :]
    kind = mask.kind
    if kind == pb.Mask.FULL:
        return np.ones((len(qpos), len(kpos)), bool)
    if kind == pb.Mask.SLIDING_WINDOW:
        return (j <= p) & (j >= np.maximum(0, p - int(mask.window) + 1))
    if kind == pb.Mask.PREFIX_LM:
        return (j < mask.prefix_len) | (j <= p)
    if kind == pb.Mask.CAUSAL:
        return j <= p
    raise Fail(INVALID, f"the scale-out fake has no mask kind {kind}")


class ScaleoutFake(FakeAttnd):
    """kv_range: (begin, end, model_q_heads, model_kv_heads) or None (whole model);
    the fake's own shape (q_heads, kv_heads) is the held part. split: report and
    serve split context."""

    def __init__(self, path, model=None, kv_range=None, split=True, **kw):
        super().__init__(path, model, **kw)
        self.kv_range = kv_range
        self.split = split
        self.fail_next_open = False

    def _health(self, r, resp):
        super()._health(r, resp)
        resp.health.split_context = self.split
        if self.kv_range is not None:
            b, e, tq, tkv = self.kv_range
            m = resp.health.model
            m.kv_head_begin, m.kv_head_end, m.model_q_heads, m.model_kv_heads = b, e, tq, tkv

    def _open_session(self, r, resp):
        base = r.base if self.split else 0
        if base >= self.m.max_context:
            raise Fail(11, f"base {base} >= max_context")
        sid = random.getrandbits(64) or 1
        self.sessions[sid] = Part(self.m, base)
        resp.open_session.session = sid
        resp.open_session.base = base

    def _fork(self, r, resp):
        import copy
        sid = random.getrandbits(64) or 1
        self.sessions[sid] = copy.deepcopy(self._session(r.session))
        resp.fork.session = sid

    def _truncate(self, r, resp):
        s = self._session(r.session)
        if r.len < s.base:
            raise Fail(INVALID, f"truncate to {r.len} < base {s.base}")
        for layer in range(self.m.layers):
            s.K[layer] = s.K[layer][: r.len - s.base]
            s.V[layer] = s.V[layer][: r.len - s.base]
        resp.truncate.SetInParent()

    def _list_sessions(self, r, resp):
        resp.list_sessions.SetInParent()
        for sid, s in self.sessions.items():
            resp.list_sessions.sessions.add(session=sid, len=s.length(), base=s.base)

    def _check_items(self, items):
        seen = set()
        for i, it in enumerate(items):
            s = self._session(it.session)
            if it.session in seen:
                raise Fail(INVALID, f"item {i}: session named twice")
            seen.add(it.session)
            if it.n < 1:
                raise Fail(INVALID, f"item {i}: n must be >= 1")
            if it.q_only and (it.kv_only or len(it.tokens)):
                raise Fail(INVALID, f"item {i}: q_only takes no kv_only and no tokens")
            if it.q_only and not self.split:
                raise Fail(INVALID, f"item {i}: q_only unknown")
            if it.start < s.base:
                raise Fail(INVALID, f"item {i}: start {it.start} < base {s.base}")
            if not it.q_only and it.start > s.length():
                raise Fail(INVALID, f"item {i}: start {it.start} > len {s.length()}")
        return list(items)

    def _step(self, r, resp):
        m = self.m
        if r.plan:
            if r.plan not in self.plans:
                raise Fail(PRECOND, "plan ended")
            items = self.plans[r.plan]
        else:
            items = self._check_items(r.items)
        T = sum(it.n for it in items if not it.q_only)
        Tq = sum(it.n for it in items if not it.kv_only)

        def arr(t, rows, heads):
            if not rows:
                return None
            if tuple(t.shape) != (rows, heads, m.head_dim) or t.dtype != pb.DTYPE_BF16:
                raise Fail(INVALID, f"tensor {list(t.shape)} dtype {t.dtype}, want [{rows},{heads},{m.head_dim}] bf16")
            bits = np.frombuffer(t.data, dtype="<u2").reshape(rows, heads, m.head_dim)
            return (bits.astype(np.uint32) << 16).view(np.float32)

        k, v = arr(r.k, T, m.kv_heads), arr(r.v, T, m.kv_heads)
        q = arr(r.q, Tq, m.q_heads)
        scale = m.softmax_scale
        outs, lses, r0, q0 = [], [], 0, 0
        for it in items:
            s = self.sessions[it.session]
            pos = np.arange(it.start, it.start + it.n)
            if not it.q_only:
                kr = act_round(rope(k[r0:r0 + it.n], pos, m.rope, m.rope_theta, m.rotary_dim), m.dtype)
                keep = it.start - s.base
                s.K[r.layer] = np.concatenate([s.K[r.layer][:keep], kr])
                s.V[r.layer] = np.concatenate([s.V[r.layer][:keep], v[r0:r0 + it.n]])
                r0 += it.n
            if it.kv_only:
                continue
            qr = act_round(rope(q[q0:q0 + it.n], pos, m.rope, m.rope_theta, m.rotary_dim), m.dtype)
            q0 += it.n
            K = s.K[r.layer].astype(np.float64)
            V = s.V[r.layer].astype(np.float64)
            kpos = s.base + np.arange(K.shape[0])
            vis = visible(pos, kpos, it.mask)
            g = m.q_heads // m.kv_heads
            o = np.zeros((it.n, m.q_heads, m.head_dim))
            lse = np.full((it.n, m.q_heads), -np.inf)
            for h in range(m.q_heads):
                sc = (qr[:, h, :].astype(np.float64) @ K[:, h // g, :].T) * scale
                sc = np.where(vis, sc, -np.inf)
                mx = sc.max(axis=1, keepdims=True) if K.shape[0] else np.full((it.n, 1), -np.inf)
                mx = np.where(np.isfinite(mx), mx, 0.0)
                p = np.where(vis, np.exp(sc - mx), 0.0)
                z = p.sum(axis=1)
                ok = z > 0
                o[:, h, :] = np.where(ok[:, None], (p @ V[:, h // g, :]) / np.where(ok, z, 1)[:, None], 0)
                lse[:, h] = np.where(ok, np.log(np.where(ok, z, 1)) + mx[:, 0], -np.inf)
            outs.append(o)
            lses.append(lse)
        out = np.concatenate(outs) if outs else np.zeros((0, m.q_heads, m.head_dim))
        if r.fp32_out:
            resp.step.out.dtype = pb.DTYPE_FP32
            data = np.ascontiguousarray(out, dtype="<f4").tobytes()
        else:
            out = act_round(out, m.dtype)
            resp.step.out.dtype = pb.DTYPE_BF16
            data = (np.ascontiguousarray(out, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        resp.step.out.shape.extend(out.shape)
        resp.step.out.data = data
        if r.want_lse:
            lse = np.concatenate(lses) if lses else np.zeros((0, m.q_heads))
            resp.step.lse.dtype = pb.DTYPE_FP32
            resp.step.lse.shape.extend(lse.shape)
            resp.step.lse.data = np.ascontiguousarray(lse, dtype="<f4").tobytes()
        resp.timing.total_us = 1
