"""Helpers shared by the reliability tests (no tests here).

RawConn speaks the wire protocol byte by byte (docs/protocol.md) so a test
can send frames no well-behaved client would (truncated, oversized, garbled)
and see exactly what comes back, including a closed connection. It also reads
a process's resident memory and open descriptors from /proc.
"""
import os
import socket
import struct

import numpy as np

import attnd
from attnd import client as ac

pb = ac.pb

OK, INVALID, NOT_FOUND, PERM, EXHAUSTED, PRECOND, ABORTED, RANGE, UNIMPL, INTERNAL, UNAVAIL, UNAUTH = (
    0, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 16)

# The reliability tests' model: tiny, so hundreds of sessions fit in seconds.
LAYERS, QH, KVH, D, BS = 2, 4, 2, 64, 16
SHAPE = ["--backend", "cpu", "--layers", str(LAYERS), "--q-heads", str(QH), "--kv-heads", str(KVH),
         "--head-dim", str(D), "--block-size", str(BS)]


class Closed(Exception):
    """The daemon closed the connection."""


class RawConn:
    def __init__(self, address, timeout=30.0):
        if isinstance(address, tuple):
            self.sock = socket.create_connection(address, timeout=timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(address)
        self.next_id = 1
        self.pending = {}

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send_raw(self, data):
        self.sock.sendall(data)

    def send(self, req):
        if req.id == 0:
            req.id = self.next_id
            self.next_id += 1
        b = req.SerializeToString()
        self.sock.sendall(struct.pack(">I", len(b)) + b)
        return req.id

    def _exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            try:
                k = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                k = b""
            if not k:
                raise Closed()
            buf += k
        return bytes(buf)

    def recv_any(self):
        (n,) = struct.unpack(">I", self._exact(4))
        r = pb.Response()
        r.ParseFromString(self._exact(n))
        return r

    def recv(self, id):
        if id in self.pending:
            return self.pending.pop(id)
        while True:
            r = self.recv_any()
            if r.id == id or r.id == 0:
                return r
            self.pending[r.id] = r

    def call(self, req):
        return self.recv(self.send(req))

    def is_closed(self, timeout=5.0):
        """True when the daemon closed the connection (EOF) within timeout."""
        self.sock.settimeout(timeout)
        try:
            while True:
                k = self.sock.recv(65536)
                if not k:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False


# ---- request builders ----

_rng = np.random.default_rng(7)


def bf16(shape, rng=None, scale=1.0):
    r = rng if rng is not None else _rng
    x = (r.standard_normal(shape) * scale).astype(np.float32)
    return ac.f32_to_bf16(x).tobytes()


def tensor(t, dtype, shape, data):
    t.dtype = dtype
    del t.shape[:]
    t.shape.extend(int(s) for s in shape)
    t.data = data


def item(it, session, start, n, tokens=None, kv_only=False):
    it.session = session
    it.start = start
    it.n = n
    it.kv_only = kv_only
    it.tokens.extend(tokens if tokens is not None else [(start + i) % 1000 for i in range(n)])
    return it


def step_req(layer, items, q=None, k=None, v=None, plan=0, rng=None, lse=False):
    """items: (session, start, n[, tokens]) tuples; q/k/v: bytes, or None for random."""
    r = pb.Request()
    st = r.step
    st.layer = layer
    st.plan = plan
    T = 0
    for i in items:
        T += i[2]
        if not plan:
            item(st.items.add(), i[0], i[1], i[2], i[3] if len(i) > 3 else None)
    tensor(st.q, pb.DTYPE_BF16, [T, QH, D], q if q is not None else bf16((T, QH, D), rng))
    tensor(st.k, pb.DTYPE_BF16, [T, KVH, D], k if k is not None else bf16((T, KVH, D), rng))
    tensor(st.v, pb.DTYPE_BF16, [T, KVH, D], v if v is not None else bf16((T, KVH, D), rng))
    st.want_lse = lse
    return r


def simple(field, **kw):
    r = pb.Request()
    getattr(r, field).SetInParent()
    for k, v in kw.items():
        setattr(getattr(r, field), k, v)
    return r


def open_req(tokens=None, salt=b""):
    r = simple("open_session")
    if tokens:
        r.open_session.tokens.extend(tokens)
    if salt:
        r.open_session.salt = salt
    return r


def must(resp, what=""):
    if resp.status.code != 0:
        raise AssertionError(f"{what}: status {resp.status.code} {resp.status.message}")
    return resp


def open_session(conn, tokens=None):
    return must(conn.call(open_req(tokens)), "open").open_session.session


def prefill(conn, sess, n, start=0, tokens=None, rng=None):
    outs = []
    for layer in range(LAYERS):
        toks = tokens if tokens is not None else None
        r = must(conn.call(step_req(layer, [(sess, start, n, toks)], rng=rng)), f"prefill layer {layer}")
        outs.append(r.step.out.data)
    return outs


# ---- /proc ----

def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def nfds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))
