"""The Python client's step frames (attnd/_frames.py), without a daemon: a Step
framed by hand parses as the same message protobuf would build, tensor bytes
taken from the caller's arrays; a Step answer's large out/lse data are cut out
of the message and come back as aligned views of the frame, and put back for
the plain recv() they equal protobuf's own parse."""
import unittest

import numpy as np

from attnd import _frames
from attnd.client import pb


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


if __name__ == "__main__":
    unittest.main()
