#!/usr/bin/env python3
"""Block-scaled FP8 (Float8BlockScaling) on one GPU, against bf16 and per-tensor FP8:

1. the seed training step (examples/pytorch/layer_with_overlap.py at tp 1, one process, its
   default size: 8192 tokens, hidden 4096, ffn 16384, bf16 parameters) in bf16, FP8 with
   per-tensor current scaling and FP8 with block scaling, each eager and with --cuda-graph:
   the mean step time and the final loss (the bar: block's final loss within 2 % of bf16's);
2. the GEMMs on the anchor shapes (tokens x K x N: 8192x8192x3584, 8192x4096x2048,
   16384x8192x1024), forward layout ``y = x W^T``: bf16 (torch), per-tensor FP8
   (torch._scaled_mm, split accumulation; fast accumulation, TE's forward default, beside
   it), block-scaled FP8 through the torch path
   (transformer_engine_comm.torch.fp8.block_gemm: the library's nvte_cublas_gemm on a 1D x
   and a 2D W, split accumulation); CUDA events around each call after a warm-up, the
   median; each GEMM's error against the fp32 product of the unquantized operands; the
   block casts' time (x 1D rowwise + columnwise, W 2D) beside it.

Prints a short table last and writes it (summary.md) and the example logs under --out.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ANCHORS = ((8192, 8192, 3584), (8192, 4096, 2048), (16384, 8192, 1024))
STEP_ROWS = (
    ("bf16", []),
    ("bf16 graph", ["--cuda-graph"]),
    ("fp8 current", ["--fp8", "--fp8-recipe", "current"]),
    ("fp8 current graph", ["--fp8", "--fp8-recipe", "current", "--cuda-graph"]),
    ("fp8 block", ["--fp8", "--fp8-recipe", "block"]),
    ("fp8 block graph", ["--fp8", "--fp8-recipe", "block", "--cuda-graph"]),
)
LOSS_BAR = 0.02


def step_rows(a, lines):
    """Run the example's rows -> {row: (step_ms, final_loss) or None}."""
    res = {}
    port = 29650
    for name, args in STEP_ROWS:
        port += 1
        log = os.path.join(a.out, "step_" + name.replace(" ", "_") + ".log")
        cmd = [sys.executable, os.path.join(ROOT, "examples", "pytorch", "layer_with_overlap.py"),
               "--iters", str(a.iters), "--warmup", str(a.warmup), "--log-every", "10"] + args
        t0 = time.time()
        env = dict(os.environ, MASTER_PORT=str(port))
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = open(log).read()
        m = re.search(r"^RESULT .*step_ms=([0-9.]+).*final_loss=([0-9.]+)", text, re.M)
        res[name] = (float(m.group(1)), float(m.group(2))) if (rc == 0 and m) else None
        print(f"step {name}: rc {rc} ({time.time() - t0:.0f} s) {m.group(0)[:160] if m else 'no RESULT line'}",
              flush=True)
        if res[name] is None:
            print("\n".join(text.splitlines()[-15:]), flush=True)
    lines += ["", "| step (tp 1, default size) | step ms | vs bf16 | final loss | loss vs bf16 |", "|---|---|---|---|---|"]
    for name, _ in STEP_ROWS:
        r = res[name]
        base = res["bf16 graph" if "graph" in name else "bf16"]
        if r is None:
            lines.append(f"| {name} | failed | | | |")
            continue
        sp = f"{r[0] / base[0]:.2f}x" if base else "-"
        dl = f"{(r[1] - base[1]) / base[1] * 100:+.2f} %" if base else "-"
        lines.append(f"| {name} | {r[0]:.2f} | {sp} | {r[1]:.6f} | {dl} |")
    ok = True
    for mode in ("", " graph"):
        b, f = res.get("bf16" + mode), res.get("fp8 block" + mode)
        if b and f:
            d = abs(f[1] - b[1]) / b[1]
            met = d <= LOSS_BAR
            ok &= met
            lines.append(f"bar: block final loss within 2 % of bf16 ({mode.strip() or 'eager'}): "
                         f"{'met' if met else 'missed'} ({d * 100:.2f} %)")
        else:
            ok = False
            lines.append(f"bar: block final loss within 2 % of bf16 ({mode.strip() or 'eager'}): no figures")
    return all(v is not None for v in res.values()), ok


def timed(fn, warmup, iters):
    import torch

    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def gemm_rows(a, lines):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "python"))
    from transformer_engine_comm.torch import fp8

    lib = fp8._library()
    block_lib = lib is not None and lib.has_block_gemm
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    bf = torch.bfloat16
    e4 = torch.float8_e4m3fn
    lines += ["", "| GEMM T x K x N | bf16 ms (TFLOP/s) | FP8 per-tensor ms (TFLOP/s) | per-tensor fast acc. ms | "
              "FP8 block ms (TFLOP/s) | block / per-tensor | err bf16 / pt / block | block casts ms (x 1D row+col, W 2D) |",
              "|---|---|---|---|---|---|---|---|"]
    for t, k, n in ANCHORS:
        g = torch.Generator(device=dev).manual_seed(t + k + n)
        x = torch.randn(t, k, device=dev, generator=g).to(bf)
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(bf)
        ref = x.float() @ w.float().t()
        flop = 2.0 * t * k * n

        def tf(ms):
            return f"{ms:.3f} ({flop / ms / 1e9:.0f})"

        def err(y):
            return ((y.float() - ref).norm() / ref.norm()).item()

        ms_bf = timed(lambda: x @ w.t(), a.gemm_warmup, a.gemm_iters)
        e_bf = err(x @ w.t())
        # per-tensor current scaling: one scale per tensor from its amax
        sx = (448.0 / x.abs().amax().float()).reshape(1)
        sw = (448.0 / w.abs().amax().float()).reshape(1)
        xq, wq = (x.float() * sx).to(e4), (w.float() * sw).to(e4)
        sxi, swi = sx.reciprocal(), sw.reciprocal()

        def pt(fast=False):
            return torch._scaled_mm(xq, wq.t(), scale_a=sxi, scale_b=swi, out_dtype=bf, use_fast_accum=fast)

        ms_pt = timed(pt, a.gemm_warmup, a.gemm_iters)  # split accumulation, as the block GEMM
        ms_ptf = timed(lambda: pt(True), a.gemm_warmup, a.gemm_iters)  # TE's forward default
        e_pt = err(pt())
        xb = fp8.quantize_block(x, 1, rowwise=True, columnwise=True)
        wb = fp8.quantize_block(w, 2, rowwise=True, columnwise=True)
        ms_cast = timed(lambda: (fp8.quantize_block(x, 1, rowwise=True, columnwise=True),
                                 fp8.quantize_block(w, 2, rowwise=True, columnwise=True)), 2, 10)
        if block_lib:
            def blk():
                return fp8.block_gemm(xb.rowwise(), wb.rowwise(), bf)

            ms_bl = timed(blk, a.gemm_warmup, a.gemm_iters)
            e_bl = err(blk())
            bl, ratio = tf(ms_bl), f"{ms_bl / ms_pt:.2f}x"
        else:
            e_bl = err(fp8.block_gemm(xb.rowwise(), wb.rowwise(), torch.float32, reference=True))
            bl, ratio = "no library block GEMM (emulated: not timed)", "-"
        lines.append(f"| {t}x{k}x{n} | {tf(ms_bf)} | {tf(ms_pt)} | {ms_ptf:.3f} | {bl} | {ratio} | "
                     f"{e_bf:.4f} / {e_pt:.4f} / {e_bl:.4f} | {ms_cast:.3f} |")
        print(lines[-1], flush=True)
        x = w = ref = xq = wq = xb = wb = None  # noqa: F841 (free the operands before the next shape)
        torch.cuda.empty_cache()
    return block_lib


def breakdown(a, lines):
    """The seed step's parts at the example's default size (tokens 8192, hidden 4096, ffn
    16384), block vs per-tensor current scaling: each GEMM (with the epilogue the modules
    fuse, and without) and each cast, CUDA events, median; then torch.profiler's top kernels
    of whole LayerNormMLP steps (forward + backward) under each recipe."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "python"))
    from transformer_engine_comm.torch import fp8
    from transformer_engine_comm.torch import modules as tm

    dev, bf, e4 = torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn
    T, H, F = 8192, 4096, 16384
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device=dev, generator=g) * scale).to(bf)

    x, w1, h, w2, dy, dh = rnd(T, H), rnd(F, H, scale=0.02), rnd(T, F), rnd(H, F, scale=0.02), rnd(T, H), rnd(T, F)
    b1, b2 = rnd(F), rnd(H)
    q = fp8.quantize_block
    xb, w1b, hb, w2b = q(x, 1, columnwise=True), q(w1, 2, columnwise=True), q(h, 1, columnwise=True), \
        q(w2, 2, columnwise=True)
    dyb, dhb = q(dy, 1, columnwise=True), q(dh, 1, columnwise=True)
    cur = fp8.Float8CurrentScaling(fp8.Format.E4M3)

    def pt(t):
        return fp8.Fp8Meta(cur, e4, dev).cast(t, rowwise=True, columnwise=True)

    xp, w1p, hp, w2p, dyp, dhp = (pt(t) for t in (x, w1, h, w2, dy, dh))
    G = fp8.block_gemm

    def smm(a_, asi, b_, bsi, bias=None):
        return torch._scaled_mm(a_, b_.t(), scale_a=asi, scale_b=bsi, bias=bias, out_dtype=bf, use_fast_accum=False)

    rows = [
        ("fc1 fprop +bias", lambda: G(xb.rowwise(), w1b.rowwise(), bf, bias=b1),
         lambda: smm(xp.data, xp.scale_inv, w1p.data, w1p.scale_inv, b1)),
        ("fc1 fprop", lambda: G(xb.rowwise(), w1b.rowwise(), bf),
         lambda: smm(xp.data, xp.scale_inv, w1p.data, w1p.scale_inv)),
        ("fc2 fprop +bias", lambda: G(hb.rowwise(), w2b.rowwise(), bf, bias=b2),
         lambda: smm(hp.data, hp.scale_inv, w2p.data, w2p.scale_inv, b2)),
        ("fc2 dgrad +dgelu", lambda: G(dyb.rowwise(), w2b.columnwise(), bf, dgelu_pre=h),
         lambda: smm(dyp.data, dyp.scale_inv, w2p.data_t, w2p.scale_inv)),
        ("fc2 dgrad", lambda: G(dyb.rowwise(), w2b.columnwise(), bf),
         lambda: smm(dyp.data, dyp.scale_inv, w2p.data_t, w2p.scale_inv)),
        ("fc2 wgrad (1Dx1D)", lambda: G(dyb.columnwise(), hb.columnwise(), bf),
         lambda: smm(dyp.data_t, dyp.scale_inv, hp.data_t, hp.scale_inv)),
        ("fc1 dgrad", lambda: G(dhb.rowwise(), w1b.columnwise(), bf),
         lambda: smm(dhp.data, dhp.scale_inv, w1p.data_t, w1p.scale_inv)),
        ("fc1 wgrad (1Dx1D)", lambda: G(dhb.columnwise(), xb.columnwise(), bf),
         lambda: smm(dhp.data_t, dhp.scale_inv, xp.data_t, xp.scale_inv)),
    ]
    for name, t, dim in (("x", x, 1), ("w1", w1, 2), ("h", h, 1), ("w2", w2, 2), ("dy", dy, 1), ("dh", dh, 1)):
        rows.append((f"cast {name} {tuple(t.shape)} row+col", (lambda t=t, dim=dim: q(t, dim, columnwise=True)),
                     (lambda t=t: pt(t))))
    lines += ["", "| step part (T 8192, H 4096, F 16384) | block ms | per-tensor current ms | block / pt |",
              "|---|---|---|---|"]
    for name, fb, fp in rows:
        mb, mp = timed(fb, 3, 20), timed(fp, 3, 20)
        lines.append(f"| {name} | {mb:.3f} | {mp:.3f} | {mb / mp:.2f}x |")
        print(lines[-1], flush=True)
    rows = xb = w1b = hb = w2b = dyb = dhb = xp = w1p = hp = w2p = dyp = dhp = None  # noqa: F841 (freed)
    torch.cuda.empty_cache()
    from torch.profiler import ProfilerActivity, profile

    for rname, r in (("block", fp8.Float8BlockScaling()), ("current", cur)):
        m = tm.LayerNormMLP(H, F, comm_overlap=False, fp8=True, fp8_recipe=r, params_dtype=bf, device=dev, seed=1)
        xi = rnd(T, H).requires_grad_(True)
        gy = rnd(T, H, scale=0.01)

        def step():
            m(xi, is_first_microbatch=True).backward(gy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        tot = sum(e.self_device_time_total for e in evs) / 3e3
        lines += ["", f"{rname}: GPU {tot:.3f} ms per LayerNormMLP step (forward + backward); top kernels (ms/step, calls/step):"]
        for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:14]:
            lines.append(f"  {e.self_device_time_total / 3e3:7.3f}  {e.count // 3:3d}  {e.key[:110]}")
        print("\n".join(lines[-15:]), flush=True)
        m = xi = None  # noqa: F841 (freed before the next recipe)
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the logs and summary.md")
    p.add_argument("--iters", type=int, default=30, help="timed steps per example row")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per example row")
    p.add_argument("--timeout", type=int, default=240, help="seconds per example run")
    p.add_argument("--gemm-iters", type=int, default=50)
    p.add_argument("--gemm-warmup", type=int, default=10)
    p.add_argument("--skip-step", action="store_true", help="only the GEMMs")
    p.add_argument("--skip-gemm", action="store_true", help="only the example's steps")
    p.add_argument("--breakdown", action="store_true",
                   help="also the step's GEMMs and casts, block vs per-tensor, and torch.profiler's top kernels")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    lines = ["# Block-scaled FP8 vs per-tensor FP8 vs bf16 (one GPU)"]
    ok = True
    if not a.skip_gemm:
        ok &= gemm_rows(a, lines)
    if a.breakdown:
        breakdown(a, lines)
    if not a.skip_step:
        ran, _bar = step_rows(a, lines)
        ok &= ran
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(text)
    print()
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
