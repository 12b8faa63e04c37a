"""The clients against fake_attnd.py (the wire protocol with numpy math behind it):
framing, receive-by-id with out-of-order answers, typed errors, epoch changes,
attnctl's commands and exit codes, and the tiny Llama example. These run whether
or not the real daemon has landed; the same paths run against it in
test_health.py, test_sessions.py and test_tiny_llama.py."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

import attnd
from attnd.client import pb
from fake_attnd import FakeAttnd
from harness import SOURCE_DIR, attnctl_binary
from reference import RefSession, rel_l2

sys.path.insert(0, os.path.join(SOURCE_DIR, "client", "python", "examples"))
import tiny_llama  # noqa: E402


class FakeCase(unittest.TestCase):
    reverse = False

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "fake.sock")
        self.fake = FakeAttnd(self.path, reverse=self.reverse)

    def tearDown(self):
        self.fake.close()
        self.tmp.cleanup()


class PythonClientTest(FakeCase):
    reverse = True

    def test_out_of_order_answers_are_matched_by_id(self):
        with attnd.Client(self.path, timeout=10) as c:
            ids = []
            for i in range(6):
                r = pb.Request()
                (r.health if i % 2 else r.stats).SetInParent()
                ids.append(c.send(r))
            got = {c.recv(i).id for i in ids}
            self.assertEqual(got, set(ids))

    def test_typed_errors(self):
        with attnd.Client(self.path, timeout=10) as c:
            with self.assertRaises(attnd.NotFound) as cm:
                c.close_session(12345)
            self.assertEqual(cm.exception.code, 5)
            self.assertIn("not found", str(cm.exception))
            with self.assertRaises(attnd.Unimplemented):
                c.call(pb.Request())
            sid, _ = c.open_session([1, 2, 3])
            with self.assertRaises(attnd.InvalidArgument):
                c.plan([attnd.Item(sid, 5, 1)])
            self.assertIsInstance(attnd.error_for(9, "x"), attnd.FailedPrecondition)
            self.assertIsInstance(attnd.error_for(8, "x"), attnd.ResourceExhausted)

    def test_epoch_change_raises_once_then_flags(self):
        with attnd.Client(self.path, timeout=10) as c:
            sid, _ = c.open_session([1])
            old = c.epoch
            self.assertEqual(c.session_epoch(sid), old)
            self.fake.restart()
            with self.assertRaises(attnd.EpochChanged) as cm:
                c.health()
            self.assertEqual(cm.exception.old, old)
            self.assertNotEqual(c.epoch, old)
            self.assertTrue(c.epoch_changed)
            self.assertIsNone(c.session_epoch(sid))
            with self.assertRaises(attnd.NotFound):  # the session is gone with the old daemon
                c.close_session(sid)
        seen = []
        with attnd.Client(self.path, timeout=10, on_epoch_change=lambda o, n: seen.append((o, n))) as c:
            c.health()
            self.fake.restart()
            c.health()
        self.assertEqual(len(seen), 1)

    def test_session_context_manager(self):
        with attnd.Client(self.path, timeout=10) as c:
            with c.session([1, 2, 3]) as s:
                self.assertEqual(s.cached_len, 0)
                self.assertIn(s.id, [x.session for x in c.list_sessions()])
                child = s.fork()
                child.truncate(1)
                child.close()
                child.close()  # idempotent
            self.assertEqual(c.list_sessions(), [])
        with attnd.Client(self.path, timeout=10, on_epoch_change="flag") as c:
            s = c.session([1])
            self.fake.restart()
            c.health()
            self.assertTrue(s.stale())
            s.close()  # a stale session is not closed on the new daemon

    def test_numpy_in_and_out(self):
        m = self.fake.m
        rng = np.random.default_rng(3)
        with attnd.Client(self.path, timeout=10, bf16="float32") as c:
            sid, _ = c.open_session(list(range(10)))
            ref = RefSession(m)
            plan = c.plan([attnd.Item(sid, 0, 10, tokens=list(range(10)))])
            q = rng.standard_normal((10, m.q_heads, m.head_dim)).astype(np.float32)
            k = rng.standard_normal((10, m.kv_heads, m.head_dim)).astype(np.float32)
            v = rng.standard_normal((10, m.kv_heads, m.head_dim)).astype(np.float32)
            # float32 in (rounded by the client), bf16 bits in: the same request.
            r1 = c.step(0, q, k, v, plan=plan)
            r2 = c.step(0, attnd.f32_to_bf16(q), attnd.f32_to_bf16(k), attnd.f32_to_bf16(v), plan=plan)
            self.assertEqual(r1.out.dtype, np.float32)
            np.testing.assert_array_equal(r1.out, r2.out)
            self.assertLess(rel_l2(r1.out, ref.step(0, 0, q, k, v)), 1e-6)
        with attnd.Client(self.path, timeout=10, bf16="uint16") as c:
            c.open_session([1])
            self.assertEqual(c.model.head_dim, m.head_dim)

    def test_spin_and_kernel_timeout(self):
        """set_spin reads the same answers (non-blocking reads first); the
        connection's timeout is the kernel's (no poll() per call) and a silent
        daemon still fails the read as a timeout."""
        m = self.fake.m
        rng = np.random.default_rng(5)
        q = attnd.f32_to_bf16(rng.standard_normal((3, m.q_heads, m.head_dim)).astype(np.float32))
        k = attnd.f32_to_bf16(rng.standard_normal((3, m.kv_heads, m.head_dim)).astype(np.float32))
        with attnd.Client(self.path, timeout=10) as c:
            self.assertIsNone(c._sock.gettimeout())  # blocking: SO_RCVTIMEO keeps the timeout
            sid, _ = c.open_session([1, 2, 3])
            plan = c.plan([attnd.Item(sid, 0, 3, tokens=[1, 2, 3])])
            plain = c.step(0, q, k, k, plan=plan).out
            c.set_spin(200)
            for _ in range(3):
                np.testing.assert_array_equal(c.step(0, q, k, k, plan=plan).out, plain)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        quiet = os.path.join(self.tmp.name, "quiet.sock")
        srv.bind(quiet)
        srv.listen(1)
        try:
            with attnd.Client(quiet, timeout=0.2) as c:
                r = pb.Request()
                r.health.SetInParent()
                rid = c.send(r)
                with self.assertRaisesRegex(attnd.AttndConnectionError, "timed out"):
                    c.recv(rid)
        finally:
            srv.close()

    def test_bf16_helpers_round_to_nearest_even(self):
        x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 0.0, np.inf], np.float32)
        b = attnd.f32_to_bf16(x)
        np.testing.assert_array_equal(b, [0x3F80, 0x3F80, 0x3F82, 0xC020, 0, 0x7F80])
        np.testing.assert_array_equal(attnd.bf16_to_f32(b)[:4], [1.0, 1.0, 1.015625, -2.5])
        self.assertEqual(int(attnd.f32_to_bf16(np.float32("nan"))), 0x7FC0)

    def test_default_socket_order(self):
        env = dict(os.environ)
        try:
            os.environ["RUNTIME_DIRECTORY"] = self.tmp.name + ":/other"
            os.rename(self.path, os.path.join(self.tmp.name, "attnd.sock"))
            self.assertEqual(attnd.default_socket(), os.path.join(self.tmp.name, "attnd.sock"))
        finally:
            os.environ.clear()
            os.environ.update(env)


class TinyLlamaFakeTest(FakeCase):
    def test_generates_and_matches_local_attention(self):
        with attnd.Client(self.path, timeout=30) as c:
            res = tiny_llama.generate(c, prompt_len=12, new_tokens=16, verbose=True)
        self.assertEqual(len(res["tokens"]), 16)
        self.assertLess(res["worst_logit_rel_l2"], tiny_llama.logit_tol(c.model.layers))
        self.assertGreaterEqual(res["agree"] + res["near_ties"], 17)


class AttnctlFakeTest(FakeCase):
    def run_ctl(self, *args, check=None):
        exe = attnctl_binary()
        if exe is None:
            self.skipTest("attnctl is not built ($ATTND_BUILD_DIR/client/attnctl)")
        r = subprocess.run([exe, "--socket", self.path, *args], capture_output=True, text=True, timeout=60)
        if check is not None:
            self.assertEqual(r.returncode, check, r.stdout + r.stderr)
        return r

    def test_commands(self):
        self.assertEqual(json.loads(self.run_ctl("--json", "health", check=0).stdout)["status"], "serving")
        self.assertIn("serving", self.run_ctl("health", check=0).stdout)
        j = json.loads(self.run_ctl("--json", "config", check=0).stdout)
        self.assertEqual(j["head_dim"], 64)
        self.run_ctl("config", check=0)
        self.assertIn("methods", json.loads(self.run_ctl("--json", "stats", check=0).stdout))
        self.run_ctl("stats", "--watch", "0.05", "--count", "2", check=0)
        self.assertEqual(json.loads(self.run_ctl("--json", "sessions", check=0).stdout)["count"], 0)

    def test_bench_and_sessions(self):
        self.fake.reverse = True  # pipelined layer steps come back out of order
        r = self.run_ctl("--json", "bench", "--sessions", "2", "--prompt", "20", "--steps", "6",
                         "--depth", "2", check=0)
        j = json.loads(r.stdout)
        self.assertEqual(j["decode_token"]["count"], 6)
        self.assertEqual(j["decode_layer_step"]["count"], 12)
        self.assertEqual(j["prefill_layer_step"]["count"], 2)
        r = self.run_ctl("bench", "--sessions", "1", "--prompt", "0", "--steps", "3", "--inline", check=0)
        self.assertIn("p99 ms", r.stdout)
        # bench closes what it opened
        self.assertEqual(json.loads(self.run_ctl("--json", "sessions", check=0).stdout)["count"], 0)

    def test_watch_survives_a_restart(self):
        exe = attnctl_binary()
        if exe is None:
            self.skipTest("attnctl is not built")
        p = subprocess.Popen([exe, "--socket", self.path, "--json", "stats", "--watch", "0.2", "--count", "4"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = p.stdout.readline()  # connected and sampled once
        self.fake.close()  # the daemon goes away ...
        time.sleep(0.5)
        self.fake = FakeAttnd(self.path)  # ... and comes back with a new epoch
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(len((first + out).splitlines()), 4)
        self.assertIn("retrying", err)
        self.assertIn("restarted", err)

    def test_daemon_error_is_exit_1(self):
        self.fake.token = "secret"
        with tempfile.NamedTemporaryFile("w") as f:
            f.write("wrong\n")
            f.flush()
            r = self.run_ctl("--token-file", f.name, "health", check=1)
            self.assertIn("UNAUTHENTICATED", r.stderr)
        with tempfile.NamedTemporaryFile("w") as f:
            f.write("secret\n")
            f.flush()
            self.run_ctl("--token-file", f.name, "health", check=0)
