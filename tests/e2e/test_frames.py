"""The Python client's step frames (attnd/_frames.py), without a daemon: a Step
framed by hand parses as the same message protobuf would build, tensor bytes
taken from the caller's arrays; a Step answer's large out/lse data are cut out
of the message and come back as aligned views of the frame, and put back for
the plain recv() they equal protobuf's own parse. A decode loop's fast path:
frames with heads cached per tensor signature, OK answers parsed by hand (and
everything else left to protobuf), and steps through it against a served
socket and the CPU daemon equal to the general path's."""
import os
import socket
import tempfile
import unittest

import numpy as np

import attnd
from attnd import _frames
from attnd import client as ac
from attnd.client import pb
from harness import DaemonTestCase


def _tensor(t, dtype, a):
    t.dtype = dtype
    t.shape.extend(a.shape)
    t.data = a.tobytes()


def _join(pieces):
    return b"".join(bytes(_frames._bytes_view(p)) for p in pieces)


def _answer(rid, epoch=0, out=None, lse=None, timing=(3, 200, 250), status=True):
    """A Step's Response as the daemon writes it (an empty Status on OK)."""
    r = pb.Response(id=rid, epoch=epoch)
    if status:
        r.status.SetInParent()
    if timing:
        r.timing.queued_us, r.timing.computing_us, r.timing.total_us = timing
    r.step.SetInParent()
    if out is not None:
        _tensor(r.step.out, pb.DTYPE_FP32 if out.dtype == np.float32 else pb.DTYPE_BF16, out)
    if lse is not None:
        _tensor(r.step.lse, pb.DTYPE_FP32, lse)
    return r


class FramesTest(unittest.TestCase):
    def test_step_frame_parses_as_protobuf(self):
        rng = np.random.default_rng(3)
        q = rng.integers(0, 1 << 16, (300, 4, 64), dtype=np.uint16)
        k = rng.integers(0, 1 << 16, (300, 2, 64), dtype=np.uint16)
        empty = np.zeros((0, 2, 64), dtype=np.uint16)
        req = pb.Request(id=77)
        req.step.layer = 3
        it = req.step.items.add()
        it.session, it.start, it.n = 5, 0, 300
        it.tokens.extend(range(300))
        req.step.want_lse = True
        pieces = _frames.step_frame(req, [("q", pb.DTYPE_BF16, q.shape, q),
                                          ("k", pb.DTYPE_BF16, k.shape, k),
                                          ("v", pb.DTYPE_BF16, empty.shape, empty)])
        # The tensors go as the caller's own memory, not as copies.
        self.assertTrue(any(isinstance(p, memoryview) and p.obj is q for p in pieces))
        frame = b"".join(bytes(memoryview(p)) for p in pieces)
        self.assertEqual(int.from_bytes(frame[:4], "big"), len(frame) - 4)
        got = pb.Request()
        got.ParseFromString(frame[4:])
        want = pb.Request()
        want.CopyFrom(req)
        for name, a in (("q", q), ("k", k), ("v", empty)):
            t = getattr(want.step, name)
            t.dtype = pb.DTYPE_BF16
            t.shape.extend(a.shape)
            t.data = a.tobytes()
        self.assertEqual(got, want)
        self.assertTrue(got.step.HasField("v"))

    def test_plan_step_frame_is_protobufs_message(self):
        """step_frame_plan writes a plan's Step (no protobuf message) as the same
        Request protobuf builds, zero fields left out, for ids, layers and plan
        ids across their varint and fixed64 ranges; the frame length it returns
        is the frame's."""
        self.assertTrue(_frames._FAST)
        rng = np.random.default_rng(4)
        q = rng.integers(0, 1 << 16, (2, 4, 64), dtype=np.uint16)
        k = rng.integers(0, 1 << 16, (2, 2, 64), dtype=np.uint16)
        for rid, layer, plan, lse, fp32 in [(1, 0, 1, False, False), (300, 79, (1 << 64) - 1, True, True),
                                            (0, 1, 0, False, True), ((1 << 40) + 3, 1 << 20, 12345, True, False)]:
            pieces, n = _frames.step_frame_plan(rid, layer, plan, lse, fp32,
                                                [("q", pb.DTYPE_BF16, q.shape, q),
                                                 ("k", pb.DTYPE_BF16, k.shape, k),
                                                 ("v", pb.DTYPE_BF16, k.shape, k)])
            frame = b"".join(bytes(memoryview(p)) for p in pieces)
            self.assertEqual(n, len(frame))
            self.assertEqual(int.from_bytes(frame[:4], "big"), len(frame) - 4)
            got = pb.Request()
            got.ParseFromString(frame[4:])
            want = pb.Request(id=rid)
            want.step.layer, want.step.plan = layer, plan
            want.step.want_lse, want.step.fp32_out = lse, fp32
            for name, a in (("q", q), ("k", k), ("v", k)):
                t = getattr(want.step, name)
                t.dtype = pb.DTYPE_BF16
                t.shape.extend(a.shape)
                t.data = a.tobytes()
            self.assertEqual(got, want)
            # Field for field what protobuf writes (its order aside).
            self.assertEqual(sorted(frame[4:]), sorted(want.SerializeToString()))

    def test_ref_step_frame_is_protobufs_message(self):
        """step_frame_refs (a Step by reference, no protobuf message) frames the
        same Request protobuf builds from the same TensorRefs."""
        refs = {}
        for i, name in enumerate(("q_ref", "k_ref", "v_ref", "out_ref", "lse_ref")):
            m = pb.TensorRef(buffer=3 + i, offset=256 * i * 1000, dtype=pb.DTYPE_BF16)
            m.shape.extend([5, 2 + i, 64])
            refs[name] = m
        for rid, layer, plan, lse in [(1, 0, 7, False), (1 << 33, 31, (1 << 64) - 1, True)]:
            names = ["q_ref", "k_ref", "v_ref", "out_ref"] + (["lse_ref"] if lse else [])
            frame = _frames.step_frame_refs(rid, layer, plan, lse, False,
                                            [(n, refs[n].SerializeToString()) for n in names])
            self.assertEqual(int.from_bytes(frame[:4], "big"), len(frame) - 4)
            got = pb.Request()
            got.ParseFromString(frame[4:])
            want = pb.Request(id=rid)
            want.step.layer, want.step.plan, want.step.want_lse = layer, plan, lse
            for n in names:
                getattr(want.step, n).CopyFrom(refs[n])
            self.assertEqual(got, want)
            self.assertEqual(len(frame) - 4, len(want.SerializeToString()))
        # With a done signal (field 14, after the refs).
        done = pb.DoneSignal(buffer=9, offset=4096, value=(1 << 40) + 3)
        names = ["q_ref", "k_ref", "v_ref", "out_ref"]
        frame = _frames.step_frame_refs(5, 2, 11, False, False,
                                        [(n, refs[n].SerializeToString()) for n in names]
                                        + [("done", done.SerializeToString())])
        got = pb.Request()
        got.ParseFromString(frame[4:])
        want = pb.Request(id=5)
        want.step.layer, want.step.plan = 2, 11
        for n in names:
            getattr(want.step, n).CopyFrom(refs[n])
        want.step.done.CopyFrom(done)
        self.assertEqual(got, want)
        self.assertEqual(frame[4:], want.SerializeToString())

    def test_cut_step_answer(self):
        rng = np.random.default_rng(4)
        out = rng.integers(0, 1 << 16, (1000, 4, 64), dtype=np.uint16)  # 512 KB
        lse = rng.standard_normal((1000, 4)).astype("<f4")  # 16 KB: under CUT_MIN, kept
        for big_lse in (False, True):
            lse_a = np.tile(lse, (5, 1)) if big_lse else lse
            resp = pb.Response(id=9, epoch=1234)
            resp.status.code = 0
            resp.timing.total_us = 55
            resp.step.out.dtype = pb.DTYPE_BF16
            resp.step.out.shape.extend(out.shape)
            resp.step.out.data = out.tobytes()
            resp.step.lse.dtype = pb.DTYPE_FP32
            resp.step.lse.shape.extend(lse_a.shape)
            resp.step.lse.data = lse_a.tobytes()
            body = bytearray(resp.SerializeToString())
            rest, spans = _frames.cut_step(body)
            self.assertEqual(set(spans), {"out", "lse"} if big_lse else {"out"})
            self.assertLess(len(rest), 1 << 16 if not big_lse else 200)
            small = pb.Response()
            small.ParseFromString(rest)
            self.assertEqual(small.step.out.data, b"")
            self.assertEqual(list(small.step.out.shape), list(out.shape))
            self.assertEqual(small.timing.total_us, 55)
            # Views, aligned in place; then the whole message back.
            off, n = _frames.tensor_view(body, spans["out"], 2)
            self.assertEqual(off % 2, 0)
            view = np.frombuffer(body, dtype="<u2", count=n, offset=off).reshape(out.shape)
            self.assertTrue(np.array_equal(view, out))
            if big_lse:
                off, n = _frames.tensor_view(body, spans["lse"], 4)
                self.assertEqual(off % 4, 0)
                self.assertTrue(np.array_equal(np.frombuffer(body, "<f4", n, off).reshape(lse_a.shape), lse_a))
            body2 = bytearray(resp.SerializeToString())
            rest2, spans2 = _frames.cut_step(body2)
            back = pb.Response()
            back.ParseFromString(rest2)
            _frames.put_back(back, body2, spans2)
            self.assertEqual(back, resp)

    def test_nothing_to_cut(self):
        resp = pb.Response(id=1)
        resp.step.out.data = b"x" * 100
        self.assertEqual(_frames.cut_step(bytearray(resp.SerializeToString())), (b"", {}))
        with self.assertRaises((ValueError, IndexError)):
            _frames.cut_step(bytearray(b"\x0a\xff\xff\x03"))  # a length past the end


class FastFramesTest(unittest.TestCase):
    def test_sig_frame_is_protobufs_message_per_signature(self):
        """step_frame_sig (heads cached per signature) writes step_frame_plan's
        bytes, protobuf's Request, for several signatures in turn and again; a
        changed signature changes the frame (no stale head)."""
        rng = np.random.default_rng(5)
        frames = set()
        cases = [((1, 4, 64), (1, 2, 64), 0, 1, False, False), ((3, 4, 64), (3, 2, 64), 7, 99, True, False),
                 ((1, 8, 128), (1, 2, 128), 20000, (1 << 64) - 1, False, True),
                 ((0, 4, 64), (2, 2, 64), 1, 5, True, True), ((1, 4, 64), (1, 2, 64), 0, 1, False, False)]
        for rid, (qs, ks, layer, plan, lse, fp32) in zip((1, 200, 1 << 20, 5, 1), cases):
            q = rng.integers(0, 1 << 16, qs, dtype=np.uint16)
            k = rng.integers(0, 1 << 16, ks, dtype=np.uint16)
            v = rng.integers(0, 1 << 16, ks, dtype=np.uint16)
            ts = [("q", pb.DTYPE_BF16, q.shape, q), ("k", pb.DTYPE_FP16, k.shape, k), ("v", pb.DTYPE_BF16, v.shape, v)]
            sig = tuple((n, dt, sh, a.nbytes) for n, dt, sh, a in ts)
            pieces, n = _frames.step_frame_sig(rid, layer, plan, lse, fp32, sig, [q, k, v])
            frame = _join(pieces)
            self.assertEqual(n, len(frame))
            self.assertEqual(int.from_bytes(frame[:4], "big"), len(frame) - 4)
            old, n_old = _frames.step_frame_plan(rid, layer, plan, lse, fp32, ts)
            self.assertEqual(frame, _join(old))
            got = pb.Request()
            got.ParseFromString(frame[4:])
            want = pb.Request(id=rid)
            want.step.layer, want.step.plan, want.step.want_lse, want.step.fp32_out = layer, plan, lse, fp32
            for (name, dt, _, a) in ts:
                _tensor(getattr(want.step, name), dt, a)
            self.assertEqual(got, want)
            self.assertTrue(any(p is q for p in pieces) or q.nbytes == 0)  # the caller's own memory
            frames.add(tuple(p for p in pieces if isinstance(p, bytes)))  # the heads: one set per signature
        self.assertEqual(len(frames), 4)  # the last case repeats the first (id and all)
        # A signature of only q; no tensors at all.
        q = np.ones((1, 4, 64), np.uint16)
        for ts in ([("q", pb.DTYPE_BF16, q.shape, q)], []):
            pieces, n = _frames.step_frame_sig(9, 2, 3, False, False, tuple((a, b, c, d.nbytes) for a, b, c, d in ts),
                                               [t[3] for t in ts])
            frame = _join(pieces)
            self.assertEqual(frame, _join(_frames.step_frame_plan(9, 2, 3, False, False, ts)[0]))
        with self.assertRaises(ValueError):  # a negative layer refused as step_frame_plan refuses it
            _frames.step_frame_sig(1, -1, 3, False, False, (), [])

    def test_parse_step_ok_equals_protobuf(self):
        """parse_step_ok reads OK answers (out bf16 or fp32, with and without
        lse, an epoch or none, no timing, empty out) as protobuf does, and
        refuses what it does not know: a status, other results, unknown or
        repeated fields, a truncated frame, data not the shape's bytes."""
        rng = np.random.default_rng(6)
        out16 = rng.integers(0, 1 << 16, (1, 4, 64), dtype=np.uint16)
        out32 = rng.standard_normal((2, 4, 64)).astype(np.float32)
        lse = rng.standard_normal((2, 4)).astype(np.float32)
        empty = np.zeros((0, 4, 64), np.uint16)
        for r in [_answer(5, 0, out16), _answer(1 << 40, 0x1234567890ABCDEF, out32, lse),
                  _answer(300, 7, out16, lse[:1], timing=None), _answer(2, 1, empty, status=False),
                  _answer(3, 0, None), _answer(6, 0, out16.reshape(1, 2, 128)),
                  _answer(8, 0, np.zeros((2, 4, 64), np.uint16), lse), _answer(8, 0, out32.reshape(4, 2, 64), lse),
                  _answer(8, 0, np.zeros((4, 2, 64), np.uint16), lse)] * 2:
            # Twice each (a layout seen is compared, not walked again), and answers
            # of one length but other shapes.
            body = bytearray(b"xy" + r.SerializeToString())
            got = _frames.parse_step_ok(body, 2, len(body))
            self.assertIsNotNone(got, r)
            rid, epoch, tspan, out, ls = got
            self.assertEqual((rid, epoch), (r.id, r.epoch))
            t = pb.Timing.FromString(bytes(body[tspan[0]:tspan[1]])) if tspan else pb.Timing()
            self.assertEqual(t, r.timing)
            for spec, name in ((out, "out"), (ls, "lse")):
                if not r.step.HasField(name):
                    self.assertIsNone(spec)
                    continue
                dt, shape, s, e = spec
                want = getattr(r.step, name)
                self.assertEqual((dt, shape, bytes(body[s:e])), (want.dtype, tuple(want.shape), want.data))
        bad = []
        r = _answer(5, 1, out16)
        r.status.code, r.status.message = 3, "bad layer"
        bad.append(r.SerializeToString())
        r = _answer(5, 1, out16)
        r.status.message = "ok but said"
        bad.append(r.SerializeToString())
        bad.append(pb.Response(id=5, plan=pb.PlanResponse(plan=3)).SerializeToString())
        good = _answer(5, 1, out16).SerializeToString()
        bad.append(good + b"\x28\x01")  # an unknown field
        bad.append(good + b"\x08\x06")  # the id twice
        bad.append(good[:-1])  # truncated
        r = _answer(5, 1, out16)
        r.step.out.shape[0] = 2  # data of another shape
        bad.append(r.SerializeToString())
        r = _answer(5, 1, out16)
        r.step.out.dtype = 42  # no known size
        bad.append(r.SerializeToString())
        for b in bad:
            self.assertIsNone(_frames.parse_step_ok(bytearray(b), 0, len(b)), b[:40])


def counted(c):
    """c with a count of the answers its fast path parsed by hand (c.hand)."""
    c.hand = 0
    ok_result = c._ok_result

    def count(*a):
        c.hand += 1
        return ok_result(*a)
    c._ok_result = count
    return c


class ServedClientTest(unittest.TestCase):
    """Client.step_recv's fast path against answers written here by hand: the
    same StepResult as the general path, the same errors, epoch handling and
    answers kept for other ids."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        path = os.path.join(self.tmp.name, "s.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(1)
        self.path = path

    def tearDown(self):
        self.srv.close()
        self.tmp.cleanup()

    def client(self, **kw):
        c = counted(ac.Client(self.path, timeout=10, **kw))
        self.peer, _ = self.srv.accept()
        self.addCleanup(self.peer.close)
        self.addCleanup(c.close)
        return c

    def answer(self, *resps):
        data = b""
        for r in resps:
            b = r.SerializeToString()
            data += len(b).to_bytes(4, "big") + b
        self.peer.sendall(data)

    def both(self, c, resp, **kw):
        """(fast, general) StepResults of one answer, each sent once."""
        out = []
        for fast in (True, False):
            c._fast_steps = fast
            self.answer(resp)
            out.append(c.step_recv(resp.id, **kw))
        c._fast_steps = True
        return out

    def assertSameResult(self, a, b):
        self.assertEqual((a.id, a.timing), (b.id, b.timing))
        for x, y in ((a.out, b.out), (a.lse, b.lse)):
            if y is None:
                self.assertIsNone(x)
                continue
            self.assertEqual((x.dtype, x.shape, x.flags.writeable), (y.dtype, y.shape, y.flags.writeable))
            self.assertEqual(x.tobytes(), y.tobytes())

    def test_fast_equals_general(self):
        rng = np.random.default_rng(7)
        out16 = rng.integers(0, 1 << 16, (1, 4, 64), dtype=np.uint16)
        out32 = rng.standard_normal((1, 4, 64)).astype(np.float32)
        lse = rng.standard_normal((1, 4)).astype(np.float32)
        for bf16 in ("auto", "uint16", "float32"):
            c = self.client(bf16=bf16)
            for r in (_answer(7, 11, out16), _answer(9, 11, out32, lse), _answer(10, 11, out16, lse, timing=None),
                      _answer(12, 11, None)):
                a, b = self.both(c, r)
                self.assertSameResult(a, b)
            self.assertEqual((c.epoch, c.hand), (11, 4))
            c.close()
            self.peer.close()

    def test_errors_epochs_and_other_ids(self):
        out16 = np.arange(256, dtype=np.uint16).reshape(1, 4, 64)
        c = self.client()
        # A non-OK answer: the typed error, as the general path raises it.
        r = _answer(4, 5, None)
        r.status.code, r.status.message = 9, "plan ended"
        for fast in (True, False):
            c._fast_steps = fast
            self.answer(r)
            with self.assertRaises(attnd.FailedPrecondition) as cm:
                c.step_recv(4)
            self.assertEqual((cm.exception.code, c.epoch, c.hand), (9, 5, 0))
        c._fast_steps = True
        # Answers to other ids first: kept, then found by their own step_recv.
        self.answer(_answer(21, 5, out16 + 1), _answer(22, 5, out16 + 2), _answer(20, 5, out16))
        self.assertEqual(c.step_recv(20).out.view(np.uint16)[0, 0, 0], 0)
        self.assertEqual(c.step_recv(22).out.view(np.uint16)[0, 0, 0], 2)
        self.assertEqual(c.step_recv(21).out.view(np.uint16)[0, 0, 0], 1)
        self.assertEqual(c._pending, {})
        # An epoch change on an OK answer: raised once (the answer consumed), then seen.
        self.answer(_answer(30, 6, out16))
        with self.assertRaises(attnd.EpochChanged) as cm:
            c.step_recv(30)
        self.assertEqual((cm.exception.old, cm.exception.new, c.epoch, c.epoch_changed), (5, 6, 6, True))
        self.answer(_answer(31, 6, out16))
        self.assertEqual(c.step_recv(31).id, 31)
        seen = []
        c.on_epoch_change = lambda o, n: seen.append((o, n))
        self.answer(_answer(32, 8, out16))
        self.assertEqual(c.step_recv(32).id, 32)
        self.assertEqual(seen, [(6, 8)])


class FastStepDaemonTest(DaemonTestCase):
    def test_fast_step_equals_general_step(self):
        """Steps of a plan through the CPU daemon: the fast path's StepResults
        (numpy bf16 bits, fp16-free float32 rounding, fp32 out, lse) equal the
        general path's, step for step (each layer stepped twice: a rewrite)."""
        rng = np.random.default_rng(8)
        with counted(self.daemon.client()) as c, self.engine_needed():
            m = c.model
            sid, _ = c.open_session()
            plan = c.plan([attnd.Item(sid, 0, 3, tokens=[1, 2, 3])])
            for layer in range(m.layers):
                q = ac.f32_to_bf16(rng.standard_normal((3, m.q_heads, m.head_dim)).astype(np.float32))
                k = rng.standard_normal((3, m.kv_heads, m.head_dim)).astype(np.float32)  # rounded by the client
                v = ac.f32_to_bf16(rng.standard_normal((3, m.kv_heads, m.head_dim)).astype(np.float32))
                for kw in ({}, {"want_lse": True}, {"fp32_out": True, "want_lse": True}):
                    res = []
                    for fast in (True, False):
                        c._fast_steps = fast
                        res.append(c.step(layer, q, k, v, plan=plan, **kw))
                        rid = c.step_send(layer, q, k, v, plan=plan, **kw)
                        res.append(c.step_recv(rid))
                    c._fast_steps = True
                    for r in res[1:]:
                        for x, y in ((r.out, res[0].out), (r.lse, res[0].lse)):
                            self.assertEqual(x is None, y is None)
                            if y is not None:
                                self.assertEqual((x.dtype, x.shape), (y.dtype, y.shape))
                                self.assertEqual(x.tobytes(), y.tobytes())
                    self.assertEqual(res[0].lse is not None, bool(kw))
            self.assertEqual(c.hand, 2 * 3 * m.layers)  # every fast step's answer parsed by hand
            # Bad input: the same error either way, nothing sent.
            for fast in (True, False):
                c._fast_steps = fast
                with self.assertRaises(ValueError):
                    c.step(0, np.zeros((1, m.q_heads), np.uint16), plan=plan)


if __name__ == "__main__":
    unittest.main()
