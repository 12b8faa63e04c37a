"""Sessions through prefill and many decode steps on the real daemon, compared
with the independent numpy reference (reference.py). Skips with a message while
the engine is the placeholder that answers UNIMPLEMENTED."""
import copy
import json
import os
import tempfile

import numpy as np

import attnd
from harness import BACKEND, DaemonTestCase
from reference import RefSession, rel_l2
import tolerance

# Prefix hit vs full compute, fp32 output (see test_prefix_cache_hit_gives_the_same_outputs).
PREFIX_HIT_TOL = tolerance.PREFIX_HIT

TOL = tolerance.REL_L2["bf16"]  # bf16 cache, relative L2 per item (docs/numerics.md)


class SessionsTest(DaemonTestCase):
    def setUp(self):
        self.c = self.daemon.client()
        self.m = self.c.model

    def tearDown(self):
        self.c.close()

    def rand(self, rng, rows, heads):
        return rng.standard_normal((rows, heads, self.m.head_dim)).astype(np.float32)

    def run_step(self, plan_or_items, items, refs, rng, worst, inline=False):
        """One step through every layer; checks each item's output against its RefSession."""
        m = self.m
        rows = sum(it.n for it in items)
        for layer in range(m.layers):
            q = self.rand(rng, rows, m.q_heads)
            k = self.rand(rng, rows, m.kv_heads)
            v = self.rand(rng, rows, m.kv_heads)
            if inline:
                res = self.c.step(layer, q, k, v, items=items)
            else:
                res = self.c.step(layer, q, k, v, plan=plan_or_items)
            out = attnd.bf16_to_f32(res.out) if res.out.dtype != np.float16 else res.out.astype(np.float32)
            self.assertEqual(out.shape, (rows, m.q_heads, m.head_dim))
            self.assertTrue(np.isfinite(out).all())
            r0 = 0
            for it in items:
                ref = refs[it.session].step(layer, it.start, q[r0:r0 + it.n], k[r0:r0 + it.n], v[r0:r0 + it.n])
                err = rel_l2(out[r0:r0 + it.n], ref)
                worst[0] = max(worst[0], err)
                self.assertLess(err, TOL, f"layer {layer} session {it.session:x} start {it.start}")
                r0 += it.n

    def open(self, rng, n):
        tokens = rng.integers(0, 1 << 20, size=n).tolist()
        sid, cached = self.c.open_session(tokens, salt=rng.bytes(8))
        self.assertEqual(cached, 0)  # a fresh salt never shares
        return sid, tokens

    def test_prefill_then_decode_matches_reference(self):
        rng = np.random.default_rng(11)
        with self.engine_needed("OpenSession"):
            prompts = [37, 16, 5]
            sessions = [self.open(rng, n) for n in prompts]
        refs = {sid: RefSession(self.m) for sid, _ in sessions}
        worst = [0.0]
        items = [attnd.Item(sid, 0, len(t), tokens=t) for sid, t in sessions]
        with self.engine_needed("Plan/Step"):
            plan = self.c.plan(items)
        self.run_step(plan, items, refs, rng, worst)
        steps = 40
        for t in range(steps):
            items = [attnd.Item(sid, len(toks) + t, 1, tokens=[int(rng.integers(0, 1 << 20))])
                     for sid, toks in sessions]
            self.run_step(self.c.plan(items), items, refs, rng, worst)
        listed = {s.session: s for s in self.c.list_sessions()}
        for (sid, toks) in sessions:
            self.assertIn(sid, listed)
            self.assertEqual(listed[sid].len, len(toks) + steps)
            self.c.close_session(sid)
        print(f"prefill {prompts} + {steps} decode steps: worst rel L2 {worst[0]:.2e} (tol {TOL})")

    def test_inline_items_and_pipelined_layers(self):
        rng = np.random.default_rng(12)
        with self.engine_needed("OpenSession"):
            sid, toks = self.open(rng, 20)
        ref = RefSession(self.m)
        worst = [0.0]
        items = [attnd.Item(sid, 0, 20, tokens=toks)]
        with self.engine_needed("inline Step"):
            self.run_step(None, items, {sid: ref}, rng, worst, inline=True)
        # Decode with every layer's step in flight at once (layer 0 leads at admission).
        m = self.m
        for t in range(10):
            items = [attnd.Item(sid, 20 + t, 1, tokens=[t])]
            plan = self.c.plan(items)
            qkv = [(self.rand(rng, 1, m.q_heads), self.rand(rng, 1, m.kv_heads), self.rand(rng, 1, m.kv_heads))
                   for _ in range(m.layers)]
            ids = [self.c.step_send(layer, *qkv[layer], plan=plan) for layer in range(m.layers)]
            for layer in reversed(range(m.layers)):
                res = self.c.step_recv(ids[layer])
                exp = ref.step(layer, 20 + t, *qkv[layer])
                err = rel_l2(attnd.bf16_to_f32(res.out), exp)
                self.assertLess(err, TOL)
        self.c.close_session(sid)

    def test_truncate_and_fork(self):
        rng = np.random.default_rng(13)
        with self.engine_needed("OpenSession"):
            sid, toks = self.open(rng, 24)
        ref = RefSession(self.m)
        worst = [0.0]
        items = [attnd.Item(sid, 0, 24, tokens=toks)]
        with self.engine_needed("Plan/Step"):
            self.run_step(self.c.plan(items), items, {sid: ref}, rng, worst)
        with self.engine_needed("Truncate"):
            self.c.truncate(sid, 17)
        for layer in range(self.m.layers):
            ref.K[layer] = ref.K[layer][:17]
            ref.V[layer] = ref.V[layer][:17]
        items = [attnd.Item(sid, 17, 3, tokens=[1, 2, 3])]
        self.run_step(self.c.plan(items), items, {sid: ref}, rng, worst)
        with self.engine_needed("Fork"):
            child = self.c.fork(sid)
        refc = copy.deepcopy(ref)
        items = [attnd.Item(child, 20, 2, tokens=[4, 5]), attnd.Item(sid, 20, 1, tokens=[6])]
        self.run_step(self.c.plan(items), items, {sid: ref, child: refc}, rng, worst)
        self.c.close_session(child)
        self.c.close_session(sid)

    # The bound is tolerance.PREFIX_HIT. The CPU backend meets it exactly (0: the
    # same kernel path either way). The CUDA kernels round P to bf16 for the matrix
    # units (docs/numerics.md allows it) and a hit runs its 8 rows on another kernel
    # than the 40-row prefill; P is taken relative to an integer running max
    # (kernels/cuda/primitives.cuh, softmax_ref), so its rounding does not depend on the path and
    # the two differ by fp32 summation order only (1.2e-3 before that change).
    def test_prefix_cache_hit_gives_the_same_outputs(self):
        m = self.m
        rng = np.random.default_rng(16)
        n = 2 * m.block_size + 8
        tokens = rng.integers(0, 1 << 20, size=n).tolist()
        salt = rng.bytes(8)
        data = [tuple(self.rand(rng, n, h) for h in (m.q_heads, m.kv_heads, m.kv_heads))
                for _ in range(m.layers)]
        with self.engine_needed("OpenSession"):
            a, cached = self.c.open_session(tokens, salt=salt)
        self.assertEqual(cached, 0)
        plan = self.c.plan([attnd.Item(a, 0, n, tokens=tokens)])
        # fp32 outputs: a hit runs fewer query rows, and a backend may then take
        # another kernel path (another accumulation order), so the contract is
        # equality up to accumulation order (rel L2 <= 1e-3), not bit equality.
        full = [np.asarray(self.c.step(l, *data[l], plan=plan, fp32_out=True).out, np.float64)
                for l in range(m.layers)]
        b, cached = self.c.open_session(tokens, salt=salt)
        if cached == 0:
            self.c.close_session(a)
            self.c.close_session(b)
            self.skipTest("no prefix cache hit (prefix caching off or not landed)")
        self.assertEqual(cached % m.block_size, 0)
        self.assertLessEqual(cached, n - 1)
        plan = self.c.plan([attnd.Item(b, cached, n - cached, tokens=tokens[cached:])])
        worst = 0.0
        for l in range(m.layers):
            q, k, v = (x[cached:] for x in data[l])
            out = np.asarray(self.c.step(l, q, k, v, plan=plan, fp32_out=True).out, np.float64)
            ref = full[l][cached:]
            err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            worst = max(worst, err)
            self.assertLessEqual(err, PREFIX_HIT_TOL,
                                 f"layer {l}: rel L2 {err:.2e} with a prefix hit")
        st = self.c.stats()
        self.assertGreaterEqual(st.prefix_hit_tokens, cached)
        self.c.close_session(a)
        self.c.close_session(b)
        print(f"prefix cache: {cached} of {n} tokens cached, worst rel L2 {worst:.1e} (fp32 out)")

    def test_errors_are_typed(self):
        rng = np.random.default_rng(14)
        m = self.m
        with self.engine_needed("OpenSession"):
            sid, toks = self.open(rng, 4)
        with self.assertRaises(attnd.InvalidArgument):  # start beyond len[0]
            self.c.plan([attnd.Item(sid, 9, 1, tokens=[1])])
        with self.assertRaises(attnd.NotFound):
            self.c.plan([attnd.Item(sid ^ 0x5A5A5A5A, 0, 1, tokens=[1])])
        with self.assertRaises(attnd.InvalidArgument):  # n must be >= 1
            self.c.plan([attnd.Item(sid, 0, 0, tokens=[])])
        with self.assertRaises(attnd.InvalidArgument):  # k rows must match the items
            self.c.step(0, np.zeros((2, m.q_heads, m.head_dim), np.float32),
                        np.zeros((1, m.kv_heads, m.head_dim), np.float32),
                        np.zeros((1, m.kv_heads, m.head_dim), np.float32),
                        items=[attnd.Item(sid, 0, 2, tokens=toks[:2])])
        self.c.close_session(sid)
        with self.assertRaises(attnd.NotFound):
            self.c.close_session(sid)

    def test_attnctl_bench(self):
        with self.engine_needed("OpenSession"):
            sid, _ = self.open(np.random.default_rng(15), 2)
            self.c.close_session(sid)
        r = self.attnctl("--socket", self.daemon.socket, "--json", "bench", "--sessions", "3",
                         "--prompt", "40", "--steps", "20", "--depth", "2", check=0, timeout=120)
        j = json.loads(r.stdout.strip().splitlines()[-1])
        self.assertEqual(j["decode_token"]["count"], 20)
        self.assertEqual(j["decode_layer_step"]["count"], 20 * self.m.layers)
        self.assertGreater(j["decode_token"]["tokens_per_s"], 0)
        print(f"attnctl bench: decode token p50 {j['decode_token']['p50_ms']:.3f} ms, "
              f"p99 {j['decode_token']['p99_ms']:.3f} ms, {j['decode_token']['tokens_per_s']:.0f} tokens/s")
        r = self.attnctl("--socket", self.daemon.socket, "bench", "--sessions", "2", "--prompt", "16",
                         "--steps", "5", "--inline", check=0, timeout=120)
        self.assertIn("decode token", r.stdout)


class MasksTest(DaemonTestCase):
    """Each mask preset and the lse/fp32 outputs through the wire, against reference.py."""

    def setUp(self):
        self.c = self.daemon.client(bf16="float32")
        self.m = self.c.model

    def tearDown(self):
        self.c.close()

    def check(self, rng, n, wire_mask, ref_mask, prefill=0):
        m = self.m
        with self.engine_needed("OpenSession"):
            sid, _ = self.c.open_session(salt=rng.bytes(8))
        ref = RefSession(m)
        if prefill:  # causal history first, then the masked rows on top of it
            toks = list(range(prefill))
            for layer in range(m.layers):
                q, k, v = (rng.standard_normal((prefill, h, m.head_dim)).astype(np.float32)
                           for h in (m.q_heads, m.kv_heads, m.kv_heads))
                self.c.step(layer, q, k, v, items=[attnd.Item(sid, 0, prefill, tokens=toks)])
                ref.step(layer, 0, q, k, v)
        item = attnd.Item(sid, prefill, n, tokens=list(range(n)), mask=wire_mask)
        worst = 0.0
        for layer in range(m.layers):
            q, k, v = (rng.standard_normal((n, h, m.head_dim)).astype(np.float32)
                       for h in (m.q_heads, m.kv_heads, m.kv_heads))
            res = self.c.step(layer, q, k, v, items=[item], want_lse=True, fp32_out=True)
            out_ref, lse_ref = ref.step(layer, prefill, q, k, v, mask=ref_mask, want_lse=True)
            self.assertEqual(res.out.dtype, np.float32)
            self.assertEqual(res.lse.shape, (n, m.q_heads))
            err = rel_l2(res.out, out_ref)
            worst = max(worst, err)
            self.assertLess(err, TOL, f"{ref_mask} layer {layer}")
            np.testing.assert_allclose(res.lse, lse_ref, rtol=0, atol=2e-2, err_msg=str(ref_mask))
        self.c.close_session(sid)
        return worst

    def test_presets(self):
        rng = np.random.default_rng(31)
        results = {}
        results["full"] = self.check(rng, 20, attnd.Mask.full(), ("full",))
        results["sliding(5)"] = self.check(rng, 20, attnd.Mask.sliding_window(5), ("sliding", 5))
        results["prefix_lm(7)"] = self.check(rng, 20, attnd.Mask.prefix_lm(7), ("prefix_lm", 7))
        results["document(6,9,5)"] = self.check(rng, 20, attnd.Mask.document([6, 9, 5]), ("document", [6, 9, 5]))
        results["causal over 33 cached"] = self.check(rng, 4, None, None, prefill=33)
        results["sliding(8) over 33 cached"] = self.check(rng, 4, attnd.Mask.sliding_window(8), ("sliding", 8), prefill=33)
        print("masks, worst rel L2 (fp32 out, with lse): " +
              ", ".join(f"{k} {v:.1e}" for k, v in results.items()))


class IdentityTest(DaemonTestCase):
    """Sessions belong to the identity that opened them (docs/sessions.md): a TCP
    token, the anonymous loopback identity, or the Unix peer uid."""

    @classmethod
    def setUpClass(cls):
        cls.tokdir = tempfile.TemporaryDirectory()
        path = os.path.join(cls.tokdir.name, "tokens")
        with open(path, "w") as f:
            f.write("tok-a\ntok-b\n")
        cls.extra_args = ("--token-file", path)
        try:
            super().setUpClass()
        except BaseException:
            cls.tokdir.cleanup()
            raise

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            cls.tokdir.cleanup()

    def test_sessions_are_private_to_their_identity(self):
        addr = f"127.0.0.1:{self.daemon.tcp_port}"
        with self.assertRaises(attnd.Unauthenticated):
            attnd.Client(addr, token="not-a-token", timeout=10)
        with attnd.Client(addr, token="tok-a", timeout=10) as a, \
                attnd.Client(addr, token="tok-b", timeout=10) as b, \
                attnd.Client(addr, timeout=10) as anon, self.daemon.client() as unix:
            with self.engine_needed("OpenSession"):
                sid, _ = a.open_session([1, 2, 3])
            self.assertIn(sid, [s.session for s in a.list_sessions()])
            for other in (b, anon, unix):
                self.assertNotIn(sid, [s.session for s in other.list_sessions()])
                with self.assertRaises((attnd.NotFound, attnd.PermissionDenied)):
                    other.close_session(sid)
                with self.assertRaises((attnd.NotFound, attnd.PermissionDenied)):
                    other.plan([attnd.Item(sid, 0, 1, tokens=[1])])
            a.close_session(sid)
