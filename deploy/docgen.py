#!/usr/bin/python3
"""Generates attnd's operator documents from deploy/options.toml and deploy/man/*.md.

    docgen.py conf [-o FILE]                  the example config (deploy/attnd.conf)
    docgen.py man SRC.md -o OUT [--version V] [--date YYYY-MM-DD]
                                              a man page: markdown -> roff (man(7))
    docgen.py completion attnd -o FILE        bash completion for attnd
    docgen.py completion attnctl --attnctl BINARY -o FILE
                                              ... and attnctl, from its --help texts
    docgen.py gzip FILE -o FILE.gz            gzip -9n (Debian's changelog.gz)
    docgen.py cheader -o FILE                 the daemon's option table and --help text
                                              (a C header, built into daemon/config/)
    docgen.py list flags|keys                 the option names, one per line (tests)

The man pages are written in a small markdown subset, so that they read well as
text and need nothing heavier than Python at build time:
  '# NAME' a section (.SH), '## Name' a subsection (.SS), blank lines between
  paragraphs, '- ' bullets, fenced ``` blocks (shown as typed), `code` and **bold**
  (bold), *italic* (italic), a definition list as a term line followed by lines
  that start with ': ', and the placeholders @FLAGS@ (attnd's options, from
  options.toml, by section), @KEYS@ (the config-file keys) and @VERSION@.
The first line is the title: '% NAME(SECTION) | manual title'.
"""
import argparse
import os
import re
import sys
import textwrap

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

HERE = os.path.dirname(os.path.abspath(__file__))


def load_options(path=os.path.join(HERE, "options.toml")):
    if tomllib is None:
        sys.exit("docgen.py needs Python 3.11 or later (tomllib)")
    with open(path, "rb") as f:
        t = tomllib.load(f)
    titles = [s["title"] for s in t["section"]]
    for o in t["option"]:
        o.setdefault("flag", "value")
        o.setdefault("file", True)
        o.setdefault("example", "set")
        o["doc"] = " ".join(o["doc"].split())
        o.setdefault("help", first_sentence(o["doc"]))
        if o["section"] not in titles:
            sys.exit(f"options.toml: option {o['name']} names an unknown section {o['section']!r}")
        if o["flag"] == "value" and "arg" not in o:
            sys.exit(f"options.toml: option {o['name']} takes a value but has no arg")
        if o["file"] and "default" not in o:
            sys.exit(f"options.toml: config key {o['name']} has no default")
    return t


def first_sentence(text):
    m = re.match(r"(.+?[.:;])(\s|$)", text)
    return (m.group(1) if m else text).rstrip(".")


def flags(t):
    return [o["name"] for o in t["option"] if o["flag"] != "none"]


def keys(t):
    return [o["name"] for o in t["option"] if o["file"]]


# ---- the example configuration ----

def conf_text(t):
    out = []

    def comment(text, indent=""):
        for para in text.strip().split("\n\n"):
            para = " ".join(para.split())
            out.extend("# " + line for line in textwrap.wrap(para, 76, break_on_hyphens=False))
            out.append("#")
        out.pop()

    comment(t["conf"]["header"])
    out += ["", "[attnd]"]
    for s in t["section"]:
        opts = [o for o in t["option"] if o["section"] == s["title"] and o["file"]]
        if not opts:
            continue
        out += ["", f"# ---- {s['title']} ".ljust(79, "-"), ""]
        if s.get("intro"):
            comment(s["intro"])
            out.append("")
        for o in opts:
            comment(o["doc"])
            prefix = "#" if o["example"] in ("commented", "model") else ""
            out.append(f"{prefix}{o['name']} = {o['default']}")
            out.append("")
        out.pop()
    return "\n".join(out) + "\n"


# ---- markdown -> roff ----

def roff_escape(s):
    s = s.replace("\\", "\\e").replace("-", "\\-")
    return s


def roff_inline(s):
    """Escapes text and turns `code`, **bold** and *italic* into font changes."""
    parts = re.split(r"(`[^`]+`|\*\*[^*]+\*\*|\*[^*\s][^*]*\*)", s)
    out = []
    for p in parts:
        if p.startswith("`") and p.endswith("`") and len(p) > 1:
            out.append("\\fB" + roff_escape(p[1:-1]) + "\\fR")
        elif p.startswith("**") and p.endswith("**") and len(p) > 3:
            out.append("\\fB" + roff_escape(p[2:-2]) + "\\fR")
        elif p.startswith("*") and p.endswith("*") and len(p) > 2:
            out.append("\\fI" + roff_escape(p[1:-1]) + "\\fR")
        else:
            out.append(roff_escape(p))
    return "".join(out)


def roff_line(s):
    """A text line roff will not take for a request ('.' or "'" first)."""
    s = s.strip()
    return "\\&" + s if s[:1] in (".", "'") else s


def option_items(t, kind, section):
    """Definition-list markdown for one section's options (kind: 'flags' or 'keys')."""
    lines = []
    for o in t["option"]:
        if o["section"] != section:
            continue
        if kind == "flags" and o["flag"] == "none":
            continue
        if kind == "keys" and not o["file"]:
            continue
        if kind == "flags":
            term = (f"**-{o['short']}**, " if o.get("short") else "") + f"**--{o['name']}**"
            if o["flag"] == "value":
                term += f" *{o['arg']}*"
        else:
            term = f"**{o['name']}** = *{o.get('arg', 'BOOL')}*"
        text = o["doc"]
        if o["file"] and o["example"] in ("set", "model"):
            text += f" Default: `{o['default']}`."
        if kind == "flags" and not o["file"]:
            text += " Command line only."
        elif kind == "flags" and o["flag"] == "switch":
            text += f" In the config file: `{o['name']} = true`."
        elif kind == "keys" and o["flag"] == "none":
            text += " Config file only."
        elif kind == "keys" and o["flag"] == "switch":
            text += f" On the command line: `--{o['name']}` (no value)."
        lines += [term, ": " + text, ""]
    return lines


def expand(md, t, version):
    out = []
    for line in md.split("\n"):
        if line.strip() in ("@FLAGS@", "@KEYS@"):
            kind = "flags" if line.strip() == "@FLAGS@" else "keys"
            for s in t["section"]:
                items = option_items(t, kind, s["title"])
                if items:
                    out += [f"## {s['title']}", ""]
                    if s.get("intro") and kind == "keys" and s["title"] != "Command line":
                        out += [s["intro"], ""]
                    out += items
        else:
            out.append(line.replace("@VERSION@", version))
    return "\n".join(out)


def md_to_roff(md, version, date):
    lines = md.split("\n")
    m = re.match(r"%\s*([A-Za-z0-9_.-]+)\((\d)\)\s*\|\s*(.+)", lines[0])
    if not m:
        sys.exit("a man page source starts with '% NAME(SECTION) | manual title'")
    name, sec, manual = m.groups()
    # .nh: no hyphenation, so option and file names are never split across lines.
    out = [f'.TH "{name.upper()}" "{sec}" "{date}" "attnd {version}" "{manual.strip()}"', ".nh"]
    para = []
    i = 1

    def flush():
        if para:
            out.append(".PP")
            out.extend(roff_line(roff_inline(p)) for p in para)
            para.clear()

    while i < len(lines):
        line = lines[i].rstrip()
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.startswith("```"):
            flush()
            out += [".PP", ".RS 4", ".nf"]
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                out.append(roff_line(roff_escape(lines[i])) if lines[i].strip() else "")
                i += 1
            out += [".fi", ".RE"]
        elif line.startswith("## "):
            flush()
            out.append(".SS " + roff_inline(line[3:]))
        elif line.startswith("# "):
            flush()
            out.append(".SH " + roff_inline(line[2:].upper()))
        elif line.startswith("- "):
            flush()
            item = [line[2:]]
            while i + 1 < len(lines) and lines[i + 1].startswith("  ") and lines[i + 1].strip():
                i += 1
                item.append(lines[i].strip())
            out += [".IP \\(bu 2", roff_line(roff_inline(" ".join(item)))]
        elif line and nxt.startswith(": "):
            flush()
            out += [".TP", roff_line(roff_inline(line))]
            i += 1
            text = [lines[i][2:]]
            while i + 1 < len(lines) and lines[i + 1].startswith("  ") and lines[i + 1].strip():
                i += 1
                text.append(lines[i].strip())
            out.append(roff_line(roff_inline(" ".join(text))))
        elif not line.strip():
            flush()
        else:
            para.append(line)
        i += 1
    flush()
    # A .PP straight after a heading is redundant (and groff warns about none; mandoc does).
    res = []
    for line in out:
        if line == ".PP" and res and res[-1].startswith((".SH", ".SS")):
            continue
        res.append(line)
    return "\n".join(res) + "\n"


# ---- bash completion ----

COMPLETION_ATTND = r'''# bash completion for attnd(8). Generated by deploy/docgen.py from deploy/options.toml.

_attnd() {
    local cur prev words cword
    _init_completion -s || return
    case $prev in
@ATTND_VALUES@
    esac
    $split && return
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W '@ATTND_FLAGS@' -- "$cur"))
        [[ ${COMPREPLY-} == *= ]] && compopt -o nospace
    fi
}
complete -F _attnd attnd
'''

COMPLETION_ATTNCTL = r'''# bash completion for attnctl(1). Generated by deploy/docgen.py from attnctl's --help texts.

_attnctl() {
    local cur prev words cword
    _init_completion -s || return
    case $prev in
        @ATTNCTL_PATH_OPTS@)
            _filedir
            return
            ;;
        @ATTNCTL_VALUE_OPTS@)
            return
            ;;
    esac
    $split && return
    local i cmd=""
    for ((i = 1; i < cword; i++)); do
        case ${words[i]} in
            @ATTNCTL_ALL_VALUE_OPTS@)
                ((i++))
                ;;
            -*) ;;
            *)
                cmd=${words[i]}
                break
                ;;
        esac
    done
    local global='@ATTNCTL_GLOBAL@'
    if [[ $cur == -* ]]; then
        case $cmd in
@ATTNCTL_CMD_OPTS@
            *) COMPREPLY=($(compgen -W "$global" -- "$cur")) ;;
        esac
        [[ ${COMPREPLY-} == *= ]] && compopt -o nospace
    elif [[ -z $cmd ]]; then
        COMPREPLY=($(compgen -W '@ATTNCTL_COMMANDS@' -- "$cur"))
    fi
}
complete -F _attnctl attnctl
'''


def help_options(text):
    """The options a --help text lists: those that start a line ('  --name', '  -h, --help')."""
    return sorted(set(re.findall(r"(?m)^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", text)))


def completion_attnd(t):
    cases = []
    for o in t["option"]:
        if o["flag"] != "value":
            continue
        if o.get("complete") == "file":
            action = "_filedir"
        elif o.get("complete") == "dir":
            action = "_filedir -d"
        elif o.get("choices"):
            action = f"COMPREPLY=($(compgen -W '{' '.join(o['choices'])}' -- \"$cur\"))"
        else:
            action = ":"
        cases.append(f"        --{o['name']})\n            {action}\n            return\n            ;;")
    # A flag that takes a value completes as "--name=" too, so both forms are offered.
    names = []
    for o in t["option"]:
        if o["flag"] != "none":
            names.append(f"--{o['name']}")
    text = COMPLETION_ATTND.replace("@ATTND_VALUES@", "\n".join(cases))
    return text.replace("@ATTND_FLAGS@", " ".join(names))


def completion_attnctl(attnctl_helps):
    main = attnctl_helps[""]
    commands = re.findall(r"(?m)^  ([a-z]+) {2,}", main.split("commands:")[1].split("options:")[0])
    glob = help_options(main)
    per_cmd = []
    for c in commands:
        own = [x for x in help_options(attnctl_helps[c]) if x not in glob]
        per_cmd.append(f"            {c}) COMPREPLY=($(compgen -W \"$global {' '.join(own)}\" -- \"$cur\")) ;;")
    # "  --socket PATH   ..." in a help text: the option takes a value (a path for PATH/FILE).
    valued = {}
    for h in attnctl_helps.values():
        for name, meta in re.findall(r"(?m)^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)[ =]([A-Z][A-Z:_]*)\b", h):
            valued[name] = meta
    paths = sorted(n for n, m in valued.items() if m in ("PATH", "FILE"))
    others = sorted(n for n in valued if n not in paths)
    text = COMPLETION_ATTNCTL.replace("@ATTNCTL_PATH_OPTS@", " | ".join(paths))
    text = text.replace("@ATTNCTL_VALUE_OPTS@", " | ".join(others))
    text = text.replace("@ATTNCTL_ALL_VALUE_OPTS@", " | ".join(sorted(valued)))
    text = text.replace("@ATTNCTL_GLOBAL@", " ".join(glob))
    text = text.replace("@ATTNCTL_CMD_OPTS@", "\n".join(per_cmd))
    text = text.replace("@ATTNCTL_COMMANDS@", " ".join(commands))
    return text


def attnctl_helps(binary):
    """attnctl's --help ("" key) and each COMMAND --help, by command."""
    import subprocess

    def run(*args):
        r = subprocess.run([binary, *args, "--help"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            sys.exit(f"{binary} {' '.join(args)} --help exited {r.returncode}: {r.stderr}")
        return r.stdout

    helps = {"": run()}
    section = helps[""].split("commands:")[1].split("options:")[0]
    for cmd in re.findall(r"(?m)^  ([a-z]+) {2,}", section):
        helps[cmd] = run(cmd)
    return helps


# ---- the daemon's option table and --help (C) ----

def c_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def help_text(t):
    """attnd --help: the usage lines, then each section's options, one line each."""
    out = ["usage: attnd [OPTION]...",
           "       attnd --check-config [--config FILE] [OPTION]...",
           "",
           "A value follows its option after a space or '=' (--kv-memory 8G or",
           "--kv-memory=8G); flags win over the --config file, whatever their order.",
           ""]
    for s in t["section"]:
        opts = [o for o in t["option"] if o["section"] == s["title"] and o["flag"] != "none"]
        if not opts:
            continue
        out.append(s["title"] + ":")
        for o in opts:
            term = (f"-{o['short']}, " if o.get("short") else "    ") + f"--{o['name']}"
            if o["flag"] == "value":
                term += f" {o['arg']}"
            # GNU style: the term in a 28-column gutter, the line wrapped at 79.
            text = textwrap.wrap(o["help"], 79 - 28, break_on_hyphens=False)
            if len(term) <= 24:
                out.append(f"  {term:<26}{text[0]}")
            else:
                out += [f"  {term}", " " * 28 + text[0]]
            out += [" " * 28 + x for x in text[1:]]
        out.append("")
    cli = [f"--{o['name']}" for o in t["option"] if not o["file"]]
    out += textwrap.wrap(f"Every option but {', '.join(cli[:-1])} and {cli[-1]} is also a key of "
                         "the --config file (attnd.conf(5)); attnd(8) explains them all.", 79,
                         break_on_hyphens=False)
    return "\n".join(out) + "\n"


def cheader_text(t):
    kinds = {"value": "ATTND_OPT_VALUE", "switch": "ATTND_OPT_SWITCH", "none": "ATTND_OPT_FILE_ONLY"}
    out = ["/* Generated by deploy/docgen.py from deploy/options.toml: do not edit.",
           " * daemon/config/options.c builds its getopt_long table from these rows and",
           " * prints ATTND_OPTIONS_HELP for --help. */",
           "#ifndef ATTND_OPTIONS_GEN_H",
           "#define ATTND_OPTIONS_GEN_H",
           "",
           "/* How an option is given: --name VALUE, --name alone, or only as a file key. */",
           "enum { ATTND_OPT_VALUE = 0, ATTND_OPT_SWITCH = 1, ATTND_OPT_FILE_ONLY = 2 };",
           "",
           "typedef struct {",
           "  const char *name; /* the flag without dashes, and the file key */",
           "  int kind;          /* ATTND_OPT_* */",
           "  int file;          /* 1: also a config-file key */",
           "  char short_name;   /* one-letter flag, or 0 */",
           "} attnd_option_def_t;",
           "",
           "static const attnd_option_def_t attnd_option_defs[] = {"]
    for o in t["option"]:
        short = f"'{o['short']}'" if o.get("short") else "0"
        out.append(f"    {{{c_string(o['name'])}, {kinds[o['flag']]}, {int(o['file'])}, {short}}},")
    out += ["};",
            f"#define ATTND_OPTION_COUNT {len(t['option'])}",
            "",
            "static const char ATTND_OPTIONS_HELP[] ="]
    for line in help_text(t).splitlines(keepends=True):
        out.append("    " + c_string(line))
    out[-1] += ";"
    out += ["", "#endif /* ATTND_OPTIONS_GEN_H */", ""]
    return "\n".join(out)


def write(path, text):
    """Writes text to path (stdout for '-'); a path ending in .gz is gzipped the way
    Debian wants man pages: -9, no name, no timestamp (reproducible)."""
    if path in (None, "-"):
        sys.stdout.write(text)
        return
    tmp = path + ".tmp"
    if path.endswith(".gz"):
        import gzip
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                   compresslevel=9, mtime=0) as f:
            f.write(text.encode())
    else:
        with open(tmp, "w") as f:
            f.write(text)
    os.replace(tmp, path)


def changelog_date(path):
    """The date of the newest entry of a Debian changelog, as YYYY-MM-DD."""
    import email.utils
    with open(path) as f:
        for line in f:
            if line.startswith(" -- "):
                return email.utils.parsedate_to_datetime(line.split(">", 1)[1].strip()).strftime("%Y-%m-%d")
    sys.exit(f"{path}: no ' -- maintainer  date' line")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("conf")
    c.add_argument("-o", "--output")
    m = sub.add_parser("man")
    m.add_argument("source")
    m.add_argument("-o", "--output")
    m.add_argument("--version", default="")
    m.add_argument("--date", default="")
    m.add_argument("--changelog", help="take --date from this Debian changelog's newest entry")
    b = sub.add_parser("completion")
    b.add_argument("tool", choices=["attnd", "attnctl"])
    b.add_argument("-o", "--output")
    b.add_argument("--attnctl", help="the attnctl binary whose --help texts to read")
    g = sub.add_parser("gzip")
    g.add_argument("source")
    g.add_argument("-o", "--output", required=True)
    ch = sub.add_parser("cheader")
    ch.add_argument("-o", "--output")
    li = sub.add_parser("list")
    li.add_argument("kind", choices=["flags", "keys"])
    a = ap.parse_args(argv)
    t = load_options()
    if a.what == "conf":
        write(a.output, conf_text(t))
    elif a.what == "man":
        with open(a.source) as f:
            md = f.read()
        date = changelog_date(a.changelog) if a.changelog else a.date
        write(a.output, md_to_roff(expand(md, t, a.version), a.version, date))
    elif a.what == "completion" and a.tool == "attnd":
        write(a.output, completion_attnd(t))
    elif a.what == "completion":
        if not a.attnctl:
            ap.error("completion attnctl needs --attnctl BINARY")
        write(a.output, completion_attnctl(attnctl_helps(a.attnctl)))
    elif a.what == "cheader":
        write(a.output, cheader_text(t))
    elif a.what == "gzip":
        with open(a.source) as f:
            write(a.output, f.read())
    else:
        print("\n".join(flags(t) if a.kind == "flags" else keys(t)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
