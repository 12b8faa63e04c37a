"""Limits and access against the real daemon (CPU): max connections, max
sessions, max frame, max in-flight bytes per connection, Unix socket
permissions, Hello{token} required (--require-token on 127.0.0.1: tests send
traffic to loopback only), and tokens never reaching the log."""
import os
import socket
import stat
import struct
import subprocess
import sys
import time
import unittest

import numpy as np

from harness import Daemon
from test_reliability_util import (Closed, D, EXHAUSTED, KVH, OK, QH, SHAPE, UNAUTH, RawConn, bf16, must,
                                   open_req, pb, simple, step_req)


def padded_health(total):
    """A Health request whose frame body is exactly `total` bytes (unknown field 15 pads it)."""
    base = pb.Request()
    base.id = 7
    base.health.SetInParent()
    b = base.SerializeToString()
    pad = total - len(b)
    # field 15, wire type 2: tag 0x7a, then a varint length, then the bytes.
    for lenlen in range(1, 6):
        n = pad - 1 - lenlen
        v, enc = n, b""
        while True:
            if v < 0x80:
                enc += bytes([v])
                break
            enc += bytes([(v & 0x7F) | 0x80])
            v >>= 7
        if len(enc) == lenlen:
            return b + b"\x7a" + enc + b"\0" * n
    raise ValueError(total)


class LimitsTest(unittest.TestCase):
    def start(self, extra):
        d = Daemon(["--kv-memory", "16M", "--max-context", "1024"] + extra, shape=SHAPE)
        try:
            d.wait_ready()
        except BaseException:
            d.close()
            raise
        return d

    def finish(self, d):
        try:
            self.assertEqual(d.stop(), 0, d.log_text())
        finally:
            d.close()

    def test_max_connections(self):
        d = self.start(["--max-connections", "3"])
        try:
            time.sleep(0.2)  # wait_ready's client has gone
            held = [RawConn(d.socket) for _ in range(3)]
            for c in held:
                must(c.call(simple("health")), "health")
            extra = RawConn(d.socket)
            r = extra.recv_any()
            self.assertEqual((r.id, r.status.code), (0, EXHAUSTED), r.status.message)
            self.assertTrue(extra.is_closed())
            extra.close()
            held.pop().close()
            for _ in range(50):  # the daemon sees the close asynchronously
                time.sleep(0.05)
                with RawConn(d.socket) as c:
                    r = c.call(simple("health"))
                    if r.status.code == OK:
                        break
            self.assertEqual(r.status.code, OK)
            for c in held:
                c.close()
        finally:
            self.finish(d)

    def test_max_sessions(self):
        # The daemon-wide limit (one identity here: its quota as large).
        d = self.start(["--max-sessions", "3", "--max-sessions-per-identity", "3"])
        try:
            with RawConn(d.socket) as c:
                ids = [must(c.call(open_req()), "open").open_session.session for _ in range(3)]
                r = c.call(open_req())
                self.assertEqual(r.status.code, EXHAUSTED, r.status.message)
                r = c.call(simple("fork", session=ids[0]))
                self.assertEqual(r.status.code, EXHAUSTED, r.status.message)
                must(c.call(simple("close_session", session=ids[0])), "close")
                must(c.call(open_req()), "open after a close")
        finally:
            self.finish(d)

    def test_max_frame(self):
        limit = 64 * 1024
        d = self.start(["--max-frame", str(limit), "--max-inflight", str(limit)])
        try:
            with RawConn(d.socket) as c:
                body = padded_health(limit)
                self.assertEqual(len(body), limit)
                c.send_raw(struct.pack(">I", limit) + body)
                r = c.recv_any()
                self.assertEqual((r.id, r.status.code), (7, OK), r.status.message)
            with RawConn(d.socket) as c:
                body = padded_health(limit + 1)
                c.send_raw(struct.pack(">I", limit + 1) + body[:100])
                r = c.recv_any()
                self.assertEqual((r.id, r.status.code), (0, EXHAUSTED))
                self.assertTrue(c.is_closed())
        finally:
            self.finish(d)

    def push(self, d, nreq, T):
        """Pipelines nreq large steps without reading; returns (bytes the daemon
        let in within 2 s, responses all OK once read)."""
        c = RawConn(d.socket)
        s = must(c.call(open_req()), "open").open_session.session
        q, kv = bf16((T, QH, D)), bf16((T, KVH, D))
        frames = []
        for i in range(nreq):
            r = step_req(0, [(s, 0, T)], q=q, k=kv, v=kv)
            r.id = 100 + i
            r.step.fp32_out = True
            b = r.SerializeToString()
            frames.append(struct.pack(">I", len(b)) + b)
        data = b"".join(frames)
        c.sock.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 2.0
        while sent < len(data) and time.monotonic() < deadline:
            try:
                sent += c.sock.send(data[sent:sent + 65536])
            except BlockingIOError:
                time.sleep(0.01)
        pushed = sent
        c.sock.setblocking(True)
        c.sock.settimeout(60)
        codes = []

        def reader():
            for _ in range(nreq):
                codes.append(c.recv_any().status.code)

        # Now read while sending the rest: the daemon resumes as its responses drain.
        import threading
        t = threading.Thread(target=reader)
        t.start()
        if sent < len(data):
            c.sock.sendall(data[sent:])
        t.join(60)
        c.close()
        return pushed, len(data), codes

    def test_max_inflight(self):
        frame = 256 * 1024
        T = 200  # a 200 KiB request and a 200 KiB fp32 response
        nreq = 40
        # Tight: one frame in flight per connection.
        d = self.start(["--max-frame", str(frame), "--max-inflight", str(frame)])
        try:
            pushed, total, codes = self.push(d, nreq, T)
        finally:
            self.finish(d)
        d = self.start(["--max-frame", str(frame), "--max-inflight", "256M"])
        try:
            pushed_loose, _, codes_loose = self.push(d, nreq, T)
        finally:
            self.finish(d)
        print(f"max-inflight: {nreq} x {total // nreq} B pipelined without reading: the daemon let in "
              f"{pushed} B with --max-inflight {frame}, {pushed_loose} B with 256M")
        self.assertEqual(set(codes), {OK})
        self.assertEqual(set(codes_loose), {OK})
        # Socket buffers hold some; the daemon itself holds at most about one frame more than the limit.
        self.assertLess(pushed, 3 * 1024 * 1024)
        self.assertLess(pushed, pushed_loose)


class AccessTest(unittest.TestCase):
    def test_unix_socket_permissions(self):
        tmp_d = Daemon(["--kv-memory", "8M"], shape=SHAPE)
        try:
            tmp_d.wait_ready()
            mode = stat.S_IMODE(os.stat(tmp_d.socket).st_mode)
            self.assertEqual(mode, 0o660, oct(mode))
            self.assertEqual(tmp_d.stop(), 0)
        finally:
            tmp_d.close()
        import tempfile
        import shutil
        base = tempfile.mkdtemp(prefix="attnd-rel-perm-")
        try:
            sock = os.path.join(base, "run", "attnd.sock")
            d = Daemon(["--kv-memory", "8M", "--socket", sock], shape=SHAPE, socket_arg=False, tmp=base)
            d.socket = sock
            try:
                d.wait_ready()
                self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode), 0o700)
                self.assertEqual(stat.S_IMODE(os.stat(sock).st_mode), 0o660)
                if os.geteuid() == 0:
                    # Another user (nobody) cannot connect.
                    code = subprocess.run(
                        [sys.executable, "-c",
                         "import os,socket,sys\nos.setgid(65534); os.setuid(65534)\n"
                         "s=socket.socket(socket.AF_UNIX)\n"
                         "try:\n s.connect(sys.argv[1]); sys.exit(0)\n"
                         "except PermissionError: sys.exit(13)\n", sock]).returncode
                    self.assertEqual(code, 13, "another uid could connect to the socket")
                self.assertEqual(d.stop(), 0)
            finally:
                d.close()
            # A world-writable socket directory is refused at start.
            bad = os.path.join(base, "open")
            os.mkdir(bad)
            os.chmod(bad, 0o777)
            d = Daemon(["--kv-memory", "8M", "--socket", os.path.join(bad, "attnd.sock")], shape=SHAPE,
                       socket_arg=False, tmp=base)
            try:
                self.assertNotEqual(d.proc.wait(20), 0)
                self.assertIn("world-writable", d.log_text())
            finally:
                d.close()
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def test_tcp_hello_required_and_tokens_not_logged(self):
        # --require-token makes loopback behave as an off-loopback peer does
        # (the same need_hello path), so the check needs no other address.
        ip = "127.0.0.1"
        import tempfile
        import shutil
        base = tempfile.mkdtemp(prefix="attnd-rel-tok-")
        good, good2, bad = "tok-GOOD-5f1e9c0a7b", "tok-TWO-41d8e7a2c9", "tok-BAD-93a7d2c4e1"
        try:
            tf = os.path.join(base, "tokens")
            with open(tf, "w") as f:
                f.write(good + "\n" + good2 + "\n")
            os.chmod(tf, 0o600)
            d = Daemon(["--kv-memory", "8M", "--listen", "127.0.0.1:0", "--token-file", tf,
                        "--require-token", "--hello-timeout", "1000", "--log-level", "debug"],
                       shape=SHAPE, tmp=base)
            try:
                d.wait_ready()
                port = d.tcp_port
                # Anything before Hello: UNAUTHENTICATED, then close.
                with RawConn((ip, port)) as c:
                    r = c.call(simple("health"))
                    self.assertEqual(r.status.code, UNAUTH, r.status.message)
                    self.assertTrue(c.is_closed())
                with RawConn((ip, port)) as c:
                    h = pb.Request()
                    h.hello.token = bad
                    r = c.call(h)
                    self.assertEqual(r.status.code, UNAUTH)
                    self.assertTrue(c.is_closed())
                # An over-long token (nanopb caps it at 255 bytes) is refused
                # and authenticates nothing; it must not be logged either.
                long_tok = "tok-LONG-7c3e" * 30
                with RawConn((ip, port)) as c:
                    h = pb.Request()
                    h.hello.token = long_tok
                    r = c.call(h)
                    self.assertNotEqual(r.status.code, OK)
                    try:
                        r = c.call(simple("health"))
                        self.assertEqual(r.status.code, UNAUTH)
                    except (OSError, Closed):  # closed already: as good
                        pass
                # Silence: closed after --hello-timeout.
                with RawConn((ip, port)) as c:
                    t0 = time.monotonic()
                    self.assertTrue(c.is_closed(timeout=5))
                    self.assertLess(time.monotonic() - t0, 4)
                with RawConn((ip, port)) as c:
                    h = pb.Request()
                    h.hello.token = good
                    must(c.call(h), "hello")
                    s = must(c.call(open_req()), "open").open_session.session
                    must(c.call(step_req(0, [(s, 0, 2)])), "step after hello")
                    # Another token is another identity: it cannot touch the session.
                    with RawConn((ip, port)) as lc:
                        h2 = pb.Request()
                        h2.hello.token = good2
                        must(lc.call(h2), "hello with the second token")
                        r = lc.call(simple("close_session", session=s))
                        self.assertNotEqual(r.status.code, OK)
                    must(c.call(simple("close_session", session=s)), "close")
                self.assertEqual(d.stop(), 0)
                with open(d.log_path, "rb") as f:
                    log = f.read().decode(errors="replace")
                self.assertNotIn(good, log, "the accepted token reached the log")
                self.assertNotIn(good2, log, "the second token reached the log")
                self.assertNotIn(bad, log, "a rejected token reached the log")
                self.assertNotIn("tok-LONG-7c3e", log, "an over-long token reached the log")
                self.assertIn(ip, log)  # the log did record these connections
            finally:
                d.close()
        finally:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
