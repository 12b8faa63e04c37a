"""setuptools glue of the attnd package (the metadata is in pyproject.toml).

What pyproject.toml cannot say: attnd_pb2.py is generated from proto/attnd.proto
into the wheel (never into this directory), the version comes from the project's
CMakeLists.txt, and the protobuf runtime floor follows the generator (code from
protoc 3.x runs on protobuf >= 3.20; code from a newer protoc stamps its own,
higher floor). Build directories go to a temporary directory, not the checkout.
"""
import atexit
import os
import shutil
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build"))
import attnd_protoc  # noqa: E402

NUMPY_FLOOR = "1.23.2"  # the first numpy with wheels for CPython 3.11 (Debian 12's Python)

_scratch = tempfile.mkdtemp(prefix="attnd-pybuild-")
atexit.register(shutil.rmtree, _scratch, True)
_pb2, _protobuf_floor = (None, attnd_protoc.PROTOBUF_FLOOR)
if not any(a.startswith(("sdist", "egg_info")) for a in sys.argv[1:]):
    _pb2, _protobuf_floor = attnd_protoc.generate(_scratch)
VERSION = attnd_protoc.version()


class BuildPy(build_py):
    """Adds the generated attnd_pb2.py (with its .pyi) and _version.py to the built package."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "attnd")
        os.makedirs(dst, exist_ok=True)
        pb2 = _pb2 or attnd_protoc.generate(_scratch)[0]
        shutil.copyfile(pb2, os.path.join(dst, "attnd_pb2.py"))
        shutil.copyfile(pb2[:-3] + ".pyi", os.path.join(dst, "attnd_pb2.pyi"))
        with open(os.path.join(dst, "_version.py"), "w") as f:
            f.write(f'"""Written when the package was built: the attnd project version."""\n'
                    f'__version__ = "{VERSION}"\n')


class Sdist(sdist):
    """Carries attnd.proto and the version, which live outside client/python."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        bundle = os.path.join(base_dir, "_bundle")
        os.makedirs(bundle, exist_ok=True)
        shutil.copyfile(attnd_protoc.proto_path(), os.path.join(bundle, "attnd.proto"))
        with open(os.path.join(bundle, "VERSION"), "w") as f:
            f.write(VERSION + "\n")


setup(
    version=VERSION,
    license="Apache-2.0",
    install_requires=[f"numpy>={NUMPY_FLOOR}", f"protobuf>={_protobuf_floor}"],
    cmdclass={"build_py": BuildPy, "sdist": Sdist},
    options={"build": {"build_base": os.path.join(_scratch, "build")},
             "egg_info": {"egg_base": _scratch}},
)
