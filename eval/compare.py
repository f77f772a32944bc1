"""
Put several eval/harness.py results side by side, in the paper's table layout.

    python eval/compare.py out/gdn_130m/eval.json out/prism_130m/eval.json [--output table.md]

Each argument is a results JSON written by eval/harness.py --output (lm-eval's own
`--output_path` JSON works too: both keep lm-eval's "results" block). A row is labelled by the
JSON's "label" field, else by the file name; --labels overrides.

Columns: Wiki PPL (wikitext word perplexity), LMB PPL and LMB acc (lambada_openai), then
accuracy on piqa, hellaswag (acc_norm), winogrande, arc_easy, arc_challenge (acc_norm), boolq,
openbookqa, sciq, and Avg = the mean of the accuracy columns (LMB acc included). Accuracies are
percentages. A task that was not run shows '-', and Avg then covers only the columns present
(marked with '*').
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write  # noqa: E402

# (header, lm-eval task, lm-eval metric key, is_accuracy)
COLUMNS = [
    ("Wiki PPL", "wikitext", "word_perplexity,none", False),
    ("LMB PPL", "lambada_openai", "perplexity,none", False),
    ("LMB acc", "lambada_openai", "acc,none", True),
    ("piqa", "piqa", "acc,none", True),
    ("hella", "hellaswag", "acc_norm,none", True),
    ("wino", "winogrande", "acc,none", True),
    ("arc-e", "arc_easy", "acc,none", True),
    ("arc-c", "arc_challenge", "acc_norm,none", True),
    ("boolq", "boolq", "acc,none", True),
    ("obqa", "openbookqa", "acc,none", True),
    ("sciq", "sciq", "acc,none", True),
]


def table_row(results):
    """lm-eval's results block {task: {metric: value}} -> (cells, avg, complete)."""
    cells, accs = [], []
    for _, task, metric, is_acc in COLUMNS:
        v = results.get(task, {}).get(metric)
        if v is None or v == "N/A":
            cells.append(None)
            continue
        v = float(v) * (100.0 if is_acc else 1.0)
        cells.append(v)
        if is_acc:
            accs.append(v)
    n_acc = sum(1 for c in COLUMNS if c[3])
    avg = sum(accs) / len(accs) if accs else None
    return cells, avg, len(accs) == n_acc


def results_table(rows):
    """rows: list of (label, results block). Returns a markdown table string."""
    head = ["Model"] + [c[0] for c in COLUMNS] + ["Avg."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, results in rows:
        cells, avg, complete = table_row(results)
        out = [label]
        for (_, _, _, is_acc), v in zip(COLUMNS, cells):
            out.append("-" if v is None else (f"{v:.1f}" if is_acc else f"{v:.2f}"))
        out.append("-" if avg is None else f"{avg:.1f}" + ("" if complete else "*"))
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def load_results(path):
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"results file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("results"), dict):
        raise ValueError(f"{path}: no 'results' block; expected eval/harness.py or lm-eval output")
    label = d.get("label") or os.path.splitext(os.path.basename(path))[0]
    return label, d["results"]



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("results", nargs="+", help="results JSON files (eval/harness.py --output, or lm-eval's own)")
    p.add_argument("--labels", default=None, help="comma list, one label per file (default: each file's label)")
    p.add_argument("--output", default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    rows = [load_results(f) for f in args.results]
    if args.labels:
        labels = args.labels.split(",")
        if len(labels) != len(rows):
            p.error(f"--labels has {len(labels)} entries for {len(rows)} files")
        rows = [(lab, res) for lab, (_, res) in zip(labels, rows)]
    table = results_table(rows)
    sys.stdout.write(table)
    if args.output:
        atomic_write(args.output, table)
    return table


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:  # bad input: the message, not a traceback
        sys.exit(f"error: {e}")
