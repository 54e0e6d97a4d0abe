#!/usr/bin/env python3
"""Host cost of the FP8 casts of the torch modules (one process, one GPU, no process group).

    python3 bench/fp8_cast_host.py [--calls 1000] [--batches 7] [--size 256] [--out FILE]

Host µs per call of each row: the wall clock of N calls issued back to back (no
synchronization between them) after a warm-up, divided by N; the median over batches (each
batch ends with a device synchronize, not timed). The input is a bf16 [size, size] tensor,
small enough that the GPU work of a call is shorter than its host work, so the host is what
is measured. Rows:
  Fp8Meta.cast, <recipe>, rowwise / rowwise + columnwise, <how>   a module's cast (delayed,
                        current): what the forward and backward of a layer call per tensor;
                        "one packed call" (nvte_comm_cast_packed, the default) against
                        "separate calls" (the primitives, one foreign call each, plus the
                        packed path's early checks: about a µs), in one process
  quantize / compute_amax / compute_scale_from_amax / delayed_scaling_update   the
                        primitives alone (transformer_engine_comm.torch.fp8)
  torch.empty(1) / torch.empty(size, size)   the allocations a cast makes, for reference
  a kernel launch (torch.Tensor.zero_ of one float)   for reference
"""
import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
from transformer_engine_comm.torch import fp8 as F  # noqa: E402
from host_cost import per_call_us  # noqa: E402  (this folder's: the same timing loop)


def rows(size: int):
    dev = torch.device("cuda")
    x = torch.randn(size, size, device=dev).to(torch.bfloat16)
    e4m3 = torch.float8_e4m3fn
    backend = F._library()
    packed = backend.cast_packed if backend is not None else None
    for name, recipe in (("delayed", F.DelayedScaling()), ("current", F.Float8CurrentScaling())):
        for how in ("one packed call", "separate calls"):
            meta = F.Fp8Meta(recipe, e4m3, dev)
            meta.cast(x)  # primes delayed scaling (its first cast takes an extra amax pass)
            if packed is None and how == "one packed call":
                continue  # a library without nvte_comm_cast_packed

            def cast(m=meta, cols=False, off=how == "separate calls"):
                if off:  # the primitives, one foreign call each (as without nvte_comm_cast_packed)
                    backend.cast_packed = None
                    m._plan = None  # (the priming cast above made one)
                    try:
                        return m.cast(x, columnwise=cols)
                    finally:
                        backend.cast_packed = packed
                return m.cast(x, columnwise=cols)

            yield f"Fp8Meta.cast, {name}, rowwise, {how}", cast
            yield f"Fp8Meta.cast, {name}, rowwise + columnwise, {how}", lambda c=cast: c(cols=True)
    scale = torch.ones(1, device=dev)
    amax = torch.zeros(1, device=dev)
    sinv = torch.empty(1, device=dev)
    hist = torch.zeros(1024, device=dev)
    yield "quantize (amax and scale_inv)", lambda: F.quantize(x, e4m3, scale, amax=amax, scale_inv=sinv)
    yield "compute_amax", lambda: F.compute_amax(x, amax)
    yield "compute_scale_from_amax", lambda: F.compute_scale_from_amax(amax, e4m3, scale)
    yield "delayed_scaling_update", lambda: F.delayed_scaling_update(hist, scale, e4m3)
    yield "torch.empty(1)", lambda: torch.empty(1, device=dev)
    yield f"torch.empty({size}, {size})", lambda: torch.empty(size, size, dtype=e4m3, device=dev)
    yield "a kernel launch (zero_ of one float)", lambda: sinv.zero_()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--out", default=None, help="also write the table to FILE")
    opts = p.parse_args()
    if not torch.cuda.is_available():
        print("fp8_cast_host: no CUDA device: nothing measured (skipped)")
        return 0
    lines = [f"fp8_cast_host: {torch.cuda.get_device_name()}, bf16 [{opts.size}, {opts.size}], "
             f"median of {opts.batches} batches of {opts.calls} calls",
             "", "| row | host us / call |", "|---|---:|"]
    for name, fn in rows(opts.size):
        lines.append(f"| {name} | {per_call_us(fn, opts.calls, opts.batches)[0]:.1f} |")
    text = "\n".join(lines)
    print(text)
    if opts.out:
        with open(opts.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
