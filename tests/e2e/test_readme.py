"""The README's Quick start, as printed: after the daemon `make run` starts (the
built-in 32-layer shape, the default socket), `build/client/attnctl health`
answers and the Python block sends a first step through every layer. The
commands are taken from README.md and run with bash in a directory laid out like
a checkout (build/ and client/), so an edit that breaks them fails here."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

from harness import BUILD_DIR, SOURCE_DIR, Daemon, attnctl_binary


def quick_start():
    with open(os.path.join(SOURCE_DIR, "README.md")) as f:
        text = f.read()
    m = re.search(r"(?ms)^## Quick start\n(.*?)^## ", text)
    if not m:
        raise AssertionError("README.md has no '## Quick start' section")
    return m.group(1)


class QuickStartTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="attnd-readme-")
        run_dir = os.path.join(cls.tmp, "run")
        os.mkdir(run_dir, 0o700)
        # As `make run` does: no --socket and the built-in shape, so the daemon and the
        # clients find each other through the default lookup ($RUNTIME_DIRECTORY first).
        # The KV memory is smaller than the CPU default (1G) only to spare the test host.
        cls.env = dict(os.environ, RUNTIME_DIRECTORY=run_dir)
        cls.daemon = Daemon(shape=["--backend", "cpu", "--kv-memory", "256M"], env=cls.env,
                            socket_arg=False)
        cls.daemon.socket = os.path.join(run_dir, "attnd.sock")
        try:
            cls.daemon.wait_ready(timeout=60)
        except BaseException:
            cls.daemon.close()
            raise
        # A checkout's layout: build/ (this build) and client/ next to each other, and
        # Debian's python3 first on PATH, as on the Debian host the README is written for.
        cls.work = os.path.join(cls.tmp, "checkout")
        os.mkdir(cls.work)
        os.symlink(BUILD_DIR, os.path.join(cls.work, "build"))
        os.symlink(os.path.join(SOURCE_DIR, "client"), os.path.join(cls.work, "client"))
        bindir = os.path.join(cls.tmp, "bin")
        os.mkdir(bindir)
        os.symlink(sys.executable, os.path.join(bindir, "python3"))
        env = {k: v for k, v in cls.env.items() if k != "PYTHONPATH"}
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        cls.shell_env = env

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        cls.daemon.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def bash(self, script):
        return subprocess.run(["bash", "-e", "-c", script], cwd=self.work, env=self.shell_env,
                              capture_output=True, text=True, timeout=300)

    def test_attnctl_health_answers(self):
        if attnctl_binary() is None:
            self.skipTest("attnctl is not built")
        cmd = re.search(r"(?m)^\$ (build/client/attnctl health)$", quick_start())
        self.assertIsNotNone(cmd, "the Quick start shows `$ build/client/attnctl health`")
        r = self.bash(cmd.group(1))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stdout, r"^attnd \S+: serving\n")
        self.assertIn("model          32 layers, 32 q / 8 kv heads, head_dim 128, bf16, kv bf16",
                      r.stdout, "the README shows this line of the built-in shape")

    def test_first_step_snippet(self):
        blocks = re.findall(r"(?ms)^```\n(PYTHONPATH=.*?python3 - <<'EOF'\n.*?^EOF\n)```", quick_start())
        self.assertEqual(len(blocks), 1, "the Quick start has one Python heredoc block")
        r = self.bash(blocks[0])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # The comment's example output, with this run's session id.
        self.assertRegex(r.stdout.strip(), r"^[0-9a-f]{16} \(4, 32, 128\)$")
        with self.daemon.client() as c:
            self.assertEqual(c.list_sessions(), [], "the snippet closes its session")
            st = c.stats()
        steps = {m.method: m.requests for m in st.methods}.get("step", 0)
        self.assertGreaterEqual(steps, 32, f"one step per layer: {st.methods}")


if __name__ == "__main__":
    unittest.main()
