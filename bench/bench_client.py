#!/usr/bin/env python3
"""The Python client's own cost of a small (decode-shaped) Step over the Unix socket.

    bench_client.py [--attnd BUILD/daemon/attnd] [--backend cpu|cuda] [--ctx 300]
                    [--iters 3000] [--rounds 3] [--path old,new] [--lse] [--json FILE]

Spawns attnd (the CPU backend unless --backend cuda; 32 layers, 32 q / 8 kv
heads, d128, bf16), opens one session of --ctx tokens (prefilled), plans one
decode token after them and sends the Steps of that plan layer after layer (a second Step of a
layer is a rewrite: the session's length stays put). Per path it reports the
medians, in microseconds, of:

  encode      q, k, v to the frame's pieces (no I/O)
  send        the frame's sendmsg
  wait        until the answer is readable (the daemon's work and the wake-up)
  recv+parse  reading the answer and making its StepResult
  step        a whole Client.step() (send, wait, receive), timed on its own

"old" is the client's general path (Client._fast_steps = False: the per-tensor
_wire, step_frame_plan, the protobuf parse of the answer), "new" the fast path
(_frames.step_frame_sig, _frames.parse_step_ok). Both run in one process, each
path's loops interleaved in rounds, against one daemon. Speed is only measured
here, never asserted.
"""
import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import numpy as np  # noqa: E402

import attnd  # noqa: E402
from attnd import _frames  # noqa: E402
from attnd import client as ac  # noqa: E402

LAYERS, QH, KVH, D = 32, 32, 8, 128


def spawn(binary, tmp, backend="cpu"):
    sock = os.path.join(tmp, "attnd.sock")
    args = [binary, "--backend", backend, "--socket", sock, "--listen", "", "--metrics", "",
            "--state-dir", tmp, "--kv-memory", "512M", "--layers", str(LAYERS), "--q-heads", str(QH),
            "--kv-heads", str(KVH), "--head-dim", str(D), "--block-size", "16"]
    log = open(os.path.join(tmp, "attnd.log"), "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"attnd exited with {proc.returncode}; see {tmp}/attnd.log")
        if os.path.exists(sock):
            try:
                with attnd.Client(sock, timeout=5) as c:
                    c.health()
                return proc, sock
            except (attnd.AttndError, OSError):
                pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("attnd did not answer Health within 20 s")


def bits(rng, shape):
    return ac.f32_to_bf16(rng.standard_normal(shape).astype(np.float32) * 0.5)


def encode_old(c, layer, plan, q, k, v, want_lse):
    rid = c._next_id
    c._next_id += 1
    tensors = [(name,) + tuple(c._wire(a, name)) for name, a in (("q", q), ("k", k), ("v", v))]
    return rid, _frames.step_frame_plan(rid, layer, plan, want_lse, False, tensors)


def encode_new(c, layer, plan, q, k, v, want_lse):
    rid = c._next_id
    c._next_id += 1
    return rid, c._fast_frame(rid, layer, plan, q, k, v, want_lse, False)


def phases(c, path, plan, q, k, v, want_lse, iters):
    ac.Client._fast_steps = path == "new"
    enc = encode_new if path == "new" else encode_old
    sock = c._conn()
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLIN)
    t = {n: [] for n in ("encode", "send", "wait", "recv+parse")}
    pc = time.perf_counter_ns
    for i in range(iters):
        layer = i % LAYERS
        t0 = pc()
        rid, (pieces, n) = enc(c, layer, plan, q, k, v, want_lse)
        t1 = pc()
        _frames.sendmsg_all(sock, pieces, n)
        t2 = pc()
        if c._rlen == c._rpos:
            poll.poll()
        t3 = pc()
        r = c.step_recv(rid)
        t4 = pc()
        assert r.out is not None and r.out.shape == (1, QH, D)
        for name, a, b in (("encode", t0, t1), ("send", t1, t2), ("wait", t2, t3), ("recv+parse", t3, t4)):
            t[name].append(b - a)
    return t


def whole(c, path, plan, q, k, v, want_lse, iters):
    ac.Client._fast_steps = path == "new"
    out = []
    pc = time.perf_counter_ns
    for i in range(iters):
        t0 = pc()
        c.step(i % LAYERS, q, k, v, plan=plan, want_lse=want_lse)
        out.append(pc() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attnd", default=os.environ.get("ATTND_BIN")
                    or os.path.join(HERE, "..", "build-cpu", "daemon", "attnd"))
    ap.add_argument("--backend", default="cpu", help="the daemon's backend: cpu or cuda")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--path", default="old,new")
    ap.add_argument("--lse", action="store_true", help="want_lse on every step")
    ap.add_argument("--json")
    a = ap.parse_args()
    paths = a.path.split(",")
    tmp = tempfile.mkdtemp(prefix="attnd-bench-client-")
    proc, sock = spawn(a.attnd, tmp, a.backend)
    rng = np.random.default_rng(1)
    try:
        with attnd.Client(sock, timeout=30) as c:
            sid, _ = c.open_session()
            pre = c.plan([ac.Item(sid, 0, a.ctx, tokens=range(a.ctx))])
            for layer in range(LAYERS):
                c.step(layer, bits(rng, (a.ctx, QH, D)), bits(rng, (a.ctx, KVH, D)),
                       bits(rng, (a.ctx, KVH, D)), plan=pre)
            plan = c.plan([ac.Item(sid, a.ctx, 1, tokens=[7])])
            q, k, v = bits(rng, (1, QH, D)), bits(rng, (1, KVH, D)), bits(rng, (1, KVH, D))
            res = {p: {n: [] for n in ("encode", "send", "wait", "recv+parse", "step")} for p in paths}
            for p in paths:  # warm-up
                phases(c, p, plan, q, k, v, a.lse, 200)
                whole(c, p, plan, q, k, v, a.lse, 200)
            for _ in range(a.rounds):
                for p in paths:
                    for n, xs in phases(c, p, plan, q, k, v, a.lse, a.iters).items():
                        res[p][n] += xs
                    res[p]["step"] += whole(c, p, plan, q, k, v, a.lse, a.iters)
            ac.Client._fast_steps = True
    finally:
        proc.terminate()
        proc.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {p: {n: statistics.median(xs) / 1000 for n, xs in r.items()} for p, r in res.items()}
    print(f"{a.backend} daemon, decode step: 1 token, ctx {a.ctx}, {QH}/{KVH} heads, d{D}, bf16, lse {a.lse}; "
          f"{a.rounds} x {a.iters} steps per path; medians in us")
    names = ("encode", "send", "wait", "recv+parse", "step")
    print(f"{'path':6s}" + "".join(f"{n:>12s}" for n in names))
    for p in paths:
        print(f"{p:6s}" + "".join(f"{med[p][n]:12.2f}" for n in names))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ctx": a.ctx, "lse": a.lse, "medians_us": med}, f, indent=1)


if __name__ == "__main__":
    main()
