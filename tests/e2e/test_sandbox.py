"""attnd under its systemd unit's system call sandbox, without systemd.

deploy/sandbox-check.sh --no-systemd runs the daemon under attnd-sandbox-exec
(deploy/sandbox/attnd_sandbox_exec.c) with the unit's SystemCallFilter=,
SystemCallErrorNumber=, RestrictAddressFamilies=, NoNewPrivileges=,
LockPersonality= and RestrictNamespaces=, checks the devices it holds open
against DevicePolicy=/DeviceAllow=, and runs the tiny Llama example against it.
Here on the CPU backend (the GPU round runs the same script with --backend
cuda). The filter itself is checked too: under it, a call outside the allow
list fails with the unit's errno and a socket of a family the unit does not
allow fails with EAFNOSUPPORT, so a filter that let everything through
would not pass."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from harness import SOURCE_DIR, attnctl_binary, daemon_binary

SANDBOX_EXEC = os.environ.get("ATTND_SANDBOX_EXEC", "")
SANDBOX_DIR = os.path.join(SOURCE_DIR, "deploy", "sandbox")


def need_tool(test):
    if not SANDBOX_EXEC or not os.access(SANDBOX_EXEC, os.X_OK):
        test.skipTest("attnd-sandbox-exec not built (Debian package libseccomp-dev)")
    lists = [os.path.join(SANDBOX_DIR, n) for n in ("system-service.list", "privileged.list")]
    r = subprocess.run([SANDBOX_EXEC, "--allow", lists[0], "--deny", lists[1], "--", "true"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode == 125:
        test.skipTest("this container does not allow installing a seccomp filter: " + r.stderr.strip())


class FilterTest(unittest.TestCase):
    def run_filtered(self, code):
        need_tool(self)
        lists = [os.path.join(SANDBOX_DIR, n) for n in ("system-service.list", "privileged.list")]
        return subprocess.run(
            [SANDBOX_EXEC, "--allow", lists[0], "--deny", lists[1], "--families",
             "AF_UNIX,AF_INET,AF_INET6,AF_NETLINK", "--", sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60)

    def test_filter_denies(self):
        # mount(2) is in @privileged: EPERM; AF_PACKET is not in the families: EAFNOSUPPORT;
        # unshare(CLONE_NEWNS) is a namespace: EPERM; an ordinary socket still works.
        code = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
r = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
print("mount", r, ctypes.get_errno())
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    print("packet ok")
except OSError as e:
    print("packet", e.errno)
r = libc.unshare(0x00020000)
print("unshare", r, ctypes.get_errno())
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.close()
print("unix ok")
"""
        r = self.run_filtered(code)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = r.stdout.split("\n")
        import errno
        self.assertIn(f"mount -1 {errno.EPERM}", out)
        self.assertIn(f"packet {errno.EAFNOSUPPORT}", out)
        self.assertIn(f"unshare -1 {errno.EPERM}", out)
        self.assertIn("unix ok", out)

    def test_lists_match_systemd(self):
        exe = shutil.which("systemd-analyze")
        if exe is None:
            self.skipTest("systemd-analyze is not installed (Debian package systemd)")
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, os.path.join(SANDBOX_DIR, "expand_filter.py"),
                            "@system-service", "@privileged"], check=True, cwd=d, timeout=60)
            for name in ("system-service.list", "privileged.list"):
                with open(os.path.join(d, name)) as a, open(os.path.join(SANDBOX_DIR, name)) as b:
                    fresh = [x for x in a.read().splitlines() if not x.startswith("#")]
                    kept = [x for x in b.read().splitlines() if not x.startswith("#")]
                self.assertEqual(fresh, kept, f"deploy/sandbox/{name} differs from this systemd's "
                                 "expansion: regenerate it with expand_filter.py")


class SandboxCheckTest(unittest.TestCase):
    def test_cpu_backend_under_the_unit_filter(self):
        need_tool(self)
        attnd, attnctl = daemon_binary(), attnctl_binary()
        if not attnd or not attnctl:
            self.skipTest("attnd or attnctl not built")
        example = os.path.join(SOURCE_DIR, "client", "python", "examples", "tiny_llama.py")
        # LeakSanitizer stops the world with ptrace, which the filter denies
        # (@privileged): a sanitizer build's daemon checks no leaks here.
        env = dict(os.environ)
        env["ASAN_OPTIONS"] = (env.get("ASAN_OPTIONS", "") + ":detect_leaks=0").lstrip(":")
        r = subprocess.run(
            ["bash", os.path.join(SOURCE_DIR, "deploy", "sandbox-check.sh"), "--no-systemd",
             "--sandbox-exec", SANDBOX_EXEC, "--attnd", attnd, "--attnctl", attnctl,
             "--example", example, "--backend", "cpu", "--python", sys.executable],
            capture_output=True, text=True, timeout=240, env=env)
        self.assertEqual(r.returncode, 0, r.stdout[-4000:] + r.stderr[-4000:])
        self.assertIn("sandbox-check: PASS", r.stdout)


if __name__ == "__main__":
    unittest.main()
