#!/usr/bin/python3
"""test_layout.py: the project's shape, checked mechanically (ctest test_layout).

1. Daemon sources stay small: no file under daemon/ over MAX_LINES lines.
2. daemon/ is layered along the data flow, each folder a library that links
   only downward (README "What is where"):

       base < config < backend < engine < rpc < net < main.c

   Each folder holds exactly its public header, a private internal.h and, where
   internal.h is split by concern, private internal_<concern>.h files. A
   file may include (with quotes) its own folder's headers, the public
   headers of lower layers and the headers of kernels/ and the generated
   proto (and its own generated headers: config's options_gen.h, made from
   deploy/options.toml); never a higher layer's header, another folder's
   internal.h, or a path with a directory in it. daemon/CMakeLists.txt may link a folder's
   library only to lower layers' libraries. (The build enforces the same:
   each library's include path holds only the public headers below it.)
3. The project stands alone: no tracked file refers to the development
   machines' paths, to requirement documents kept outside the project, to an
   issue tracker or to the machines' tools (the patterns are in FORBIDDEN,
   spelled in pieces so that this file does not match them itself).

Run by hand: /usr/bin/python3 tests/test_layout.py [SOURCE_DIR]
"""
import os
import re
import subprocess
import sys

MAX_LINES = 600

LAYERS = ["base", "config", "backend", "engine", "rpc", "net"]
PUBLIC = {name: name + ".h" for name in LAYERS}
TOP = len(LAYERS)  # main.c, directly in daemon/

# Headers from outside daemon/ that any layer may name.
EXTERNAL = {"attnd_kernels.h", "attnd_cuda.h", "attnd_cuda_ipc.h", "cuda_sticky.h", "attnd.pb.h"}
# Headers generated at build time into one layer's private include path.
GENERATED = {"config": {"options_gen.h"}}
# Each layer's internal_<concern>.h files (filled from the tracked files).
PRIVATE = {}

# Each pattern is written in pieces: this file must pass its own check.
FORBIDDEN = [
    (re.compile("/" + "work/"), "a development machine's path"),
    (re.compile(r"\.\./" + "shared"), "a path outside the project"),
    (re.compile(r"\b(" + "DESIGN|STYLE|GPU" + r")\.md\b"), "a document outside the project"),
    (re.compile(r"\bthe " + r"issue\b", re.IGNORECASE), "an issue tracker outside the project"),
    (re.compile(r"\bdevice " + r"tool\b", re.IGNORECASE), "a development machine's tool"),
]

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def tracked_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True,
                             check=True).stdout
        return sorted(p for p in out.decode().split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith((".", "build"))]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
        return sorted(files)


def layer_of(path):
    """Layer index of a daemon/ path, or None."""
    parts = path.split("/")
    if parts[0] != "daemon":
        return None
    if len(parts) == 2:
        return TOP
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def check_sizes(root, files, errors):
    for p in files:
        if p.startswith("daemon/") and p.endswith((".c", ".h")):
            with open(os.path.join(root, p), errors="replace") as f:
                n = sum(1 for _ in f)
            if n > MAX_LINES:
                errors.append(f"{p}: {n} lines (at most {MAX_LINES}: split it by concern)")


def check_folders(root, files, errors):
    for name in LAYERS:
        heads = sorted(os.path.basename(p) for p in files
                       if p.startswith(f"daemon/{name}/") and p.endswith(".h"))
        private = [h for h in heads if re.fullmatch(r"internal_[a-z0-9_]+\.h", h)]
        if sorted(set(heads) - set(private)) != sorted([PUBLIC[name], "internal.h"]):
            errors.append(f"daemon/{name}/: headers {heads}, expected {PUBLIC[name]}, "
                          "internal.h and any internal_<concern>.h")
    for p in files:
        if p.startswith("daemon/") and p.endswith((".c", ".h")) and layer_of(p) is None:
            errors.append(f"{p}: not in a layer's folder ({', '.join(LAYERS)}) nor main.c")


def allowed_includes(layer):
    ok = set(EXTERNAL)
    for i, name in enumerate(LAYERS):
        if i < layer:
            ok.add(PUBLIC[name])
    if layer < TOP:
        ok |= {PUBLIC[LAYERS[layer]], "internal.h"} | GENERATED.get(LAYERS[layer], set())
        ok |= PRIVATE.get(LAYERS[layer], set())
    return ok


def check_includes(root, files, errors):
    for p in files:
        layer = layer_of(p)
        if layer is None or not p.endswith((".c", ".h")):
            continue
        with open(os.path.join(root, p), errors="replace") as f:
            text = f.read()
        ok = allowed_includes(layer)
        for inc in INCLUDE.findall(text):
            if "/" in inc:
                errors.append(f'{p}: #include "{inc}": name a header, not a path')
            elif inc not in ok:
                owner = next((n for n in LAYERS if PUBLIC[n] == inc), None)
                why = (f"{owner} is not below {('main.c' if layer == TOP else LAYERS[layer])}"
                       if owner else "not a public header of a lower layer")
                errors.append(f'{p}: #include "{inc}": {why}')


def check_links(root, errors):
    path = os.path.join(root, "daemon", "CMakeLists.txt")
    with open(path) as f:
        text = f.read()
    libs = {"attnd_" + n: i for i, n in enumerate(LAYERS)}
    for m in re.finditer(r"attnd_layer\((attnd_\w+)([^)]*)\)", text):
        lib, body = m.group(1), m.group(2)
        if lib not in libs:
            errors.append(f"daemon/CMakeLists.txt: {lib} is not one of {sorted(libs)}")
            continue
        link = body.split("LINK", 1)[1] if "LINK" in body else ""
        for dep in re.findall(r"\battnd_\w+", link):
            if dep in libs and libs[dep] >= libs[lib]:
                errors.append(f"daemon/CMakeLists.txt: {lib} links {dep}, which is not below it")


def check_references(root, files, errors):
    for p in files:
        full = os.path.join(root, p)
        if not os.path.isfile(full):
            continue
        with open(full, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue  # binary (fuzz corpus, ...)
        text = data.decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for pat, what in FORBIDDEN:
                if pat.search(line):
                    errors.append(f"{p}:{n}: refers to {what}: {line.strip()[:100]}")


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    files = tracked_files(root)
    errors = []
    for name in LAYERS:
        PRIVATE[name] = {os.path.basename(p) for p in files
                         if p.startswith(f"daemon/{name}/")
                         and re.fullmatch(r"internal_[a-z0-9_]+\.h", os.path.basename(p))}
    check_sizes(root, files, errors)
    check_folders(root, files, errors)
    check_includes(root, files, errors)
    check_links(root, errors)
    check_references(root, files, errors)
    for e in errors:
        print(e)
    print(f"test_layout: {len(files)} files, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
