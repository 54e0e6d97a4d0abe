#!/usr/bin/env python3
"""Host cost per call of the training step's GEMM calls at the tp-4 per-rank shape (tp 1,
one process, one GPU): x [8192, 4096], W [4096, 4096], dY [8192, 4096], bf16. Each row is
the host wall clock of 6 back-to-back calls (then a synchronisation, not timed), median of
40 batches, µs per call: torch.mm / F.linear, the public comm-GEMM ops on their eager
direct path, one op's C call alone (its prepared packed call), the library's GEMM
(`gemm.py`, TE's nvte_cublas_gemm) as the modules' wgrad (NT + bias gradient) and TN,
torch's equivalents, and the userbuffers bulk overlap at tp 1 (its NN GEMM). Few calls a
batch, so the GPU (0.2-0.4 ms a GEMM) never makes the host wait.

    TE_COMM_LIB=<libtransformer_engine_comm.so> python3 bench/host_step_ops.py
"""
import os, sys, time, statistics, socket
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import transformer_engine_comm.torch as tec
from transformer_engine_comm.torch import ops as te_ops, modules as M
from transformer_engine_comm.torch.gemm import gemm
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
g = dist.group.WORLD
dev = torch.device("cuda", 0)
T, H, F = 8192, 4096, 4096
bf = torch.bfloat16
x = torch.randn(T, H, device=dev, dtype=bf); w1 = torch.randn(F, H, device=dev, dtype=bf)
dy = torch.randn(T, F, device=dev, dtype=bf); db = torch.empty(F, device=dev, dtype=bf)
out = torch.empty(T, H, device=dev, dtype=bf)
def per_call(fn, calls=6, batches=40):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    r = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        r.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(r)
rows = []
def row(name, fn): rows.append((name, per_call(fn)))
row("torch.empty [8192,4096]", lambda: torch.empty(T, H, device=dev, dtype=bf))
row("torch.mm x@w1.T", lambda: torch.mm(x, w1.T))
row("F.linear", lambda: torch.nn.functional.linear(x, w1))
row("tec.all_gather_gemm", lambda: tec.all_gather_gemm(x, w1, group=g))
row("tec.gemm_reduce_scatter", lambda: tec.gemm_reduce_scatter(x, w1, group=g))
row("tec.gemm_all_reduce", lambda: tec.gemm_all_reduce(x, w1, group=g))
row("tec.gemm_reduce_scatter NN (transa=False)", lambda: tec.gemm_reduce_scatter(dy, w1, None, group=g, transa=False))
pr = next(p for k, p in te_ops._fast.items() if k[0] == "ag")
o2 = torch.empty(pr.out_shape, dtype=pr.out_dtype, device=dev)
pr.pa.data, pr.pb.data, pr.pd.data = w1.data_ptr(), x.data_ptr(), o2.data_ptr()
pr.args.stream = torch.cuda.current_stream().cuda_stream
row("AG C call alone (packed)", lambda: pr.fn(pr.ctx_h, pr.ptr))
row("gemm.py wgrad NT + bias_grad", lambda: gemm(x, dy, transa=False, transb=True, bias_grad=db))
row("gemm.py TN", lambda: gemm(w1, x, transa=True, transb=False))
row("torch dy.t()@x", lambda: dy.t() @ x)
ub = M._get_userbuffer("ag", g, T, H, bf)
row("ub.bulk_overlap ag NN tp1", lambda: ub.bulk_overlap("ag", w1, dy, out, transa=False))
row("torch dy@w1 (NN)", lambda: dy @ w1)
print(f"host µs per call, {torch.cuda.get_device_name(0)}\n\n| call | host µs |\n|---|---|")
for n, v in rows: print(f"| {n} | {v:.1f} |")
tec.destroy_contexts(); dist.destroy_process_group()
