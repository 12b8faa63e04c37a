#!/usr/bin/env python3
"""The client's per-layer fan-out cost: a head-sharded group of two daemons vs one.

    bench_fanout.py [--attnd BUILD/daemon/attnd] [--backend cpu|cuda] [--sessions 16]
                    [--ctx 256] [--layers 4] [--iters 30] [--q-heads 8 --kv-heads 2]
                    [--head-dim 128] [--json FILE]
    bench_fanout.py --connect WHOLE_SOCK --shards SOCK_A,SOCK_B ...   (daemons already running)

Spawned daemons (the default): one holding the whole shape and two holding half
its heads each (started with --kv-heads 0:K/2 and K/2:K, their ranges reported
in Health), all with the same backend. Each session is prefilled to --ctx
(kv_only items, at most --prefill-rows rows per step), then
--iters decode steps run: one Plan, then every layer's Step sent before any
answer is read (as a pipelined orchestrator would), per configuration:

- one: attnd.Client on the whole daemon;
- sharded: attnd.sharded.ShardedClient over the two halves (slice q/k/v per
  daemon, one request each, join the outputs).

Reported per layer step (medians): with one step in flight, the wall time from
send to answer, the (slowest) daemon's own total (Timing.total_us) and their
difference, which is what the client and the transport add; the client's own
CPU time per layer (converting, slicing, encoding, joining); and, with every
layer of a step sent before any answer is read, the wall time per layer and
tokens/s = sessions / (wall per step). Speed is only
measured here, never asserted. On the GPU the two halves would sit on two GPUs
(attnd@0, attnd@1); on one host's CPUs both halves share the cores, so the
daemon time does not halve: read the client overhead rows.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import attnd  # noqa: E402
from attnd.fleet import Daemon as FleetDaemon  # noqa: E402
from attnd.sharded import ShardedClient  # noqa: E402


def spawn(binary, tmp, name, args):
    sock = os.path.join(tmp, f"{name}.sock")
    log = open(os.path.join(tmp, f"{name}.log"), "wb")
    p = subprocess.Popen([binary, "--socket", sock, "--listen", "", "--metrics", "", "--state-dir",
                          os.path.join(tmp, name)] + args, stdout=log, stderr=subprocess.STDOUT)
    os.makedirs(os.path.join(tmp, name), exist_ok=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"{name}: attnd exited {p.returncode}; see {log.name}")
        if os.path.exists(sock):
            try:
                with attnd.Client(sock, timeout=5) as c:
                    c.health()
                return p, sock
            except (attnd.AttndError, OSError):
                pass
        time.sleep(0.05)
    p.kill()
    raise SystemExit(f"{name}: no Health within 60 s")


def prefill(cl, model, a, sids, rng):
    """Every session to --ctx positions with kv_only items (no q, no output),
    at most --prefill-rows rows per step, from one random block reused for
    every step (the values do not matter for timing; bf16 bits)."""
    KV, D, L = model.kv_heads, model.head_dim, a.layers
    per = max(1, a.prefill_rows // a.ctx)
    blk = attnd.f32_to_bf16(rng.standard_normal((per * a.ctx, KV, D)).astype(np.float32))
    for g in range(0, len(sids), per):
        group = sids[g:g + per]
        plan = cl.plan([attnd.Item(s, 0, a.ctx, tokens=[1] * a.ctx, kv_only=True) for s in group])
        rows = len(group) * a.ctx
        for layer in range(L):
            cl.step(layer, None, blk[:rows], blk[:rows], plan=plan)


def run(cl, model, a, seed):
    rng = np.random.default_rng(seed)
    H, KV, D, L = model.q_heads, model.kv_heads, model.head_dim, a.layers
    B = a.sessions
    sids = [cl.open_session()[0] for _ in range(B)]
    prefill(cl, model, a, sids, rng)
    # Fresh inputs per layer, prepared before timing (bf16 bits, as an orchestrator holds them).
    pre = [[attnd.f32_to_bf16(rng.standard_normal((B, h, D)).astype(np.float32)) for h in (H, KV, KV)]
           for _ in range(L)]
    # Synchronous: one layer step in flight; wall minus the daemon's own total is
    # what the client and the transport add to a layer.
    walls, servers, cpu, pipe = [], [], [], []
    pos = a.ctx
    for it in range(a.iters + 2):
        plan = cl.plan([attnd.Item(s, pos, 1, tokens=[1]) for s in sids])
        pos += 1
        for layer in range(L):
            t0, c0 = time.perf_counter(), time.process_time()
            r = cl.step_recv(cl.step_send(layer, *pre[layer], plan=plan))
            wall, c1 = time.perf_counter() - t0, time.process_time()
            if it >= 2:  # warm-up
                walls.append(wall)
                servers.append(r.timing.total_us * 1e-6)
                cpu.append(c1 - c0)
    # Pipelined: every layer sent before any answer is read (throughput).
    for it in range(a.iters + 2):
        plan = cl.plan([attnd.Item(s, pos, 1, tokens=[1]) for s in sids])
        pos += 1
        t0 = time.perf_counter()
        ids = [cl.step_send(layer, *pre[layer], plan=plan) for layer in range(L)]
        for i in ids:
            cl.step_recv(i)
        if it >= 2:
            pipe.append((time.perf_counter() - t0) / L)
    for s in sids:
        cl.close_session(s)
    w, sv, c, pw = (float(np.median(x)) for x in (walls, servers, cpu, pipe))
    return {"layer_wall_us": w * 1e6, "layer_daemon_us": sv * 1e6, "layer_client_overhead_us": (w - sv) * 1e6,
            "layer_client_cpu_us": c * 1e6, "pipelined_layer_us": pw * 1e6, "tokens_per_s": B / (pw * L)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attnd", default=os.path.join(HERE, "..", "build", "daemon", "attnd"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--connect", help="socket of a daemon holding the whole model")
    ap.add_argument("--shards", help="comma-separated sockets of the two halves (kv heads 0:K/2, K/2:K)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-cache", default="bf16")
    ap.add_argument("--threads", type=int, default=1, help="CPU backend threads per daemon")
    ap.add_argument("--prefill-rows", type=int, default=16384,
                    help="most rows per prefill step (kv_only, one plan per group of sessions)")
    ap.add_argument("--max-context", type=int, default=0, help="spawned daemons' --max-context (0: ctx + iters + 64)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.kv_heads % 2:
        raise SystemExit("--kv-heads must be even (two halves)")
    tmp = None
    procs = []
    try:
        half = a.kv_heads // 2
        if a.connect:
            whole, shards = a.connect, a.shards.split(",")
            declared = [None, None]
        else:
            tmp = tempfile.mkdtemp(prefix="attnd-fanout-")
            mc = a.max_context or max(4096, a.ctx + 2 * a.iters + 64)
            common = ["--backend", a.backend, "--layers", str(a.layers), "--head-dim", str(a.head_dim),
                      "--kv-cache", a.kv_cache, "--max-context", str(mc)]
            if a.backend == "cpu":
                common += ["--threads", str(a.threads), "--kv-memory", "1G"]
            p, whole = spawn(a.attnd, tmp, "whole", common + ["--q-heads", str(a.q_heads), "--kv-heads",
                                                              str(a.kv_heads)])
            procs.append(p)
            shards = []
            for i in range(2):
                rng_ = f"{i * half}:{(i + 1) * half}"  # --kv-heads A:B: the daemon reports its range
                p, s = spawn(a.attnd, tmp, f"half{i}", common + ["--q-heads", str(a.q_heads), "--kv-heads",
                                                                  str(a.kv_heads), "--kv-heads", rng_])
                procs.append(p)
                shards.append(s)
            declared = [None, None]
        out = {"sessions": a.sessions, "ctx": a.ctx, "layers": a.layers, "q_heads": a.q_heads,
               "kv_heads": a.kv_heads, "head_dim": a.head_dim, "backend": a.backend, "kv_cache": a.kv_cache}
        with attnd.Client(whole, timeout=120) as one:
            out["one"] = run(one, one.model, a, 1)
        fl = [FleetDaemon(f"half{i}", s, kv_heads=declared[i], timeout=120) for i, s in enumerate(shards)]
        with ShardedClient(fl) as sh:
            out["sharded"] = run(sh, sh.model, a, 1)
        o, s = out["one"], out["sharded"]
        out["fanout_overhead_us"] = s["layer_client_overhead_us"] - o["layer_client_overhead_us"]
        out["speedup"] = s["tokens_per_s"] / o["tokens_per_s"]
        print(f"{'':10} {'wall/layer':>12} {'daemon':>10} {'client+io':>10} {'client cpu':>11} "
              f"{'pipelined':>10} {'tokens/s':>10}")
        for k in ("one", "sharded"):
            r = out[k]
            print(f"{k:10} {r['layer_wall_us']:10.0f}us {r['layer_daemon_us']:8.0f}us "
                  f"{r['layer_client_overhead_us']:8.0f}us {r['layer_client_cpu_us']:9.0f}us "
                  f"{r['pipelined_layer_us']:8.0f}us {r['tokens_per_s']:10.0f}")
        print(f"fan-out overhead per layer (sharded - one, client+io): {out['fanout_overhead_us']:.0f} us; "
              f"tokens/s ratio {out['speedup']:.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
