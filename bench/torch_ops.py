#!/usr/bin/env python3
"""Benchmark of the torch ops against what torch offers, one process per GPU (torchrun).

    python3 -m torch.distributed.run --standalone --nproc-per-node=4 bench/torch_ops.py \
        [--ops ag,rs] [--shapes MxKxN,...] [--iters 50] [--out FILE] [--lib PATH]

Per anchor shape (bf16, TN: y = x @ w.T; M tokens, K, N global; the all-gather splits N,
the reduce-scatter splits K, both split M in their communication):
  ours      transformer_engine_comm.torch.all_gather_gemm / gemm_reduce_scatter
  nccl+mm   dist.all_gather_into_tensor + torch.mm  /  torch.mm + dist.reduce_scatter_tensor
  symm-mem  torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter
            (torch's async-TP, CUDA symmetric-memory backend, multicast disabled)
  gemm      the local mm of the whole op's size: AG [M, K] @ [K, N/tp]; RS [M, K/tp] @ [K/tp, N]
  coll      the NCCL collective of the same bytes: all_gather [M/tp, K]; reduce_scatter [M, N]
  bound     max(gemm, coll): what perfect overlap would reach
Timing: warm-up, then per iteration a barrier (and device sync) followed by CUDA events
around one call on the current stream; each rank's median; the table shows the maximum
over ranks. Random data. Our output and symm-mem's are checked once against nccl+mm
(relative Frobenius error). Closing line `torch_ops: N passed, M failed` counts our ops'
checks (ran and matched within --tol); exit status 1 when one failed.
"""
import argparse
import math
import os
import statistics
import sys
import traceback

# Never NVLink multicast (NVLS): it can take shared GPUs out of service. Set before torch.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
# A blocking communicator: our ops' context issues its own NCCL calls on torch's.
os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "0")

import torch  # noqa: E402  (before the library: it binds the NCCL torch has loaded)
import torch.distributed as dist  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AG_SHAPES = [(8192, 8192, 28672), (8192, 4096, 16384), (16384, 8192, 8192)]
RS_SHAPES = [(8192, 28672, 8192), (8192, 16384, 4096), (16384, 8192, 8192)]


def short(e, n=90):
    s = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return s.replace("|", "/")[:n]


def import_ours():
    """-> (module, None) or (None, error string)."""
    try:
        import transformer_engine_comm.torch as tec
        return tec, None
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "python"))  # run from the source tree
    except Exception as e:
        traceback.print_exc()
        return None, short(e)
    try:
        import transformer_engine_comm.torch as tec
        return tec, None
    except Exception as e:
        traceback.print_exc()
        return None, short(e)


class Bench:
    def __init__(self, args, dev, pg):
        self.args, self.dev, self.pg = args, dev, pg
        self.rank, self.tp = dist.get_rank(), dist.get_world_size()

    def agree(self, ok):
        """True on every rank only if ok on every rank."""
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(t.item())

    def time_ms(self, fn):
        """Max over ranks of each rank's median time of fn (ms)."""
        for _ in range(self.args.warmup):
            fn()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.args.iters):
            dist.barrier(group=self.pg)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return t.item()

    def attempt(self, what, check, fn):
        """Run check() once (returns the output), agree, then time fn.
        -> (ms or None, output or None, error string or None)."""
        out, err = None, None
        try:
            out = check()
            torch.cuda.synchronize()
        except Exception as e:
            err = short(e)
            print(f"[rank {self.rank}] {what} failed: {err}", file=sys.stderr, flush=True)
            traceback.print_exc()
        if not self.agree(err is None):
            return None, None, err or "failed on another rank"
        try:
            return self.time_ms(fn), out, None
        except Exception as e:
            err = short(e)
            print(f"[rank {self.rank}] timing {what} failed: {err}", file=sys.stderr, flush=True)
            traceback.print_exc()
            self.agree(False)
            return None, None, err


def rel_err(y, ref):
    y, ref = y.float(), ref.float()
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def geomean(vals):
    vals = [v for v in vals if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="ag,rs", help="comma list of ag, rs")
    ap.add_argument("--shapes", help="MxKxN,... global sizes for every op (AG splits N, RS splits K)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", help="write the markdown table here (rank 0)")
    ap.add_argument("--lib", help="libtransformer_engine_comm.so to use (sets TE_COMM_LIB)")
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative error of our ops")
    ap.add_argument("--no-symm", action="store_true", help="skip torch's symmetric-memory ops")
    args = ap.parse_args()
    if args.lib:
        os.environ["TE_COMM_LIB"] = os.path.abspath(args.lib)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in ("ag", "rs")]
    if bad:
        ap.error(f"unknown op(s) {bad}; use ag, rs")
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]
            assert all(len(s) == 3 for s in shapes)
        except (ValueError, AssertionError):
            ap.error("--shapes takes MxKxN,...")
        ag_shapes = rs_shapes = shapes
    else:
        ag_shapes, rs_shapes = AG_SHAPES, RS_SHAPES

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    pg = dist.group.WORLD
    group_name = pg.group_name
    b = Bench(args, dev, pg)
    rank, tp = b.rank, b.tp
    dtype = torch.bfloat16

    tec, ours_err = import_ours()
    symm_err = "skipped (--no-symm)" if args.no_symm else None
    if not args.no_symm:
        try:
            import torch.distributed._symmetric_memory as symm_mem
            # The CUDA (IPC) backend, chosen before any symmetric allocation; never multicast.
            symm_mem.set_backend("CUDA")
        except Exception as e:
            print(f"[rank {rank}] symm_mem.set_backend('CUDA'): {short(e)} (keeping the default)",
                  file=sys.stderr, flush=True)
        if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
            symm_err = "torch.ops.symm_mem.fused_* not available"
    symm_failed = {}  # op -> error: after a failure the op's later rows are skipped

    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    except Exception as e:
        nccl = f"? ({short(e, 40)})"
    if rank == 0:
        print(f"tp {tp}; {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; "
              f"NCCL {nccl}; iters {args.iters}, warm-up {args.warmup}; "
              f"ours: {'transformer_engine_comm.torch' if tec else 'unavailable: ' + ours_err}", flush=True)

    header = ("| op | M x K x N | ours ms | nccl+mm ms | symm-mem ms | gemm ms | coll ms | bound ms "
              "| ours/bound | nccl+mm/bound | symm/bound | ours err | symm err |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows, notes = [], []
    ratios = {op: {"ours": [], "nccl": [], "symm": []} for op in ops}
    passed = failed = 0
    gen = torch.Generator(device=dev)

    def randn(shape, seed):
        gen.manual_seed(seed)
        return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    for op in ops:
        for (M, K, N) in (ag_shapes if op == "ag" else rs_shapes):
            if op == "ag":
                label = f"{M}x{K}x({N}/{tp})"
                split_ok = M % tp == 0 and N % tp == 0
            else:
                label = f"{M}x({K}/{tp})x{N}"
                split_ok = M % tp == 0 and K % tp == 0
            if not split_ok:
                notes.append(f"{op.upper()} {M}x{K}x{N}: skipped (M and the split size must divide by tp={tp})")
                continue
            torch.cuda.empty_cache()
            if op == "ag":
                x = randn((M // tp, K), 1000 + rank)
                w = randn((N // tp, K), 2000 + rank)
                x_full = torch.empty((M, K), device=dev, dtype=dtype)
                y_ref = torch.empty((M, N // tp), device=dev, dtype=dtype)

                def gemm():
                    torch.mm(x_full, w.t(), out=y_ref)

                def coll():
                    dist.all_gather_into_tensor(x_full, x, group=pg)

                def ours():
                    return tec.all_gather_gemm(x, w, group=pg)

                def symm():
                    # return_A=True: torch's multimem (multicast) path is only taken without it.
                    return torch.ops.symm_mem.fused_all_gather_matmul(x, [w.t()], 0, group_name, return_A=True)[1][0]
            else:
                x = randn((M, K // tp), 3000 + rank)
                w = randn((N, K // tp), 4000 + rank)
                partial = torch.empty((M, N), device=dev, dtype=dtype)
                y_ref = torch.empty((M // tp, N), device=dev, dtype=dtype)

                def gemm():
                    torch.mm(x, w.t(), out=partial)

                def coll():
                    dist.reduce_scatter_tensor(y_ref, partial, group=pg)

                def ours():
                    return tec.gemm_reduce_scatter(x, w, group=pg)

                def symm():
                    return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", 0, group_name)

            def nccl_mm():
                if op == "ag":
                    coll()
                    gemm()
                else:
                    gemm()
                    coll()

            # The reference output of nccl+mm (y_ref), then its time and the parts' times.
            nccl_mm()
            torch.cuda.synchronize()
            ref = y_ref.clone()
            t_gemm = b.time_ms(gemm)
            t_coll = b.time_ms(coll)
            t_nccl = b.time_ms(nccl_mm)
            bound = max(t_gemm, t_coll)

            # Ours.
            t_ours, e_ours, cell_ours = None, None, None
            if tec is None:
                cell_ours = "unavailable"
                failed += 1
            else:
                t_ours, y, err = b.attempt(f"ours {op} {label}", ours, ours)
                if err:
                    cell_ours = "error: " + err
                    failed += 1
                elif tuple(y.shape) != tuple(ref.shape):
                    cell_ours = f"error: output shape {tuple(y.shape)}, expected {tuple(ref.shape)}"
                    failed += 1
                    t_ours = None
                else:
                    e_ours = rel_err(y, ref)
                    worst = torch.tensor([e_ours], dtype=torch.float64, device=dev)
                    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pg)
                    e_ours = worst.item()
                    ok = e_ours <= args.tol
                    passed, failed = passed + ok, failed + (not ok)
                    del y

            # torch symmetric memory.
            t_symm, e_symm, cell_symm = None, None, None
            if symm_err or op in symm_failed:
                cell_symm = symm_err or "skipped (failed above)"
            else:
                def symm_check():
                    try:
                        return symm()
                    except RuntimeError as e:
                        # torch < 2.11 needs the group registered for symmetric memory.
                        if "group info" not in str(e):
                            raise
                        import warnings
                        import torch.distributed._symmetric_memory as symm_mem
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            symm_mem.enable_symm_mem_for_group(group_name)
                        return symm()

                t_symm, y, err = b.attempt(f"symm-mem {op} {label}", symm_check, symm)
                if err:
                    cell_symm = "error: " + err
                    symm_failed[op] = err
                    notes.append(f"symm-mem {op.upper()} {label}: {err}")
                elif tuple(y.shape) != tuple(ref.shape):
                    cell_symm = f"error: output shape {tuple(y.shape)}, expected {tuple(ref.shape)}"
                    t_symm = None
                else:
                    e_symm = rel_err(y, ref)
                    worst = torch.tensor([e_symm], dtype=torch.float64, device=dev)
                    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pg)
                    e_symm = worst.item()
                    del y

            r_ours = t_ours / bound if t_ours else None
            r_nccl = t_nccl / bound
            r_symm = t_symm / bound if t_symm else None
            ratios[op]["ours"].append(r_ours)
            ratios[op]["nccl"].append(r_nccl)
            ratios[op]["symm"].append(r_symm)
            row = (f"| {op.upper()} | {label} | {cell_ours or fmt(t_ours)} | {fmt(t_nccl)} | {cell_symm or fmt(t_symm)} "
                   f"| {fmt(t_gemm)} | {fmt(t_coll)} | {fmt(bound)} | {fmt(r_ours)} | {fmt(r_nccl)} | {fmt(r_symm)} "
                   f"| {fmt(e_ours, '.1e')} | {fmt(e_symm, '.1e')} |")
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
            del x, w, ref
            if op == "ag":
                del x_full, y_ref
            else:
                del partial, y_ref

    for op in ops:
        r = ratios[op]
        if r["nccl"]:
            rows.append(f"| {op.upper()} geomean | | | | | | | | {fmt(geomean(r['ours']))} | {fmt(geomean(r['nccl']))} "
                        f"| {fmt(geomean(r['symm']))} | | |")
    table = header + "\n".join(rows) + "\n"
    if rank == 0:
        caption = (f"torch ops, tp {tp}, bf16, {torch.cuda.get_device_name(dev)}, torch {torch.__version__}: "
                   f"ms (max over ranks of each rank's median of {args.iters}); bound = max(gemm, coll)\n\n")
        print()
        print(caption + table, end="")
        for n in notes:
            print("note: " + n)
        if args.out:
            with open(args.out, "w") as f:
                f.write(caption + table)
                for n in notes:
                    f.write(f"\nnote: {n}\n")
        print(f"torch_ops: {passed} passed, {failed} failed", flush=True)
    torch.cuda.synchronize()
    dist.barrier(group=pg)
    if tec is not None and hasattr(tec, "destroy_contexts"):
        try:
            tec.destroy_contexts()  # before the process group's communicator goes away
        except Exception as e:
            print(f"[rank {rank}] destroy_contexts: {short(e)}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
