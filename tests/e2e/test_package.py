"""Install rules and Debian maintainer scripts: `cmake --install` into a scratch
DESTDIR lays out what the .deb ships, and the installed Python package imports
its own generated protobuf module. (`cpack -G DEB` itself builds every target
first, so it is run by hand or in CI, not from ctest.)"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from harness import BUILD_DIR, SOURCE_DIR


class InstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not BUILD_DIR or not os.path.exists(os.path.join(BUILD_DIR, "cmake_install.cmake")):
            raise unittest.SkipTest("no configured build directory ($ATTND_BUILD_DIR)")
        cls.dest = tempfile.mkdtemp(prefix="attnd-install-")
        env = dict(os.environ, DESTDIR=cls.dest)
        r = subprocess.run(["cmake", "--install", BUILD_DIR, "--prefix", "/usr"], env=env,
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            shutil.rmtree(cls.dest, ignore_errors=True)
            raise AssertionError(f"cmake --install failed:\n{r.stdout}{r.stderr}")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dest, ignore_errors=True)

    def path(self, p):
        return os.path.join(self.dest, p.lstrip("/"))

    def test_layout(self):
        for p in ("usr/bin/attnctl", "usr/lib/systemd/system/attnd.service",
                  "usr/lib/systemd/system/attnd@.service", "usr/include/attnd/attnclient.h",
                  "usr/lib/python3/dist-packages/attnd/__init__.py",
                  "usr/lib/python3/dist-packages/attnd/attnd_pb2.py",
                  "usr/share/doc/attnd/examples/tiny_llama.py",
                  "usr/lib/python3/dist-packages/attnd/_version.py",
                  "usr/lib/python3/dist-packages/attnd/py.typed",
                  "usr/share/man/man8/attnd.8.gz", "usr/share/man/man1/attnctl.1.gz",
                  "usr/share/man/man5/attnd.conf.5.gz",
                  "usr/share/bash-completion/completions/attnd",
                  "usr/share/bash-completion/completions/attnctl",
                  "usr/share/doc/attnd/copyright", "usr/share/doc/attnd/changelog.gz"):
            self.assertTrue(os.path.exists(self.path(p)), p)
        if os.path.exists(os.path.join(BUILD_DIR, "daemon", "attnd")):
            self.assertTrue(os.access(self.path("usr/bin/attnd"), os.X_OK))
        # Always shipped: the units pass --config and the daemon refuses a missing file.
        self.assertTrue(os.path.exists(self.path("etc/attnd/attnd.conf")))

    def test_shipped_config_is_accepted_by_the_daemon(self):
        binary = os.path.join(BUILD_DIR, "daemon", "attnd")
        if not os.access(binary, os.X_OK):
            self.skipTest("attnd is not built yet")
        from harness import Daemon
        d = Daemon(["--config", self.path("etc/attnd/attnd.conf"), "--kv-memory", "64M"])
        try:
            h = d.wait_ready()
            self.assertEqual(h.status, "serving")
        finally:
            d.stop()
            d.close()

    def test_installed_python_package_is_self_contained(self):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "PYTHONPATH": self.path("usr/lib/python3/dist-packages")}
        r = subprocess.run([sys.executable, "-c",
                            "import attnd, attnd.client as c; print(c.pb.__name__, attnd.__file__)"],
                           env=env, capture_output=True, text=True, timeout=60, cwd=self.dest)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(r.stdout.startswith("attnd.attnd_pb2 "), r.stdout)

    def test_installed_attnctl_runs(self):
        r = subprocess.run([self.path("usr/bin/attnctl"), "--help"], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 0)
        self.assertIn("exit codes", r.stdout)


class MaintainerScriptsTest(unittest.TestCase):
    def test_scripts_parse_and_create_the_user(self):
        d = os.path.join(SOURCE_DIR, "deploy", "debian")
        for name in ("postinst", "prerm", "postrm"):
            p = os.path.join(d, name)
            self.assertTrue(os.access(p, os.X_OK), f"{name} must be executable")
            r = subprocess.run(["sh", "-n", p], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(d, "postinst")) as f:
            text = f.read()
        self.assertIn("useradd --system", text)
        self.assertIn("groupadd --system attnd", text)

    def run_postinst(self, user_exists):
        """Runs postinst with stub user tools on PATH: checks what it would do, changing nothing."""
        with tempfile.TemporaryDirectory() as stubs:
            log = os.path.join(stubs, "log")
            for tool in ("groupadd", "useradd", "usermod", "systemctl"):
                with open(os.path.join(stubs, tool), "w") as f:
                    f.write(f'#!/bin/sh\necho "{tool} $*" >> {log}\n')
                os.chmod(os.path.join(stubs, tool), 0o755)
            with open(os.path.join(stubs, "getent"), "w") as f:
                # "video" exists, attnd exists only when asked.
                f.write(f'#!/bin/sh\n[ "$2" = video ] && exit 0\n'
                        f'[ "$2" = attnd ] && exit {0 if user_exists else 2}\nexit 2\n')
            os.chmod(os.path.join(stubs, "getent"), 0o755)
            env = {"PATH": f"{stubs}:/usr/bin:/bin"}
            r = subprocess.run(["sh", os.path.join(SOURCE_DIR, "deploy", "debian", "postinst"), "configure"],
                               env=env, capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 0, r.stderr)
            return open(log).read() if os.path.exists(log) else ""

    def test_postinst_creates_the_user_once(self):
        calls = self.run_postinst(user_exists=False)
        self.assertIn("groupadd --system attnd", calls)
        self.assertRegex(calls, r"useradd --system --gid attnd .*--shell /usr/sbin/nologin.* attnd")
        self.assertIn("usermod -a -G video attnd", calls)
        self.assertNotIn("render", calls)
        again = self.run_postinst(user_exists=True)
        self.assertNotIn("groupadd", again)
        self.assertNotIn("useradd", again)

