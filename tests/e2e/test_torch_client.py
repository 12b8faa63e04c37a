"""torch tensors through the Python client (client/python/attnd/client.py): bf16 in,
bf16 out, no numpy round trip; the same bytes as the numpy path, so the outputs are
identical; float32 rounded by torch as the client's own rounding does (nearest even);
outputs land on the device of the inputs. Skipped where torch is not installed."""
import unittest

import numpy as np

import attnd
from harness import DaemonTestCase

try:
    import torch
except ImportError:  # optional dependency
    torch = None


@unittest.skipIf(torch is None, "torch is not installed")
class TorchClientTest(DaemonTestCase):
    def test_bf16_in_bf16_out_same_as_numpy(self):
        with self.daemon.client() as c:
            m = c.model
            g = torch.Generator().manual_seed(5)
            n = 6
            q = torch.randn(n, m.q_heads, m.head_dim, generator=g).to(torch.bfloat16)
            k = torch.randn(n, m.kv_heads, m.head_dim, generator=g).to(torch.bfloat16)
            v = torch.randn(n, m.kv_heads, m.head_dim, generator=g).to(torch.bfloat16)
            a, _ = c.open_session()
            b, _ = c.open_session()
            toks = list(range(n))
            rt = c.step(0, q, k, v, items=[attnd.Item(a, 0, n, tokens=toks)], want_lse=True)
            self.assertIsInstance(rt.out, torch.Tensor)
            self.assertEqual(rt.out.dtype, torch.bfloat16)
            self.assertEqual(tuple(rt.out.shape), (n, m.q_heads, m.head_dim))
            self.assertEqual(rt.lse.dtype, torch.float32)
            bits = [x.view(torch.int16).numpy().view(np.uint16) for x in (q, k, v)]
            rn = c.step(0, *bits, items=[attnd.Item(b, 0, n, tokens=toks)], want_lse=True)
            out_n = np.ascontiguousarray(rn.out).view(np.uint16)
            self.assertTrue(np.array_equal(rt.out.view(torch.int16).numpy().view(np.uint16), out_n))
            self.assertTrue(np.array_equal(rt.lse.numpy(), rn.lse))
            self.assertTrue(torch.isfinite(rt.out.float()).all())

    def test_float32_rounds_like_the_client(self):
        with self.daemon.client() as c:
            m = c.model
            x = torch.randn(3, m.kv_heads, m.head_dim, dtype=torch.float32)
            dt, shape, data = c._wire(x, "k")
            self.assertEqual(shape, (3, m.kv_heads, m.head_dim))
            want = attnd.client.f32_to_bf16(x.numpy()).astype("<u2").tobytes()
            self.assertEqual(bytes(memoryview(data)), want)  # a buffer: sent as it lies

    def test_pipelined_torch_and_errors(self):
        with self.daemon.client() as c:
            m = c.model
            sid, _ = c.open_session()
            q = torch.zeros(1, m.q_heads, m.head_dim, dtype=torch.bfloat16)
            kv = torch.zeros(1, m.kv_heads, m.head_dim, dtype=torch.bfloat16)
            plan = c.plan([attnd.Item(sid, 0, 1, tokens=[1])])
            ids = [c.step_send(layer, q, kv, kv, plan=plan) for layer in range(m.layers)]
            outs = [c.step_recv(i, as_torch=True).out for i in ids]
            self.assertTrue(all(o.dtype == torch.bfloat16 for o in outs))
            bad = q.clone()
            bad[0, 0, 0] = float("nan")
            with self.assertRaises(attnd.InvalidArgument):
                c.step(0, bad, kv, kv, items=[attnd.Item(sid, 1, 1, tokens=[2])])
            with self.assertRaises(ValueError):
                c.step_send(0, q[0], kv, kv, items=[attnd.Item(sid, 1, 1, tokens=[2])])

    def test_fast_path_equals_general_path(self):
        """torch CPU tensors through Client's fast path (a Step of a plan) and its
        general path: the same torch outputs, for contiguous bf16, a strided
        view and float32 with grad (rounded by torch), blocking and pipelined."""
        with self.daemon.client() as c:
            m = c.model
            sid, _ = c.open_session()
            plan = c.plan([attnd.Item(sid, 0, 2, tokens=[1, 2])])
            g = torch.Generator().manual_seed(7)
            q = torch.randn(2, m.q_heads, m.head_dim, generator=g).to(torch.bfloat16)
            k = torch.randn(m.kv_heads, 2, m.head_dim, generator=g).to(torch.bfloat16).transpose(0, 1)
            v = torch.randn(2, m.kv_heads, m.head_dim, generator=g).requires_grad_()
            res = []
            for fast in (True, False):
                c._fast_steps = fast
                res.append(c.step(0, q, k, v, plan=plan, want_lse=True))
                res.append(c.step_recv(c.step_send(0, q, k, v, plan=plan, want_lse=True), as_torch=True))
            c._fast_steps = True
            for r in res:
                self.assertIsInstance(r.out, torch.Tensor)
                self.assertEqual((r.out.dtype, r.lse.dtype), (torch.bfloat16, torch.float32))
                self.assertEqual(tuple(r.out.shape), (2, m.q_heads, m.head_dim))
                self.assertTrue(torch.equal(r.out.view(torch.int16), res[0].out.view(torch.int16)))
                self.assertTrue(torch.equal(r.lse, res[0].lse))


if __name__ == "__main__":
    unittest.main()
