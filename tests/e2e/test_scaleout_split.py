"""Split context (attnd.split.SplitClient): one context over several daemons, merged by
the lse rule, equals one daemon holding all of it within 1e-3 (fp32 out).

- The protocol fake with base positions and q_only items: 2 and 3 parts against
  one fake holding the whole context, causal and sliding-window masks (the window
  leaves whole parts fully masked for later rows), truncate and fork across parts.
- Real CPU daemons: 2 and 4 daemons (up to 4 parts) against one, sliding,
  prefix-LM and full masks, a fully masked part, base and q_only bad input.
"""
import os
import random
import shutil
import tempfile
import unittest

import numpy as np

import attnd
from attnd.split import SplitClient, SplitError
from fake_attnd import shape
from harness import BACKEND, Daemon
from scaleout_fake import ScaleoutFake

SEED = int(os.environ.get("ATTND_TEST_SEED", random.SystemRandom().getrandbits(31)))
TOL = 1e-3


def drive(cl, model, seed, chunks=(20, 12, 9), decode=6, mask=None, nsess=2):
    """Chunked prefill then decode for nsess sessions; every step's (out fp32, lse)."""
    rng = np.random.default_rng(seed)
    H, KV, D, L = model.q_heads, model.kv_heads, model.head_dim, model.layers
    sids = [cl.open_session()[0] for _ in range(nsess)]
    lens = [0] * nsess
    res = []
    for n in list(chunks) + [1] * decode:
        items = [attnd.Item(s, ln, n, tokens=list(rng.integers(0, 1000, n)), mask=mask)
                 for s, ln in zip(sids, lens)]
        plan = cl.plan(items)
        for layer in range(L):
            q, k, v = (rng.standard_normal((n * nsess, h, D)).astype(np.float32) for h in (H, KV, KV))
            if isinstance(cl, SplitClient):
                r = cl.step(layer, q, k, v, plan=plan)
            else:
                r = cl.step(layer, q, k, v, plan=plan, want_lse=True, fp32_out=True)
            res.append((np.asarray(r.out, np.float32), np.asarray(r.lse, np.float32)))
        lens = [x + n for x in lens]
    return sids, res


def compare(test, a, b):
    test.assertEqual(len(a), len(b))
    worst = 0.0
    for (oa, la), (ob, lb) in zip(a, b):
        test.assertEqual(oa.shape, ob.shape)
        test.assertTrue(np.isfinite(ob).all())
        d = float(np.abs(oa - ob).max())
        worst = max(worst, d)
        test.assertLess(d, TOL)
        np.testing.assert_array_equal(np.isneginf(la), np.isneginf(lb))
        fin = ~np.isneginf(la)
        test.assertLess(float(np.abs(la[fin] - lb[fin]).max(initial=0)), TOL)
    print(f"max |split - one| = {worst:.2e}")
    return worst


class FakeSplit(unittest.TestCase):
    def setUp(self):
        print(f"seed {SEED}")
        self.tmp = tempfile.mkdtemp(prefix="attnd-split-")
        self.fakes = []

    def tearDown(self):
        for f in self.fakes:
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fake(self, **kw):
        f = ScaleoutFake(os.path.join(self.tmp, f"f{len(self.fakes)}.sock"), shape(), **kw)
        self.fakes.append(f)
        return f

    def run_both(self, nparts, part_len, **kw):
        whole = self.fake()
        parts = [self.fake() for _ in range(nparts)]
        one = attnd.Client(whole.path)
        self.addCleanup(one.close)
        sp = SplitClient([p.path for p in parts], part_len)
        self.addCleanup(sp.close)
        _, a = drive(one, one.model, SEED, **kw)
        sids, b = drive(sp, sp.model, SEED, **kw)
        return a, b, sp, sids, parts

    def test_two_parts_causal(self):
        a, b, sp, sids, parts = self.run_both(2, 24)
        compare(self, a, b)
        s = sp.session(sids[0])
        # Rolled when a step started at 32 >= 24 positions into part 0; decode stays on part 1.
        self.assertEqual([p.base for p in s.parts], [0, 32])
        held = sorted((x.base, x.length()) for x in parts[1].sessions.values())
        self.assertEqual(held, [(32, 47), (32, 47)])

    def test_three_parts_decode_rolls(self):
        a, b, sp, sids, parts = self.run_both(3, 16, chunks=(16, 16), decode=20)
        compare(self, a, b)
        s = sp.session(sids[1])
        self.assertEqual([p.base for p in s.parts], [0, 16, 32, 48])
        self.assertEqual([p.daemon for p in s.parts], [0, 1, 2, 0])  # round robin: daemon 0 holds two parts

    def test_sliding_window_masks_whole_parts(self):
        # Window 10 over parts of 16: later rows see nothing of part 0, whose lse is
        # then -inf there (checked below), and the merge still matches.
        m = attnd.Mask.sliding_window(10)
        a, b, sp, sids, parts = self.run_both(3, 16, chunks=(16, 16, 8), decode=3, mask=m)
        compare(self, a, b)
        # One more token (position 43, window keys 34..43): daemon 0 holds positions
        # 0..15 and sees nothing of it (lse -inf, out 0); the merge is still exact.
        plan = sp.plan([attnd.Item(sids[0], 43, 1, tokens=[5], mask=m)])
        q, k, v = (np.ones((1, h, 64), np.float32) for h in (4, 2, 2))
        r = sp.step(0, q, k, v, plan=plan)
        self.assertEqual(len(r.parts), 3)
        self.assertTrue(np.isneginf(r.parts[0].lse).all())
        self.assertTrue((r.parts[0].out == 0).all())
        self.assertTrue(np.isfinite(r.parts[2].lse).all())
        self.assertTrue(np.isfinite(r.out).all() and np.isfinite(r.lse).all())

    def test_single_daemon_group(self):
        a, b, *_ = self.run_both(1, 1000)
        compare(self, a, b)

    def test_truncate_and_fork_across_parts(self):
        whole, p0, p1 = self.fake(), self.fake(), self.fake()
        with attnd.Client(whole.path) as one, SplitClient([p0.path, p1.path], 16) as sp:
            s1, _ = drive(one, one.model, SEED, chunks=(16, 16, 8), decode=0, nsess=1)
            s2, _ = drive(sp, sp.model, SEED, chunks=(16, 16, 8), decode=0, nsess=1)
            self.assertEqual(len(sp.session(s2[0]).parts), 3)
            one.truncate(s1[0], 20)
            sp.truncate(s2[0], 20)
            self.assertEqual([p.base for p in sp.session(s2[0]).parts], [0, 16])
            kid1, kid2 = one.fork(s1[0]), sp.fork(s2[0])
            rng = np.random.default_rng(SEED + 1)
            for c, sid in ((one, kid1), (sp, kid2)):
                plan = c.plan([attnd.Item(sid, 20, 3, tokens=[1, 2, 3])])
                q, k, v = (rng.standard_normal((3, h, 64)).astype(np.float32) for h in (4, 2, 2))
                rng = np.random.default_rng(SEED + 1)
                kw = {} if c is sp else {"want_lse": True, "fp32_out": True}
                r = c.step(0, q, k, v, plan=plan, **kw)
                if c is one:
                    ref = r.out
            self.assertLess(float(np.abs(ref - r.out).max()), TOL)
            sp.close_session(kid2)
            sp.close_session(s2[0])
        self.assertEqual(len(p0.sessions) + len(p1.sessions), 0)

    def test_rewrite_before_tail_refused(self):
        p0, p1 = self.fake(), self.fake()
        with SplitClient([p0.path, p1.path], 16) as sp:
            (sid,), _ = drive(sp, sp.model, SEED, chunks=(16, 8), decode=0, nsess=1)
            with self.assertRaises(SplitError):
                sp.plan([attnd.Item(sid, 4, 1, tokens=[1])])
            with self.assertRaises(attnd.InvalidArgument):
                sp.plan([attnd.Item(sid, 30, 1, tokens=[1])])
            sp.plan([attnd.Item(sid, 20, 1, tokens=[1])])  # a rewrite inside the tail is fine

    def test_old_daemon_refused(self):
        old = self.fake(split=False)
        with self.assertRaises(SplitError) as cm:
            SplitClient([old.path], 16)
        self.assertIn("split_context", str(cm.exception))

    def test_base_not_honoured_refused(self):
        p0, p1 = self.fake(), self.fake()
        with SplitClient([p0.path, p1.path], 8) as sp:
            sid, _ = sp.open_session()
            p1.split = False  # from now on p1 answers base 0 whatever is asked
            plan = sp.plan([attnd.Item(sid, 0, 8, tokens=list(range(8)))])
            q, k, v = (np.ones((8, h, 64), np.float32) for h in (4, 2, 2))
            sp.step(0, q, k, v, plan=plan)
            with self.assertRaises(SplitError) as cm:
                sp.plan([attnd.Item(sid, 8, 1, tokens=[1])])
            self.assertIn("base 0, not 8", str(cm.exception))
            self.assertEqual(len(p1.sessions), 0)  # the wrongly placed session was closed


def open_at(cl, base, tokens=None):
    """OpenSession with a base position (a raw request: the plain client has no base)."""
    req = attnd.client.pb.Request()
    req.open_session.SetInParent()
    req.open_session.base = base
    if tokens is not None:
        req.open_session.tokens.extend(tokens)
    r = cl.call(req).open_session
    return r.session, r.cached_len, r.base


class RealSplit(unittest.TestCase):
    """Real CPU daemons serving split context: 2 and 4 daemons (up to 4 parts)
    against one, the masks that leave whole parts fully masked, and bad input."""

    SHAPE = ["--backend", BACKEND, "--kv-memory", "32M", "--layers", "2", "--q-heads", "4",
             "--kv-heads", "2", "--head-dim", "64", "--block-size", "16", "--threads", "1"]

    @classmethod
    def setUpClass(cls):
        print(f"seed {SEED}")
        cls.ds = []
        try:
            for _ in range(5):
                d = Daemon(shape=cls.SHAPE)
                cls.ds.append(d)
                h = d.wait_ready()
                assert h.split_context, "Health.split_context is false"
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for d in cls.ds:
            d.stop()
            d.close()

    def split_vs_one(self, n, part_len, parts=None, **kw):
        with self.ds[0].client() as one:
            sids1, a = drive(one, one.model, SEED, **kw)
            for sid in sids1:
                one.close_session(sid)
        with SplitClient([d.socket for d in self.ds[1:1 + n]], part_len) as sp:
            sids, b = drive(sp, sp.model, SEED, **kw)
            if parts is not None:
                self.assertEqual(len(sp.session(sids[0]).parts), parts)
            for sid in sids:
                sp.close_session(sid)
        return compare(self, a, b)

    def test_split_equals_one(self):
        for n in (2, 4):
            with self.subTest(daemons=n):
                self.split_vs_one(n, 32, chunks=(40, 24), decode=8)

    def test_four_parts(self):
        # Parts at 0, 40, 64, 80 (bases need not be block multiples); prefill
        # chunks longer than a part's keys (q_only pieces) and decode rolls.
        self.split_vs_one(4, 16, parts=4, chunks=(40, 24, 16), decode=8)

    def test_masks(self):
        for name, m in (("sliding", attnd.Mask.sliding_window(10)),
                        ("sliding-wide", attnd.Mask.sliding_window(30)),
                        ("prefix-lm", attnd.Mask.prefix_lm(20)),
                        ("full", attnd.Mask.full())):
            with self.subTest(mask=name):
                self.split_vs_one(3, 16, chunks=(16, 16, 8), decode=3, mask=m)

    def test_fully_masked_part(self):
        # Window 10: position 43 sees keys 34..43; daemon 0's part [0, 16) gives
        # lse -inf and out 0 there, and the merge equals one daemon.
        m = attnd.Mask.sliding_window(10)
        with SplitClient([d.socket for d in self.ds[1:4]], 16) as sp:
            (sid,), _ = drive(sp, sp.model, SEED, chunks=(16, 16, 8), decode=3, mask=m, nsess=1)
            plan = sp.plan([attnd.Item(sid, 43, 1, tokens=[5], mask=m)])
            q, k, v = (np.ones((1, h, 64), np.float32) for h in (4, 2, 2))
            r = sp.step(0, q, k, v, plan=plan)
            self.assertEqual(len(r.parts), 3)
            self.assertTrue(np.isneginf(r.parts[0].lse).all())
            self.assertTrue((r.parts[0].out == 0).all())
            self.assertTrue(np.isfinite(r.out).all() and np.isfinite(r.lse).all())
            sp.close_session(sid)

    def test_base_and_bad_input(self):
        from attnd.split import _q_only_item
        with self.ds[1].client() as c:
            mc = c.health().model.max_context
            with self.assertRaises(attnd.OutOfRange):
                open_at(c, mc)
            # A part past 0 neither looks up nor publishes: cached_len 0.
            toks = list(range(32))
            s0, _ = c.open_session(toks)
            plan = c.plan([attnd.Item(s0, 0, 32, tokens=toks)])
            for layer in range(2):
                c.step(layer, *(np.ones((32, h, 64), np.float32) for h in (4, 2, 2)), plan=plan)
            c.close_session(s0)
            _, hit, _ = open_at(c, 0, toks)
            self.assertGreater(hit, 0)
            sid, hit, base = open_at(c, 40, toks)
            self.assertEqual((hit, base), (0, 40))
            info = {x.session: x for x in c.list_sessions()}[sid]
            self.assertEqual((info.base, info.len), (40, 40))
            one = lambda *hs: [np.ones((n, h, 64), np.float32) for n, h in hs]
            bad = [
                ([attnd.Item(sid, 39, 1, tokens=[1])], 1, attnd.InvalidArgument, "base 40"),
                ([attnd.Item(sid, 41, 1, tokens=[1])], 1, attnd.InvalidArgument, "> len 40"),
                ([_q_only_item(sid, 40, 1, None)], 0, attnd.FailedPrecondition, "no positions"),
            ]
            for items, t, exc, what in bad:
                with self.subTest(what=what):
                    with self.assertRaises(exc) as cm:
                        c.step(0, *one((1, 4), (t, 2), (t, 2)), items=items)
                    self.assertIn(what, str(cm.exception))
            plan = c.plan([attnd.Item(sid, 40, 8, tokens=list(range(8)))])
            for layer in range(2):
                c.step(layer, *one((8, 4), (8, 2), (8, 2)), plan=plan)
            q_bad = []
            it = _q_only_item(sid, 47, 1, None)
            q_bad.append(([it], attnd.InvalidArgument, "q_only start 47 < len 48"))
            it = _q_only_item(sid, 48, 1, None)
            it.kv_only = True
            q_bad.append(([it], attnd.InvalidArgument, "q_only and kv_only"))
            it = _q_only_item(sid, 48, 1, None)
            it.tokens = [3]
            q_bad.append(([it], attnd.InvalidArgument, "no token ids"))
            for items, exc, what in q_bad:
                with self.subTest(what=what):
                    with self.assertRaises(exc) as cm:
                        c.step(0, *one((1, 4), (0, 2), (0, 2)), items=items)
                    self.assertIn(what, str(cm.exception))
            # An attend-only step writes nothing: the session's length stays.
            r = c.step(0, *one((2, 4), (0, 2), (0, 2)), items=[_q_only_item(sid, 60, 2, None)],
                       want_lse=True, fp32_out=True)
            self.assertTrue(np.isfinite(r.out).all() and np.isfinite(r.lse).all())
            info = {x.session: x for x in c.list_sessions()}[sid]
            self.assertEqual((info.base, info.len), (40, 48))
            with self.assertRaises(attnd.InvalidArgument):
                c.truncate(sid, 39)
            c.truncate(sid, 40)
            kid = c.fork(sid)
            info = {x.session: x for x in c.list_sessions()}[kid]
            self.assertEqual((info.base, info.len), (40, 40))
            c.close_session(kid)
            c.close_session(sid)


if __name__ == "__main__":
    unittest.main()
