"""Head sharding: one model's heads over several daemons (docs/scale-out.md).

Each daemon holds a contiguous range of the model's kv heads [A, B) and the q
heads that read them, [A*g, B*g) with g = q_heads / kv_heads (query head h reads
kv head h // g, so nothing crosses a range). ShardedClient opens every session on
every daemon, makes one Plan per daemon, sends each daemon its heads' slices of
the packed q, k and v for every layer step (to all daemons before waiting for
any), and joins the outputs along the head axis. The heads are computed
independently, so the joined output equals one daemon's bit for bit.

The range of a daemon comes from its Health (ModelShape.kv_head_begin/end). A
daemon older than those fields that was started with the shard's own shape
(--q-heads (B-A)*g --kv-heads B-A) can be given its range in the fleet file
instead (kv_heads = "A:B"); a daemon that reports a range must agree with it.
"""

import itertools
import types

import numpy as np

from . import errors
from ._fanout import EpochRelay, recv_all, shape_mismatch, to_wire
from .client import Item, StepResult
from .fleet import Daemon


class ShardError(errors.AttndError):
    """The daemons of a sharded group do not form one model."""

    code = 9  # FAILED_PRECONDITION


class Shard:
    """One daemon of the group and the heads it holds."""

    def __init__(self, name, client, kv_begin, kv_end, group):
        self.name = name
        self.client = client
        self.kv_begin, self.kv_end = kv_begin, kv_end
        self.q_begin, self.q_end = kv_begin * group, kv_end * group

    def __repr__(self):
        return f"Shard({self.name}, kv [{self.kv_begin}, {self.kv_end}), q [{self.q_begin}, {self.q_end}))"


def _range_of(name, model, declared):
    """(begin, end, model_q_heads or 0, model_kv_heads or 0) of one daemon."""
    # A daemon that reports the whole model of its own shape (not started with
    # --kv-heads A:B) may still be a shard started with the shard's shape: a
    # declared range then says which heads those are.
    whole = (model.kv_head_begin == 0 and model.kv_head_end == model.kv_heads
             and model.model_kv_heads in (0, model.kv_heads))
    if model.kv_head_end and not (declared is not None and whole):
        rng = (model.kv_head_begin, model.kv_head_end)
        if model.kv_head_end - model.kv_head_begin != model.kv_heads:
            raise ShardError(f"{name}: Health reports kv heads [{rng[0]}, {rng[1]}) but holds {model.kv_heads}")
        if declared is not None and tuple(declared) != rng:
            raise ShardError(f"{name}: the fleet says kv heads {declared[0]}:{declared[1]}, "
                             f"Health says {rng[0]}:{rng[1]}")
        return rng[0], rng[1], model.model_q_heads, model.model_kv_heads
    if declared is not None:
        if declared[1] - declared[0] != model.kv_heads:
            raise ShardError(f"{name}: the fleet says kv heads {declared[0]}:{declared[1]} but the daemon "
                             f"holds {model.kv_heads} (start it with --kv-heads {declared[1] - declared[0]})")
        return declared[0], declared[1], 0, 0
    return 0, model.kv_heads, model.q_heads, model.kv_heads


class ShardedClient:
    """A head-sharded group of daemons used as one model.

    daemons: fleet.Daemon entries, addresses, or already connected Clients (in any
    order; they are sorted by head range). on_epoch_change: as attnd.Client's, a
    callable taking (daemon name, old, new). Other keyword arguments go to each
    attnd.Client.

    The calls mirror attnd.Client's: open_session, plan, step_send/step_recv,
    step, fork, truncate, close_session, set_scales. Sessions and plans are
    handles of this object that stand for one session or plan per daemon.
    """

    def __init__(self, daemons, on_epoch_change="raise", **client_kw):
        self.on_epoch_change = on_epoch_change
        self.shards = []
        self._stale = set()
        self._ids = itertools.count(1)
        self._sessions = {}
        self._plans = {}
        self._inflight = {}
        opened = []
        try:
            for i, d in enumerate(daemons):
                d = d if isinstance(d, Daemon) or hasattr(d, "step_send") else Daemon(str(d), str(d))
                name = getattr(d, "name", None) or f"daemon{i}"
                relay = EpochRelay(on_epoch_change, name, self._restarted)
                if hasattr(d, "step_send"):  # a connected Client
                    cl = d
                    cl.on_epoch_change = relay
                    declared = None
                else:
                    cl = d.connect(on_epoch_change=relay, **client_kw)
                    declared = d.kv_heads
                opened.append(cl)
                self.shards.append((name, cl, declared, cl.health().model))
            self._build()
        except BaseException:
            for cl in opened:
                cl.close()
            raise

    def _build(self):
        if not self.shards:
            raise ShardError("a sharded group needs at least one daemon")
        m0 = self.shards[0][3]
        g = m0.q_heads // m0.kv_heads
        built, totals = [], set()
        for name, cl, declared, m in self.shards:
            bad = shape_mismatch(m0, m)
            if bad:
                raise ShardError(f"{name}: model differs from {self.shards[0][0]}'s: {bad}")
            if m.q_heads // m.kv_heads != g or m.q_heads % m.kv_heads:
                raise ShardError(f"{name}: {m.q_heads} q heads per {m.kv_heads} kv heads, not {g} per 1")
            b, e, tq, tkv = _range_of(name, m, declared)
            if tkv:
                totals.add((tq, tkv))
            built.append(Shard(name, cl, b, e, g))
        built.sort(key=lambda s: s.kv_begin)
        pos = 0
        for s in built:
            if s.kv_begin != pos:
                raise ShardError(f"kv heads [{pos}, {s.kv_begin}) are held by no daemon, or twice "
                                 f"({[repr(x) for x in built]})")
            pos = s.kv_end
        if len(totals) > 1 or (totals and totals.pop() != (pos * g, pos)):
            raise ShardError(f"the daemons report model totals that are not the {pos} kv heads they hold")
        self.shards = built
        self.group_size = g
        self.model = types.SimpleNamespace(**{f: getattr(m0, f) for f in (
            "layers", "head_dim", "block_size", "dtype", "kv_cache", "rope", "rope_theta", "rotary_dim",
            "softmax_scale", "max_context", "model_id")})
        self.model.q_heads, self.model.kv_heads = pos * g, pos

    # -- connection --

    def close(self):
        for s in self.shards:
            s.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _restarted(self, name, old, new):
        # Every session of the group lost its part on that daemon.
        self._stale.update(self._sessions)

    def stale(self, session):
        """True once any daemon of the group restarted after the session was opened."""
        return session in self._stale

    # -- sessions --

    def _fan(self, fn):
        """Calls fn(shard) on every shard; on a failure still calls the rest, then raises."""
        results, first = [], None
        for s in self.shards:
            try:
                results.append(fn(s))
            except Exception as e:  # noqa: BLE001 - re-raised below
                results.append(None)
                first = first or e
        if first is not None:
            raise first
        return results

    def open_session(self, tokens=None, salt=b""):
        """Opens the session on every daemon; returns (handle, cached_len).

        cached_len is the smallest of the daemons' (their prefix caches evict on
        their own): positions past it are recomputed everywhere, which is a
        rewrite where a daemon already held them.
        """
        opened = []
        try:
            for s in self.shards:
                opened.append(s.client.open_session(tokens, salt))
        except BaseException:
            for s, (sid, _) in zip(self.shards, opened):
                try:
                    s.client.close_session(sid)
                except errors.AttndError:
                    pass
            raise
        h = next(self._ids)
        self._sessions[h] = [sid for sid, _ in opened]
        return h, min(c for _, c in opened)

    def _sids(self, session):
        try:
            return self._sessions[session]
        except KeyError:
            raise errors.NotFound(f"sharded session {session} is not open here") from None

    def close_session(self, session):
        sids = self._sids(session)
        del self._sessions[session]
        self._stale.discard(session)
        self._fan(lambda s: s.client.close_session(sids[self.shards.index(s)]))

    def fork(self, session):
        sids = self._sids(session)
        kids = self._fan(lambda s: s.client.fork(sids[self.shards.index(s)]))
        h = next(self._ids)
        self._sessions[h] = kids
        return h

    def truncate(self, session, length):
        sids = self._sids(session)
        self._fan(lambda s: s.client.truncate(sids[self.shards.index(s)], length))

    def set_scales(self, layer, k_scale, v_scale, k_zero=None, v_zero=None, drop_cached_kv=False):
        """Sets a layer's static scales ([kv_heads] or [kv_heads, head_dim] of the whole
        model): each daemon gets its heads' rows. Returns the daemons' versions."""
        def part(a, s):
            return None if a is None else np.asarray(a, dtype=np.float32)[s.kv_begin:s.kv_end]
        return self._fan(lambda s: s.client.set_scales(layer, part(k_scale, s), part(v_scale, s),
                                                       part(k_zero, s), part(v_zero, s), drop_cached_kv))

    # -- plans and steps --

    def _items_for(self, items, idx):
        out = []
        for it in items:
            sids = self._sids(it.session)
            out.append(Item(sids[idx], it.start, it.n, it.tokens, it.kv_only, it.mask))
        return out

    def plan(self, items):
        """One Plan per daemon for the same items; returns a plan handle."""
        items = list(items)
        pids = self._fan(lambda s: s.client.plan(self._items_for(items, self.shards.index(s))))
        h = next(self._ids)
        self._plans[h] = pids
        return h

    def step_send(self, layer, q=None, k=None, v=None, items=None, plan=0, want_lse=False,
                  fp32_out=False):
        """Sends each daemon its heads' slices of one layer step; returns a handle.

        q [Tq, q_heads, head_dim], k and v [T, kv_heads, head_dim] of the whole
        model, packed in item order as for one daemon. Every daemon gets its step
        before this returns, so they compute at the same time.
        """
        act = self.model.dtype
        qw, kw, vw = to_wire(q, act, "q"), to_wire(k, act, "k"), to_wire(v, act, "v")
        for name, a, heads in (("q", qw, self.model.q_heads), ("k", kw, self.model.kv_heads),
                               ("v", vw, self.model.kv_heads)):
            if a is not None and a.shape[1] != heads:
                raise ValueError(f"{name} has {a.shape[1]} heads, the sharded model {heads}")
        pids = self._plans.get(plan) if plan else None
        if plan and pids is None:
            raise errors.FailedPrecondition(f"sharded plan {plan} is not known here")
        sent = []
        for i, s in enumerate(self.shards):
            its = self._items_for(items, i) if items else None
            rid = s.client.step_send(
                layer,
                None if qw is None else qw[:, s.q_begin:s.q_end],
                None if kw is None else kw[:, s.kv_begin:s.kv_end],
                None if vw is None else vw[:, s.kv_begin:s.kv_end],
                items=its, plan=pids[i] if pids else 0, want_lse=want_lse, fp32_out=fp32_out)
            sent.append((s.client, rid))
        h = next(self._ids)
        self._inflight[h] = sent
        return h

    def step_recv(self, handle):
        """Receives every daemon's part of a step and joins them along the head axis.

        Returns a StepResult whose timing is the slowest daemon's and whose
        .parts are the daemons' own results."""
        sent = self._inflight.pop(handle)
        parts = recv_all(sent)
        out = None if parts[0].out is None else np.concatenate([p.out for p in parts], axis=1)
        lse = None if parts[0].lse is None else np.concatenate([p.lse for p in parts], axis=1)
        slow = max(parts, key=lambda p: p.timing.total_us)
        r = StepResult(out=out, lse=lse, timing=slow.timing, id=handle)
        r.parts = parts
        return r

    def step(self, layer, q=None, k=None, v=None, items=None, plan=0, want_lse=False,
             fp32_out=False):
        return self.step_recv(self.step_send(layer, q, k, v, items, plan, want_lse, fp32_out))
