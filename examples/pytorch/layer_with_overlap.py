#!/usr/bin/env python3
"""Train a tensor-parallel LayerNormMLP with comm/GEMM overlap (TE's te_layer_with_overlap.py
workflow, on transformer_engine_comm).

    torchrun --nnodes=1 --nproc-per-node=$(nvidia-smi -L | wc -l) \\
        examples/pytorch/layer_with_overlap.py [--fp8 [--fp8-recipe delayed|current|block]] \\
        [--no-comm-overlap] [--num-replicas N] [--cuda-graph] [--profile]

Without a GPU (a smoke test of seconds: a world of one on gloo, the reference build, small
default sizes that it prints; no torchrun or environment variables needed)::

    python examples/pytorch/layer_with_overlap.py --device cpu

From the source tree (no wheel installed): ``PYTHONPATH=python`` (the library is then found
at ``target/release/libtransformer_engine_comm.so``, or wherever ``TE_COMM_LIB`` points);
the script also adds ``<repo>/python`` to ``sys.path`` by itself when the package is not
importable.

The world is split into ``--num-replicas`` data-parallel replicas of ``world / num_replicas``
consecutive ranks each (the tensor-parallel groups); ranks with the same TP rank form the
data-parallel groups, and the model is wrapped in DistributedDataParallel over its DP group
when there is more than one replica. Each replica trains on its own fixed random batch
(``--seed`` + replica index) against a fixed random target (MSE loss), with the sequence
sharded across its TP group (sequence parallelism). ``--no-comm-overlap`` builds the same
model on plain torch.distributed (NCCL) collectives and torch matmuls: the reference.

FP8 (``--fp8``): TE's recipes from ``transformer_engine_comm.torch.fp8``, ``--fp8-recipe
delayed`` (DelayedScaling: HYBRID, amax history; the default), ``current``
(Float8CurrentScaling) or ``block`` (Float8BlockScaling, DeepSeek-V3's: e4m3, one
power-of-2 scale per 1 x 128 block of the activations and gradients and per 128 x 128 tile
of the weights; the library's block casts and block-scaled GEMMs, torch.distributed
collectives in bf16 around them at tp > 1: the ``ub_*`` overlap does not apply to it yet). One micro-batch per optimizer step: the model is called with
``is_first_microbatch=True`` (TE's semantics), so the FP8 weights are cast once per step.
The optimizer is Adam, fused on CUDA (``torch.optim.Adam(fused=True)``'s kernels through
``transformer_engine_comm.torch.optim.LeanFusedAdam``, whose step costs less host time).

``--cuda-graph`` captures the whole forward and backward of the model with
``torch.cuda.make_graphed_callables`` (its warm-up iterations also make the library's
first eager calls); the loss (MSE) and the optimizer step run eagerly outside
the graph. Needs CUDA and one replica (no DistributedDataParallel).

``--force-library-path`` (bench only): at tp 1 the overlap build runs the library's
comm-GEMM ops exactly as at tp > 1 (``force_library_path=True`` of the modules), so their
host cost and kernels can be measured on one GPU.

Output: TE-style progress lines (``[rank0:node0] |-- Forward pass`` ...) for the first
iterations (every iteration with ``--verbose``), the loss every ``--log-every`` iterations,
the mean step time (CUDA events around zero_grad + forward + loss + backward + optimizer
step, warm-up iterations excluded, the maximum over ranks; the loop does not synchronise per
step: at most two steps are queued, and the losses are read when it ends), the mean host time per step
(``time.perf_counter`` from the step's start to the return of ``optimizer.step()``, i.e.
to its last enqueue: nothing inside the step synchronizes; same iterations, maximum over
ranks) and, last, one machine-readable line:

    RESULT mode=<overlap|no-overlap> fp8=<0|1> recipe=<none|delayed|current|block> graph=<0|1>
        forced=<0|1> tp=<n> dp=<n> step_ms=<x> host_ms=<h> final_loss=<y> losses=<l1,l2,...>

(one line). ``--profile`` adds a step breakdown from ``torch.profiler`` (CUDA activities)
over ``--profile-steps`` further steps, in a separate pass after the timed iterations (the
profiler's overhead stays out of step_ms and host_ms): per step, the median over the
profiled steps and then the maximum over ranks of each figure, GPU-busy ms (union of all
kernel, memcpy and memset intervals), GEMM ms (union of the GEMM kernels), communication
ms (union of NCCL kernels, the library's communication kernels of kernels/comm.cu and
peer-to-peer memcpys) split into exposed (not overlapped by any other kernel) and hidden,
and the kernel count; and one more machine-readable line before RESULT:

    PROFILE mode=... fp8=... recipe=... graph=... forced=... tp=... dp=... steps=<n> step_ms=<x>
        host_ms=<h> gpu_busy_ms=<b> gemm_ms=<g> comm_ms=<c> comm_exposed_ms=<e>
        comm_hidden_ms=<d> kernels=<k> copies=<m> unassigned=<u>

(one line; copies: memcpy and memset operations per step; unassigned: device operations
of the profiled window that fell in no step, expected 0).

``--host-profile N`` runs N further steps under Python's ``cProfile`` on every rank, in a
separate pass (its overhead inflates host time, so it stays out of step_ms and host_ms), and
prints rank 0's functions with the most own host time, µs per step (own time and with
callees) and calls per step: where the host time of a step goes (the library's ctypes
calls, the torch ops, the FP8 scaling). ``--host-profile-out FILE`` also writes each rank's
raw statistics (``pstats``; rank r: FILE.rank<r>).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch  # first: the library must bind the NCCL that torch loaded
import torch.distributed as dist
import torch.nn.functional as F

try:
    import transformer_engine_comm  # noqa: F401
except ImportError:  # running from the source tree without PYTHONPATH=python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    import transformer_engine_comm  # noqa: F401

from transformer_engine_comm.torch import modules as te_comm_modules
from transformer_engine_comm.recipe import RECIPE_NAMES
from transformer_engine_comm.torch.fp8 import delayed_states, keep_delayed_states, recipe_from_name

WORLD_RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
LOCAL_SIZE = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
NODE_ID = WORLD_RANK // max(LOCAL_SIZE, 1)


def dist_print(msg: str, *, all_ranks: bool = False, end: str = "\n") -> None:
    """Print ``[rank<r>:node<n>] msg`` on world rank 0 (every rank with all_ranks)."""
    if all_ranks or WORLD_RANK == 0:
        print(f"[rank{WORLD_RANK}:node{NODE_ID}] {msg}", end=end, flush=True)


# Sizes and iteration counts when not given: GPU_DEFAULTS (8192 tokens, hidden 4096) on
# CUDA; CPU_DEFAULTS with --device cpu (256 tokens, hidden 128: seconds on 2 cores).
GPU_DEFAULTS = {"seq_length": 2048, "batch_size": 4, "num_heads": 32, "head_dim": 128, "iters": 20, "warmup": 3}
CPU_DEFAULTS = {"seq_length": 128, "batch_size": 2, "num_heads": 4, "head_dim": 32, "iters": 6, "warmup": 2}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a tensor-parallel LayerNormMLP with comm/GEMM overlap (transformer_engine_comm)."
    )
    # Defaults: 8192 tokens, hidden 4096, ffn 16384 -- a size where communication matters.
    # With --device cpu, the sizes not given are CPU_DEFAULTS' (a run of seconds).
    p.add_argument("-s", "--seq-length", type=int, default=None,
                   help=f"sequence length (sharded over the TP group; default {GPU_DEFAULTS['seq_length']}, "
                        f"--device cpu: {CPU_DEFAULTS['seq_length']})")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help=f"default {GPU_DEFAULTS['batch_size']} (--device cpu: {CPU_DEFAULTS['batch_size']})")
    p.add_argument("-n", "--num-heads", type=int, default=None,
                   help=f"default {GPU_DEFAULTS['num_heads']} (--device cpu: {CPU_DEFAULTS['num_heads']})")
    p.add_argument("-d", "--head-dim", type=int, default=None,
                   help=f"hidden = num_heads * head_dim; default {GPU_DEFAULTS['head_dim']} "
                        f"(--device cpu: {CPU_DEFAULTS['head_dim']})")
    p.add_argument("--ffn-mult", type=int, default=4, help="ffn_hidden = ffn_mult * hidden")
    p.add_argument("-i", "--iters", type=int, default=None,
                   help=f"training iterations (default {GPU_DEFAULTS['iters']}, --device cpu: {CPU_DEFAULTS['iters']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"iterations excluded from the mean step time (default {GPU_DEFAULTS['warmup']}, "
                        f"--device cpu: {CPU_DEFAULTS['warmup']})")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-4,
                   help="Adam learning rate (1e-4: a smooth fall at the default size; 1e-3 overshoots there)")
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs with TE's recipe --fp8-recipe")
    p.add_argument("--fp8-recipe", choices=RECIPE_NAMES, default=None,
                   help="with --fp8: delayed (DelayedScaling, HYBRID; the default), current (Float8CurrentScaling) "
                        "or block (Float8BlockScaling: 1x128 / 128x128 blocks, e4m3, power-of-2 scales)")
    p.add_argument("--no-comm-overlap", action="store_true",
                   help="reference build: torch.distributed collectives + torch matmuls")
    p.add_argument("--num-replicas", type=int, default=1, help="data-parallel replicas (TP size = world / N)")
    p.add_argument("--no-ub-overlap-ag", action="store_true", help="disable the AG+GEMM overlap")
    p.add_argument("--no-ub-overlap-rs", action="store_true", help="disable the GEMM+RS overlap")
    p.add_argument("--ub-overlap-rs-dgrad", action="store_true",
                   help="fc1 backward: dgrad GEMM+RS fused (turns the bulk overlaps off, as TE)")
    p.add_argument("--no-ub-bulk-dgrad", action="store_true", help="disable the bulk AG beside the dgrad GEMM")
    p.add_argument("--no-ub-bulk-wgrad", action="store_true", help="disable the bulk RS beside the wgrad GEMM")
    p.add_argument("--log-every", type=int, default=1, help="print the loss every N iterations")
    p.add_argument("-v", "--verbose", action="store_true", help="progress lines on every iteration")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo + CPU tensors, the reference build (--no-comm-overlap implied), small "
                        "default sizes: a smoke test of seconds, no GPU needed")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter / activation dtype")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture forward + backward with torch.cuda.make_graphed_callables (loss and optimizer eager)")
    p.add_argument("--profile", action="store_true",
                   help="step breakdown from torch.profiler in a separate pass after the timed iterations")
    p.add_argument("--profile-steps", type=int, default=5, help="steps of the profiled pass (after one warm-up step)")
    p.add_argument("--profile-trace", default=None, metavar="FILE",
                   help="with --profile: also write the profiled pass's Chrome trace to FILE (rank r: FILE.rank<r>)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="N further steps under cProfile (a separate pass): host time per function and step")
    p.add_argument("--host-profile-out", default=None, metavar="FILE",
                   help="with --host-profile: write each rank's pstats to FILE.rank<r>")
    p.add_argument("--force-library-path", action="store_true",
                   help="bench only: the overlap build runs the library's comm-GEMM ops at tp 1 as at tp > 1")
    opts = p.parse_args(argv)
    # Sizes not given: the GPU defaults, or with --device cpu small ones (noted in
    # opts.cpu_notes and printed by train()); --device cpu implies --no-comm-overlap.
    opts.cpu_notes = []
    defaults = CPU_DEFAULTS if opts.device == "cpu" else GPU_DEFAULTS
    picked = []
    for name, value in defaults.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
            picked.append(f"--{name.replace('_', '-')} {value}")
    if opts.device == "cpu":
        if picked:
            opts.cpu_notes.append("--device cpu: small default sizes (" + ", ".join(picked) + "); pass them to change")
        if not opts.no_comm_overlap and not opts.force_library_path:
            opts.no_comm_overlap = True
            opts.cpu_notes.append("--device cpu: the reference build (torch.distributed collectives + torch matmuls; "
                                  "--no-comm-overlap implied: the library's overlap needs CUDA)")
    if opts.iters < 1:
        p.error("--iters must be >= 1")
    if opts.log_every < 1:
        p.error("--log-every must be >= 1")
    if opts.num_replicas < 1:
        p.error("--num-replicas must be >= 1")
    if opts.device == "cpu" and not opts.no_comm_overlap:
        p.error("--device cpu runs the reference build only (--force-library-path needs --device cuda)")
    if opts.warmup < 0:
        p.error("--warmup must be >= 0")
    if opts.fp8_recipe is not None and not opts.fp8:
        p.error("--fp8-recipe needs --fp8")
    if opts.fp8 and opts.fp8_recipe is None:
        opts.fp8_recipe = "delayed"
    if opts.force_library_path and opts.no_comm_overlap:
        p.error("--force-library-path applies to the overlap build (drop --no-comm-overlap)")
    if opts.device == "cpu" and (opts.cuda_graph or opts.profile):
        p.error("--cuda-graph and --profile need --device cuda")
    if opts.cuda_graph and opts.num_replicas > 1:
        p.error("--cuda-graph runs one replica only (the graph does not hold DistributedDataParallel's hooks)")
    if opts.profile_steps < 1:
        p.error("--profile-steps must be >= 1")
    if opts.host_profile < 0:
        p.error("--host-profile must be >= 0")
    return opts


# ----------------------------------------------------------------------------- setup


def init_distributed(device: str) -> torch.device:
    """Initialise torch.distributed from torchrun's environment (no-op if already done);
    returns this rank's device."""
    global WORLD_RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, NODE_ID
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("layer_with_overlap.py: CUDA is not available (use --device cpu --no-comm-overlap for a CPU smoke test)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python` run: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    WORLD_RANK, WORLD_SIZE = dist.get_rank(), dist.get_world_size()
    LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
    LOCAL_SIZE = int(os.environ.get("LOCAL_WORLD_SIZE", str(WORLD_SIZE)))
    NODE_ID = WORLD_RANK // max(LOCAL_SIZE, 1)
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_GROUPS: Dict[tuple, tuple] = {}

# Steps queued at most in the timed loop (see train()).
IN_FLIGHT = 2


def make_groups(num_replicas: int, verbose: bool = True):
    """(tp_group, dp_group, tp_size, dp_size): TP groups of world/num_replicas consecutive
    ranks, DP groups of the ranks with the same TP rank. Collective; cached per layout."""
    world = dist.get_world_size()
    if world % num_replicas:
        raise SystemExit(f"--num-replicas {num_replicas} must divide the world size {world}")
    tp_size = world // num_replicas
    key = (world, num_replicas)
    if key not in _GROUPS:
        rank = dist.get_rank()
        tp_group = dp_group = None
        if num_replicas == 1:
            tp_group = dist.group.WORLD
            tp_ranks = list(range(world))
        else:
            for r in range(num_replicas):
                ranks = list(range(r * tp_size, (r + 1) * tp_size))
                g = dist.new_group(ranks)  # every rank creates every group, in order
                if rank in ranks:
                    tp_group, tp_ranks = g, ranks
        if tp_size == 1:
            dp_group, dp_ranks = dist.group.WORLD, list(range(world))
        elif num_replicas > 1:
            for t in range(tp_size):
                ranks = list(range(t, world, tp_size))
                g = dist.new_group(ranks)
                if rank in ranks:
                    dp_group, dp_ranks = g, ranks
        else:
            dp_ranks = [rank]
        _GROUPS[key] = (tp_group, dp_group, tp_ranks, dp_ranks)
    tp_group, dp_group, tp_ranks, dp_ranks = _GROUPS[key]
    dist_print(f"|-- Created tensor-parallel group: {tp_ranks}", all_ranks=verbose)
    if num_replicas > 1:
        dist_print(f"|-- Created data-parallel group: {dp_ranks}", all_ranks=verbose)
    return tp_group, dp_group, tp_size, num_replicas


# ----------------------------------------------------------------------------- step breakdown

# Classification of the device operations of a profiled step (names as the Chrome trace of
# torch.profiler writes them). GEMM kernels: cuBLAS / cuBLASLt (xmma, nvjet, cutlass) and
# anything named gemm. Communication: NCCL's kernels, the library's communication kernels
# (kernels/comm.cu: the flag / arrival kernels, the NCCL bracketing kernels, the peer puts,
# the segment copies and the reductions of received partials) and peer-to-peer memcpys.
# The library's amax_max (a local max over per-chunk amaxes) is compute.
GEMM_RE = re.compile(r"gemm|cutlass|nvjet|xmma|cublas", re.IGNORECASE)
LIB_COMM_KERNELS = frozenset(
    ("wait_flags", "wait_arrival_checked", "signal_flags", "begin_call", "nccl_begin", "nccl_arrived",
     "nccl_end", "put_bytes", "copy_segments")
)
LIB_REDUCE_RE = re.compile(r"^reduce_[a-z0-9]+_[a-z0-9]+_v[0-9]+$")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_MARK = "te_comm_step#"


def classify(name: str, cat: str) -> str:
    """'gemm', 'comm', 'compute' (other kernels) or 'copy' (memcpy / memset, not peer)."""
    if cat == "kernel":
        if "nccl" in name.lower() or name in LIB_COMM_KERNELS or LIB_REDUCE_RE.match(name):
            return "comm"
        return "gemm" if GEMM_RE.search(name) else "compute"
    if cat == "gpu_memcpy" and ("PtoP" in name or "Peer" in name):
        return "comm"
    return "copy"


def union(intervals) -> List[tuple]:
    """Merged, sorted (start, end) intervals covering the given ones."""
    out: List[list] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(i) for i in out]


def measure(merged) -> float:
    return sum(b - a for a, b in merged)


def overlap_length(x, y) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            tot += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def analyze_trace(trace: dict) -> dict:
    """Per-step breakdown of a torch.profiler Chrome trace whose steps are host ranges named
    ``te_comm_step#<i>`` (each closed by a device synchronize, so a step's device work lies
    inside its range). Returns {"steps": [per-step dict], "unassigned": n}; per step (ms,
    from the trace's microseconds): gpu_busy_ms, gemm_ms, comm_ms, comm_exposed_ms,
    comm_hidden_ms, and kernels, copies (counts)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_MARK)
        and not str(e.get("cat", "")).startswith("gpu")
    )
    per = [{"all": [], "gemm": [], "comm": [], "compute": [], "kernels": 0, "copies": 0} for _ in steps]
    unassigned = 0
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or cat not in DEVICE_CATS:
            continue
        t0 = float(e["ts"])
        iv = (t0, t0 + float(e.get("dur", 0.0)))
        k = next((i for i, (a, b) in enumerate(steps) if a <= t0 <= b), None)
        if k is None:
            unassigned += 1
            continue
        s = per[k]
        kind = classify(str(e.get("name", "")), cat)
        s["all"].append(iv)
        if cat == "kernel":
            s["kernels"] += 1
        else:
            s["copies"] += 1
        if kind == "comm":
            s["comm"].append(iv)
        else:
            if kind == "gemm":
                s["gemm"].append(iv)
            if kind in ("gemm", "compute"):
                s["compute"].append(iv)
    out = []
    for s in per:
        comm, compute = union(s["comm"]), union(s["compute"])
        hidden = overlap_length(comm, compute)
        comm_ms = measure(comm) / 1e3
        out.append({
            "gpu_busy_ms": measure(union(s["all"])) / 1e3,
            "gemm_ms": measure(union(s["gemm"])) / 1e3,
            "comm_ms": comm_ms,
            "comm_hidden_ms": hidden / 1e3,
            "comm_exposed_ms": comm_ms - hidden / 1e3,
            "kernels": s["kernels"],
            "copies": s["copies"],
        })
    return {"steps": out, "unassigned": unassigned}


PROFILE_KEYS = ("gpu_busy_ms", "gemm_ms", "comm_ms", "comm_exposed_ms", "comm_hidden_ms", "kernels", "copies")


def median_steps(steps: List[dict]) -> dict:
    """Median over the steps of each figure (PROFILE_KEYS)."""
    if not steps:
        raise ValueError("no profiled step found in the trace")
    return {k: statistics.median(s[k] for s in steps) for k in PROFILE_KEYS}


def profile_steps(step_fn, nsteps: int, trace_path: Optional[str] = None) -> dict:
    """Run one warm-up step and ``nsteps`` annotated steps under torch.profiler (CPU and
    CUDA activities), each step closed by a device synchronize; returns analyze_trace()'s
    result for this rank."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn()  # the profiler's own first-events cost lands here, outside the steps
        torch.cuda.synchronize()
        for i in range(nsteps):
            with record_function(f"{STEP_MARK}{i}"):
                step_fn()
                torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="te_comm_profile_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
        if trace_path:
            shutil.copyfile(path, trace_path if WORLD_SIZE == 1 else f"{trace_path}.rank{WORLD_RANK}")
    finally:
        os.unlink(path)
    return analyze_trace(trace)


# ----------------------------------------------------------------------------- training


def make_optimizer(params, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """The example's optimizer: Adam, fused (one kernel launch per step group) on CUDA,
    with the library's host-lean step (``LeanFusedAdam``: torch's fused Adam, the same
    kernels and results; step + zero_grad about 130 µs of host time instead of about 360
    at the tp-4 per-rank shape); torch's default
    implementation on the CPU. bench/step_parts.py times this very call."""
    if device.type == "cuda":
        from transformer_engine_comm.torch.optim import LeanFusedAdam

        return LeanFusedAdam(params, lr=lr)
    return torch.optim.Adam(params, lr=lr)


def _prime_delayed_states(model: torch.nn.Module, forward, x: torch.Tensor, target: torch.Tensor,
                          tp_size: int) -> None:
    """Before a capture under delayed scaling: one eager forward and backward on the real
    batch (no optimizer step; the gradients are dropped), so that each role's first cast
    (which takes its scale from the tensor itself, then marks the state primed) sees real
    data. make_graphed_callables' warm-up backward passes take uninitialised gradients
    (torch.empty_like): primed by them, or reset to scale 1 with the primed flag kept, the
    first step's gradients flushed towards zero (measured on one H200, 2026-12-03: the loss
    did not move in the first step)."""
    if delayed_states(model):
        out = forward(x)
        loss = F.mse_loss(out, target)
        (loss / tp_size if tp_size > 1 else loss).backward()
        for p in model.parameters():
            p.grad = None


class _FirstMicrobatch(torch.nn.Module):
    """model(x, is_first_microbatch=True) as a one-argument module (what
    make_graphed_callables captures: the flag is a capture-time constant)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, is_first_microbatch=True)


def train(opts: argparse.Namespace) -> dict:
    """Build the model, train ``opts.iters`` iterations (then, with ``opts.profile``, a
    profiled pass); returns ``{"mode", "fp8", "recipe", "graph", "forced", "tp", "dp",
    "step_ms", "host_ms", "final_loss", "losses"}`` (losses: the mean loss over all ranks,
    per iteration) plus ``"profile"`` (PROFILE_KEYS, steps, unassigned) with
    ``opts.profile``. Needs torch.distributed initialised (or initialises it from
    torchrun's environment). Leaves the process groups alive."""
    fp8_recipe_name = getattr(opts, "fp8_recipe", None) or ("delayed" if opts.fp8 else None)
    device = init_distributed(opts.device)
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    overlap = not opts.no_comm_overlap
    tp_group, dp_group, tp_size, dp_size = make_groups(opts.num_replicas, verbose=opts.verbose)
    tp_rank = dist.get_rank(tp_group)
    dp_rank = dist.get_rank() // tp_size
    hidden = opts.num_heads * opts.head_dim
    ffn_hidden = opts.ffn_mult * hidden
    if opts.seq_length % tp_size:
        raise SystemExit(f"--seq-length {opts.seq_length} must be divisible by the TP size {tp_size}")

    mode = "overlap" if overlap else "no-overlap"
    recipe = fp8_recipe_name if opts.fp8 else "none"
    for note in getattr(opts, "cpu_notes", ()):
        dist_print(note)
    dist_print(
        f"Config: mode={mode} fp8={int(opts.fp8)} recipe={recipe} graph={int(opts.cuda_graph)} "
        f"forced={int(opts.force_library_path)} tp={tp_size} dp={dp_size} seq={opts.seq_length} "
        f"batch={opts.batch_size} hidden={hidden} ffn_hidden={ffn_hidden} dtype={opts.dtype} "
        f"iters={opts.iters} seed={opts.seed}"
    )

    torch.manual_seed(opts.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(opts.seed)
    model = te_comm_modules.LayerNormMLP(
        hidden,
        ffn_hidden,
        tp_group=tp_group,
        sequence_parallel=True,
        comm_overlap=overlap,
        ub_overlap_ag=not opts.no_ub_overlap_ag,
        ub_overlap_rs=not opts.no_ub_overlap_rs,
        ub_overlap_rs_dgrad=opts.ub_overlap_rs_dgrad,
        ub_bulk_dgrad=not opts.no_ub_bulk_dgrad,
        ub_bulk_wgrad=not opts.no_ub_bulk_wgrad,
        fp8=opts.fp8,
        fp8_recipe=recipe_from_name(fp8_recipe_name) if opts.fp8 else None,
        force_library_path=opts.force_library_path,
        params_dtype=dtype,
        device=device,
        seed=opts.seed,
    )
    if dp_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(
            model,
            process_group=dp_group,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
    optim = make_optimizer(model.parameters(), opts.lr, device)

    # This replica's fixed batch and target, [seq, batch, hidden] with the sequence sharded
    # across the TP group (drawn on the CPU: identical for every build and device).
    gen = torch.Generator(device="cpu").manual_seed(opts.seed * 1000 + dp_rank)
    shape = (opts.seq_length, opts.batch_size, hidden)
    x_full = torch.randn(shape, generator=gen)
    y_full = torch.randn(shape, generator=gen)
    x = x_full.chunk(tp_size, 0)[tp_rank].to(device=device, dtype=dtype).contiguous()
    # The target in the activations' dtype: the loss reads both in place (torch's MSE
    # accumulates in float32) instead of a float32 copy of the output per step, which
    # cost about 0.68 ms of a 10.9 ms bf16 step (bench/RESULTS.md, 2026-11-24).
    target = y_full.chunk(tp_size, 0)[tp_rank].to(device=device, dtype=dtype).contiguous()
    del x_full, y_full

    # One micro-batch per optimizer step: is_first_microbatch=True casts the FP8 weights
    # once per step (TE's semantics). Eager: the model called directly (a wrapper module
    # would add a module call's host time to every step).
    forward = functools.partial(model, is_first_microbatch=True)
    if opts.cuda_graph:
        # make_graphed_callables runs its own warm-up iterations (forward + backward through
        # torch.autograd.grad: no .grad is touched), which are also the library ops' first
        # eager calls, then captures one forward and one backward graph. x is the static
        # input (it needs no gradient); the loss and the optimizer stay outside the graph.
        dist_print("|-- Capturing forward and backward (torch.cuda.make_graphed_callables)")
        # Garbage collected first (torch no longer does it when a capture begins): a
        # collection during the capture could free objects whose release is not capturable.
        gc.collect()
        torch.cuda.synchronize()
        # Delayed scaling: every role primed on the real batch first, and its state put
        # back after the warm-up's passes on uninitialised gradients (TE's
        # make_graphed_callables saves and restores its FP8 state the same way).
        _prime_delayed_states(model, forward, x, target, tp_size)
        with keep_delayed_states(model):
            forward = torch.cuda.make_graphed_callables(_FirstMicrobatch(model), (x,))
        torch.cuda.synchronize()

    def step(verbose: bool = False) -> torch.Tensor:
        """One training step; returns the output (detached) for the logged loss."""
        optim.zero_grad(set_to_none=True)
        if verbose:
            dist_print("|-- Forward pass")
        out = forward(x)
        if verbose:
            dist_print("|-- Compute loss")
        # Mean over this rank's tokens; the loss of the replica is the mean over its TP
        # ranks (equal shards). Every rank's backward adds its loss's gradient to the TP
        # region's shared gradients, so each backpropagates 1/tp of it.
        loss = F.mse_loss(out, target)
        if verbose:
            dist_print("|-- Backward pass")
        (loss / tp_size if tp_size > 1 else loss).backward()
        if verbose:
            dist_print("|-- Optimizer step")
        optim.step()
        return out.detach()

    cuda = device.type == "cuda"
    losses: List[float] = []
    times: List[float] = []
    host: List[float] = []
    world = dist.get_world_size()
    # As a training loop runs (no synchronisation per step), with at most IN_FLIGHT steps
    # queued: before step i the host waits for step i - IN_FLIGHT to finish, outside the
    # timed region. The GPU then never waits for the host between steps (the host enqueues a
    # step in a fraction of its GPU time), so step_ms (CUDA events around each step) is the
    # step's GPU time in a steady stream, and host_ms (perf_counter from the step's start to
    # its last enqueue) is pure enqueue time: no launch blocks on a full queue. The losses
    # stay on the device until the loop ends.
    events = []
    loss_dev = []
    for it in range(opts.iters):
        verbose = opts.verbose or it < 2
        if verbose:
            dist_print(f"Iter {it + 1}")
        if cuda and it >= IN_FLIGHT:
            events[it - IN_FLIGHT][1].synchronize()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = step(verbose)
        t1 = time.perf_counter()  # the step's last enqueue (nothing above synchronizes)
        if cuda:
            end.record()
            events.append((start, end))
        # Outside the timed region: the loss in float32 (the step's own is bf16-rounded, too
        # coarse to compare builds), summed over every rank (DP replicas included). Kept as
        # a one-element copy: the loss as mse_loss returns it kept its 128 MiB float32
        # buffer alive (measured on one H100 with torch 2.11: 128 MiB more memory every
        # step, and the next step's buffers at new addresses each time).
        l = F.mse_loss(out.float(), target.float()).reshape(()).clone()
        dist.all_reduce(l, group=dist.group.WORLD)
        loss_dev.append(l)
        if not cuda:
            times.append((t1 - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in events]
    losses = [v / world for v in torch.stack([l.reshape(()) for l in loss_dev]).double().cpu().tolist()]
    for it in range(opts.iters):
        if (it + 1) % opts.log_every == 0 or it == opts.iters - 1:
            dist_print(f"Iter {it + 1}: loss {losses[it]:.6f}  step {times[it]:.3f} ms")

    first = opts.warmup if len(times) > opts.warmup else len(times) - 1
    step_ms, host_ms = _max_over_ranks(
        [statistics.fmean(times[first:]), statistics.fmean(host[first:])], device
    )
    n = len(times) - first
    dist_print(f"Mean step time: {step_ms:.3f} ms over {n} iterations (max over ranks, warm-up excluded)")
    dist_print(f"Mean host time per step: {host_ms:.3f} ms (to the last enqueue; max over ranks)")
    hs = sorted(host[first:])
    dist_print(f"Host ms per step on this rank: median {statistics.median(hs):.3f}, min {hs[0]:.3f}, "
               f"max {hs[-1]:.3f}", all_ranks=True)
    host_median = _max_over_ranks([statistics.median(hs)], device)[0]
    result = {
        "mode": mode,
        "fp8": int(opts.fp8),
        "recipe": recipe,
        "graph": int(opts.cuda_graph),
        "forced": int(opts.force_library_path),
        "tp": tp_size,
        "dp": dp_size,
        "step_ms": step_ms,
        "host_ms": host_ms,
        "host_ms_median": host_median,
        "final_loss": losses[-1],
        "losses": losses,
    }
    if opts.profile:
        dist_print(f"|-- Profiling {opts.profile_steps} steps (torch.profiler, a separate pass)")
        mine = profile_steps(step, opts.profile_steps, opts.profile_trace)
        med = median_steps(mine["steps"])
        vals = _max_over_ranks([med[k] for k in PROFILE_KEYS] + [mine["unassigned"], len(mine["steps"])], device)
        prof = dict(zip(PROFILE_KEYS, vals[: len(PROFILE_KEYS)]))
        prof["unassigned"] = int(vals[len(PROFILE_KEYS)])
        prof["steps"] = int(vals[len(PROFILE_KEYS) + 1])
        result["profile"] = prof
        dist_print(
            f"Step breakdown (median of {prof['steps']} profiled steps, max over ranks; step and host "
            f"from the timed iterations):\n"
            f"    step ms          {step_ms:9.3f}\n"
            f"    host ms          {host_ms:9.3f}   (host / GPU busy {host_ms / max(prof['gpu_busy_ms'], 1e-9):.2f})\n"
            f"    GPU busy ms      {prof['gpu_busy_ms']:9.3f}\n"
            f"    GEMM ms          {prof['gemm_ms']:9.3f}\n"
            f"    comm ms          {prof['comm_ms']:9.3f}   (exposed {prof['comm_exposed_ms']:.3f}, "
            f"hidden {prof['comm_hidden_ms']:.3f})\n"
            f"    kernels / step   {prof['kernels']:9.0f}   (+ {prof['copies']:.0f} memcpy / memset)"
        )
        if prof["unassigned"]:
            dist_print(f"warning: {prof['unassigned']} device operations of the profiled window fell in no step")
        if WORLD_RANK == 0:
            print(profile_line(result), flush=True)
    if opts.host_profile:
        dist_print(f"|-- Host profile of {opts.host_profile} steps (cProfile, a separate pass)")
        report = host_profile(step, opts.host_profile, cuda, opts.host_profile_out, int(os.environ.get("TE_COMM_HOST_PROFILE_TOP", "30")))
        if WORLD_RANK == 0:
            print(report, flush=True)
    if WORLD_RANK == 0:
        print(result_line(result), flush=True)
    return result


def host_profile(step, steps: int, cuda: bool, out: Optional[str], top: int = 30) -> str:
    """Run ``steps`` steps under cProfile (every rank: the steps' collectives need them
    all); return this rank's table of the ``top`` functions by own time, per step."""
    import cProfile
    import pstats

    step()  # not profiled: the profiler's first calls
    if cuda:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    if out:
        prof.dump_stats(f"{out}.rank{WORLD_RANK}")
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = name if file == "~" else f"{os.path.basename(file)}:{line}({name})"
        rows.append((tt, ct, nc, where))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [
        f"HOSTPROFILE rank {WORLD_RANK}: {total / steps * 1e6:.0f} us of profiled host time per step "
        f"(cProfile inflates it); top {top} by own time",
        f"{'own us/step':>12} {'cum us/step':>12} {'calls/step':>10}  function",
    ]
    for tt, ct, nc, where in rows[:top]:
        lines.append(f"{tt / steps * 1e6:12.1f} {ct / steps * 1e6:12.1f} {nc / steps:10.1f}  {where}")
    return "\n".join(lines)


def _max_over_ranks(values: List[float], device: torch.device) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def _head(r: dict) -> str:
    return (
        f"mode={r['mode']} fp8={r['fp8']} recipe={r['recipe']} graph={r['graph']} forced={r['forced']} "
        f"tp={r['tp']} dp={r['dp']}"
    )


def result_line(r: dict) -> str:
    return (
        f"RESULT {_head(r)} step_ms={r['step_ms']:.4f} host_ms={r['host_ms']:.4f} "
        + (f"host_ms_median={r['host_ms_median']:.4f} " if "host_ms_median" in r else "")
        + f"final_loss={r['final_loss']:.6f} losses={','.join(f'{v:.6f}' for v in r['losses'])}"
    )


def profile_line(r: dict) -> str:
    p = r["profile"]
    return (
        f"PROFILE {_head(r)} steps={p['steps']} step_ms={r['step_ms']:.4f} host_ms={r['host_ms']:.4f} "
        f"gpu_busy_ms={p['gpu_busy_ms']:.4f} gemm_ms={p['gemm_ms']:.4f} comm_ms={p['comm_ms']:.4f} "
        f"comm_exposed_ms={p['comm_exposed_ms']:.4f} comm_hidden_ms={p['comm_hidden_ms']:.4f} "
        f"kernels={p['kernels']:g} copies={p['copies']:g} unassigned={p['unassigned']}"
    )


def cleanup() -> None:
    """Release the library's objects, then the process groups."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        te_comm_modules.destroy_module_userbuffers()
        import transformer_engine_comm.torch as tec

        tec.destroy_userbuffers()
        tec.destroy_contexts()
    except ImportError:
        pass
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    opts = parse_args(argv)
    train(opts)  # an exception ends the process: torchrun then stops the other ranks
    cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
