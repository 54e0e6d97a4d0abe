#!/usr/bin/env python3
"""Host cost of the torch ops, back to back, at tp 1 (one process, one GPU).

    python3 bench/host_cost.py [--calls 2000] [--batches 7] [--sizes 256,4096] [--out FILE]

Per size (bf16, m = n = k = size; TN), host µs per call: the wall clock of N calls issued
back to back (no synchronization between them) after a warm-up, divided by N; the median
over batches (each batch ends with a device synchronize, not timed). Rows:
  all_gather_gemm / gemm_reduce_scatter / gemm_all_reduce   the public ops (eager direct path)
  <op> C call alone   the library's call alone through ctypes: nvte_comm_gemm_call_packed
                      with its argument struct prepared (pointers of preallocated tensors)
  torch.mm            the local GEMM of the same size
  torch.mm + NCCL all_reduce   mm, then dist.all_reduce of its output (a 1-rank NCCL group)
At 256³ the GPU work of one call (a few µs) is shorter than the host's, so the host is
measured; at 4096³ the GPU is the bottleneck (the launch queue fills and the host waits):
those rows are for reference only. The closing line compares the public ops at 256³ with
the bar (40 µs): `host_cost: PASS` / `FAIL`, and the exit status is 1 on FAIL.

Two ranks sharing one GPU: NCCL refuses two ranks on one device, and the torch binding
builds its contexts on a ProcessGroupNCCL communicator only (get_context), so this script
cannot run that case; the C benchmark (tests_c/bench_host) covers it with the library's
IPC transport and callback bootstrap. The output says so.
"""
import argparse
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402  (before the library: it binds the NCCL torch has loaded)
import torch.distributed as dist  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAR_US = 40.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init():
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if int(os.environ["WORLD_SIZE"]) != 1:
        sys.exit("host_cost.py measures tp 1: run it as one process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    return dist.group.WORLD


def per_call_us(fn, calls, batches):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / calls * 1e6)
    return statistics.median(out), min(out), max(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--sizes", default="256,4096")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        import transformer_engine_comm.torch as tec
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "python"))
        import transformer_engine_comm.torch as tec
    from transformer_engine_comm.torch import ops as te_ops

    g = init()
    dev = torch.device("cuda", 0)
    rows = []
    verdicts = []
    for size in (int(s) for s in a.sizes.split(",")):
        x = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        w = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        ops = {
            "all_gather_gemm": lambda: tec.all_gather_gemm(x, w, group=g),
            "gemm_reduce_scatter": lambda: tec.gemm_reduce_scatter(x, w, group=g),
            "gemm_all_reduce": lambda: tec.gemm_all_reduce(x, w, group=g),
        }
        for name, fn in ops.items():
            ref = x.float() @ w.float().T
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"{name} {size}: rel. error {err:.3g} against torch: FAIL")
                verdicts.append(False)
            med, lo, hi = per_call_us(fn, a.calls, a.batches)
            rows.append((size, name, med, lo, hi))
            if size == 256:
                verdicts.append(med <= BAR_US)
            # The same op's C call alone: its prepared call, pointers of preallocated tensors.
            pr = next(p for k, p in te_ops._fast.items() if k[0] == {"all_gather_gemm": "ag",
                      "gemm_reduce_scatter": "rs", "gemm_all_reduce": "ar"}[name] and k[-5][0] == x.shape)
            out = torch.empty(pr.out_shape, dtype=pr.out_dtype, device=dev)
            pr.pa.data, pr.pb.data, pr.pd.data = w.data_ptr(), x.data_ptr(), out.data_ptr()
            pr.args.stream = torch.cuda.current_stream().cuda_stream
            cfn, ch, cp = pr.fn, pr.ctx_h, pr.ptr

            def c_call():
                if cfn(ch, cp):
                    raise RuntimeError("the C call failed")

            med, lo, hi = per_call_us(c_call, a.calls, a.batches)
            rows.append((size, f"{name} C call alone", med, lo, hi))
        y = torch.empty(size, size, device=dev, dtype=torch.bfloat16)
        med, lo, hi = per_call_us(lambda: torch.mm(x, w.T, out=y), a.calls, a.batches)
        rows.append((size, "torch.mm", med, lo, hi))

        def mm_ar():
            torch.mm(x, w.T, out=y)
            dist.all_reduce(y, group=g)

        med, lo, hi = per_call_us(mm_ar, a.calls, a.batches)
        rows.append((size, "torch.mm + NCCL all_reduce", med, lo, hi))
    lines = [
        f"host µs per call, back to back, tp 1, bf16 TN, {a.calls} calls x {a.batches} batches (median [min, max]); "
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        "",
        "| size | call | host µs | range |",
        "|---|---|---|---|",
    ]
    for size, name, med, lo, hi in rows:
        note = " (GPU-bound: reference)" if size >= 4096 else ""
        lines.append(f"| {size}³ | {name}{note} | {med:.1f} | {lo:.1f}–{hi:.1f} |")
    lines += [
        "",
        "2 ranks sharing one GPU: not measured here: NCCL refuses two ranks on one device and the torch "
        "binding's contexts need a ProcessGroupNCCL communicator (get_context); the C benchmark "
        "(tests_c/bench_host) measures that case over IPC with the callback bootstrap.",
    ]
    ok = all(verdicts) and bool(verdicts)
    pub = [f"{n} {m:.1f}" for s, n, m, _, _ in rows if s == 256 and "C call" not in n and n in
           ("all_gather_gemm", "gemm_reduce_scatter", "gemm_all_reduce")]
    lines.append(f"host_cost: {'PASS' if ok else 'FAIL'}: public ops at 256³ (bar {BAR_US:.0f} µs): {', '.join(pub)}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    tec.destroy_contexts()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
