"""Bandwidth of the library's quantization kernels on one GPU (torch tensors, CUDA events).

For 64M elements (default; --numel): quantize bf16 -> e4m3 rowwise, rowwise + columnwise
(one kernel), compute_amax, transpose (bf16), dequantize (e4m3 -> bf16), and torch's
unfused equivalents (abs/amax/float/multiply/clamp/cast; .t().contiguous()). Each timing:
warm-up, then the median of --iters runs (the copy and the three barred kernels: the median
of --bar-rounds interleaved rounds of that), each between its own pair of events, rotating
over several input buffers so that no run reads what the previous one left in L2. GB/s
count the bytes each operation must move (inputs read once, outputs written once), and
are given against the device's nominal HBM bandwidth (--nominal; by default from the device
name: H100 SXM 3352 GB/s, H100 NVL 3938, H100 PCIe 2039, H200 4800; another device, GH200
included, needs --nominal) and a measured device-to-device copy. Then the host cost (microseconds of Python and library
enqueue per call: Fp8Meta.cast under both recipes, and single library calls, on a small
tensor). Last line: PASS/FAIL for the bar (>= 80 % of nominal for quantize rowwise,
rowwise + columnwise, and amax).

The cast + transpose kernel (NVTE_COMM_CAST_TRANSPOSE, read by the library at each call):
the barred "rowwise+columnwise" row runs the environment's choice (unset: v3); --ct-variants (default
"v2,v1"; "all": every value) adds a table of each kernel, timed in --ct-rounds interleaved
rounds (median of the rounds' medians, and the best round), so that old and new are
compared in one process on the same buffers."""
import argparse
import os
import statistics
import sys
import time

import torch

from transformer_engine_comm.torch import fp8


# Every value of NVTE_COMM_CAST_TRANSPOSE (src/kernels.rs, whose unit test checks this list):
# v3 (default), v2, v1 (the previous kernel), the bench variants of v2 and v3 (bf16 -> e4m3 only).
CT_ALL = ["v3", "v2", "v1", "v2-np", "v2-tr64", "v2-tr64-np", "v2-tr64-g16", "v2-g16", "v2-cs", "v2-g32-cs",
          "v2-pf0", "v2-m4-np", "v3-r256c128", "v3-r256c64-m4", "v3-r256c64-bs-m4", "v3-r512c64",
          "v3-r512c64-bs", "v3-nohint", "v3-cs", "v3-ef"]


def timed(fn, iters, warmup=10):
    for _ in range(warmup):
        fn(0)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(i)
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e-3  # seconds


# Nominal HBM bandwidth (GB/s) by a part of the device name, the most specific first (None:
# several memory configurations share the name: --nominal needed).
NOMINAL_GBS = (("GH200", None), ("H200", 4800.0), ("H100 NVL", 3938.0), ("H100 PCIe", 2039.0), ("H100", 3352.0))


def nominal_gbs(name: str) -> float:
    for part, gbs in NOMINAL_GBS:
        if part in name:
            if gbs is None:
                break
            return gbs
    raise SystemExit(f"quantize_bench: no nominal HBM bandwidth known for {name!r}: pass --nominal GB/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--nominal", type=float, default=None,
                    help="nominal HBM GB/s (default: by device name, see NOMINAL_GBS)")
    ap.add_argument("--bar", type=float, default=0.80)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--ct-variants", default="v2,v1",
                    help="cast + transpose kernels to compare (NVTE_COMM_CAST_TRANSPOSE values; 'all')")
    ap.add_argument("--ct-rounds", type=int, default=5)
    ap.add_argument("--bar-rounds", type=int, default=5,
                    help="interleaved rounds of the copy and the barred kernels (median of the rounds' medians)")
    a = ap.parse_args()
    ct_variants = CT_ALL if a.ct_variants == "all" else [v for v in a.ct_variants.split(",") if v]
    assert fp8._library() is not None, "library backend not available"
    dev = torch.device("cuda", 0)
    if a.nominal is None:
        a.nominal = nominal_gbs(torch.cuda.get_device_name(dev))
    rows = a.numel // a.cols
    n = rows * a.cols
    nbuf = 3  # rotate: 3 x 128 MB inputs >> L2
    xs = [torch.randn(rows, a.cols, device=dev, dtype=torch.bfloat16) for _ in range(nbuf)]
    e4 = torch.float8_e4m3fn
    scale = torch.tensor([3.0], device=dev)
    amax = torch.zeros(1, device=dev)
    sinv = torch.empty(1, device=dev)
    qs = [fp8.quantize(x, e4, scale)[0] for x in xs]
    lib = fp8._library()
    # Preallocated outputs for the library calls would save the allocator's time, but the
    # caching allocator's reuse costs ~nothing on the device; torch's path allocates too.
    cases = []

    def case(name, nbytes, fn, barred=False):
        t = timed(fn, a.iters)
        cases.append((name, nbytes, t, barred))

    copy_dst = torch.empty_like(xs[0])
    # The copy and the barred kernels: --bar-rounds interleaved rounds of --iters runs each,
    # the median of the rounds' medians (single medians move by about 1.5 % between runs).
    rounded = [
        ("D2D copy (torch, bf16)", 2 * n * 2, lambda i: copy_dst.copy_(xs[i % nbuf]), False),
        ("quantize bf16->e4m3 rowwise", n * 3,
         lambda i: lib.quantize(xs[i % nbuf], e4, scale, amax, sinv, True, False), True),
        ("quantize bf16->e4m3 rowwise+columnwise", n * 4,
         lambda i: lib.quantize(xs[i % nbuf], e4, scale, amax, sinv, True, True), True),
        ("compute_amax bf16", n * 2, lambda i: lib.compute_amax(xs[i % nbuf], amax), True),
    ]
    round_times = [[] for _ in rounded]
    for _ in range(max(a.bar_rounds, 1)):
        for j, (_, _, fn, _) in enumerate(rounded):
            round_times[j].append(timed(fn, a.iters))
    for (name, nbytes, _, barred), ts in zip(rounded, round_times):
        cases.append((name, nbytes, statistics.median(ts), barred))
    copy_gbs = 2 * n * 2 / cases[0][2] / 1e9
    case("current scaling: amax + scale + quantize", n * 5,
         lambda i: (lib.compute_amax(xs[i % nbuf], amax), lib.compute_scale_from_amax(amax, e4, scale, 0.0, False),
                    lib.quantize(xs[i % nbuf], e4, scale, None, sinv, True, True)))
    case("transpose bf16", n * 4, lambda i: lib.transpose(xs[i % nbuf]))
    case("transpose e4m3", n * 2, lambda i: lib.transpose(qs[i % nbuf]))
    case("dequantize e4m3->bf16", n * 3, lambda i: lib.dequantize(qs[i % nbuf], sinv, torch.bfloat16))

    def torch_quant(i, columnwise):
        x = xs[i % nbuf]
        am = x.abs().amax().float()
        torch.maximum(amax, am, out=amax)
        q = (x.float() * scale).clamp(-448.0, 448.0).to(e4)
        return q.t().contiguous() if columnwise else q

    case("torch unfused quantize rowwise", n * 3, lambda i: torch_quant(i, False))
    case("torch unfused quantize rowwise+columnwise", n * 4, lambda i: torch_quant(i, True))
    case("torch amax", n * 2, lambda i: xs[i % nbuf].abs().amax())
    case("torch transpose bf16", n * 4, lambda i: xs[i % nbuf].t().contiguous())

    # Host cost: microseconds of Python + library enqueue per call (a small tensor, so that
    # the GPU keeps up and the host time is what is measured), the mean over many calls.
    def host_us(fn, calls=300):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / calls * 1e6

    small = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    host = []
    for rname, recipe in (("current", fp8.Float8CurrentScaling()), ("delayed", fp8.DelayedScaling())):
        meta = fp8.Fp8Meta(recipe, e4, dev)
        host.append((f"Fp8Meta.cast ({rname} scaling, rowwise+columnwise)",
                     host_us(lambda: meta.cast(small, columnwise=True))))
    host.append(("quantize (library call, rowwise+columnwise)",
                 host_us(lambda: lib.quantize(small, e4, scale, amax, sinv, True, True))))
    host.append(("compute_amax (library call)", host_us(lambda: lib.compute_amax(small, amax))))

    # Cast + transpose kernels compared, interleaved rounds (each: every variant in turn).
    ct = {v: [] for v in ct_variants}
    saved = os.environ.get("NVTE_COMM_CAST_TRANSPOSE")
    try:
        for _ in range(a.ct_rounds):
            for v in ct_variants:
                os.environ["NVTE_COMM_CAST_TRANSPOSE"] = v
                ct[v].append(timed(lambda i: lib.quantize(xs[i % nbuf], e4, scale, amax, sinv, True, True), a.iters))
    finally:
        if saved is None:
            os.environ.pop("NVTE_COMM_CAST_TRANSPOSE", None)
        else:
            os.environ["NVTE_COMM_CAST_TRANSPOSE"] = saved

    lines = [f"device: {torch.cuda.get_device_name(dev)} (nominal HBM {a.nominal:.0f} GB/s; the D2D copy reaches "
             f"{100 * copy_gbs / a.nominal:.1f} % of it); {n} elements ([{rows}, {a.cols}]), median of {a.iters} "
             f"(the copy and the barred rows: median of {max(a.bar_rounds, 1)} interleaved rounds' medians)",
             "", "| operation | us | GB/s | % nominal | % D2D copy |", "|---|---:|---:|---:|---:|"]
    ok = True
    for name, nbytes, t, barred in cases:
        gbs = nbytes / t / 1e9
        pn, pc = 100 * gbs / a.nominal, 100 * gbs / copy_gbs
        mark = ""
        if barred:
            passed = gbs >= a.bar * a.nominal
            ok &= passed
            mark = " (bar: PASS)" if passed else " (bar: FAIL)"
        lines.append(f"| {name}{mark} | {t * 1e6:.1f} | {gbs:.0f} | {pn:.1f} | {pc:.1f} |")
    if ct:
        lines += ["", f"cast + transpose bf16->e4m3 by kernel (NVTE_COMM_CAST_TRANSPOSE; {a.ct_rounds} interleaved "
                      f"rounds of {a.iters}; bar {100 * a.bar:.0f}% = {4 * n / (a.bar * a.nominal * 1e9) * 1e6:.1f} us)",
                  "", "| kernel | us (median of rounds) | us (best round) | % nominal | % D2D copy | vs v1 |",
                  "|---|---:|---:|---:|---:|---:|"]
        base = statistics.median(ct["v1"]) if "v1" in ct else None
        for v, ts in ct.items():
            t = statistics.median(ts)
            gbs = 4 * n / t / 1e9
            rel = f"{base / t:.3f}x" if base else "-"
            lines.append(f"| {v} | {t * 1e6:.1f} | {min(ts) * 1e6:.1f} | {100 * gbs / a.nominal:.1f} | "
                         f"{100 * gbs / copy_gbs:.1f} | {rel} |")
    lines += ["", "| host cost per call ([256, 1024] bf16) | us |", "|---|---:|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in host]
    verdict = f"quantize bar (>= {100 * a.bar:.0f}% of {a.nominal:.0f} GB/s for rowwise, rowwise+columnwise, amax): " \
              + ("PASS" if ok else "FAIL")
    lines += ["", verdict]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
