"""client/python as an installable package: `pip install ./client/python` into a
fresh virtual environment, then `import attnd` with no PYTHONPATH, from outside
the checkout, against the real daemon.

OfflineInstallTest builds with no network: a venv over Debian's site packages
(setuptools, wheel, numpy, protobuf) and `pip install --no-index
--no-build-isolation`, the generated module made by Debian's protoc.
PyPIInstallTest is the new user's path: a bare venv, pip fetching the build
backend and the dependencies from the package index, once at the documented
floors (numpy 1.23.2, protobuf 3.20.0) with protoc generating, once at the
newest releases with grpcio-tools generating (no protoc). It skips, as ctest
"Skipped", only when the index cannot be reached."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest
import urllib.parse

from harness import BUILD_DIR, SOURCE_DIR, Daemon, daemon_binary

PKG = os.path.join(SOURCE_DIR, "client", "python")

# Run by the venv's Python, in an empty directory, with a clean environment:
# everything it imports must come from the installed package.
PROBE = r'''
import json, os, sys
import numpy as np
import attnd, attnd.client
sock = sys.argv[1]
out = {"version": attnd.__version__, "file": attnd.__file__, "pb2": attnd.client.pb.__file__,
       "typed": os.path.exists(os.path.join(os.path.dirname(attnd.__file__), "py.typed")),
       "numpy": np.__version__}
import google.protobuf
out["protobuf"] = google.protobuf.__version__
if sock:
    with attnd.Client(sock, timeout=30) as c:
        m = c.health().model
        sid, cached = c.open_session([1, 2, 3])
        out["sid"] = str(sid)
        out["sid_repr"] = repr(sid)
        plan = c.plan([attnd.Item(sid, start=0, n=3, tokens=[1, 2, 3])])
        rng = np.random.default_rng(0)
        q = rng.standard_normal((3, m.q_heads, m.head_dim)).astype(np.float32)
        k = rng.standard_normal((3, m.kv_heads, m.head_dim)).astype(np.float32)
        v = rng.standard_normal((3, m.kv_heads, m.head_dim)).astype(np.float32)
        r = c.step(0, q, k, v, plan=plan)
        out["out_shape"] = list(r.out.shape)
        # Row 0 sees only key 0: its output is v[0] of its kv head, rounded to bf16.
        got = attnd.bf16_to_f32(r.out)[0, 0]
        out["row0_err"] = float(np.max(np.abs(got - attnd.round_bf16(v[0, 0]))))
        out["listed"] = [str(s.session) for s in c.list_sessions()]
        c.close_session(sid)
print(json.dumps(out))
'''


def project_version():
    with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
        return re.search(r"project\(\s*attnd\s+VERSION\s+([0-9.]+)", f.read()).group(1)


def index_reachable():
    """True when pip's package index answers a TCP connect (PIP_INDEX_URL or PyPI)."""
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    u = urllib.parse.urlparse(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname, port), timeout=5):
            return True
    except OSError:
        return False


class VenvCase(unittest.TestCase):
    system_site = False

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="attnd-venv-")
        cls.daemon = None
        if daemon_binary() is not None:
            cls.daemon = Daemon()
            try:
                cls.daemon.wait_ready()
            except BaseException:
                cls.daemon.close()
                shutil.rmtree(cls.tmp, ignore_errors=True)
                raise

    @classmethod
    def tearDownClass(cls):
        if cls.daemon is not None:
            cls.daemon.stop()
            cls.daemon.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def clean_env(self, **extra):
        # No PYTHONPATH: the build tree's attnd_pb2 and the checkout's attnd must not leak in.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.tmp,
               "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT", "HTTPS_PROXY", "https_proxy",
                  "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
            if k in os.environ:
                env[k] = os.environ[k]
        env.update(extra)
        return env

    def make_venv(self, name):
        venv = os.path.join(self.tmp, name)
        args = [sys.executable, "-m", "venv", venv]
        if self.system_site:
            args.insert(3, "--system-site-packages")
        r = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            self.fail(f"python3 -m venv failed (Debian: python3-venv):\n{r.stderr}")
        return os.path.join(venv, "bin", "python")

    def pip_install(self, py, *args, env=None):
        r = subprocess.run([py, "-m", "pip", "install", *args], env=env or self.clean_env(),
                           capture_output=True, text=True, timeout=900, cwd=self.tmp)
        self.assertEqual(r.returncode, 0, f"pip install {' '.join(args)} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        return r

    def probe(self, py):
        work = tempfile.mkdtemp(dir=self.tmp)
        sock = self.daemon.socket if self.daemon else ""
        r = subprocess.run([py, "-c", PROBE, sock], env=self.clean_env(), capture_output=True, text=True,
                           timeout=120, cwd=work)
        self.assertEqual(r.returncode, 0, f"the installed package failed:\n{r.stdout}{r.stderr}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        venv = os.path.dirname(os.path.dirname(py))
        self.assertEqual(out["version"], project_version())
        if daemon_binary():
            v = subprocess.run([daemon_binary(), "--version"], capture_output=True, text=True, timeout=30)
            self.assertEqual(v.stdout.split()[-1], out["version"], "attnd --version and attnd.__version__")
        self.assertTrue(out["file"].startswith(venv), f"attnd imported from {out['file']}, not the venv")
        self.assertTrue(out["pb2"].startswith(os.path.dirname(out["file"])),
                        f"attnd_pb2 imported from {out['pb2']}, not from the installed package")
        self.assertTrue(out["typed"], "py.typed is not installed")
        if self.daemon is not None:
            m = self.daemon.health.model
            self.assertEqual(out["out_shape"], [3, m.q_heads, m.head_dim])
            self.assertLess(out["row0_err"], 1e-2)
            self.assertRegex(out["sid"], r"^[0-9a-f]{16}$")
            self.assertEqual(out["sid_repr"], f"SessionId('{out['sid']}')")
            self.assertIn(out["sid"], out["listed"])
        print(f"installed attnd {out['version']} with numpy {out['numpy']}, protobuf {out['protobuf']}")
        return out


class OfflineInstallTest(VenvCase):
    system_site = True

    def test_install_without_network(self):
        py = self.make_venv("offline")
        have = subprocess.run([py, "-c", "import setuptools, wheel, numpy, google.protobuf"],
                              capture_output=True, text=True, env=self.clean_env())
        if have.returncode != 0:
            self.skipTest(f"Debian's python3-setuptools/-wheel/-numpy/-protobuf are missing: {have.stderr}")
        if shutil.which("protoc") is None:
            self.skipTest("protoc is not installed (Debian: protobuf-compiler)")
        self.pip_install(py, "--no-index", "--no-build-isolation", PKG)
        self.probe(py)
        # Nothing was generated or built inside the checkout.
        for junk in ("build", "attnd.egg-info", os.path.join("attnd", "attnd_pb2.py"),
                     os.path.join("attnd", "_version.py")):
            self.assertFalse(os.path.exists(os.path.join(PKG, junk)), f"client/python/{junk} left behind")


class PyPIInstallTest(VenvCase):
    @classmethod
    def setUpClass(cls):
        if not index_reachable():
            raise unittest.SkipTest("the package index is not reachable (no network): "
                                    "the fresh-venv install from PyPI is not run")
        super().setUpClass()

    def test_fresh_venv_at_the_dependency_floors(self):
        if shutil.which("protoc") is None:
            self.skipTest("protoc is not installed (Debian: protobuf-compiler)")
        py = self.make_venv("floors")
        self.pip_install(py, "numpy==1.23.2", "protobuf==3.20.0", PKG)
        out = self.probe(py)
        self.assertEqual((out["numpy"], out["protobuf"]), ("1.23.2", "3.20.0"))

    def test_fresh_venv_newest_with_grpcio_tools(self):
        py = self.make_venv("newest")
        self.pip_install(py, PKG, env=self.clean_env(ATTND_PROTOC="grpcio-tools"))
        self.probe(py)
        # The wheel asks for the protobuf runtime its generated code needs.
        r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.requires('attnd'))"],
                           capture_output=True, text=True, env=self.clean_env())
        self.assertIn("protobuf>=", r.stdout)
        self.assertIn("numpy>=1.23.2", r.stdout)


if __name__ == "__main__":
    unittest.main()
