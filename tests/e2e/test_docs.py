"""The operator documents cannot drift from the binaries: the options of the man
pages attnd(8) and attnd.conf(5) (generated from deploy/options.toml) equal
those `attnd --help` prints and the daemon accepts, attnctl(1) lists what
`attnctl --help` does, deploy/attnd.conf is what options.toml generates, the
pages render without a groff warning, and bash completion offers the same
options."""
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

from harness import BUILD_DIR, SOURCE_DIR, attnctl_binary, daemon_binary

sys.path.insert(0, os.path.join(SOURCE_DIR, "deploy"))
import docgen  # noqa: E402

# Flags the daemon accepts that its --help does not print. The option table and
# --help are both generated from options.toml now, so this stays empty (the test
# checks the set exactly, so it cannot quietly grow).
NOT_IN_DAEMON_HELP = set()


def man_text(page):
    p = os.path.join(BUILD_DIR, "deploy", "man", page + ".gz")
    if not os.path.exists(p):
        raise unittest.SkipTest(f"{p} is not built (target attnd_docs)")
    with gzip.open(p, "rt") as f:
        return f.read()


def roff_plain(s):
    return re.sub(r"\\f[BIRP]", "", s).replace("\\-", "-").replace("\\&", "").replace("\\e", "\\")


def man_terms(roff):
    """The terms of a page's definition lists (the line after each .TP), as plain text."""
    lines = roff.split("\n")
    return [roff_plain(lines[i + 1]) for i, line in enumerate(lines[:-1]) if line == ".TP"]


def man_options(roff):
    """The options a page defines: each .TP term's options (--name, or '-h, --help')."""
    out = []
    for term in man_terms(roff):
        out += re.findall(r"(?:^|, )--([a-z][a-z0-9-]*)", term)
    return out


def placeholder_paths(d):
    """Stand-ins, under d, for the options whose documented value names a file."""
    tokens = os.path.join(d, "tokens")
    with open(tokens, "w") as f:
        f.write("secret\n")
    model = os.path.join(d, "config.json")
    with open(model, "w") as f:
        f.write('{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, '
                '"hidden_size": 256}\n')
    return {"token-file": tokens, "state-dir": d, "model-config": model,
            "log-file": os.path.join(d, "attnd.log")}


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


class AttndOptionsTest(unittest.TestCase):
    def setUp(self):
        self.t = docgen.load_options()
        if daemon_binary() is None:
            self.skipTest("attnd is not built")

    def daemon_help_flags(self):
        r = run([daemon_binary(), "--help"])
        self.assertEqual(r.returncode, 0)
        body = r.stdout.split("\n", 1)[1]  # the usage line shows the syntax (--flag value)
        return set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", body))

    def test_man_page_flags_equal_attnd_help(self):
        man = man_options(man_text("attnd.8"))
        self.assertEqual(len(man), len(set(man)), "an option appears twice in attnd(8)")
        self.assertEqual(set(man), set(docgen.flags(self.t)))
        helped = self.daemon_help_flags()
        self.assertEqual(helped - set(man), set(),
                         "attnd --help prints options that deploy/options.toml lacks: add them there")
        self.assertEqual(set(man) - helped, NOT_IN_DAEMON_HELP,
                         "attnd(8) and attnd --help differ in other options than the known gap "
                         "(NOT_IN_DAEMON_HELP); if the daemon now prints them, empty the set")

    def test_daemon_accepts_every_documented_option(self):
        """Each flag of options.toml, with its documented default, passes --check-config:
        the daemon's own option table knows it and its value syntax."""
        with tempfile.TemporaryDirectory() as d:
            paths = placeholder_paths(d)
            for o in self.t["option"]:
                n = o["name"]
                if o["flag"] == "none" or n in ("help", "version", "check-config", "config"):
                    continue
                value = paths.get(n, o.get("default"))
                args = [f"--{n}"] if o["flag"] == "switch" else [f"--{n}={value}"]
                with self.subTest(option=n):
                    r = run([daemon_binary(), "--check-config", *args])
                    self.assertEqual(r.returncode, 0, f"attnd --check-config {args}: {r.stderr}")
                if o["file"]:
                    with self.subTest(key=n):
                        conf = os.path.join(d, "one.conf")
                        with open(conf, "w") as f:
                            f.write(f"[attnd]\n{n} = {value if o['flag'] != 'switch' else 'true'}\n")
                        r = run([daemon_binary(), "--config", conf, "--check-config"])
                        self.assertEqual(r.returncode, 0, f"key {n}: {r.stderr}")
            r = run([daemon_binary(), "--check-config", "--no-such-option=1"])
            self.assertEqual(r.returncode, 2, "the check above must be able to fail")

    def test_conf_page_and_example_config(self):
        keys = docgen.keys(self.t)
        page = man_options(man_text("attnd.conf.5"))  # "--name" nowhere: keys are bold words
        self.assertEqual(page, [])
        documented = [m.group(1) for m in (re.match(r"([a-z][a-z0-9-]*) = \S", term)
                                           for term in man_terms(man_text("attnd.conf.5"))) if m]
        self.assertEqual(sorted(documented), sorted(keys))
        with open(os.path.join(SOURCE_DIR, "deploy", "attnd.conf")) as f:
            committed = f.read()
        self.assertEqual(committed, docgen.conf_text(self.t),
                         "deploy/attnd.conf differs from deploy/options.toml: run "
                         "python3 deploy/docgen.py conf -o deploy/attnd.conf")
        in_conf = re.findall(r"(?m)^#?([a-z][a-z0-9-]*) = ", committed)
        self.assertEqual(in_conf, keys)
        # The example with every commented line switched on is valid too.
        with tempfile.TemporaryDirectory() as d:
            text = re.sub(r"(?m)^#(?=[a-z][a-z0-9-]* = )", "", committed)
            for key, path in placeholder_paths(d).items():
                text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {path}", text)
            p = os.path.join(d, "all.conf")
            with open(p, "w") as f:
                f.write(text)
            r = run([daemon_binary(), "--config", p, "--check-config"])
            self.assertEqual(r.returncode, 0, r.stderr)


class AttnctlPageTest(unittest.TestCase):
    def test_man_page_equals_attnctl_help(self):
        exe = attnctl_binary()
        if exe is None:
            self.skipTest("attnctl is not built")
        helps = docgen.attnctl_helps(exe)
        helped = set()
        for h in helps.values():
            helped |= {x[2:] for x in docgen.help_options(h)}
        roff = man_text("attnctl.1")
        self.assertEqual(set(man_options(roff)), helped)
        commands = [roff_plain(s).split()[0] for s in re.findall(r"(?m)^\.SS (.+)$", roff)]
        self.assertEqual(commands, [c for c in helps if c])


class RenderTest(unittest.TestCase):
    def test_pages_render_without_warnings(self):
        groff = shutil.which("groff")
        if groff is None:
            self.skipTest("groff is not installed (Debian: groff-base)")
        for page in ("attnd.8", "attnd.conf.5", "attnctl.1"):
            with self.subTest(page=page):
                text = man_text(page)
                self.assertTrue(text.startswith('.TH "'), text[:80])
                r = subprocess.run([groff, "-man", "-ww", "-z", "-Tutf8"], input=text,
                                   capture_output=True, text=True, env=dict(os.environ, LC_ALL="C.UTF-8"))
                self.assertEqual((r.returncode, r.stderr), (0, ""))
                # Nothing escaped by mistake: no stray backslash sequences in the output.
                r = subprocess.run([groff, "-man", "-Tascii", "-P-cbou"], input=text,
                                   capture_output=True, text=True, env=dict(os.environ, LC_ALL="C.UTF-8"))
                self.assertNotIn("\\", r.stdout.replace("\\e", ""))
                self.assertIn("SEE ALSO", r.stdout)


BASH_COMPLETION = "/usr/share/bash-completion/bash_completion"


class CompletionTest(unittest.TestCase):
    def complete(self, tool, line):
        """What bash completion offers at the end of `line` (words split as bash does)."""
        script = os.path.join(BUILD_DIR, "deploy", "completion", tool)
        if not os.path.exists(script):
            self.skipTest(f"{script} is not built")
        if not os.path.exists(BASH_COMPLETION):
            self.skipTest("bash-completion is not installed")
        words = []
        for w in line.split(" "):
            parts = re.split(r"(=)", w)
            words += [p for p in parts if p != ""] or [""]
        bash = f"""
source {BASH_COMPLETION}
source {script}
COMP_LINE={line!r}
COMP_POINT=${{#COMP_LINE}}
COMP_WORDS=({' '.join(repr(w) for w in words)})
COMP_CWORD={len(words) - 1}
_{tool}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
        r = subprocess.run(["bash", "-c", bash], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        return sorted(x.strip() for x in r.stdout.splitlines() if x.strip())

    def test_attnd(self):
        t = docgen.load_options()
        self.assertEqual(self.complete("attnd", "attnd --"), sorted(f"--{n}" for n in docgen.flags(t)))
        self.assertEqual(self.complete("attnd", "attnd --kv-"), ["--kv-cache", "--kv-heads", "--kv-memory"])
        self.assertEqual(self.complete("attnd", "attnd --backend "), ["auto", "cpu", "cuda"])
        self.assertEqual(self.complete("attnd", "attnd --kv-cache=int"), ["int4", "int8", "int8_dynamic"])
        self.assertEqual(self.complete("attnd", "attnd --log-level d"), ["debug"])

    def test_attnctl(self):
        self.assertEqual(self.complete("attnctl", "attnctl "), ["bench", "config", "health", "sessions", "stats"])
        self.assertEqual(self.complete("attnctl", "attnctl --json he"), ["health"])
        self.assertEqual(self.complete("attnctl", "attnctl stats --w"), ["--watch"])
        self.assertEqual(self.complete("attnctl", "attnctl --socket /tmp/x.sock bench --se"), ["--seed", "--sessions"])
        self.assertEqual(self.complete("attnctl", "attnctl sessions --w"), [])
        self.assertEqual(self.complete("attnctl", "attnctl --to"), ["--token-file"])
        self.assertEqual(self.complete("attnctl", "attnctl health "), [])


if __name__ == "__main__":
    unittest.main()
