"""Tests for bench/realtext_corpus.py (the text cleaning, the shards) and bench/realtext.sh (end to
end in its TINY mode on a generated token file). Offline, no Debian packages needed."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import realtext_corpus as rc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MAN = r'''.\" Copyright line, a comment
.de Vb
.ft CW
..
.TH OPEN 2 2023-02-05 "Linux man-pages 6.03"
.SH NAME
open, creat \- open and possibly create a file
.SH DESCRIPTION
The
.BR open ()
system call opens the file specified by
.IR pathname .
It returns \fBa file descriptor\fR \(em a small,
nonnegative integer \*(L"fd\*(R".
.PP
.nf
int fd = open("x", O_RDONLY);
    if (fd < 0) exit(1);
.fi
.TS
tab(;);
l l.
HIDDEN;TABLE
.TE
Back slash: \e and a \(bu bullet.
'''


def test_groff_to_text():
    text = rc.groff_to_text(MAN)
    assert text.splitlines()[0] == "OPEN"
    assert "NAME\n\nopen, creat - open and possibly create a file" in text
    # filled lines are joined into one paragraph; alternating-font macros join without spaces
    assert ("The open() system call opens the file specified by pathname. It returns a file "
            "descriptor \u2014 a small, nonnegative integer \"fd\".") in text
    # no-fill block kept line by line, indentation included
    assert 'int fd = open("x", O_RDONLY);\n    if (fd < 0) exit(1);' in text
    assert "HIDDEN" not in text and ".ft" not in text and "Copyright" not in text  # table, macro, comment
    assert "Back slash: \\ and a \u2022 bullet." in text
    assert "\\f" not in text and "\\(" not in text
    assert rc.groff_to_text(".so man2/open.2\n") == ""  # alias pages are skipped


def test_info_to_text():
    raw = ("This is x.info, produced by makeinfo.\nINFO-DIR-SECTION X\n"
           "\x1f\nFile: x.info,  Node: Top,  Next: Intro,  Up: (dir)\n\nX manual\n********\n\n"
           "* Menu:\n\n* Intro::     The introduction.\n* More::      More.\n\n"
           "\x1f\nFile: x.info,  Node: Intro,  Prev: Top\n\n1 Intro\n=======\n\nText of the intro.\n"
           "\x1f\nTag Table:\nNode: Top\x7f100\n\x1f\nEnd Tag Table\n")
    nodes = rc.info_to_text(raw)
    assert nodes == ["X manual\n********", "1 Intro\n=======\n\nText of the intro."]


def test_html_to_text():
    page = ("<html><head><title>T</title><style>p {x}</style></head><body><nav>Prev Next</nav>"
            '<div id="banner"><a>Download</a></div><ul class="docnav top"><li><ul><li>Up</li></ul></li></ul>'
            "<h1>Heading</h1><p>One   sentence\nacross lines &amp; an entity.</p>"
            "<script>var x = 1;</script><pre>  code  line\n  two</pre></body></html>")
    text = rc.html_to_text(page)
    assert text.startswith("Heading\n\nOne sentence across lines & an entity.")
    assert "var x" not in text and "p {x}" not in text and "Prev Next" not in text
    assert "Download" not in text and "Up" not in text  # banner and DocBook nav bars, nested lists too
    assert "code  line" in text  # preformatted whitespace kept


def test_dict_and_pieces():
    raw = "Abuse \\A*buse\"\\, v. t.\n   1. To misuse.\n      [1913 Webster]\n\n   2. To revile.\n      [PJC]\n"
    text = rc.dict_to_text(raw)
    assert "[1913 Webster]" not in text and "[PJC]" not in text and "To revile." in text
    docs = rc.pieces(["a" * 30, "b" * 30, "c" * 30, "d" * 5], 50)
    assert docs == ["a" * 30 + "\n\n" + "b" * 30, "c" * 30 + "\n\n" + "d" * 5]
    assert "".join(docs).replace("\n", "") == "a" * 30 + "b" * 30 + "c" * 30 + "d" * 5


def test_write_shards_roundtrip(tmp_path):
    import zstandard
    docs = [("man", f"document {i} \u00e9 " * 50) for i in range(30)]
    (tmp_path / "realtext_009.jsonl.zst").write_bytes(b"stale")  # a previous run's shard goes
    paths = rc.write_shards(docs, str(tmp_path), shard_chars=5000)
    assert len(paths) > 1 and not (tmp_path / "realtext_009.jsonl.zst").exists()
    back = []
    for p in paths:
        for line in zstandard.ZstdDecompressor().decompress(open(p, "rb").read(),
                                                            max_output_size=1 << 24).decode().splitlines():
            rec = json.loads(line)
            back.append((rec["meta"]["redpajama_set_name"], rec["text"]))
    assert back == docs  # order and text kept exactly


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("lanes", ["", "0 1"])
def test_realtext_sh_tiny(tmp_path, lanes):
    """The whole GPU script on CPU: three tiny models, plot, summary, a few files in RESULTS_DIR; with
    GPUS="0 1" the models train in two parallel lanes and are summarised once."""
    data = tmp_path / "data" / "tok"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    # a learnable stream: mostly a repeating 7-token pattern, so the loss must fall in 4 steps
    pattern = np.array([5, 900, 31, 4000, 77, 12000, 2], dtype=np.uint16)
    for split, n in (("train", 6000), ("val", 1500)):
        toks = np.resize(pattern, n)
        noise = rng.random(n) < 0.1
        toks[noise] = rng.integers(3, 32000, noise.sum())
        toks.astype(np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": 32000, "tokenizer": "test", "eos_id": 2,
                                                "train_tokens": 6000, "val_tokens": 1500}))
    out = tmp_path / "result"
    env = dict(os.environ, TINY="1", TOKENS="1024", RESULTS_DIR=str(out), RUNS=str(tmp_path / "runs"),
               DATA_DIR=str(tmp_path / "data"), DATASET="tok", RUN_TIMEOUT="120", GPUS=lanes)
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "realtext.sh")], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(os.listdir(out))
    assert len(files) <= 8
    assert {"realtext_val.png", "realtext_summary.json", "realtext_train.log"} <= set(files)
    s = json.loads((out / "realtext_summary.json").read_text())
    assert s["iters"] == 2 and s["tokens_per_model"] == 1024 and s["same_tokens_all"]
    assert s["compare_at_iter"] == 2 and set(s["val_loss_at_compare"]) == {"gdn", "prism", "hybrid"}
    for name, m in s["models"].items():
        assert m["exit_code"] == 0 and m["finished"] and m["tokens_done"] == 1024, name
        first, last = m["val_curve"][0][2], m["val_curve"][-1][2]
        assert np.isfinite(last) and last < first, (name, m["val_curve"])
        assert abs(m["final_val_ppl"] - np.exp(m["final_val_loss"])) < 1e-2 * m["final_val_ppl"]
