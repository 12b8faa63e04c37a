"""Merging partial attention by the lse rule (split context, docs/scale-out.md).

A daemon that holds only some of a context's keys returns, per query row and q
head, out_i (the softmax-weighted mean of v over the keys it holds and the mask
admits) and lse_i = log(sum over those keys of exp(softmax_scale * q.k)). The
attention over the union of the parts is then

    m   = max_i lse_i
    w_i = exp(lse_i - m)
    out = sum_i w_i * out_i / sum_i w_i
    lse = m + log(sum_i w_i)

exactly, because each part's out_i is its own sum divided by exp(lse_i). A part
that sees no key of a row (fully masked there: out 0, lse -inf) has w_i = 0 and
contributes nothing; a row that no part sees stays out 0, lse -inf, which is what
one daemon holding the whole context answers for a fully masked row.

The arithmetic is float64 (the parts come as fp32); results are fp32.
"""

import numpy as np

NEG_INF = float("-inf")


class LseMerger:
    """Merges parts as they arrive (one pass, no part kept).

    shape: the rows' leading shape, e.g. (T, q_heads); head_dim: the last axis
    of out. add() takes a part for a slice of the leading axis, so parts that
    cover different rows (split-context items on different daemons) merge into
    one result.
    """

    def __init__(self, shape, head_dim):
        shape = tuple(int(s) for s in shape)
        self._m = np.full(shape, -np.inf)
        self._s = np.zeros(shape)
        self._acc = np.zeros(shape + (int(head_dim),))

    def add(self, out, lse, rows=slice(None)):
        """Adds one part: out [..., head_dim] and lse [...] for the rows `rows` of the
        first axis (a slice or index array without repeats)."""
        out = np.asarray(out, dtype=np.float64)
        lse = np.asarray(lse, dtype=np.float64)
        if out.shape[:-1] != lse.shape or out.shape[-1] != self._acc.shape[-1]:
            raise ValueError(f"part out {out.shape} does not match lse {lse.shape}")
        if np.isnan(lse).any() or np.isposinf(lse).any() or not np.isfinite(out).all():
            raise ValueError("a part holds NaN or Inf where only lse may be -inf")
        if (np.isneginf(lse) & (out != 0).any(axis=-1)).any():
            raise ValueError("a part has lse -inf (no visible key) but a non-zero out")
        m_old = self._m[rows]
        if m_old.shape != lse.shape:
            raise ValueError(f"part lse {lse.shape} does not match its rows {m_old.shape}")
        m_new = np.maximum(m_old, lse)
        with np.errstate(invalid="ignore", over="ignore"):
            # -inf - -inf is NaN: a term whose lse is -inf has weight 0 by definition.
            a = np.where(np.isneginf(m_old), 0.0, np.exp(m_old - m_new))
            b = np.where(np.isneginf(lse), 0.0, np.exp(lse - m_new))
        self._m[rows] = m_new
        self._s[rows] = self._s[rows] * a + b
        self._acc[rows] = self._acc[rows] * a[..., None] + out * b[..., None]

    def result(self):
        """(out fp32 [..., head_dim], lse fp32 [...]): 0 and -inf where no part saw a key."""
        seen = self._s > 0
        s = np.where(seen, self._s, 1.0)
        out = np.where(seen[..., None], self._acc / s[..., None], 0.0)
        with np.errstate(divide="ignore"):
            lse = np.where(seen, self._m + np.log(s), -np.inf)
        return out.astype(np.float32), lse.astype(np.float32)


def merge(outs, lses):
    """Merges parts that cover the same rows: outs [P] of [..., D], lses [P] of [...].

    Returns (out fp32, lse fp32). An empty list is an error (there is no shape).
    """
    outs = list(outs)
    lses = list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge needs as many lse as out parts (got {len(outs)} and {len(lses)})")
    first = np.asarray(outs[0])
    mg = LseMerger(first.shape[:-1], first.shape[-1])
    for o, l in zip(outs, lses):
        mg.add(o, l)
    return mg.result()
