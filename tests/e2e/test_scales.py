"""Static KV scales and restarts through the Python client on a daemon with an int8
cache: a step before SetScales is FAILED_PRECONDITION, bad scales are
INVALID_ARGUMENT, scales persist across a restart under the same state
directory, and a client that reconnects with the old epoch sees EpochChanged."""
import shutil
import tempfile
import unittest

import numpy as np

import attnd
from harness import Daemon, daemon_binary
from reference import RefSession, rel_l2
import tolerance

INT8 = ["--kv-cache", "int8"]


class ScalesTest(unittest.TestCase):
    def setUp(self):
        if daemon_binary() is None:
            self.skipTest("attnd is not built yet")
        self.tmp = tempfile.mkdtemp(prefix="attnd-scales-")
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            d.stop()
            d.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self):
        d = Daemon(INT8, tmp=self.tmp)
        self.daemons.append(d)
        d.wait_ready()
        return d

    def stop(self, d):
        self.assertEqual(d.stop(), 0, d.log_text())

    def one_step(self, c, rng, n=8):
        m = c.model
        sid, _ = c.open_session(list(range(n)), salt=rng.bytes(8))
        items = [attnd.Item(sid, 0, n, tokens=list(range(n)))]
        plan = c.plan(items)
        ref = RefSession(m)
        worst = 0.0
        for layer in range(m.layers):
            q = rng.standard_normal((n, m.q_heads, m.head_dim)).astype(np.float32)
            k = rng.standard_normal((n, m.kv_heads, m.head_dim)).astype(np.float32)
            v = rng.standard_normal((n, m.kv_heads, m.head_dim)).astype(np.float32)
            out = attnd.bf16_to_f32(c.step(layer, q, k, v, plan=plan).out)
            # The reference keeps bf16 KV; int8 with scale max|x|/127 stays within a few percent.
            worst = max(worst, rel_l2(out, ref.step(layer, 0, q, k, v)))
        c.close_session(sid)
        return worst

    def test_scales_lifecycle_and_restart(self):
        d = self.start()
        rng = np.random.default_rng(21)
        with d.client() as c:
            m = c.model
            if m.kv_cache != "int8":
                self.skipTest(f"daemon ignores --kv-cache int8 (reports {m.kv_cache})")
            try:
                sid, _ = c.open_session([1, 2], salt=b"x")
            except attnd.Unimplemented as e:
                self.skipTest(f"sessions answer UNIMPLEMENTED ({e.message})")
            plan = c.plan([attnd.Item(sid, 0, 2, tokens=[1, 2])])
            z = np.zeros((2, m.kv_heads, m.head_dim), np.float32)
            zq = np.zeros((2, m.q_heads, m.head_dim), np.float32)
            with self.assertRaises(attnd.FailedPrecondition):  # no scales yet: never a default
                c.step(0, zq, z, z, plan=plan)
            c.close_session(sid)
            with self.assertRaises(attnd.InvalidArgument):
                c.set_scales(0, -np.ones(m.kv_heads), np.ones(m.kv_heads))
            with self.assertRaises(attnd.InvalidArgument):
                c.set_scales(0, np.full(m.kv_heads, np.inf), np.ones(m.kv_heads))
            s = np.float32(4.5 / 127)  # N(0,1) data: |x| < 4.5 almost surely
            versions = [c.set_scales(layer, np.full(m.kv_heads, s), np.full(m.kv_heads, s))
                        for layer in range(m.layers)]
            self.assertTrue(all(v >= 1 for v in versions), versions)
            err = self.one_step(c, rng)
            self.assertLess(err, tolerance.STATIC_SCALES_E2E)
            old_epoch = c.epoch
        self.stop(d)

        d2 = self.start()  # same state directory: the scales come back
        with self.assertRaises(attnd.EpochChanged) as cm:
            with d2.client(epoch=old_epoch) as c:
                c.health()
        self.assertEqual(cm.exception.old, old_epoch)
        with d2.client() as c:
            err2 = self.one_step(c, rng)
        self.assertLess(err2, tolerance.STATIC_SCALES_E2E)
        print(f"int8 static scales: rel L2 vs bf16 reference {err:.2e}, after restart {err2:.2e}")


if __name__ == "__main__":
    unittest.main()
