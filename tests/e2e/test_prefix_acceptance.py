"""Acceptance check of "Prefix caching, Fork and Truncate" for every kv cache type.

A shared 2,000-token prompt and 50 sessions: session 1 prefills prompt + suffix in
chunks, the other 49 open with the prompt + their own 8..40-token suffix, get
cached_len (the whole-block prefix) and send only the tokens from there on, then all
50 decode a few tokens. The same token streams and q/k/v go to a second daemon started
with --no-prefix-cache, which is given the cached prefix's k and v (kv_only items) and
computes everything else. Checked per type: outputs (fp32) equal between the daemons
within relative L2 tolerance.PREFIX_HIT per session and step; blocks in use about one prompt plus the
suffixes (far below 50 prompts' worth, which the no-cache daemon shows); the hit
counters; cached blocks outlive their sessions and hit again; another salt or another
identity (anonymous loopback TCP instead of the Unix socket uid) never hits.

For prefix reuse to mean anything, k and v of a token are a deterministic function of
(token id, position, layer): a per-token-id seeded RNG plus a fixed per-position table.
"""
import unittest

import numpy as np

import attnd
from harness import SMALL_SHAPE, Daemon, daemon_binary
from reference import rel_l2
import tolerance

PROMPT = 2000
SESSIONS = 50
SUFFIX = (8, 40)  # inclusive
DECODE = 3
CHUNK = 512  # session 1's prefill chunks (a multiple of the block size)
VOCAB = 4096
SEED = 20261129
TOL = tolerance.PREFIX_HIT
SLACK = 2  # blocks
TYPES = ["bf16", "fp16", "int8", "fp8", "int8_dynamic", "fp8_dynamic", "int4"]

# The no-cache daemon holds 50 full streams: ~100K tokens at 1 KiB (bf16, 2 layers).
SHAPE = list(SMALL_SHAPE)
SHAPE[SHAPE.index("--kv-memory") + 1] = "160M"


class Data:
    """Token streams, per-token k/v and q, shared by every kv type (built once)."""

    def __init__(self, layers, kv_heads, q_heads, head_dim, bs):
        rng = np.random.default_rng(SEED)
        self.bs = bs
        self.prompt = rng.integers(0, VOCAB, PROMPT)
        self.streams, self.lens = [], []  # stream = prompt + suffix + decode tokens
        for _ in range(SESSIONS):
            nsuf = int(rng.integers(SUFFIX[0], SUFFIX[1] + 1))
            tail = rng.integers(0, VOCAB, nsuf + DECODE)
            self.streams.append(np.concatenate([self.prompt, tail]))
            self.lens.append(PROMPT + nsuf)  # what OpenSession sees; decode follows
        maxpos = max(len(s) for s in self.streams) + 64
        # k/v of token t at position p in layer l: tok[t, l] + 0.5 * pos[p, l].
        tok = np.empty((VOCAB, layers, 2, kv_heads, head_dim), np.float32)
        for t in range(VOCAB):
            tok[t] = np.random.default_rng([SEED, t]).standard_normal(tok.shape[1:], np.float32)
        self.tok = tok
        self.pos = 0.5 * np.random.default_rng([SEED, 1 << 30]).standard_normal(
            (maxpos, layers, 2, kv_heads, head_dim), np.float32)
        # q for every position a session computes (session 0: all; others: past the prompt
        # blocks); drawn per session, only needed to be the same for both daemons.
        self.q = []
        for s in range(SESSIONS):
            first = 0 if s == 0 else self.expected_cached(s)
            self.q.append((first, rng.standard_normal((layers, len(self.streams[s]) - first, q_heads,
                                                       head_dim), np.float32)))
        # Fresh suffixes for the reopen-after-close checks.
        self.extra = rng.integers(0, VOCAB, 24)

    def expected_cached(self, s):
        return min(PROMPT, self.lens[s] - 1) // self.bs * self.bs

    def kv(self, s, start, n, layer):
        toks = self.streams[s][start:start + n]
        kv = self.tok[toks, layer] + self.pos[start:start + n, layer]
        return kv[:, 0], kv[:, 1]

    def qrows(self, s, start, n, layer):
        first, q = self.q[s]
        assert start >= first
        return q[layer, start - first:start - first + n]


_DATA = {}


def data_for(m):
    key = (m.layers, m.kv_heads, m.q_heads, m.head_dim, m.block_size)
    if key not in _DATA:
        _DATA[key] = Data(*key)
    return _DATA[key]


def static_scales(kv, m):
    """Same static scales for both daemons; |k|, |v| stay below ~6 for this data."""
    H, D = m.kv_heads, m.head_dim
    if kv == "int8":
        return [np.full(H, 7.0 / 127, np.float32)] * 2, None
    if kv == "fp8":
        return [np.full(H, 8.0 / 448, np.float32)] * 2, None
    if kv == "int4":
        return [np.full((H, D), 0.9, np.float32)] * 2, [np.full((H, D), 7.5, np.float32)] * 2
    return None, None


class PrefixAcceptanceTest(unittest.TestCase):
    report = []

    @classmethod
    def tearDownClass(cls):
        if cls.report:
            print("\nprefix acceptance (2 layers, 4q/2kv heads, d 64, block 16; "
                  f"{SESSIONS} sessions, {PROMPT}-token prompt):")
            for line in cls.report:
                print("  " + line)

    def setUp(self):
        if daemon_binary() is None:
            self.skipTest("attnd is not built yet")
        self.daemons = []
        self.clients = []

    def tearDown(self):
        for c in self.clients:
            c.close()
        for d in self.daemons:
            try:
                code = d.stop()
                log = d.log_text()
            finally:
                d.close()
            self.assertEqual(code, 0, log)

    def start(self, args):
        d = Daemon(args, shape=SHAPE)
        self.daemons.append(d)
        return d

    def client(self, d, **kw):
        c = d.client(**kw)
        self.clients.append(c)
        return c

    def both_steps(self, ca, cb, plan_a, plan_b, rows, worst, what):
        """Sends every layer's step of the plans to both daemons (pipelined so they compute
        at once), then checks each session's output rows match. rows: [(s, start, n)]."""
        m = ca.model
        ids = []
        for layer in range(m.layers):
            q = np.concatenate([self.d.qrows(s, st, n, layer) for s, st, n in rows])
            kk, vv = zip(*(self.d.kv(s, st, n, layer) for s, st, n in rows))
            k, v = np.concatenate(kk), np.concatenate(vv)
            ids.append((layer, ca.step_send(layer, q, k, v, plan=plan_a, fp32_out=True),
                        cb.step_send(layer, q, k, v, plan=plan_b, fp32_out=True)))
        for layer, ia, ib in ids:
            oa, ob = ca.step_recv(ia).out, cb.step_recv(ib).out
            self.assertEqual(oa.dtype, np.float32)
            self.assertEqual(oa.shape, ob.shape)
            r0 = 0
            for s, st, n in rows:
                err = rel_l2(oa[r0:r0 + n], ob[r0:r0 + n])
                self.assertTrue(np.isfinite(oa[r0:r0 + n]).all())
                worst[0] = max(worst[0], err)
                self.assertLessEqual(err, TOL, f"{what}: session {s} layer {layer} positions {st}..{st + n}")
                r0 += n

    def run_type(self, kv):
        args = ["--kv-cache", kv] + (["--dtype", "fp16"] if kv == "fp16" else [])
        da, db = self.start(args), self.start(args + ["--no-prefix-cache"])
        da.wait_ready()
        db.wait_ready()
        ca, cb = self.client(da), self.client(db)
        m = ca.model
        self.assertEqual(m.kv_cache, kv)
        self.assertEqual(cb.model.kv_cache, kv)
        bs = m.block_size
        self.d = d = data_for(m)

        scales, zeros = static_scales(kv, m)
        if scales is not None:
            for c in (ca, cb):
                for layer in range(m.layers):
                    if zeros is None:
                        c.set_scales(layer, scales[0], scales[1])
                    else:
                        c.set_scales(layer, scales[0], scales[1], zeros[0], zeros[1])

        worst = [0.0]
        sa, sb, cached = [], [], []
        # Session 1 (index 0): the whole prompt + its suffix, in chunks, on both daemons.
        for s in range(SESSIONS):
            toks = d.streams[s][:d.lens[s]].tolist()
            ida, ca_len = ca.open_session(toks)
            idb, cb_len = cb.open_session(toks)
            self.assertEqual(cb_len, 0, "the --no-prefix-cache daemon never hits")
            if s == 0:
                self.assertEqual(ca_len, 0, "nothing is cached before session 1")
                for st in range(0, d.lens[0], CHUNK):
                    n = min(CHUNK, d.lens[0] - st)
                    tk = d.streams[0][st:st + n].tolist()
                    pa = ca.plan([attnd.Item(ida, st, n, tokens=tk)])
                    pb_ = cb.plan([attnd.Item(idb, st, n, tokens=tk)])
                    self.both_steps(ca, cb, pa, pb_, [(0, st, n)], worst, f"{kv} prefill")
            else:
                # Whole blocks of the shared prompt, never the last token.
                self.assertEqual(ca_len, d.expected_cached(s), f"session {s} cached_len")
                self.assertEqual(ca_len % bs, 0)
                self.assertLessEqual(ca_len, d.lens[s] - 1)
            sa.append(ida)
            sb.append(idb)
            cached.append(ca_len)

        # The no-cache daemon imports the cached prefix's k/v (kv_only; nothing attended).
        others = list(range(1, SESSIONS))
        for g in range(0, len(others), 10):
            grp = others[g:g + 10]
            pb_ = cb.plan([attnd.Item(sb[s], 0, cached[s], tokens=d.streams[s][:cached[s]].tolist(),
                                      kv_only=True) for s in grp])
            ids = []
            for layer in range(m.layers):
                kk, vv = zip(*(d.kv(s, 0, cached[s], layer) for s in grp))
                ids.append(cb.step_send(layer, None, np.concatenate(kk), np.concatenate(vv), plan=pb_))
            for i in ids:
                cb.step_recv(i)

        # The 49 tails (from cached_len on) in one step, the same on both daemons.
        rows = [(s, cached[s], d.lens[s] - cached[s]) for s in others]
        def items(ids, rows):
            return [attnd.Item(ids[s], st, n, tokens=d.streams[s][st:st + n].tolist()) for s, st, n in rows]

        self.both_steps(ca, cb, ca.plan(items(sa, rows)), cb.plan(items(sb, rows)), rows, worst,
                        f"{kv} suffix")

        # A few decode steps of all 50 sessions.
        for i in range(DECODE):
            rows = [(s, d.lens[s] + i, 1) for s in range(SESSIONS)]
            self.both_steps(ca, cb, ca.plan(items(sa, rows)), cb.plan(items(sb, rows)), rows, worst,
                            f"{kv} decode {i}")

        # Memory: one prompt's blocks plus each session's own (suffix + decode) blocks.
        st_a, st_b = ca.stats(), cb.stats()
        prompt_blocks = PROMPT // bs
        own = sum(-(-(d.lens[s] + DECODE - cached[s]) // bs) for s in range(1, SESSIONS))
        own += -(-(d.lens[0] + DECODE) // bs) - prompt_blocks
        expected = prompt_blocks + own
        naive = sum(-(-(d.lens[s] + DECODE) // bs) for s in range(SESSIONS))
        self.assertLessEqual(st_a.blocks_used, expected + SLACK, st_a)
        self.assertGreaterEqual(st_a.blocks_used, expected, st_a)
        self.assertLess(st_a.blocks_used * 10, naive, "far below 50 prompts' worth")
        self.assertEqual(st_b.blocks_used, naive, "the no-cache daemon holds every stream whole")
        hit = sum(cached)
        self.assertEqual(st_a.prefix_queries, SESSIONS)
        self.assertEqual(st_a.prefix_hit_tokens, hit)
        self.assertEqual(hit, (SESSIONS - 1) * PROMPT)
        self.assertEqual(st_a.prefix_miss_tokens, sum(d.lens) - hit)
        self.assertEqual(st_b.prefix_queries, 0)
        self.assertEqual(st_b.prefix_hit_tokens, 0)
        self.assertEqual(st_b.cow_copies, 0)
        self.assertEqual(st_a.cow_copies, 0, "tails start on a fresh block: nothing to copy")
        per_tok = st_a.kv_bytes_per_token

        # Closed sessions leave their published blocks cached; the prompt hits again.
        for sid in sa:
            ca.close_session(sid)
        st_c = ca.stats()
        self.assertEqual(st_c.blocks_used, 0)
        self.assertGreaterEqual(st_c.blocks_cached, prompt_blocks)
        toks = d.prompt.tolist() + d.extra.tolist()
        sid, again = ca.open_session(toks)
        self.assertEqual(again, PROMPT, "the prompt hits again after every session closed")
        ca.close_session(sid)
        # Another salt, or another identity, never shares.
        sid, salted = ca.open_session(toks, salt=b"another tenant")
        self.assertEqual(salted, 0, "a different salt must not hit")
        ca.close_session(sid)
        with attnd.Client(("127.0.0.1", da.tcp_port), timeout=30) as ct:  # anonymous loopback identity
            sid, other = ct.open_session(toks)
            self.assertEqual(other, 0, "a different identity must not hit")
            ct.close_session(sid)

        self.report.append(
            f"{kv:13s} blocks used {st_a.blocks_used:5d} (expected {expected}, naive {naive}: "
            f"{naive / st_a.blocks_used:.1f}x) = {st_a.blocks_used * bs * per_tok / 2**20:.2f} MiB vs "
            f"{naive * bs * per_tok / 2**20:.2f} MiB; hit tokens {st_a.prefix_hit_tokens} in "
            f"{st_a.prefix_queries} queries, miss {st_a.prefix_miss_tokens}; cached after close "
            f"{st_c.blocks_cached}; worst rel L2 {worst[0]:.2e}")


def _make(kv):
    def test(self):
        self.run_type(kv)
    test.__name__ = f"test_{kv}"
    test.__doc__ = f"prefix caching acceptance with a {kv} cache"
    return test


for _kv in TYPES:
    setattr(PrefixAcceptanceTest, f"test_{_kv}", _make(_kv))


if __name__ == "__main__":
    unittest.main()
