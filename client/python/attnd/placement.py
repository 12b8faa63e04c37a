"""Placement of sessions on a consistent-hash ring of daemons (docs/scale-out.md).

A new session goes to the daemon that owns the hash of its first prompt block
(block_size token ids and the salt) on a ketama-style ring (uhashring: 160
points per daemon and weight). Prompts that share their first block land on the
same daemon, where its prefix cache can serve them; removing a daemon moves only
the keys it owned, adding one takes only the keys it now owns.

The ring's nodes are single daemons, or head-sharded groups (a ShardedClient
each) when the fleet file groups its daemons. Each node's connection watches the
daemon's epoch: when a daemon restarted, the sessions placed on it are gone, and
the caller's replay policy is called with them. A removed daemon's sessions are
handed to the same policy (reason "removed"), to be reopened where the ring now
puts them.

uhashring is an optional dependency of the package (Debian: python3-uhashring,
PyPI: uhashring); importing this module without it raises ImportError.
"""

import dataclasses
import hashlib
import struct
import threading
from typing import Any, Callable, List, Optional, Sequence

import uhashring

from . import errors
from ._fanout import EpochRelay
from .fleet import Daemon, Fleet


def prefix_key(tokens: Optional[Sequence[int]], block_size: int, salt: bytes = b"") -> str:
    """The ring key of a prompt: a 128-bit BLAKE2b of the salt and the first block's
    token ids (the whole prompt when it is shorter than a block), as hex."""
    h = hashlib.blake2b(digest_size=16)
    salt = bytes(salt)
    h.update(struct.pack("<I", len(salt)))
    h.update(salt)
    first = list(tokens or [])[: int(block_size)]
    h.update(struct.pack(f"<{len(first)}I", *[int(t) & 0xFFFFFFFF for t in first]))
    return h.hexdigest()


def _chain(first, then):
    """An epoch callback that runs the connection's own one (a ShardedClient's, which
    marks its sessions stale) before the placement's."""
    if not callable(first):
        return then

    def both(old, new):
        try:
            first(old, new)
        finally:
            then(old, new)
    return both


@dataclasses.dataclass
class PlacedSession:
    """A session on the node the ring chose. tokens: the prompt it was opened with
    (what a replay starts from); data: the caller's own slot."""

    node: str
    id: int
    cached_len: int
    tokens: Optional[List[int]]
    salt: bytes
    epoch: int
    data: Any = None
    gone: bool = False


class Placement:
    """Routes new sessions to daemons (or groups) by their first prompt block.

    nodes: {name: (connect, weight)} where connect() returns an attnd.Client or a
    ShardedClient; use from_fleet() to build it from a fleet file. block_size:
    the daemons' block size (None: asked from the first node's Health when first
    needed). on_replay(node, sessions, reason): the caller's replay policy,
    called with the PlacedSessions that a restart ("restarted") or a removal
    ("removed") took away; they are no longer tracked here, so the policy
    reopens them with open_session() (the ring now names their new home).
    """

    def __init__(self, nodes, block_size=None, on_replay: Optional[Callable] = None):
        self._connect = {}
        self._clients = {}
        self._lock = threading.RLock()
        self._sessions = {}
        self.on_replay = on_replay
        self.block_size = block_size
        self.ring = uhashring.HashRing(nodes={})
        for name, (connect, weight) in nodes.items():
            self.add_node(name, connect, weight)

    @staticmethod
    def from_fleet(fleet: Fleet, by_group=None, block_size=None, on_replay=None, **client_kw):
        """A Placement over a Fleet: one node per daemon, or one per group (a
        ShardedClient over its daemons) when by_group is true or, with None, when
        the fleet has groups."""
        from .sharded import ShardedClient

        if by_group is None:
            by_group = bool(fleet.groups())
        nodes = {}
        if by_group:
            for gname, ds in fleet.groups().items():
                nodes[gname] = ((lambda ds=ds: ShardedClient(ds, on_epoch_change="flag", **client_kw)),
                                max(d.weight for d in ds))
        else:
            for d in fleet.daemons:
                nodes[d.name] = ((lambda d=d: d.connect(**client_kw)), d.weight)
        return Placement(nodes, block_size=block_size, on_replay=on_replay)

    # -- the ring --

    def add_node(self, name, connect, weight=1):
        """Adds a daemon (or group) to the ring; it takes over only the keys it now owns."""
        if isinstance(connect, Daemon):
            d = connect
            connect = lambda: d.connect()  # noqa: E731
        with self._lock:
            if name in self._connect:
                raise ValueError(f"node {name!r} is already on the ring")
            self._connect[name] = connect
            self.ring.add_node(name, {"weight": int(weight)})

    def remove_node(self, name) -> List[PlacedSession]:
        """Takes a daemon off the ring; its sessions go to the replay policy
        (reason "removed") and are returned."""
        with self._lock:
            self.ring.remove_node(name)
            del self._connect[name]
            cl = self._clients.pop(name, None)
            moved = self._take(name)
        if cl is not None:
            cl.close()
        self._replay(name, moved, "removed")
        return moved

    @property
    def nodes(self):
        return list(self._connect)

    def node_for(self, tokens, salt=b"") -> str:
        """The node the ring gives a prompt (its first block and salt)."""
        if not self._connect:
            raise errors.Unavailable("the placement ring has no daemon")
        return self.ring.get_node(prefix_key(tokens, self._block_size(), salt))

    def _block_size(self):
        if self.block_size is None:
            self.block_size = self.client(next(iter(self._connect))).model.block_size
        return self.block_size

    # -- connections and epochs --

    def client(self, name):
        """The node's connection (opened on first use; it watches the epoch)."""
        with self._lock:
            cl = self._clients.get(name)
            if cl is None:
                cl = self._connect[name]()
                relay = EpochRelay("flag", name, self._restarted)
                conns = [s.client for s in cl.shards] if hasattr(cl, "shards") else [cl]
                for conn in conns:  # a ShardedClient: watch every daemon of it
                    conn.on_epoch_change = _chain(conn.on_epoch_change, relay)
                self._clients[name] = cl
            return cl

    def _take(self, name):
        taken = [s for s in self._sessions.values() if s.node == name]
        for s in taken:
            s.gone = True
            del self._sessions[(s.node, s.id)]
        return taken

    def _restarted(self, name, old, new):
        with self._lock:
            lost = self._take(name)
        self._replay(name, lost, "restarted")

    def _replay(self, name, sessions, reason):
        if sessions and self.on_replay is not None:
            self.on_replay(name, sessions, reason)

    def check(self):
        """Asks every connected node for Health, so that a restart is noticed (and the
        replay policy called) without waiting for the next call to fail."""
        for name in list(self._clients):
            cl = self._clients.get(name)
            if cl is None:
                continue
            if hasattr(cl, "shards"):
                for s in cl.shards:
                    s.client.health()
            else:
                cl.health()

    # -- sessions --

    def open_session(self, tokens=None, salt=b"", data=None) -> PlacedSession:
        """Opens a session where the ring puts its first block; returns a PlacedSession."""
        name = self.node_for(tokens, salt)
        cl = self.client(name)
        sid, cached = cl.open_session(tokens, salt)
        epoch = getattr(cl, "epoch", 0)
        s = PlacedSession(name, sid, cached, None if tokens is None else [int(t) for t in tokens],
                          bytes(salt), epoch, data)
        with self._lock:
            self._sessions[(name, sid)] = s
        return s

    def close_session(self, s: PlacedSession):
        with self._lock:
            tracked = self._sessions.pop((s.node, s.id), None)
        if tracked is not None and not s.gone:
            self.client(s.node).close_session(s.id)

    def sessions(self, node=None) -> List[PlacedSession]:
        with self._lock:
            return [s for s in self._sessions.values() if node is None or s.node == node]

    def close(self):
        with self._lock:
            clients, self._clients = self._clients, {}
        for cl in clients.values():
            cl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
