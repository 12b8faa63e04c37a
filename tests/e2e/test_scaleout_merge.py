"""The lse merge of split-context parts (attnd.lse) against a float64 reference.

The reference attends over all keys at once in float64; the parts attend over a
partition of the keys (float64, then rounded to fp32 as a daemon returns them)
and are merged. Fully masked parts and fully masked rows are included.
"""
import os
import unittest

import numpy as np

from attnd.lse import LseMerger, merge

SEED = int(os.environ.get("ATTND_TEST_SEED", np.random.SeedSequence().entropy % (1 << 31)))


def attend64(q, K, V, vis, scale):
    """q [T, H, D], K/V [L, H, D], vis [T, L] -> out [T, H, D], lse [T, H] (float64)."""
    s = np.einsum("thd,lhd->thl", q, K) * scale
    s = np.where(vis[:, None, :], s, -np.inf)
    m = s.max(axis=2, keepdims=True) if K.shape[0] else np.full(s.shape[:2] + (1,), -np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis[:, None, :], np.exp(s - m), 0.0)
    z = p.sum(axis=2)
    ok = z > 0
    out = np.where(ok[..., None], np.einsum("thl,lhd->thd", p, V) / np.where(ok, z, 1)[..., None], 0.0)
    lse = np.where(ok, np.log(np.where(ok, z, 1)) + m[..., 0], -np.inf)
    return out, lse


class MergeTest(unittest.TestCase):
    def setUp(self):
        print(f"seed {SEED}")
        self.rng = np.random.default_rng(SEED)

    def parts(self, T=6, H=3, D=16, L=40, cuts=(0, 13, 27, 40), vis=None, scale=0.25, big=1.0):
        rng = self.rng
        q = rng.standard_normal((T, H, D)) * big
        K = rng.standard_normal((L, H, D)) * big
        V = rng.standard_normal((L, H, D))
        if vis is None:
            vis = np.ones((T, L), bool)
        ref = attend64(q, K, V, vis, scale)
        outs, lses = [], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            o, l = attend64(q, K[a:b], V[a:b], vis[:, a:b], scale)
            outs.append(o.astype(np.float32))
            lses.append(l.astype(np.float32))
        return ref, outs, lses

    def check(self, ref, got, tol=2e-6):
        out, lse = got
        self.assertEqual(out.dtype, np.float32)
        self.assertEqual(lse.dtype, np.float32)
        self.assertTrue(np.isfinite(out).all())
        rmask = np.isneginf(ref[1])
        np.testing.assert_array_equal(np.isneginf(lse), rmask)
        np.testing.assert_allclose(out, ref[0], rtol=0, atol=tol)
        np.testing.assert_allclose(lse[~rmask], ref[1][~rmask], rtol=tol, atol=tol)
        self.assertTrue((out[rmask] == 0).all(), "a fully masked row must be exactly 0")

    def test_partition_equals_whole(self):
        ref, outs, lses = self.parts()
        self.check(ref, merge(outs, lses))

    def test_order_does_not_matter(self):
        ref, outs, lses = self.parts()
        self.check(ref, merge(outs[::-1], lses[::-1]))

    def test_large_scores(self):
        # lse far from 0 (scores of several hundred): the max shift keeps exp finite.
        ref, outs, lses = self.parts(big=6.0, scale=1.0)
        self.assertGreater(np.abs(np.concatenate(lses)).max(), 80)
        self.check(ref, merge(outs, lses), tol=1e-4)

    def test_fully_masked_part_contributes_nothing(self):
        T, L = 5, 30
        vis = np.tril(np.ones((T, L), bool), k=L - T)  # causal for rows at L-T..L-1
        vis[:, 10:20] = False  # the middle part sees nothing of any row
        ref, outs, lses = self.parts(T=T, L=L, cuts=(0, 10, 20, 30), vis=vis)
        self.assertTrue(np.isneginf(lses[1]).all())
        self.assertTrue((outs[1] == 0).all())
        self.check(ref, merge(outs, lses))
        # The same without the masked part: identical bits.
        a = merge(outs, lses)
        b = merge([outs[0], outs[2]], [lses[0], lses[2]])
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])

    def test_rows_masked_in_some_parts(self):
        # Sliding window 8 over 3 parts: early rows see only the first part,
        # late rows only the last: per row a different subset of parts is masked.
        T, L = 30, 30
        p, j = np.arange(T)[:, None], np.arange(L)[None, :]
        vis = (j <= p) & (j > p - 8)
        ref, outs, lses = self.parts(T=T, L=L, cuts=(0, 10, 20, 30), vis=vis)
        self.assertTrue(np.isneginf(np.stack(lses)).any())
        self.check(ref, merge(outs, lses))

    def test_all_parts_masked(self):
        T, L = 4, 12
        vis = np.ones((T, L), bool)
        vis[1] = False  # row 1 sees no key in any part
        vis[3, :] = False
        ref, outs, lses = self.parts(T=T, L=L, cuts=(0, 5, 12), vis=vis)
        out, lse = merge(outs, lses)
        self.assertTrue(np.isneginf(lse[1]).all() and np.isneginf(lse[3]).all())
        self.assertTrue((out[1] == 0).all() and (out[3] == 0).all())
        self.check(ref, (out, lse))

    def test_single_part_is_identity(self):
        ref, outs, lses = self.parts(cuts=(0, 40))
        out, lse = merge(outs, lses)
        np.testing.assert_allclose(out, outs[0], rtol=0, atol=1e-7)
        np.testing.assert_allclose(lse, lses[0], rtol=1e-7)

    def test_rows_of_different_parts(self):
        # Parts that cover different row ranges (items of a split step on different
        # daemons) merge into one result through add(rows=...).
        ref, outs, lses = self.parts(T=6)
        mg = LseMerger((6, 3), 16)
        for o, l in zip(outs, lses):
            mg.add(o[:4], l[:4], slice(0, 4))
            mg.add(o[4:], l[4:], slice(4, 6))
        self.check(ref, mg.result())

    def test_bad_parts_rejected(self):
        ref, outs, lses = self.parts()
        bad = lses[0].copy()
        bad[0, 0] = np.nan
        with self.assertRaises(ValueError):
            merge(outs, [bad] + lses[1:])
        bad[0, 0] = np.inf
        with self.assertRaises(ValueError):
            merge(outs, [bad] + lses[1:])
        bad = lses[0].copy()
        bad[0, 0] = -np.inf  # no visible key, yet out says otherwise
        with self.assertRaises(ValueError):
            merge(outs, [bad] + lses[1:])
        with self.assertRaises(ValueError):
            merge(outs, lses[:-1])
        with self.assertRaises(ValueError):
            merge([], [])
        with self.assertRaises(ValueError):
            merge([outs[0][:, :, :8]] + outs[1:], lses)


if __name__ == "__main__":
    unittest.main()
