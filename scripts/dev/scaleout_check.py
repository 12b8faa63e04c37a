#!/usr/bin/env python3
"""Scale-out equality on running daemons (docs/scale-out.md), for the GPU rounds.

    scaleout_check.py --whole SOCK [--shards SOCK,SOCK,...] [--split SOCK,SOCK,...]
                      [--part-len 512] [--json FILE]

--shards: a head-sharded group (daemons started with --kv-heads A:B) against the
daemon holding the whole model: prefill of four sessions (1000, 300, 64, 17
tokens), eight pipelined decode steps, bf16 out with lse and fp32 out, bit for
bit. --split: a split-context group (SplitClient, parts of --part-len
positions) against the whole daemon: chunked prefill and decode, fp32 out and
lse within 1e-3. Every layer of the daemons' shape is stepped. Prints one JSON
line and exits 1 when a check fails.
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

import attnd  # noqa: E402
from attnd.sharded import ShardedClient  # noqa: E402
from attnd.split import SplitClient  # noqa: E402


def sharded_run(cl, m, seed, fp32_out):
    rng = np.random.default_rng(seed)
    H, KV, D, L = m.q_heads, m.kv_heads, m.head_dim, m.layers
    prompts = [list(rng.integers(0, 32000, n)) for n in (1000, 300, 64, 17)]
    sids = [cl.open_session(p)[0] for p in prompts]
    lens = [len(p) for p in prompts]
    outs = []
    for sid, p in zip(sids, prompts):  # one session per prefill step: frames stay small
        plan = cl.plan([attnd.Item(sid, 0, len(p), tokens=p)])
        for layer in range(L):
            q, k, v = (rng.standard_normal((len(p), h, D)).astype(np.float32) for h in (H, KV, KV))
            r = cl.step(layer, q, k, v, plan=plan, want_lse=True, fp32_out=fp32_out)
            outs += [r.out, r.lse]
    for _ in range(8):
        plan = cl.plan([attnd.Item(s, n, 1, tokens=[int(rng.integers(32000))]) for s, n in zip(sids, lens)])
        ids = []
        for layer in range(L):
            q, k, v = (rng.standard_normal((len(sids), h, D)).astype(np.float32) for h in (H, KV, KV))
            ids.append(cl.step_send(layer, q, k, v, plan=plan, want_lse=True, fp32_out=fp32_out))
        for i in ids:
            r = cl.step_recv(i)
            outs += [r.out, r.lse]
        lens = [n + 1 for n in lens]
    for s in sids:
        cl.close_session(s)
    return outs


def split_run(cl, m, seed, chunks=(600, 300, 200), decode=8):
    rng = np.random.default_rng(seed)
    H, KV, D, L = m.q_heads, m.kv_heads, m.head_dim, m.layers
    sids = [cl.open_session()[0] for _ in range(2)]
    lens = [0, 0]
    res = []
    for n in list(chunks) + [1] * decode:
        plan = cl.plan([attnd.Item(s, ln, n, tokens=list(rng.integers(0, 32000, n))) for s, ln in zip(sids, lens)])
        for layer in range(L):
            q, k, v = (rng.standard_normal((2 * n, h, D)).astype(np.float32) for h in (H, KV, KV))
            if isinstance(cl, SplitClient):
                r = cl.step(layer, q, k, v, plan=plan)
            else:
                r = cl.step(layer, q, k, v, plan=plan, want_lse=True, fp32_out=True)
            res.append((np.asarray(r.out, np.float32), np.asarray(r.lse, np.float32)))
        lens = [x + n for x in lens]
    nparts = len(cl.session(sids[0]).parts) if isinstance(cl, SplitClient) else 1
    for s in sids:
        cl.close_session(s)
    return res, nparts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--whole", required=True)
    ap.add_argument("--shards")
    ap.add_argument("--split")
    ap.add_argument("--part-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    out, ok = {}, True
    with attnd.Client(a.whole, timeout=300) as one:
        h = one.health()
        m = one.model
        out["whole"] = {"backend": h.backend, "device": h.device, "layers": m.layers, "q_heads": m.q_heads,
                        "kv_heads": m.kv_heads, "kv_cache": m.kv_cache}
        if a.shards:
            with ShardedClient(a.shards.split(","), timeout=300) as sh:
                out["shards"] = [f"{s.kv_begin}:{s.kv_end}" for s in sh.shards]
                for fp32 in (False, True):
                    x = sharded_run(one, m, a.seed, fp32)
                    y = sharded_run(sh, sh.model, a.seed, fp32)
                    bad = [i for i, (u, w) in enumerate(zip(x, y))
                           if u.shape != w.shape or not np.array_equal(u.view(np.uint8), w.view(np.uint8))]
                    key = "sharded_fp32_bitequal" if fp32 else "sharded_bf16_bitequal"
                    out[key] = not bad and len(x) == len(y)
                    if bad:
                        u, w = x[bad[0]], y[bad[0]]
                        out[key + "_first_diff"] = {"output": bad[0], "count": len(bad), "of": len(x),
                                                    "max_abs": float(np.abs(u.astype(np.float32) -
                                                                            w.astype(np.float32)).max())}
                    ok &= out[key]
        if a.split:
            with SplitClient(a.split.split(","), a.part_len, timeout=300) as sp:
                # Another seed than the sharded runs': the same token ids with other
                # k/v would find the whole daemon's published blocks of those runs
                # (prefix blocks are named by their tokens), which no part holds.
                ra, _ = split_run(one, m, a.seed + 1)
                rb, nparts = split_run(sp, sp.model, a.seed + 1)
            worst = 0.0
            for (oa, la), (ob, lb) in zip(ra, rb):
                worst = max(worst, float(np.abs(oa - ob).max()))
                fin = ~np.isneginf(la)
                if (np.isneginf(la) != np.isneginf(lb)).any():
                    worst = float("inf")
                else:
                    worst = max(worst, float(np.abs(la[fin] - lb[fin]).max(initial=0)))
            out["split_parts"] = nparts
            out["split_max_abs"] = worst
            out["split_within_1e-3"] = worst < 1e-3
            ok &= out["split_within_1e-3"]
    out["ok"] = bool(ok)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
