"""attnd's Python client: framing, blocking and pipelined calls, numpy or torch tensors.

The wire protocol (docs/protocol.md) is a 4-byte big-endian length, then one
protobuf message (attnd.v1.Request out, attnd.v1.Response in). Messages come from
attnd_pb2, generated from proto/attnd.proto at build time with the standard
protobuf runtime (no nanopb, no gRPC).
"""

import dataclasses
import errno
import os
import socket
import struct
import threading
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple,
                    Union)

import numpy as np
import numpy.typing as npt

from . import _frames
from . import errors
from . import ipc as _ipc

try:  # installed package: the generated module sits next to this one
    from . import attnd_pb2 as pb
except ImportError:  # source tree: $BUILD/python is on sys.path
    import attnd_pb2 as pb  # type: ignore[no-redef,import-not-found,unused-ignore]

if TYPE_CHECKING:  # the generated messages (attnd_pb2.pyi ships with the package)
    from .attnd_pb2 import (HealthResponse, ModelShape, Request, Response,  # noqa: F401
                            StatsResponse, Timing)

# Where the client connects: a Unix socket path, "HOST:PORT", or (host, port).
Address = Union[str, Tuple[str, int]]

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
_READ_AHEAD = 1 << 16


# ---- bf16 helpers (numpy has no bf16 dtype of its own) ----

def f32_to_bf16(x: npt.ArrayLike) -> np.ndarray:
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


def bf16_to_f32(bits: npt.ArrayLike) -> np.ndarray:
    """Widens bf16 (uint16 bits or an ml_dtypes.bfloat16 array) to float32 exactly."""
    shape = np.shape(bits)
    b = np.ascontiguousarray(bits)
    if BFLOAT16 is not None and b.dtype == BFLOAT16:
        return b.astype(np.float32).reshape(shape)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


def round_bf16(x: npt.ArrayLike) -> np.ndarray:
    """Rounds float values to the nearest bf16 and returns them as float32."""
    return bf16_to_f32(f32_to_bf16(x))


def default_socket() -> str:
    """The socket attnd listens on by default, looked up as attnctl does (docs/operations.md)."""
    cands: List[str] = []
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


_UNIX_SNDBUF = 4 << 20


def _kernel_timeout(s: socket.socket, timeout: Optional[float]) -> None:
    """A connected socket made blocking, its timeout kept by the kernel
    (SO_RCVTIMEO / SO_SNDTIMEO) rather than by Python: with settimeout, every
    send and recv is a poll() and then the call itself (two system calls per
    read or write of a step's frame). A timed-out call then fails with EAGAIN,
    reported as a timeout (_io_error)."""
    if timeout is None:
        return
    sec = max(float(timeout), 1e-3)
    tv = struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    s.settimeout(None)


def _io_error(what: str, address: Any, e: OSError) -> "errors.AttndConnectionError":
    """An I/O failure on the connection, a kernel timeout (EAGAIN) named as one."""
    if isinstance(e, (BlockingIOError, socket.timeout)) or e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
        return errors.AttndConnectionError(f"{what} attnd at {address}: timed out")
    return errors.AttndConnectionError(f"{what} attnd at {address}: {e}")


# ---- session ids ----

class SessionId(int):
    """A session id: the 64-bit integer of the protocol, printed as attnctl and the
    daemon's messages print it, 16 lowercase hex digits (``0123456789abcdef``).

    It is an int (compares, hashes and serializes as one); SessionId("0123...")
    parses the printed form back.
    """

    __slots__ = ()

    def __new__(cls, value: Union[int, str]) -> "SessionId":
        if isinstance(value, str):
            value = int(value, 16)
        if not 0 <= value < 1 << 64:
            raise ValueError(f"a session id is a 64-bit unsigned integer, got {value}")
        return super().__new__(cls, value)

    def __str__(self) -> str:
        return format(int(self), "016x")

    def __repr__(self) -> str:
        return f"SessionId('{self}')"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(int(self), spec)


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """One entry of list_sessions(): length (layer 0, absolute), blocks held, seconds
    idle, and the first position held (split context; 0 otherwise)."""

    session: SessionId
    len: int
    blocks: int
    idle_s: int
    base: int = 0


# ---- items and masks ----

@dataclasses.dataclass
class Mask:
    """An item's attention mask (docs/numerics.md). Use the constructors."""

    kind: int = pb.Mask.CAUSAL
    window: int = 0
    prefix_len: int = 0
    doc_lengths: Optional[Sequence[int]] = None
    intervals: Optional[np.ndarray] = None  # int32 [4, kv_len]: lts, lte, uts, ute
    bidirectional: bool = False

    @staticmethod
    def causal() -> "Mask":
        return Mask()

    @staticmethod
    def full() -> "Mask":
        return Mask(kind=pb.Mask.FULL)

    @staticmethod
    def sliding_window(w: int) -> "Mask":
        return Mask(kind=pb.Mask.SLIDING_WINDOW, window=int(w))

    @staticmethod
    def prefix_lm(n: int) -> "Mask":
        return Mask(kind=pb.Mask.PREFIX_LM, prefix_len=int(n))

    @staticmethod
    def document(lengths: Iterable[int]) -> "Mask":
        return Mask(kind=pb.Mask.DOCUMENT, doc_lengths=[int(x) for x in lengths])

    @staticmethod
    def custom(intervals: npt.ArrayLike, bidirectional: bool = False) -> "Mask":
        return Mask(kind=pb.Mask.CUSTOM, intervals=np.asarray(intervals, dtype=np.int32),
                    bidirectional=bool(bidirectional))

    def to_pb(self, m: Any) -> None:
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

    def to_pb(self, it: Any) -> None:
        it.session = int(self.session)
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

    out: Optional[np.ndarray]
    lse: Optional[np.ndarray]
    timing: "Timing"
    id: int


def _fill_tensor(t: Any, dtype: int, shape: Sequence[int], data: bytes) -> None:
    t.dtype = dtype
    del t.shape[:]
    t.shape.extend(int(s) for s in shape)
    t.data = data


def _is_torch(x: Any) -> bool:
    """A torch.Tensor, recognised without importing torch (it stays optional)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "untyped_storage")


def _torch_wire(t: Any, what: str, model_dtype: str) -> Tuple[int, Tuple[int, ...], Any]:
    """torch tensor -> (dtype enum, shape, bytes): bf16 and fp16 as they are (one copy
    to host bytes, no per-element Python work); float32/64 rounded by torch to the
    daemon's activation dtype (round to nearest even)."""
    import torch

    if t.dim() != 3:
        raise ValueError(f"{what} must be [rows, heads, head_dim], got shape {tuple(t.shape)}")
    t = t.detach()
    if t.dtype in (torch.float32, torch.float64):
        t = t.to(torch.float16 if model_dtype == "fp16" else torch.bfloat16)
    if t.dtype == torch.bfloat16:
        dt = DTYPE_BF16
    elif t.dtype == torch.float16:
        dt = DTYPE_FP16
    else:
        raise ValueError(f"{what} has unsupported dtype {t.dtype}")
    t = t.to("cpu").contiguous()
    # A view of the host tensor's memory (one copy from a device, none on the host).
    return dt, tuple(t.shape), t.view(torch.int16).numpy()


_ITEMSIZE = {DTYPE_FP32: 4, DTYPE_FP16: 2, DTYPE_BF16: 2, DTYPE_INT32: 4}


def _tensor_buf(t: Any, frame: Optional[bytearray], span: Any) -> Tuple[Any, int, int]:
    """(buffer, offset, count) of a response tensor's elements: a view of the frame
    when its data were cut out of the message (_frames.cut_step; aligned there in
    place), else its data field's bytes."""
    size = _ITEMSIZE.get(t.dtype)
    if size is None:
        raise errors.AttndError(f"response tensor has unknown dtype {t.dtype}", code=13)
    if frame is not None and span is not None:
        off, count = _frames.tensor_view(frame, span, size)
        return frame, off, count
    return t.data, 0, len(t.data) // size


def _tensor_to_torch(t: Any, device: Any = None, frame: Optional[bytearray] = None,
                     span: Any = None) -> Any:
    """A response tensor as a torch tensor of its own dtype (bf16 stays bf16): a view
    of the received frame (large tensors) or one copy of its bytes into a writable
    buffer, never walked in Python."""
    import torch

    dts = {DTYPE_FP32: torch.float32, DTYPE_FP16: torch.float16, DTYPE_BF16: torch.bfloat16,
           DTYPE_INT32: torch.int32}
    buf, off, count = _tensor_buf(t, frame, span)
    if count == 0:  # torch.frombuffer refuses an empty buffer
        out = torch.empty(tuple(t.shape), dtype=dts[t.dtype])
        return out.to(device) if device is not None else out
    if not isinstance(buf, bytearray):
        buf = bytearray(buf)
    out = torch.frombuffer(buf, dtype=dts[t.dtype], count=count, offset=off).reshape(tuple(t.shape))
    return out.to(device) if device is not None else out


def _tensor_to_numpy(t: Any, bf16: str = "auto", frame: Optional[bytearray] = None,
                     span: Any = None) -> np.ndarray:
    shape = tuple(t.shape)
    buf, off, count = _tensor_buf(t, frame, span)
    if t.dtype == DTYPE_FP32:
        return np.frombuffer(buf, dtype="<f4", count=count, offset=off).reshape(shape)
    if t.dtype == DTYPE_FP16:
        return np.frombuffer(buf, dtype="<f2", count=count, offset=off).reshape(shape)
    if t.dtype == DTYPE_INT32:
        return np.frombuffer(buf, dtype="<i4", count=count, offset=off).reshape(shape)
    if t.dtype == DTYPE_BF16:
        bits = np.frombuffer(buf, dtype="<u2", count=count, offset=off).reshape(shape)
        if bf16 == "float32":
            return bf16_to_f32(bits)
        if bf16 == "auto" and BFLOAT16 is not None:
            return bits.view(BFLOAT16)
        return bits
    raise errors.AttndError(f"response tensor has unknown dtype {t.dtype}", code=13)


# The fast path's tensors (Client._fast_tensors, Client._ok_result).
_U2 = np.dtype("<u2")
_FAST_NP = {_U2: DTYPE_BF16, np.dtype("<f2"): DTYPE_FP16}
if BFLOAT16 is not None:
    _FAST_NP[BFLOAT16] = DTYPE_BF16
_NP_DT = {DTYPE_FP32: np.dtype("<f4"), DTYPE_FP16: np.dtype("<f2"), DTYPE_INT32: np.dtype("<i4"),
          DTYPE_BF16: _U2}
_TORCH_DT: Dict[Any, int] = {}


def _torch_dtypes() -> Dict[Any, int]:
    """torch bf16 and fp16 -> their wire dtypes ("int16": torch.int16), once torch is in use."""
    if not _TORCH_DT:
        import torch

        _TORCH_DT.update({torch.bfloat16: DTYPE_BF16, torch.float16: DTYPE_FP16, "int16": torch.int16})
    return _TORCH_DT


class _Wire:
    """A response tensor's dtype, shape and data bytes, as _tensor_to_torch reads a pb.Tensor."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: int, shape: Tuple[int, ...], data: bytes) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data


class Session:
    """A session opened by Client.session(): closes itself when used as a context
    manager, and knows the epoch it was opened under (stale() after a restart)."""

    def __init__(self, client: "Client", session: int, cached_len: int) -> None:
        self.client = client
        self.id = SessionId(session)
        self.cached_len = cached_len
        self.epoch = client.epoch
        self.closed = False

    def __repr__(self) -> str:
        return f"Session({self.id}, cached_len={self.cached_len}, epoch={self.epoch:016x})"

    def stale(self) -> bool:
        """True once the daemon restarted: the session is gone, replay its tokens."""
        return self.client.epoch != self.epoch

    def fork(self) -> "Session":
        return Session(self.client, self.client.fork(self.id), 0)

    def truncate(self, length: int) -> None:
        self.client.truncate(self.id, length)

    def close(self) -> None:
        if not self.closed and not self.stale():
            self.closed = True
            self.client.close_session(self.id)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
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
    bfloat16 if installed, else uint16 bits), "uint16" or "float32". ipc: whether step()
    over torch CUDA tensors names them in place (same-host zero-copy, attnd.ipc) instead
    of sending bytes: "auto" (when the daemon is on this host and device and the step's
    q, k and v come to 1 MiB or more; bytes from the first FAILED_PRECONDITION on),
    True (every such step; refusals raise) or False.

    Blocking calls (health(), step(), ...) and pipelined ones (step_send() many,
    then step_recv(id) in any order) can be mixed. A Client is safe to share
    between threads for sends and receives, but one thread at a time does each.
    """

    # A decode loop's steps (a plan; numpy arrays or torch CPU tensors) go a
    # shorter way: frame heads cached per tensor signature
    # (_frames.step_frame_sig), an OK answer parsed by hand
    # (_frames.parse_step_ok). False: the general path alone, the same
    # results (bench/bench_client.py compares the two).
    _fast_steps = True

    def __init__(self, address: Optional[Address] = None, token: Optional[str] = None,
                 timeout: Optional[float] = None,
                 on_epoch_change: Union[str, Callable[[int, int], Any]] = "raise",
                 bf16: str = "auto", epoch: int = 0, ipc: Union[bool, str] = "auto") -> None:
        self.address: Address = address if address is not None else default_socket()
        # Same-host zero-copy for torch CUDA tensors (attnd.ipc): "auto", True or False.
        self.ipc = _ipc.IpcState(self, ipc)
        self.on_epoch_change = on_epoch_change
        self.bf16 = bf16
        self.epoch = int(epoch)
        self.epoch_changed = False
        self._next_id = 1
        # id -> (Response, cut): cut is (frame, spans) when _frames.cut_step took
        # a step's out/lse data out of the message (they are views of frame).
        self._pending: Dict[int, Tuple["Response", Any]] = {}
        # id -> (out, lse) the daemon writes for a step sent by reference (attnd.ipc).
        self._ipc_out: Dict[int, Tuple[Any, Any]] = {}
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        # Bytes read ahead of the frame being read: a small answer's header and
        # body come in one recv (_recv_exact).
        self._rbuf = bytearray(_READ_AHEAD)
        self._rpos = self._rlen = 0
        self._spin_ns = 0
        self._model: Optional["ModelShape"] = None
        self._session_epoch: Dict[int, int] = {}
        self._sock: Optional[socket.socket] = self._connect(self.address, timeout)
        if token is not None:
            try:
                self.hello(token)
            except BaseException:
                self.close()
                raise

    # -- connection --

    def __repr__(self) -> str:
        state = "closed" if self._sock is None else f"epoch {self.epoch:016x}"
        return f"attnd.Client({self.address!r}, {state})"

    @staticmethod
    def _connect(address: Address, timeout: Optional[float]) -> socket.socket:
        try:
            if isinstance(address, tuple):
                s = socket.create_connection(address, timeout=timeout)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            elif "/" in address:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                # A Unix stream socket holds at most the sender's buffer in
                # flight: a large step's request goes out in 4 MiB writes,
                # not the kernel's default ~208K (best effort: the kernel
                # caps it at net.core.wmem_max).
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_SNDBUF)
                except OSError:
                    pass
                s.settimeout(timeout)
                s.connect(address)
            else:
                host, _, port = address.rpartition(":")
                host = host.strip("[]")
                s = socket.create_connection((host, int(port)), timeout=timeout)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _kernel_timeout(s, timeout)
            return s
        except (OSError, ValueError) as e:
            raise errors.AttndConnectionError(f"cannot connect to attnd at {address}: {e}") from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _conn(self) -> socket.socket:
        if self._sock is None:
            raise errors.AttndConnectionError(f"the client of attnd at {self.address} is closed")
        return self._sock

    def set_spin(self, us: int) -> None:
        """Busy-polls for each answer up to us microseconds (non-blocking reads)
        before blocking in the kernel: the wake-up of a sleeping reader is spared
        when the answer comes within that time, at the cost of one CPU core while
        waiting (attnctl bench --spin, attnd_client_set_spin; docs/operations.md,
        "Small steps: latency or throughput"). 0 (the default) never spins."""
        self._spin_ns = max(0, int(us)) * 1000

    def _recv_into(self, view: Any, n: int) -> int:
        """One read of up to n bytes (spinning first when set_spin asked)."""
        sock = self._conn()
        try:
            if self._spin_ns:
                end = time.perf_counter_ns() + self._spin_ns
                while True:
                    try:
                        k = sock.recv_into(view, n, socket.MSG_DONTWAIT)
                        break
                    except BlockingIOError:
                        if time.perf_counter_ns() >= end:
                            k = sock.recv_into(view, n)
                            break
            else:
                k = sock.recv_into(view, n)
        except OSError as e:
            raise _io_error("read from", self.address, e) from None
        if k == 0:
            raise errors.AttndConnectionError(f"attnd at {self.address} closed the connection")
        return k

    def _ahead(self, need: int) -> None:
        """At least need (<= _READ_AHEAD) bytes in the read-ahead buffer from
        _rpos: what is there moved to its start if the rest does not fit, then
        reads of whatever the daemon sent (one read for a small answer)."""
        if self._rpos + need > _READ_AHEAD:
            have = self._rlen - self._rpos
            self._rbuf[:have] = self._rbuf[self._rpos:self._rlen]
            self._rpos, self._rlen = 0, have
        mv = memoryview(self._rbuf)
        while self._rlen - self._rpos < need:
            self._rlen += self._recv_into(mv[self._rlen:], _READ_AHEAD - self._rlen)

    def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = min(n, self._rlen - self._rpos)
        if got:  # what was read ahead first
            view[:got] = memoryview(self._rbuf)[self._rpos:self._rpos + got]
            self._rpos += got
        while got < n:
            if n - got < _READ_AHEAD:  # small: whatever the daemon sent, into the read-ahead
                self._rpos = self._rlen = 0
                self._ahead(1)
                take = min(self._rlen, n - got)
                view[got:got + take] = memoryview(self._rbuf)[:take]
                got += take
                self._rpos = take
                continue
            got += self._recv_into(view[got:], n - got)
        return buf

    # -- raw requests --

    def send(self, req: "Request") -> int:
        """Sends a Request (its id is assigned when 0); returns the id."""
        with self._send_lock:
            if req.id == 0:
                req.id = self._next_id
                self._next_id += 1
            data = req.SerializeToString()
            if not 0 < len(data) <= _MAX_FRAME:
                raise errors.InvalidArgument(f"request of {len(data)} bytes does not fit a frame")
            try:
                self._conn().sendall(struct.pack(">I", len(data)) + data)
            except OSError as e:
                raise _io_error("write to", self.address, e) from None
            return int(req.id)

    def _send_built(self, build: Callable[[int], bytes]) -> int:
        """Sends the frame build(id) makes for the next request id; returns the id."""
        with self._send_lock:
            rid = self._next_id
            self._next_id += 1
            frame = build(rid)
            if not 4 < len(frame) <= _MAX_FRAME + 4:
                raise errors.InvalidArgument(f"request of {len(frame) - 4} bytes does not fit a frame")
            try:
                self._conn().sendall(frame)
            except OSError as e:
                raise _io_error("write to", self.address, e) from None
            return rid

    def _read_response(self) -> Tuple["Response", Any]:
        """The next Response, and (frame, spans) when a step's large out/lse data
        were cut out of it (_frames.cut_step), else None."""
        self._ahead(4)
        p = self._rpos
        n = int.from_bytes(self._rbuf[p:p + 4], "big")
        if n == 0 or n > _MAX_FRAME:
            raise errors.AttndConnectionError(f"bad frame length {n} from attnd")
        resp = pb.Response()
        if n < _frames.CUT_MIN:
            # A small answer (a decode step's): parsed from the read-ahead
            # buffer with one copy, no frame buffer of its own.
            self._rpos = p + 4
            self._ahead(n)
            p = self._rpos
            resp.ParseFromString(bytes(self._rbuf[p:p + n]))
            self._rpos = p + n
            return resp, None
        self._rpos = p + 4
        buf = self._recv_exact(n)
        if n >= _frames.CUT_MIN:
            try:
                rest, spans = _frames.cut_step(buf)
            except (ValueError, IndexError):
                rest, spans = b"", {}  # protobuf says what is wrong with it
            if spans:
                resp.ParseFromString(rest)
                return resp, (buf, spans)
        resp.ParseFromString(bytes(buf))
        return resp, None

    def _await(self, id: Optional[int], got: Optional[Tuple["Response", Any]] = None) -> Tuple["Response", Any]:
        """(Response, cut) of id (None: the next one), the answers of other ids
        kept; got: an answer already read (_recv_step_fast's). _recv_lock held."""
        if got is None:
            if id is None and self._pending:
                return self._pending.pop(next(iter(self._pending)))
            if id is not None and id in self._pending:
                return self._pending.pop(id)
            got = self._read_response()
        while True:
            # id 0 is about the connection itself: whoever waits must see it.
            if id is None or got[0].id == id or got[0].id == 0:
                return got
            self._pending[got[0].id] = got
            got = self._read_response()

    def _recv_cut(self, id: Optional[int], check: bool) -> Tuple["Response", Any]:
        with self._recv_lock:
            resp, cut = self._await(id)
        if check:
            self._check(resp)
        return resp, cut

    def recv(self, id: Optional[int] = None, check: bool = True) -> "Response":
        """Receives the Response with this id (None: the next one, any id).

        Responses for other ids are kept until asked for. With check, a non-OK
        status raises its typed exception and an epoch change is reported.
        """
        resp, cut = self._recv_cut(id, check)
        if cut is not None:
            _frames.put_back(resp, *cut)
        return resp

    def _check(self, resp: "Response") -> None:
        if resp.epoch:
            self._epoch_seen(resp.epoch, resp.id)
        if resp.HasField("status") and resp.status.code != 0:
            raise errors.error_for(resp.status.code, resp.status.message, resp.id, resp.epoch)

    def _epoch_seen(self, epoch: int, rid: int) -> None:
        """An answer's (nonzero) epoch: a change reported as on_epoch_change says."""
        if self.epoch and epoch != self.epoch:
            old = self.epoch
            self.epoch = epoch
            self.epoch_changed = True
            self._session_epoch.clear()
            if callable(self.on_epoch_change):
                self.on_epoch_change(old, epoch)
            elif self.on_epoch_change == "raise":
                raise errors.EpochChanged(old, epoch, rid)
        self.epoch = epoch

    def call(self, req: "Request") -> "Response":
        """Sends a Request and waits for its Response (raises on a non-OK status)."""
        return self.recv(self.send(req))

    def _simple(self, field: str, **kw: Any) -> Any:
        req = pb.Request()
        getattr(req, field).SetInParent()
        for k, v in kw.items():
            setattr(getattr(req, field), k, v)
        return getattr(self.call(req), field)

    # -- calls --

    def hello(self, token: str) -> Any:
        return self._simple("hello", token=token)

    def health(self) -> "HealthResponse":
        h = self._simple("health")
        self._model = h.model
        return h  # type: ignore[no-any-return]

    def stats(self) -> "StatsResponse":
        return self._simple("stats")  # type: ignore[no-any-return]

    def list_sessions(self) -> List[SessionInfo]:
        """This identity's sessions."""
        return [SessionInfo(SessionId(s.session), s.len, s.blocks, s.idle_s, s.base)
                for s in self._simple("list_sessions").sessions]

    @property
    def model(self) -> "ModelShape":
        """The daemon's ModelShape (fetched with Health on first use)."""
        if self._model is None:
            self.health()
        assert self._model is not None
        return self._model

    def open_session(self, tokens: Optional[Iterable[int]] = None,
                     salt: bytes = b"") -> Tuple[SessionId, int]:
        """Opens a session; returns (session id, cached_len)."""
        req = pb.Request()
        req.open_session.SetInParent()
        if tokens is not None:
            req.open_session.tokens.extend(int(t) for t in tokens)
        req.open_session.salt = bytes(salt)
        r = self.call(req).open_session
        self._session_epoch[r.session] = self.epoch
        return SessionId(r.session), int(r.cached_len)

    def session(self, tokens: Optional[Iterable[int]] = None, salt: bytes = b"") -> Session:
        """Opens a session and returns it as a Session (a context manager)."""
        sid, cached = self.open_session(tokens, salt)
        return Session(self, sid, cached)

    def session_epoch(self, session: int) -> Optional[int]:
        """The epoch a session was opened under (None when the daemon restarted since)."""
        return self._session_epoch.get(session)

    def close_session(self, session: int) -> None:
        self._session_epoch.pop(session, None)
        self._simple("close_session", session=int(session))

    def fork(self, session: int) -> SessionId:
        """Forks a session (shares all its blocks); returns the new session id."""
        r = self._simple("fork", session=int(session))
        self._session_epoch[r.session] = self.epoch
        return SessionId(r.session)

    def truncate(self, session: int, length: int) -> None:
        self._simple("truncate", session=int(session), len=int(length))

    def plan(self, items: Iterable[Item]) -> int:
        """Admits the items of one step for all layers; returns the plan id."""
        req = pb.Request()
        req.plan.SetInParent()
        for it in items:
            it.to_pb(req.plan.items.add())
        return int(self.call(req).plan.plan)

    def set_scales(self, layer: int, k_scale: npt.ArrayLike, v_scale: npt.ArrayLike,
                   k_zero: Optional[npt.ArrayLike] = None, v_zero: Optional[npt.ArrayLike] = None,
                   drop_cached_kv: bool = False) -> int:
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
        return int(self.call(req).set_scales.version)

    def set_sinks(self, layer: int, sinks: npt.ArrayLike) -> int:
        """Sets a layer's attention sink logits (fp32 [q_heads], finite; the units of the
        scaled, capped scores: docs/numerics.md); returns the version."""
        req = pb.Request()
        s = req.set_sinks
        s.layer = int(layer)
        a = np.ascontiguousarray(sinks, dtype="<f4")
        _fill_tensor(s.sinks, DTYPE_FP32, a.shape, a.tobytes())
        return int(self.call(req).set_sinks.version)

    # -- same-host zero-copy (docs/protocol.md) --

    @property
    def local(self) -> bool:
        """Whether the daemon is on this host: a Unix socket, or TCP to loopback."""
        a = self.address
        if isinstance(a, str) and "/" in a:
            return True
        host = a[0] if isinstance(a, tuple) else a.rsplit(":", 1)[0].strip("[]")
        return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")

    def register_buffer(self, handle: bytes, size: int, device_uuid: str) -> int:
        """Registers device memory shared with cudaIpcGetMemHandle (its 64 handle bytes,
        the allocation's size, its device's UUID); returns the buffer id for TensorRef."""
        req = pb.Request()
        r = req.register_buffer
        r.cuda_ipc_handle = bytes(handle)
        r.size = int(size)
        r.device_uuid = device_uuid
        return int(self.call(req).register_buffer.buffer)

    def release_buffer(self, buffer: int) -> None:
        self._simple("release_buffer", buffer=int(buffer))

    # -- steps --

    def _wire(self, arr: npt.ArrayLike, what: str) -> Tuple[int, Tuple[int, ...], Any]:
        """numpy or torch -> (dtype enum, shape, bytes) in the daemon's activation dtype."""
        if _is_torch(arr):
            return _torch_wire(arr, what, self.model.dtype)
        a = np.asarray(arr)
        if a.ndim != 3:
            raise ValueError(f"{what} must be [rows, heads, head_dim], got shape {a.shape}")
        # The arrays themselves (C order, no copy when they already are) go to
        # the socket: _frames.step_frame takes any buffer.
        if BFLOAT16 is not None and a.dtype == BFLOAT16:
            return DTYPE_BF16, a.shape, np.ascontiguousarray(a).view("<u2")
        if a.dtype == np.uint16:  # bf16 bits
            return DTYPE_BF16, a.shape, np.ascontiguousarray(a, dtype="<u2")
        if a.dtype == np.float16:
            return DTYPE_FP16, a.shape, np.ascontiguousarray(a, dtype="<f2")
        if a.dtype.kind == "f":
            if self.model.dtype == "fp16":
                return DTYPE_FP16, a.shape, np.ascontiguousarray(a, dtype="<f2")
            return DTYPE_BF16, a.shape, np.ascontiguousarray(f32_to_bf16(a), dtype="<u2")
        raise ValueError(f"{what} has unsupported dtype {a.dtype}")

    def step_send(self, layer: int, q: Optional[npt.ArrayLike] = None,
                  k: Optional[npt.ArrayLike] = None, v: Optional[npt.ArrayLike] = None,
                  items: Optional[Sequence[Item]] = None, plan: int = 0, want_lse: bool = False,
                  fp32_out: bool = False, out: Any = None, lse: Any = None,
                  done: Any = None) -> int:
        """Sends one Step (a plan id, or inline items); returns its request id.

        q: [Tq, q_heads, head_dim], k and v: [T, kv_heads, head_dim], packed in item
        order; float arrays are rounded to the daemon's activation dtype, uint16 is
        taken as bf16 bits, float16 as fp16. torch tensors (any device) are sent as
        they are when bf16/fp16, float32 rounded by torch; no numpy round trip. torch
        CUDA tensors go by reference when the ipc mode allows (attnd.ipc); the daemon
        then writes out and lse into the tensors given (else new ones): step_recv's.
        done: an attnd.ipc.DoneSignal the daemon raises on the device once out and lse
        are written (the step must go by reference), for done.wait().
        """
        if self._fast_steps and not items and done is None and _frames._FAST:
            fast = self._fast_tensors(q, k, v)
            if fast is not None:
                return self._fast_send(layer, plan, want_lse, fp32_out, fast[0], fast[1])
        rid = _ipc.try_step_send(self, layer, q, k, v, items, plan, want_lse, fp32_out, out, lse,
                                 done=done)
        if rid is not None:
            return rid
        return self._bytes_send(layer, q, k, v, items, plan, want_lse, fp32_out)

    def _fast_tensors(self, q: Any, k: Any, v: Any) -> Optional[Tuple[Tuple[Tuple[str, int, Tuple[int, ...], int], ...],
                                                                      List[Any], bool]]:
        """A step's q, k and v for the fast path (a Step of a plan whose tensors
        are numpy arrays, torch CPU tensors or anything else _wire takes):
        (signature for _frames.step_frame_sig, buffers, whether any is torch), or
        None (a torch tensor off the CPU: the general path, which may go by reference).
        The bytes _wire sends (the same conversions and errors, in the same
        order); contiguous bf16 and fp16 go as they lie, checked in a few
        attribute reads."""
        sig: List[Tuple[str, int, Tuple[int, ...], int]] = []
        bufs: List[Any] = []
        torch_in = False
        for name, a in (("q", q), ("k", k), ("v", v)):
            if a is None:
                continue
            if type(a) is np.ndarray:
                dt = _FAST_NP.get(a.dtype)
                if dt is not None and a.ndim == 3 and a.flags.c_contiguous:
                    if a.dtype is not _U2 and dt == DTYPE_BF16:
                        a = a.view(_U2)  # ml_dtypes bfloat16: its bits
                    sig.append((name, dt, a.shape, a.nbytes))
                    bufs.append(a)
                    continue
            elif _is_torch(a):
                if a.device.type != "cpu":
                    return None
                torch_in = True
                dt = _torch_dtypes().get(a.dtype)
                if dt is not None and a.dim() == 3 and a.is_contiguous():
                    b = a.detach().view(_torch_dtypes()["int16"]).numpy()
                    sig.append((name, dt, b.shape, b.nbytes))
                    bufs.append(b)
                    continue
            dt, shape, b = self._wire(a, name)
            b = _frames._bytes_view(b)
            sig.append((name, dt, tuple(shape), b.nbytes))
            bufs.append(b)
        return tuple(sig), bufs, torch_in

    def _fast_frame(self, rid: int, layer: int, plan: int, q: Any, k: Any, v: Any, want_lse: bool,
                    fp32_out: bool) -> Tuple[List[Any], int]:
        """The fast path's frame of a Step of a plan (pieces, bytes), for numpy or
        torch CPU q, k, v (bench/bench_client.py times it alone)."""
        fast = self._fast_tensors(q, k, v)
        assert fast is not None
        return _frames.step_frame_sig(rid, int(layer), int(plan), bool(want_lse), bool(fp32_out),
                                      fast[0], fast[1])

    def _fast_send(self, layer: int, plan: int, want_lse: bool, fp32_out: bool,
                   sig: Tuple[Tuple[str, int, Tuple[int, ...], int], ...], bufs: List[Any]) -> int:
        """Sends a Step of a plan framed by _frames.step_frame_sig; returns its id."""
        with self._send_lock:
            rid = self._next_id
            self._next_id += 1
            pieces, n = _frames.step_frame_sig(rid, int(layer), int(plan), bool(want_lse), bool(fp32_out),
                                               sig, bufs)
            if not 0 < n - 4 <= _MAX_FRAME:
                raise errors.InvalidArgument(f"request of {n - 4} bytes does not fit a frame")
            try:
                _frames.sendmsg_all(self._conn(), pieces, n)
            except OSError as e:
                raise _io_error("write to", self.address, e) from None
            return rid

    def _recv_step_fast(self, id: int, torch_device: Any, torch_out: bool) -> StepResult:
        """step_recv of a Step answered in one small frame: an OK answer of this id
        is read from the read-ahead buffer and parsed by hand
        (_frames.parse_step_ok), its out and lse copied out of the buffer once
        (as protobuf's parse would); anything else (answers kept for later, a
        large frame, another id, a status, fields the hand parse does not know)
        goes the general way (_await, _check), with the same bookkeeping."""
        res = None
        with self._recv_lock:
            got = None
            if not self._pending:
                self._ahead(4)
                p = self._rpos
                n = int.from_bytes(self._rbuf[p:p + 4], "big")
                if 0 < n < _frames.CUT_MIN:
                    self._rpos = p + 4
                    self._ahead(n)
                    p = self._rpos
                    ok = _frames.parse_step_ok(self._rbuf, p, p + n)
                    if ok is not None and ok[0] == id and id:
                        res = self._ok_result(ok, torch_device, torch_out)
                    else:
                        resp = pb.Response()
                        resp.ParseFromString(bytes(self._rbuf[p:p + n]))
                        got = (resp, None)
                    self._rpos = p + n
            if res is None:
                resp, cut = self._await(id, got)
        if res is not None:
            if ok[1]:
                self._epoch_seen(ok[1], id)
            return res
        self._check(resp)
        return self._step_result(resp, cut, torch_device, torch_out)

    def _ok_result(self, ok: Any, torch_device: Any, torch_out: bool) -> StepResult:
        """The StepResult of _frames.parse_step_ok's answer in the read-ahead buffer:
        what _step_result makes of protobuf's parse of it (the tensors' bytes
        copied once, arrays of them read-only as protobuf's bytes make them)."""
        rid, _, tspan, out, lse = ok
        mv = memoryview(self._rbuf)
        timing = pb.Timing.FromString(bytes(mv[tspan[0]:tspan[1]])) if tspan else pb.Timing()
        if torch_out:
            return StepResult(out=out and _tensor_to_torch(_Wire(out[0], out[1], bytes(mv[out[2]:out[3]])),
                                                           torch_device),
                              lse=lse and _tensor_to_torch(_Wire(lse[0], lse[1], bytes(mv[lse[2]:lse[3]])),
                                                           torch_device),
                              timing=timing, id=rid)
        if out is not None:
            # Read-only over bytes, as np.frombuffer of protobuf's data makes it.
            a = np.ndarray(out[1], _NP_DT[out[0]], bytes(mv[out[2]:out[3]]))
            if out[0] == DTYPE_BF16 and self.bf16 != "uint16":
                if self.bf16 == "float32":
                    a = bf16_to_f32(a)
                elif self.bf16 == "auto" and BFLOAT16 is not None:
                    a = a.view(BFLOAT16)
            out = a
        if lse is not None:
            a = np.ndarray(lse[1], _NP_DT[lse[0]], bytes(mv[lse[2]:lse[3]]))
            lse = a.view(BFLOAT16) if lse[0] == DTYPE_BF16 and BFLOAT16 is not None else a
        return StepResult(out=out, lse=lse, timing=timing, id=rid)

    def _bytes_send(self, layer: int, q: Any, k: Any, v: Any, items: Optional[Sequence[Item]],
                    plan: int, want_lse: bool, fp32_out: bool) -> int:
        if not items and _frames._FAST:
            # A step of a plan: framed without a protobuf message (_frames.step_frame_plan).
            tensors = []
            for name, arr in (("q", q), ("k", k), ("v", v)):
                if arr is not None:
                    dt, shape, data = self._wire(arr, name)
                    tensors.append((name, dt, shape, data))
            with self._send_lock:
                rid = self._next_id
                self._next_id += 1
                pieces, n = _frames.step_frame_plan(rid, int(layer), int(plan), bool(want_lse),
                                                    bool(fp32_out), tensors)
                if not 0 < n - 4 <= _MAX_FRAME:
                    raise errors.InvalidArgument(f"request of {n - 4} bytes does not fit a frame")
                try:
                    _frames.sendmsg_all(self._conn(), pieces, n)
                except OSError as e:
                    raise _io_error("write to", self.address, e) from None
                return rid
        req = pb.Request()
        st = req.step
        st.layer = int(layer)
        st.plan = int(plan)
        if items:
            for it in items:
                it.to_pb(st.items.add())
        tensors = []
        for name, arr in (("q", q), ("k", k), ("v", v)):
            if arr is not None:
                dt, shape, data = self._wire(arr, name)
                tensors.append((name, dt, shape, data))
        st.want_lse = bool(want_lse)
        st.fp32_out = bool(fp32_out)
        return self._send_step(req, tensors)

    def _send_step(self, req: "Request", tensors: List[Tuple[str, int, Tuple[int, ...], Any]]) -> int:
        """send() for a Step whose tensors are framed by hand (_frames.step_frame):
        their bytes go to the socket from where they lie."""
        with self._send_lock:
            if req.id == 0:
                req.id = self._next_id
                self._next_id += 1
            pieces = _frames.step_frame(req, tensors)
            n = sum(memoryview(p).nbytes for p in pieces) - 4
            if not 0 < n <= _MAX_FRAME:
                raise errors.InvalidArgument(f"request of {n} bytes does not fit a frame")
            try:
                _frames.sendmsg_all(self._conn(), pieces, n + 4)
            except OSError as e:
                raise _io_error("write to", self.address, e) from None
            return int(req.id)

    def step_recv(self, id: int, torch_device: Any = None, as_torch: bool = False) -> StepResult:
        """Receives a Step's answer by request id. as_torch (or a torch_device):
        out and lse as torch tensors (bf16 stays bf16), on torch_device if given. A step
        sent by reference: the tensors the daemon wrote."""
        if id in self._ipc_out:
            try:
                resp = self.recv(id)
            except errors.AttndError:
                self.ipc.answered(id, False)  # a done signal the daemon will not raise
                raise
            self.ipc.answered(id, True)
            out, lse = self._ipc_out.pop(id)
            return StepResult(out=out, lse=lse, timing=resp.timing, id=resp.id)
        torch_out = as_torch or torch_device is not None
        if self._fast_steps and _frames._PARSE_OK:
            return self._recv_step_fast(id, torch_device, torch_out)
        resp, cut = self._recv_cut(id, True)
        return self._step_result(resp, cut, torch_device, torch_out)

    def _step_result(self, resp: "Response", cut: Any, torch_device: Any, torch_out: bool) -> StepResult:
        """A checked Step answer as its StepResult (numpy, or torch when torch_out)."""
        sr = resp.step
        frame, spans = cut if cut is not None else (None, {})
        res = {}
        for name in ("out", "lse"):
            if not sr.HasField(name):
                res[name] = None
            elif torch_out:
                res[name] = _tensor_to_torch(getattr(sr, name), torch_device, frame, spans.get(name))
            else:
                res[name] = _tensor_to_numpy(getattr(sr, name), self.bf16 if name == "out" else "auto",
                                             frame, spans.get(name))
        return StepResult(out=res["out"], lse=res["lse"], timing=resp.timing, id=resp.id)

    def step(self, layer: int, q: Optional[npt.ArrayLike] = None,
             k: Optional[npt.ArrayLike] = None, v: Optional[npt.ArrayLike] = None,
             items: Optional[Sequence[Item]] = None, plan: int = 0, want_lse: bool = False,
             fp32_out: bool = False, out: Any = None, lse: Any = None) -> StepResult:
        """One blocking Step; see step_send(). torch tensors in: torch tensors out,
        on the device of the first of q, k, v given (bf16 stays bf16)."""
        if self._fast_steps and not items and _frames._FAST:
            fast = self._fast_tensors(q, k, v)
            if fast is not None:
                rid = self._fast_send(layer, plan, want_lse, fp32_out, fast[0], fast[1])
                return self.step_recv(rid, as_torch=fast[2])
        t = next((x for x in (q, k, v) if x is not None and _is_torch(x)), None)
        rid = _ipc.try_step_send(self, layer, q, k, v, items, plan, want_lse, fp32_out, out, lse)
        if rid is not None:
            try:
                return self.step_recv(rid)
            finally:
                self._ipc_out.pop(rid, None)
        rid = self._bytes_send(layer, q, k, v, items, plan, want_lse, fp32_out)
        return self.step_recv(rid, torch_device=t.device if t is not None else None)
