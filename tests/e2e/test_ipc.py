"""Same-host zero-copy (docs/protocol.md): RegisterBuffer, ReleaseBuffer and steps
whose tensors are (buffer, offset) refs instead of bytes.

Everywhere (CI has no GPU): the refusals that need no device. The CPU backend
answers RegisterBuffer with FAILED_PRECONDITION, so does --ipc false; a handle
that is not 64 bytes, a step naming a buffer nobody registered, a step mixing
bytes and refs, a done signal on a step with bytes, a release of an unknown
buffer are INVALID_ARGUMENT, and a
refused step changes nothing (the session still steps from 0).

On the CUDA backend with torch on the daemon's GPU (the lead's GPU round:
scripts/dev/gpu-e2e.sh runs this module with ATTND_E2E_BACKEND=cuda): the same
steps over the IPC path and the bytes path give bit-equal outputs (same kernels),
both within the bf16 bound of the float64 reference; outputs appear in the
client's own tensors (poisoned with NaN first); a bad offset, a misaligned one,
a released buffer, another connection's buffer and a NaN in q are refused and
change nothing, and so is a registration larger than its allocation; every
layer's step pipelined by reference into staging tensors registered once gives
the bytes path's outputs, and a NaN in a later item's k names that item; a stream
that waits for a step's done signal reads its outputs before the response is read,
and a refused step's signal is raised by the client when the error arrives; attnd.hf's
runner handing each layer's output on at its done signal gives the blocking runner's
outputs bit for bit and reports a failed step at the next one."""
import os
import unittest

import numpy as np

import attnd
import reference
import tolerance
from attnd import ipc as attnd_ipc
from attnd.client import pb
from harness import BACKEND, DaemonTestCase

try:
    import torch
except ImportError:  # optional dependency
    torch = None

HANDLE = bytes(range(64))  # 64 bytes that no driver would open


def ref_step(layer, items, **refs):
    """A Step whose tensors are refs: refs maps 'q'/'k'/... to (buffer, offset, dtype, shape)."""
    req = pb.Request()
    st = req.step
    st.layer = layer
    for it in items:
        it.to_pb(st.items.add())
    for name, (buf, off, dt, shape) in refs.items():
        r = getattr(st, name + "_ref")
        r.buffer, r.offset, r.dtype = buf, off, dt
        r.shape.extend(shape)
    return req


def with_bytes(c, req, **arrays):
    """Sets req.step's q, k, v (the names given) to tensors with bytes, as c sends them."""
    for name, a in arrays.items():
        dt, shape, data = c._wire(a, name)
        t = getattr(req.step, name)
        t.dtype = dt
        t.shape.extend(shape)
        t.data = bytes(memoryview(data))


def register_req(handle=HANDLE, size=1 << 20, uuid="GPU-00000000-0000-0000-0000-000000000000"):
    req = pb.Request()
    req.register_buffer.cuda_ipc_handle = handle
    req.register_buffer.size = size
    req.register_buffer.device_uuid = uuid
    return req


class RefusalTest(DaemonTestCase):
    def test_health_names_the_device(self):
        with self.daemon.client() as c:
            u = c.health().device_uuid
        if BACKEND == "cpu":
            self.assertEqual(u, "")
        else:
            self.assertTrue(u.startswith("GPU-"), u)

    @unittest.skipIf(BACKEND != "cpu", "the CPU backend's answer")
    def test_register_on_the_cpu_backend_is_failed_precondition(self):
        with self.daemon.client() as c:
            with self.assertRaises(attnd.FailedPrecondition) as e:
                c.call(register_req())
            self.assertIn("cpu backend", e.exception.message)
        # TCP to loopback is on this host: the same answer, from the backend.
        with attnd.Client(f"127.0.0.1:{self.daemon.tcp_port}", timeout=10) as c:
            with self.assertRaises(attnd.FailedPrecondition) as e:
                c.call(register_req())
            self.assertIn("cpu backend", e.exception.message)

    def test_a_handle_of_the_wrong_size_is_invalid(self):
        with self.daemon.client() as c:
            with self.assertRaises(attnd.InvalidArgument) as e:
                c.call(register_req(handle=b"x" * 10))
            self.assertIn("64", e.exception.message)
            with self.assertRaises(attnd.InvalidArgument):
                c.call(register_req(size=0))

    def test_release_of_an_unknown_buffer_is_invalid(self):
        with self.daemon.client() as c:
            with self.assertRaises(attnd.InvalidArgument) as e:
                c.release_buffer(0x1234)
            self.assertIn("not registered", e.exception.message)

    def test_a_step_naming_an_unknown_buffer_changes_nothing(self):
        with self.daemon.client() as c:
            m = c.model
            n = 3
            s, _ = c.open_session()
            it = [attnd.Item(s, 0, n, tokens=[1, 2, 3])]
            bf = pb.DTYPE_BF16
            req = ref_step(0, it, q=(77, 0, bf, [n, m.q_heads, m.head_dim]),
                           k=(77, 4096, bf, [n, m.kv_heads, m.head_dim]),
                           v=(77, 8192, bf, [n, m.kv_heads, m.head_dim]),
                           out=(77, 16384, bf, [n, m.q_heads, m.head_dim]))
            with self.assertRaises(attnd.InvalidArgument) as e:
                c.call(req)
            self.assertIn("not registered", e.exception.message)
            self.assertEqual([x.len for x in c.list_sessions() if x.session == s], [0])
            # Bytes and refs in one step: refused the same way.
            rng = np.random.default_rng(1)
            q = rng.standard_normal((n, m.q_heads, m.head_dim), dtype=np.float32)
            kv = rng.standard_normal((n, m.kv_heads, m.head_dim), dtype=np.float32)
            req = pb.Request()
            req.step.CopyFrom(ref_step(0, it, out=(77, 0, bf, [n, m.q_heads, m.head_dim])).step)
            with_bytes(c, req, q=q, k=kv, v=kv)
            with self.assertRaises(attnd.InvalidArgument) as e:
                c.call(req)
            self.assertIn("all bytes or all refs", e.exception.message)
            # A done signal on a step with bytes: refused, naming it.
            req = pb.Request()
            req.step.CopyFrom(ref_step(0, it).step)
            with_bytes(c, req, q=q, k=kv, v=kv)
            req.step.done.buffer, req.step.done.offset, req.step.done.value = 77, 0, 1
            with self.assertRaises(attnd.InvalidArgument) as e:
                c.call(req)
            self.assertIn("done is for steps by reference", e.exception.message)
            # Nothing changed: the session steps from position 0.
            out = c.step(0, q, kv, kv, items=it).out
            self.assertEqual(out.shape, (n, m.q_heads, m.head_dim))
            self.assertEqual([x.len for x in c.list_sessions() if x.session == s], [n])


class IpcOffTest(DaemonTestCase):
    extra_args = ("--ipc", "false")

    def test_register_with_ipc_off_is_failed_precondition(self):
        with self.daemon.client() as c:
            with self.assertRaises(attnd.FailedPrecondition) as e:
                c.call(register_req())
            self.assertIn("--ipc false", e.exception.message)


def _gpu_ready():
    return BACKEND == "cuda" and torch is not None and torch.cuda.is_available()


@unittest.skipUnless(_gpu_ready(), "needs the CUDA backend and torch on a GPU")
class GpuIpcTest(DaemonTestCase):
    def setUp(self):
        self.dev = torch.device("cuda", int(os.environ.get("ATTND_E2E_CUDA_DEVICE", "0")))

    def rand(self, g, *shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(self.dev)

    def test_ipc_and_bytes_agree_bit_for_bit_and_match_the_reference(self):
        with self.daemon.client(ipc=True) as ci, self.daemon.client(ipc=False) as cb:
            m = ci.model
            g = torch.Generator().manual_seed(11)
            a, _ = ci.open_session()
            b, _ = cb.open_session()
            ref = reference.RefSession(m)
            worst = 0.0
            start = 0
            for n in (37, 1, 1, 5):  # a prefill, two decodes, a short prefill
                toks = list(range(start, start + n))
                for layer in range(m.layers):
                    q = self.rand(g, n, m.q_heads, m.head_dim)
                    k = self.rand(g, n, m.kv_heads, m.head_dim)
                    v = self.rand(g, n, m.kv_heads, m.head_dim)
                    ri = ci.step(layer, q, k, v, items=[attnd.Item(a, start, n, tokens=toks)],
                                 want_lse=True)
                    rb = cb.step(layer, q, k, v, items=[attnd.Item(b, start, n, tokens=toks)],
                                 want_lse=True)
                    self.assertTrue(ri.out.is_cuda)  # the IPC path: the client's own tensor
                    self.assertEqual(ri.out.device, self.dev)
                    self.assertTrue(torch.equal(ri.out.cpu().view(torch.int16),
                                                rb.out.cpu().view(torch.int16)))
                    self.assertTrue(torch.equal(ri.lse.cpu(), rb.lse.cpu()))
                    f = lambda t: t.float().cpu().numpy()
                    want = ref.step(layer, start, f(q), f(k), f(v))
                    worst = max(worst, reference.rel_l2(f(ri.out), want))
                start += n
            print(f"ipc vs reference: worst rel L2 {worst:.2e}")
            self.assertLess(worst, tolerance.REL_L2["bf16"])

    def test_outputs_land_in_the_clients_tensors(self):
        with self.daemon.client(ipc=True) as c:
            m = c.model
            g = torch.Generator().manual_seed(3)
            n = 4
            s, _ = c.open_session()
            q = self.rand(g, n, m.q_heads, m.head_dim)
            kv = self.rand(g, n, m.kv_heads, m.head_dim)
            out = torch.full((n, m.q_heads, m.head_dim), float("nan"), dtype=torch.float32,
                             device=self.dev)
            lse = torch.full((n, m.q_heads), float("nan"), dtype=torch.float32, device=self.dev)
            rid, o, l = attnd_ipc.step_send(c, 0, q, kv, kv, [attnd.Item(s, 0, n, tokens=[9] * n)],
                                            0, True, True, out=out, lse=lse)
            resp = c.recv(rid)
            self.assertFalse(resp.step.HasField("out"))  # no bytes came back
            self.assertIs(o, out)
            self.assertFalse(torch.isnan(out).any().item())
            self.assertFalse(torch.isnan(lse).any().item())

    def test_the_done_signal_orders_the_clients_stream(self):
        # The client's stream waits for the done signal right after the send and
        # copies out behind the wait, before the response is read: the copy holds
        # the step's outputs (out was NaN before), and the word holds the value.
        # Then a step refused for a NaN in k: the error's arrival raises the
        # signal on the client's side, so the waiting stream goes on.
        with self.daemon.client(ipc=True) as c:
            m = c.model
            g = torch.Generator().manual_seed(7)
            sig = attnd_ipc.DoneSignal(c, self.dev)
            s, _ = c.open_session()
            n = 64
            for start in (0, n):
                q = self.rand(g, n, m.q_heads, m.head_dim)
                kv = self.rand(g, n, m.kv_heads, m.head_dim)
                out = torch.full((n, m.q_heads, m.head_dim), float("nan"), dtype=torch.bfloat16,
                                 device=self.dev)
                rid = c.step_send(0, q, kv, kv, items=[attnd.Item(s, start, n, tokens=[3] * n)],
                                  out=out, done=sig)
                sig.wait()
                early = out.clone()  # enqueued behind the wait, before any answer
                r = c.step_recv(rid)
                torch.cuda.synchronize()
                self.assertIs(r.out, out)
                self.assertFalse(torch.isnan(early).any().item())
                self.assertTrue(torch.equal(early.view(torch.int16), out.view(torch.int16)))
                self.assertEqual(sig.reached(), sig.value)
            kv[1, 0, 0] = float("nan")
            torch.cuda.synchronize()
            rid = c.step_send(0, q, kv, kv, items=[attnd.Item(s, 2 * n, n, tokens=[3] * n)],
                              out=out, done=sig)
            sig.wait()
            with self.assertRaises(attnd.InvalidArgument):
                c.step_recv(rid)
            torch.cuda.synchronize()  # released by the client: no hang
            self.assertEqual(sig.reached(), sig.value)
            self.assertEqual([x.len for x in c.list_sessions() if x.session == s], [2 * n])
            # Misaligned or outside its buffer: refused, changing nothing.
            for off in (sig.offset + 4, 1 << 40):
                req = ref_step(0, [attnd.Item(s, 2 * n, 1, tokens=[3])])
                qq, kk = q[:1].contiguous(), kv[2:3].contiguous()
                oo = out[:1].contiguous()
                for name, t in (("q", qq), ("k", kk), ("v", kk), ("out", oo)):
                    c.ipc.ref(t, getattr(req.step, name + "_ref"))
                req.step.done.buffer, req.step.done.offset, req.step.done.value = \
                    sig.buffer, off, sig.value + 1
                torch.cuda.synchronize()
                with self.assertRaises(attnd.InvalidArgument) as e:
                    c.call(req)
                self.assertIn("done", e.exception.message)
            self.assertEqual([x.len for x in c.list_sessions() if x.session == s], [2 * n])

    def test_overlapped_runner_matches_the_blocking_one(self):
        # attnd.hf's runner with a done signal per layer (AttndAdapter(overlap=True))
        # against the blocking runner, two decode tokens through every layer over
        # the same inputs: every layer's output is handed on before its answer is
        # read, and the outputs are bit-equal. Then a NaN in the overlapped runner's
        # k at layer 1: the failure surfaces at the next step as RuntimeError, and
        # the stream that waited for layer 1's signal goes on (released).
        import attnd.hf

        with self.daemon.client(ipc=True) as ca, self.daemon.client(ipc=True) as cb:
            m = ca.model
            g = torch.Generator().manual_seed(13)
            ra, rb = attnd.hf.AttndRunner(ca), attnd.hf.AttndRunner(cb)
            sa, sb = ra.sequences(), rb.sequences()
            sigs = [attnd_ipc.DoneSignal(ca, self.dev) for _ in range(m.layers)]
            rows = 2
            outs = {l: torch.empty(rows, m.q_heads, m.head_dim, dtype=torch.bfloat16,
                                   device=self.dev) for l in range(m.layers)}
            for t in outs.values():
                ca.ipc.keep(t)
            for start, n in ((0, 5), (5, 1), (6, 1)):
                toks = [[start + i for i in range(n)] for _ in range(rows)]
                for layer in range(m.layers):
                    q = self.rand(g, rows * n, m.q_heads, m.head_dim)
                    kv = self.rand(g, rows * n, m.kv_heads, m.head_dim)
                    out = outs[layer] if n == 1 else None
                    oa = ra.step(sa, layer, q, kv, kv, start, toks, out=out, done=sigs[layer])
                    early = oa.clone()  # behind the wait, before the answer was read
                    ob = rb.step(sb, layer, q, kv, kv, start, toks)
                    torch.cuda.synchronize()
                    self.assertTrue(torch.equal(early.view(torch.int16), ob.view(torch.int16)))
                ra.drain()
            self.assertEqual(ra.steps, rb.steps)
            q = self.rand(g, rows, m.q_heads, m.head_dim)
            kv = self.rand(g, rows, m.kv_heads, m.head_dim)
            bad = kv.clone()
            bad[1, 0, 0] = float("nan")
            try:
                toks = [[7] for _ in range(rows)]
                ra.step(sa, 0, q, kv, kv, 7, toks, out=outs[0], done=sigs[0])
                ra.step(sa, 1, q, bad, bad, 7, toks, out=outs[1], done=sigs[1])
                # The next step (the next token's first layer, a new plan) reads
                # layer 1's answer first and fails, sending nothing.
                with self.assertRaises(RuntimeError) as e:
                    ra.step(sa, 0, q, kv, kv, 8, [[8] for _ in range(rows)], out=outs[0],
                            done=sigs[0])
                self.assertIn("layer 1", str(e.exception))
                torch.cuda.synchronize()  # layer 1's signal was released: no hang
                self.assertEqual(sigs[1].reached(), sigs[1].value)
                self.assertEqual(ra._inflight, [])
            finally:  # whatever failed above, no stream of this process stays waiting
                for sg in sigs:
                    sg.release(sg.value)

    def test_pipelined_steps_by_reference_into_kept_staging(self):
        # Every layer's step sent before any answer is read (step_send/step_recv),
        # by reference into per-layer staging tensors registered once (keep()),
        # two sessions per step: the same bytes as the bytes path. Then a NaN in
        # the second item's k row fails that step naming item 1 and k (the check's
        # one kernel maps rows of q, k and v back to their tensor), changing nothing.
        with self.daemon.client(ipc=True) as ci, self.daemon.client(ipc=False) as cb:
            m = ci.model
            g = torch.Generator().manual_seed(5)
            sa = [ci.open_session()[0] for _ in range(2)]
            sb = [cb.open_session()[0] for _ in range(2)]
            n = 3
            stage = {}
            for layer in range(m.layers):
                stage[layer] = (torch.empty(2 * n, m.q_heads, m.head_dim, dtype=torch.bfloat16,
                                            device=self.dev),
                                torch.empty(2 * n, m.kv_heads, m.head_dim, dtype=torch.bfloat16,
                                            device=self.dev),
                                torch.empty(2 * n, m.q_heads, m.head_dim, dtype=torch.bfloat16,
                                            device=self.dev))
                for t in stage[layer]:
                    ci.ipc.keep(t)
            for start in (0, n):
                toks = list(range(start, start + n))
                ia = [attnd.Item(s, start, n, tokens=toks) for s in sa]
                ib = [attnd.Item(s, start, n, tokens=toks) for s in sb]
                ids_i, ids_b = [], []
                for layer in range(m.layers):
                    q, kv, out = stage[layer]
                    q.copy_(self.rand(g, 2 * n, m.q_heads, m.head_dim))
                    kv.copy_(self.rand(g, 2 * n, m.kv_heads, m.head_dim))
                    ids_i.append(ci.step_send(layer, q, kv, kv, items=ia, out=out))
                    ids_b.append(cb.step_send(layer, q, kv, kv, items=ib))
                for layer in range(m.layers):
                    ri = ci.step_recv(ids_i[layer])
                    rb = cb.step_recv(ids_b[layer], as_torch=True)
                    self.assertIs(ri.out, stage[layer][2])
                    self.assertTrue(torch.equal(ri.out.cpu().view(torch.int16),
                                                rb.out.cpu().view(torch.int16)))
            q, kv, out = stage[0]
            kv[n + 1, 0, 3] = float("nan")  # item 1's second row
            torch.cuda.synchronize()
            toks = list(range(2 * n, 3 * n))
            with self.assertRaises(attnd.InvalidArgument) as e:
                ci.step(0, q, kv, kv, items=[attnd.Item(s, 2 * n, n, tokens=toks) for s in sa],
                        out=out)
            self.assertIn("item 1: k", e.exception.message)
            self.assertEqual(sorted(x.len for x in ci.list_sessions() if x.session in sa),
                             [2 * n, 2 * n])

    def test_bad_refs_are_refused_and_change_nothing(self):
        with self.daemon.client(ipc=True) as c, self.daemon.client(ipc=True) as other:
            m = c.model
            n = 2
            s, _ = c.open_session()
            it = [attnd.Item(s, 0, n, tokens=[1, 2])]
            big = torch.zeros(1 << 20, dtype=torch.bfloat16, device=self.dev)
            ref = pb.TensorRef()
            c.ipc.ref(big, ref)
            buf, base = ref.buffer, ref.offset
            _, asize, handle = attnd_ipc._Driver.allocation(big.data_ptr())
            bf = pb.DTYPE_BF16
            qs, kvs = [n, m.q_heads, m.head_dim], [n, m.kv_heads, m.head_dim]

            def refs(qoff):
                return dict(q=(buf, qoff, bf, qs), k=(buf, base + 65536, bf, kvs),
                            v=(buf, base + 131072, bf, kvs), out=(buf, base + 196608, bf, qs))

            for off, why in ((base + 2, "multiples of 256"), (asize + 4096, "do not fit")):
                with self.assertRaises(attnd.InvalidArgument) as e:
                    c.call(ref_step(0, it, **refs(off)))
                self.assertIn(why, e.exception.message)
            # Another connection's buffer: refused by name.
            so, _ = other.open_session()
            with self.assertRaises(attnd.PermissionDenied):
                other.call(ref_step(0, [attnd.Item(so, 0, n, tokens=[1, 2])], **refs(base)))
            # A NaN in q: refused before anything is written, naming the item.
            big[5] = float("nan")  # q's first row
            torch.cuda.synchronize()
            with self.assertRaises(attnd.InvalidArgument) as e:
                c.call(ref_step(0, it, **refs(base)))
            self.assertIn("item 0", e.exception.message)
            self.assertIn("NaN", e.exception.message)
            big.zero_()
            torch.cuda.synchronize()
            # Registering more bytes than the allocation holds: refused.
            with self.assertRaises(attnd.InvalidArgument) as e:
                c.register_buffer(handle, asize + 1, attnd_ipc.device_uuid(self.dev))
            self.assertIn("more than the allocation", e.exception.message)
            # Released: refused.
            c.release_buffer(buf)
            with self.assertRaises(attnd.InvalidArgument):
                c.call(ref_step(0, it, **refs(base)))
            self.assertEqual([x.len for x in c.list_sessions() if x.session == s], [0])


if __name__ == "__main__":
    unittest.main()
