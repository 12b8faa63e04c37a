"""An independent numpy reference of attnd's attention semantics (docs/numerics.md).

Written from the design text, not from the daemon's code: RoPE with fp32 angles,
rotated q and k rounded to the activation dtype, attention in float64 over what
the cache holds, output rounded to the activation dtype. Only the bf16/fp16
cache types (no quantization), which is what the end-to-end tests use.
"""
import numpy as np


def bf16_round(x):
    """Rounds to bf16 (nearest even) and returns float32."""
    shape = np.shape(x)
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).reshape(shape)


def act_round(x, dtype):
    if dtype == "fp16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    return bf16_round(x)


def rope(x, pos, rope_kind, theta, rotary_dim):
    """Applies RoPE to x [T, H, D] (float32) at absolute positions pos [T]."""
    if rope_kind == "none" or rotary_dim == 0:
        return np.asarray(x, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32)
    half = rotary_dim // 2
    inv = (float(theta) ** (-2.0 * np.arange(half, dtype=np.float64) / rotary_dim)).astype(np.float32)
    ang = (np.asarray(pos, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float32)
    cos = np.cos(ang.astype(np.float64)).astype(np.float32)[:, None, :]
    sin = np.sin(ang.astype(np.float64)).astype(np.float32)[:, None, :]
    out = x.copy()
    if rope_kind == "neox":
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
    elif rope_kind == "interleaved":
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * cos - x2 * sin
        out[..., 1:rotary_dim:2] = x2 * cos + x1 * sin
    else:
        raise ValueError(rope_kind)
    return out


def visible(qpos, L, mask=None):
    """[Tq, L] bool: which keys each query row sees. mask is None (causal) or a tuple
    ("full",), ("sliding", w), ("prefix_lm", n), ("document", lengths)."""
    p = np.asarray(qpos)[:, None]
    j = np.arange(L)[None, :]
    kind = mask[0] if mask else "causal"
    if kind == "causal":
        return j <= p
    if kind == "full":
        return np.broadcast_to(j < L, (p.shape[0], L))
    if kind == "sliding":
        return (j <= p) & (j >= np.maximum(0, p - mask[1] + 1))
    if kind == "prefix_lm":
        return (j < mask[1]) | (j <= p)
    if kind == "document":
        doc = np.repeat(np.arange(len(mask[1])), mask[1])  # document id of every position
        return (j <= p) & (doc[j] == doc[p])
    raise ValueError(kind)


def attend(q, K, V, qpos, scale, want_lse=False, mask=None, softcap=0.0, window=0, sinks=None):
    """GQA attention in float64 (causal unless mask says otherwise, see visible()).

    q [Tq, Hq, D] (rotated, rounded), K and V [L, Hkv, D] as the cache holds them,
    qpos [Tq] absolute positions. Returns out [Tq, Hq, D] float64 (and lse [Tq, Hq]).
    The per-layer variants of docs/numerics.md: softcap c > 0 replaces every scaled
    score s by c tanh(s / c); window w > 0 also hides keys j <= p - w; sinks [Hq]
    add exp(sink) to each row's denominator (a row that sees nothing: out 0, lse sink).
    """
    q = np.asarray(q, dtype=np.float64)
    K = np.asarray(K, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    Tq, Hq, D = q.shape
    L, Hkv, _ = K.shape
    group = Hq // Hkv
    out = np.zeros((Tq, Hq, D))
    lse = np.full((Tq, Hq), -np.inf)
    vis = visible(qpos, L, mask)
    if window:
        vis = vis & (np.arange(L)[None, :] > np.asarray(qpos)[:, None] - int(window))
    for h in range(Hq):
        kh = h // group
        s = (q[:, h, :] @ K[:, kh, :].T) * float(scale)
        if softcap:
            s = float(softcap) * np.tanh(s / float(softcap))
        s = np.where(vis, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        if sinks is not None:
            m = np.maximum(m, float(sinks[h]))
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.where(vis, np.exp(s - m), 0.0)
        z = p.sum(axis=1, keepdims=True)
        if sinks is not None:
            z = z + np.exp(float(sinks[h]) - m)
        out[:, h, :] = np.where(z > 0, (p @ V[:, kh, :]) / np.where(z > 0, z, 1), 0.0)
        lse[:, h] = np.where(z[:, 0] > 0, np.log(np.where(z[:, 0] > 0, z[:, 0], 1)) + m[:, 0], -np.inf)
    return (out, lse) if want_lse else out


class RefSession:
    """What the daemon holds for one session, per layer: rotated, rounded K and V."""

    def __init__(self, model):
        self.m = model
        L = model.layers
        self.K = [np.zeros((0, model.kv_heads, model.head_dim), np.float32) for _ in range(L)]
        self.V = [np.zeros((0, model.kv_heads, model.head_dim), np.float32) for _ in range(L)]

    def step(self, layer, start, q, k, v, mask=None, want_lse=False, sinks=None):
        """Writes k, v at start.. and returns the activation-dtype output for q (float32),
        with the fp32 lse when want_lse (then as a pair, out unrounded fp64)."""
        m = self.m
        n = k.shape[0]
        pos = np.arange(start, start + n)
        scale = m.softmax_scale if m.softmax_scale else 1.0 / np.sqrt(m.head_dim)
        rd = m.rotary_dim if m.rotary_dim else m.head_dim
        kr = act_round(rope(act_round(k, m.dtype), pos, m.rope, m.rope_theta, rd), m.dtype)
        vr = act_round(v, m.dtype)
        self.K[layer] = np.concatenate([self.K[layer][:start], kr])
        self.V[layer] = np.concatenate([self.V[layer][:start], vr])
        if q is None:
            return None
        qr = act_round(rope(act_round(q, m.dtype), pos, m.rope, m.rope_theta, rd), m.dtype)
        # The layer's variants as Health reports them (absent on older daemons).
        softcap = float(getattr(m, "softcap", 0.0) or 0.0)
        wins = [int(w) for w in getattr(m, "attention_windows", "").split(",") if w]
        window = wins[layer % len(wins)] if wins else 0
        kw = dict(mask=mask, softcap=softcap, window=window, sinks=sinks)
        if want_lse:
            return attend(qr, self.K[layer], self.V[layer], pos, scale, True, **kw)
        out = attend(qr, self.K[layer], self.V[layer], pos, scale, **kw)
        return act_round(out, m.dtype)


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))
