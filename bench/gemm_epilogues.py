#!/usr/bin/env python3
"""The LayerNormMLP step's GEMMs with TE's fused epilogues (library: nvte_cublas_gemm through
transformer_engine_comm.torch.gemm) against the unfused torch ops they replace, one GPU, one
process, bf16, the seed example's size (8192 tokens, hidden 4096, ffn 16384 by default).

Rows (each: torch ms, library ms, ratio, relative error of the library result vs torch's):
- fc1 fwd: ``F.linear(x, W1, b1)`` + ``gelu``  vs  GEMM with GELU_AUX_BIAS (out + pre-activation)
- fc2 dgrad: ``dY @ W2`` + ``gelu_backward`` + ``sum(0)``  vs  NN GEMM with DGELU_BGRAD
- fc2 wgrad: ``dY.T @ H`` + ``dY.sum(0)``  vs  NT GEMM with BGRADB
- fc1 dgrad (NN) / fc1 wgrad (NT) / fc2 fwd (TN + bias): plain GEMMs, library vs torch
CUDA events, warm-up, median of interleaved rounds, random data, outputs poisoned first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from transformer_engine_comm.torch.gemm import gemm  # noqa: E402


def timed(fn, reps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    o = p.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    T, H, FF = o.tokens, o.hidden, o.ffn
    g = torch.Generator(device=dev).manual_seed(5)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device=dev, dtype=torch.float32, generator=g) * scale).to(bf)

    x, w1, b1 = rnd(T, H), rnd(FF, H, scale=0.02), rnd(FF, scale=0.1)
    w2, b2 = rnd(H, FF, scale=0.02), rnd(H, scale=0.1)
    dy = rnd(T, H, scale=1e-3)
    pre = F.linear(x, w1, b1)
    h = F.gelu(pre, approximate="tanh")

    def poison(t):
        return t.fill_(float("nan"))

    rows = []

    def case(name, torch_fn, lib_fn, compare):
        ref = torch_fn()
        got = lib_fn()
        torch.cuda.synchronize()
        errs = [rel(a, b) for a, b in compare(got, ref)]
        torch_fn(), lib_fn()
        tt, tl = [], []
        for _ in range(o.rounds):
            tt.append(timed(torch_fn, o.reps))
            tl.append(timed(lib_fn, o.reps))
        a, b = statistics.median(tt), statistics.median(tl)
        rows.append((name, a, b, b / a, max(errs)))

    # fc1 forward: linear + bias + GELU, pre-activation kept.
    out1 = poison(torch.empty(T, FF, device=dev, dtype=bf))
    case(
        "fc1 fwd: linear+bias+gelu (GELU_AUX_BIAS)",
        lambda: (lambda y: (F.gelu(y, approximate="tanh"), y))(F.linear(x, w1, b1)),
        lambda: gemm(w1, x, transa=True, transb=False, bias=b1, gelu=True, out=out1),
        lambda got, ref: [(got[0], ref[0]), (got[1], ref[1])],
    )
    # fc2 dgrad with fc1's GELU backward and fc1's bias gradient.
    db1 = torch.empty(FF, device=dev, dtype=bf)
    dpre = poison(torch.empty(T, FF, device=dev, dtype=bf))

    def torch_dgrad():
        dh = dy @ w2
        d = torch.ops.aten.gelu_backward(dh, pre, approximate="tanh")
        return d, d.sum(0)

    case(
        "fc2 dgrad + gelu bwd + fc1 bias grad (DGELU_BGRAD, NN)",
        torch_dgrad,
        lambda: (gemm(w2, dy, transa=False, transb=False, dgelu_pre=pre, bias_grad=db1, out=dpre), db1),
        lambda got, ref: [(got[0], ref[0]), (got[1], ref[1])],
    )
    # fc2 wgrad with fc2's bias gradient.
    db2 = torch.empty(H, device=dev, dtype=bf)
    dw2 = poison(torch.empty(H, FF, device=dev, dtype=bf))
    case(
        "fc2 wgrad + bias grad (BGRADB, NT)",
        lambda: (dy.t() @ h, dy.sum(0)),
        lambda: (gemm(h, dy, transa=False, transb=True, bias_grad=db2, out=dw2), db2),
        lambda got, ref: [(got[0], ref[0]), (got[1], ref[1])],
    )
    dp = rnd(T, FF, scale=1e-3)
    case("fc1 dgrad (NN)", lambda: dp @ w1, lambda: gemm(w1, dp, transa=False, transb=False),
         lambda got, ref: [(got, ref)])
    case("fc1 wgrad (NT)", lambda: dp.t() @ x, lambda: gemm(x, dp, transa=False, transb=True),
         lambda got, ref: [(got, ref)])
    case("fc2 fwd (TN + bias)", lambda: F.linear(h, w2, b2), lambda: gemm(w2, h, transa=True, transb=False, bias=b2),
         lambda got, ref: [(got, ref)])

    name = torch.cuda.get_device_name()
    lines = [
        f"GEMM epilogues on {name}: tokens {T}, hidden {H}, ffn {FF}, bf16; median of {o.rounds} interleaved "
        f"rounds of {o.reps} calls, CUDA events",
        "",
        "| case | torch (unfused) ms | library (fused) ms | library / torch | rel. err vs torch |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.1e} |")
    tot_t, tot_l = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"| all six | {tot_t:.3f} | {tot_l:.3f} | {tot_l / tot_t:.3f} | |")
    text = "\n".join(lines)
    print(text)
    if o.out:
        with open(o.out, "w") as f:
            f.write(text + "\n")
    bad = [r for r in rows if not r[4] < 2e-2]
    if bad:
        print("FAIL: relative error above 2e-2 in", [r[0] for r in bad])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
