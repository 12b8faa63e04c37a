"""A small stand-in for attnd that speaks the wire protocol (docs/protocol.md)
with reference.py's numpy math behind it.

It exists to test the clients on their own: framing, pipelining, out-of-order
answers, typed errors, epoch changes, the bench loop and the tiny Llama example
run against it whether or not the real daemon and engine have landed. It is not
a model of the daemon's performance or of its prefix cache.
"""
import os
import random
import socket
import struct
import threading
import types

import numpy as np

from attnd.client import pb
from reference import RefSession

OK, INVALID, NOT_FOUND, PRECOND, UNIMPL, UNAUTH = 0, 3, 5, 9, 12, 16


class Fail(Exception):
    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code
        self.msg = msg


def shape(layers=2, q_heads=4, kv_heads=2, head_dim=64, block_size=16, rope="neox"):
    return types.SimpleNamespace(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                 block_size=block_size, dtype="bf16", kv_cache="bf16", rope=rope,
                                 rope_theta=10000.0, rotary_dim=head_dim,
                                 softmax_scale=float(np.float32(1 / np.sqrt(head_dim))),
                                 max_context=4096, model_id="fake")


class FakeAttnd:
    """Serves on a Unix socket in a background thread. reverse=True answers each
    batch of pipelined requests in reverse order (tests receive-by-id)."""

    def __init__(self, path, model=None, reverse=False, token=None):
        self.path = path
        self.m = model or shape()
        self.reverse = reverse
        self.token = token
        self.epoch = random.getrandbits(64) or 1
        self.sessions = {}
        self.plans = {}
        self.counts = {}
        self.lock = threading.Lock()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            os.unlink(path)
        self.sock.bind(path)
        self.sock.listen(16)
        self.conns = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def restart(self):
        """Forgets every session and draws a new epoch, as a restarted daemon would."""
        with self.lock:
            self.epoch = random.getrandbits(64) or 1
            self.sessions.clear()
            self.plans.clear()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read(conn, n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _send(self, conn, resp):
        data = resp.SerializeToString()
        conn.sendall(struct.pack(">I", len(data)) + data)

    def _serve(self, conn):
        try:
            while True:
                batch = [self._read_req(conn)]
                conn.setblocking(False)
                try:  # collect what is already queued, to answer it out of order
                    while self.reverse:
                        hdr = conn.recv(4, socket.MSG_PEEK)
                        if len(hdr) < 4:
                            break
                        conn.setblocking(True)
                        batch.append(self._read_req(conn))
                        conn.setblocking(False)
                except (BlockingIOError, InterruptedError):
                    pass
                conn.setblocking(True)
                resps = []
                for req in batch:
                    if req is None:
                        r = pb.Response(id=0, epoch=self.epoch)
                        r.status.code = INVALID
                        r.status.message = "zero-length frame"
                        self._send(conn, r)
                        conn.close()
                        return
                    resps.append(self._handle(req))
                for r in (reversed(resps) if self.reverse else resps):
                    self._send(conn, r)
        except (EOFError, OSError):
            conn.close()

    def _read_req(self, conn):
        (n,) = struct.unpack(">I", self._read(conn, 4))
        if n == 0:
            return None
        req = pb.Request()
        req.ParseFromString(self._read(conn, n))
        return req

    def _handle(self, req):
        resp = pb.Response(id=req.id)
        call = req.WhichOneof("call")
        with self.lock:
            resp.epoch = self.epoch
            self.counts[call] = self.counts.get(call, 0) + 1
            try:
                if call is None:
                    raise Fail(UNIMPL, "no call")
                getattr(self, "_" + call)(getattr(req, call), resp)
            except Fail as e:
                resp.ClearField("result")
                resp.status.code = e.code
                resp.status.message = e.msg
        return resp

    # ---- calls ----

    def _hello(self, r, resp):
        if self.token is not None and r.token != self.token:
            raise Fail(UNAUTH, "bad token")
        resp.hello.SetInParent()

    def _health(self, r, resp):
        h = resp.health
        h.status, h.version, h.backend, h.device = "serving", "fake", "cpu", "numpy"
        m = self.m
        for f in ("layers", "q_heads", "kv_heads", "head_dim", "block_size", "dtype", "kv_cache",
                  "rope", "rope_theta", "rotary_dim", "softmax_scale", "max_context", "model_id"):
            setattr(h.model, f, getattr(m, f))
        h.model.kv_bytes_per_token = m.layers * 2 * m.kv_heads * m.head_dim * 2
        h.epoch = self.epoch
        h.kv_memory_bytes = 64 << 20
        h.kv_blocks = (64 << 20) // (h.model.kv_bytes_per_token * m.block_size)

    def _stats(self, r, resp):
        s = resp.stats
        s.connections = len(self.conns)
        s.sessions = len(self.sessions)
        s.kv_cache = "bf16"
        for k, v in sorted(self.counts.items()):
            if k:
                s.methods.add(method=k, requests=v)

    def _list_sessions(self, r, resp):
        resp.list_sessions.SetInParent()
        for sid, s in self.sessions.items():
            resp.list_sessions.sessions.add(session=sid, len=len(s.tokens[0]), blocks=0)

    def _session(self, sid):
        s = self.sessions.get(sid)
        if s is None:
            raise Fail(NOT_FOUND, f"session {sid:016x} not found")
        return s

    def _open_session(self, r, resp):
        sid = random.getrandbits(64) or 1
        s = RefSession(self.m)
        s.tokens = [[] for _ in range(self.m.layers)]
        self.sessions[sid] = s
        resp.open_session.session = sid
        resp.open_session.cached_len = 0

    def _close_session(self, r, resp):
        self._session(r.session)
        del self.sessions[r.session]
        resp.close_session.SetInParent()

    def _fork(self, r, resp):
        import copy
        s = copy.deepcopy(self._session(r.session))
        sid = random.getrandbits(64) or 1
        self.sessions[sid] = s
        resp.fork.session = sid

    def _truncate(self, r, resp):
        s = self._session(r.session)
        for layer in range(self.m.layers):
            s.K[layer] = s.K[layer][:r.len]
            s.V[layer] = s.V[layer][:r.len]
            s.tokens[layer] = s.tokens[layer][:r.len]
        resp.truncate.SetInParent()

    def _check_items(self, items):
        for i, it in enumerate(items):
            s = self._session(it.session)
            if it.n < 1:
                raise Fail(INVALID, f"item {i}: n must be >= 1")
            if it.start > len(s.tokens[0]):
                raise Fail(INVALID, f"item {i}: start {it.start} > len {len(s.tokens[0])}")
        return list(items)

    def _plan(self, r, resp):
        items = self._check_items(r.items)
        pid = random.getrandbits(64) or 1
        self.plans[pid] = items
        resp.plan.plan = pid

    def _step(self, r, resp):
        m = self.m
        if r.plan:
            if r.plan not in self.plans:
                raise Fail(PRECOND, "plan ended")
            items = self.plans[r.plan]
        else:
            items = self._check_items(r.items)
        T = sum(it.n for it in items)
        Tq = sum(it.n for it in items if not it.kv_only)

        def arr(t, rows, heads):
            if tuple(t.shape) != (rows, heads, m.head_dim) or t.dtype != pb.DTYPE_BF16:
                raise Fail(INVALID, f"tensor shape {list(t.shape)} dtype {t.dtype}, want [{rows},{heads},{m.head_dim}] bf16")
            bits = np.frombuffer(t.data, dtype="<u2").reshape(rows, heads, m.head_dim)
            return (bits.astype(np.uint32) << 16).view(np.float32)

        k, v = arr(r.k, T, m.kv_heads), arr(r.v, T, m.kv_heads)
        q = arr(r.q, Tq, m.q_heads) if Tq else None
        outs, r0, q0 = [], 0, 0
        for it in items:
            s = self.sessions[it.session]
            qi = None if it.kv_only else q[q0:q0 + it.n]
            o = s.step(r.layer, it.start, qi, k[r0:r0 + it.n], v[r0:r0 + it.n])
            s.tokens[r.layer] = s.tokens[r.layer][:it.start] + list(it.tokens or [0] * it.n)
            if o is not None:
                outs.append(o)
                q0 += it.n
            r0 += it.n
        out = np.concatenate(outs) if outs else np.zeros((0, m.q_heads, m.head_dim), np.float32)
        bits = (np.ascontiguousarray(out, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
        resp.step.out.dtype = pb.DTYPE_BF16
        resp.step.out.shape.extend(out.shape)
        resp.step.out.data = bits.tobytes()
        resp.timing.total_us = 1
