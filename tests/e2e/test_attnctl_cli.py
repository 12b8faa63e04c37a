"""attnctl's command-line habits against the real daemon: `--flag value` and
`--flag=value` everywhere, options before or after the command, exit code 2 for
every usage error, --version, `health --watch` that keeps watching through a
daemon restart, and session ids printed as the Python client prints them."""
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
import unittest

import attnd
from harness import SOURCE_DIR, Daemon, attnctl_binary, daemon_binary


def ctl(*args, timeout=60):
    exe = attnctl_binary()
    if exe is None:
        raise unittest.SkipTest("attnctl is not built")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


class UsageTest(unittest.TestCase):
    """No daemon needed."""

    def test_version(self):
        r = ctl("--version")
        self.assertEqual(r.returncode, 0)
        with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
            want = re.search(r"project\(\s*attnd\s+VERSION\s+([0-9.]+)", f.read()).group(1)
        self.assertEqual(r.stdout.strip(), f"attnctl {want}")
        self.assertEqual(ctl("-V").stdout, r.stdout)
        if daemon_binary():
            d = subprocess.run([daemon_binary(), "--version"], capture_output=True, text=True)
            self.assertEqual(d.stdout.split()[-1], want)

    def test_usage_errors_exit_2(self):
        cases = [
            [], ["frobnicate"], ["health", "extra"], ["health", "--bogus"], ["health", "-x"],
            ["--socket"], ["health", "--watch"], ["health", "--watch=abc"], ["health", "--watch", "0"],
            ["health", "--watch=-1"], ["sessions", "--watch", "1"], ["config", "--count=2"],
            ["health", "--count", "2"], ["stats", "--watch", "1", "--count", "0"],
            ["stats", "--sessions", "2"], ["bench", "--prompt=-1"], ["bench", "--depth", "0"],
            ["bench", "--seed", "x"], ["--socket", "/a", "--tcp", "b:1", "health"],
            ["--json=1", "health"], ["--token-file", "/nonexistent/token", "health"],
        ]
        for args in cases:
            with self.subTest(args=args):
                r = ctl(*args)
                self.assertEqual(r.returncode, 2, f"attnctl {args}: {r.stdout}{r.stderr}")
                self.assertTrue(r.stderr.strip(), "a usage error must say what was wrong")
                self.assertEqual(r.stdout, "")

    def test_help_everywhere(self):
        r = ctl("--help")
        self.assertEqual(r.returncode, 0)
        for cmd in ("health", "stats", "sessions", "config", "bench"):
            self.assertIn(cmd, r.stdout)
            for form in ([cmd, "--help"], ["--help", cmd], [cmd, "-h"]):
                h = ctl(*form)
                self.assertEqual(h.returncode, 0, form)
                self.assertTrue(h.stdout.startswith(f"usage: attnctl [global options] {cmd}"), h.stdout)

    def test_cannot_connect_exit_3(self):
        with tempfile.TemporaryDirectory() as d:
            for args in (["--socket", f"{d}/no.sock", "health"], [f"--socket={d}/no.sock", "stats"],
                         ["stats", "--socket", f"{d}/no.sock", "--json"]):
                r = ctl(*args)
                self.assertEqual(r.returncode, 3, args)
                self.assertIn(f"{d}/no.sock", r.stderr)


class AgainstDaemonTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()
        try:
            cls.d.wait_ready()
        except BaseException:
            cls.d.close()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        cls.d.close()

    def test_both_value_forms_and_positions(self):
        s = self.d.socket
        port = self.d.tcp_port
        forms = [["--socket", s, "--json", "health"], [f"--socket={s}", "--json", "health"],
                 ["health", "--json", "--socket", s], ["--json", "health", f"--socket={s}"],
                 ["--tcp", f"127.0.0.1:{port}", "--json", "health"],
                 [f"--tcp=127.0.0.1:{port}", "health", "--json"]]
        for args in forms:
            with self.subTest(args=args):
                r = ctl(*args)
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertEqual(json.loads(r.stdout)["status"], "serving")
        for args in (["stats", "--watch", "0.05", "--count", "2"], ["stats", "--watch=0.05", "--count=2"]):
            r = ctl("--socket", s, "--json", *args)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(len(r.stdout.splitlines()), 2)
        r = ctl("--socket", s, "--json", "bench", "--sessions=2", "--prompt=8", "--steps", "2", "--seed=7")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["sessions"], 2)

    def test_session_ids_print_alike(self):
        with self.d.client() as c:
            sid, _ = c.open_session([5, 6, 7])
            try:
                self.assertRegex(str(sid), r"^[0-9a-f]{16}$")
                self.assertEqual(f"{sid}", str(sid))
                self.assertEqual(attnd.SessionId(str(sid)), sid)
                self.assertEqual(repr(sid), f"SessionId('{sid}')")
                listed = {str(x.session) for x in c.list_sessions()}
                self.assertIn(str(sid), listed)
                r = ctl("--socket", self.d.socket, "--json", "sessions")
                self.assertEqual(r.returncode, 0, r.stderr)
                ids = [x["session"] for x in json.loads(r.stdout)["sessions"]]
                # attnctl connects as the same uid: the same identity, so it lists this session.
                self.assertIn(str(sid), ids)
                human = ctl("--socket", self.d.socket, "sessions").stdout
                self.assertRegex(human, rf"(?m)^{sid} ")
            finally:
                c.close_session(sid)


class HealthWatchTest(unittest.TestCase):
    """health --watch keeps sampling while the daemon is down, comes back with it,
    and reports the restart (a new epoch)."""

    def read_line(self, proc, timeout=15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([proc.stdout], [], [], 0.2)
            if r:
                line = proc.stdout.readline()
                if line:
                    return json.loads(line)
            if proc.poll() is not None:
                self.fail(f"attnctl health --watch exited {proc.returncode}: {proc.stderr.read()}")
        self.fail("attnctl health --watch printed nothing for 15 s")

    def wait_for(self, proc, status):
        for _ in range(200):
            j = self.read_line(proc)
            if j["status"] == status:
                return j
        self.fail(f"never saw status {status}")

    def test_watch_through_a_restart(self):
        exe = attnctl_binary()
        if exe is None or daemon_binary() is None:
            self.skipTest("attnctl or attnd is not built")
        tmp = tempfile.mkdtemp(prefix="attnd-watch-")
        sock = os.path.join(tmp, "attnd.sock")
        proc = subprocess.Popen([exe, "--json", "health", f"--socket={sock}", "--watch", "0.1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        d = None
        try:
            # Started before the daemon: it waits for it, saying so each time.
            j = self.read_line(proc)
            self.assertEqual(j["status"], "unreachable")
            self.assertEqual(j["socket"], sock)
            self.assertIn(sock, j["error"])
            d = Daemon(tmp=tmp)
            d.wait_ready()
            first = self.wait_for(proc, "serving")
            self.assertEqual(first["epoch"], f"{d.health.epoch:016x}")
            self.assertEqual(d.stop(), 0)
            d.close()
            self.wait_for(proc, "unreachable")
            d = Daemon(tmp=tmp)
            d.wait_ready()
            second = self.wait_for(proc, "serving")
            self.assertNotEqual(second["epoch"], first["epoch"])
            self.assertEqual(second["epoch"], f"{d.health.epoch:016x}")
            self.assertIsNone(proc.poll(), "--watch without --count must keep running")
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=10)
            if d is not None:
                d.stop()
                d.close()
            shutil.rmtree(tmp, ignore_errors=True)
        self.assertIn("attnd restarted (epoch", err)

    def test_watch_count_and_exit_code(self):
        with tempfile.TemporaryDirectory() as t:
            r = ctl("--socket", os.path.join(t, "none.sock"), "health", "--watch=0.05", "--count=3")
            self.assertEqual(r.returncode, 3)
            self.assertEqual(r.stdout.count("unreachable:"), 3)
        d = Daemon()
        try:
            d.wait_ready()
            r = ctl("--socket", d.socket, "health", "--watch", "0.05", "--count", "2")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.count("=== "), 2)
            self.assertEqual(r.stdout.count(": serving"), 2)
        finally:
            d.stop()
            d.close()


if __name__ == "__main__":
    unittest.main()
