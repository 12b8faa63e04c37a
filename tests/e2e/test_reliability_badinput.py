"""Bad input over every RPC, table-driven, against the real daemon (CPU).

Each row sends one malformed request on a connection of its own identity and
expects a status (or a closed connection for framing errors). Around the whole
table, a sentinel session on another connection proves no other session was
touched: its next decode step, computed before the table ran, is recomputed
afterwards (a retry at the same position is idempotent) and must be bitwise
identical on every layer. The victim session the rows aim at must keep its
length too. The daemon runs with an int8 cache so SetScales rows mean
something; a second class checks that non-finite q/k/v never reach a shared
prefix block.
"""
import struct
import unittest

import numpy as np

from harness import Daemon
from test_reliability_util import (ABORTED, BS, D, EXHAUSTED, INVALID, KVH, LAYERS, NOT_FOUND, OK,
                                   PERM, PRECOND, QH, RANGE, SHAPE, UNAUTH, UNIMPL, RawConn, bf16,
                                   item, must, open_req, pb, simple, step_req, tensor)

MAX_CONTEXT = 256
MAX_FRAME = 1 << 20


def scales_req(layer, kshape=(KVH,), vshape=(KVH,), value=0.05, dtype=pb.DTYPE_FP32, zero=False,
               drop=False, kval=None):
    r = pb.Request()
    s = r.set_scales
    s.layer = layer
    kv = np.full(int(np.prod(kshape or (1,))), value if kval is None else kval, np.float32)
    vv = np.full(int(np.prod(vshape or (1,))), value, np.float32)
    if kshape is not None:
        tensor(s.k_scale, dtype, kshape, kv.tobytes() if dtype == pb.DTYPE_FP32 else kv.astype(np.float16).tobytes())
    if vshape is not None:
        tensor(s.v_scale, dtype, vshape, vv.tobytes() if dtype == pb.DTYPE_FP32 else vv.astype(np.float16).tobytes())
    if zero:
        tensor(s.k_zero, pb.DTYPE_FP32, [KVH, D], np.full(KVH * D, 8, np.float32).tobytes())
        tensor(s.v_zero, pb.DTYPE_FP32, [KVH, D], np.full(KVH * D, 8, np.float32).tobytes())
    s.drop_cached_kv = drop
    return r


def with_mask(req, kind, window=0, prefix_len=0, docs=None, docs_dtype=pb.DTYPE_INT32, iv=None,
              iv_shape=None):
    m = req.step.items[0].mask
    m.kind = kind
    m.window = window
    m.prefix_len = prefix_len
    if docs is not None:
        a = np.array(docs, np.int32)
        tensor(m.doc_lengths, docs_dtype, [len(docs)], a.tobytes())
    if iv is not None:
        a = np.ascontiguousarray(iv, np.int32)
        tensor(m.intervals, pb.DTYPE_INT32, iv_shape or a.shape, a.tobytes())
    return req


def nonfinite(which, value):
    """A valid one-token step whose q, k or v holds one non-finite value."""
    def build(ctx):
        r = step_req(0, [(ctx.victim, ctx.vlen, 1)])
        t = getattr(r.step, which)
        a = bytearray(t.data)
        bits = np.array([value], np.float32).view(np.uint32)[0] >> 16
        a[6:8] = struct.pack("<H", int(bits))
        t.data = bytes(a)
        return r
    return build


def mutate_step(fn, n=1, layer=0, start=None):
    def build(ctx):
        r = step_req(layer, [(ctx.victim, ctx.vlen if start is None else start, n)])
        fn(r.step, ctx)
        return r
    return build


def set_shape(t, shape):
    del t.shape[:]
    t.shape.extend(shape)


def custom_iv(kv_len, inverted=False):
    iv = np.zeros((4, kv_len), np.int32)
    iv[1, :] = 1
    if inverted:
        iv[0, 0], iv[1, 0] = 5, 2
    return iv


class Ctx:
    pass


def framing(data):
    """A raw byte string instead of a request."""
    return ("raw", data)


# name -> (builder(ctx) -> Request | ("raw", bytes), expected codes, expect close, operator)
# Rows run over TCP loopback (the anonymous identity, not an operator); rows
# with op=True on the Unix socket as the daemon's own uid, an operator
# (SetScales changes daemon-wide state: docs/protocol.md section 7).
def table():
    T = []

    def add(name, build, codes, close=False, op=False):
        T.append((name, build, set(codes) if isinstance(codes, (list, tuple, set)) else {codes}, close, op))

    # ---- Step: shapes ----
    add("step q heads mismatch", mutate_step(lambda s, c: (set_shape(s.q, [1, QH - 1, D]),
                                                           setattr(s.q, "data", s.q.data[:(QH - 1) * D * 2]))), INVALID)
    add("step k head_dim mismatch", mutate_step(lambda s, c: (set_shape(s.k, [1, KVH, D // 2]),
                                                              setattr(s.k, "data", s.k.data[:KVH * D]))), INVALID)
    add("step k rows != n", mutate_step(lambda s, c: (set_shape(s.k, [2, KVH, D]),
                                                      setattr(s.k, "data", bf16((2, KVH, D))))), INVALID)
    add("step q rows != n", mutate_step(lambda s, c: (set_shape(s.q, [2, QH, D]),
                                                      setattr(s.q, "data", bf16((2, QH, D))))), INVALID)
    add("step data shorter than shape", mutate_step(lambda s, c: setattr(s.v, "data", s.v.data[:-2])), INVALID)
    add("step data longer than shape", mutate_step(lambda s, c: setattr(s.v, "data", s.v.data + b"\0\0")), INVALID)
    add("step 5 dims", mutate_step(lambda s, c: set_shape(s.k, [1, 1, KVH, D, 1])), INVALID)
    add("step zero dim", mutate_step(lambda s, c: (set_shape(s.k, [0, KVH, D]), setattr(s.k, "data", b""))), INVALID)
    add("step huge dims", mutate_step(lambda s, c: set_shape(s.k, [0xFFFFFFFF, KVH, D])), INVALID)
    add("step overflowing dims", mutate_step(lambda s, c: set_shape(s.q, [1 << 31, 1 << 31, 1 << 31, 8])), INVALID)
    # The byte count of this shape wraps to 0 in 64 bits: with no data it must still fail.
    add("step overflowing dims, no data", mutate_step(lambda s, c: (set_shape(s.q, [1 << 31, 1 << 31, 1 << 31, 8]),
                                                                    setattr(s.q, "data", b""))), INVALID)
    add("step 2-d k", mutate_step(lambda s, c: set_shape(s.k, [KVH, D])), INVALID)
    add("step missing k", mutate_step(lambda s, c: s.ClearField("k")), INVALID)
    add("step missing v", mutate_step(lambda s, c: s.ClearField("v")), INVALID)
    add("step missing q", mutate_step(lambda s, c: s.ClearField("q")), INVALID)
    add("step q with kv_only item", mutate_step(lambda s, c: setattr(s.items[0], "kv_only", True)), INVALID)
    # ---- Step: dtypes ----
    add("step fp16 on a bf16 daemon", mutate_step(lambda s, c: [setattr(t, "dtype", pb.DTYPE_FP16)
                                                                for t in (s.q, s.k, s.v)]), INVALID)
    add("step int32 k", mutate_step(lambda s, c: setattr(s.k, "dtype", pb.DTYPE_INT32)), INVALID)
    add("step unspecified dtype", mutate_step(lambda s, c: setattr(s.v, "dtype", 0)), INVALID)
    add("step unknown dtype 9", mutate_step(lambda s, c: setattr(s.q, "dtype", 9)), INVALID)
    # ---- Step: positions and items ----
    add("step n = 0", mutate_step(lambda s, c: setattr(s.items[0], "n", 0)), INVALID)
    add("step n huge", mutate_step(lambda s, c: setattr(s.items[0], "n", 1 << 31)), [INVALID, RANGE])
    add("step position gap", mutate_step(lambda s, c: setattr(s.items[0], "start", c.vlen + 1)), INVALID)
    add("step start 2^32-1", mutate_step(lambda s, c: setattr(s.items[0], "start", 0xFFFFFFFF)), [INVALID, RANGE])
    add("step past max_context", lambda c: must_step_at(c, MAX_CONTEXT), [INVALID, RANGE])
    add("step layer out of range", mutate_step(lambda s, c: setattr(s, "layer", LAYERS)), [INVALID, RANGE])
    add("step layer huge", mutate_step(lambda s, c: setattr(s, "layer", 0xFFFFFFFF)), [INVALID, RANGE])
    add("step layer 1 ahead of layer 0", mutate_step(lambda s, c: None, layer=1, n=2), INVALID)
    add("step tokens count != n", mutate_step(lambda s, c: s.items[0].tokens.append(5)), INVALID)
    add("step tokens beyond max_context", mutate_step(
        lambda s, c: s.items[0].tokens.extend(range(10 * MAX_CONTEXT))), INVALID)
    add("step tokens differ from layer 0", mutate_step(
        lambda s, c: (s.items[0].tokens.__setitem__(0, 999)), layer=1, start=0), INVALID)
    add("step no items, no plan", mutate_step(lambda s, c: s.ClearField("items")), INVALID)
    add("step same session twice", lambda c: two_items(c, c.victim, c.victim), INVALID)
    add("step second item unknown", lambda c: two_items(c, c.victim, 0x1234), NOT_FOUND)
    add("step unknown session", mutate_step(lambda s, c: setattr(s.items[0], "session", 0xdead)), NOT_FOUND)
    add("step closed session", mutate_step(lambda s, c: setattr(s.items[0], "session", c.closed)), NOT_FOUND)
    add("step another identity's session", mutate_step(lambda s, c: setattr(s.items[0], "session", c.sentinel)),
        [NOT_FOUND, 7])
    add("step unknown plan", lambda c: plan_step(c, 0x77), [PRECOND, NOT_FOUND])
    add("step plan and inline items", mutate_step(lambda s, c: setattr(s, "plan", 5)), INVALID)
    # ---- Step: masks ----
    add("mask sliding window 0", lambda c: with_mask(step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.SLIDING_WINDOW), INVALID)
    # Windows wider than any position are valid (the same as causal): a rewrite of the last position.
    add("mask sliding window 2^32-1", lambda c: with_mask(step_req(0, [(c.victim, c.vlen - 1, 1)]),
                                                          pb.Mask.SLIDING_WINDOW, window=0xFFFFFFFF), OK)
    add("mask sliding window 2^31", lambda c: with_mask(step_req(0, [(c.victim, c.vlen - 1, 1)]),
                                                        pb.Mask.SLIDING_WINDOW, window=1 << 31), OK)
    add("mask more documents than keys", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.DOCUMENT, docs=[c.vlen + 1] + [0] * (c.vlen + 1)), INVALID)
    add("mask unknown kind", lambda c: with_mask(step_req(0, [(c.victim, c.vlen, 1)]), 9), [INVALID, UNIMPL])
    add("mask documents not summing to kv_len", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.DOCUMENT, docs=[1, 1]), INVALID)
    add("mask negative document", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.DOCUMENT, docs=[c.vlen + 2, -1]), INVALID)
    add("mask document lengths fp32", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.DOCUMENT, docs=[c.vlen + 1], docs_dtype=pb.DTYPE_FP32), INVALID)
    add("mask document missing", lambda c: with_mask(step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.DOCUMENT), INVALID)
    add("mask intervals too short", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.CUSTOM, iv=custom_iv(c.vlen)), INVALID)
    add("mask intervals too long", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.CUSTOM, iv=custom_iv(c.vlen + 2)), INVALID)
    add("mask intervals 3 rows", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.CUSTOM, iv=custom_iv(c.vlen + 1)[:3]), INVALID)
    add("mask intervals inverted", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.CUSTOM, iv=custom_iv(c.vlen + 1, inverted=True)), INVALID)
    add("mask intervals missing", lambda c: with_mask(step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.CUSTOM), INVALID)
    add("mask intervals shape lies", lambda c: with_mask(
        step_req(0, [(c.victim, c.vlen, 1)]), pb.Mask.CUSTOM, iv=custom_iv(c.vlen + 1), iv_shape=[4, 100000]), INVALID)
    # ---- Step: non-finite values ----
    add("step NaN in k", nonfinite("k", np.nan), INVALID)
    add("step +Inf in v", nonfinite("v", np.inf), INVALID)
    add("step -Inf in q", nonfinite("q", -np.inf), INVALID)
    # ---- Plan ----
    add("plan no items", lambda c: simple("plan"), INVALID)
    add("plan unknown session", lambda c: plan_req([(0xbeef, 0, 1)]), NOT_FOUND)
    add("plan n = 0", lambda c: plan_req([(c.victim, c.vlen, 0)]), INVALID)
    add("plan position gap", lambda c: plan_req([(c.victim, c.vlen + 3, 1)]), INVALID)
    add("plan past max_context", lambda c: plan_req([(c.victim, MAX_CONTEXT, 1)]), [INVALID, RANGE])
    add("plan same session twice", lambda c: plan_req([(c.victim, c.vlen, 1), (c.victim, c.vlen, 1)]), INVALID)
    add("planned step with wrong rows", lambda c: planned_bad_rows(c), INVALID)
    # ---- OpenSession / CloseSession / Fork / Truncate ----
    add("open salt over 64 bytes", lambda c: open_req([1, 2], salt=b"x" * 65), INVALID)
    add("open tokens beyond max_context", lambda c: open_req(list(range(MAX_CONTEXT + 1))), INVALID)
    add("open tokens 1000x max_context", lambda c: open_req([7] * (1000 * MAX_CONTEXT)), INVALID)
    add("close unknown session", lambda c: simple("close_session", session=0x5555), NOT_FOUND)
    add("close closed session", lambda c: simple("close_session", session=c.closed), NOT_FOUND)
    add("close another identity's session", lambda c: simple("close_session", session=c.sentinel), [NOT_FOUND, 7])
    add("fork unknown session", lambda c: simple("fork", session=0x5555), NOT_FOUND)
    add("fork uneven layers", lambda c: simple("fork", session=c.uneven), PRECOND)
    add("truncate beyond len", lambda c: simple("truncate", session=c.victim, len=c.vlen + 5), [INVALID, RANGE])
    add("truncate uneven layers", lambda c: simple("truncate", session=c.uneven, len=1), PRECOND)
    add("truncate unknown session", lambda c: simple("truncate", session=0x5555, len=0), NOT_FOUND)
    # ---- SetScales (int8 daemon: per head [kv_heads] or per channel [kv_heads, head_dim]) ----
    add("scales wrong shape [3]", lambda c: scales_req(0, kshape=(KVH + 1,)), INVALID, op=True)
    add("scales wrong shape [kv, d+1]", lambda c: scales_req(0, kshape=(KVH, D + 1), vshape=(KVH, D + 1)), INVALID,
        op=True)
    add("scales k and v shapes differ", lambda c: scales_req(0, kshape=(KVH,), vshape=(KVH, D)), [INVALID, PRECOND, OK],
        op=True)
    add("scales zero", lambda c: scales_req(0, value=0.0), INVALID, op=True)
    add("scales negative", lambda c: scales_req(0, kval=-1.0), INVALID, op=True)
    add("scales NaN", lambda c: scales_req(0, kval=np.nan), INVALID, op=True)
    add("scales Inf", lambda c: scales_req(0, kval=np.inf), INVALID, op=True)
    add("scales fp16", lambda c: scales_req(0, dtype=pb.DTYPE_FP16), INVALID, op=True)
    add("scales zero points on int8", lambda c: scales_req(0, kshape=(KVH, D), vshape=(KVH, D), zero=True), INVALID,
        op=True)
    add("scales missing v", lambda c: scales_req(0, vshape=None), INVALID, op=True)
    add("scales layer out of range", lambda c: scales_req(LAYERS), [INVALID, RANGE], op=True)
    add("scales change while KV is held", lambda c: scales_req(0, value=0.07), PRECOND, op=True)
    # Not an operator: refused whatever it asks, before anything is looked at.
    add("scales from anonymous TCP", lambda c: scales_req(0, kshape=(KVH, D), vshape=(KVH, D), value=0.03,
                                                           drop=True), PERM)
    add("scales from anonymous TCP, bad shape", lambda c: scales_req(0, kshape=(KVH + 1,)), PERM)
    # ---- Calls and Hello ----
    add("no call", lambda c: pb.Request(), UNIMPL)
    add("unknown call 99", lambda c: framing(frame(b"\x08\x07" + b"\x9a\x06\x02zz")), UNIMPL)
    add("hello with a wrong token", lambda c: hello("wrong"), UNAUTH, close=True)
    # ---- Framing ----
    add("zero-length frame", lambda c: framing(b"\0\0\0\0"), INVALID, close=True)
    add("frame over --max-frame", lambda c: framing(struct.pack(">I", MAX_FRAME + 1) + b"\x08\x01"),
        EXHAUSTED, close=True)
    add("frame of 2^32-1", lambda c: framing(b"\xff\xff\xff\xff"), EXHAUSTED, close=True)
    add("garbled protobuf", lambda c: framing(frame(b"\xff\xff\xff\xff\xff")), INVALID, close=True)
    add("length running past the frame", lambda c: framing(frame(b"\x08\x09\x52\x40\x01")), INVALID, close=True)
    add("wrong wire type for id", lambda c: framing(frame(b"\x0a\x01\x00")), INVALID, close=True)
    add("truncated frame then EOF", lambda c: ("eof", struct.pack(">I", 100) + b"\x08\x01"), None, close=True)
    return T


def frame(b):
    return struct.pack(">I", len(b)) + b


def hello(token):
    r = pb.Request()
    r.hello.token = token
    return r


def must_step_at(c, start):
    return step_req(0, [(c.victim, start, 1)])


def two_items(c, a, b):
    return step_req(0, [(a, c.vlen, 1), (b, 0 if b != a else c.vlen, 1)])


def plan_req(items):
    r = pb.Request()
    r.plan.SetInParent()
    for (s, start, n) in items:
        item(r.plan.items.add(), s, start, n)
    return r


def plan_step(c, plan):
    r = step_req(0, [(c.victim, c.vlen, 1)], plan=plan)
    return r


def planned_bad_rows(c):
    resp = c.conn.call(plan_req([(c.victim, c.vlen, 1)]))
    must(resp, "plan")
    r = step_req(0, [(c.victim, c.vlen, 2)], plan=resp.plan.plan)
    return r


class BadInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon(["--kv-cache", "int8", "--kv-memory", "16M", "--max-context", str(MAX_CONTEXT),
                        "--max-frame", str(MAX_FRAME), "--max-inflight", str(4 * MAX_FRAME)],
                       shape=SHAPE)
        try:
            cls.d.wait_ready()
        except BaseException:
            cls.d.close()
            raise

    @classmethod
    def tearDownClass(cls):
        try:
            code = cls.d.stop()
            assert code == 0, f"attnd exited {code}:\n{cls.d.log_text()}"
        finally:
            cls.d.close()

    def tcp(self):
        return RawConn(("127.0.0.1", self.d.tcp_port))

    def test_table(self):
        rng = np.random.default_rng(11)
        # Scales for both layers first (an int8 cache cannot step without them).
        with RawConn(self.d.socket) as c:
            for layer in range(LAYERS):
                must(c.call(scales_req(layer, kshape=(KVH, D), vshape=(KVH, D), value=0.03)), "scales")
        # The sentinel: its own connection and identity (the Unix peer uid).
        sent = RawConn(self.d.socket)
        s_id = must(sent.call(open_req(list(range(20)))), "open").open_session.session
        for layer in range(LAYERS):
            must(sent.call(step_req(layer, [(s_id, 0, 20, list(range(20)))], rng=rng)), "sentinel prefill")
        probe = [step_req(layer, [(s_id, 20, 1, [20])], rng=rng, lse=True) for layer in range(LAYERS)]
        ref = [must(sent.call(p), "probe") for p in probe]
        ref_out = [(r.step.out.data, r.step.lse.data) for r in ref]

        # The rows run over TCP loopback (the anonymous identity): the sentinel is foreign there.
        conn = self.tcp()
        ctx = Ctx()
        ctx.conn = conn
        ctx.sentinel = s_id
        ctx.victim = must(conn.call(open_req(list(range(4)))), "open victim").open_session.session
        for layer in range(LAYERS):
            must(conn.call(step_req(layer, [(ctx.victim, 0, 4, list(range(4)))], rng=rng)), "victim prefill")
        ctx.vlen = 4
        ctx.closed = must(conn.call(open_req()), "open").open_session.session
        must(conn.call(simple("close_session", session=ctx.closed)), "close")
        ctx.uneven = must(conn.call(open_req()), "open").open_session.session
        must(conn.call(step_req(0, [(ctx.uneven, 0, 3)], rng=rng)), "uneven prefill")

        ctx.op = RawConn(self.d.socket)
        rows = table()
        results = []
        failures = []
        for (name, build, codes, close, op) in rows:
            got_code, got_close, msg = None, False, ""
            try:
                req = build(ctx)
                if isinstance(req, tuple) and req[0] == "eof":
                    with self.tcp() as t:
                        t.send_raw(req[1])
                    got_close = True
                elif isinstance(req, tuple):
                    t = self.tcp()
                    t.send_raw(req[1])
                    r = t.recv_any()
                    got_code, msg = r.status.code, r.status.message
                    if r.id == 0 or close:
                        got_close = t.is_closed()
                    t.close()
                elif close:
                    t = self.tcp()
                    r = t.call(req)
                    got_code, msg = r.status.code, r.status.message
                    got_close = t.is_closed()
                    t.close()
                else:
                    r = (ctx.op if op else conn).call(req)
                    got_code, msg = r.status.code, r.status.message
            except Exception as e:  # noqa: BLE001 (a row must never take the test down silently)
                msg = f"{type(e).__name__}: {e}"
            ok = (codes is None or got_code in codes) and got_close == close
            results.append((name, got_code, got_close, msg))
            if not ok:
                failures.append(f"{name}: want {sorted(codes) if codes else None} close={close}, "
                                f"got {got_code} close={got_close} ({msg})")
        for (name, code, closed, msg) in results:
            print(f"  {name:42s} -> {code} {'(closed)' if closed else ''} {msg[:70]}")
        print(f"bad-input table: {len(rows)} rows, {len(rows) - len(failures)} as expected")
        # The element count of a huge shape saturates instead of wrapping to 0 (daemon/rpc/decode.c).
        ovf = [m for (n, _, _, m) in results if n == "step overflowing dims"]
        self.assertNotIn("needs 0 bytes", ovf[0])

        # The victim kept its length on both layers (no row changed it).
        ls = must(conn.call(simple("list_sessions")), "list").list_sessions.sessions
        lens = {s.session: s.len for s in ls}
        self.assertEqual(lens.get(ctx.victim), ctx.vlen)
        conn.close()
        ctx.op.close()
        # The sentinel's retried probe is bitwise identical on every layer.
        for layer in range(LAYERS):
            r = must(sent.call(step_req(layer, [(s_id, 20, 1, [20])], q=probe[layer].step.q.data,
                                        k=probe[layer].step.k.data, v=probe[layer].step.v.data,
                                        lse=True)), "probe again")
            self.assertEqual(r.step.out.data, ref_out[layer][0], f"sentinel output changed at layer {layer}")
            self.assertEqual(r.step.lse.data, ref_out[layer][1], f"sentinel lse changed at layer {layer}")
        sent.close()
        self.assertIsNone(self.d.proc.poll(), "the daemon died")
        self.assertEqual(failures, [], "\n".join(failures))


class NonFiniteTest(unittest.TestCase):
    """NaN/Inf never reach a cache block, shared prefix blocks included."""

    def test_shared_prefix_not_poisoned(self):
        d = Daemon(["--kv-memory", "16M", "--max-context", "256"], shape=SHAPE)
        try:
            d.wait_ready()
            rng = np.random.default_rng(5)
            toks = list(range(300, 333))  # 33 tokens: 2 full blocks can be shared
            with RawConn(d.socket) as a, RawConn(d.socket) as b:
                sa = must(a.call(open_req(toks)), "open a").open_session.session
                for layer in range(LAYERS):
                    must(a.call(step_req(layer, [(sa, 0, 32, toks[:32])], rng=rng)), "a prefill")
                # B shares the prefix, then tries to poison it (a rewrite of
                # position 0, which would copy-on-write) and to append NaN.
                ob = must(b.call(open_req(toks)), "open b").open_session
                self.assertEqual(ob.cached_len, 2 * BS)
                sb = ob.session
                for layer in range(LAYERS):
                    for (start, n) in ((0, 1), (2 * BS, 1), (5, 3)):
                        r = step_req(layer, [(sb, start, n, toks[start:start + n])], rng=rng)
                        for t in (r.step.k, r.step.v, r.step.q):
                            a16 = bytearray(t.data)
                            a16[-2:] = struct.pack("<H", 0x7FC0)  # bf16 NaN in the last element
                            t.data = bytes(a16)
                            rr = b.call(r)
                            self.assertEqual(rr.status.code, INVALID, rr.status.message)
                            t.data = bytes(a16[:-2]) + struct.pack("<H", 0x7F80)  # +Inf
                            rr = b.call(r)
                            self.assertEqual(rr.status.code, INVALID, rr.status.message)
                            t.data = bytes(a16[:-2]) + b"\0\0"
                # A third session on the same prefix and A compute the same
                # next token from the same q/k/v: identical outputs, so the
                # shared blocks hold what A wrote.
                with RawConn(d.socket) as c:
                    oc = must(c.call(open_req(toks)), "open c").open_session
                    self.assertEqual(oc.cached_len, 2 * BS)
                    for layer in range(LAYERS):
                        q, k, v = bf16((1, QH, D), rng), bf16((1, KVH, D), rng), bf16((1, KVH, D), rng)
                        ra = must(a.call(step_req(layer, [(sa, 32, 1, toks[32:])], q=q, k=k, v=v)), "a")
                        rc = must(c.call(step_req(layer, [(oc.session, 32, 1, toks[32:])], q=q, k=k, v=v)), "c")
                        self.assertEqual(ra.step.out.data, rc.step.out.data, f"layer {layer}")
                        out = np.frombuffer(ra.step.out.data, "<u2")
                        self.assertFalse(((out & 0x7F80) == 0x7F80).any(), "non-finite output")
            self.assertEqual(d.stop(), 0)
        finally:
            d.close()


if __name__ == "__main__":
    unittest.main()
