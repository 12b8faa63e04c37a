"""Helpers shared by the fan-out clients (sharded.py, split.py, placement.py)."""

import numpy as np

from . import errors
from .client import BFLOAT16, f32_to_bf16

# Model fields every daemon of a group must agree on (besides the head counts).
SHAPE_FIELDS = ("layers", "head_dim", "block_size", "dtype", "kv_cache", "rope", "rope_theta",
                "rotary_dim", "softmax_scale", "max_context", "model_id")


def to_wire(arr, act_dtype, what):
    """Converts q, k or v once to what travels on the wire: uint16 bf16 bits or float16.

    Client._wire does the same per call; doing it once before slicing or
    gathering rows for several daemons is cheaper and gives every daemon the very
    bits one daemon would get (rounding is elementwise).
    """
    if arr is None:
        return None
    a = np.asarray(arr)
    if a.ndim != 3:
        raise ValueError(f"{what} must be [rows, heads, head_dim], got shape {a.shape}")
    if BFLOAT16 is not None and a.dtype == BFLOAT16:
        return a.view(np.uint16)
    if a.dtype in (np.uint16, np.float16):
        return a
    if a.dtype.kind == "f":
        if act_dtype == "fp16":
            return a.astype(np.float16)
        return f32_to_bf16(a)
    raise ValueError(f"{what} has unsupported dtype {a.dtype}")


def shape_mismatch(a, b):
    """The first SHAPE_FIELDS entry where two ModelShapes differ, or None."""
    for f in SHAPE_FIELDS:
        if getattr(a, f) != getattr(b, f):
            return f"{f} {getattr(a, f)!r} != {getattr(b, f)!r}"
    return None


def recv_all(pairs):
    """Receives every (client, id) pair even when one fails, so no answer is left
    queued on a connection; re-raises the first error after the rest arrived."""
    results, first = [], None
    for cl, rid in pairs:
        try:
            results.append(cl.step_recv(rid))
        except Exception as e:  # noqa: BLE001 - re-raised below
            results.append(None)
            if first is None:
                first = e
    if first is not None:
        raise first
    return results


class EpochRelay:
    """A Client's on_epoch_change that names the daemon: tells the fan-out client
    (notify) first, then applies the caller's policy: "raise" (EpochChanged),
    "flag" (nothing more) or a callable taking (daemon name, old, new)."""

    def __init__(self, policy, name, notify=None):
        self.policy = policy
        self.name = name
        self.notify = notify

    def __call__(self, old, new):
        if self.notify is not None:
            self.notify(self.name, old, new)
        if callable(self.policy):
            self.policy(self.name, old, new)
        elif self.policy == "raise":
            raise errors.EpochChanged(old, new)
