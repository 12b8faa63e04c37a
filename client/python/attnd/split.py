"""Split context: one long context over several daemons (docs/scale-out.md).

A split session is a chain of parts, each a session on one daemon holding the
positions [base, next part's base): part 0 starts at 0, each later part was
opened with OpenSession(base = the length at that moment). New tokens go to the
tail (the last part). Every part answers each query row: the tail with an
ordinary item (it writes the new k and v and attends), the other parts with a
q_only item (attend over what they hold, write nothing). Every daemon returns
fp32 out and lse; the client merges them by the lse rule (lse.py), where a part
that sees no key of a row (out 0, lse -inf) contributes nothing.

The tail rolls to the next daemon of the group (round robin) when a new step
starts at the end of a tail that already holds part_len positions; one step's
tokens always stay on one part, so chunk a long prefill to spread it.

Needs daemons whose Health says split_context (they honour OpenSession.base
and Item.q_only); an older daemon is refused, never silently misused.
"""

import dataclasses
import itertools
from typing import List

import numpy as np

from . import errors
from ._fanout import EpochRelay, recv_all, shape_mismatch, to_wire
from .client import Item, StepResult, pb
from .fleet import Daemon
from .lse import LseMerger


class SplitError(errors.AttndError):
    """The daemons cannot hold a split context (or a call would need an unsupported rewrite)."""

    code = 9  # FAILED_PRECONDITION


@dataclasses.dataclass
class Part:
    daemon: int  # index into SplitClient.clients
    session: int  # the session id on that daemon
    base: int


@dataclasses.dataclass
class SplitSession:
    parts: List[Part]
    length: int  # layer 0's length as planned so far

    @property
    def tail(self):
        return self.parts[-1]


class _Route:
    """How one step's items map onto the daemons: per daemon its items and, in its
    row order, which caller q rows and kv rows it gets; per q-carrying part the
    (daemon, first daemon row, first caller row, n) to merge."""

    def __init__(self, ndaemons):
        self.items = [[] for _ in range(ndaemons)]
        self.qrows = [[] for _ in range(ndaemons)]
        self.kvrows = [[] for _ in range(ndaemons)]
        self.merge = []
        self.tq = 0

    def add(self, d, item, q0, kv0):
        if not item.kv_only:
            r = sum(len(x) for x in self.qrows[d])
            self.merge.append((d, r, q0, item.n))
            self.qrows[d].append(np.arange(q0, q0 + item.n))
        if not getattr(item, "q_only", False):
            self.kvrows[d].append(np.arange(kv0, kv0 + item.n))
        self.items[d].append(item)

    def finish(self):
        cat = lambda xs: np.concatenate(xs) if xs else None  # noqa: E731
        self.qidx = [cat(x) for x in self.qrows]
        self.kvidx = [cat(x) for x in self.kvrows]


class QOnlyItem(Item):
    """An attend-only item (Item.q_only on the wire): q rows, no k or v, nothing written."""

    q_only = True

    def to_pb(self, it):
        super().to_pb(it)
        it.q_only = True


def _q_only_item(session, start, n, mask):
    return QOnlyItem(session, start, n, None, False, mask)


class SplitClient:
    """Split-context sessions over a group of daemons.

    daemons: fleet.Daemon entries or addresses, in the order parts are placed.
    part_len: positions a part holds before the tail rolls to the next daemon.
    on_epoch_change: as ShardedClient's. Other keyword arguments go to attnd.Client.
    """

    def __init__(self, daemons, part_len, on_epoch_change="raise", **client_kw):
        if int(part_len) < 1:
            raise ValueError("part_len must be >= 1")
        self.part_len = int(part_len)
        self.names, self.clients = [], []
        self._ids = itertools.count(1)
        self._sessions, self._plans, self._inflight = {}, {}, {}
        self._stale = set()
        try:
            for i, d in enumerate(daemons):
                d = d if isinstance(d, Daemon) else Daemon(str(d), str(d))
                relay = EpochRelay(on_epoch_change, d.name, self._restarted)
                cl = d.connect(on_epoch_change=relay, **client_kw)
                self.clients.append(cl)
                self.names.append(d.name)
                h = cl.health()
                if not h.split_context:
                    raise SplitError(f"{d.name} does not serve split context (Health.split_context is "
                                     f"false: a daemon that predates OpenSession.base and q_only)")
                m = h.model
                if m.kv_head_end and (m.kv_head_begin, m.kv_head_end) != (0, m.model_kv_heads):
                    raise SplitError(f"{d.name} holds only kv heads {m.kv_head_begin}:{m.kv_head_end}")
                bad = shape_mismatch(self.clients[0].model, m)
                if bad or (m.q_heads, m.kv_heads) != (self.clients[0].model.q_heads,
                                                      self.clients[0].model.kv_heads):
                    raise SplitError(f"{d.name}: model differs from {self.names[0]}'s: {bad or 'heads'}")
            if not self.clients:
                raise SplitError("a split group needs at least one daemon")
        except BaseException:
            self.close()
            raise
        self.model = self.clients[0].model

    def close(self):
        for cl in self.clients:
            cl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _restarted(self, name, old, new):
        d = self.names.index(name)
        self._stale.update(h for h, s in self._sessions.items() if any(p.daemon == d for p in s.parts))

    def stale(self, session):
        """True once a daemon holding one of the session's parts restarted."""
        return session in self._stale

    # -- sessions --

    def _open_part(self, d, tokens, salt, base):
        cl = self.clients[d]
        req_base = int(base)
        req = pb.Request()
        req.open_session.SetInParent()
        if tokens is not None:
            req.open_session.tokens.extend(int(t) for t in tokens)
        req.open_session.salt = bytes(salt)
        req.open_session.base = req_base
        r = cl.call(req).open_session
        if r.base != req_base:
            try:
                cl.close_session(r.session)
            except errors.AttndError:
                pass
            raise SplitError(f"{self.names[d]} opened the session at base {r.base}, not {req_base}")
        return r.session, r.cached_len

    def open_session(self, tokens=None, salt=b""):
        """Opens part 0 (base 0, prefix cache as usual) on the group's first daemon;
        returns (handle, cached_len)."""
        sid, cached = self._open_part(0, tokens, salt, 0)
        h = next(self._ids)
        self._sessions[h] = SplitSession([Part(0, sid, 0)], cached)
        return h, cached

    def session(self, handle) -> SplitSession:
        try:
            return self._sessions[handle]
        except KeyError:
            raise errors.NotFound(f"split session {handle} is not open here") from None

    def close_session(self, handle):
        s = self.session(handle)
        del self._sessions[handle]
        self._stale.discard(handle)
        first = None
        for p in s.parts:
            try:
                self.clients[p.daemon].close_session(p.session)
            except errors.AttndError as e:
                first = first or e
        if first is not None:
            raise first

    def truncate(self, handle, length):
        """Rolls the context back to length positions: parts that start at or past it
        are closed (part 0 stays), the part that then holds the end is truncated."""
        s = self.session(handle)
        length = int(length)
        while len(s.parts) > 1 and s.tail.base >= length:
            p = s.parts.pop()
            self.clients[p.daemon].close_session(p.session)
        self.clients[s.tail.daemon].truncate(s.tail.session, length)
        s.length = length

    def fork(self, handle):
        """Forks every part (each shares its blocks on its daemon); returns the new handle."""
        s = self.session(handle)
        parts = []
        try:
            for p in s.parts:
                parts.append(Part(p.daemon, self.clients[p.daemon].fork(p.session), p.base))
        except BaseException:
            for p in parts:
                self.clients[p.daemon].close_session(p.session)
            raise
        h = next(self._ids)
        self._sessions[h] = SplitSession(parts, s.length)
        return h

    # -- plans and steps --

    def _route(self, items, roll):
        rt = _Route(len(self.clients))
        q0 = kv0 = 0
        seen = set()
        for i, it in enumerate(items):
            if getattr(it, "q_only", False):
                raise ValueError(f"item {i}: q_only items are made by the split client, not passed to it")
            s = self.session(it.session)
            if it.session in seen:
                raise errors.InvalidArgument(f"item {i}: session {it.session} appears twice")
            seen.add(it.session)
            if it.start > s.length:
                raise errors.InvalidArgument(f"item {i}: start {it.start} > length {s.length}")
            if roll and it.start == s.length and s.length - s.tail.base >= self.part_len:
                d = (s.tail.daemon + 1) % len(self.clients)
                sid, _ = self._open_part(d, None, b"", s.length)
                s.parts.append(Part(d, sid, s.length))
            if it.start < s.tail.base:
                raise SplitError(f"item {i}: start {it.start} rewrites positions before the tail's "
                                 f"base {s.tail.base}; truncate the session first")
            for p in s.parts[:-1]:
                if not it.kv_only:
                    rt.add(p.daemon, _q_only_item(p.session, it.start, it.n, it.mask), q0, kv0)
            tail = Item(s.tail.session, it.start, it.n, it.tokens, it.kv_only, it.mask)
            rt.add(s.tail.daemon, tail, q0, kv0)
            if roll:
                s.length = it.start + it.n
            if not it.kv_only:
                q0 += it.n
            kv0 += it.n
        rt.tq = q0
        rt.finish()
        return rt

    def plan(self, items):
        """Routes the items (rolling tails that are full) and makes one Plan per daemon
        that has a part of them; returns a plan handle."""
        rt = self._route(list(items), roll=True)
        rt.plans = [self.clients[d].plan(its) if its else 0 for d, its in enumerate(rt.items)]
        h = next(self._ids)
        self._plans[h] = rt
        return h

    def step_send(self, layer, q=None, k=None, v=None, plan=0):
        """Sends one layer step of a plan to every daemon with a part of it (fp32 out
        and lse from each); returns a handle for step_recv()."""
        rt = self._plans.get(plan)
        if rt is None:
            raise errors.FailedPrecondition(f"split plan {plan} is not known here")
        act = self.model.dtype
        qw, kw, vw = to_wire(q, act, "q"), to_wire(k, act, "k"), to_wire(v, act, "v")
        if rt.tq and (qw is None or qw.shape[0] != rt.tq):
            raise ValueError(f"q must have the plan's {rt.tq} rows")
        sent = []
        for d, its in enumerate(rt.items):
            if not its:
                continue
            qi, ki = rt.qidx[d], rt.kvidx[d]
            rid = self.clients[d].step_send(
                layer, None if qi is None else qw[qi], None if ki is None else kw[ki],
                None if ki is None else vw[ki], plan=rt.plans[d], want_lse=True, fp32_out=True)
            sent.append((d, self.clients[d], rid))
        h = next(self._ids)
        self._inflight[h] = (rt, sent)
        return h

    def step_recv(self, handle) -> StepResult:
        """Receives every part and merges them: out fp32 [Tq, q_heads, head_dim] and
        lse fp32 [Tq, q_heads] (0 and -inf for rows no part sees a key of)."""
        rt, sent = self._inflight.pop(handle)
        parts = recv_all([(cl, rid) for _, cl, rid in sent])
        by_daemon = {d: p for (d, _, _), p in zip(sent, parts)}
        mg = LseMerger((rt.tq, self.model.q_heads), self.model.head_dim)
        for d, r, q0, n in rt.merge:
            p = by_daemon[d]
            mg.add(p.out[r:r + n], p.lse[r:r + n], slice(q0, q0 + n))
        out, lse = mg.result()
        slow = max(parts, key=lambda p: p.timing.total_us) if parts else None
        res = StepResult(out=out, lse=lse, timing=None if slow is None else slow.timing, id=handle)
        res.parts = parts
        return res

    def step(self, layer, q=None, k=None, v=None, plan=0) -> StepResult:
        return self.step_recv(self.step_send(layer, q, k, v, plan))
