"""attnd's Python client: framing, blocking and pipelined calls, numpy tensors.

The wire protocol is DESIGN.md section 7: a 4-byte big-endian length, then one
protobuf message (attnd.v1.Request out, attnd.v1.Response in). Messages come from
attnd_pb2, generated from proto/attnd.proto at build time with the standard
protobuf runtime (no nanopb, no gRPC).
"""

import dataclasses
import os
import socket
import struct
import threading
from typing import Optional, Sequence

import numpy as np

from . import errors

try:  # installed package: the generated module sits next to this one
    from . import attnd_pb2 as pb  # type: ignore
except ImportError:  # source tree: $BUILD/python is on sys.path
    import attnd_pb2 as pb  # type: ignore

try:  # bf16 as a real numpy dtype when ml_dtypes is installed
    import ml_dtypes  # type: ignore

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    ml_dtypes = None
    BFLOAT16 = None

DTYPE_BF16 = pb.DTYPE_BF16
DTYPE_FP16 = pb.DTYPE_FP16
DTYPE_FP32 = pb.DTYPE_FP32
DTYPE_INT32 = pb.DTYPE_INT32
_MAX_FRAME = (1 << 31) - 1


# ---- bf16 helpers (numpy has no bf16 dtype of its own) ----

def f32_to_bf16(x) -> np.ndarray:
    """Rounds float values to bf16 (round to nearest even); returns the bits as uint16."""
    shape = np.shape(x)  # ascontiguousarray makes 0-d inputs 1-d; give back the caller's shape
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    r = r.astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r[nan] = 0x7FC0
    return r.reshape(shape)


def bf16_to_f32(bits) -> np.ndarray:
    """Widens bf16 (uint16 bits or an ml_dtypes.bfloat16 array) to float32 exactly."""
    shape = np.shape(bits)
    b = np.ascontiguousarray(bits)
    if BFLOAT16 is not None and b.dtype == BFLOAT16:
        return b.astype(np.float32).reshape(shape)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


def round_bf16(x) -> np.ndarray:
    """Rounds float values to the nearest bf16 and returns them as float32."""
    return bf16_to_f32(f32_to_bf16(x))


def default_socket() -> str:
    """The socket attnd listens on by default, looked up as attnctl does (DESIGN.md section 3)."""
    cands = []
    rt = os.environ.get("RUNTIME_DIRECTORY")
    if rt:
        cands.append(os.path.join(rt.split(":")[0], "attnd.sock"))
    root = os.geteuid() == 0
    if root:
        cands.append("/run/attnd/attnd.sock")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        cands.append(os.path.join(xdg, "attnd.sock"))
    cands.append(f"/tmp/attnd-{os.getuid()}/attnd.sock")
    first = cands[0]
    if not root:
        cands.append("/run/attnd/attnd.sock")
    for c in cands:
        if os.path.exists(c):
            return c
    return first


# ---- items and masks ----

@dataclasses.dataclass
class Mask:
    """An item's attention mask (DESIGN.md section 5). Use the constructors."""

    kind: int = pb.Mask.CAUSAL
    window: int = 0
    prefix_len: int = 0
    doc_lengths: Optional[Sequence[int]] = None
    intervals: Optional[np.ndarray] = None  # int32 [4, kv_len]: lts, lte, uts, ute
    bidirectional: bool = False

    @staticmethod
    def causal():
        return Mask()

    @staticmethod
    def full():
        return Mask(kind=pb.Mask.FULL)

    @staticmethod
    def sliding_window(w):
        return Mask(kind=pb.Mask.SLIDING_WINDOW, window=int(w))

    @staticmethod
    def prefix_lm(n):
        return Mask(kind=pb.Mask.PREFIX_LM, prefix_len=int(n))

    @staticmethod
    def document(lengths):
        return Mask(kind=pb.Mask.DOCUMENT, doc_lengths=[int(x) for x in lengths])

    @staticmethod
    def custom(intervals, bidirectional=False):
        return Mask(kind=pb.Mask.CUSTOM, intervals=np.asarray(intervals, dtype=np.int32),
                    bidirectional=bool(bidirectional))

    def to_pb(self, m):
        m.kind = self.kind
        m.window = self.window
        m.prefix_len = self.prefix_len
        if self.doc_lengths is not None:
            d = np.asarray(self.doc_lengths, dtype="<i4")
            _fill_tensor(m.doc_lengths, DTYPE_INT32, d.shape, d.tobytes())
        if self.intervals is not None:
            iv = np.ascontiguousarray(self.intervals, dtype="<i4")
            _fill_tensor(m.intervals, DTYPE_INT32, iv.shape, iv.tobytes())
        m.bidirectional = self.bidirectional


@dataclasses.dataclass
class Item:
    """One session's part of a step: n new tokens at absolute positions start.."""

    session: int
    start: int
    n: int
    tokens: Optional[Sequence[int]] = None
    kv_only: bool = False
    mask: Optional[Mask] = None

    def to_pb(self, it):
        it.session = self.session
        it.start = self.start
        it.n = self.n
        it.kv_only = self.kv_only
        if self.tokens is not None:
            it.tokens.extend(int(t) for t in self.tokens)
        if self.mask is not None and (self.mask.kind != pb.Mask.CAUSAL or self.mask.intervals is not None):
            self.mask.to_pb(it.mask)


@dataclasses.dataclass
class StepResult:
    """A Step's answer: out [Tq, q_heads, head_dim], lse [Tq, q_heads] (fp32) or None."""

    out: np.ndarray
    lse: Optional[np.ndarray]
    timing: "pb.Timing"
    id: int


def _fill_tensor(t, dtype, shape, data):
    t.dtype = dtype
    del t.shape[:]
    t.shape.extend(int(s) for s in shape)
    t.data = data


def _tensor_to_numpy(t, bf16="auto"):
    shape = tuple(t.shape)
    if t.dtype == DTYPE_FP32:
        return np.frombuffer(t.data, dtype="<f4").reshape(shape)
    if t.dtype == DTYPE_FP16:
        return np.frombuffer(t.data, dtype="<f2").reshape(shape)
    if t.dtype == DTYPE_INT32:
        return np.frombuffer(t.data, dtype="<i4").reshape(shape)
    if t.dtype == DTYPE_BF16:
        bits = np.frombuffer(t.data, dtype="<u2").reshape(shape)
        if bf16 == "float32":
            return bf16_to_f32(bits)
        if bf16 == "auto" and BFLOAT16 is not None:
            return bits.view(BFLOAT16)
        return bits
    raise errors.AttndError(f"response tensor has unknown dtype {t.dtype}", code=13)


class Session:
    """A session opened by Client.session(): closes itself when used as a context
    manager, and knows the epoch it was opened under (stale() after a restart)."""

    def __init__(self, client, session, cached_len):
        self.client = client
        self.id = session
        self.cached_len = cached_len
        self.epoch = client.epoch
        self.closed = False

    def stale(self):
        """True once the daemon restarted: the session is gone, replay its tokens."""
        return self.client.epoch != self.epoch

    def fork(self):
        return Session(self.client, self.client.fork(self.id), 0)

    def truncate(self, length):
        self.client.truncate(self.id, length)

    def close(self):
        if not self.closed and not self.stale():
            self.closed = True
            self.client.close_session(self.id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except errors.AttndError:
            if exc[0] is None:
                raise


class Client:
    """One connection to attnd.

    address: a Unix socket path (anything with '/'), "HOST:PORT", a (host, port)
    tuple, or None for the default socket. token: sent in Hello (needed on TCP
    off loopback). on_epoch_change: "raise" (EpochChanged on the first response
    from a restarted daemon), "flag" (only sets .epoch_changed) or a callable
    taking (old, new). epoch: the epoch a previous connection saw, so that a
    reconnect to a restarted daemon is noticed too. bf16: how bf16 outputs come back: "auto" (ml_dtypes
    bfloat16 if installed, else uint16 bits), "uint16" or "float32".

    Blocking calls (health(), step(), ...) and pipelined ones (step_send() many,
    then step_recv(id) in any order) can be mixed. A Client is safe to share
    between threads for sends and receives, but one thread at a time does each.
    """

    def __init__(self, address=None, token=None, timeout=None, on_epoch_change="raise",
                 bf16="auto", epoch=0):
        self.address = address if address is not None else default_socket()
        self.on_epoch_change = on_epoch_change
        self.bf16 = bf16
        self.epoch = int(epoch)
        self.epoch_changed = False
        self._next_id = 1
        self._pending = {}
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._model = None
        self._session_epoch = {}
        self._sock = self._connect(self.address, timeout)
        if token is not None:
            try:
                self.hello(token)
            except BaseException:
                self.close()
                raise

    # -- connection --

    @staticmethod
    def _connect(address, timeout):
        try:
            if isinstance(address, tuple):
                s = socket.create_connection(address, timeout=timeout)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s
            if "/" in address:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(timeout)
                s.connect(address)
                return s
            host, _, port = address.rpartition(":")
            host = host.strip("[]")
            s = socket.create_connection((host, int(port)), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except (OSError, ValueError) as e:
            raise errors.AttndConnectionError(f"cannot connect to attnd at {address}: {e}") from None

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _recv_exact(self, n):
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = self._sock.recv_into(view[got:], n - got)
            except OSError as e:
                raise errors.AttndConnectionError(f"read from attnd at {self.address}: {e}") from None
            if k == 0:
                raise errors.AttndConnectionError(f"attnd at {self.address} closed the connection")
            got += k
        return bytes(buf)

    # -- raw requests --

    def send(self, req) -> int:
        """Sends a Request (its id is assigned when 0); returns the id."""
        with self._send_lock:
            if req.id == 0:
                req.id = self._next_id
                self._next_id += 1
            data = req.SerializeToString()
            if not 0 < len(data) <= _MAX_FRAME:
                raise errors.InvalidArgument(f"request of {len(data)} bytes does not fit a frame")
            try:
                self._sock.sendall(struct.pack(">I", len(data)) + data)
            except OSError as e:
                raise errors.AttndConnectionError(f"write to attnd at {self.address}: {e}") from None
            return req.id

    def _read_response(self):
        (n,) = struct.unpack(">I", self._recv_exact(4))
        if n == 0 or n > _MAX_FRAME:
            raise errors.AttndConnectionError(f"bad frame length {n} from attnd")
        resp = pb.Response()
        resp.ParseFromString(self._recv_exact(n))
        return resp

    def recv(self, id=None, check=True):
        """Receives the Response with this id (None: the next one, any id).

        Responses for other ids are kept until asked for. With check, a non-OK
        status raises its typed exception and an epoch change is reported.
        """
        with self._recv_lock:
            if id is None and self._pending:
                resp = self._pending.pop(next(iter(self._pending)))
            elif id is not None and id in self._pending:
                resp = self._pending.pop(id)
            else:
                while True:
                    resp = self._read_response()
                    # id 0 is about the connection itself: whoever waits must see it.
                    if id is None or resp.id == id or resp.id == 0:
                        break
                    self._pending[resp.id] = resp
        if check:
            self._check(resp)
        return resp

    def _check(self, resp):
        if resp.epoch:
            if self.epoch and resp.epoch != self.epoch:
                old = self.epoch
                self.epoch = resp.epoch
                self.epoch_changed = True
                self._session_epoch.clear()
                if callable(self.on_epoch_change):
                    self.on_epoch_change(old, resp.epoch)
                elif self.on_epoch_change == "raise":
                    raise errors.EpochChanged(old, resp.epoch, resp.id)
            self.epoch = resp.epoch
        if resp.HasField("status") and resp.status.code != 0:
            raise errors.error_for(resp.status.code, resp.status.message, resp.id, resp.epoch)

    def call(self, req):
        """Sends a Request and waits for its Response (raises on a non-OK status)."""
        return self.recv(self.send(req))

    def _simple(self, field, **kw):
        req = pb.Request()
        getattr(req, field).SetInParent()
        for k, v in kw.items():
            setattr(getattr(req, field), k, v)
        return getattr(self.call(req), field)

    # -- calls --

    def hello(self, token):
        return self._simple("hello", token=token)

    def health(self):
        h = self._simple("health")
        self._model = h.model
        return h

    def stats(self):
        return self._simple("stats")

    def list_sessions(self):
        return list(self._simple("list_sessions").sessions)

    @property
    def model(self):
        """The daemon's ModelShape (fetched with Health on first use)."""
        if self._model is None:
            self.health()
        return self._model

    def open_session(self, tokens=None, salt=b""):
        """Opens a session; returns (session id, cached_len)."""
        req = pb.Request()
        req.open_session.SetInParent()
        if tokens is not None:
            req.open_session.tokens.extend(int(t) for t in tokens)
        req.open_session.salt = bytes(salt)
        r = self.call(req).open_session
        self._session_epoch[r.session] = self.epoch
        return r.session, r.cached_len

    def session(self, tokens=None, salt=b""):
        """Opens a session and returns it as a Session (a context manager)."""
        sid, cached = self.open_session(tokens, salt)
        return Session(self, sid, cached)

    def session_epoch(self, session):
        """The epoch a session was opened under (None when the daemon restarted since)."""
        return self._session_epoch.get(session)

    def close_session(self, session):
        self._session_epoch.pop(session, None)
        self._simple("close_session", session=session)

    def fork(self, session):
        """Forks a session (shares all its blocks); returns the new session id."""
        r = self._simple("fork", session=session)
        self._session_epoch[r.session] = self.epoch
        return r.session

    def truncate(self, session, length):
        self._simple("truncate", session=session, len=int(length))

    def plan(self, items):
        """Admits the items of one step for all layers; returns the plan id."""
        req = pb.Request()
        req.plan.SetInParent()
        for it in items:
            it.to_pb(req.plan.items.add())
        return self.call(req).plan.plan

    def set_scales(self, layer, k_scale, v_scale, k_zero=None, v_zero=None, drop_cached_kv=False):
        """Sets a layer's static KV scales (fp32 [kv_heads] or [kv_heads, head_dim]); returns the version."""
        req = pb.Request()
        s = req.set_scales
        s.layer = int(layer)
        for name, arr in (("k_scale", k_scale), ("v_scale", v_scale), ("k_zero", k_zero),
                          ("v_zero", v_zero)):
            if arr is not None:
                a = np.ascontiguousarray(arr, dtype="<f4")
                _fill_tensor(getattr(s, name), DTYPE_FP32, a.shape, a.tobytes())
        s.drop_cached_kv = bool(drop_cached_kv)
        return self.call(req).set_scales.version

    # -- steps --

    def _wire(self, arr, what):
        """numpy -> (dtype enum, shape, bytes) in the daemon's activation dtype."""
        a = np.asarray(arr)
        if a.ndim != 3:
            raise ValueError(f"{what} must be [rows, heads, head_dim], got shape {a.shape}")
        if BFLOAT16 is not None and a.dtype == BFLOAT16:
            return DTYPE_BF16, a.shape, np.ascontiguousarray(a).view("<u2").tobytes()
        if a.dtype == np.uint16:  # bf16 bits
            return DTYPE_BF16, a.shape, np.ascontiguousarray(a, dtype="<u2").tobytes()
        if a.dtype == np.float16:
            return DTYPE_FP16, a.shape, np.ascontiguousarray(a, dtype="<f2").tobytes()
        if a.dtype.kind == "f":
            if self.model.dtype == "fp16":
                return DTYPE_FP16, a.shape, np.ascontiguousarray(a, dtype="<f2").tobytes()
            return DTYPE_BF16, a.shape, f32_to_bf16(a).astype("<u2").tobytes()
        raise ValueError(f"{what} has unsupported dtype {a.dtype}")

    def step_send(self, layer, q=None, k=None, v=None, items=None, plan=0, want_lse=False,
                  fp32_out=False) -> int:
        """Sends one Step (a plan id, or inline items); returns its request id.

        q: [Tq, q_heads, head_dim], k and v: [T, kv_heads, head_dim], packed in item
        order; float arrays are rounded to the daemon's activation dtype, uint16 is
        taken as bf16 bits, float16 as fp16.
        """
        req = pb.Request()
        st = req.step
        st.layer = int(layer)
        st.plan = int(plan)
        if items:
            for it in items:
                it.to_pb(st.items.add())
        for name, arr in (("q", q), ("k", k), ("v", v)):
            if arr is not None:
                dt, shape, data = self._wire(arr, name)
                _fill_tensor(getattr(st, name), dt, shape, data)
        st.want_lse = bool(want_lse)
        st.fp32_out = bool(fp32_out)
        return self.send(req)

    def step_recv(self, id) -> StepResult:
        """Receives a Step's answer by request id."""
        resp = self.recv(id)
        sr = resp.step
        out = _tensor_to_numpy(sr.out, self.bf16) if sr.HasField("out") else None
        lse = _tensor_to_numpy(sr.lse) if sr.HasField("lse") else None
        return StepResult(out=out, lse=lse, timing=resp.timing, id=resp.id)

    def step(self, layer, q=None, k=None, v=None, items=None, plan=0, want_lse=False,
             fp32_out=False) -> StepResult:
        """One blocking Step; see step_send()."""
        return self.step_recv(self.step_send(layer, q, k, v, items, plan, want_lse, fp32_out))
