#!/usr/bin/env python3
"""Tensor-parallel MLP training with communication hidden behind the GEMMs, in JAX.

One command, one process driving every local GPU (JAX's default on one host):

    python3 examples/jax/mlp_with_overlap.py                          # bf16, overlap on
    python3 examples/jax/mlp_with_overlap.py --fp8-recipe delayed     # FP8 training, TE's DelayedScaling
    python3 examples/jax/mlp_with_overlap.py --fp8-recipe current     # FP8, current scaling (--fp8: the same)
    python3 examples/jax/mlp_with_overlap.py --fp8-recipe block       # FP8 block scaling (the library's casts and GEMM)
    python3 examples/jax/mlp_with_overlap.py --fp8-recipe block --compare-bf16  # bf16 first, then block: the ratio
    python3 examples/jax/mlp_with_overlap.py --no-comm-overlap        # XLA's all_gather / psum_scatter
    python3 examples/jax/mlp_with_overlap.py --builds xla,layers,library --profile

Several processes, one GPU each (e.g. across nodes: the TP group must stay inside a node):

    python3 examples/jax/mlp_with_overlap.py --coordinator HOST:PORT --num-processes N --process-id I

The MLP is ``row(gelu(column(x)))`` with sequence parallelism: the column layer's forward
all-gathers the tokens inside its GEMM (``all_gather_gemm``), the row layer's
reduce-scatters its output inside its GEMM (``gemm_reduce_scatter``); the backward pass
swaps them. Both run inside ``jax.jit(shard_map(...))`` over a ``tp`` mesh axis.

Builds (``--builds``, comma-separated; each prints its loss and step time and a final
``RESULT`` line): ``layers`` (the library's layers; at tp 1 they lower to XLA's own dot,
since nothing is communicated), ``library`` (the same layers with the library's custom
calls forced, ``library=True``: their overhead at tp 1 stays measurable), ``xla`` (XLA's
collectives and dots, bf16: the reference build; ``--no-comm-overlap``). Default:
``layers``, plus ``library`` at tp 1. ``--compare-bf16`` (with an FP8 recipe) runs the bf16
``layers`` build first, in the same process, and prints each FP8 build's step time and
final loss against it.

``--profile``: a ``jax.profiler`` trace of a few steps per build, read back from its
Perfetto JSON: step ms, GPU-busy ms (the union of the GPU's kernel and copy intervals),
GEMM ms, communication ms (exposed: no other kernel running; hidden: under another
kernel), host ms (the host's launch of the step, from the trace's execute events) and
kernels per step. Kernels are classified by name: GEMM (cutlass, cublas, sm90_xmma,
nvjet, gemm), communication (nccl and the library's comm kernels), other.
"""
import argparse
import glob
import gzip
import json
import os
import re
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (NVLS)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402


GEMM_RE = re.compile(r"cutlass|cublas|sm\d+_xmma|nvjet|gemm|matmul", re.I)
COMM_RE = re.compile(r"nccl|put_bytes|signal_flags|wait_flags|wait_arrival|copy_segments|begin_call|^reduce_|"
                     r"memcpy.*(p2p|ptop|peer)", re.I)
HOST_RE = re.compile(r"Execute(Helper)?$|ExecuteSharded|::Execute\b|LaunchOnDevice|ExecuteOnLocalDevices", re.I)


def _union(iv):
    iv = sorted(iv)
    out = []
    for a, b in iv:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(iv):
    return sum(b - a for a, b in iv)


def _intersect(x, y):
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append([a, b])
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def gemm_census(hlo):
    """The GEMMs of a compiled program (its optimized HLO text): XLA's FP8 GEMMs (cuBLASLt's
    ``__cublas$lt$matmul$f8`` calls and Triton GEMM fusions with FP8 operands), XLA's
    other GEMMs (cuBLAS / cuBLASLt calls, Triton GEMM fusions), the library's calls."""
    fp8 = other = lib = 0
    for line in hlo.splitlines():
        m = re.search(r'custom_call_target="([^"]+)"', line)
        if m and m.group(1).startswith("te_comm_"):
            lib += 1
            continue
        if m and m.group(1).startswith("__cublas$"):
            ops = line.split("custom-call(", 1)[-1].split(")", 1)[0]
        elif re.search(r"\bfusion\(", line) and re.search(r'"kind":"__triton(_nested)?_gemm', line):
            ops = line.split("fusion(", 1)[1].split("), kind=", 1)[0]
        else:
            continue
        if (m and m.group(1) == "__cublas$lt$matmul$f8") or re.search(r"\bf8e\w+\[", ops):
            fp8 += 1
        else:
            other += 1
    return dict(xla_fp8_gemms=fp8, xla_gemms=other, library_calls=lib)


def trace_breakdown(trace_dir, steps):
    """Per-step figures from the Perfetto JSON that jax.profiler wrote under trace_dir (the
    first GPU's kernels, and the host's events)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise SystemExit(f"--profile: no *.trace.json.gz under {trace_dir}")
    with gzip.open(max(files, key=os.path.getmtime), "rt") as f:
        tr = json.load(f)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in pname.items() if re.search(r"/device:GPU|GPU:\d|gpu", n, re.I)}
    # One device's timeline (the lowest-numbered GPU): with several devices in this process
    # their kernels overlap each other, and a union across them would count one device's
    # communication as hidden behind another's GEMM.
    index = lambda p: int(m.group(1)) if (m := re.search(r"GPU:(\d+)", pname[p])) else 1 << 30  # noqa: E731
    gpu = set(sorted(gpu, key=lambda p: (index(p), p))[:1])
    kern, host = [], []
    for e in ev:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e["pid"] in gpu:
            kern.append((e.get("name", ""), iv))
        elif HOST_RE.search(e.get("name", "")):
            host.append((e.get("name", ""), iv))
    if not kern:
        raise SystemExit(f"--profile: no GPU events in the trace (processes: {sorted(set(pname.values()))})")
    allk = _union([iv for _, iv in kern])
    gemm = _union([iv for n, iv in kern if GEMM_RE.search(n)])
    comm = _union([iv for n, iv in kern if COMM_RE.search(n)])
    other = _union([iv for n, iv in kern if not COMM_RE.search(n)])
    hidden = _length(_intersect(comm, other))
    ms = 1e-3 / steps
    per_name = {}
    for n, (t0, t1) in kern:
        per_name[n] = per_name.get(n, 0.0) + (t1 - t0) * ms
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    return dict(top_kernels=[(n[:60], round(v, 3)) for n, v in top],gpu_busy=_length(allk) * ms, gemm=_length(gemm) * ms, comm=_length(comm) * ms,
                comm_hidden=hidden * ms, comm_exposed=(_length(comm) - hidden) * ms,
                host=_length(_union([iv for _, iv in host])) * ms, kernels=len(kern) / steps,
                host_events=sorted({n for n, _ in host})[:4])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (all TP ranks together)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fp8", action="store_true", help="FP8 training, current scaling (= --fp8-recipe current)")
    p.add_argument("--fp8-recipe", choices=("delayed", "current", "block"),
                   help="FP8 training with TE's recipe: delayed / current (HYBRID) or block (Float8BlockScaling: "
                        "e4m3, 1x128 / 128x128 blocks; the library's block quantize kernel and block-scaled FP8 "
                        "GEMM on a GPU, XLA's collectives at tp > 1)")
    p.add_argument("--block-gemm", choices=("auto", "library", "dequant"), default="auto",
                   help="--fp8-recipe block's GEMMs: the library's block-scaled FP8 GEMM custom call (auto: on a "
                        "GPU where the shapes fit cuBLASLt's rules; library: always) or the dot of the dequantized "
                        "operands (dequant, the reference)")
    p.add_argument("--block-casts", choices=("auto", "library", "jnp"), default="auto",
                   help="--fp8-recipe block's casts: the library's block quantize kernel custom call (auto: where "
                        "the GEMMs run on the library and the tensor is whole 128x128 tiles; library: wherever it is "
                        "whole tiles) or the jnp casts (jnp, the reference)")
    p.add_argument("--compare-bf16", action="store_true",
                   help="with an FP8 recipe: run the bf16 layers build first and print the FP8 step time / final "
                        "loss against it")
    p.add_argument("--amax-history-len", type=int, default=1024, help="delayed scaling's history (TE's default)")
    p.add_argument("--no-comm-overlap", action="store_true", help="XLA's collectives, then the GEMMs (= --builds xla)")
    p.add_argument("--builds", help="comma-separated: layers, library, xla (default: layers, + library at tp 1)")
    p.add_argument("--profile", action="store_true", help="a step breakdown from a jax.profiler trace")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--profile-dir", help="where the trace goes (default: a temporary directory)")
    p.add_argument("--coordinator", help="HOST:PORT of jax.distributed (multi-process)")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import jax

    if a.coordinator:
        jax.distributed.initialize(a.coordinator, num_processes=a.num_processes, process_id=a.process_id)
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import transformer_engine_comm.jax as tj

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    tp = mesh.shape["tp"]
    T, H, F = a.tokens, a.hidden, a.ffn
    if T % tp or F % tp:
        raise SystemExit(f"--tokens {T} and --ffn {F} must divide by tp = {tp}")
    recipe_name = a.fp8_recipe or ("current" if a.fp8 else None)
    if recipe_name == "delayed":
        recipe = tj.DelayedScaling(amax_history_len=a.amax_history_len)
    elif recipe_name == "current":
        recipe = tj.CurrentScaling()
    elif recipe_name == "block":
        recipe = tj.Float8BlockScaling()
        tj.fp8.BLOCK_GEMM = a.block_gemm  # read when the step is traced
        tj.fp8.BLOCK_CASTS = a.block_casts
    else:
        recipe = None
    if a.builds:
        builds = [b.strip() for b in a.builds.split(",") if b.strip()]
    elif a.no_comm_overlap:
        builds = ["xla"]
    else:
        builds = ["layers"] + (["library"] if tp == 1 else [])
    for b in builds:
        if b not in ("layers", "library", "xla"):
            raise SystemExit(f"--builds: {b!r} is not layers, library or xla")
    if recipe_name == "block":
        # The layers run block scaling on the library's block-scaled FP8 GEMM (the
        # te_comm_block_gemm custom call) with XLA's collectives around it (the library has no
        # block-scaled comm-GEMM yet): a forced library build would run the same program.
        if "library" in builds and a.builds:
            raise SystemExit("--fp8-recipe block: the library build has no block-scaled GEMM; use --builds layers")
        builds = [b for b in builds if b != "library"]
    # (build, recipe) in run order: the bf16 layers build first with --compare-bf16
    runs = [(b, recipe if b != "xla" else None) for b in builds]
    if a.compare_bf16 and recipe is not None:
        runs.insert(0, ("layers", None))
    ctx = tj.tp_context(mesh, "tp") if any(b != "xla" for b, _ in runs) else None
    bf = jnp.bfloat16
    specs = (P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P())

    def xla_layers(x, w1, b1, w2, b2, meta):
        xt = jax.lax.all_gather(x, "tp", tiled=True)
        h = jax.nn.gelu(xt @ w1.T + b1, approximate=True)
        return jax.lax.psum_scatter(h @ w2.T, "tp", scatter_dimension=0, tiled=True) + b2

    def make_step(build, fp8):
        if build == "xla":
            layers = xla_layers
        else:
            lib = True if build == "library" else None

            def layers(x, w1, b1, w2, b2, meta):
                return tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=fp8 or False, fp8_meta=meta, library=lib)

        model = tj.tp_shard_map(layers, mesh, specs + (P(),), P("tp", None), ctx=ctx)
        delayed = fp8 is not None and fp8.delayed

        def loss_fn(params, meta, x, y):
            out = model(x, *params, meta).astype(jnp.float32)
            return jnp.mean((out - y) ** 2)

        @jax.jit
        def step(params, meta, x, y):
            if delayed:
                loss, (grads, meta_g) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta, x, y)
                meta = tj.fp8_meta_update(meta_g, fp8)
            else:
                loss, grads = jax.value_and_grad(loss_fn)(params, meta, x, y)
            new = tuple((p.astype(jnp.float32) - a.lr * g.astype(jnp.float32)).astype(p.dtype)
                        for p, g in zip(params, grads))
            return new, meta, loss

        meta0 = tj.fp8_meta_init(fp8, 2) if delayed else None
        return step, meta0, ("bf16" if fp8 is None else f"fp8 {recipe_name}")

    rng = np.random.default_rng(a.seed)

    def glob_arr(arr, spec, dtype):
        s = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(arr.shape, s, lambda idx: jnp.asarray(arr[idx], dtype))

    w1 = rng.standard_normal((F, H), np.float32) * H**-0.5
    w2 = rng.standard_normal((H, F), np.float32) * F**-0.5
    params0 = (glob_arr(w1, specs[1], bf), glob_arr(np.zeros(F, np.float32), specs[2], bf),
               glob_arr(w2, specs[3], bf), glob_arr(np.zeros(H, np.float32), specs[4], bf))
    x = glob_arr(rng.standard_normal((T, H), np.float32), specs[0], bf)
    target = glob_arr(np.tanh(rng.standard_normal((T, H), np.float32)), P("tp", None), jnp.float32)

    print(f"tp = {tp} ({jax.devices()[0].device_kind}), tokens {T}, hidden {H}, ffn {F}; builds {builds}", flush=True)
    results = []
    for build, rec in runs:
        step, meta, prec = make_step(build, rec)
        params = params0
        if rec is not None and rec.block:
            via = (f" (block casts: {a.block_casts}, block GEMM: {a.block_gemm}"
                   f"{', XLA collectives' if tp > 1 else ''})")
        else:
            via = " (XLA's dot at tp 1)" if tp == 1 else " (library)"
        name = {"layers": "layers" + via,
                "library": "layers, library forced", "xla": "XLA collectives + dots"}[build]
        print(f"--- {name}, {prec}", flush=True)
        # Step 1 compiles; then a steady stream with at most two steps queued (no per-step
        # synchronisation): a step's time is the interval between consecutive completions
        # (its GPU time when the GPU never waits for the host), host ms the enqueue time.
        t0 = time.perf_counter()
        params, meta, loss = step(params, meta, x, target)
        jax.block_until_ready(loss)
        first_ms = (time.perf_counter() - t0) * 1e3
        losses, queued, done, host = [loss], [], [], []
        for i in range(1, a.steps):
            t0 = time.perf_counter()
            params, meta, loss = step(params, meta, x, target)
            host.append(time.perf_counter() - t0)
            losses.append(loss)
            queued.append(loss)
            while len(queued) > 2 or (i == a.steps - 1 and queued):
                jax.block_until_ready(queued.pop(0))
                done.append(time.perf_counter())
        losses = [float(v) for v in losses]
        for i, v in enumerate(losses):
            if i < 3 or i % 10 == 9 or i == a.steps - 1:
                print(f"step {i + 1:4d}  loss {v:.6f}", flush=True)
        k = 2 if len(done) > 4 else 0  # the stream's first completions still carry the start
        med = (done[-1] - done[k]) / (len(done) - 1 - k) * 1e3 if len(done) > k + 1 else float("nan")
        host_ms = sorted(host)[len(host) // 2] * 1e3 if host else float("nan")
        print(f"step time {med:.2f} ms (steady stream, at most 2 steps queued; host enqueue {host_ms:.2f} ms; "
              f"first step with compilation {first_ms:.0f} ms); loss {losses[0]:.6f} -> {losses[-1]:.6f}", flush=True)
        if not losses[-1] < losses[0] or not np.isfinite(losses[-1]):
            raise SystemExit(f"{build}: the loss did not decrease")
        row = dict(build=build, precision=prec, step_ms=med, host_enqueue_ms=host_ms, final_loss=losses[-1])
        if a.profile:
            # What XLA compiled: its cuBLASLt FP8 GEMMs, its other GEMMs, the library's calls.
            hlo = step.lower(params, meta, x, target).compile().as_text()
            row.update(gemm_census(hlo))
            print(f"compiled step: {row['xla_fp8_gemms']} XLA FP8 GEMMs, {row['xla_gemms']} other XLA GEMMs, "
                  f"{row['library_calls']} library custom calls", flush=True)
            d = a.profile_dir or tempfile.mkdtemp(prefix="te_comm_jax_trace_")
            d = os.path.join(d, f"{build}-{prec.replace(' ', '-')}")
            jax.block_until_ready(params)
            n = a.profile_steps
            with jax.profiler.trace(d, create_perfetto_trace=True):
                t0 = time.perf_counter()
                for i in range(n):
                    with jax.profiler.StepTraceAnnotation("train", step_num=i):
                        params, meta, loss = step(params, meta, x, target)
                jax.block_until_ready((params, loss))
                wall = (time.perf_counter() - t0) * 1e3 / n
            bd = trace_breakdown(d, n)
            row.update(profiled_step_ms=wall, **{k: v for k, v in bd.items() if k not in ("host_events", "top_kernels")})
            print(f"profile ({n} steps, trace {d}): step {wall:.2f} ms, GPU busy {bd['gpu_busy']:.2f} ms, "
                  f"GEMM {bd['gemm']:.2f} ms, communication {bd['comm']:.2f} ms (exposed {bd['comm_exposed']:.2f}, "
                  f"hidden {bd['comm_hidden']:.2f}), host {bd['host']:.2f} ms (events {bd['host_events']}), "
                  f"kernels {bd['kernels']:.0f} per step", flush=True)
            print("top kernels (ms a step): " + "; ".join(f"{n} {v:.3f}" for n, v in bd["top_kernels"]), flush=True)
        print("RESULT " + json.dumps(row), flush=True)
        results.append(row)
    if a.compare_bf16 and len(results) > 1 and results[0]["precision"] == "bf16":
        b = results[0]
        for r in results[1:]:
            print(f"COMPARE {r['build']} {r['precision']} vs bf16: step {r['step_ms']:.2f} / {b['step_ms']:.2f} ms = "
                  f"{r['step_ms'] / b['step_ms']:.3f}x; final loss {r['final_loss']:.6f} vs {b['final_loss']:.6f} "
                  f"({(r['final_loss'] / b['final_loss'] - 1) * 100:+.2f} %)", flush=True)
    if len(results) > 1:
        base = results[0]["step_ms"]
        print("\n| build | precision | step ms | vs first | final loss |\n|---|---|---|---|---|")
        for r in results:
            print(f"| {r['build']} | {r['precision']} | {r['step_ms']:.2f} | {r['step_ms'] / base:.3f}x | "
                  f"{r['final_loss']:.6f} |")
    if ctx is not None:
        ctx.close()


if __name__ == "__main__":
    main()
