#!/usr/bin/env python3
"""The parts of a LayerNormMLP training step, timed alone in one process on one GPU: the bar
that examples/pytorch/layer_with_overlap.py's step is held to (issue 21).

At the example's default size (8192 tokens = seq 2048 x batch 4, hidden 4096, ffn 16384,
bf16, tp 1) a step runs six GEMMs (with X the LayerNorm output [M, H], A the GELU output
[M, F], W1 [F, H], W2 [H, F], dY2 [M, H] the output gradient, dY1 [M, F] fc1's output
gradient):

    fc1 fwd    Y1  = X   . W1^T    [M, H] x [H, F]
    fc2 fwd    Y2  = A   . W2^T    [M, F] x [F, H]
    fc2 dgrad  dA  = dY2 . W2      [M, H] x [H, F]
    fc2 wgrad  dW2 = dY2^T . A     [H, M] x [M, F]
    fc1 dgrad  dX  = dY1 . W1      [M, F] x [F, H]
    fc1 wgrad  dW1 = dY1^T . X     [F, M] x [M, H]

and one optimizer step over the module's parameters (LayerNorm weight and bias, fc1 and
fc2 weights and biases). This script times, with CUDA events after a warm-up, the median
of ``--iters`` calls on random data:

- each GEMM alone in bf16 (torch.mm, the layouts above), their sum, and the six back to back;
- the optimizer step alone: the example's own optimizer (``make_optimizer`` of the example:
  Adam, fused on CUDA, through the library's host-lean LeanFusedAdam) on parameters of the
  module's shapes and dtype with random gradients; for comparison torch's own fused,
  foreach and for-loop Adam;
- the bar: (sum of the six bf16 GEMMs) + (optimizer step); the example's bf16 step should be
  <= 1.10x this;
- for reference, the same six GEMMs in FP8 (torch._scaled_mm; HYBRID: e4m3 activations and
  weights, e5m2 gradients; fast accumulation in the forward, split (full-precision)
  accumulation in the backward; the transposed FP8 copies a TN GEMM needs are made once,
  outside the timing), each checked against a float32 product of the same FP8 values.

Prints a markdown table (also written to ``--out``) and one machine-readable line:

    STEP_PARTS tokens=.. hidden=.. ffn=.. gemm_bf16_ms=.. gemm_bf16_seq_ms=.. adam_ms=..
        bar_ms=.. gemm_fp8_ms=.. gemm_fp8_seq_ms=.. bar_fp8_ms=.. adam_foreach_ms=..
        adam_forloop_ms=..

Usage: PYTHONPATH=python python3 bench/step_parts.py [--tokens 8192] [--hidden 4096]
       [--ffn 16384] [--iters 50] [--warmup 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch", "layer_with_overlap.py")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_DEVICE = [torch.device("cpu")]


def load_example():
    """The example as a module (for its make_optimizer: the very optimizer it trains with)."""
    spec = importlib.util.spec_from_file_location("te_comm_example_layer_with_overlap", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median over ``iters`` calls of the CUDA-event time of one call (after ``warmup``);
    on the CPU (smoke runs) the host clock."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available() or _DEVICE[0].type != "cuda":
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - r).norm() / r.norm()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="M: seq x batch (the example's 2048 x 4)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-4, help="the example's default learning rate")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of the script itself at a small size (host clock; no figure to keep)")
    opts = p.parse_args(argv)
    if opts.device == "cuda":
        if not torch.cuda.is_available():
            print("step_parts.py: CUDA is not available (--device cpu for a smoke run)", file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    _DEVICE[0] = dev
    M, H, F = opts.tokens, opts.hidden, opts.ffn
    torch.manual_seed(opts.seed)
    bf = torch.bfloat16

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, device=dev, dtype=torch.float32).mul_(std).to(bf)

    X, A = rnd(M, H), rnd(M, F)
    W1, W2 = rnd(F, H, std=0.02), rnd(H, F, std=0.02)
    dY2, dY1 = rnd(M, H, std=1e-2), rnd(M, F, std=1e-2)
    gemms_bf16: Dict[str, Callable[[], torch.Tensor]] = {
        "fc1 fwd": lambda: torch.mm(X, W1.t()),
        "fc2 fwd": lambda: torch.mm(A, W2.t()),
        "fc2 dgrad": lambda: torch.mm(dY2, W2),
        "fc2 wgrad": lambda: torch.mm(dY2.t(), A),
        "fc1 dgrad": lambda: torch.mm(dY1, W1),
        "fc1 wgrad": lambda: torch.mm(dY1.t(), X),
    }
    shapes = {  # (m, k, n) of each product
        "fc1 fwd": (M, H, F), "fc2 fwd": (M, F, H), "fc2 dgrad": (M, H, F),
        "fc2 wgrad": (H, M, F), "fc1 dgrad": (M, F, H), "fc1 wgrad": (F, M, H),
    }

    # FP8 operands: per-tensor scale 1 (the random data lies well inside both formats), and
    # the transposed copies (row-major) that torch._scaled_mm's TN layout needs.
    def q(t, dt):
        return t.to(dt)

    Xq, Aq, W1q, W2q = q(X, E4M3), q(A, E4M3), q(W1, E4M3), q(W2, E4M3)
    dY2q, dY1q = q(dY2, E5M2), q(dY1, E5M2)
    XTq, ATq = q(X.t().contiguous(), E4M3), q(A.t().contiguous(), E4M3)
    W1Tq, W2Tq = q(W1.t().contiguous(), E4M3), q(W2.t().contiguous(), E4M3)
    dY2Tq, dY1Tq = q(dY2.t().contiguous(), E5M2), q(dY1.t().contiguous(), E5M2)
    one = torch.ones((), device=dev, dtype=torch.float32)

    def smm(a, b, fast):
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=bf, use_fast_accum=fast)

    fp8_operands = {  # (a row-major, b column-major, fast accumulation)
        "fc1 fwd": (Xq, W1q.t(), True),
        "fc2 fwd": (Aq, W2q.t(), True),
        "fc2 dgrad": (dY2q, W2Tq.t(), False),
        "fc2 wgrad": (dY2Tq, ATq.t(), False),
        "fc1 dgrad": (dY1q, W1Tq.t(), False),
        "fc1 wgrad": (dY1Tq, XTq.t(), False),
    }
    gemms_fp8 = {k: (lambda a=a, b=b, f=f: smm(a, b, f)) for k, (a, b, f) in fp8_operands.items()}

    # Correctness first: each bf16 GEMM against float32 of the same bf16 values, each FP8
    # GEMM against float32 of the same FP8 values (layouts and operands right).
    errors = {}
    for k in gemms_bf16:
        a, b, _ = fp8_operands[k]
        ref8 = torch.mm(a.float(), b.float())
        errors[k] = (None, rel_err(gemms_fp8[k](), ref8))
        del ref8
    refs_bf16 = {
        "fc1 fwd": (X, W1.t()), "fc2 fwd": (A, W2.t()), "fc2 dgrad": (dY2, W2),
        "fc2 wgrad": (dY2.t(), A), "fc1 dgrad": (dY1, W1), "fc1 wgrad": (dY1.t(), X),
    }
    for k, (a, b) in refs_bf16.items():
        e = rel_err(gemms_bf16[k](), torch.mm(a.float(), b.float()))
        errors[k] = (e, errors[k][1])
    bad = [f"{k}: bf16 {e16:.2e}, fp8 {e8:.2e}" for k, (e16, e8) in errors.items() if not (e16 < 1e-2 and e8 < 1e-2)]
    if bad:
        print("step_parts.py: a GEMM disagrees with its float32 reference: " + "; ".join(bad), file=sys.stderr)
        return 1

    t_bf16 = {k: time_ms(f, opts.warmup, opts.iters) for k, f in gemms_bf16.items()}
    t_fp8 = {k: time_ms(f, opts.warmup, opts.iters) for k, f in gemms_fp8.items()}
    seq_bf16 = time_ms(lambda: [f() for f in gemms_bf16.values()], opts.warmup, opts.iters)
    seq_fp8 = time_ms(lambda: [f() for f in gemms_fp8.values()], opts.warmup, opts.iters)
    del gemms_bf16, gemms_fp8, fp8_operands, refs_bf16
    del X, A, W1, W2, dY2, dY1, Xq, Aq, W1q, W2q, dY2q, dY1q, XTq, ATq, W1Tq, W2Tq, dY2Tq, dY1Tq
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # The optimizer step over LayerNormMLP's parameters at tp 1 (shapes and dtype of the
    # module: bf16 parameters, so bf16 Adam states), with random gradients.
    example = load_example()
    pshapes = [(H,), (H,), (F, H), (F,), (H, F), (H,)]

    def make_params():
        ps = [torch.nn.Parameter(rnd(*s, std=0.02)) for s in pshapes]
        for p_ in ps:
            p_.grad = rnd(*p_.shape, std=1e-3)
        return ps

    adam = {}
    ps = make_params()
    opt = example.make_optimizer(ps, opts.lr, dev)
    adam["example"] = (time_ms(opt.step, opts.warmup, opts.iters), describe(opt))
    for name, kw in (("torch fused", dict(fused=True)), ("foreach", dict(foreach=True)),
                     ("for-loop", dict(foreach=False))):
        ps = make_params()
        o = torch.optim.Adam(ps, lr=opts.lr, **kw)
        adam[name] = (time_ms(o.step, opts.warmup, opts.iters), describe(o))
    del ps, opt, o

    sum_bf16, sum_fp8 = sum(t_bf16.values()), sum(t_fp8.values())
    t_adam = adam["example"][0]
    bar, bar_fp8 = sum_bf16 + t_adam, sum_fp8 + t_adam

    def tflops(k, ms):
        m, kk, n = shapes[k]
        return 2.0 * m * kk * n / (ms * 1e-3) / 1e12

    lines: List[str] = [
        f"Step parts on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU (smoke run)'} (torch {torch.__version__}): tokens {M}, hidden {H}, "
        f"ffn {F}; median of {opts.iters} calls after {opts.warmup} warm-up, "
        f"{'CUDA events' if dev.type == 'cuda' else 'host clock'}, random data",
        "",
        "| part | m x k x n | bf16 ms | bf16 TFLOP/s | FP8 ms | FP8 TFLOP/s | rel. err bf16 / FP8 |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in t_bf16:
        m, kk, n = shapes[k]
        lines.append(
            f"| {k} | {m} x {kk} x {n} | {t_bf16[k]:.3f} | {tflops(k, t_bf16[k]):.0f} | {t_fp8[k]:.3f} | "
            f"{tflops(k, t_fp8[k]):.0f} | {errors[k][0]:.1e} / {errors[k][1]:.1e} |"
        )
    lines += [
        f"| six GEMMs, sum | | {sum_bf16:.3f} | | {sum_fp8:.3f} | | |",
        f"| six GEMMs, back to back | | {seq_bf16:.3f} | | {seq_fp8:.3f} | | |",
        f"| optimizer step: the example's ({adam['example'][1]}) | | {t_adam:.3f} | | | | |",
        f"| optimizer step: torch's {adam['torch fused'][1]} (comparison) | | {adam['torch fused'][0]:.3f} | | | | |",
        f"| optimizer step: {adam['foreach'][1]} (comparison) | | {adam['foreach'][0]:.3f} | | | | |",
        f"| optimizer step: {adam['for-loop'][1]} (comparison) | | {adam['for-loop'][0]:.3f} | | | | |",
        f"| **bar: six GEMMs + optimizer** | | **{bar:.3f}** | | {bar_fp8:.3f} | | |",
    ]
    fastest = min(adam, key=lambda n: adam[n][0])
    lines.append("")
    lines.append(
        f"The example's optimizer ({adam['example'][1]}) is "
        + ("the fastest." if fastest == "example"
           else f"NOT the fastest: {adam[fastest][1]} takes {adam[fastest][0]:.3f} ms against {t_adam:.3f} ms.")
    )
    table = "\n".join(lines)
    print(table)
    if opts.out:
        with open(opts.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    print(
        f"STEP_PARTS tokens={M} hidden={H} ffn={F} gemm_bf16_ms={sum_bf16:.4f} gemm_bf16_seq_ms={seq_bf16:.4f} "
        f"adam_ms={t_adam:.4f} bar_ms={bar:.4f} gemm_fp8_ms={sum_fp8:.4f} gemm_fp8_seq_ms={seq_fp8:.4f} "
        f"bar_fp8_ms={bar_fp8:.4f} adam_foreach_ms={adam['foreach'][0]:.4f} "
        f"adam_forloop_ms={adam['for-loop'][0]:.4f} adam_torch_fused_ms={adam['torch fused'][0]:.4f} adam_fastest={'example' if fastest == 'example' else fastest.replace(' ', '_')}",
        flush=True,
    )
    return 0


def describe(opt: torch.optim.Optimizer) -> str:
    d = opt.defaults
    how = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop" if d.get("foreach") is False else "default"
    return f"{type(opt).__name__} {how}"


if __name__ == "__main__":
    sys.exit(main())
