"""Limits and access against the real daemon (CPU): max connections, max
sessions, max frame, max in-flight bytes per connection, the partial-frame
budget and frame deadline, the idle timeout, connections per identity,
answers before a close, Unix socket permissions, Hello{token} required
(--require-token on 127.0.0.1: tests send traffic to loopback only), operator
tokens, and tokens never reaching the log."""
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
from test_reliability_util import (INVALID, PERM, UNAVAIL, Closed, D, EXHAUSTED, KVH, OK, QH, SHAPE, UNAUTH,
                                   RawConn, bf16, must, open_req, pb, rss_kb, simple, step_req)


def padded_health(total):
    """A Health request whose frame body is exactly `total` bytes (unknown field 100 pads it)."""
    base = pb.Request()
    base.id = 7
    base.health.SetInParent()
    b = base.SerializeToString()
    pad = total - len(b)
    # field 100, wire type 2: tag 0xa2 0x06, then a varint length, then the bytes.
    for lenlen in range(1, 6):
        n = pad - 2 - lenlen
        v, enc = n, b""
        while True:
            if v < 0x80:
                enc += bytes([v])
                break
            enc += bytes([(v & 0x7F) | 0x80])
            v >>= 7
        if len(enc) == lenlen:
            return b + b"\xa2\x06" + enc + b"\0" * n
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
        # --socket-buffer: answers in the daemon's send buffer are written, so
        # it lets in at most twice that many more request bytes (Linux doubles
        # SO_SNDBUF), and no more.
        sbuf = 2 * 1024 * 1024
        d = self.start(["--max-frame", str(frame), "--max-inflight", str(frame),
                        "--socket-buffer", str(sbuf)])
        try:
            pushed_sb, _, codes_sb = self.push(d, nreq, T)
        finally:
            self.finish(d)
        print(f"max-inflight: {nreq} x {total // nreq} B pipelined without reading: the daemon let in "
              f"{pushed} B with --max-inflight {frame}, {pushed_loose} B with 256M, "
              f"{pushed_sb} B with --max-inflight {frame} --socket-buffer {sbuf}")
        self.assertEqual(set(codes), {OK})
        self.assertEqual(set(codes_loose), {OK})
        self.assertEqual(set(codes_sb), {OK})
        # Socket buffers hold some; the daemon itself holds at most about one frame more than the limit.
        self.assertLess(pushed, 3 * 1024 * 1024)
        self.assertLess(pushed, pushed_loose)
        self.assertLess(pushed_sb, 3 * 1024 * 1024 + 2 * sbuf)


class ConnectionLimitsTest(unittest.TestCase):
    """docs/protocol.md sections 2 and 9, through the daemon's own flags."""

    def start(self, extra):
        d = Daemon(["--kv-memory", "16M"] + extra, shape=SHAPE)
        try:
            d.wait_ready()
        except BaseException:
            d.close()
            raise
        return d

    def test_partial_frames_and_deadline(self):
        # Six connections start 3 MiB frames and stall: the 8 MiB budget lets
        # two hold theirs, the others wait unread; at the deadline each is
        # told RESOURCE_EXHAUSTED (id 0) and closed, and the memory is back.
        d = self.start(["--max-frame", "4M", "--max-partial-bytes", "8M", "--frame-deadline", "1500"])
        try:
            base = rss_kb(d.proc.pid)
            conns = []
            for _ in range(6):
                c = RawConn(d.socket)
                c.send_raw(struct.pack(">I", 3 << 20) + b"\x08\x01" + b"\0" * (1 << 20))
                conns.append(c)
            time.sleep(0.5)
            held = rss_kb(d.proc.pid) - base
            with RawConn(d.socket) as other:  # small frames never wait
                must(other.call(simple("health")), "health while frames stall")
            codes = []
            for c in conns:
                c.sock.settimeout(15)
                r = c.recv_any()
                codes.append((r.id, r.status.code))
                self.assertIn("--frame-deadline", r.status.message)
                self.assertTrue(c.is_closed())
                c.close()
            print(f"partial frames: 6 x 3 MiB started, {held // 1024} MiB held under an 8 MiB budget")
            self.assertEqual(set(codes), {(0, EXHAUSTED)})
            self.assertLess(held, 12 * 1024)
            self.assertEqual(d.stop(), 0)
        finally:
            d.close()

    def test_answers_before_close_and_idle(self):
        d = self.start(["--idle-timeout", "1"])
        try:
            with RawConn(d.socket) as c:
                s = must(c.call(open_req()), "open").open_session.session
                # Steps then a half-close: every step answered, then EOF.
                for i in range(3):
                    c.send(step_req(0, [(s, 0, 4)]))
                c.sock.shutdown(socket.SHUT_WR)
                got = sorted(c.recv_any().status.code for _ in range(3))
                self.assertEqual(got, [OK] * 3)
                self.assertTrue(c.is_closed())
            with RawConn(d.socket) as c:
                c.send(step_req(0, [(s, 0, 4)]))
                c.send_raw(struct.pack(">I", 3) + b"\xff\xff\xff")
                r = c.recv_any()
                self.assertEqual((r.status.code, r.HasField("step")), (OK, True))
                r = c.recv_any()
                self.assertEqual((r.id, r.status.code), (0, INVALID))
                self.assertTrue(c.is_closed())
            # An identity with a session open keeps its idle connection; a
            # TCP (anonymous) one without is told UNAVAILABLE and closed.
            with RawConn(d.socket) as keep, RawConn(("127.0.0.1", d.tcp_port)) as idle:
                must(keep.call(simple("health")), "health")
                must(idle.call(simple("health")), "health")
                idle.sock.settimeout(10)
                r = idle.recv_any()
                self.assertEqual((r.id, r.status.code), (0, UNAVAIL))
                self.assertIn("--idle-timeout", r.status.message)
                self.assertTrue(idle.is_closed())
                must(keep.call(simple("health")), "the session owner's connection stays")
            self.assertEqual(d.stop(), 0)
        finally:
            d.close()

    def test_operator_tokens_and_per_identity(self):
        import tempfile
        import shutil
        base = tempfile.mkdtemp(prefix="attnd-rel-op-")
        try:
            tf = os.path.join(base, "tokens")
            with open(tf, "w") as f:
                f.write("plain-tok\noperator:op-tok\n")
            d = Daemon(["--kv-memory", "8M", "--token-file", tf, "--max-connections-per-identity", "2"],
                       shape=SHAPE, tmp=base)
            try:
                d.wait_ready()
                tcp = ("127.0.0.1", d.tcp_port)

                def scales(c):
                    r = pb.Request()
                    r.set_scales.layer = 0
                    return c.call(r).status.code

                with RawConn(tcp) as anon, RawConn(tcp) as plain, RawConn(d.socket) as own:
                    h = pb.Request()
                    h.hello.token = "plain-tok"
                    must(plain.call(h), "hello")
                    self.assertEqual(scales(anon), PERM)
                    self.assertEqual(scales(plain), PERM)
                    # The daemon's own uid is an operator: the call reaches the
                    # engine, which refuses scales for a bf16 cache.
                    self.assertEqual(scales(own), INVALID)
                    with RawConn(tcp) as op:
                        h.hello.token = "op-tok"
                        must(op.call(h), "operator hello")
                        self.assertEqual(scales(op), INVALID)
                    # A third connection of the daemon's uid is one too many.
                    with RawConn(d.socket) as own2, RawConn(d.socket) as own3:
                        must(own2.call(simple("health")), "second of the uid")
                        r = own3.recv_any()
                        self.assertEqual((r.id, r.status.code), (0, EXHAUSTED))
                        self.assertTrue(own3.is_closed())
                self.assertEqual(d.stop(), 0)
            finally:
                d.close()
        finally:
            shutil.rmtree(base, ignore_errors=True)


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
                # SIGHUP rereads the token file: the new token works, the dropped one no longer does.
                fresh = "tok-NEW-0d5b8e1f3a"
                with open(tf, "w") as f:
                    f.write(good + "\n" + fresh + "\n")
                import signal
                d.proc.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 10
                while "tokens=reloaded" not in open(d.log_path, errors="replace").read():
                    self.assertLess(time.monotonic(), deadline, "no reload logged after SIGHUP")
                    time.sleep(0.05)
                with RawConn((ip, port)) as c:
                    h = pb.Request()
                    h.hello.token = fresh
                    must(c.call(h), "hello with the token added before SIGHUP")
                with RawConn((ip, port)) as c:
                    h = pb.Request()
                    h.hello.token = good2
                    self.assertEqual(c.call(h).status.code, UNAUTH, "a token removed before SIGHUP still works")
                self.assertEqual(d.stop(), 0)
                with open(d.log_path, "rb") as f:
                    log = f.read().decode(errors="replace")
                self.assertNotIn(fresh, log, "the reloaded token reached the log")
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
