"""Finds attnd.proto and the project version, and runs protoc, for setup.py.

In a checkout the package sits at client/python, so the proto is
../../proto/attnd.proto and the version is in ../../CMakeLists.txt; an sdist
carries copies of both in _bundle/ (setup.py's sdist command puts them there).
"""
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # client/python
TREE = os.path.dirname(os.path.dirname(HERE))                       # the attnd checkout
BUNDLE = os.path.join(HERE, "_bundle")

# gencode from protoc 3.20 and later needs google.protobuf >= 3.20 (internal.builder).
PROTOBUF_FLOOR = "3.20"


def proto_path():
    for p in (os.path.join(BUNDLE, "attnd.proto"), os.path.join(TREE, "proto", "attnd.proto")):
        if os.path.exists(p):
            return p
    raise SystemExit("attnd: cannot find attnd.proto (expected ../../proto/attnd.proto: build the "
                     "package from a checkout of attnd, or from its sdist)")


def version():
    """The project version: project(attnd VERSION x.y.z) in the top-level CMakeLists.txt."""
    p = os.path.join(BUNDLE, "VERSION")
    if os.path.exists(p):
        with open(p) as f:
            return f.read().strip()
    with open(os.path.join(TREE, "CMakeLists.txt")) as f:
        m = re.search(r"project\(\s*attnd\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if not m:
        raise SystemExit("attnd: no 'project(attnd VERSION x.y.z)' in the top-level CMakeLists.txt")
    return m.group(1)


def find_protoc():
    """The protoc to run: $ATTND_PROTOC (a path, or 'grpcio-tools' to use its bundled
    one), else protoc on PATH; None means grpcio-tools'."""
    want = os.environ.get("ATTND_PROTOC", "")
    if want == "grpcio-tools":
        return None
    if want:
        if not shutil.which(want):
            raise SystemExit(f"attnd: ATTND_PROTOC={want} is not an executable")
        return shutil.which(want)
    return shutil.which("protoc")


def generate(out_dir):
    """Writes attnd_pb2.py (and its type stub attnd_pb2.pyi) into out_dir; returns (the
    .py's path, the google.protobuf floor it needs)."""
    proto = proto_path()
    args = ["-I" + os.path.dirname(proto), "--python_out=" + out_dir, "--pyi_out=" + out_dir, proto]
    protoc = find_protoc()
    if protoc:
        r = subprocess.run([protoc] + args, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"attnd: {protoc} failed on {proto}:\n{r.stderr}")
    else:
        try:
            from grpc_tools import protoc as grpc_protoc
        except ImportError:
            raise SystemExit("attnd: building needs protoc (Debian: apt-get install protobuf-compiler) "
                             "or the grpcio-tools package") from None
        import grpc_tools
        inc = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        if grpc_protoc.main(["protoc", "-I" + inc] + args) != 0:
            raise SystemExit(f"attnd: grpcio-tools' protoc failed on {proto}")
    path = os.path.join(out_dir, "attnd_pb2.py")
    with open(path) as f:
        head = f.read(2000)
    # Newer protoc stamps the runtime its code needs ("# Protobuf Python Version: 6.31.1")
    # and checks it at import; older protoc (3.x, Debian 12's) needs only 3.20.
    m = re.search(r"Protobuf Python Version: ([0-9]+\.[0-9]+(?:\.[0-9]+)?)", head)
    floor = m.group(1) if m else PROTOBUF_FLOOR
    print(f"attnd: generated {path} with {protoc or 'grpcio-tools'}; needs protobuf>={floor}",
          file=sys.stderr)
    return path, floor
