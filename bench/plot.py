#!/usr/bin/env python3
"""Plot benchmark tables: per shape, ours and NCCL-then-GEMM (or XLA) divided by the bound
max(GEMM alone, collective alone), with the bound drawn at 1.

Reads the markdown tables the benchmarks write (`tests_c/bench_overlap --out`,
`bench_comm_gemm --out`, `bench/torch_ops.py --out`, `bench/jax_ops.py --out`): any table
with an "ours ms" column and GEMM / collective columns ("GEMM ms" and "NCCL ms" or
"coll ms"); the baseline is "NCCL+GEMM ms" or "XLA ms" when present. One PNG, one panel
per input file.

    python3 bench/plot.py gpu-out/bench_overlap_tp4.md gpu-out/jax_ops.md --out plot.png
"""
import argparse
import math
import os
import sys


def tables(path):
    """Each markdown table of the file as (header, rows) of strings."""
    out, head, rows = [], None, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("|"):
                if head:
                    out.append((head, rows))
                head, rows = None, []
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            if head is None:
                head = cells
            elif set("".join(cells)) <= set("-: "):
                continue
            else:
                rows.append(cells)
    if head:
        out.append((head, rows))
    return out


def num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def series(path):
    """(labels, ours/bound, baseline/bound, baseline name) from the file's first usable table."""
    for head, rows in tables(path):
        col = {h.lower(): i for i, h in enumerate(head)}

        def find(*names):
            for n in names:
                if n in col:
                    return col[n]
            return None

        ours, gemm = find("ours ms"), find("gemm ms")
        comm = find("nccl ms", "coll ms")
        base = find("nccl+gemm ms", "xla ms")
        if ours is None or gemm is None or comm is None:
            continue
        label_cols = [i for i, h in enumerate(head) if not h.lower().endswith("ms") and "/" not in h
                      and h.lower() not in ("rel err vs xla",)]
        labels, o, b = [], [], []
        for r in rows:
            bound = max(num(r[gemm]), num(r[comm]))
            if not bound > 0:
                continue
            labels.append(" ".join(r[i] for i in label_cols if i < len(r)))
            o.append(num(r[ours]) / bound)
            b.append(num(r[base]) / bound if base is not None else math.nan)
        if labels:
            name = head[base].replace(" ms", "") if base is not None else None
            return labels, o, b, name
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [(t, series(t)) for t in a.tables]
    data = [(t, s) for t, s in data if s]
    if not data:
        print("no table with ours / GEMM / collective columns in " + ", ".join(a.tables), file=sys.stderr)
        return 1
    fig, axes = plt.subplots(len(data), 1, figsize=(max(8, 0.6 * max(len(s[0]) for _, s in data) + 3), 3.6 * len(data)),
                             squeeze=False)
    for ax, (path, (labels, ours, base, name)) in zip(axes[:, 0], data):
        x = range(len(labels))
        w = 0.4
        ax.bar([i - w / 2 for i in x], ours, w, label="ours / bound", color="#2a7ab0")
        if name and not all(math.isnan(v) for v in base):
            ax.bar([i + w / 2 for i in x], base, w, label=f"{name} / bound", color="#c8553d")
        ax.axhline(1.0, color="black", lw=1, ls="--", label="bound = max(GEMM alone, collective alone)")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("time / bound")
        ax.set_title(os.path.basename(path), fontsize=9)
        finite = [v for v in ours + base if not math.isnan(v)]
        ax.set_ylim(0, max(1.2, max(finite) * 1.1))
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out} ({len(data)} panel(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
