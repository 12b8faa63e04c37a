"""Same-host zero-copy (docs/protocol.md, "Same-host zero-copy"): torch CUDA tensors
named in steps instead of sent as bytes.

A client on the daemon's host shares the device allocations its tensors live in
with the daemon once (RegisterBuffer: a CUDA IPC memory handle, the allocation's
size, its device's UUID) and then names (buffer, offset) for q, k, v and for
where out and lse go. The daemon reads and writes those tensors in place; the
response carries no tensor bytes.

The handle, the allocation's base and its size come from the CUDA driver through
ctypes (cuMemGetAddressRange, cuIpcGetMemHandle on libcuda.so.1, which every
CUDA install has): no dependency beyond torch itself, which stays optional.

Rules the client keeps (the daemon relies on them):
- q, k and v are complete when the step is sent: the stream that wrote them is
  synchronized first (done here);
- nothing touches the step's tensors (inputs and outputs) until its response has
  arrived: the daemon answers once its kernels are done, so from then on out and
  lse hold the result and every stream may use them.
"""

import ctypes
import threading
from typing import Any, Dict, Optional, Tuple

from . import _frames
from . import errors

_HANDLE_BYTES = 64


class IpcUnavailable(Exception):
    """This process cannot share a tensor's memory (no CUDA driver library, memory
    that CUDA IPC cannot export, ...): the client sends bytes instead."""


class _Driver:
    """The few CUDA driver calls zero-copy needs, through ctypes (torch has made
    the device's primary context current on the calling thread)."""

    _lock = threading.Lock()
    _lib: Any = None

    @classmethod
    def lib(cls) -> Any:
        with cls._lock:
            if cls._lib is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as e:
                    raise IpcUnavailable(f"no CUDA driver library: {e}") from None
                u64, vp = ctypes.c_uint64, ctypes.c_void_p
                lib.cuMemGetAddressRange_v2.argtypes = [vp, vp, u64]
                lib.cuIpcGetMemHandle.argtypes = [vp, u64]
                lib.cuDeviceGet.argtypes = [vp, ctypes.c_int]
                lib.cuDeviceGetUuid_v2.argtypes = [vp, ctypes.c_int]
                for f in ("cuMemGetAddressRange_v2", "cuIpcGetMemHandle", "cuDeviceGet",
                          "cuDeviceGetUuid_v2"):
                    getattr(lib, f).restype = ctypes.c_int
                # The done signal (DoneSignal): stream memory operations.
                for f, args in (("cuStreamWaitValue64", [vp, u64, u64, ctypes.c_uint]),
                                ("cuStreamWriteValue64", [vp, u64, u64, ctypes.c_uint]),
                                ("cuStreamCreate", [vp, ctypes.c_uint]),
                                ("cuStreamSynchronize", [vp]),
                                ("cuMemcpyDtoHAsync", [vp, u64, ctypes.c_size_t, vp])):
                    for name in (f + "_v2", f):
                        fn = getattr(lib, name, None)
                        if fn is not None:
                            fn.argtypes = args
                            fn.restype = ctypes.c_int
                            setattr(lib, "_" + f, fn)
                            break
                cls._lib = lib
            return cls._lib

    @classmethod
    def allocation(cls, ptr: int) -> Tuple[int, int, bytes]:
        """(base, size, handle) of the device allocation holding address ptr."""
        lib = cls.lib()
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        if rc != 0:
            raise IpcUnavailable(f"cuMemGetAddressRange failed (CUresult {rc})")
        h = ctypes.create_string_buffer(_HANDLE_BYTES)
        rc = lib.cuIpcGetMemHandle(ctypes.byref(h), base.value)
        if rc != 0:  # e.g. memory from cuMemCreate (expandable segments): not shareable this way
            raise IpcUnavailable(f"cuIpcGetMemHandle failed (CUresult {rc})")
        return int(base.value), int(size.value), h.raw

    @classmethod
    def uuid(cls, ordinal: int) -> str:
        """The device's UUID as the daemon writes it (cudaDeviceProp.uuid's bytes)."""
        lib = cls.lib()
        dev = ctypes.c_int(0)
        u = ctypes.create_string_buffer(16)
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0 or \
                lib.cuDeviceGetUuid_v2(ctypes.byref(u), dev.value) != 0:
            raise IpcUnavailable(f"cannot read the UUID of CUDA device {ordinal}")
        h = u.raw.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_CU_STREAM_NON_BLOCKING = 1
_CU_STREAM_WAIT_VALUE_GEQ = 0


def _driver_call(name: str, *args: Any) -> None:
    fn = getattr(_Driver.lib(), "_" + name, None)
    if fn is None:
        raise IpcUnavailable(f"the CUDA driver has no {name}")
    rc = fn(*args)
    if rc != 0:
        raise IpcUnavailable(f"{name} failed (CUresult {rc})")


class DoneSignal:
    """A 64-bit word in this process's device memory that steps by reference raise
    on the device once their outputs are written (docs/protocol.md, the done
    signal), so that a torch stream can wait for a step's outputs without waiting
    for its response: step_send(..., done=sig), then sig.wait() makes the current
    stream wait on the device, and work enqueued behind it reads out and lse.

    Give every step in flight its own signal (one per layer of a decode loop
    does): each step arms the next value of its signal, and a signal is armed
    again only after the step before has been answered. The response still
    comes and still says whether the step succeeded: a failed step's signal is
    raised by the client when its answer arrives (step_recv), so a waiting stream
    goes on, over outputs that are not the step's result."""

    def __init__(self, client: Any, device: Any = None) -> None:
        import torch

        self.client = client
        self.tensor = torch.zeros(1, dtype=torch.int64, device=device or "cuda")
        self.buffer, self.offset = client.ipc.locate(self.tensor)
        self.value = 0  # the last value armed
        self._stream = None  # a non-blocking driver stream of our own (release, read)

    def arm(self) -> int:
        self.value += 1
        return self.value

    def fill(self, m: Any, value: int) -> None:
        m.buffer, m.offset, m.value = self.buffer, self.offset, int(value)

    def wait(self, stream: Any = None, value: Optional[int] = None) -> None:
        """The torch stream (default: the current one) waits on the device until the
        word reaches value (default: the last value armed)."""
        import torch

        st = stream if stream is not None else torch.cuda.current_stream(self.tensor.device)
        _driver_call("cuStreamWaitValue64", ctypes.c_void_p(st.cuda_stream), self.tensor.data_ptr(),
                     self.value if value is None else int(value), _CU_STREAM_WAIT_VALUE_GEQ)

    def _own_stream(self) -> Any:
        if self._stream is None:
            s = ctypes.c_void_p(0)
            _driver_call("cuStreamCreate", ctypes.byref(s), _CU_STREAM_NON_BLOCKING)
            self._stream = s
        return self._stream

    def release(self, value: int) -> None:
        """Sets the word to value from a stream of its own (one that no waiting
        stream blocks), for a step the daemon answered with an error."""
        st = self._own_stream()
        _driver_call("cuStreamWriteValue64", st, self.tensor.data_ptr(), int(value), 0)
        _driver_call("cuStreamSynchronize", st)

    def reached(self) -> int:
        """The word's value now (read on a stream of its own)."""
        st = self._own_stream()
        v = ctypes.c_uint64(0)
        _driver_call("cuMemcpyDtoHAsync", ctypes.byref(v), self.tensor.data_ptr(), 8, st)
        _driver_call("cuStreamSynchronize", st)
        return int(v.value)


def device_uuid(device: Any) -> str:
    """The UUID of a torch CUDA device, in the daemon's form ("GPU-...")."""
    import torch

    dev = torch.device(device)
    return _Driver.uuid(dev.index if dev.index is not None else torch.cuda.current_device())


def _same_device(a: str, b: str) -> bool:
    def bare(s: str) -> str:
        s = s.lower()
        return s[4:] if s.startswith("gpu-") else s

    return bool(a) and bare(a) == bare(b)


class IpcState:
    """One connection's registered allocations and whether zero-copy is in use.

    mode: "auto" (use it when the daemon is on this host, the tensors are on its
    device and q, k and v come to at least AUTO_MIN_BYTES; fall back to bytes for good
    once the daemon refuses a registration with FAILED_PRECONDITION), True (every
    such step, and a refusal raises), False (never).
    """

    # Below this "auto" sends bytes, large steps (prefills) go by reference. Set
    # when the daemon's device check of refs was a thread hop and a blocking sync
    # (an H200, 8B shape: a 1-session decode layer step took 376 us by reference
    # and 152 us as bytes; 16 sessions, 131 KB of q, were even); the check is now a
    # device job completed like a step: lower it once bench_e2e's ipc rows say so.
    AUTO_MIN_BYTES = 1 << 20

    def __init__(self, client: Any, mode: Any) -> None:
        self.client = client
        self.mode = mode
        self.off = mode is False
        self._uuid: Optional[str] = None  # the daemon's device
        self._bufs: Dict[bytes, Tuple[int, int]] = {}  # handle -> (buffer id, size)
        # data_ptr -> (tensor, buffer id, allocation base, bytes) of tensors kept
        # (keep()): refs of them, or of views starting where they start, need no
        # driver call. Holding the tensor keeps its memory, so the mapping holds.
        self._kept: Dict[int, Tuple[Any, int, int, int]] = {}
        self._uuids: Dict[Any, str] = {}  # torch device -> its UUID
        self._same: Dict[Any, bool] = {}  # torch device -> it is the daemon's
        # (data_ptr, dtype, shape, strides) of a kept tensor -> its TensorRef,
        # serialized (ref_bytes): a decode loop names the same few tensors every step.
        self._ref_bytes: Dict[Tuple[Any, ...], bytes] = {}
        self._lock = threading.Lock()
        # request id -> (DoneSignal, value) of steps sent with one, until answered
        self._done: Dict[int, Tuple["DoneSignal", int]] = {}

    def answered(self, rid: int, ok: bool) -> None:
        """A step by reference was answered: a done signal it carried that the
        daemon will not raise (the step failed) is raised here instead, so that a
        stream waiting for it goes on (its out and lse are not the step's result)."""
        with self._lock:
            d = self._done.pop(rid, None)
        if d is not None and not ok:
            d[0].release(d[1])

    def _daemon_uuid(self) -> str:
        if self._uuid is None:
            self._uuid = self.client.health().device_uuid
        return self._uuid

    def usable(self, *tensors: Any, small: bool = False) -> bool:
        """Whether a step over these torch tensors goes by reference (small: also
        below "auto"'s size threshold)."""
        if self.off or not self.client.local:
            return False
        ts = [t for t in tensors if t is not None]
        # Contiguous, and at the 256-byte offsets refs need (an allocation's start
        # is aligned further, so the address tells); anything else goes as bytes.
        if not ts or not all(_is_cuda_tensor(t) and t.is_contiguous() and t.data_ptr() % 256 == 0
                             for t in ts):
            return False
        import torch

        act = torch.float16 if self.client.model.dtype == "fp16" else torch.bfloat16
        if any(t.dtype != act for t in ts):  # bytes: the client rounds them
            return False
        dev = ts[0].device
        if any(t.device != dev for t in ts):
            return False
        return self.would_use(dev, sum(t.numel() * t.element_size() for t in ts), small=small)

    def would_use(self, dev: Any, nbytes: int, small: bool = False) -> bool:
        """Whether a step of nbytes of q, k and v on torch device dev would go by
        reference (given tensors that allow it: see usable())."""
        if self.off or not self.client.local:
            return False
        if self.mode == "auto" and nbytes < self.AUTO_MIN_BYTES and not small:
            return False
        if self._same.get(dev):  # checked before: the daemon's device (its answer is kept)
            return True
        theirs = self._daemon_uuid()
        try:
            ours = self._uuids.get(dev) or self._uuids.setdefault(dev, device_uuid(dev))
        except IpcUnavailable:
            if self.mode is True:
                raise
            self.off = True
            return False
        if not theirs or not _same_device(ours, theirs):
            if self.mode is True:
                raise errors.FailedPrecondition(
                    f"zero-copy: the tensors are on {ours}, the daemon runs on "
                    f"{theirs or 'no CUDA device'}")
            return False
        self._same[dev] = True
        return True

    def ref(self, t: Any, out: Any) -> None:
        """Fills the TensorRef out for the contiguous torch CUDA tensor t (registering
        its allocation on first use)."""
        out.buffer, out.offset = self.locate(t)
        self._fill_meta(t, out)

    def locate(self, t: Any) -> Tuple[int, int]:
        """(buffer id, offset) of the contiguous torch CUDA tensor t, its allocation
        registered on first use."""
        if not t.is_contiguous():
            raise ValueError("zero-copy needs contiguous tensors")
        ptr = t.data_ptr()
        nbytes = t.numel() * t.element_size()
        kept = self._kept.get(ptr)
        if kept is not None and nbytes <= kept[3]:
            return kept[1], ptr - kept[2]
        base, size, handle = _Driver.allocation(ptr)
        if ptr - base + nbytes > size:
            raise ValueError("tensor extends past its allocation")
        with self._lock:
            have = self._bufs.get(handle)
        if have is None or have[1] != size:
            buf = self.client.register_buffer(handle, size, device_uuid(t.device))
            with self._lock:
                self._bufs[handle] = (buf, size)
            have = (buf, size)
        return have[0], ptr - base

    def ref_bytes(self, t: Any) -> bytes:
        """ref() as a serialized TensorRef, made once per kept tensor (the same
        address, dtype, shape and strides: the same allocation and offset while
        it is kept; unkeep and release_all forget them)."""
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        b = self._ref_bytes.get(key)
        if b is not None:
            return b
        m = _pb().TensorRef()
        self.ref(t, m)
        b = m.SerializeToString()
        with self._lock:
            kept = self._kept.get(key[0])
            if kept is not None and len(self._ref_bytes) < 1024:
                self._ref_bytes[key] = b
        return b

    def keep(self, t: Any) -> None:
        """Registers the allocation of the contiguous torch CUDA tensor t now and
        remembers where t lies in it, for as long as this connection lives: later refs
        of t (or of a view starting at t's first element, e.g. t[:rows]) cost no
        driver call. For staging tensors that are reused step after step."""
        from . import client as _c

        m = _c.pb.TensorRef()
        self.ref(t, m)
        with self._lock:
            self._kept[t.data_ptr()] = (t, int(m.buffer), t.data_ptr() - int(m.offset),
                                        t.numel() * t.element_size())

    def unkeep(self, t: Any) -> None:
        """Forgets a tensor keep() remembered (its allocation stays registered)."""
        with self._lock:
            self._kept.pop(t.data_ptr(), None)
            self._ref_bytes.clear()

    _dts: Optional[Dict[Any, int]] = None  # torch dtype -> wire dtype, made once

    @classmethod
    def _fill_meta(cls, t: Any, out: Any) -> None:
        dts = cls._dts
        if dts is None:
            import torch

            dts = cls._dts = {torch.bfloat16: _pb().DTYPE_BF16, torch.float16: _pb().DTYPE_FP16,
                              torch.float32: _pb().DTYPE_FP32}
        if t.dtype not in dts:
            raise ValueError(f"zero-copy: unsupported dtype {t.dtype}")
        out.dtype = dts[t.dtype]
        del out.shape[:]
        out.shape.extend(int(s) for s in t.shape)

    def release_all(self) -> None:
        with self._lock:
            bufs = [b for b, _ in self._bufs.values()]
            self._bufs.clear()
            self._kept.clear()
            self._ref_bytes.clear()
        for b in bufs:
            try:
                self.client.release_buffer(b)
            except (errors.AttndError, OSError):
                pass


def _is_cuda_tensor(x: Any) -> bool:
    return (type(x).__module__.startswith("torch") and hasattr(x, "is_cuda") and bool(x.is_cuda))


def _pb() -> Any:
    from .client import pb

    return pb


def step_send(client: Any, layer: int, q: Any, k: Any, v: Any, items: Any, plan: int,
              want_lse: bool, fp32_out: bool, out: Any = None, lse: Any = None,
              done: Optional[DoneSignal] = None) -> Tuple[int, Any, Any]:
    """Sends one Step over torch CUDA tensors by reference; returns (request id, out,
    lse): the tensors the daemon writes (allocated here when not given). done: a
    DoneSignal the step arms and raises (then done.wait() orders a stream after it);
    answer the step with client.step_recv, which also releases a failed step's."""
    import torch

    st_ipc: IpcState = client.ipc
    m = client.model
    act = torch.float16 if m.dtype == "fp16" else torch.bfloat16
    dev = next(t for t in (q, k, v) if t is not None).device
    if q is not None and out is None:
        out = torch.empty((q.shape[0], m.q_heads, m.head_dim),
                          dtype=torch.float32 if fp32_out else act, device=dev)
    if q is not None and want_lse and lse is None:
        lse = torch.empty((q.shape[0], m.q_heads), dtype=torch.float32, device=dev)
    if not items and _frames._FAST:
        # A plan's step: its frame written from the tensors' serialized refs,
        # no protobuf message (_frames.step_frame_refs).
        refs = []
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is not None:
                if t.dtype != act:
                    raise ValueError(f"zero-copy: {name} must be {act} (the daemon's activation dtype)")
                refs.append((name + "_ref", st_ipc.ref_bytes(t)))
        if out is not None:
            refs.append(("out_ref", st_ipc.ref_bytes(out)))
        if lse is not None:
            refs.append(("lse_ref", st_ipc.ref_bytes(lse)))
        value = done.arm() if done is not None else 0
        if done is not None:
            d = _pb().DoneSignal()
            done.fill(d, value)
            refs.append(("done", d.SerializeToString()))
        # The daemon reads q, k and v as soon as the step arrives: they must be written.
        torch.cuda.current_stream(dev).synchronize()
        rid = client._send_built(lambda i: _frames.step_frame_refs(i, int(layer), int(plan), bool(want_lse),
                                                                   bool(fp32_out), refs))
        if done is not None:
            with st_ipc._lock:
                st_ipc._done[rid] = (done, value)
        return rid, out, lse
    pb = _pb()
    req = pb.Request()
    st = req.step
    st.layer = int(layer)
    st.plan = int(plan)
    if items:
        for it in items:
            it.to_pb(st.items.add())
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None:
            if t.dtype != act:
                raise ValueError(f"zero-copy: {name} must be {act} (the daemon's activation dtype)")
            st_ipc.ref(t, getattr(st, name + "_ref"))
    if out is not None:
        st_ipc.ref(out, st.out_ref)
    if lse is not None:
        st_ipc.ref(lse, st.lse_ref)
    st.want_lse = bool(want_lse)
    st.fp32_out = bool(fp32_out)
    value = done.arm() if done is not None else 0
    if done is not None:
        done.fill(st.done, value)
    # The daemon reads q, k and v as soon as the step arrives: they must be written.
    torch.cuda.current_stream(dev).synchronize()
    rid = client.send(req)
    if done is not None:
        with st_ipc._lock:
            st_ipc._done[rid] = (done, value)
    return rid, out, lse


def try_step_send(client: Any, layer: int, q: Any, k: Any, v: Any, items: Any, plan: int,
                  want_lse: bool, fp32_out: bool, out: Any = None, lse: Any = None,
                  done: Optional[DoneSignal] = None) -> Optional[int]:
    """The Step by reference when its torch tensors and the client's ipc mode allow it
    (step_send), its out and lse kept for step_recv; its request id, or None: the
    caller sends bytes. A registration refused with FAILED_PRECONDITION (or a
    process that cannot share memory) turns "auto" off for good; with ipc=True it
    raises."""
    if not any(x is not None and _is_cuda_tensor(x) for x in (q, k, v)) or \
            not client.ipc.usable(q, k, v, small=done is not None):
        if done is not None:
            raise ValueError("a done signal needs a step by reference: torch CUDA tensors of "
                             "the activation dtype on the daemon's device, and ipc not off")
        return None
    try:
        rid, o, l = step_send(client, layer, q, k, v, items, plan, want_lse, fp32_out,
                              out=out, lse=lse, done=done)
    except (errors.FailedPrecondition, IpcUnavailable):
        if client.ipc.mode is True or done is not None:
            raise
        client.ipc.off = True  # refused at registration: bytes from now on
        return None
    client._ipc_out[rid] = (o, l)
    return rid
