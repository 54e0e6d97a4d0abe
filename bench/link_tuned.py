#!/usr/bin/env python3
"""The autotuner on the emulated link: which fused configuration the library's tuner would
pick per row, and what that pick then measures.

bench/own_gemm_link.cpp measures one fused configuration per pass (the tile rule's width
and piece count unless told otherwise). The library's autotuner (src/tune.rs) measures
several fused candidates per call shape and keeps the fastest: for the fused all-gather
whole chunks, 2 and 8 pieces (with K slices, NVTE_COMM_AG_PIECES=k: 4 slices for the first
two, 8 for the third) and 128-wide tiles; for the fused reduce-scatter ring 1 and 4 pieces
(raised by `sm90::rs_pieces`) and 4 pieces of 128-wide tiles. scripts/emulated-link-gpu.sh
(LINK_TUNED=1) runs a subset: the bench's default (4 pieces: with --k-pieces the 4 K slices
of the tuner's whole-chunk and 2-piece candidates; row pieces the tuner does not have
without it), `--bn 128` (128-wide tiles) and, for the all-gather, `--pieces 8`; not the
reduce-scatter's whole blocks. This script takes two
independent sets of passes of the same candidates, each candidate's pass a markdown table
of own_gemm_link (`--bn 128` for the narrow tiles, `--pieces 8` for 8 slices):
- the TUNE set picks, per row (op, dtype, tp, shape, flags variant), the candidate with the
  shortest fused time (as the tuner does: the call's time, not its ratio to a bound). The
  tuner's margin (src/timing.rs MARGIN, 3 %) is against the call's defaults, which are not
  fused (the chunked algorithms): the fused candidates compete among themselves without
  one, so `--margin` (against the first candidate here) defaults to 0. Whether the tuner
  would take a fused candidate at all is the line "fused over chunked": the picked fused
  time against the pass's chunked cuBLASLt algorithm with the 3 % margin;
- the REPORT set gives that candidate's fused / bound (its own pass's bound: the GEMM
  alone on all SMs or the link alone, whichever is longer), so no pick is reported on
  the measurement that chose it.
A candidate that did not run a row (e.g. 8 slices for the reduce-scatter) is skipped there.

Prints (and writes with --out) one line per row and the bar lines: fused <= 1.05 x bound,
geomean over the tp 4 and 8 rows per dtype, tuned, next to the default candidate's from the
same REPORT set.

  python3 bench/link_tuned.py --tune default=A1.md narrow=B1.md slices8=C1.md \\
      --report default=A2.md narrow=B2.md slices8=C2.md [--out tuned.md]
The first candidate named is the default (the tuner's first candidate).
"""
import argparse
import math
import sys


def read_table(path, wrong):
    """{(op, in, tp, shape): (fused ms, fused/bound, chunked ms)} of the flags-only rows that ran
    and were right; the keys of rows that ran wrong (ok not "yes") are added to `wrong`."""
    rows = {}
    head = None
    with open(path) as f:
        for line in f:
            if not line.startswith("|"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "op":
                head = cells
                continue
            if head is None or cells[0] not in ("AG", "RS") or len(cells) < len(head):
                continue
            r = dict(zip(head, cells))
            if r["link"] != "flags":
                continue
            key = (r["op"], r["in"], int(r["tp"]), r["shape"])
            if r["ok"] != "yes":
                wrong.add((path, key))
                continue
            try:
                fused, ratio, chunked = float(r["fused"]), float(r["fused/bound"]), float(r["chunked"])
            except ValueError:
                continue
            if fused > 0 and ratio > 0:
                rows[key] = (fused, ratio, chunked)
    return rows


def parse_set(items, wrong):
    out = []
    for it in items:
        name, _, path = it.partition("=")
        if not path:
            sys.exit(f"link_tuned: '{it}' is not NAME=TABLE.md")
        out.append((name, read_table(path, wrong)))
    return out


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune", nargs="+", required=True, help="NAME=TABLE.md: the passes that pick")
    ap.add_argument("--report", nargs="+", required=True, help="NAME=TABLE.md: the passes reported")
    ap.add_argument("--margin", type=float, default=0.0,
                    help="a candidate other than the first only where this much faster (default 0: see above)")
    ap.add_argument("--out", help="write the lines here too")
    a = ap.parse_args()
    wrong = set()
    tune, report = parse_set(a.tune, wrong), parse_set(a.report, wrong)
    names = [n for n, _ in tune]
    if names != [n for n, _ in report]:
        sys.exit("link_tuned: --tune and --report must name the same candidates in the same order")
    tune_d, report_d = dict(tune), dict(report)
    default = names[0]
    lines = ["## The autotuner on the emulated link (bench/link_tuned.py)", "",
             "Picked per row on the TUNE passes (shortest fused ms), reported from the REPORT passes "
             "(fused / bound of the picked candidate's own pass); "
             + (f"another candidate than the first only where {a.margin:.0%} faster. " if a.margin > 0 else
                "no margin among the fused candidates (the tuner's margin is against the call's non-fused "
                "defaults: see the line 'fused over chunked'). ")
             + "Candidates: " + ", ".join(names) + f" (the first: {default}).", "",
             "| op | in | tp | shape | picked | fused / bound (tuned) | " + default + " / bound | tune ms (" +
             " / ".join(names) + ") |", "|---|---|---|---|---|---|---|---|"]
    per = {}  # dtype -> ([tuned], [default])
    missing = []  # rows left out: (key, why)
    over_chunked = counted = 0
    every = set().union(*(set(d) for d in tune_d.values()), *(set(d) for d in report_d.values()))
    for key in sorted(every, key=lambda k: (k[1], k[0], k[2], k[3])):
        op, dt, tp, shape = key
        if key not in tune_d[default] or key not in report_d[default]:
            missing.append((key, "the default candidate has no result in both sets"))
            continue
        cands = [n for n in names if key in tune_d[n]]
        pick = min(cands, key=lambda n: tune_d[n][key][0])
        if tune_d[pick][key][0] >= tune_d[default][key][0] * (1 - a.margin):
            pick = default
        if key not in report_d[pick]:
            missing.append((key, f"picked {pick}, which has no REPORT result"))
            continue
        tuned, base = report_d[pick][key][1], report_d[default][key][1]
        counted += 1
        over_chunked += tune_d[pick][key][0] < tune_d[pick][key][2] * (1 - 0.03)
        if tp in (4, 8):
            t, b = per.setdefault(dt, ([], []))
            t.append(tuned)
            b.append(base)
        ms = " / ".join(f"{tune_d[n][key][0]:.3f}" if key in tune_d[n] else "-" for n in names)
        lines.append(f"| {op} | {dt} | {tp} | {shape} | {pick} | {tuned:.3f} | {base:.3f} | {ms} |")
    lines.append("")
    for dt, (t, b) in sorted(per.items()):
        g, gb = geomean(t), geomean(b)
        lines.append(f"- flags only, {dt}, tuned: fused <= 1.05x max(GEMM, link), geomean over tp 4 and 8 rows: "
                     f"{g:.3f} ({'met' if g <= 1.05 else 'missed'}; {len(t)} rows; the default candidate alone "
                     f"{gb:.3f})")
    lines.append(f"- fused over chunked: the picked fused candidate beat the chunked algorithm by the tuner's 3 % "
                 f"margin (TUNE set) on {over_chunked} of {counted} rows")
    for key, why in missing:
        lines.append(f"- LEFT OUT of the geomean: {' '.join(map(str, key))}: {why}")
    for path, key in sorted(wrong):
        lines.append(f"- WRONG: {' '.join(map(str, key))} in {path} (not used)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
