#!/usr/bin/env python3
"""The done signal against waiting for the response: a by-reference decode loop
through every layer with a client-side layer body between the steps.

    bench_done.py [--attnd BUILD/daemon/attnd] [--sessions 1,16] [--context 4096]
                  [--tokens 16] [--json FILE]

CUDA backend and torch on the daemon's GPU (same-host zero-copy, docs/protocol.md
§5a). Spawns attnd with the 8B shape (32 layers, 32 q / 8 kv heads, d 128),
fills N sessions to --context tokens by reference, then decodes --tokens tokens
twice over the same sessions, per token one Plan and per layer one Step by
reference followed by the client's own layer body (an o_proj-sized matmul of the
step's output, written back into the next layer's q, so every layer depends on
the one before, as in a model):

- response: each step's response is read before the body is enqueued (what a
  client without the done signal must do);
- done: each layer's step names that layer's DoneSignal, the client's stream waits
  for it on the device and the body is enqueued at once; the response is read
  after the next layer's step is sent.

Both read their q, k and v after the previous body: step_send synchronizes the
client's stream first. Reported per mode: per-token latency p50 / p90. Speed is
measured here, never asserted.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_e2e as e2e  # noqa: E402  (also puts the client on the path)
from attnd import client as ac  # noqa: E402
from attnd import ipc as aipc  # noqa: E402


def loop(c, sh, sess, lens, tokens, mode, rng):
    import torch

    L, qh, kvh, d = sh["layers"], sh["q_heads"], sh["kv_heads"], sh["head_dim"]
    n = len(sess)
    dev = torch.device("cuda", 0)
    q = e2e.to_cuda_bf16(e2e.bf16_bits(rng, (n, qh, d)))
    kv = e2e.to_cuda_bf16(e2e.bf16_bits(rng, (n, kvh, d)))
    out = torch.empty((n, qh, d), dtype=torch.bfloat16, device=dev)
    w = (torch.randn((qh * d, qh * d), device=dev) / (qh * d) ** 0.5).to(torch.bfloat16)
    for t in (q, kv, out):
        c.ipc.keep(t)
    sigs = [aipc.DoneSignal(c, dev) for _ in range(L)] if mode == "done" else None

    def body():
        x = out.view(n, qh * d) @ w
        q.copy_(x.view(n, qh, d).clamp_(-4, 4))

    per_token = []
    for _ in range(tokens):
        plan = c.plan([ac.Item(s, lens[s], 1, tokens=[lens[s]]) for s in sess])
        for s in sess:
            lens[s] += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = []
        for layer in range(L):
            if mode == "done":
                rid = c.step_send(layer, q, kv, kv, plan=plan, out=out, done=sigs[layer])
                for p in pending:  # answered while this layer's step was prepared
                    c.step_recv(p)
                pending = [rid]
                sigs[layer].wait()
            else:
                c.step_recv(c.step_send(layer, q, kv, kv, plan=plan, out=out))
            body()
        for p in pending:
            c.step_recv(p)
        torch.cuda.synchronize()
        per_token.append((time.perf_counter() - t0) * 1e6)
    return per_token


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attnd", default=os.path.join(HERE, "..", "build", "daemon", "attnd"))
    ap.add_argument("--sessions", default="1,16")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--daemon-arg", action="append", default=[])
    ap.add_argument("--json")
    a = ap.parse_args()
    a.backend, a.kv_memory, a.no_step_trace, a.no_cuda_trace = "cuda", "0", True, True
    a.trace_window = 0
    a.sessions = [int(x) for x in a.sessions.split(",")]
    sh = e2e.SHAPES["8b"]
    tmp = tempfile.mkdtemp(prefix="attnd-bench-done-")
    p, path, log = e2e.start_daemon(a, sh, tmp, e2e.free_port(), os.path.join(tmp, "attnd.log"))
    rng = np.random.default_rng(2)
    rows = []
    try:
        with ac.Client(path, timeout=600, ipc=True) as c:
            sess, lens = [], {}
            for n in sorted(a.sessions):
                new = [int(c.open_session()[0]) for _ in range(n - len(sess))]
                if new:
                    e2e.fill(c, sh, new, a.context, rng, ipc=True)
                    sess += new
                    lens.update({s: a.context for s in new})
                for mode in ("response", "done", "response", "done"):  # each twice, interleaved
                    pt = loop(c, sh, sess[:n], lens, a.tokens, mode, rng)
                    rows.append({"sessions": n, "mode": mode, "token_p50_us": e2e.pct(pt, 0.5),
                                 "token_p90_us": e2e.pct(pt, 0.9)})
    finally:
        p.terminate()
        p.wait(timeout=60)
        log.close()
    print(f"# bench_done: 8B shape, {sh['layers']} layers, context {a.context}, "
          f"{a.tokens} tokens per run, by reference")
    print("| sessions | mode | token p50 us | token p90 us |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['sessions']} | {r['mode']} | {r['token_p50_us']:.0f} | {r['token_p90_us']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
