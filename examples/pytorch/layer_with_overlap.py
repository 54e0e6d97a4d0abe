#!/usr/bin/env python3
"""Train a tensor-parallel LayerNormMLP with comm/GEMM overlap (TE's te_layer_with_overlap.py
workflow, on transformer_engine_comm).

    torchrun --nnodes=1 --nproc-per-node=$(nvidia-smi -L | wc -l) \\
        examples/pytorch/layer_with_overlap.py [--fp8] [--no-comm-overlap] [--num-replicas N]

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

Output: TE-style progress lines (``[rank0:node0] |-- Forward pass`` ...) for the first
iterations (every iteration with ``--verbose``), the loss every ``--log-every`` iterations,
the mean step time (CUDA events around forward + backward + optimizer step, warm-up
iterations excluded, the maximum over ranks) and, last, one machine-readable line:

    RESULT mode=<overlap|no-overlap> fp8=<0|1> tp=<n> dp=<n> step_ms=<x> final_loss=<y> losses=<l1,l2,...>
"""

from __future__ import annotations

import argparse
import os
import sys
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

WORLD_RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
LOCAL_SIZE = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
NODE_ID = WORLD_RANK // max(LOCAL_SIZE, 1)


def dist_print(msg: str, *, all_ranks: bool = False, end: str = "\n") -> None:
    """Print ``[rank<r>:node<n>] msg`` on world rank 0 (every rank with all_ranks)."""
    if all_ranks or WORLD_RANK == 0:
        print(f"[rank{WORLD_RANK}:node{NODE_ID}] {msg}", end=end, flush=True)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a tensor-parallel LayerNormMLP with comm/GEMM overlap (transformer_engine_comm)."
    )
    # Defaults: 8192 tokens, hidden 4096, ffn 16384 -- a size where communication matters.
    p.add_argument("-s", "--seq-length", type=int, default=2048, help="sequence length (sharded over the TP group)")
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-n", "--num-heads", type=int, default=32)
    p.add_argument("-d", "--head-dim", type=int, default=128, help="hidden = num_heads * head_dim")
    p.add_argument("--ffn-mult", type=int, default=4, help="ffn_hidden = ffn_mult * hidden")
    p.add_argument("-i", "--iters", type=int, default=20, help="training iterations")
    p.add_argument("--warmup", type=int, default=3, help="iterations excluded from the mean step time")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-4,
                   help="Adam learning rate (1e-4: a smooth fall at the default size; 1e-3 overshoots there)")
    p.add_argument("--fp8", action="store_true", help="FP8 (e4m3, per-tensor current scaling) forward GEMMs")
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
                   help="cpu: gloo + CPU tensors, reference build only (for smoke tests)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter / activation dtype")
    opts = p.parse_args(argv)
    if opts.iters < 1:
        p.error("--iters must be >= 1")
    if opts.log_every < 1:
        p.error("--log-every must be >= 1")
    if opts.num_replicas < 1:
        p.error("--num-replicas must be >= 1")
    if opts.device == "cpu" and not opts.no_comm_overlap:
        p.error("--device cpu runs the reference build only: add --no-comm-overlap")
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


# ----------------------------------------------------------------------------- training


def train(opts: argparse.Namespace) -> dict:
    """Build the model, train ``opts.iters`` iterations; returns
    ``{"mode", "fp8", "tp", "dp", "step_ms", "final_loss", "losses"}`` (losses: the mean
    loss over all ranks, per iteration). Needs torch.distributed initialised (or
    initialises it from torchrun's environment). Leaves the process groups alive."""
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
    dist_print(
        f"Config: mode={mode} fp8={int(opts.fp8)} tp={tp_size} dp={dp_size} seq={opts.seq_length} "
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
    optim = torch.optim.Adam(model.parameters(), lr=opts.lr)

    # This replica's fixed batch and target, [seq, batch, hidden] with the sequence sharded
    # across the TP group (drawn on the CPU: identical for every build and device).
    gen = torch.Generator(device="cpu").manual_seed(opts.seed * 1000 + dp_rank)
    shape = (opts.seq_length, opts.batch_size, hidden)
    x_full = torch.randn(shape, generator=gen)
    y_full = torch.randn(shape, generator=gen)
    x = x_full.chunk(tp_size, 0)[tp_rank].to(device=device, dtype=dtype).contiguous()
    target = y_full.chunk(tp_size, 0)[tp_rank].to(device=device, dtype=torch.float32).contiguous()
    del x_full, y_full

    cuda = device.type == "cuda"
    losses: List[float] = []
    times: List[float] = []
    world = dist.get_world_size()
    for it in range(opts.iters):
        verbose = opts.verbose or it < 2
        if verbose:
            dist_print(f"Iter {it + 1}")
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        if verbose:
            dist_print("|-- Forward pass")
        out = model(x)
        if verbose:
            dist_print("|-- Compute loss")
        # Mean over this rank's tokens; the loss of the replica is the mean over its TP
        # ranks (equal shards). Every rank's backward adds its loss's gradient to the TP
        # region's shared gradients, so each backpropagates 1/tp of it.
        loss = F.mse_loss(out.float(), target)
        if verbose:
            dist_print("|-- Backward pass")
        (loss / tp_size).backward()
        if verbose:
            dist_print("|-- Optimizer step")
        optim.step()
        if cuda:
            end.record()
        # Outside the timed region: the loss averaged over every rank (DP replicas included).
        l = loss.detach().clone()
        dist.all_reduce(l, group=dist.group.WORLD)
        losses.append(l.item() / world)
        if cuda:
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        if (it + 1) % opts.log_every == 0 or it == opts.iters - 1:
            dist_print(f"Iter {it + 1}: loss {losses[-1]:.6f}  step {times[-1]:.3f} ms")

    timed = times[opts.warmup:] if len(times) > opts.warmup else times[-1:]
    step_ms = sum(timed) / len(timed)
    t = torch.tensor([step_ms], dtype=torch.float64, device=device if opts.device == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step_ms = float(t.item())
    dist_print(f"Mean step time: {step_ms:.3f} ms over {len(timed)} iterations (max over ranks, warm-up excluded)")
    result = {
        "mode": mode,
        "fp8": int(opts.fp8),
        "tp": tp_size,
        "dp": dp_size,
        "step_ms": step_ms,
        "final_loss": losses[-1],
        "losses": losses,
    }
    if WORLD_RANK == 0:
        print(result_line(result), flush=True)
    return result


def result_line(r: dict) -> str:
    return (
        f"RESULT mode={r['mode']} fp8={r['fp8']} tp={r['tp']} dp={r['dp']} step_ms={r['step_ms']:.4f} "
        f"final_loss={r['final_loss']:.6f} losses={','.join(f'{v:.6f}' for v in r['losses'])}"
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
