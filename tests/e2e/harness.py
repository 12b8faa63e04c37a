"""Starts the real attnd on a temporary socket for the end-to-end tests.

Tests talk to it with the real clients (the Python package and attnctl). When
the daemon binary is not built yet, or a feature still answers UNIMPLEMENTED
(the engine placeholder), tests skip with a message instead of failing.
"""
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import attnd

BUILD_DIR = os.environ.get("ATTND_BUILD_DIR", "")
SOURCE_DIR = os.environ.get("ATTND_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Small shapes so every test runs in seconds on the CPU backend. ATTND_E2E_BACKEND=cuda
# runs the same suite on a GPU (ATTND_BIN and ATTND_ATTNCTL name binaries built elsewhere).
BACKEND = os.environ.get("ATTND_E2E_BACKEND", "cpu")
# ATTND_E2E_DAEMON_ARGS: flags added to every daemon a test starts (ctest's
# e2e_sessions_queued sends every step through the admission queue with them).
DAEMON_ARGS = shlex.split(os.environ.get("ATTND_E2E_DAEMON_ARGS", ""))
SMALL_SHAPE = ["--backend", BACKEND, "--kv-memory", "64M", "--layers", "2", "--q-heads", "4",
               "--kv-heads", "2", "--head-dim", "64", "--block-size", "16"]


def _exe(env, *rel):
    p = os.environ.get(env) or (os.path.join(BUILD_DIR, *rel) if BUILD_DIR else "")
    return p if p and os.access(p, os.X_OK) else None


def daemon_binary():
    return _exe("ATTND_BIN", "daemon", "attnd")


def attnctl_binary():
    return _exe("ATTND_ATTNCTL", "client", "attnctl")


class Daemon:
    """One attnd process in its own temporary directory."""

    def __init__(self, extra_args=(), env=None, socket_arg=True, state_arg=True, shape=SMALL_SHAPE,
                 tmp=None):
        binary = daemon_binary()
        if binary is None:
            raise unittest.SkipTest(
                f"attnd is not built yet ({os.path.join(BUILD_DIR or '$ATTND_BUILD_DIR', 'daemon', 'attnd')} missing)")
        # tmp: reuse a directory (and its state) from an earlier Daemon; the caller removes it.
        self.own_tmp = tmp is None
        self.tmp = tempfile.mkdtemp(prefix="attnd-e2e-") if tmp is None else tmp
        self.socket = os.path.join(self.tmp, "attnd.sock")
        self.log_path = os.path.join(self.tmp, "attnd.log")
        args = [binary]
        if socket_arg:
            args += ["--socket", self.socket]
        args += ["--listen", "127.0.0.1:0", "--metrics", ""]
        if state_arg:
            args += ["--state-dir", self.tmp]
        args += list(shape) + list(extra_args) + DAEMON_ARGS
        self.args = args
        self.env = dict(os.environ if env is None else env)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        self.health = None

    def wait_ready(self, timeout=20.0):
        """Waits until Health answers on the socket; returns the HealthResponse."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"attnd exited with {self.proc.returncode} at start:\n{self.log_text()}")
            if os.path.exists(self.socket):
                try:
                    with attnd.Client(self.socket, timeout=5) as c:
                        self.health = c.health()
                        return self.health
                except (attnd.AttndError, OSError) as e:
                    last = e
            time.sleep(0.05)
        raise AssertionError(f"attnd did not answer Health within {timeout}s ({last}):\n{self.log_text()}")

    @property
    def tcp_port(self):
        return self.health.tcp_port if self.health else 0

    def client(self, **kw):
        kw.setdefault("timeout", 30)
        return attnd.Client(self.socket, **kw)

    def log_text(self):
        self.log.flush()
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout=20.0):
        """SIGTERM, then wait; returns the exit code (kills after the timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"attnd did not exit within {timeout}s of SIGTERM:\n{self.log_text()}")
        return self.proc.returncode

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        finally:
            self.log.close()
            if self.own_tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)


class DaemonTestCase(unittest.TestCase):
    """Starts one daemon for the class; skips the class when attnd is not built."""

    extra_args = ()

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(cls.extra_args)
        try:
            cls.daemon.wait_ready()
        except BaseException:
            cls.daemon.close()
            raise

    @classmethod
    def tearDownClass(cls):
        d = cls.daemon
        try:
            code = d.stop()
            if code != 0:
                print(f"attnd exited {code} after SIGTERM:\n{d.log_text()}", file=sys.stderr)
        finally:
            d.close()

    @contextlib.contextmanager
    def engine_needed(self, what="sessions"):
        """Turns UNIMPLEMENTED (the engine placeholder) into a skip with a message."""
        try:
            yield
        except attnd.Unimplemented as e:
            self.skipTest(f"{what}: the daemon answers UNIMPLEMENTED ({e.message}); engine not landed yet")

    def attnctl(self, *args, check=None, timeout=60):
        exe = attnctl_binary()
        if exe is None:
            self.skipTest("attnctl is not built")
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
        if check is not None:
            self.assertEqual(r.returncode, check, f"attnctl {' '.join(args)}: {r.stdout}{r.stderr}")
        return r
