#!/usr/bin/env python3
"""Flattens systemd syscall groups into plain lists of system call names.

    expand_filter.py @system-service @privileged ...   # prints NAME.list files' text

Each list is what `systemd-analyze syscall-filter GROUP` names, with nested
@groups expanded, sorted, one name per line, after a header naming the systemd
version it came from. attnd-sandbox-exec reads these lists; the e2e_sandbox
test regenerates them where systemd-analyze exists and fails if they differ.
"""
import subprocess
import sys


def group(name, seen):
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", name],
                         check=True, capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines()[1:]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            if line not in seen:
                seen.add(line)
                names |= group(line, seen)
        else:
            names.add(line)
    return names


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    ver = subprocess.run(["systemd-analyze", "--version"], check=True, capture_output=True,
                         text=True).stdout.splitlines()[0]
    for g in sys.argv[1:]:
        names = group(g, {g})
        with open(g.lstrip("@") + ".list", "w") as f:
            f.write(f"# {g} as {ver} expands it (deploy/sandbox/expand_filter.py)\n")
            for n in sorted(names):
                f.write(n + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
