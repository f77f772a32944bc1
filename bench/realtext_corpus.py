"""
An offline English corpus for the small real-text comparison (bench/realtext.sh), built from
Debian packages and written as SlimPajama-style .jsonl.zst shards that data/prepare_slimpajama.py
reads. Runs on the CPU of a Debian system; writes --out and --record.

On Debian 12 (bookworm), as root (about 100 MB to download, 0.5 GB installed):

    apt-get update
    apt-get install -y --no-install-recommends bible-kjv fortunes jargon-text python3.11-doc \\
        linux-doc-6.1 perl-doc git-man manpages manpages-dev libssl-doc debian-handbook \\
        debian-policy developers-reference bash-doc gnu-standards guile-3.0-doc octave-doc \\
        r-doc-info zsh-doc postgresql-doc-15 vim-runtime dict-gcide dict-foldoc dict-devil
    python bench/realtext_corpus.py                        # -> data/realtext_src/*.jsonl.zst
    python data/prepare_slimpajama.py --data_files 'data/realtext_src/*.jsonl.zst' \\
        --tokens 25000000 --val_tokens 1000000 --num_proc 2 --out_dir data/realtext
    python bench/realtext_corpus.py --record_prepared data/realtext   # counts + sha256 -> the record
    # the whole corpus's size in tokens (33.5M), recorded under "whole_corpus":
    python data/prepare_slimpajama.py --data_files 'data/realtext_src/*.jsonl.zst' --tokens all \\
        --val_tokens 0 --num_proc 2 --out_dir /tmp/realtext_all
    python bench/realtext_corpus.py --record_prepared /tmp/realtext_all --record_key whole_corpus

25M + 1M tokens are 52 MB of .bin, small enough to copy to a GPU machine with the repo.

Sources (one record per document, meta.redpajama_set_name = the source name):
  bible      King James Bible (bible-kjv, through its `bible` program), one document per chapter
  fortunes   fortune cookies (fortunes), ~2 KB runs of consecutive cookies
  jargon     the Jargon File (jargon-text), ~4 KB pieces
  pydoc      Python 3.11 documentation, reST sources (python3.11-doc), one per page
  linux      Linux 6.1 kernel documentation, reST (linux-doc-6.1), one per file; translations left out
  man        manual pages of MAN_PACKAGES (perl's pods are among them), groff markup stripped
             in Python (see groff_to_text), one per page; `.so` alias pages skipped
  info       GNU info manuals of INFO_PACKAGES, node headers, menus and tag tables removed,
             ~8 KB pieces
  handbook   The Debian Administrator's Handbook, en-US HTML (debian-handbook), one per page
  postgres   the PostgreSQL 15 manual, HTML (postgresql-doc-15), one per page
  vim        Vim's help files and user manual (vim-runtime), one per file
  dict       GCIDE (Webster 1913 + additions), FOLDOC and the Devil's Dictionary (dict-gcide,
             dict-foldoc, dict-devil), ~4 KB pieces of consecutive entries

More manuals (Django, Sphinx, SQLAlchemy, git, SQLite, Rust's books, Apache, Postfix, the Debian
Reference, the Bash scripting guide, Erlang/OTP, m4, and the autoconf/automake/binutils info
manuals: MANUALS, info_more) join with --sources; bench/realtext_seeds.py builds that corpus.

Only files that dpkg lists for these packages are read, so whatever else is installed does not
change the corpus. Exact duplicate documents are dropped. Documents are ordered by the md5 of
their text, which interleaves the sources (as SlimPajama's shuffled chunks do) and is the same
on every machine; prepare_slimpajama.py then holds out every k-th document for validation.
The package names, versions and sizes, and per-source counts go to --record
(bench/results/realtext_corpus.json). A missing package is reported and skipped.
"""

import argparse
import glob
import gzip
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write, sha256_file, write_json  # noqa: E402

MAN_PACKAGES = ["manpages", "manpages-dev", "perl-doc", "git-man", "libssl-doc"]
INFO_PACKAGES = ["bash-doc", "coreutils", "debian-policy", "developers-reference", "diffutils",
                 "findutils", "gettext", "gnu-standards", "gnupg", "grep", "guile-3.0-doc", "gzip",
                 "octave-doc", "r-doc-info", "sed", "wget", "zsh-doc"]
PACKAGES = sorted({"bible-kjv", "fortunes", "jargon-text", "python3.11-doc", "linux-doc-6.1",
                   "debian-handbook", "postgresql-doc-15", "vim-runtime", "dict-gcide", "dict-foldoc",
                   "dict-devil", *MAN_PACKAGES, *INFO_PACKAGES})


# -----------------------------------------------------------------------------------------------
# cleaning: pure functions of text (unit-tested)

# groff special characters worth keeping; any other \(xx or \[xx] is dropped
GROFF_CHARS = {"em": "\u2014", "en": "\u2013", "hy": "-", "bu": "\u2022", "aq": "'", "dq": '"',
               "lq": "\u201c", "rq": "\u201d", "oq": "\u2018", "cq": "\u2019", "co": "\u00a9",
               "rg": "\u00ae", "tm": "\u2122", "mu": "\u00d7", "de": "\u00b0", "ga": "`", "ti": "~",
               "ha": "^", "rs": "\\", "ba": "|", "lh": "<=", "rh": "=>", "->": "->", "<-": "<-",
               "Fo": "\u00ab", "Fc": "\u00bb", "fm": "'", "sq": "\u25a1", "ss": "\u00df",
               ":a": "\u00e4", ":o": "\u00f6", ":u": "\u00fc", "'e": "\u00e9", "`e": "\u00e8"}
# pod2man's strings: \*(L" and \*(R" are quotes, \*(C` and \*(C' frame code
GROFF_STRINGS = {'L"': '"', 'R"': '"', "C`": "'", "C'": "'", "Aq": "'", "lq": "\u201c", "rq": "\u201d"}
# font/size/motion escapes and other zero-width escapes
_GROFF_ESC = re.compile(r"""\\(?:f(?:\[[^\]]*\]|\(..|.)|s[-+]?(?:\d+|\(\d\d|\[[^\]]*\])|
                            [hvwlLoxbDHSZ]'[^']*'|[kmMnFgY](?:\[[^\]]*\]|\(..|.)|[&|^%c:ad uEpt)/,!{}])""", re.X)
_GROFF_SPECIAL = re.compile(r"\\(?:\((..)|\[([^\]]*)\]|\*(?:\((..)|\[([^\]]*)\]|(.)))")
_ALT_MACROS = {"BR", "RB", "IR", "RI", "BI", "IB"}
_FONT_MACROS = {"B", "I", "SM", "SB", "Nm", "Ar", "Fl", "Cm",
                "Pa", "Ev", "Va", "Fn", "Fa", "Ft", "Xr", "Em", "Sy", "Li", "Dv", "Er", "Nd", "Ql",
                "Dq", "Sq", "Pq", "Op", "Ic", "Tn", "Ux", "UR", "MT", "OP", "Lk"}
_PARA_MACROS = {"PP", "P", "LP", "sp", "br", "Pp", "Lp", "TP", "IP", "HP", "Bl", "El", "RS", "RE", "in"}


def _groff_args(rest):
    """Macro arguments as words: "quoted strings" keep their spaces."""
    words = re.findall(r'"((?:[^"]|"")*)"|(\S+)', rest)
    return [a.replace('""', '"') if a else b for a, b in words]


def groff_inline(s):
    """Text of one line with groff escapes replaced or removed."""
    s = s.replace("\\e", "\x00").replace("\\\\", "\x00")  # a literal backslash, restored below

    def special(m):
        name = m.group(1) or m.group(2)
        if name is not None:
            return GROFF_CHARS.get(name, "")
        return GROFF_STRINGS.get(m.group(3) or m.group(4) or m.group(5), "")
    s = _GROFF_SPECIAL.sub(special, s)
    s = s.replace("\\-", "-").replace("\\0", " ").replace("\\~", " ").replace("\\ ", " ")
    s = _GROFF_ESC.sub("", s)
    s = re.sub(r"\\(.)", r"\1", s)  # any other escaped character stands for itself
    return s.replace("\x00", "\\")


def groff_to_text(src):
    """Readable text from man(7)/mdoc(7) groff source, cheaply: requests and macro definitions
    dropped, headings and font macros reduced to their words, filled text joined into one line
    per paragraph (no-fill blocks such as .nf/.EX kept line by line), tables (tbl) dropped.
    Returns "" for an alias page (`.so other.1`)."""
    src = re.sub(r"(?<!\\)\\\n", "", src)  # escaped newline: the line continues
    out, para, skip_until, fill = [], [], None, True

    def text(s):
        if fill:
            para.append(s)
        else:
            out.append(s)

    def flush(blank=True):
        if para:
            out.append(" ".join(w for w in para if w))
            para.clear()
        if blank:
            out.append("")

    for line in src.splitlines():
        if skip_until is not None:  # inside a macro definition, .ig block or table
            if line.startswith(skip_until):
                skip_until = None
            continue
        if not line.startswith((".", "'")):
            if not line.strip():
                flush()
            else:
                if fill and line[0] in " \t":  # a leading space breaks the line in groff too
                    flush(blank=False)
                text(groff_inline(line))
            continue
        m = re.match(r"[.'][ \t]*(\S*)[ \t]*(.*)", line)
        name, rest = m.group(1), m.group(2)
        if name.startswith('\\"') or name == "":
            continue
        if name == "so":
            return ""
        if name in ("de", "de1", "am", "ig"):
            skip_until = ".."
        elif name == "TS":
            skip_until = ".TE"
        elif name in ("SH", "SS", "Sh", "Ss"):
            flush()
            out += [groff_inline(" ".join(_groff_args(rest))), ""]
        elif name in _ALT_MACROS:  # .BR open (2) -> "open(2)": alternating fonts, no spaces
            text(groff_inline("".join(_groff_args(rest))))
        elif name in _FONT_MACROS:
            text(groff_inline(" ".join(_groff_args(rest))))
        elif name in ("nf", "EX", "Bd", "Vb"):
            flush()
            fill = False
        elif name in ("fi", "EE", "Ed", "Ve"):
            fill = True
            out.append("")
        elif name in _PARA_MACROS:
            flush()
            args = _groff_args(rest)
            if name == "IP" and args and args[0] not in ("\\(bu", "\\[bu]", "\\(em", "-", "*"):
                out.append(groff_inline(args[0]))
        elif name == "It":
            flush()
            text(groff_inline(" ".join(a for a in _groff_args(rest) if a not in _FONT_MACROS)))
        elif name == "TH":
            args = _groff_args(rest)
            if args:
                out += [groff_inline(args[0]), ""]
        # every other request or macro: formatting only
    flush(blank=False)
    return tidy("\n".join(out))


def tidy(text):
    """Trailing spaces off, runs of blank lines to one, ends stripped."""
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def info_to_text(raw):
    """Text of a GNU info file: node header lines, menus, the tag table and the file preamble
    removed (the \\x1f separators mark nodes)."""
    nodes = []
    for part in raw.split("\x1f")[1:]:  # before the first separator: the file preamble
        part = part.lstrip("\n")
        if part.startswith(("Tag Table:", "End Tag Table", "Indirect:", "Local Variables")):
            continue
        lines = part.split("\n")
        if lines and lines[0].startswith("File:"):
            lines = lines[1:]
        body, in_menu = [], False
        for line in lines:
            if line.startswith("* Menu:"):
                in_menu = True
                continue
            if in_menu:
                if line.startswith("* ") or line.startswith(" ") or not line.strip():
                    continue
                in_menu = False
            body.append(line)
        text = tidy("\n".join(body))
        if text:
            nodes.append(text)
    return nodes


class _HTMLText(html.parser.HTMLParser):
    BLOCK = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr", "dt", "dd",
             "table", "ul", "ol", "dl", "blockquote", "section", "title"}
    SKIP = {"script", "style", "head", "nav"}
    SKIP_CLASSES = {"docnav", "navheader", "navfooter"}  # DocBook's Prev/Up/Next bars
    SKIP_IDS = {"banner"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.pre = [], 0
        self.skip_tag, self.skip_depth = None, 0  # the element whose subtree is being skipped

    def handle_starttag(self, tag, attrs):
        if self.skip_tag is not None:
            self.skip_depth += tag == self.skip_tag
            return
        a = dict(attrs)
        if (tag in self.SKIP or a.get("id") in self.SKIP_IDS
                or self.SKIP_CLASSES & set((a.get("class") or "").split())):
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag in self.BLOCK:
            self.parts.append("\n\n")
        self.pre += tag == "pre"

    def handle_endtag(self, tag):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag in self.BLOCK:
            self.parts.append("\n\n")
        if tag == "pre":
            self.pre = max(0, self.pre - 1)

    def handle_data(self, data):
        if self.skip_tag is None:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(src):
    """Visible text of an HTML page, block elements as paragraphs; head, scripts, styles, nav out."""
    p = _HTMLText()
    p.feed(src)
    p.close()
    text = "".join(p.parts)
    return tidy("\n".join(line.strip() if not line.startswith("    ") else line.rstrip()
                          for line in text.split("\n")))


_DICT_SOURCE_TAG = re.compile(r"^[ \t]*\[(?:1913 Webster|PJC|WordNet 1\.5|Century Dict\.|Webster 1913 Suppl\.|"
                              r"[A-Z][A-Za-z. ]{0,20})\]\s*$", re.M)


def dict_to_text(raw):
    """A dictd .dict body with GCIDE's per-sense source tags ("[1913 Webster]") removed."""
    return tidy(_DICT_SOURCE_TAG.sub("", raw))


def pieces(paragraphs, size):
    """Consecutive paragraphs joined into documents of at least `size` characters (the last may
    be shorter)."""
    out, cur, n = [], [], 0
    for p in paragraphs:
        cur.append(p)
        n += len(p) + 2
        if n >= size:
            out.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


# -----------------------------------------------------------------------------------------------
# sources: each returns a list of document texts (empty when its package is missing)

def dpkg_files(pkg):
    """Paths dpkg lists for an installed package (sorted), or [] if it is not installed."""
    p = subprocess.run(["dpkg-query", "-L", pkg], capture_output=True, text=True)
    return sorted(line for line in p.stdout.splitlines() if line.startswith("/")) if p.returncode == 0 else []


def read_text(path):
    opener = gzip.open if path.endswith((".gz", ".dz")) else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def src_bible():
    if not shutil.which("bible"):
        return []
    kjv = subprocess.run(["bible", "Gen1:1-Rev22:21"], capture_output=True, text=True, cwd="/tmp").stdout
    chapters = [c.strip() for c in re.split(r"\n(?=[A-Za-z0-9 ]+ \d+\n)", kjv)]  # "Genesis 1" heads
    return [c for c in chapters if len(c) > 200]


def fortune_cookies(path):
    """The cookies of one fortune file ('%' lines separate them); [] for an index (.dat), a
    directory or a file that is not UTF-8."""
    if "." in os.path.basename(path) or not os.path.isfile(path):
        return []
    try:
        text = open(path, encoding="utf-8").read()
    except UnicodeDecodeError:
        return []
    return [c.strip() for c in text.split("\n%\n") if c.strip()]


def src_fortunes():
    docs = []
    for f in dpkg_files("fortunes"):
        if f.startswith("/usr/share/games/fortunes/"):
            docs += pieces(fortune_cookies(f), 2000)  # most are one line: ~2 KB documents
    return docs


def src_jargon():
    f = "/usr/share/doc/jargon-text/jargon.txt.gz"
    return pieces(read_text(f).split("\n\n"), 4000) if os.path.exists(f) else []


def src_pydoc():
    pages = sorted({os.path.realpath(f) for f in dpkg_files("python3.11-doc")
                    if "/_sources/" in f and f.endswith(".txt")})
    return [tidy(read_text(f)) for f in pages]


def src_linux():
    files = [f for f in dpkg_files("linux-doc-6.1")
             if f.endswith(".rst.gz") and "/Documentation/" in f and "/translations/" not in f]
    return [tidy(read_text(f)) for f in files if os.path.isfile(f) and not os.path.islink(f)]


def src_man():
    docs = []
    for pkg in MAN_PACKAGES:
        for f in dpkg_files(pkg):
            if re.match(r"/usr/share/man/man\d/", f) and f.endswith(".gz") and not os.path.islink(f):
                docs.append(groff_to_text(read_text(f)))
    return docs


def src_info(packages=INFO_PACKAGES):
    docs = []
    for pkg in packages:
        files = [f for f in dpkg_files(pkg) if f.startswith("/usr/share/info/") and ".info" in f
                 and f.endswith(".gz") and not os.path.islink(f)]
        manuals = {}
        for f in files:  # find.info.gz (indirect table only), find.info-1.gz, find.info-2.gz
            m = re.match(r"(.*\.info)(?:-(\d+))?\.gz$", f)
            manuals.setdefault(m.group(1), []).append((int(m.group(2) or 0), f))
        for name in sorted(manuals):
            nodes = []
            for _, f in sorted(manuals[name]):
                nodes += info_to_text(read_text(f))
            docs += pieces(nodes, 8000)
    return docs


def src_handbook():
    files = [f for f in dpkg_files("debian-handbook") if "/html/en-US/" in f and f.endswith(".html")]
    return [html_to_text(read_text(f)) for f in files]


def src_postgres():
    files = [f for f in dpkg_files("postgresql-doc-15") if "/html/" in f and f.endswith(".html")]
    return [html_to_text(read_text(f)) for f in files]


def src_vim():
    files = [f for f in dpkg_files("vim-runtime") if re.match(r"/usr/share/vim/vim\d+/doc/[^/]+\.txt$", f)]
    return [tidy(read_text(f)) for f in files if os.path.isfile(f) and not os.path.islink(f)]


def src_dict():
    docs = []
    for pkg in ("dict-gcide", "dict-foldoc", "dict-devil"):
        for f in dpkg_files(pkg):
            if f.endswith(".dict.dz"):
                paras = [p for p in dict_to_text(read_text(f)).split("\n\n") if p.strip()]
                docs += pieces(paras, 4000)
    return docs


SOURCES = {"bible": src_bible, "fortunes": src_fortunes, "jargon": src_jargon, "pydoc": src_pydoc,
           "linux": src_linux, "man": src_man, "info": src_info, "handbook": src_handbook,
           "postgres": src_postgres, "vim": src_vim, "dict": src_dict}
DEFAULT_SOURCES = list(SOURCES)  # the corpus recorded in bench/results/realtext_corpus.json

# More manuals, for the larger corpus of bench/realtext_seeds.py (named with --sources, so the
# default corpus stays as recorded): name -> (package, files to read, files to skip), regexes
# over the paths dpkg lists. HTML is reduced to its text; any other file is read as text.
MANUALS = {
    "django": ("python-django-doc", r"/html/.*\.html$", r"/(genindex|py-modindex|search)\.html$|/_modules/"),
    "sphinx": ("sphinx-doc", r"/_sources/.*\.txt$", None),
    "sqlalchemy": ("python-sqlalchemy-doc", r"/rst/.*\.rst$", None),
    # the commands' own pages are git-man's (source "man")
    "gitdoc": ("git-doc", r"/git-doc/(user-manual|technical/.*|howto/.*)\.txt$", None),
    # C API stubs and release logs are lists, not prose
    "sqlite": ("sqlite3-doc", r"\.html$", r"/(c3ref|releaselog)/"),
    # the books; print.html repeats every chapter of its book
    "rust": ("rust-doc", r"/html/(book|reference|nomicon|rustc|edition-guide|embedded-book|rust-by-example|"
                         r"rustdoc|style-guide)/.*\.html$", r"/(print|toc|404)\.html$"),
    "apache": ("apache2-doc", r"/manual/en/.*\.html$", None),
    "postfix": ("postfix-doc", r"/html/[^/]+\.html$", r"\.\d\.html$"),  # NAME.N.html: its man pages
    "debref": ("debian-reference-en", r"\.en\.html$", None),
    "abs": ("abs-guide", r"/html/.*\.html$", None),
    "erlang": ("erlang-doc", r"/doc/html/.*\.html$", None),
    "m4": ("m4-doc", r"\.html$", None),
}
MORE_INFO_PACKAGES = ["autoconf-doc", "automake", "binutils-doc"]


def src_manual(pkg, keep, skip):
    files = [f for f in dpkg_files(pkg) if re.search(keep, f) and not (skip and re.search(skip, f))
             and os.path.isfile(f) and not os.path.islink(f)]
    return [html_to_text(read_text(f)) if ".html" in f else tidy(read_text(f)) for f in files]


SOURCES.update({name: (lambda spec=spec: src_manual(*spec)) for name, spec in MANUALS.items()})
SOURCES["info_more"] = lambda: src_info(MORE_INFO_PACKAGES)


def packages_of(sources):
    """The Debian packages whose files the named sources read."""
    extra = {MANUALS[s][0] for s in sources if s in MANUALS}
    return sorted(set(PACKAGES) | extra | (set(MORE_INFO_PACKAGES) if "info_more" in sources else set()))


# -----------------------------------------------------------------------------------------------
# output

def package_versions(pkgs):
    """{package: {version, installed_kb}} for the installed ones; the missing ones listed apart."""
    found, missing = {}, []
    for pkg in pkgs:
        p = subprocess.run(["dpkg-query", "-W", "-f", "${Status}\t${Version}\t${Installed-Size}", pkg],
                           capture_output=True, text=True)
        parts = p.stdout.split("\t")
        if p.returncode == 0 and len(parts) == 3 and parts[0].endswith(" installed"):
            found[pkg] = {"version": parts[1], "installed_kb": int(parts[2] or 0)}
        else:
            missing.append(pkg)
    return found, missing


def md5(s):
    return hashlib.md5(s.encode("utf-8")).hexdigest()


def write_shards(docs, out, shard_chars=32_000_000):
    """docs = [(source, text)] in final order -> out/realtext_NNN.jsonl.zst, atomically each."""
    import zstandard
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "realtext_*.jsonl.zst")):
        os.remove(old)  # a previous run's shards would otherwise be read too
    shards, cur, n = [], [], 0
    for src, text in docs:
        cur.append(json.dumps({"text": text, "meta": {"redpajama_set_name": src}}, ensure_ascii=False) + "\n")
        n += len(text)
        if n >= shard_chars:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    paths = []
    for i, lines in enumerate(shards):
        path = os.path.join(out, f"realtext_{i:03d}.jsonl.zst")
        atomic_write(path, zstandard.ZstdCompressor(level=3).compress("".join(lines).encode("utf-8")))
        paths.append(path)
    return paths


def build(sources, min_chars=200):
    """[(source, text)] deduplicated and ordered by md5, plus per-source counts."""
    seen, docs, counts = set(), [], {}
    for name in sources:
        t0 = time.time()
        texts = SOURCES[name]()
        kept = 0
        c = {"documents": 0, "characters": 0, "dropped_short": 0, "dropped_duplicate": 0}
        for t in texts:
            if len(t) < min_chars:
                c["dropped_short"] += 1
                continue
            h = md5(t)
            if h in seen:
                c["dropped_duplicate"] += 1
                continue
            seen.add(h)
            docs.append((h, name, t))
            c["documents"] += 1
            c["characters"] += len(t)
            kept += 1
        counts[name] = c
        print(f"{name:9s} {c['documents']:7,d} docs {c['characters'] / 1e6:7.1f}M chars "
              f"({c['dropped_short']} short, {c['dropped_duplicate']} duplicate dropped) "
              f"in {time.time() - t0:.1f}s", flush=True)
    docs.sort()
    return [(s, t) for _, s, t in docs], counts


def update_record(path, updates):
    """Merge `updates` into the JSON record at path (written atomically)."""
    rec = {}
    if os.path.isfile(path):
        with open(path) as f:
            rec = json.load(f)
    rec.update(updates)
    write_json(path, rec)


def prepared_record(d):
    """What data/prepare_slimpajama.py made of the shards in `d`: its command and counts (from
    meta.json) and the sha256 of the .bin files, so a rebuild can be checked byte for byte."""
    meta_path = os.path.join(d, "meta.json")
    if not os.path.isfile(meta_path):
        sys.exit(f"realtext_corpus.py: error: {meta_path} not found; run data/prepare_slimpajama.py first")
    with open(meta_path) as f:
        meta = json.load(f)
    rec = {k: meta.get(k) for k in ("command", "created_utc", "tokenizer", "tokenizer_sha256", "train_tokens",
                                    "val_tokens", "train_documents", "val_documents", "val_split")}
    for split in ("train", "val"):
        rec[f"{split}_bin_bytes"] = os.path.getsize(os.path.join(d, f"{split}.bin"))
        rec[f"{split}_bin_sha256"] = sha256_file(os.path.join(d, f"{split}.bin"))
    return rec



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", default=os.path.relpath(os.path.join(ROOT, "data", "realtext_src")), help="shard folder")
    ap.add_argument("--record", default=os.path.relpath(os.path.join(ROOT, "bench", "results", "realtext_corpus.json")),
                    help="JSON record of the packages, versions and counts")
    ap.add_argument("--sources", nargs="+", default=DEFAULT_SOURCES, choices=list(SOURCES), metavar="SOURCE",
                    help="sources to gather: " + " ".join(SOURCES))
    ap.add_argument("--min_chars", type=int, default=200, help="drop shorter documents")
    ap.add_argument("--record_prepared", metavar="DIR", default=None,
                    help="only add DIR's meta.json counts and .bin sha256 to --record (after prepare)")
    ap.add_argument("--record_key", default="prepared", help="the key --record_prepared writes under")
    a = ap.parse_args(argv)
    if a.record_prepared:
        update_record(a.record, {a.record_key: prepared_record(a.record_prepared)})
        print(f"wrote {a.record}")
        return
    if not shutil.which("dpkg-query"):
        sys.exit("realtext_corpus.py: error: needs a Debian system (dpkg-query not found)")
    found, missing = package_versions(packages_of(a.sources))
    if missing:
        print(f"warning: not installed, their text is left out: {' '.join(missing)}\n"
              f"  apt-get install -y --no-install-recommends {' '.join(missing)}", file=sys.stderr)
    docs, counts = build(a.sources, a.min_chars)
    if not docs:
        sys.exit("realtext_corpus.py: error: no text found; install the packages in the docstring")
    paths = write_shards(docs, a.out)
    chars = sum(len(t) for _, t in docs)
    size = sum(os.path.getsize(p) for p in paths)
    print(f"total     {len(docs):7,d} docs {chars / 1e6:7.1f}M chars -> {len(paths)} shards, "
          f"{size / 1e6:.1f} MB in {a.out}")
    update_record(a.record, {"corpus": {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/realtext_corpus.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "os": open("/etc/debian_version").read().strip() if os.path.exists("/etc/debian_version") else None,
        "packages": found, "packages_missing": missing, "sources": counts,
        "documents": len(docs), "characters": chars, "shards": [os.path.basename(p) for p in paths],
        "jsonl_zst_bytes": size}})
    print(f"wrote {a.record}")


if __name__ == "__main__":
    main()
