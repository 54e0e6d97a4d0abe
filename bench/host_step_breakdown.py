#!/usr/bin/env python3
"""Where the host time of a training step goes, by phase and by function: the example's
LayerNormMLP step (zero_grad, forward, MSE loss, backward, fused Adam) at the tp-4 per-rank
shape (8192 tokens, hidden 4096, ffn 4096; bf16, or FP8 with ``--fp8-recipe``), tp 1, one
process, one GPU; the library path forced (``force_library_path``) against the torch
reference build.

Pass 1: host µs of each phase (perf_counter around it; at most two steps queued, as the
example runs, so no launch waits on a full queue), median over the steps, and the step's
GPU time (CUDA events), both builds in interleaved rounds (the host's speed drifts). Pass 2:
the same steps with the modules' and the library's Python functions (and a few torch ones)
wrapped by a timer, inclusive µs per step of each and per call (the wrappers add about
0.3 µs a call). The phases' sums are the example's host_ms.

    TE_COMM_LIB=<libtransformer_engine_comm.so> python3 bench/host_step_breakdown.py [--steps 60]
        [--fp8-recipe delayed|current|block]
"""
import argparse
import os
import socket
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
from transformer_engine_comm.torch import modules as M  # noqa: E402
from transformer_engine_comm.torch.optim import LeanFusedAdam  # noqa: E402
from transformer_engine_comm.recipe import recipe_from_name  # noqa: E402

# The example's optimizer (LeanFusedAdam); TE_COMM_BREAKDOWN_TORCH_ADAM=1: torch's fused Adam.
LEAN = os.environ.get("TE_COMM_BREAKDOWN_TORCH_ADAM", "0") in ("", "0")
# TE_COMM_BREAKDOWN_LOG_LOSS=1: between steps, the example's loss logging (an fp32 MSE and an
# all-reduce of it, outside the timed region), whose host work also runs between its steps.
LOG_LOSS = os.environ.get("TE_COMM_BREAKDOWN_LOG_LOSS", "0") not in ("", "0")
GC_COUNT = [0, 0, 0]


def _gc_cb(phase, info):
    if phase == "start":
        GC_COUNT[info["generation"]] += 1


import gc  # noqa: E402

gc.callbacks.append(_gc_cb)
if os.environ.get("TE_COMM_BREAKDOWN_NO_GC", "0") not in ("", "0"):
    gc.disable()

PHASES = ("zero_grad", "forward", "loss", "backward", "optimizer")


def build(forced: bool, dev, hidden: int, ffn: int, recipe=None):
    torch.manual_seed(1)
    fp8 = {} if recipe is None else {"fp8": True, "fp8_recipe": recipe_from_name(recipe)}
    model = M.LayerNormMLP(hidden, ffn, tp_group=None, sequence_parallel=True, comm_overlap=forced,
                           force_library_path=forced, params_dtype=torch.bfloat16, device=dev, seed=1, **fp8)
    optim = LeanFusedAdam(model.parameters(), lr=1e-4) if LEAN else torch.optim.Adam(model.parameters(), lr=1e-4,
                                                                                      fused=True)
    return model, optim


def run(model, optim, x, target, steps: int):
    """-> ({phase: [µs per step]}, [GPU ms per step])."""
    ph = defaultdict(list)
    events = []
    logged = []
    for it in range(steps):
        if it >= 2:
            events[it - 2][1].synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        out = model(x, is_first_microbatch=True)
        t2 = time.perf_counter()
        loss = F.mse_loss(out, target)
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        optim.step()
        t5 = time.perf_counter()
        e.record()
        events.append((s, e))
        if LOG_LOSS:  # the example's between-step work (outside the timed region)
            lv = F.mse_loss(out.float(), target.float()).reshape(()).clone()  # as the example
            dist.all_reduce(lv)
            logged.append(lv)
        for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            ph[name].append((b - a) * 1e6)
    torch.cuda.synchronize()
    return ph, [a.elapsed_time(b) for a, b in events]


class Timers:
    """Inclusive host time per wrapped function (µs summed over the calls)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.each = defaultdict(list)
        self.undo = []

    def wrap(self, owner, attr: str, label: str, static: bool = False):
        fn = owner.__dict__[attr] if static else getattr(owner, attr)
        inner = fn.__func__ if static else fn
        total, calls, each = self.total, self.calls, self.each

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                dt = (time.perf_counter() - t0) * 1e6
                total[label] += dt
                calls[label] += 1
                each[label].append(dt)

        setattr(owner, attr, staticmethod(timed) if static else timed)
        self.undo.append((owner, attr, fn))

    def restore(self):
        for owner, attr, fn in reversed(self.undo):
            setattr(owner, attr, fn)
        self.undo.clear()
        M._GEMM = None  # (it may hold the wrapper)


def instrument(t: Timers):
    from transformer_engine_comm.torch import gemm as G, ops, userbuffers as U
    for meth in ("forward", "backward"):
        t.wrap(M._MLPFn, meth, f"_MLPFn.{meth}", static=True)
    for name in ("_column_forward", "_row_forward", "_column_grads", "_row_grads", "_column_backward",
                 "_row_backward", "_wgrad", "_gelu_backward", "_get_userbuffer", "_flat", "_dx_reduce",
                 "_bulk_rs_wanted"):
        t.wrap(M, name, f"modules.{name}")
    for name in ("all_gather_gemm", "gemm_reduce_scatter", "gemm_all_reduce"):
        t.wrap(ops, name, f"ops.{name}")
    t.wrap(G, "gemm", "gemm.gemm")
    M._GEMM = None  # the modules keep gemm.gemm once looked up: look the wrapper up
    for name in ("bulk_overlap", "copy_into_buffer", "get_buffer", "split_overlap_ag"):
        t.wrap(U.CommOverlap, name, f"CommOverlap.{name}")
    t.wrap(M.LayerNormMLP, "forward", "LayerNormMLP.forward")
    t.wrap(F, "layer_norm", "F.layer_norm")
    t.wrap(F, "linear", "F.linear")
    t.wrap(F, "gelu", "F.gelu")
    t.wrap(ops._Prepared, "__call__", "ops._Prepared.__call__")
    # FP8 (--fp8-recipe): the casts, their primitives and the FP8 GEMMs and layers.
    from transformer_engine_comm.torch import fp8 as F8
    for name in ("_fp8_gemm", "_column_backward_fp8", "_row_backward_fp8", "_all_reduce", "_all_gather"):
        t.wrap(M, name, f"modules.{name}")
    for name in ("quantize", "compute_amax", "compute_scale_from_amax", "delayed_scaling_update", "transpose",
                 "quantize_block", "block_gemm"):
        if hasattr(F8, name):
            t.wrap(F8, name, f"fp8.{name}")
    t.wrap(F8.Fp8Meta, "cast", "Fp8Meta.cast")
    t.wrap(M._Fp8State, "cast_weight", "_Fp8State.cast_weight")
    t.wrap(torch, "_scaled_mm", "torch._scaled_mm")
    t.wrap(torch, "empty", "torch.empty")
    # The C calls themselves: the prepared comm-GEMM calls' and gemm.py's.
    for pr in ops._fast.values():
        if not hasattr(pr.fn, "_timed"):
            t.undo.append((pr, "fn", pr.fn))
            pr.fn = _timed_c(t, pr.fn, "C nvte_comm_gemm_call_packed")
    for pr in G._plans.values():
        if not hasattr(pr.fn, "_timed"):
            t.undo.append((pr, "fn", pr.fn))
            pr.fn = _timed_c(t, pr.fn, "C nvte_comm_cublas_gemm_packed")


def _timed_c(t: Timers, f, label: str):
    def c_call(*a):
        t0 = time.perf_counter()
        try:
            return f(*a)
        finally:
            dt = (time.perf_counter() - t0) * 1e6
            t.total[label] += dt
            t.calls[label] += 1
            t.each[label].append(dt)

    c_call._timed = True
    return c_call


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=240, help="timed steps per build, over --rounds rounds")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--fp8-recipe", default=None, choices=("delayed", "current", "block"),
                   help="both builds in FP8 with this recipe (default: bf16)")
    p.add_argument("--out", default=None)
    o = p.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", device_id=dev)
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(o.tokens, 1, o.hidden, generator=g).to(dev, torch.bfloat16)
    target = torch.randn(o.tokens, 1, o.hidden, generator=g).to(dev, torch.bfloat16)
    precision = f"FP8 {o.fp8_recipe}" if o.fp8_recipe else "bf16"
    lines = [f"host_step_breakdown: {torch.cuda.get_device_name(0)}, {o.tokens} tokens, hidden {o.hidden}, "
             f"ffn {o.ffn}, {precision}, tp 1, {o.rounds} interleaved rounds of {max(o.steps // o.rounds, 4)} steps a build "
             f"(a warm-up round first; each round's first 2 steps dropped), median µs per step", ""]
    res = {}
    dist_note = []
    prof = {}
    builds = {forced: build(forced, dev, o.hidden, o.ffn, o.fp8_recipe) for forced in (True, False)}
    # Interleaved rounds (the host's speed drifts over seconds): each round runs both
    # builds; the first round is warm-up.
    per = max(o.steps // o.rounds, 4)
    ph_all = {f: defaultdict(list) for f in builds}
    gpu_all = {f: [] for f in builds}
    gcs = {f: [0, 0, 0, 0] for f in builds}  # collections by generation, steps
    for rnd in range(o.rounds + 1):
        for forced, (model, optim) in builds.items():
            g0 = list(GC_COUNT)
            ph, gpu = run(model, optim, x, target, per)
            if rnd:
                for k, v in ph.items():
                    ph_all[forced][k] += v[2:]
                gpu_all[forced] += gpu[2:]
                for i in range(3):
                    gcs[forced][i] += GC_COUNT[i] - g0[i]
                gcs[forced][3] += per
    for forced in builds:
        ph = ph_all[forced]
        res[forced] = ({k: statistics.median(v) for k, v in ph.items()}, statistics.median(gpu_all[forced]))
        tot = sorted(sum(v[i] for v in ph.values()) for i in range(len(ph["forward"])))
        dist_note.append(f"{'forced' if forced else 'reference'}: host µs per step mean {statistics.fmean(tot):.1f}, "
                         f"median {statistics.median(tot):.1f}, min {tot[0]:.1f}, max {tot[-1]:.1f} "
                         f"({len(tot)} steps)")
    for forced, (model, optim) in builds.items():
        t = Timers()
        instrument(t)
        try:
            run(model, optim, x, target, per * 2)
        finally:
            t.restore()
        prof[forced] = sorted(((v / (per * 2), t.calls[k] / (per * 2), statistics.median(t.each[k]), min(t.each[k]), k)
                               for k, v in t.total.items()), reverse=True)
    lines.append("| phase | forced µs | reference µs | forced - reference |")
    lines.append("|---|---|---|---|")
    for k in PHASES:
        a, b = res[True][0][k], res[False][0][k]
        lines.append(f"| {k} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    ta, tb = sum(res[True][0].values()), sum(res[False][0].values())
    lines.append(f"| host, sum | {ta:.1f} | {tb:.1f} | {ta - tb:+.1f} |")
    lines.append(f"| GPU ms per step | {res[True][1]:.3f} | {res[False][1]:.3f} | |")
    lines.append(f"| host / GPU | {ta / 1e3 / res[True][1]:.3f} | {tb / 1e3 / res[False][1]:.3f} | |")
    lines += [""] + dist_note
    for forced in builds:
        c = gcs[forced]
        lines.append(f"{'forced' if forced else 'reference'}: garbage collections per 100 steps, generation 0 / 1 / 2: "
                     f"{100 * c[0] / c[3]:.1f} / {100 * c[1] / c[3]:.1f} / {100 * c[2] / c[3]:.1f}"
                     + (" (collector disabled)" if not gc.isenabled() else ""))
    for forced in (True, False):
        lines += ["", f"{'Forced' if forced else 'Reference'} build, instrumented pass (inclusive µs per step; "
                  "per call: median, min):", "",
                  "| function | µs / step | calls / step | µs / call | min |", "|---|---|---|---|---|"]
        for us, calls, med, mn, k in prof[forced]:
            lines.append(f"| {k} | {us:.1f} | {calls:g} | {med:.1f} | {mn:.1f} |")
    text = "\n".join(lines)
    print(text)
    if o.out:
        with open(o.out, "w") as f:
            f.write(text + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
