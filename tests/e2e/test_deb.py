"""The Debian package as CPack builds it (`cpack -G DEB`), checked by lintian: no
error and no warning on the .deb and its -dbgsym .ddeb, Depends computed from
the binaries, stripped binaries whose debug info is in the -dbgsym package (by
build id), and the copyright, changelog, man pages and completions shipped.
Skipped (ctest "Skipped") where lintian or dpkg-deb is not installed."""
import gzip
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from harness import BUILD_DIR, SOURCE_DIR


def project_version():
    with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
        return re.search(r"project\(\s*attnd\s+VERSION\s+([0-9.]+)", f.read()).group(1)


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)


class DebTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        for tool in ("lintian", "dpkg-deb", "cpack", "readelf"):
            if shutil.which(tool) is None:
                raise unittest.SkipTest(f"{tool} is not installed (Debian: lintian, dpkg, cmake, binutils)")
        if not os.path.exists(os.path.join(BUILD_DIR, "CPackConfig.cmake")):
            raise unittest.SkipTest("no configured build directory ($ATTND_BUILD_DIR)")
        if not os.path.exists(os.path.join(BUILD_DIR, "daemon", "attnd")):
            raise unittest.SkipTest("attnd is not built")
        cls.out = tempfile.mkdtemp(prefix="attnd-deb-")
        # Everything is built by now (ctest runs after the build), so cpack's
        # preinstall step only checks that; -B keeps its staging out of the build tree.
        r = run(["cpack", "--config", os.path.join(BUILD_DIR, "CPackConfig.cmake"), "-G", "DEB",
                 "-B", cls.out], cwd=BUILD_DIR)
        if r.returncode != 0:
            shutil.rmtree(cls.out, ignore_errors=True)
            raise AssertionError(f"cpack -G DEB failed:\n{r.stdout[-4000:]}{r.stderr[-4000:]}")
        v = project_version()
        arch = run(["dpkg", "--print-architecture"]).stdout.strip()
        cls.deb = os.path.join(cls.out, f"attnd_{v}_{arch}.deb")
        cls.ddeb = os.path.join(cls.out, f"attnd-dbgsym_{v}_{arch}.ddeb")
        cls.tree = os.path.join(cls.out, "tree")
        run(["dpkg-deb", "-x", cls.deb, cls.tree])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.out, ignore_errors=True)

    def field(self, name, pkg=None):
        r = run(["dpkg-deb", "-f", pkg or self.deb, name])
        return r.stdout.strip()

    def test_lintian_is_clean(self):
        self.assertTrue(os.path.exists(self.deb), os.listdir(self.out))
        self.assertTrue(os.path.exists(self.ddeb), os.listdir(self.out))
        r = run(["lintian", "--pedantic", "--fail-on", "error,warning", self.deb, self.ddeb])
        tags = [line for line in r.stdout.splitlines() if re.match(r"^[EWP]: ", line)]
        print(f"lintian {r.returncode}: {len(tags)} error/warning/pedantic tags")
        print("\n".join(r.stdout.splitlines()[:60]))
        self.assertEqual([t for t in tags if t[0] in "EW"], [], r.stdout + r.stderr)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_control_fields(self):
        self.assertEqual(self.field("Version"), project_version())
        m = self.field("Maintainer")
        self.assertRegex(m, r"^[^<>@]+ <[^<>@\s]+@[^<>@\s]+\.[a-z]+>$")
        self.assertNotRegex(m, r"localhost")
        deps = self.field("Depends")
        # Computed by dpkg-shlibdeps from what the binaries link, with versions.
        for lib in ("libc6 (>=", "libuv1", "libinih1", "libjansson4", "libxxhash0", "libsystemd0",
                    "libhttp-parser2.9"):
            self.assertIn(lib, deps)
        self.assertEqual(self.field("Depends", self.ddeb), f"attnd (= {project_version()})")

    def test_stripped_with_debug_info_by_build_id(self):
        debug = run(["dpkg-deb", "-c", self.ddeb]).stdout
        for exe in ("usr/bin/attnd", "usr/bin/attnctl"):
            p = os.path.join(self.tree, exe)
            sections = run(["readelf", "-S", "-W", p]).stdout
            self.assertNotIn(".debug_info", sections, f"{exe} is not stripped")
            self.assertNotIn(".symtab", sections, f"{exe} keeps its symbol table")
            note = run(["readelf", "-n", p]).stdout
            bid = re.search(r"Build ID: ([0-9a-f]+)", note).group(1)
            self.assertIn(f"usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug", debug)

    def test_ships_docs_man_pages_completion(self):
        doc = os.path.join(self.tree, "usr/share/doc/attnd")
        with open(os.path.join(doc, "copyright")) as f:
            c = f.read()
        self.assertTrue(c.startswith("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"))
        self.assertIn("License: Apache-2.0", c)
        with gzip.open(os.path.join(doc, "changelog.gz"), "rt") as f:
            head = f.readline()
        self.assertEqual(head.split()[:2], ["attnd", f"({project_version()})"],
                         "debian/changelog's newest entry must be the project version")
        for p in ("usr/share/man/man8/attnd.8.gz", "usr/share/man/man1/attnctl.1.gz",
                  "usr/share/man/man5/attnd.conf.5.gz", "usr/share/bash-completion/completions/attnd",
                  "usr/share/bash-completion/completions/attnctl", "usr/share/doc/attnd/README.md",
                  "etc/attnd/attnd.conf", "usr/lib/python3/dist-packages/attnd/attnd_pb2.py"):
            self.assertTrue(os.path.exists(os.path.join(self.tree, p)), p)
        conffiles = run(["dpkg-deb", "-I", self.deb, "conffiles"]).stdout
        self.assertEqual(conffiles.split(), ["/etc/attnd/attnd.conf"])


if __name__ == "__main__":
    unittest.main()
