#!/usr/bin/env python3
"""Deep pipelines on one connection, and what another client sees meanwhile.

    bench_pipeline.py [--attnd BUILD/daemon/attnd] [--depth 10000,50000,150000]
                      [--kind step|health] [--json FILE]

Spawns attnd on the CPU backend with a tiny model (1 layer, 8 q / 2 kv heads,
d 64), opens one session, and for each depth N writes N pipelined requests on
one connection before reading any answer (a writer thread sends, the main
thread reads): 1-token inline Steps that all rewrite position 0 (so the KV pool
never fills), or Health calls. Meanwhile a second connection sends one Health
every 10 ms and records each round trip.

Reported per depth: wall time from the first byte sent to the last answer read,
requests/s, and the second client's Health round trip (p50, p99, max). The
daemon's per-request work should not depend on how many requests are already
in flight: time per request stays flat as N grows, and the second client's
Health stays within a few milliseconds. Speed is only measured here, never
asserted (docs/protocol.md section 4 states the contract).
"""
import argparse
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

from attnd import client as ac  # noqa: E402

pb = ac.pb
QH, KVH, D = 8, 2, 64


def frame(req):
    b = req.SerializeToString()
    return struct.pack(">I", len(b)) + b


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        k = sock.recv(n - len(buf))
        if not k:
            raise SystemExit("the daemon closed the connection")
        buf += k
    return bytes(buf)


def call(sock, req):
    sock.sendall(frame(req))
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    r = pb.Response()
    r.ParseFromString(recv_exact(sock, n))
    return r


def step_bytes(session, rid):
    r = pb.Request()
    r.id = rid
    st = r.step
    st.layer = 0
    it = st.items.add()
    it.session = session
    it.start = 0
    it.n = 1
    it.tokens.append(7)
    for t, heads in ((st.q, QH), (st.k, KVH), (st.v, KVH)):
        t.dtype = pb.DTYPE_BF16
        t.shape.extend([1, heads, D])
        t.data = bytes([0x3f, 0x80]) * (heads * D)  # bf16 1.0
    return frame(r)


def health_bytes(rid):
    r = pb.Request()
    r.id = rid
    r.health.SetInParent()
    return frame(r)


def count_frames(sock, want):
    """Reads until `want` response frames have arrived; returns the number not OK."""
    buf = bytearray()
    got = bad = 0
    while got < want:
        k = sock.recv(1 << 22)
        if not k:
            raise SystemExit(f"the daemon closed the connection after {got} of {want} answers")
        buf += k
        off = 0
        while len(buf) - off >= 4:
            (n,) = struct.unpack_from(">I", buf, off)
            if len(buf) - off < 4 + n:
                break
            # Status is field 2; a cheap check: OK answers carry status with code 0.
            r = pb.Response()
            r.ParseFromString(bytes(buf[off + 4:off + 4 + n]))
            bad += r.status.code != 0
            off += 4 + n
            got += 1
        del buf[:off]
    return bad


def prober(path, stop, lat):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    i = 1
    while not stop.is_set():
        t0 = time.perf_counter()
        r = pb.Request()
        r.id = i
        r.health.SetInParent()
        call(s, r)
        lat.append(time.perf_counter() - t0)
        i += 1
        time.sleep(0.01)
    s.close()


def run_depth(path, session, depth, kind):
    # Build every frame first so the client does not pace the daemon.
    data = b"".join(step_bytes(session, i + 1) if kind == "step" else health_bytes(i + 1)
                    for i in range(depth))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    stop = threading.Event()
    lat = []
    pt = threading.Thread(target=prober, args=(path, stop, lat))
    pt.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    wt = threading.Thread(target=s.sendall, args=(data,))
    wt.start()
    bad = count_frames(s, depth)
    wall = time.perf_counter() - t0
    wt.join()
    stop.set()
    pt.join()
    s.close()
    lat.sort()
    ms = [x * 1e3 for x in lat] or [0.0]
    return {"depth": depth, "kind": kind, "wall_s": round(wall, 3),
            "req_per_s": round(depth / wall), "us_per_req": round(wall / depth * 1e6, 2),
            "errors": bad, "probe_n": len(lat), "probe_p50_ms": round(ms[len(ms) // 2], 2),
            "probe_p99_ms": round(ms[min(len(ms) - 1, len(ms) * 99 // 100)], 2),
            "probe_max_ms": round(ms[-1], 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attnd", default=os.path.join(HERE, "..", "build", "daemon", "attnd"))
    ap.add_argument("--depth", default="10000,50000,150000")
    ap.add_argument("--kind", choices=["step", "health"], default="step")
    ap.add_argument("--json")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="attnd-bench-pipe-")
    path = os.path.join(tmp, "attnd.sock")
    log = open(os.path.join(tmp, "attnd.log"), "wb")
    p = subprocess.Popen([a.attnd, "--socket", path, "--listen", "", "--metrics", "", "--state-dir",
                          tmp, "--backend", "cpu", "--threads", "1", "--layers", "1", "--q-heads",
                          str(QH), "--kv-heads", str(KVH), "--head-dim", str(D), "--block-size", "16",
                          "--kv-memory", "16M", "--max-inflight", "4G", "--log-level", "warn"],
                         stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        for _ in range(200):
            if os.path.exists(path):
                break
            time.sleep(0.05)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        r = pb.Request()
        r.id = 1
        r.open_session.SetInParent()
        session = call(s, r).open_session.session
        for depth in (int(x) for x in a.depth.split(",")):
            row = run_depth(path, session, depth, a.kind)
            print(json.dumps(row), flush=True)
            rows.append(row)
        s.close()
    finally:
        p.terminate()
        p.wait(30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
