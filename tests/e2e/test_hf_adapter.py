"""attnd.hf, the Hugging Face transformers attention adapter, on the real daemon.

RunnerTest needs only numpy: the adapter's sessions-and-steps core (one session
per batch row, a Plan per forward pass, Fork for beam search and
num_return_sequences, Truncate for crop) against the independent numpy reference,
on a daemon with --rope none as the adapter requires.

HFLlamaTest runs client/python/examples/hf_llama.py's check: a small randomly
initialised transformers Llama generating greedily with attn_implementation
"attnd" against "sdpa" and "eager". It skips, saying so, where torch or
transformers is missing (this machine and CI); it runs on the GPU machine
(scripts/dev/gpu-hf.sh), on the backend ATTND_E2E_BACKEND names.
"""
import copy
import os
import sys
import unittest

import numpy as np

import attnd
import attnd.hf
from harness import BACKEND, Daemon, DaemonTestCase
from reference import RefSession, rel_l2
import tolerance

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "client", "python", "examples"))
import hf_llama  # noqa: E402

TOL = tolerance.REL_L2["bf16"]  # bf16 cache, relative L2 per item (docs/numerics.md)

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    HAVE_HF = True
    WHY_NOT = ""
except ImportError as e:
    HAVE_HF = False
    WHY_NOT = f"torch/transformers not installed ({e}); this check runs on the GPU machine (scripts/dev/gpu-hf.sh)"

SHAPE = ["--backend", BACKEND] + hf_llama.DAEMON_SHAPE


class RunnerTest(DaemonTestCase):
    """AttndRunner with numpy tensors in the layout the adapter sends."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(shape=SHAPE)
        try:
            cls.daemon.wait_ready()
        except BaseException:
            cls.daemon.close()
            raise

    def setUp(self):
        self.c = self.daemon.client()
        self.m = self.c.model
        self.r = attnd.hf.AttndRunner(self.c)

    def tearDown(self):
        self.c.close()

    def forward(self, seqs, refs, rng, start, tokens, worst):
        """One forward pass over every layer for all rows; checks each row's output."""
        m = self.m
        rows, n = len(tokens), len(tokens[0])
        for layer in range(m.layers):
            q = rng.standard_normal((rows * n, m.q_heads, m.head_dim)).astype(np.float32)
            k = rng.standard_normal((rows * n, m.kv_heads, m.head_dim)).astype(np.float32)
            v = rng.standard_normal((rows * n, m.kv_heads, m.head_dim)).astype(np.float32)
            out = self.r.step(seqs, layer, attnd.f32_to_bf16(q), attnd.f32_to_bf16(k),
                              attnd.f32_to_bf16(v), start, tokens)
            out = attnd.bf16_to_f32(out)
            self.assertEqual(out.shape, q.shape)
            for r in range(rows):
                sl = slice(r * n, (r + 1) * n)
                ref = refs[r].step(layer, start, q[sl], k[sl], v[sl])
                err = rel_l2(out[sl], ref)
                worst[0] = max(worst[0], err)
                self.assertLess(err, TOL, f"layer {layer} row {r} start {start}")

    def test_prefill_decode_fork_truncate(self):
        rng = np.random.default_rng(5)
        worst = [0.0]
        with self.engine_needed("sessions"):
            seqs = self.r.sequences()
            refs = [RefSession(self.m) for _ in range(2)]
            toks = rng.integers(0, 1000, size=(2, 19)).tolist()
            self.forward(seqs, refs, rng, 0, toks, worst)
            pos = 19
            for _ in range(6):  # decode
                self.forward(seqs, refs, rng, pos, rng.integers(0, 1000, size=(2, 1)).tolist(), worst)
                pos += 1
            self.assertEqual(self.r.plans, 7)  # one per forward, shared by both layers
            self.assertEqual(self.r.steps, 7 * self.m.layers)
            lens = {s.session: s.len for s in self.c.list_sessions()}
            self.assertEqual([lens[s] for s in seqs.sessions], [pos, pos])
            # Beam search keeps row 1 twice and drops row 0: a fork and a close.
            seqs.select([1, 1])
            refs = [refs[1], copy.deepcopy(refs[1])]
            self.assertEqual(len(set(seqs.sessions)), 2)
            self.forward(seqs, refs, rng, pos, rng.integers(0, 1000, size=(2, 1)).tolist(), worst)
            pos += 1
            # crop() rolls both back; what follows overwrites the dropped tail.
            seqs.truncate(pos - 3)
            pos -= 3
            for ref in refs:
                ref.K = [K[:pos] for K in ref.K]
                ref.V = [V[:pos] for V in ref.V]
            self.forward(seqs, refs, rng, pos, rng.integers(0, 1000, size=(2, 2)).tolist(), worst)
            # A repeat of the same forward (same plan key) rewrites the same positions.
            toks = rng.integers(0, 1000, size=(2, 1)).tolist()
            self.forward(seqs, refs, rng, pos + 2, toks, worst)
            self.forward(seqs, refs, rng, pos + 2, toks, worst)
            # A plan that attnd ended (a Truncate touched its sessions) is replaced.
            self.c.truncate(seqs.sessions[0], pos + 3)
            self.c.truncate(seqs.sessions[1], pos + 3)
            self.forward(seqs, refs, rng, pos + 2, toks, worst)
            sids = list(seqs.sessions)
            seqs.close()
            live = {s.session for s in self.c.list_sessions()}
            self.assertFalse(live & set(sids))
            with self.assertRaises(RuntimeError):
                seqs.ensure(2, 0)
        print(f"\n  runner: worst rel L2 {worst[0]:.2e} (tol {TOL}); {self.r.steps} steps, {self.r.plans} plans")

    def test_prefix_cache_hit_skips_held_positions(self):
        rng = np.random.default_rng(7)
        m = self.m
        worst = [0.0]
        salt = rng.bytes(8)
        with self.engine_needed("sessions"):
            toks = rng.integers(0, 1000, size=(2, 40)).tolist()
            a = self.r.sequences(prefix=True, salt=salt)
            refs_a = [RefSession(m) for _ in range(2)]
            self.forward(a, refs_a, rng, 0, toks, worst)
            self.assertEqual(a.opened_cached, [0, 0])
            held = [copy.deepcopy(r) for r in refs_a]
            a.close()  # its two full blocks per row stay in the prefix cache
            b = self.r.sequences(prefix=True, salt=salt)
            refs = []
            for r in held:
                r.K = [K[:32] for K in r.K]
                r.V = [V[:32] for V in r.V]
                refs.append(r)
            n = 40
            for layer in range(m.layers):
                q = rng.standard_normal((2 * n, m.q_heads, m.head_dim)).astype(np.float32)
                k = rng.standard_normal((2 * n, m.kv_heads, m.head_dim)).astype(np.float32)
                v = rng.standard_normal((2 * n, m.kv_heads, m.head_dim)).astype(np.float32)
                out = attnd.bf16_to_f32(self.r.step(b, layer, attnd.f32_to_bf16(q), attnd.f32_to_bf16(k),
                                                    attnd.f32_to_bf16(v), 0, toks))
                self.assertEqual(b.opened_cached, [32, 32])
                for r in range(2):
                    self.assertTrue((out[r * n:r * n + 32] == 0).all(), "held rows come back as zeros")
                    sl = slice(r * n + 32, (r + 1) * n)
                    ref = refs[r].step(layer, 32, q[sl], k[sl], v[sl])
                    err = rel_l2(out[sl], ref)
                    worst[0] = max(worst[0], err)
                    self.assertLess(err, TOL, f"layer {layer} row {r}")
            self.forward(b, refs, rng, 40, rng.integers(0, 1000, size=(2, 1)).tolist(), worst)
            # Rewriting from 0 with other tokens sends every position again.
            other = rng.integers(0, 1000, size=(2, 5)).tolist()
            refs = [RefSession(m) for _ in range(2)]
            self.forward(b, refs, rng, 0, other, worst)
            self.assertEqual(b.cached, [0, 0])
            b.close()
        print(f"\n  prefix: worst rel L2 {worst[0]:.2e}")

    def test_batch_size_change_mid_sequence_is_refused(self):
        rng = np.random.default_rng(6)
        with self.engine_needed("sessions"):
            seqs = self.r.sequences()
            refs = [RefSession(self.m) for _ in range(2)]
            self.forward(seqs, refs, rng, 0, rng.integers(0, 1000, size=(2, 4)).tolist(), [0.0])
            with self.assertRaises(ValueError):
                seqs.ensure(3, 4)
            seqs.ensure(3, 0)  # a new sequence from position 0 may change the batch
            self.assertEqual(len(seqs.sessions), 3)
            seqs.close()


@unittest.skipUnless(HAVE_HF, WHY_NOT)
class HFLlamaTest(unittest.TestCase):
    """The transformers Llama check of hf_llama.py, on a daemon of its shape."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(shape=SHAPE)
        try:
            cls.daemon.wait_ready()
        except BaseException:
            cls.daemon.close()
            raise

    @classmethod
    def tearDownClass(cls):
        try:
            cls.daemon.stop()
        finally:
            cls.daemon.close()

    def check(self, dtype):
        with self.daemon.client(timeout=120) as c:
            try:
                res = hf_llama.run_check(c, dtype=dtype)
            except attnd.Unimplemented as e:
                self.skipTest(f"the daemon answers UNIMPLEMENTED ({e.message})")
        tf = res["teacher_forced"]
        self.assertLess(tf["rel_l2"], tf["tol"])
        self.assertEqual(res["attnd_sessions_len"], [hf_llama.PROMPT + hf_llama.STEPS] * hf_llama.BATCH)
        self.assertGreaterEqual(tf["agree"] + tf["near_ties"], tf["n"])
        self.assertLess(res["no_cache_rel_l2"], tf["tol"])
        self.assertEqual(res["prefix"]["cached_len"], [32] * hf_llama.BATCH)

    def test_bf16_model(self):
        self.check("bf16")

    def test_fp32_model_bf16_attention(self):
        self.check("fp32")


if __name__ == "__main__":
    unittest.main()
