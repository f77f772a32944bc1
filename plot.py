"""
Loss curves from train.py's JSONL logs.

    python plot.py out/gdn_130m/log.jsonl out/prism_130m/log.jsonl --out=loss.png
    python plot.py out/*/log.jsonl --x=tokens --smooth=20 --out=loss.png

One line per log for the training loss (optionally smoothed), dashed with markers for the
validation loss. The label of each run is its directory name.
"""
import argparse
import json
import os
import sys

from cli import HelpFormatter
from fileio import write_figure


def read_log(path):
    """(train, val): lists of records, the last record per iteration winning."""
    train, val = {}, {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                print(f"warning: {path}:{n}: not JSON, skipped", file=sys.stderr)
                continue
            if rec.get("loss") is not None:
                train[rec["iter"]] = rec
            elif rec.get("val_loss") is not None:
                val[rec["iter"]] = rec
    return [train[k] for k in sorted(train)], [val[k] for k in sorted(val)]


def smooth(ys, window):
    if window <= 1:
        return ys
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("logs", nargs="+", help="log.jsonl files written by train.py")
    p.add_argument("--out", default="loss.png", help="output PNG")
    p.add_argument("--x", choices=("iter", "tokens"), default="iter", help="x axis: iterations or tokens (billions)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window for the train loss (1: none)")
    p.add_argument("--title", default="", help="plot title (default: loss)")
    a = p.parse_args(argv)
    for path in a.logs:
        if not os.path.isfile(path):
            sys.exit(f"plot.py: error: log not found: {path}")
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    labels = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in a.logs]
    labels = [f"{x} [{i}]" if labels.count(x) > 1 else x for i, x in enumerate(labels)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (path, label) in enumerate(zip(a.logs, labels)):
        train, val = read_log(path)
        if not train and not val:
            sys.exit(f"plot.py: error: no loss records in {path}")
        color = f"C{i % 10}"
        scale = 1e9 if a.x == "tokens" else 1
        if train:
            xs = [r[a.x] / scale for r in train]
            ax.plot(xs, smooth([r["loss"] for r in train], a.smooth), color=color, lw=1.2, label=f"{label} train")
        if val:
            xs = [r[a.x] / scale for r in val]
            ax.plot(xs, [r["val_loss"] for r in val], "o--", color=color, ms=3, label=f"{label} val")
    ax.set_xlabel("tokens (B)" if a.x == "tokens" else "iteration")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(a.title or "loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(a.out, fig)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
