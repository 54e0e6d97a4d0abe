#!/usr/bin/env python3
"""The performance bar of one benchmark run, from the tables the benchmarks wrote.

    python3 bench/acceptance.py gpu-out/bench_comm_gemm_tp2.md gpu-out/bench_overlap_tp4.md \
        gpu-out/torch_ops_tp4.md ... [--out acceptance.md]

For every table with "ours ms", "GEMM ms" and "NCCL ms" / "coll ms" columns (the formats of
tests_c/bench_comm_gemm, tests_c/bench_overlap and bench/torch_ops.py), per group of rows
(benchmark, tp, transport, dtype, op, algorithm):
- ours / bound for each shape, where bound = max(GEMM alone, collective alone) from the
  same row, i.e. the same run;
- the geomean and the worst of those ratios;
- the bar: AG and RS geomean <= 1.05 and worst <= 1.10; AR geomean <= 1.10.
Rows of the library's default choice (no algorithm column) with an "NCCL+GEMM ms" / "nccl+mm
ms" column are also compared with it: the default must be no slower on every row.
bench_overlap's rows also form an "engine, best algorithm" group: per shape, the fastest
of its algorithms. torch_ops rows with a "symm-mem ms" column are also compared with
torch's symmetric-memory async TP (ours must be faster on every row).

tp comes from a "tp" column, else from the file name ("_tp4"), else from a caption line
("tp = 4", as bench/jax_ops.py writes). ours/bound is the writer's own column where there is
one (else recomputed). Geomean rows are skipped; a row whose "ours ms" is not a number
(our op failed: "error: ...", "-") counts against its group, which then does not meet the
bar. Prints a markdown table and a verdict line per group; the exit status is 0 (a
report, not a test). Reads the tables of tests_c/bench_overlap, tests_c/bench_comm_gemm,
bench/torch_ops.py and bench/jax_ops.py.
"""
import argparse
import importlib.util
import math
import os
import re
import sys
from collections import OrderedDict

_spec = importlib.util.spec_from_file_location("te_comm_plot", os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot.py"))
_plot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plot)
tables, num = _plot.tables, _plot.num

GEOMEAN_AG_RS, WORST_AG_RS, GEOMEAN_AR = 1.05, 1.10, 1.10


def geomean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else math.nan


def rows_of(path):
    """Each usable row as a dict: bench, tp, transport, dtype, op, algorithm, shape,
    ratio (ours / bound), ours, symm (symm-mem ms or None)."""
    bench = re.sub(r"_tp\d+$", "", os.path.splitext(os.path.basename(path))[0])
    m = re.search(r"_tp(\d+)", os.path.basename(path))
    if not m:
        with open(path, encoding="utf-8") as f:
            m = re.search(r"^[^|\n]*\btp\s*=\s*(\d+)", f.read(), re.M)
    file_tp = m.group(1) if m else "?"
    out = []
    for head, rows in tables(path):
        col = {h.lower(): i for i, h in enumerate(head)}

        def at(r, *names):
            for n in names:
                if n in col and col[n] < len(r):
                    return r[col[n]]
            return None

        if "ours ms" not in col or "gemm ms" not in col or not ({"nccl ms", "coll ms"} & set(col)):
            continue
        for r in rows:
            op = (at(r, "op") or "").strip()
            if not op or "geomean" in op.lower():
                continue
            ours, gemm, comm = num(at(r, "ours ms")), num(at(r, "gemm ms")), num(at(r, "nccl ms", "coll ms"))
            bound = max(gemm, comm) if gemm > 0 and comm > 0 else math.nan
            ratio = num(at(r, "ours/bound")) if "ours/bound" in col else math.nan
            if not ratio > 0 and ours > 0 and bound > 0:
                ratio = ours / bound
            symm = num(at(r, "symm-mem ms")) if "symm-mem ms" in col else None
            seq = num(at(r, "nccl+gemm ms", "nccl+mm ms")) if {"nccl+gemm ms", "nccl+mm ms"} & set(col) else None
            out.append({
                "bench": bench,
                "tp": (at(r, "tp") or file_tp).strip(),
                "transport": (at(r, "transport") or "-").strip(),
                "dtype": (at(r, "dtype") or "bf16").strip(),
                "op": op.upper(),
                "algorithm": (at(r, "algorithm") or "-").strip(),
                "shape": (at(r, "m x k x n", "tokens x k x n") or "?").strip(),
                "ratio": ratio if ratio > 0 else None,  # None: our op gave no time (failed)
                "ours": ours,
                "symm": symm if symm is not None and symm > 0 else None,
                "seq": seq if seq is not None and seq > 0 else None,
            })
    return out


def groups(rows):
    """Ordered groups: (key, [rows]); bench_overlap also gets its best-algorithm group."""
    g = OrderedDict()
    for r in rows:
        g.setdefault((r["bench"], r["tp"], r["transport"], r["dtype"], r["op"], r["algorithm"]), []).append(r)
    best = OrderedDict()
    for r in rows:
        if r["algorithm"] == "-":
            continue
        k = (r["bench"], r["tp"], r["transport"], r["dtype"], r["op"], "best algorithm")
        shapes = best.setdefault(k, OrderedDict())
        have = shapes.get(r["shape"])
        if have is None or (r["ratio"] is not None and (have["ratio"] is None or r["ratio"] < have["ratio"])):
            shapes[r["shape"]] = r
    for k, shapes in best.items():
        g[k] = list(shapes.values())
    return g


def verdict(op, ratios):
    """(geomean, worst, met) over the shapes' ratios; a failed shape (None) fails the bar."""
    ok = [x for x in ratios if x is not None]
    gm, worst = geomean(ok), max(ok) if ok else math.nan
    if len(ok) < len(ratios):
        return gm, worst, False
    if op == "AR":
        return gm, worst, gm <= GEOMEAN_AR
    return gm, worst, gm <= GEOMEAN_AG_RS and worst <= WORST_AG_RS


def report(paths):
    rows = [r for p in paths for r in rows_of(p)]
    lines = [
        f"Bar: AG/RS geomean ours/bound <= {GEOMEAN_AG_RS} and worst <= {WORST_AG_RS}; AR geomean <= {GEOMEAN_AR}.",
        "",
        "| benchmark | tp | transport | dtype | op | algorithm | shapes | failed | geomean ours/bound | worst | bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    met = total = 0
    grouped = groups(rows)
    for (bench, tp, transport, dtype, op, algo), rs in grouped.items():
        gm, worst, ok = verdict(op, [r["ratio"] for r in rs])
        failed = sum(r["ratio"] is None for r in rs)
        met, total = met + ok, total + 1
        lines.append(f"| {bench} | {tp} | {transport} | {dtype} | {op} | {algo} | {len(rs)} | {failed} | {gm:.3f} | "
                     f"{worst:.3f} | {'met' if ok else 'NOT met'} |")
    torch_rows = [r for r in rows if r["symm"] is not None and r["op"] in ("AG", "RS") and r["dtype"] == "bf16"]
    lines.append("")
    lines.append(f"groups meeting the bar: {met} of {total}")
    if torch_rows:
        slower = [r for r in torch_rows if not r["ours"] < r["symm"]]  # a failed op (NaN) counts
        lines.append(f"against torch symmetric-memory async TP (bf16 AG/RS rows): ours faster on "
                     f"{len(torch_rows) - len(slower)} of {len(torch_rows)}"
                     + ("" if not slower else "; not on: " + ", ".join(
                         f"tp {r['tp']} {r['op']} {r['shape']} ({r['ours']:.3f} vs {r['symm']:.3f} ms)" for r in slower)))
    # The default choice (rows without an explicit algorithm) against the collective then
    # the GEMM (GEMM then collective for RS / AR) of the same row.
    seq_rows = [r for r in rows if r["seq"] is not None and r["algorithm"] == "-"]
    if seq_rows:
        slower = [r for r in seq_rows if not r["ours"] <= r["seq"]]  # a failed op (NaN) counts
        lines.append(f"the default no slower than the collective then the GEMM (NCCL+GEMM): on "
                     f"{len(seq_rows) - len(slower)} of {len(seq_rows)} rows"
                     + ("" if not slower else "; not on: " + ", ".join(
                         f"{r['bench']} tp {r['tp']} {r['transport']} {r['dtype']} {r['op']} {r['shape']} "
                         f"({r['ours']:.3f} vs {r['seq']:.3f} ms)" for r in slower)))
    if any(k[5] == "best algorithm" for k in grouped):
        lines.append("(a \"best algorithm\" group takes each shape's fastest engine algorithm: optimistic by the timing noise)")
    if not rows:
        lines.append("no benchmark rows found in " + ", ".join(paths))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="+")
    p.add_argument("--out")
    a = p.parse_args()
    text = report(a.tables)
    print(text, end="")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
