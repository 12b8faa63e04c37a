#!/usr/bin/python3
"""Writes the seed corpus of fuzz_rpc (tests/fuzz/corpus/): valid request
streams for every RPC on the harness's tiny model (2 layers, 4 q / 2 kv heads,
head_dim 64, blocks of 16, context 256).

One seed is what one client sends on one connection: frames of a 4-byte
big-endian length and an attnd.v1.Request. The harness makes the daemon's ids
deterministic per input (1, 2, 3, ... in the order sessions and plans are
made), so a seed names session 1, plan 2, ... directly.

Usage: gen_corpus.py BUILD_DIR/python OUT_DIR
"""
import os
import struct
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import attnd_pb2 as pb  # noqa: E402

QH, KVH, D, BS = 4, 2, 64, 16
rng = np.random.default_rng(1234)


def bf16(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return ((x.view(np.uint32) + 0x8000) >> 16).astype(np.uint16).tobytes()


def tensor(t, dtype, shape, data):
    t.dtype = dtype
    t.shape.extend(shape)
    t.data = data


class Seed:
    def __init__(self):
        self.frames = []
        self.next = 1

    def req(self):
        r = pb.Request()
        r.id = self.next
        self.next += 1
        return r

    def add(self, r):
        b = r.SerializeToString()
        self.frames.append(struct.pack(">I", len(b)) + b)

    def raw(self, b):
        self.frames.append(b)

    def bytes(self):
        return b"".join(self.frames)


def item(it, session, start, n, tokens=None, kv_only=False, mask=None):
    it.session = session
    it.start = start
    it.n = n
    it.kv_only = kv_only
    if tokens is not None:
        it.tokens.extend(tokens)
    if mask:
        kind = mask[0]
        it.mask.kind = kind
        if kind == pb.Mask.SLIDING_WINDOW:
            it.mask.window = mask[1]
        elif kind == pb.Mask.PREFIX_LM:
            it.mask.prefix_len = mask[1]
        elif kind == pb.Mask.DOCUMENT:
            ls = mask[1]
            tensor(it.mask.doc_lengths, pb.DTYPE_INT32, [len(ls)], np.array(ls, np.int32).tobytes())
        elif kind == pb.Mask.CUSTOM:
            kv_len = start + n
            iv = np.zeros((4, kv_len), np.int32)
            iv[0, :] = 0
            iv[1, :] = np.arange(kv_len) // 2  # rows before j/2 cannot see key j
            tensor(it.mask.intervals, pb.DTYPE_INT32, [4, kv_len], iv.tobytes())
            it.mask.bidirectional = mask[1]


def open_(s, tokens=None, salt=b""):
    r = s.req()
    r.open_session.SetInParent()
    if tokens:
        r.open_session.tokens.extend(tokens)
    if salt:
        r.open_session.salt = salt
    s.add(r)


def step(s, layer, items, rows_q=None, plan=0, lse=False, fp32=False, dtype=pb.DTYPE_BF16):
    """items: list of (session, start, n, tokens, kv_only, mask)."""
    r = s.req()
    st = r.step
    st.layer = layer
    st.plan = plan
    T = 0
    Tq = 0
    for (sess, start, n, tokens, kv_only, mask) in items:
        if not plan:
            item(st.items.add(), sess, start, n, tokens, kv_only, mask)
        T += n
        Tq += 0 if kv_only else n
    if rows_q is not None:
        Tq = rows_q
    if Tq:
        tensor(st.q, dtype, [Tq, QH, D], bf16((Tq, QH, D)))
    tensor(st.k, dtype, [T, KVH, D], bf16((T, KVH, D)))
    tensor(st.v, dtype, [T, KVH, D], bf16((T, KVH, D)))
    st.want_lse = lse
    st.fp32_out = fp32
    s.add(r)


def plan(s, items):
    r = s.req()
    for (sess, start, n, tokens, kv_only, mask) in items:
        item(r.plan.items.add(), sess, start, n, tokens, kv_only, mask)
    s.add(r)


def simple(s, field, **kw):
    r = s.req()
    getattr(r, field).SetInParent()
    for k, v in kw.items():
        setattr(getattr(r, field), k, v)
    s.add(r)


def seeds():
    out = {}
    toks = list(range(100, 100 + 40))

    s = Seed()
    simple(s, "health")
    simple(s, "stats")
    simple(s, "list_sessions")
    out["health_stats_list"] = s

    s = Seed()
    r = s.req()
    r.hello.token = "not-a-token"
    s.add(r)
    simple(s, "health")
    out["hello"] = s

    # Prefill 3 tokens on both layers inline, then two decode steps, then close.
    s = Seed()
    open_(s)
    for layer in (0, 1):
        step(s, layer, [(1, 0, 3, [1, 2, 3], False, None)])
    for pos in (3, 4):
        for layer in (0, 1):
            step(s, layer, [(1, pos, 1, [pos + 1], False, None)], lse=True)
    simple(s, "close_session", session=1)
    out["inline_prefill_decode"] = s

    # A plan over two sessions, stepped on both layers; fp32 out and lse.
    s = Seed()
    open_(s, toks[:20])
    open_(s)
    plan(s, [(1, 0, 20, toks[:20], False, None), (2, 0, 4, [7, 8, 9, 10], False, None)])
    for layer in (0, 1):
        step(s, layer, [(1, 0, 20, None, False, None), (2, 0, 4, None, False, None)], plan=3,
             lse=True, fp32=True)
    out["plan_two_sessions"] = s

    # Prefix sharing: 40 tokens written, a second session finds 32 cached,
    # forks, truncates and decodes (copy-on-write of a shared block).
    s = Seed()
    open_(s, toks)
    for layer in (0, 1):
        step(s, layer, [(1, 0, 40, toks, False, None)])
    open_(s, toks)  # session 2, cached_len 32
    for layer in (0, 1):
        step(s, layer, [(2, 32, 8, toks[32:], False, None)])
    r = s.req()
    r.fork.session = 2
    s.add(r)  # session 3
    r = s.req()
    r.truncate.session = 3
    r.truncate.len = 20
    s.add(r)
    for layer in (0, 1):
        step(s, layer, [(3, 20, 1, [5], False, None)])
    simple(s, "close_session", session=1)
    out["prefix_fork_truncate"] = s

    # Every mask kind, one session each.
    s = Seed()
    masks = [(pb.Mask.FULL,), (pb.Mask.SLIDING_WINDOW, 3), (pb.Mask.PREFIX_LM, 4),
             (pb.Mask.DOCUMENT, [2, 3, 3]), (pb.Mask.CUSTOM, False), (pb.Mask.CUSTOM, True)]
    for i, m in enumerate(masks):
        open_(s)
        step(s, 0, [(i + 1, 0, 8, list(range(8)), False, m)], lse=True)
    out["masks"] = s

    # kv_only import then attention over it; several items in one step.
    s = Seed()
    open_(s)
    open_(s)
    step(s, 0, [(1, 0, 5, list(range(5)), True, None), (2, 0, 2, [1, 2], False, None)])
    step(s, 0, [(1, 5, 1, [9], False, None)])
    out["kv_only_multi_item"] = s

    # Scales: per head and per channel (bf16 cache: refused, int8: accepted).
    s = Seed()
    r = s.req()
    r.set_scales.layer = 0
    tensor(r.set_scales.k_scale, pb.DTYPE_FP32, [KVH], np.full(KVH, 0.05, np.float32).tobytes())
    tensor(r.set_scales.v_scale, pb.DTYPE_FP32, [KVH], np.full(KVH, 0.05, np.float32).tobytes())
    s.add(r)
    r = s.req()
    r.set_scales.layer = 1
    r.set_scales.drop_cached_kv = True
    for t in (r.set_scales.k_scale, r.set_scales.v_scale, r.set_scales.k_zero, r.set_scales.v_zero):
        tensor(t, pb.DTYPE_FP32, [KVH, D], np.full(KVH * D, 0.5, np.float32).tobytes())
    s.add(r)
    open_(s)
    step(s, 0, [(1, 0, 2, [1, 2], False, None)])
    out["set_scales"] = s

    # Sinks: valid for both layers (with ATTND_FUZZ_SINKS=1; else refused), then
    # a wrong shape, a non-finite value, a layer out of range, then a step.
    s = Seed()
    QH = 4
    for layer in (0, 1):
        r = s.req()
        r.set_sinks.layer = layer
        tensor(r.set_sinks.sinks, pb.DTYPE_FP32, [QH], np.linspace(-1, 2, QH, dtype=np.float32).tobytes())
        s.add(r)
    for layer, shape, vals in ((0, [QH, 1], np.zeros(QH, np.float32)),
                               (0, [QH], np.full(QH, np.inf, np.float32)), (7, [QH], np.zeros(QH, np.float32))):
        r = s.req()
        r.set_sinks.layer = layer
        tensor(r.set_sinks.sinks, pb.DTYPE_FP32, shape, vals.tobytes())
        s.add(r)
    open_(s)
    step(s, 0, [(1, 0, 9, list(range(9)), False, None)], lse=True)
    step(s, 1, [(1, 0, 9, list(range(9)), False, None)])
    out["set_sinks"] = s

    # Pipelined decode: eight sessions, steps sent back to back.
    s = Seed()
    for i in range(4):
        open_(s)
    for pos in range(3):
        for layer in (0, 1):
            step(s, layer, [(i + 1, pos, 1, [pos], False, None) for i in range(4)])
    out["pipelined_decode"] = s

    # Salted sessions, a close of an unknown session, a step at a gap.
    s = Seed()
    open_(s, toks[:17], salt=b"tenant-a")
    simple(s, "close_session", session=99)
    step(s, 0, [(1, 5, 1, [1], False, None)])
    step(s, 1, [(1, 0, 1, [1], False, None)])
    out["errors"] = s

    # Framing: a zero-length frame; a frame over the limit.
    s = Seed()
    simple(s, "health")
    s.raw(b"\x00\x00\x00\x00")
    out["zero_frame"] = s
    s = Seed()
    s.raw(b"\x7f\x00\x00\x00" + b"\x08\x01")
    out["huge_frame"] = s

    # The decoder's bounds (context 256, 48 blocks of 16 = 768 tokens, 8
    # sessions): a prompt of max_context ids and one past it; an item with
    # more ids than its n, one with its ids before n and past max_context;
    # more doc lengths than keys; a window of 2^32-1 (valid); four items
    # whose 800 ids are more than the pool holds.
    s = Seed()
    open_(s, list(range(256)))
    open_(s, list(range(257)))
    step(s, 0, [(1, 0, 2, [1, 2, 3], False, None)], rows_q=2)
    r = s.req()
    it = r.plan.items.add()
    it.tokens.extend(range(300))
    it.session = 1
    it.n = 1
    s.add(r)
    step(s, 0, [(1, 0, 2, [1, 2], False, (pb.Mask.DOCUMENT, [2, 0, 0]))])
    step(s, 0, [(1, 0, 2, [1, 2], False, (pb.Mask.SLIDING_WINDOW, 0xFFFFFFFF))])
    for i in range(3):
        open_(s)
    plan(s, [(i + 1, 0, 200, list(range(200)), False, None) for i in range(4)])
    out["bounds"] = s

    # A connection that ends: two steps in flight, then a frame that does not
    # parse (answered after both), then a step that is no longer a request.
    s = Seed()
    open_(s)
    step(s, 0, [(1, 0, 4, [1, 2, 3, 4], False, None)])
    step(s, 1, [(1, 0, 4, [1, 2, 3, 4], False, None)])
    s.raw(struct.pack(">I", 3) + b"\xff\xff\xff")
    step(s, 0, [(1, 4, 1, [5], False, None)])
    out["end_after_steps"] = s


    # The field budget: an OpenSession with more unknown fields than any
    # valid one (1024 + max_context), then a Request with 65 top-level fields.
    s = Seed()
    junk = b"\xa0\x06\x00" * 1400  # field 100 = 0, 4200 bytes (a 2-byte length)
    body = b"\x08\x01\x2a" + bytes([0x80 | (len(junk) & 0x7f), len(junk) >> 7]) + junk
    s.raw(struct.pack(">I", len(body)) + body)
    body = b"\x08\x02" + b"\xa0\x06\x00" * 64 + b"\x1a\x00"
    s.raw(struct.pack(">I", len(body)) + body)
    out["field_budget"] = s

    # Split context: a session from base 40 (id 1) and one from 0 (id 2);
    # writes at and past the base, attend-only (q_only) items alone and beside
    # a normal item, and the refusals: start below the base, q_only with
    # kv_only, with tokens, before the end; truncate below the base; a base
    # past max_context; fork and list (bases reported).
    s = Seed()
    for base in (40, 0):
        r = s.req()
        r.open_session.SetInParent()
        r.open_session.base = base
        s.add(r)
    step(s, 0, [(1, 40, 8, list(range(8)), False, None)])
    step(s, 1, [(1, 40, 8, list(range(8)), False, None)])

    def q_only_step(layer, start, n, mask=None, kv_only=False, tokens=None, with_item=False):
        r = s.req()
        st = r.step
        st.layer = layer
        T = 0
        if with_item:
            item(st.items.add(), 2, 0, 3, [1, 2, 3])
            T = 3
        it = st.items.add()
        item(it, 1, start, n, tokens, kv_only, mask)
        it.q_only = True
        tensor(st.q, pb.DTYPE_BF16, [n + T, QH, D], bf16((n + T, QH, D)))
        if T:
            tensor(st.k, pb.DTYPE_BF16, [T, KVH, D], bf16((T, KVH, D)))
            tensor(st.v, pb.DTYPE_BF16, [T, KVH, D], bf16((T, KVH, D)))
        st.want_lse = True
        st.fp32_out = True
        s.add(r)

    q_only_step(0, 48, 1)
    q_only_step(1, 50, 20, mask=(pb.Mask.SLIDING_WINDOW, 6))
    q_only_step(0, 60, 2, mask=(pb.Mask.CUSTOM, True), with_item=True)
    q_only_step(0, 48, 3, mask=(pb.Mask.PREFIX_LM, 44))
    q_only_step(0, 44, 1)                         # before the end
    q_only_step(0, 48, 1, kv_only=True)           # with kv_only
    q_only_step(0, 48, 1, tokens=[7])             # with token ids
    step(s, 0, [(1, 30, 1, [1], False, None)])    # start below the base
    simple(s, "truncate", session=1, len=39)      # below the base
    simple(s, "fork", session=1)
    simple(s, "truncate", session=1, len=44)
    simple(s, "list_sessions")
    r = s.req()
    r.open_session.SetInParent()
    r.open_session.base = 1 << 20                 # past max_context
    s.add(r)
    out["split_context"] = s

    # Same-host zero-copy (the CPU backend refuses every registration): a
    # RegisterBuffer, one with a short handle, a release of buffer 1, a step
    # whose tensors are refs to buffer 1, one mixing bytes and refs, then the
    # same step as bytes (nothing changed before it).
    s = Seed()
    open_(s)
    for handle in (bytes(range(64)), b"short"):
        r = s.req()
        r.register_buffer.cuda_ipc_handle = handle
        r.register_buffer.size = 1 << 20
        r.register_buffer.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
        s.add(r)
    simple(s, "release_buffer", buffer=1)

    def ref(t, off, shape, dtype=pb.DTYPE_BF16):
        t.buffer, t.offset, t.dtype = 1, off, dtype
        t.shape.extend(shape)

    for mixed in (False, True):
        r = s.req()
        st = r.step
        item(st.items.add(), 1, 0, 2, [1, 2])
        ref(st.q_ref, 0, [2, QH, D])
        ref(st.out_ref, 4096, [2, QH, D])
        if mixed:
            tensor(st.k, pb.DTYPE_BF16, [2, KVH, D], bf16((2, KVH, D)))
        else:
            ref(st.k_ref, 8192, [2, KVH, D])
        ref(st.v_ref, 12288, [2, KVH, D])
        ref(st.lse_ref, 16384, [2, QH], pb.DTYPE_FP32)
        st.want_lse = True
        s.add(r)
    step(s, 0, [(1, 0, 2, [1, 2], False, None)])
    out["zero_copy"] = s

    # Steps by reference that run: the harness gives the CPU backend stand-in
    # zero-copy ops over an arena (fuzz_rpc.c), so RegisterBuffer opens (buffer
    # 3, after sessions 1 and 2). Seven small steps of session 2 follow it: the
    # harness drains at eight calls in flight, so the registration is done
    # before a step names it (a client waits for its answer). Then a prefill
    # and a decode by reference of session 1 on both layers (the device check
    # a CHECK job) with done signals, an fp32 output, a misaligned done word, a
    # region past the registration, a handle
    # "the driver" cannot open, a release, and a step naming the released buffer.
    s = Seed()
    open_(s)
    open_(s)
    r = s.req()
    r.register_buffer.cuda_ipc_handle = bytes(range(64))
    r.register_buffer.size = 1 << 20
    r.register_buffer.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
    s.add(r)
    for pos in range(7):
        step(s, 0, [(2, pos, 1, [pos], True, None)])

    def ref2(t, off, shape, dtype=pb.DTYPE_BF16):
        t.buffer, t.offset, t.dtype = 3, off, dtype
        t.shape.extend(shape)

    def ref_step(layer, start, n, q_off=0, fp32=False, lse=False, done=None):
        r = s.req()
        st = r.step
        st.layer = layer
        item(st.items.add(), 1, start, n, list(range(start + 1, start + n + 1)))
        ref2(st.q_ref, q_off, [n, QH, D])
        ref2(st.k_ref, 65536, [n, KVH, D])
        ref2(st.v_ref, 131072, [n, KVH, D])
        ref2(st.out_ref, 196608, [n, QH, D], pb.DTYPE_FP32 if fp32 else pb.DTYPE_BF16)
        if lse:
            ref2(st.lse_ref, 262144, [n, QH], pb.DTYPE_FP32)
        st.want_lse = lse
        st.fp32_out = fp32
        if done is not None:  # the done signal's word: (offset, value)
            st.done.buffer, st.done.offset, st.done.value = 3, done[0], done[1]
        s.add(r)

    for layer in (0, 1):
        ref_step(layer, 0, 4, lse=True, done=(327680 + 8 * layer, 1))
    for layer in (0, 1):
        ref_step(layer, 4, 1, fp32=layer == 1, done=(327680 + 8 * layer, 2))
    ref_step(0, 4, 1, done=(327684, 3))  # a misaligned word: refused
    ref_step(0, 5, 1, q_off=(1 << 20) - 256)  # past the registration
    r = s.req()
    r.register_buffer.cuda_ipc_handle = b"\xff" + bytes(63)
    r.register_buffer.size = 4096
    r.register_buffer.device_uuid = "gpu-00000000-0000-0000-0000-000000000000"
    s.add(r)
    simple(s, "release_buffer", buffer=3)
    ref_step(0, 5, 1)
    out["zero_copy_device"] = s
    return out


def main():
    outdir = sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    for name, s in seeds().items():
        with open(os.path.join(outdir, name + ".bin"), "wb") as f:
            f.write(s.bytes())


if __name__ == "__main__":
    main()
