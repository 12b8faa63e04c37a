"""What an operator meets (docs/operations.md): SIGHUP reloads and never ends the
daemon, the log file is reopened, journald priorities on every line, failed calls
visible at the default log level (rate-limited), the HTTP probes, the host-memory
rule for the CPU backend's KV pool, and the metrics clean under `promtool check
metrics` (PromtoolTest: Skipped where promtool is not installed; Debian: prometheus)."""
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import urllib.error
import urllib.request

import numpy as np

import attnd
from harness import Daemon, daemon_binary

PRIO = {"error": "<3>", "warn": "<4>", "info": "<6>", "debug": "<7>"}


def wait_for(path, pattern, timeout=10.0):
    """The first match of pattern in the file at path, waiting for it to appear."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, errors="replace") as f:
                m = re.search(pattern, f.read(), re.M)
            if m:
                return m
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in {path} within {timeout}s")
        time.sleep(0.05)


def http(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class OperationsTest(unittest.TestCase):
    def setUp(self):
        if daemon_binary() is None:
            self.skipTest("attnd is not built")
        self.tmp = tempfile.mkdtemp(prefix="attnd-ops-")
        self.daemon = None

    def tearDown(self):
        if self.daemon:
            self.daemon.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self, *args, env=None):
        self.daemon = Daemon(list(args), env=env, tmp=self.tmp)
        self.daemon.wait_ready()
        return self.daemon

    def test_sighup_reloads_and_never_ends_the_daemon(self):
        log = os.path.join(self.tmp, "own.log")
        d = self.start("--log-file", log)
        wait_for(log, r"event=ready ")
        os.rename(log, log + ".1")
        for _ in range(3):
            d.proc.send_signal(signal.SIGHUP)
            time.sleep(0.2)
        self.assertIsNone(d.proc.poll(), f"attnd died of SIGHUP:\n{d.log_text()}")
        self.assertTrue(os.path.exists(d.socket), "the socket file must stay")
        with attnd.Client(d.socket, timeout=10) as c:
            self.assertEqual(c.health().status, "serving")
        m = wait_for(log, r"event=reloaded signal=Hangup log=(\w+)")
        self.assertEqual(m.group(1), "reopened")
        with open(log + ".1") as f:
            self.assertIn("event=ready ", f.read())
        self.assertEqual(d.stop(), 0)
        wait_for(log, r"event=exit code=0")

    def test_journal_priorities(self):
        # stderr is the file the harness logs to; JOURNAL_STREAM names it, as
        # systemd names the journal's stream.
        path = os.path.join(self.tmp, "attnd.log")
        open(path, "wb").close()
        st = os.stat(path)
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        d = self.start("--log-level", "debug", env=env)
        with attnd.Client(d.socket, timeout=10) as c:
            with self.assertRaises(attnd.NotFound):
                c.close_session(attnd.SessionId(12345))
        self.assertEqual(d.stop(), 0)
        lines = [x for x in d.log_text().splitlines() if x]
        self.assertGreater(len(lines), 5)
        for line in lines:
            m = re.match(r"(<\d>)\S+ level=(\w+) ", line)
            self.assertTrue(m, f"no priority: {line!r}")
            self.assertEqual(m.group(1), PRIO[m.group(2)], line)
        self.assertTrue(any(x.startswith("<6>") and "event=request_failed" in x for x in lines))

    def test_step_trace_logs_every_phase(self):
        # --step-trace 4 (docs/operations.md section 6): one line per 4 steps of
        # a kind, the rest at exit; failed steps are not samples.
        d = self.start("--step-trace", "4")
        backend = re.search(r"--backend\s+(\w+)", " ".join(d.args)).group(1)
        with attnd.Client(d.socket, timeout=10) as c:
            m = c.health().model
            rng = np.random.default_rng(3)
            q = rng.uniform(-1, 1, (8, m.q_heads, m.head_dim)).astype(np.float32)
            kv = rng.uniform(-1, 1, (8, m.kv_heads, m.head_dim)).astype(np.float32)
            sid, _ = c.open_session()
            c.step(0, q, kv, kv, items=[attnd.Item(sid, start=0, n=8, tokens=list(range(8)))])
            for t in range(5):
                c.step(0, q[:1], kv[:1], kv[:1], items=[attnd.Item(sid, start=8 + t, n=1, tokens=[t])])
            c.step(0, None, kv[:2], kv[:2], items=[attnd.Item(sid, start=13, n=2, tokens=[1, 2], kv_only=True)])
            bad = q[:1].copy()
            bad[0, 0, 0] = np.nan
            with self.assertRaises(attnd.InvalidArgument):
                c.step(0, bad, kv[:1], kv[:1], items=[attnd.Item(sid, start=15, n=1, tokens=[1])])
        self.assertEqual(d.stop(), 0)
        text = d.log_text()
        lines = re.findall(r"(?m)^.*event=step_trace kind=(\w+) steps=(\d+) stat=p50/p90(.*)$", text)
        self.assertEqual([(k, n) for k, n, _ in lines],
                         [("decode", "4"), ("prefill", "1"), ("decode", "1"), ("kv_only", "1")], text)
        want = ["read", "decode", "admit", "scan", "queue", "compute", "encode", "total"]
        if backend == "cpu":
            want += ["kwrite", "attend"]
        for kind, _, rest in lines:
            if kind == "kv_only":  # no attention, no output
                self.assertRegex(rest, r" scan_us=.* total_us=")
                continue
            ph = {k: (float(a), float(b)) for k, a, b in re.findall(r" (\w+)_us=([\d.]+)/([\d.]+)", rest)}
            for k in want:
                self.assertIn(k, ph, f"{kind}: {rest}")
            for k, (p50, p90) in ph.items():
                self.assertLessEqual(p50, p90, f"{kind} {k}: {rest}")
            # Each step's whole contains its backend part, and that its phases,
            # so the medians keep the order (a sum of medians would not).
            self.assertGreaterEqual(ph["total"][0] + 1, ph["compute"][0], rest)
            if backend == "cpu":
                self.assertLessEqual(ph["kwrite"][0], ph["compute"][0] + 1, rest)
                self.assertLessEqual(ph["attend"][0], ph["compute"][0] + 1, rest)

    def test_failures_are_logged_rate_limited(self):
        d = self.start()  # default level: info
        with attnd.Client(d.socket, timeout=10) as c:
            m = c.health().model
            for _ in range(30):
                with self.assertRaises(attnd.NotFound):
                    c.close_session(attnd.SessionId(0x1234))
            q = np.zeros((1, m.q_heads, m.head_dim), np.float32)
            kv = np.zeros((1, m.kv_heads, m.head_dim), np.float32)
            sid, _ = c.open_session([1])
            for _ in range(3):
                with self.assertRaises(attnd.AttndError):
                    c.step(99, q, kv, kv, items=[attnd.Item(sid, start=0, n=1, tokens=[1])])
            with self.assertRaises(attnd.NotFound):
                c.plan([attnd.Item(attnd.SessionId(77), start=0, n=1, tokens=[1])])
        self.assertEqual(d.stop(), 0)
        text = d.log_text()
        close = re.findall(r"(?m)^.*event=request_failed method=close_session code=NOT_FOUND conn=.*$", text)
        self.assertEqual(len(close), 5, text)
        self.assertRegex(close[0], r'msg="[^"]+"')
        self.assertRegex(text, r"event=request_failed method=close_session code=NOT_FOUND suppressed=25 ")
        self.assertRegex(text, r"level=info event=request_failed method=step code=(INVALID_ARGUMENT|OUT_OF_RANGE) ")
        self.assertRegex(text, r"event=request_failed method=plan code=NOT_FOUND ")

    def test_probes_and_build_info(self):
        log = os.path.join(self.tmp, "own.log")
        self.start("--metrics", "127.0.0.1:0", "--log-file", log)
        port = int(wait_for(log, r"event=metrics_listening addr=\S+ port=(\d+)").group(1))
        self.assertEqual(http(port, "/healthz"), (200, "ok\n"))
        self.assertEqual(http(port, "/readyz"), (200, "ready\n"))
        code, body = http(port, "/metrics")
        self.assertEqual(code, 200)
        self.assertRegex(body, r'attnd_build_info\{version="[^"]+",backend="cpu",device="[^"]*",'
                               r'kv_cache="bf16"\} 1')
        self.assertEqual(http(port, "/nope")[0], 404)

    def test_kv_memory_over_host_memory_is_refused(self):
        # The CPU pool is calloc'ed: without the rule it would "start" and be
        # killed later by the OOM killer. 64T is more than any test host has.
        for extra in ([], ["--check-config"]):
            r = subprocess.run([daemon_binary(), "--backend", "cpu", "--kv-memory", "64T",
                                "--socket", os.path.join(self.tmp, "x.sock"), "--listen", "",
                                "--metrics", "", "--state-dir", self.tmp, *extra],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("90% of the memory available", r.stderr)
            self.assertFalse(os.path.exists(os.path.join(self.tmp, "x.sock")))


class PromtoolTest(unittest.TestCase):
    """`promtool check metrics` on a scrape taken after mixed traffic (steps and errors,
    so that every family has samples). promtool: PATH or $ATTND_PROMTOOL."""

    def test_promtool_check_metrics(self):
        promtool = os.environ.get("ATTND_PROMTOOL") or shutil.which("promtool")
        if not promtool:
            self.skipTest("promtool is not installed (Debian: prometheus)")
        if daemon_binary() is None:
            self.skipTest("attnd is not built")
        tmp = tempfile.mkdtemp(prefix="attnd-prom-")
        log = os.path.join(tmp, "own.log")
        d = Daemon(["--metrics", "127.0.0.1:0", "--log-file", log], tmp=tmp)
        try:
            d.wait_ready()
            port = int(wait_for(log, r"event=metrics_listening addr=\S+ port=(\d+)").group(1))
            with attnd.Client(d.socket, timeout=10) as c:
                m = c.health().model
                rng = np.random.default_rng(0)
                sid, _ = c.open_session(list(range(20)))
                for start, n in ((0, 20), (20, 1), (21, 1)):
                    plan = c.plan([attnd.Item(sid, start=start, n=n, tokens=list(range(n)))])
                    for layer in range(m.layers):
                        q = rng.standard_normal((n, m.q_heads, m.head_dim), dtype=np.float32)
                        k = rng.standard_normal((n, m.kv_heads, m.head_dim), dtype=np.float32)
                        c.step(layer, q, k, k, plan=plan)
                with self.assertRaises(attnd.NotFound):
                    c.close_session(attnd.SessionId(99))
            code, body = http(port, "/metrics")
            self.assertEqual(code, 200)
            self.assertRegex(body, r'attnd_step_queue_seconds_count\{kind="decode"\} [1-9]')
            r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                               text=True, timeout=60)
            self.assertEqual((r.returncode, r.stdout + r.stderr), (0, ""))
        finally:
            d.close()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
