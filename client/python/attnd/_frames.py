"""Step frames without copies of their tensors (used by client.Client).

A Step's q, k and v go to the socket from the caller's own buffers: the request
is serialized by protobuf without them, and their Tensor fields are framed here
by hand (a tag and a length each), so ``socket.sendmsg`` takes the tensor bytes
where they lie. A Step's answer is read into one buffer, its out and lse data
are cut out of the message before protobuf parses the rest (a few fields), and
the arrays returned are views of that buffer. Protobuf copied each tensor once
more per layer of its API (bytes into the message, the message into a string,
the string into the frame; and back), which cost more than the socket itself
for a 48 MiB prefill step. Only fields are walked here, never elements.
"""
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

try:
    from . import attnd_pb2 as pb
except ImportError:  # the generated module on PYTHONPATH instead (build tree)
    import attnd_pb2 as pb  # type: ignore[no-redef,import-not-found,unused-ignore]

_REQ_STEP = pb.Request.DESCRIPTOR.fields_by_name["step"].number
_RESP_STEP = pb.Response.DESCRIPTOR.fields_by_name["step"].number
_STEP_IN = {n: pb.StepRequest.DESCRIPTOR.fields_by_name[n].number for n in ("q", "k", "v")}
_STEP_OUT = {pb.StepResponse.DESCRIPTOR.fields_by_name[n].number: n for n in ("out", "lse")}
_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_ID = pb.Request.DESCRIPTOR.fields_by_name["id"].number
_DTYPE = pb.Tensor.DESCRIPTOR.fields_by_name["dtype"].number
_SHAPE = pb.Tensor.DESCRIPTOR.fields_by_name["shape"].number
# A Request is its id and the call (a oneof): its head is then framed here
# too, without a protobuf copy of the request (a decode step's few
# microseconds). Should the message grow other fields, protobuf frames them.
_REQ_ONLY_ID = [f.name for f in pb.Request.DESCRIPTOR.fields if f.containing_oneof is None] == ["id"]

# Tensors at least this large are cut out of an answer (smaller: protobuf's copy is cheap).
CUT_MIN = 1 << 16


def _bytes_view(buf: Any) -> memoryview:
    """A flat byte view of a C-contiguous buffer (an empty one for no elements)."""
    mv = memoryview(buf)
    return mv.cast("B") if mv.nbytes else memoryview(b"")


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld_head(field: int, n: int) -> bytes:
    """The tag and length of a length-delimited field of n bytes."""
    return _varint(field << 3 | 2) + _varint(n)


@functools.lru_cache(maxsize=256)
def _tensor_head(dtype: int, shape: Tuple[int, ...]) -> bytes:
    """A Tensor's dtype and shape fields (proto3: zero and empty left out;
    shape packed), as protobuf writes them."""
    out = _varint(_DTYPE << 3) + _varint(int(dtype)) if dtype else b""
    dims = b"".join(_varint(int(s)) for s in shape)
    return out + (_ld_head(_SHAPE, len(dims)) + dims if dims else b"")


@functools.lru_cache(maxsize=512)
def _tensor_field(name: str, dtype: int, shape: Tuple[int, ...], nbytes: int) -> bytes:
    """Everything of a q, k or v Tensor field but its data bytes: the field's tag
    and length, dtype, shape and the data field's tag and length. A decode loop
    sends the same few shapes step after step: built once each."""
    hdr = _tensor_head(dtype, shape)
    # An empty data field is left out, as protobuf itself would.
    dhead = _ld_head(_DATA, nbytes) if nbytes else b""
    return _ld_head(_STEP_IN[name], len(hdr) + len(dhead) + nbytes) + hdr + dhead


def _frame(first: bytes, step: bytes,
           tensors: Sequence[Tuple[str, int, Tuple[int, ...], Any]]) -> Tuple[List[Any], int]:
    """A Step request's frame as pieces for sendmsg and its length with the 4-byte
    prefix: first (the Request's fields before its step), step (the StepRequest's
    fields but q, k and v), then each tensor's field, its data where it lies."""
    pieces: List[Any] = [b""]
    body = 0
    for name, dtype, shape, buf in tensors:
        mv = _bytes_view(buf)
        thead = _tensor_field(name, int(dtype), tuple(shape), mv.nbytes)
        pieces += [thead, mv]
        body += len(thead) + mv.nbytes
    first += _ld_head(_REQ_STEP, len(step) + body) + step
    pieces[0] = (len(first) + body).to_bytes(4, "big") + first
    return pieces, 4 + len(first) + body


def step_frame(req: Any, tensors: Sequence[Tuple[str, int, Tuple[int, ...], Any]]) -> List[Any]:
    """The frame of a Step request as pieces for sendmsg: req (a pb.Request whose
    step holds no q, k or v) and tensors [(name, dtype, shape, buffer)], each buffer
    anything with the buffer protocol, sent as it is (its bytes, C order)."""
    step = req.step.SerializeToString()
    if _REQ_ONLY_ID:
        first = _varint(_ID << 3) + _varint(req.id) if req.id else b""
    else:
        h = pb.Request()
        h.CopyFrom(req)
        h.ClearField("step")
        first = h.SerializeToString()
    return _frame(first, step, tensors)[0]


_SF = {n: pb.StepRequest.DESCRIPTOR.fields_by_name[n].number
       for n in ("layer", "plan", "want_lse", "fp32_out")}
# The fast path below writes these as protobuf would; it is taken only while
# the message is as it writes it (the types and a Request of id and call alone).
_FAST = _REQ_ONLY_ID and [pb.StepRequest.DESCRIPTOR.fields_by_name[n].type for n in
                          ("layer", "plan", "want_lse", "fp32_out")] == [
    pb.StepRequest.DESCRIPTOR.fields_by_name["layer"].TYPE_UINT32,
    pb.StepRequest.DESCRIPTOR.fields_by_name["plan"].TYPE_FIXED64,
    pb.StepRequest.DESCRIPTOR.fields_by_name["want_lse"].TYPE_BOOL,
    pb.StepRequest.DESCRIPTOR.fields_by_name["fp32_out"].TYPE_BOOL]
_T_LAYER = _varint(_SF["layer"] << 3)
_T_PLAN = _varint(_SF["plan"] << 3 | 1)
_T_LSE = _varint(_SF["want_lse"] << 3) + b"\x01"
_T_FP32 = _varint(_SF["fp32_out"] << 3) + b"\x01"
_T_ID = _varint(_ID << 3)


def _step_scalars(layer: int, plan: int, want_lse: bool, fp32_out: bool) -> bytes:
    """A StepRequest's layer, plan, want_lse and fp32_out as protobuf writes them
    (proto3: zero and false left out)."""
    step = b""
    if layer:
        step += _T_LAYER + _varint(layer)
    if plan:
        step += _T_PLAN + plan.to_bytes(8, "little")
    if want_lse:
        step += _T_LSE
    if fp32_out:
        step += _T_FP32
    return step


def step_frame_plan(rid: int, layer: int, plan: int, want_lse: bool, fp32_out: bool,
                    tensors: Sequence[Tuple[str, int, Tuple[int, ...], Any]]) -> Tuple[List[Any], int]:
    """step_frame for a Step of a plan (no inline items) without a protobuf message:
    its few scalar fields written here (a decode step's layer loop sends thousands
    a second; building and serializing a Request cost ~10 us of Python each).
    Returns (pieces, frame bytes). Callers use it only while _FAST holds (else
    they build the message)."""
    return _frame(_T_ID + _varint(rid) if rid else b"", _step_scalars(layer, plan, want_lse, fp32_out),
                  tensors)


_REF = {n: pb.StepRequest.DESCRIPTOR.fields_by_name[n].number
        for n in ("q_ref", "k_ref", "v_ref", "out_ref", "lse_ref", "done")}


def step_frame_refs(rid: int, layer: int, plan: int, want_lse: bool, fp32_out: bool,
                    refs: Sequence[Tuple[str, bytes]]) -> bytes:
    """The whole frame of a Step of a plan by reference (docs/protocol.md §5a):
    refs [(field name, a serialized TensorRef, or "done" and a serialized
    DoneSignal last)], as protobuf would write the Request (the same _FAST condition as step_frame_plan)."""
    step = _step_scalars(layer, plan, want_lse, fp32_out)
    step += b"".join(_ld_head(_REF[name], len(b)) + b for name, b in refs)
    body = (_T_ID + _varint(rid) if rid else b"") + _ld_head(_REQ_STEP, len(step)) + step
    return len(body).to_bytes(4, "big") + body


def _fields(buf: Any, pos: int, end: int):
    """(field, wire type, value start, value end, field start) of buf[pos:end]."""
    while pos < end:
        start = pos
        key = shift = 0
        while True:
            b = buf[pos]
            pos += 1
            key |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        wt = key & 7
        if wt == 0:
            vs = pos
            while buf[pos] >= 0x80:
                pos += 1
            pos += 1
        elif wt == 1:
            vs, pos = pos, pos + 8
        elif wt == 5:
            vs, pos = pos, pos + 4
        elif wt == 2:
            n = shift = 0
            while True:
                b = buf[pos]
                pos += 1
                n |= (b & 0x7F) << shift
                shift += 7
                if b < 0x80:
                    break
            vs, pos = pos, pos + n
        else:
            raise ValueError(f"wire type {wt}")
        if pos > end:
            raise ValueError("field past the end of its message")
        yield key >> 3, wt, vs, pos, start


def cut_step(buf: bytearray) -> Tuple[bytes, Dict[str, Tuple[int, int]]]:
    """A Response frame body with the data of its step's out and lse (CUT_MIN bytes
    or more) cut out: (the rest, for ParseFromString; {"out"/"lse": (start, end)}
    of the data in buf). Nothing cut: (b"", {})."""
    spans: Dict[str, Tuple[int, int]] = {}
    mv = memoryview(buf)
    parts: List[bytes] = []
    for f, wt, vs, ve, fs in _fields(buf, 0, len(buf)):
        if f != _RESP_STEP or wt != 2:
            parts.append(bytes(mv[fs:ve]))
            continue
        sparts: List[bytes] = []
        for f2, wt2, vs2, ve2, fs2 in _fields(buf, vs, ve):
            name = _STEP_OUT.get(f2) if wt2 == 2 else None
            if name is None or ve2 - vs2 < CUT_MIN:
                sparts.append(bytes(mv[fs2:ve2]))
                continue
            tparts: List[bytes] = []
            for f3, wt3, vs3, ve3, fs3 in _fields(buf, vs2, ve2):
                if f3 == _DATA and wt3 == 2:
                    spans[name] = (vs3, ve3)
                else:
                    tparts.append(bytes(mv[fs3:ve3]))
            t = b"".join(tparts)
            sparts.append(_ld_head(f2, len(t)) + t)
        s = b"".join(sparts)
        parts.append(_ld_head(f, len(s)) + s)
    if not spans:
        return b"", {}
    return b"".join(parts), spans


def aligned_span(buf: bytearray, span: Tuple[int, int], align: int) -> int:
    """Moves buf[start:end] back to an offset that is a multiple of align, over the
    field's own tag and length (already parsed; a cut tensor has at least 4 bytes
    of them), and returns that offset: typed views of unaligned memory are slow or
    refused. One move within the buffer, no allocation."""
    s, e = span
    to = s - s % align
    if to != s:
        memoryview(buf)[to:to + e - s] = memoryview(buf)[s:e]
    return to


def put_back(resp: Any, buf: bytearray, spans: Dict[str, Tuple[int, int]]) -> None:
    """Restores cut data into resp (for callers of the plain recv): one copy each."""
    for name, (s, e) in spans.items():
        getattr(resp.step, name).data = bytes(memoryview(buf)[s:e])


def _consume(views: List[memoryview], n: int) -> None:
    """Drops the first n bytes that a write took from views (in place)."""
    while n > 0 and views:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def sendmsg_all(sock: Any, pieces: List[Any], total: int = -1) -> None:
    """sendmsg of every piece, resumed after short writes. total (the pieces' bytes,
    when the caller knows it): one sendmsg of the pieces as they are first (they
    must then be bytes or byte views), the common case of a small frame."""
    if 0 <= total and len(pieces) <= 512:
        n = sock.sendmsg(pieces)
        if n == total:
            return
        views = [_bytes_view(p) for p in pieces]
        _consume(views, n)  # a short write: the rest as below
    else:
        views = [_bytes_view(p) for p in pieces]
    while views:
        _consume(views, sock.sendmsg(views[:512]))
        while views and views[0].nbytes == 0:
            views.pop(0)


def tensor_view(buf: bytearray, span: Optional[Tuple[int, int]], itemsize: int) -> Optional[Tuple[int, int]]:
    """(offset, count) of a cut tensor in buf after aligning it, or None."""
    if span is None:
        return None
    off = aligned_span(buf, span, itemsize)
    return off, (span[1] - span[0]) // itemsize


# ---- a decode loop's steps: frame heads per tensor signature, OK answers by hand ----

# The varints of small numbers (request ids, layers): a lookup, not a loop.
_V = [_varint(i) for i in range(1 << 14)]


@functools.lru_cache(maxsize=256)
def _sig_heads(sig: Tuple[Tuple[str, int, Tuple[int, ...], int], ...], want_lse: bool,
               fp32_out: bool) -> Tuple[bytes, Tuple[bytes, ...], int]:
    """What a Step of one tensor signature sig ((name, dtype, shape, nbytes) of
    each of q, k, v given) writes the same step after step: the want_lse and
    fp32_out fields, each tensor's field but its data (_tensor_field), and the
    bytes of the tensor fields with their data. Built once per signature."""
    flags = (_T_LSE if want_lse else b"") + (_T_FP32 if fp32_out else b"")
    heads = tuple(_tensor_field(name, int(dtype), tuple(shape), nbytes) for name, dtype, shape, nbytes in sig)
    return flags, heads, sum(len(h) for h in heads) + sum(s[3] for s in sig)


def step_frame_sig(rid: int, layer: int, plan: int, want_lse: bool, fp32_out: bool,
                   sig: Tuple[Tuple[str, int, Tuple[int, ...], int], ...],
                   bufs: Sequence[Any]) -> Tuple[List[Any], int]:
    """step_frame_plan with the frame's heads cached per tensor signature
    (_sig_heads): a repeat Step writes only its request id, layer and plan, then
    the tensors' buffers (bufs, in sig's order, each a C-contiguous buffer of
    sig's nbytes: sent as it is). The same message as step_frame_plan's, field
    for field. Returns (pieces, frame bytes). Only while _FAST holds."""
    flags, heads, const = _sig_heads(sig, want_lse, fp32_out)
    scal = (_T_LAYER + (_V[layer] if 0 <= layer < 16384 else _varint(layer)) if layer else b"") + \
        (_T_PLAN + plan.to_bytes(8, "little") if plan else b"") + flags
    slen = len(scal) + const
    first = (_T_ID + (_V[rid] if 0 <= rid < 16384 else _varint(rid)) if rid else b"") + _REQ_STEP_TAG + \
        (_V[slen] if slen < 16384 else _varint(slen))
    body = len(first) + slen
    if not heads:
        return [body.to_bytes(4, "big") + first + scal], 4 + body
    pieces: List[Any] = [body.to_bytes(4, "big") + first + scal + heads[0], bufs[0]]
    for i in range(1, len(heads)):
        pieces += [heads[i], bufs[i]]
    return pieces, 4 + body


_REQ_STEP_TAG = _varint(_REQ_STEP << 3 | 2)
_DTYPE_SIZE = {pb.DTYPE_FP32: 4, pb.DTYPE_FP16: 2, pb.DTYPE_BF16: 2, pb.DTYPE_INT32: 4}
# The answer's field keys parse_step_ok knows (one byte each but the step's).
_K_ID = _ID << 3
_K_STATUS = pb.Response.DESCRIPTOR.fields_by_name["status"].number << 3 | 2
_K_EPOCH = pb.Response.DESCRIPTOR.fields_by_name["epoch"].number << 3 | 1
_K_TIMING = pb.Response.DESCRIPTOR.fields_by_name["timing"].number << 3 | 2
_K_STEP = _varint(_RESP_STEP << 3 | 2)
_K_OUT = pb.StepResponse.DESCRIPTOR.fields_by_name["out"].number << 3 | 2
_K_LSE = pb.StepResponse.DESCRIPTOR.fields_by_name["lse"].number << 3 | 2
_K_TDTYPE = _DTYPE << 3
_K_TSHAPE = _SHAPE << 3 | 2
_K_TDATA = _DATA << 3 | 2
# The hand parse below holds while the messages are as it reads them.
_PARSE_OK = (len(_K_STEP) == 2 and max(_K_ID, _K_STATUS, _K_EPOCH, _K_TIMING, _K_OUT, _K_LSE, _K_TDTYPE,
                                       _K_TSHAPE, _K_TDATA) < 0x80
             and pb.Response.DESCRIPTOR.fields_by_name["epoch"].type
             == pb.Response.DESCRIPTOR.fields_by_name["epoch"].TYPE_FIXED64
             and pb.Response.DESCRIPTOR.fields_by_name["id"].type
             == pb.Response.DESCRIPTOR.fields_by_name["id"].TYPE_UINT64
             and [f.name for f in pb.StepResponse.DESCRIPTOR.fields] == ["out", "lse"]
             and [f.name for f in pb.Tensor.DESCRIPTOR.fields] == ["dtype", "shape", "data"])


def _uvarint(buf: Any, pos: int) -> Tuple[int, int]:
    """(value, position after) of the varint at buf[pos] (ValueError past 10 bytes)."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    n = b & 0x7F
    shift = 7
    pos += 1
    while True:
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _step_tensor(buf: Any, pos: int, end: int) -> Optional[Tuple[int, Tuple[int, ...], int, int]]:
    """(dtype, shape, data start, data end) of the Tensor in buf[pos:end], or
    None when it is unusual (a field twice or unknown, shape unpacked, a dtype
    of no known size, data not the shape's bytes): the full parse says."""
    dtype = seen = 0
    shape: Tuple[int, ...] = ()
    ds = de = pos
    while pos < end:
        key = buf[pos]
        pos += 1
        if key == _K_TDTYPE and not seen & 1:
            dtype, pos = _uvarint(buf, pos)
            seen |= 1
        elif key == _K_TSHAPE and not seen & 2:
            n, pos = _uvarint(buf, pos)
            e = pos + n
            if e > end:
                return None
            dims = []
            while pos < e:
                d, pos = _uvarint(buf, pos)
                if d >> 32:
                    return None
                dims.append(d)
            if pos != e:
                return None
            shape = tuple(dims)
            seen |= 2
        elif key == _K_TDATA and not seen & 4:
            n, ds = _uvarint(buf, pos)
            pos = de = ds + n
            seen |= 4
        else:
            return None
    size = _DTYPE_SIZE.get(dtype)
    if pos != end or size is None:
        return None
    for d in shape:
        size *= d
    if de - ds != size:
        return None
    return dtype, shape, ds, de


def parse_step_ok(buf: Any, pos: int, end: int) -> Optional[Tuple[int, int, Optional[Tuple[int, int]],
                                                                   Any, Any]]:
    """An OK Step answer (the Response's body in buf[pos:end]) without a
    protobuf message: (id, epoch, (start, end) of its Timing's bytes or None,
    out, lse), out and lse each None or (dtype, shape, data start, data end).
    None for anything else (a status other than an empty one, another call's answer, unknown or repeated
    fields, anything malformed): the caller parses it with protobuf then, which
    says what it is. Only while _PARSE_OK holds."""
    try:
        return _parse_step_ok(buf, pos, end)
    except (IndexError, ValueError):
        return None


# A StepResponse's layouts seen, by its length: (the bytes from its start to
# out's data, where lse's head starts and its data start, those head bytes,
# out and lse as (dtype, shape, data start, data end) from the start, or
# None). A decode loop's answers differ in their data alone: a repeat is two
# byte compares, not a walk of its fields.
_LAYOUTS: Dict[int, Tuple[bytes, int, int, bytes, Any, Any]] = {}


def _remember(buf: Any, sp: int, se: int, out: Any, lse: Any) -> None:
    """Keeps the layout of the StepResponse in buf[sp:se] (out first, data last
    in each tensor: the daemon's order), parsed into out and lse."""
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.clear()
    if out is None:
        return
    o = (out[0], out[1], out[2] - sp, out[3] - sp)
    if lse is None:
        if out[3] != se:
            return
        _LAYOUTS[se - sp] = (bytes(buf[sp:out[2]]), o[3], o[3], b"", o, None)
        return
    if lse[3] != se:
        return
    _LAYOUTS[se - sp] = (bytes(buf[sp:out[2]]), o[3], lse[2] - sp, bytes(buf[out[3]:lse[2]]), o,
                         (lse[0], lse[1], lse[2] - sp, lse[3] - sp))


def _parse_step_ok(buf: Any, pos: int, end: int) -> Any:
    rid = epoch = seen = 0
    timing = out = lse = None
    while pos < end:
        key = buf[pos]
        pos += 1
        if key == _K_ID and not seen & 1:
            rid, pos = _uvarint(buf, pos)
            seen |= 1
        elif key == _K_EPOCH and not seen & 2:
            epoch = int.from_bytes(buf[pos:pos + 8], "little")
            pos += 8
            seen |= 2
        elif key == _K_STATUS and buf[pos] == 0 and not seen & 16:
            pos += 1  # an empty Status: OK (what the daemon writes)
            seen |= 16
        elif key == _K_TIMING and not seen & 4:
            n, ts = _uvarint(buf, pos)
            pos = ts + n
            timing = (ts, pos)
            seen |= 4
        elif key == _K_STEP[0] and buf[pos] == _K_STEP[1] and not seen & 8:
            n, pos = _uvarint(buf, pos + 1)
            se = pos + n
            if se > end:
                return None
            lay = _LAYOUTS.get(n)
            if lay is not None and buf[pos:pos + len(lay[0])] == lay[0] and \
                    buf[pos + lay[1]:pos + lay[2]] == lay[3]:
                # The layout of an earlier answer, its heads compared byte for byte.
                o, l = lay[4], lay[5]
                out = o and (o[0], o[1], pos + o[2], pos + o[3])
                lse = l and (l[0], l[1], pos + l[2], pos + l[3])
                pos = se
            else:
                sp = pos
                while pos < se:
                    key = buf[pos]
                    n, vs = _uvarint(buf, pos + 1)
                    pos = vs + n
                    if pos > se:
                        return None
                    if key == _K_OUT and out is None and lse is None:
                        out = _step_tensor(buf, vs, pos)
                        if out is None:
                            return None
                    elif key == _K_LSE and lse is None:
                        lse = _step_tensor(buf, vs, pos)
                        if lse is None:
                            return None
                    else:
                        return None
                _remember(buf, sp, se, out, lse)
            seen |= 8
        else:  # a status of a code or message, another field, a field twice
            return None
    if pos != end or rid >> 64:
        return None
    return rid, epoch, timing, out, lse
