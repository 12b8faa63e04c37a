#!/usr/bin/env python3
"""End to end: a decode loop through every layer, and one large prefill layer step,
over the daemon's Unix socket and loopback TCP, beside PyTorch's in-process attention.

    bench_e2e.py [--attnd BUILD/daemon/attnd] [--backend cpu|cuda] [--shape small|8b]
                 [--sessions 1,16,64] [--context 4096] [--tokens 16] [--prefill 4096]
                 [--transports unix,tcp] [--json FILE] [--log FILE]

Spawns attnd (with --step-trace, and --cuda-trace on the CUDA backend), opens N
sessions, fills each to --context tokens with prefill steps on every layer, then
decodes --tokens tokens: per token one Plan and one Step per layer, each layer's
Step sent when the previous one's output came back (an orchestrator's layer
loop: layer l+1's q needs layer l's output). Reported per (transport, sessions):
the per-token latency (p50, p90) and the per-layer round trip, the daemon's own
total_us and computing_us (Timing), and the same per-token loop as PyTorch's
in-process attention (scaled_dot_product_attention over a preallocated cache,
the new row written in place, on the same device) when torch is installed.
Then one prefill layer step of --prefill tokens for one session (q, k, v in,
out back): its round trip and the rate of q+k+v+out bytes through the daemon.

Last, the daemon's step_trace lines (its log at exit): where a step's time
went, phase by phase (read, decode, admit, scan, queue, h2d, kwrite, attend,
d2h, compute, encode, write, total; docs/operations.md), p50/p90 per kind.

Transport `ipc` (CUDA backend, torch; with unix): same-host zero-copy
(docs/protocol.md §5a) on a second Unix socket connection, each case right
after its bytes run on the same sessions: the decode loop's q, k and v are
torch bf16 tensors on the daemon's GPU, named by reference (RegisterBuffer
once per allocation, out written by the daemon into a preallocated tensor of
the client's), and the contexts are filled by reference too (a 64 x 4096 fill
over the socket moves 34 GB of k+v). Speed is measured here, never asserted. Shapes: small (the CPU default: 4
layers, 8 q / 2 kv heads, d 64) or 8b (32 layers, 32 q / 8 kv heads, d 128).
"""
import argparse
import json
import os
import re
import shutil
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# ATTND_CLIENT_DIR: another copy of the Python client (an older one: before/after
# of the client in one run).
sys.path.insert(0, os.environ.get("ATTND_CLIENT_DIR") or os.path.join(HERE, "..", "client", "python"))
for cand in (os.path.join(HERE, "..", "build", "python"), os.environ.get("ATTND_PB2_DIR", "")):
    if cand and os.path.isdir(cand):
        sys.path.insert(0, cand)

from attnd import client as ac  # noqa: E402

SHAPES = {
    "small": dict(layers=4, q_heads=8, kv_heads=2, head_dim=64),
    "8b": dict(layers=32, q_heads=32, kv_heads=8, head_dim=128),
}


def pct(v, p):
    if not v:
        return float("nan")
    s = sorted(v)
    return s[min(len(s) - 1, int(len(s) * p))]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_daemon(a, sh, tmp, port, log_path):
    path = os.path.join(tmp, "attnd.sock")
    cmd = [a.attnd, "--socket", path, "--listen", f"127.0.0.1:{port}", "--metrics", "",
           "--state-dir", tmp, "--backend", a.backend, "--layers", str(sh["layers"]),
           "--q-heads", str(sh["q_heads"]), "--kv-heads", str(sh["kv_heads"]),
           "--head-dim", str(sh["head_dim"]), "--kv-memory", a.kv_memory,
           "--max-sessions", str(max(256, 2 * max(a.sessions))),
           "--log-level", "info", "--no-prefix-cache"]
    if not a.no_step_trace:
        cmd += ["--step-trace", str(a.trace_window)]
    if a.backend == "cuda" and not a.no_cuda_trace:
        cmd.append("--cuda-trace")
    cmd += a.daemon_arg
    log = open(log_path, "wb")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        if p.poll() is not None:
            raise SystemExit(f"attnd exited with {p.returncode}; log: {log_path}")
        if os.path.exists(path):
            try:
                with ac.Client(path, timeout=5) as c:
                    c.health()
                return p, path, log
            except OSError:
                pass
        time.sleep(0.05)
    p.kill()
    raise SystemExit("attnd did not start")


def bf16_bits(rng, shape):
    """Random values in [-1, 1) as bf16 bits (uint16): no per-element work later."""
    return ac.f32_to_bf16(rng.uniform(-1, 1, size=shape).astype(np.float32)).astype(np.uint16)


def fill(c, sh, sessions, context, rng, rows_max=16384, ipc=False):
    """Fills every session to context tokens on every layer: kv_only items (no q,
    no output), several sessions per step up to rows_max rows, every layer's step
    sent before any answer is read. ipc: k and v are one torch tensor on the GPU,
    named by reference (c a zero-copy client): no bytes on the socket, so 64
    sessions x 4096 fill in seconds rather than minutes. Returns (seconds, k+v
    bytes the daemon took in)."""
    L, kvh, d = sh["layers"], sh["kv_heads"], sh["head_dim"]
    chunk = min(context, rows_max)
    per = max(1, rows_max // chunk)
    kv = bf16_bits(rng, (per * chunk, kvh, d))
    if ipc:
        kv = to_cuda_bf16(kv)
        c.ipc.keep(kv)
    t0 = time.perf_counter()
    nbytes = 0
    for s0 in range(0, context, chunk):
        n = min(chunk, context - s0)
        toks = list(range(s0, s0 + n))
        for g in range(0, len(sessions), per):
            grp = sessions[g:g + per]
            items = [ac.Item(sid, s0, n, tokens=toks, kv_only=True) for sid in grp]
            part = kv[:n * len(grp)]
            ids = [c.step_send(l, None, part, part, items=items) for l in range(L)]
            for i in ids:
                c.step_recv(i)
            nbytes += L * 2 * n * len(grp) * kvh * d * 2
    return time.perf_counter() - t0, nbytes


def to_cuda_bf16(bits):
    """bf16 bits (uint16) as a torch bf16 tensor on cuda:0 (the ipc transport)."""
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to("cuda:0")


class PhaseSock:
    """The client's socket with the client's phases of one call timed
    (--breakdown): the first write's start and the last one's end, when the
    answer was there to read (a select() before the first read, so the wait and
    the read's system calls are told apart; a spinning client's non-blocking
    reads count as waiting) and the last read's end. Everything else is
    passed to the socket."""

    def __init__(self, sock):
        self.s = sock
        self.reset()

    def reset(self):
        self.t_send0 = self.t_send1 = self.t_ready = self.t_read1 = 0

    def _sent(self, t0):
        self.t_send0 = self.t_send0 or t0
        self.t_send1 = time.perf_counter_ns()

    def sendmsg(self, *a):
        t0 = time.perf_counter_ns()
        r = self.s.sendmsg(*a)
        self._sent(t0)
        return r

    def sendall(self, *a):
        t0 = time.perf_counter_ns()
        r = self.s.sendall(*a)
        self._sent(t0)
        return r

    def recv_into(self, buf, n=0, flags=0):
        if not self.t_ready and not flags & socket.MSG_DONTWAIT:
            select.select([self.s], [], [])
            self.t_ready = time.perf_counter_ns()
        r = self.s.recv_into(buf, n, flags)
        self.t_ready = self.t_ready or time.perf_counter_ns()
        self.t_read1 = time.perf_counter_ns()
        return r

    def __getattr__(self, k):
        return getattr(self.s, k)


# The client's phases of one layer step (--breakdown), in order.
CLIENT_PHASES = ["encode", "send", "wait", "read", "parse"]


def decode_loop(c, sh, sessions, lens, tokens, rng, ipc=False, breakdown=False):
    """tokens tokens through every layer (lens: each session's length, moved on);
    returns per-token and per-layer times and the daemon's total/computing (us).
    ipc: q, k and v are torch tensors on the GPU, sent by reference."""
    L, qh, kvh, d = sh["layers"], sh["q_heads"], sh["kv_heads"], sh["head_dim"]
    n = len(sessions)
    q = bf16_bits(rng, (n, qh, d))
    kv = bf16_bits(rng, (n, kvh, d))
    out = None
    if ipc:
        import torch

        q, kv = to_cuda_bf16(q), to_cuda_bf16(kv)
        out = torch.empty((n, qh, d), dtype=torch.bfloat16, device="cuda:0")
        for t in (q, kv, out):  # registered once: every step's refs cost no driver call
            c.ipc.keep(t)
    per_token, per_layer, total, computing = [], [], [], []
    phases = {k: [] for k in CLIENT_PHASES} if breakdown else None
    ps = None
    if breakdown:
        ps = c._sock = PhaseSock(c._sock)
    try:
        for t in range(tokens):
            plan = c.plan([ac.Item(s, lens[s], 1, tokens=[lens[s]]) for s in sessions])
            for s in sessions:
                lens[s] += 1
            t0 = time.perf_counter()
            for l in range(L):
                if ps is not None:
                    ps.reset()
                tl = time.perf_counter_ns()
                r = c.step(l, q, kv, kv, plan=plan, out=out)
                te = time.perf_counter_ns()
                per_layer.append((te - tl) / 1e3)
                total.append(r.timing.total_us)
                computing.append(r.timing.computing_us)
                if ps is not None and ps.t_send0 and ps.t_read1:
                    for k, v in zip(CLIENT_PHASES, (ps.t_send0 - tl, ps.t_send1 - ps.t_send0,
                                                    ps.t_ready - ps.t_send1, ps.t_read1 - ps.t_ready,
                                                    te - ps.t_read1)):
                        phases[k].append(v / 1e3)
            per_token.append((time.perf_counter() - t0) * 1e6)
    finally:
        if ps is not None:
            c._sock = ps.s
    return per_token, per_layer, total, computing, phases


def prefill_once(c, sh, sid, n, rng, reps):
    """One layer step of n new tokens for one session (layer 0), reps times at
    positions 0.. (each rewrites the same tokens); returns round trips (us) and
    the q+k+v+out bytes of one."""
    qh, kvh, d = sh["q_heads"], sh["kv_heads"], sh["head_dim"]
    q = bf16_bits(rng, (n, qh, d))
    kv = bf16_bits(rng, (n, kvh, d))
    items = [ac.Item(sid, 0, n, tokens=list(range(n)))]
    rt = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.step(0, q, kv, kv, items=items)
        rt.append((time.perf_counter() - t0) * 1e6)
    nbytes = 2 * (q.size + 2 * kv.size + q.size)
    return rt, nbytes


def torch_reference(sh, nsess, context, tokens, device):
    """The same per-token loop in-process: per layer, write the new k/v row into
    a preallocated bf16 cache and attend with SDPA (GQA). None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if device == "cuda" and not torch.cuda.is_available():
        return None
    try:
        return _torch_reference(torch, F, sh, nsess, context, tokens, device)
    except torch.cuda.OutOfMemoryError:  # beside the daemon's pool: the row says n/a
        return None
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def _torch_reference(torch, F, sh, nsess, context, tokens, device):
    L, qh, kvh, d = sh["layers"], sh["q_heads"], sh["kv_heads"], sh["head_dim"]
    dt = torch.bfloat16
    cap = context + tokens + 1
    # One contiguous cache per layer, sized to the run, [sessions, kv heads,
    # positions, d]. A decode step's q heads of one kv head are that head's
    # query rows: q as [sessions, kv heads, q/kv heads, d] against the cache
    # is GQA decode as plain SDPA, which its fused kernels take (SDPA with
    # enable_gqa over the sliced cache fell back to the math kernel on the H200:
    # ~60 ms per 32-layer token; repeat_interleave copied the cache per step).
    kc = [torch.randn(nsess, kvh, cap, d, dtype=dt, device=device) for _ in range(L)]
    vc = [torch.randn(nsess, kvh, cap, d, dtype=dt, device=device) for _ in range(L)]
    q = torch.randn(nsess, kvh, qh // kvh, d, dtype=dt, device=device)
    knew = torch.randn(nsess, kvh, 1, d, dtype=dt, device=device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def one(pos):
        for l in range(L):
            kc[l][:, :, pos:pos + 1] = knew
            vc[l][:, :, pos:pos + 1] = knew
            F.scaled_dot_product_attention(q, kc[l][:, :, :pos + 1], vc[l][:, :, :pos + 1])
        sync()

    one(context)  # warm-up
    out = []
    for t in range(tokens):
        t0 = time.perf_counter()
        one(context + 1 + t)
        out.append((time.perf_counter() - t0) * 1e6)
    del kc, vc
    return out


TRACE_RE = re.compile(r"event=step_trace\b.*?kind=(\w+) steps=(\d+) stat=p50/p90(.*)$")


def ipc_ready(a):
    """The ipc transport needs the CUDA backend and torch on a GPU here."""
    if a.backend != "cuda":
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


CUDA_TRACE_RE = re.compile(r"event=cuda_trace\b(.*)$")


def log_size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def case_traces(log_path, start, end):
    """The daemon's last step_trace line of kind decode and last cuda_trace line
    written while one case ran (bytes start..end of its log): a window of that
    case's own steps when the case ran at least two windows (the first may hold
    the fill's). ({phase: p50}, {interval: median}); empty when none."""
    with open(log_path, "rb") as f:
        f.seek(start)
        text = f.read(max(0, end - start)).decode(errors="replace")
    st, cu = {}, {}
    for line in text.splitlines():
        m = TRACE_RE.search(line)
        if m and m.group(1) == "decode":
            st = {k: float(p50) for k, p50, _ in re.findall(r"(\w+)_us=([\d.]+)/([\d.]+)", m.group(3))}
        m = CUDA_TRACE_RE.search(line)
        if m:
            cu = {k: float(v) for k, v in re.findall(r"(\w+)_us=(-?[\d.]+)", m.group(1))}
            for k in ("completed_by_loop", "graph_steps"):
                g = re.search(k + r"=(\d+)", m.group(1))
                if g:
                    cu[k] = int(g.group(1))
    return st, cu


def parse_trace(log_path):
    """step_trace lines of the daemon's log: [{kind, steps, phases{name: (p50, p90)}}]."""
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            m = TRACE_RE.search(line.rstrip())
            if not m:
                continue
            ph = {}
            for k, p50, p90 in re.findall(r"(\w+)_us=([\d.]+)/([\d.]+)", m.group(3)):
                ph[k] = (float(p50), float(p90))
            out.append({"kind": m.group(1), "steps": int(m.group(2)), "phases": ph})
    return out


# The breakdown's columns: (heading, where, key). Client phases are p50 of
# each layer step's; the daemon's are the p50 of its step_trace window
# (docs/operations.md, --step-trace) and the medians of its cuda_trace window
# (--cuda-trace: enqueue = submission to the end of the launches, dev = the
# device's h2d + write + attend + d2h, notice = the poller's (or the loop's)
# lag after the device finished, hop = from there to the loop thread).
BREAKDOWN = [("RT", "case", "layer_p50_us"),
             ("c.encode", "client", "encode"), ("c.send", "client", "send"),
             ("c.wait", "client", "wait"), ("c.read", "client", "read"),
             ("c.parse", "client", "parse"),
             ("d.read", "st", "read"), ("d.decode", "st", "decode"), ("d.admit", "st", "admit"),
             ("d.scan", "st", "scan"), ("d.queue", "st", "queue"), ("d.compute", "st", "compute"),
             ("d.encode", "st", "encode"), ("d.write", "st", "write"), ("d.total", "st", "total"),
             ("cu.enqueue", "cu", "enqueue"), ("cu.dev", "cu", "dev"),
             ("cu.notice", "cu", "callback_after_device"), ("cu.hop", "cu", "callback_to_loop")]


def print_breakdown(cases):
    """One row per case: where its layer step's time went (p50s, us; they need
    not add up). c.wait minus d.total is the time neither side accounts for:
    the daemon's wake-up to read the request, the response's write and the
    client's wake-up."""
    print("| breakdown (p50 us) | sessions | " + " | ".join(h for h, _, _ in BREAKDOWN) +
          " | c.wait - d.total |")
    print("|---|---|" + "---|" * (len(BREAKDOWN) + 1))
    for c in cases:
        if "client_p50_us" not in c:
            continue
        cu = dict(c.get("cuda_trace_p50_us") or {})
        if cu:
            cu["dev"] = sum(cu.get(k, 0.0) for k in ("h2d", "write", "attend", "d2h"))
        src = {"case": c, "client": c["client_p50_us"], "st": c.get("step_trace_p50_us") or {},
               "cu": cu}
        cells = []
        for _, where, key in BREAKDOWN:
            v = src[where].get(key)
            cells.append("-" if v is None else "%.1f" % v)
        tot = src["st"].get("total", c.get("daemon_total_p50_us"))
        gap = c["client_p50_us"]["wait"] - tot if tot is not None else None
        print(f"| {c['transport']} | {c['sessions']} | " + " | ".join(cells) +
              f" | {'-' if gap is None else '%.1f' % gap} |")


def save(a, results):
    """The results so far (a run cut short keeps what it measured)."""
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attnd", default=os.path.join(HERE, "..", "build", "daemon", "attnd"))
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="default: small on cpu, 8b on cuda")
    ap.add_argument("--sessions", default=None, help="comma list (default 1,16,64; cpu: 1,4)")
    ap.add_argument("--context", type=int, default=None, help="default 4096 (cpu: 256)")
    ap.add_argument("--tokens", type=int, default=16, help="decoded tokens per case")
    ap.add_argument("--prefill", type=int, default=None, help="tokens of the prefill step "
                    "(default 4096; cpu: 512); 0 = none")
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--transports", default="unix,tcp", help="comma list of unix, tcp, ipc")
    ap.add_argument("--kv-memory", default=None, help="default 0 on cuda (90%% free), 512M on cpu")
    ap.add_argument("--trace-window", type=int, default=None,
                    help="steps per step_trace line (default 256; with --breakdown a case's "
                    "layer steps / 2, at most 256, so each case has a window of its own)")
    ap.add_argument("--no-step-trace", action="store_true",
                    help="for a daemon older than --step-trace (a baseline): no phase table")
    ap.add_argument("--no-cuda-trace", action="store_true",
                    help="without --cuda-trace (its events cost a little per step; no device phases)")
    ap.add_argument("--daemon-arg", action="append", default=[], help="extra attnd flag")
    ap.add_argument("--breakdown", action="store_true",
                    help="where each case's layer step went: the client's phases (encode, send, "
                    "wait, read, parse) beside the daemon's step_trace and cuda_trace of that case")
    ap.add_argument("--spin", type=int, default=0,
                    help="the client busy-polls each answer up to US microseconds (set_spin)")
    ap.add_argument("--no-torch", action="store_true", help="no in-process PyTorch column")
    ap.add_argument("--json")
    ap.add_argument("--log", help="keep the daemon's log here")
    a = ap.parse_args()
    cpu = a.backend == "cpu"
    sh = SHAPES[a.shape or ("small" if cpu else "8b")]
    a.sessions = [int(x) for x in (a.sessions or ("1,4" if cpu else "1,16,64")).split(",")]
    context = a.context if a.context is not None else (256 if cpu else 4096)
    a.prefill = a.prefill if a.prefill is not None else (512 if cpu else 4096)
    a.kv_memory = a.kv_memory or ("512M" if cpu else "0")
    transports = [t for t in a.transports.split(",") if t]
    if a.trace_window is None:
        a.trace_window = max(8, min(256, a.tokens * sh["layers"] // 2)) if a.breakdown else 256

    # PyTorch's in-process loop first, before the daemon takes 90% of the
    # device's memory for its pool (beside it, the larger cases ran out).
    torch_by_n = {}
    if not a.no_torch:
        for n in sorted(set(a.sessions)):
            ref = torch_reference(sh, n, context, a.tokens, a.backend)
            torch_by_n[n] = pct(ref, 0.5) if ref else None
            print(f"torch in-process, {n} sessions: token p50 "
                  f"{'%.0f us' % torch_by_n[n] if torch_by_n[n] else 'n/a'}", flush=True)

    tmp = tempfile.mkdtemp(prefix="attnd-bench-e2e-")
    log_path = os.path.join(tmp, "attnd.log")
    port = free_port()
    p, path, log = start_daemon(a, sh, tmp, port, log_path)
    rng = np.random.default_rng(1)
    results = {"backend": a.backend, "shape": sh, "context": context, "tokens": a.tokens,
               "cases": [], "prefill": [], "fill": []}
    try:
        # ipc is measured beside unix, on the same sessions (they belong to the
        # uid, not the connection) through a second connection with zero-copy on.
        do_ipc = "ipc" in transports
        if do_ipc and not ipc_ready(a):
            results["cases"].append({"transport": "ipc", "skipped": "needs --backend cuda "
                                     "and torch with CUDA"})
            do_ipc = False
        for tr in [t for t in transports if t != "ipc"]:
            addr = path if tr == "unix" else f"127.0.0.1:{port}"
            cipc = ac.Client(path, timeout=600, ipc=True) if do_ipc and tr == "unix" else None
            with ac.Client(addr, timeout=600, ipc=False) as c:
                # Sessions are filled as the cases need them (small cases first),
                # so a run cut short by a timeout still has its first cases.
                sess, lens = [], {}
                for n in sorted(a.sessions):
                    new = [int(c.open_session()[0]) for _ in range(n - len(sess))]
                    if new:
                        fc = cipc if cipc is not None else c
                        fill_s, fill_bytes = fill(fc, sh, new, context, rng, ipc=fc is cipc)
                        results["fill"].append({"transport": "ipc" if fc is cipc else tr,
                                                "sessions": len(new),
                                                "tokens": context, "seconds": fill_s,
                                                "gb_s": fill_bytes / fill_s / 1e9})
                        sess += new
                        lens.update({sid: context for sid in new})
                    for name, cl in ((tr, c), ("ipc", cipc)):
                        if cl is None:
                            continue
                        if a.spin and hasattr(cl, "set_spin"):
                            cl.set_spin(a.spin)
                        off0 = log_size(log_path)
                        pt, pl, tot, comp, ph = decode_loop(cl, sh, sess[:n], lens, a.tokens, rng,
                                                            ipc=cl is cipc, breakdown=a.breakdown)
                        case = {
                            "transport": name, "sessions": n,
                            "token_p50_us": pct(pt, 0.5), "token_p90_us": pct(pt, 0.9),
                            "layer_p50_us": pct(pl, 0.5), "layer_p90_us": pct(pl, 0.9),
                            "daemon_total_p50_us": pct(tot, 0.5),
                            "computing_p50_us": pct(comp, 0.5),
                            "torch_token_p50_us": torch_by_n.get(n)}
                        if ph is not None:
                            case["client_p50_us"] = {k: pct(v, 0.5) for k, v in ph.items()}
                            st, cu = case_traces(log_path, off0, log_size(log_path))
                            case["step_trace_p50_us"] = st
                            case["cuda_trace_p50_us"] = cu
                        results["cases"].append(case)
                        save(a, results)
                for s in sess:
                    c.close_session(s)
                if cipc is not None:
                    cipc.close()
                if a.prefill:
                    s = int(c.open_session()[0])
                    rt, nbytes = prefill_once(c, sh, s, a.prefill, rng, a.prefill_reps)
                    c.close_session(s)
                    p50 = pct(rt, 0.5)
                    results["prefill"].append({"transport": tr, "tokens": a.prefill,
                                               "rt_p50_us": p50, "bytes": nbytes,
                                               "gb_s": nbytes / p50 / 1e3})
                    save(a, results)
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = -9
        log.close()
    results["daemon_exit"] = rc
    results["trace"] = parse_trace(log_path)
    if a.log:
        shutil.copy(log_path, a.log)
    shutil.rmtree(tmp, ignore_errors=True)

    print(f"# attnd e2e: backend {a.backend}, {sh['layers']} layers, {sh['q_heads']}/"
          f"{sh['kv_heads']} heads, d {sh['head_dim']}, context {context}, "
          f"{a.tokens} tokens per case")
    print("| transport | sessions | token p50 us | token p90 us | layer RT p50 us | "
          "daemon total p50 us | computing p50 us | torch in-process token p50 us |")
    print("|---|---|---|---|---|---|---|---|")
    for c in results["cases"]:
        if "skipped" in c:
            print(f"| {c['transport']} | - | skipped: {c['skipped']} | | | | | |")
            continue
        t = torch_by_n.get(c["sessions"])
        print(f"| {c['transport']} | {c['sessions']} | {c['token_p50_us']:.0f} | "
              f"{c['token_p90_us']:.0f} | {c['layer_p50_us']:.1f} | "
              f"{c['daemon_total_p50_us']:.1f} | {c['computing_p50_us']:.1f} | "
              f"{'%.0f' % t if t else 'n/a'} |")
    for f in results["fill"]:
        print(f"fill {f['transport']}: {f['sessions']} sessions x {f['tokens']} tokens, kv_only "
              f"pipelined over the layers: {f['seconds']:.2f} s, {f['gb_s']:.2f} GB/s of k+v")
    for pf in results["prefill"]:
        print(f"prefill {pf['transport']}: {pf['tokens']} tokens, {pf['bytes'] / 2**20:.1f} MiB "
              f"q+k+v+out, round trip p50 {pf['rt_p50_us'] / 1e3:.2f} ms, {pf['gb_s']:.2f} GB/s")
    phases = ["read", "decode", "admit", "scan", "queue", "h2d", "kwrite", "attend", "d2h",
              "compute", "encode", "write", "total"]
    if results["trace"]:
        print("| step_trace (p50/p90 us) | steps | " + " | ".join(phases) + " |")
        print("|---|---|" + "---|" * len(phases))
        for t in results["trace"]:
            cells = ["%.0f/%.0f" % t["phases"][k] if k in t["phases"] else "-" for k in phases]
            print(f"| {t['kind']} | {t['steps']} | " + " | ".join(cells) + " |")
    if a.breakdown:
        print_breakdown(results["cases"])
    print(f"daemon exit status after SIGTERM: {rc}")
    save(a, results)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
