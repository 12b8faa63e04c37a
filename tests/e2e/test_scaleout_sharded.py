"""Head sharding (attnd.sharded.ShardedClient): outputs equal one daemon's bit for bit.

- Real daemons started with a shard's own shape (q heads 2, kv heads 1 each of a
  4/2 model; their range given in the fleet, as for a daemon that does not report
  one) against one daemon with the whole shape: prefill, pipelined decode, lse,
  fp32 out, fork.
- Real daemons with --kv-heads A:B (2 shards of 4/2, 4 shards of 8/4, uneven
  int8 shards with sliced scales) against one daemon; bad ranges exit 2.
- The protocol fake reporting ranges: range checks and failures.
"""
import os
import random
import shutil
import tempfile
import unittest

import numpy as np

import attnd
from attnd.fleet import Daemon as FleetDaemon
from attnd.sharded import ShardedClient, ShardError
from harness import BACKEND, Daemon
from scaleout_fake import ScaleoutFake
from fake_attnd import shape

SEED = int(os.environ.get("ATTND_TEST_SEED", random.SystemRandom().getrandbits(31)))
COMMON = ["--backend", BACKEND, "--kv-memory", "32M", "--layers", "2", "--head-dim", "64",
          "--block-size", "16", "--threads", "1"]


def start(args):
    d = Daemon(shape=COMMON + args)
    try:
        d.wait_ready()
    except BaseException:
        d.close()
        raise
    return d


def run_sessions(cl, model, rng_seed, steps=3, want_lse=True, fp32_out=False):
    """Prefill two sessions (one Plan, one Step per layer), then decode steps with
    every layer sent before any answer is read. Returns every output."""
    rng = np.random.default_rng(rng_seed)
    H, KV, D, L = model.q_heads, model.kv_heads, model.head_dim, model.layers
    prompts = [list(rng.integers(0, 1000, 37)), list(rng.integers(0, 1000, 21))]
    sids = [cl.open_session(p)[0] for p in prompts]
    lens = [len(p) for p in prompts]
    outs = []
    items = [attnd.Item(s, 0, n, tokens=p) for s, n, p in zip(sids, lens, prompts)]
    T = sum(lens)
    plan = cl.plan(items)
    for layer in range(L):
        q, k, v = (rng.standard_normal((T, h, D)).astype(np.float32) for h in (H, KV, KV))
        r = cl.step(layer, q, k, v, plan=plan, want_lse=want_lse, fp32_out=fp32_out)
        outs += [r.out, r.lse]
    for _ in range(steps):
        items = [attnd.Item(s, n, 1, tokens=[int(rng.integers(1000))]) for s, n in zip(sids, lens)]
        plan = cl.plan(items)
        ids = []
        for layer in range(L):
            q, k, v = (rng.standard_normal((2, h, D)).astype(np.float32) for h in (H, KV, KV))
            ids.append(cl.step_send(layer, q, k, v, plan=plan, want_lse=want_lse, fp32_out=fp32_out))
        for i in ids:
            r = cl.step_recv(i)
            outs += [r.out, r.lse]
        lens = [n + 1 for n in lens]
    child = cl.fork(sids[0])
    plan = cl.plan([attnd.Item(child, lens[0], 1, tokens=[7])])
    q, k, v = (rng.standard_normal((1, h, D)).astype(np.float32) for h in (H, KV, KV))
    r = cl.step(0, q, k, v, plan=plan, want_lse=want_lse, fp32_out=fp32_out)
    outs += [r.out, r.lse]
    for s in sids + [child]:
        cl.close_session(s)
    return outs


class NarrowShapeShards(unittest.TestCase):
    """Two daemons of the shard shape (2 q / 1 kv heads) against one of 4 / 2."""

    @classmethod
    def setUpClass(cls):
        print(f"seed {SEED}")
        cls.daemons = []
        try:
            cls.whole = start(["--q-heads", "4", "--kv-heads", "2"])
            cls.daemons.append(cls.whole)
            for _ in range(2):
                cls.daemons.append(start(["--q-heads", "2", "--kv-heads", "1"]))
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for d in cls.daemons:
            d.stop()
            d.close()

    def group(self, order=(1, 2)):
        fl = [FleetDaemon(f"s{i}", self.daemons[i].socket, kv_heads=(i - 1, i), timeout=60) for i in order]
        return ShardedClient(fl)

    def compare(self, **kw):
        with self.whole.client() as one, self.group() as sh:
            self.assertEqual((sh.model.q_heads, sh.model.kv_heads), (4, 2))
            a = run_sessions(one, one.model, SEED, **kw)
            b = run_sessions(sh, sh.model, SEED, **kw)
        self.assertEqual(len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            if x is None:
                self.assertIsNone(y)
                continue
            self.assertEqual(x.dtype, y.dtype)
            self.assertEqual(x.shape, y.shape)
            self.assertTrue(np.array_equal(x.view(np.uint8), y.view(np.uint8)),
                            f"output {i}: sharded differs from one daemon")

    def test_bit_equal_bf16_with_lse(self):
        self.compare()

    def test_bit_equal_fp32_out(self):
        self.compare(fp32_out=True, steps=2)

    def test_order_of_daemons_does_not_matter(self):
        with self.group(order=(2, 1)) as sh:
            self.assertEqual([s.kv_begin for s in sh.shards], [0, 1])

    def test_bad_ranges(self):
        for rng, what in (([(0, 1), (0, 1)], "no daemon, or twice"), ([(0, 2), (2, 3)], "holds 1"),
                          ([(1, 2), (2, 3)], "held by no daemon")):
            fl = [FleetDaemon(f"s{i}", self.daemons[1 + i].socket, kv_heads=r) for i, r in enumerate(rng)]
            with self.subTest(rng=rng), self.assertRaises(ShardError) as cm:
                ShardedClient(fl)
            self.assertIn(what, str(cm.exception))

    def test_bad_input_names_heads(self):
        with self.group() as sh:
            with self.assertRaises(ValueError):
                sh.step_send(0, np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float32),
                             np.zeros((1, 2, 64), np.float32), plan=0)


class KvHeadsFlagShards(unittest.TestCase):
    """Daemons started with --kv-heads A:B report their range in Health and, joined
    by ShardedClient, answer one whole daemon's bits: 2 shards of a 4/2 model, 4
    shards of an 8/4 model (one kv head each), and int8 static scales sliced."""

    def group_equals_whole(self, q, kv, ranges, extra=(), scales=False):
        ds = []
        try:
            for rng in ranges:
                d = Daemon(shape=COMMON + list(extra) + ["--q-heads", str(q), "--kv-heads", str(kv),
                                                         "--kv-heads", rng])
                ds.append(d)
                h = d.wait_ready()
                a, b = (int(x) for x in rng.split(":"))
                self.assertEqual((h.model.kv_head_begin, h.model.kv_head_end), (a, b))
                self.assertEqual((h.model.model_q_heads, h.model.model_kv_heads), (q, kv))
                self.assertEqual((h.model.q_heads, h.model.kv_heads), ((b - a) * q // kv, b - a))
            whole = start(list(extra) + ["--q-heads", str(q), "--kv-heads", str(kv)])
            ds.append(whole)
            hw = whole.client().health()
            self.assertEqual((hw.model.kv_head_begin, hw.model.kv_head_end), (0, kv))
            # Each shard's KV bytes are its heads' share of the whole model's.
            hs = [x.client().health() for x in ds[:-1]]
            self.assertEqual(sum(x.model.kv_bytes_per_token for x in hs), hw.model.kv_bytes_per_token)
            shards = list(reversed([x.socket for x in ds[:-1]]))  # any order
            with whole.client() as one, ShardedClient(shards) as sh:
                self.assertEqual((sh.model.q_heads, sh.model.kv_heads), (q, kv))
                if scales:
                    rs = np.random.default_rng(SEED)
                    ks = rs.uniform(0.01, 0.05, (kv, 64)).astype(np.float32)
                    vs = rs.uniform(0.01, 0.05, (kv, 64)).astype(np.float32)
                    for layer in range(2):
                        one.set_scales(layer, ks, vs)
                        sh.set_scales(layer, ks, vs)
                a = run_sessions(one, one.model, SEED)
                b = run_sessions(sh, sh.model, SEED)
            self.assertEqual(len(a), len(b))
            for i, (x, y) in enumerate(zip(a, b)):
                self.assertEqual(x.shape, y.shape)
                self.assertTrue(np.array_equal(x.view(np.uint8), y.view(np.uint8)),
                                f"output {i}: sharded differs from one daemon")
        finally:
            for d in ds:
                d.stop()
                d.close()

    def test_two_shards(self):
        self.group_equals_whole(4, 2, ["0:1", "1:2"])

    def test_four_shards(self):
        self.group_equals_whole(8, 4, ["0:1", "1:2", "2:3", "3:4"])

    def test_uneven_shards_int8_scales(self):
        self.group_equals_whole(8, 4, ["0:3", "3:4"], extra=["--kv-cache", "int8"], scales=True)

    def test_bad_ranges_exit_2(self):
        for args, what in ((["--kv-heads", "2", "--kv-heads", "1:3"], "0 <= A < B <= 2"),
                           (["--kv-heads", "2:1"], "0 <= A < B"),
                           (["--kv-heads", "1:1"], "0 <= A < B"),
                           (["--kv-heads", ":2"], "range A:B"),
                           (["--kv-heads", "0:x"], "range A:B"),
                           (["--q-heads", "6", "--kv-heads", "4", "--kv-heads", "0:2"],
                            "not a multiple")):
            with self.subTest(args=args):
                d = Daemon(shape=COMMON + args)
                try:
                    rc = d.proc.wait(timeout=20)
                    self.assertEqual(rc, 2, d.log_text())
                    self.assertIn(what, d.log_text())
                finally:
                    d.close()


class FakeRanges(unittest.TestCase):
    """Daemons that report their range in Health (the protocol fake)."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="attnd-shard-")
        self.fakes = []

    def tearDown(self):
        for f in self.fakes:
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fake(self, rng, q=2, kv=1, **kw):
        f = ScaleoutFake(os.path.join(self.tmp, f"f{len(self.fakes)}.sock"),
                         shape(q_heads=q, kv_heads=kv, **kw), kv_range=rng)
        self.fakes.append(f)
        return f

    def test_reported_ranges_equal_whole(self):
        whole = self.fake(None, 4, 2)
        a, b = self.fake((0, 1, 4, 2)), self.fake((1, 2, 4, 2))
        with attnd.Client(whole.path) as one, ShardedClient([b.path, a.path]) as sh:
            x = run_sessions(one, one.model, SEED, steps=1)
            y = run_sessions(sh, sh.model, SEED, steps=1)
        for u, w in zip(x, y):
            self.assertTrue(np.array_equal(u, w))

    def test_declared_range_must_agree(self):
        a, b = self.fake((0, 1, 4, 2)), self.fake((1, 2, 4, 2))
        with self.assertRaises(ShardError) as cm:
            ShardedClient([FleetDaemon("a", a.path, kv_heads=(1, 2)), FleetDaemon("b", b.path)])
        self.assertIn("Health says 0:1", str(cm.exception))

    def test_totals_must_match(self):
        a, b = self.fake((0, 1, 6, 3)), self.fake((1, 2, 6, 3))
        with self.assertRaises(ShardError) as cm:
            ShardedClient([a.path, b.path])
        self.assertIn("model totals", str(cm.exception))

    def test_shape_must_match(self):
        a, b = self.fake((0, 1, 4, 2)), self.fake((1, 2, 4, 2), block_size=32)
        with self.assertRaises(ShardError) as cm:
            ShardedClient([a.path, b.path])
        self.assertIn("block_size", str(cm.exception))

    def test_restart_marks_sessions_stale(self):
        a, b = self.fake((0, 1, 4, 2)), self.fake((1, 2, 4, 2))
        seen = []
        with ShardedClient([a.path, b.path], on_epoch_change=lambda n, o, e: seen.append(n)) as sh:
            sid, _ = sh.open_session([1, 2, 3])
            self.assertFalse(sh.stale(sid))
            b.restart()
            with self.assertRaises(attnd.NotFound):
                sh.truncate(sid, 0)
            self.assertEqual(seen, [b.path])
            self.assertTrue(sh.stale(sid))

    def test_set_scales_slices_heads(self):
        a, b = self.fake((0, 1, 4, 2)), self.fake((1, 2, 4, 2))
        got = []
        for f in (a, b):
            f._set_scales = (lambda r, resp, got=got: (got.append(list(r.k_scale.shape)),
                                                       setattr(resp.set_scales, "version", 1)))
        with ShardedClient([a.path, b.path]) as sh:
            self.assertEqual(sh.set_scales(0, np.ones((2, 64)), np.ones((2, 64))), [1, 1])
        self.assertEqual(got, [[1, 64], [1, 64]])


if __name__ == "__main__":
    unittest.main()
