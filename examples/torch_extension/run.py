#!/usr/bin/env python3
"""Driver of the example extension: run under torchrun, one process per GPU.

    PKG_CONFIG_PATH=<prefix>/lib/pkgconfig \
        python3 -m torch.distributed.run --standalone --nproc-per-node=2 run.py

Builds (or loads the already built) extension, creates a comm-GEMM context over the
NCCL communicator of torch's default process group, runs all-gather + GEMM and
GEMM + reduce-scatter on random bf16 data (even and uneven sizes, with and without
bias, on the default and on a side stream) and compares each result with torch
references: the same product on the full (identically seeded) data, and where the
sizes split evenly, torch's own all_gather_into_tensor + mm / mm + reduce_scatter_tensor.
Also checks that a bad call raises RuntimeError carrying the library's message and that
the context still works afterwards. Prints `torch_extension: N passed, M failed`
(counts summed over ranks) and exits 1 on any failure.
"""
import argparse
import os
import sys
import traceback

# A blocking communicator: the library issues its own NCCL calls on it (torch >= 2.7.1
# already defaults to blocking; older ones chose nonblocking with device_id=).
os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "0")

import torch  # noqa: E402  (first: the library binds the NCCL that torch has loaded)
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_ext import load_extension  # noqa: E402


class Report:
    def __init__(self, rank):
        self.rank, self.passed, self.failed = rank, 0, 0

    def check(self, ok, what):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"[rank {self.rank}] {'PASS' if ok else 'FAIL'} {what}", flush=True)


def agree(ok, device):
    """True on every rank only if `ok` on every rank (also a barrier)."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def share(global_size, world, rank):
    """(start, size) of this rank's block (block ceil(global / world), as numroc)."""
    block = -(-global_size // world)
    start = min(rank * block, global_size)
    return start, max(0, min(block, global_size - start))


def rel_err(y, ref):
    y, ref = y.float(), ref.float()
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def randn(shape, gen, device, dtype):
    # The same generator seed on every rank gives every rank the same "global" tensors.
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative error (Frobenius)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    rep = Report(rank)
    dtype = torch.bfloat16

    # Build on rank 0 first (torch's build lock would also serialize it), then load everywhere.
    ext, err = None, None
    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            try:
                ext = load_extension()
            except Exception as e:  # reported below, on every rank
                err = e
                traceback.print_exc()
        if not agree(err is None, dev):
            if rank == 0:
                print("torch_extension: 0 passed, 1 failed (the extension did not build or load)", flush=True)
            dist.destroy_process_group()
            return 1
    if rank == 0:
        print(f"extension {ext.__file__}; library {ext.version()}; torch {torch.__version__}; "
              f"world {world}", flush=True)

    # The communicator of torch's process group (created eagerly: device_id above, and the
    # all_reduce of agree()).
    pg = dist.group.WORLD
    comm = pg._get_backend(torch.device("cuda"))._comm_ptr()
    ctx = None
    try:
        ctx = ext.CommGemm(comm, world, rank, local_rank)
        rep.check(True, f"CommGemm over the process group's communicator (0x{comm:x})")
    except Exception as e:
        rep.check(False, f"CommGemm creation: {e}")
    if not agree(ctx is not None, dev):
        return finish(rep, dev, ctx)

    gen = torch.Generator(device=dev)

    def run_case(name, fn):
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            rep.check(False, f"{name}: raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        torch.cuda.synchronize()
        agree(True, dev)  # keep the ranks in step between cases

    def ag_case(n, k, m, bias, stream=None):
        name = f"all_gather_gemm n={n} k={k} m={m}{' +bias' if bias else ''}{' side-stream' if stream else ''}"

        def fn():
            gen.manual_seed(args.seed + n + k + m)
            x_full, w_full = randn((n, k), gen, dev, dtype), randn((m, k), gen, dev, dtype)
            b_full = randn((m,), gen, dev, dtype) if bias else None
            n0, nl = share(n, world, rank)
            m0, ml = share(m, world, rank)
            rep.check(ctx.numroc(n) == nl and ctx.numroc(m) == ml, f"{name}: numroc matches block distribution")
            x = x_full[n0:n0 + nl].contiguous()
            w = w_full[m0:m0 + ml].contiguous()
            b = b_full[m0:m0 + ml].contiguous() if bias else None
            if stream is None:
                y = ctx.all_gather_gemm(x, w, b, n_global=n, m_global=m)
            else:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    y = ctx.all_gather_gemm(x, w, b, n_global=n, m_global=m)
                torch.cuda.current_stream().wait_stream(stream)
                y.record_stream(torch.cuda.current_stream())
            ok_shape = tuple(y.shape) == (n, ml)
            rep.check(ok_shape, f"{name}: output shape {tuple(y.shape)} == {(n, ml)}")
            if not ok_shape:
                return
            ref = torch.mm(x_full, w.t())
            if bias:
                ref = ref + b
            e1 = rel_err(y, ref)
            rep.check(e1 <= args.tol, f"{name}: vs mm on the full data, rel err {e1:.2e}")
            if n % world == 0 and m % world == 0:
                xg = torch.empty((n, k), device=dev, dtype=dtype)
                dist.all_gather_into_tensor(xg, x)
                ref2 = torch.mm(xg, w.t())
                if bias:
                    ref2 = ref2 + b
                e2 = rel_err(y, ref2)
                rep.check(e2 <= args.tol, f"{name}: vs torch all_gather_into_tensor + mm, rel err {e2:.2e}")

        run_case(name, fn)

    def rs_case(n, k, m, bias, stream=None):
        name = f"gemm_reduce_scatter n={n} k={k} m={m}{' +bias' if bias else ''}{' side-stream' if stream else ''}"

        def fn():
            gen.manual_seed(args.seed + 7 * n + k + m)
            x_full, w_full = randn((n, k), gen, dev, dtype), randn((m, k), gen, dev, dtype)
            b_full = randn((m,), gen, dev, dtype) if bias else None
            n0, nl = share(n, world, rank)
            k0, kl = share(k, world, rank)
            x = x_full[:, k0:k0 + kl].contiguous()
            w = w_full[:, k0:k0 + kl].contiguous()
            if stream is None:
                y = ctx.gemm_reduce_scatter(x, w, b_full, k_global=k)
            else:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    y = ctx.gemm_reduce_scatter(x, w, b_full, k_global=k)
                torch.cuda.current_stream().wait_stream(stream)
                y.record_stream(torch.cuda.current_stream())
            ok_shape = tuple(y.shape) == (nl, m)
            rep.check(ok_shape, f"{name}: output shape {tuple(y.shape)} == {(nl, m)}")
            if not ok_shape:
                return
            ref = torch.mm(x_full[n0:n0 + nl], w_full.t())
            if bias:
                ref = ref + b_full
            e1 = rel_err(y, ref)
            rep.check(e1 <= args.tol, f"{name}: vs mm on the full data, rel err {e1:.2e}")
            if n % world == 0 and k % world == 0:
                partial = torch.mm(x, w.t())
                ref2 = torch.empty((n // world, m), device=dev, dtype=dtype)
                dist.reduce_scatter_tensor(ref2, partial)
                if bias:
                    ref2 = ref2 + b_full
                e2 = rel_err(y, ref2)
                rep.check(e2 <= args.tol, f"{name}: vs torch mm + reduce_scatter_tensor, rel err {e2:.2e}")

        run_case(name, fn)

    def error_case():
        name = "bad call raises RuntimeError with the library's message"

        def fn():
            x = torch.randn((64, 256), device=dev, dtype=dtype)
            w = torch.randn((32, 256), device=dev, dtype=dtype)
            try:
                # n_global disagrees with x's rows: the library rejects tensor `b` (x).
                ctx.all_gather_gemm(x, w, None, n_global=64 * world + 8 * world, m_global=32 * world)
                rep.check(False, f"{name}: no exception")
            except RuntimeError as e:
                msg = str(e)
                print(f"[rank {rank}] expected error: {msg.splitlines()[0]}", flush=True)
                rep.check("nvte_all_gather_gemm" in msg and "INVALID_ARGUMENT" in msg,
                          f"{name}: message names the call and the status")
            y = ctx.all_gather_gemm(x, w)  # the context still works after a rejected call
            xg = torch.empty((64 * world, 256), device=dev, dtype=dtype)
            dist.all_gather_into_tensor(xg, x)
            e = rel_err(y, torch.mm(xg, w.t()))
            rep.check(e <= args.tol, f"valid call after the error, rel err {e:.2e}")

        run_case(name, fn)

    side = torch.cuda.Stream(device=dev)
    ag_case(4096, 2048, 8192, bias=False)
    ag_case(2048, 1024, 4096, bias=True)
    ag_case(1024, 512, 1024, bias=False, stream=side)
    ag_case(1003, 512, 1502, bias=False)  # uneven n and m: padded inside the library
    rs_case(4096, 8192, 2048, bias=False)
    rs_case(2048, 4096, 1024, bias=True)
    rs_case(1024, 1024, 512, bias=False, stream=side)
    rs_case(1003, 1502, 512, bias=False)  # uneven n and k
    error_case()
    print(f"[rank {rank}] live NVTETensor handles: {ext.live_tensor_count()}", flush=True)
    return finish(rep, dev, ctx)


def finish(rep, dev, ctx):
    torch.cuda.synchronize()
    if ctx is not None:
        try:
            ctx.close()
        except Exception as e:
            rep.check(False, f"CommGemm.close: {e}")
    counts = torch.tensor([rep.passed, rep.failed], dtype=torch.int64, device=dev)
    dist.all_reduce(counts)
    passed, failed = (int(v) for v in counts.tolist())
    if dist.get_rank() == 0:
        print(f"torch_extension: {passed} passed, {failed} failed", flush=True)
    dist.destroy_process_group()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
