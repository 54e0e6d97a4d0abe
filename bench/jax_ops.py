#!/usr/bin/env python3
"""JAX benchmark of the comm-GEMM ops at the anchor shapes (bf16), one process driving all
local GPUs as one TP group (``tp`` = GPU count), against:

- XLA: the same product under ``jax.jit`` with shardings (the SPMD partitioner inserts the
  all-gather before / the reduce-scatter after the dot);
- XLA windowed einsum (collective matmul): the same program compiled with
  ``--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_threshold_for_windowed_einsum_mib=0``
  (measured in a child process, since XLA flags are per process);
- the bound: max(GEMM alone, collective alone), both measured here (the per-device GEMM
  in ``shard_map`` without communication; XLA's all_gather / psum_scatter alone).

Times: each variant is run 10 times back to back and timed to completion (wall clock:
dispatch is asynchronous and far shorter than these ms-scale steps), 3 warm-up rounds,
the median of 9 rounds. Inputs are random normal values; ours is checked against XLA's
result (relative error). Usage: ``python3 bench/jax_ops.py [--out FILE.md] [--quick]``.
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast

WINDOWED = "--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_threshold_for_windowed_einsum_mib=0"


def shapes(tp, quick):
    """(op, tokens, K, N) with per-rank N for AG and per-rank K for RS (the brief's anchors)."""
    ag = [(8192, 8192, 28672 // tp), (8192, 4096, 16384 // tp), (16384, 8192, 8192 // tp)]
    rs = [(8192, 28672 // tp, 8192), (8192, 16384 // tp, 4096), (16384, 8192 // tp, 8192)]
    if quick:
        ag, rs = ag[1:2], rs[1:2]
    return [("ag",) + s for s in ag] + [("rs",) + s for s in rs]


def timeit(f, args, calls=10, rounds=9, warm=3):
    import jax

    for _ in range(warm):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / calls)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def setup(op, T, K, N):
    """Global inputs with their shardings: AG x [T, K] P(tp, None), w [N*tp, K] P(tp, None);
    RS x [T, K*tp] P(None, tp), w [N, K*tp] P(None, tp)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    tp = mesh.shape["tp"]
    key = jax.random.PRNGKey(0)
    if op == "ag":
        xs, ws, os_ = P("tp", None), P("tp", None), P(None, "tp")
        xshape, wshape = (T, K), (N * tp, K)
    else:
        xs, ws, os_ = P(None, "tp"), P(None, "tp"), P("tp", None)
        xshape, wshape = (T, K * tp), (N, K * tp)
    k1, k2 = jax.random.split(key)
    x = jax.jit(lambda k: jax.random.normal(k, xshape, jnp.bfloat16), out_shardings=NamedSharding(mesh, xs))(k1)
    w = jax.jit(lambda k: (jax.random.normal(k, wshape, jnp.float32) * wshape[1] ** -0.5).astype(jnp.bfloat16),
                out_shardings=NamedSharding(mesh, ws))(k2)
    return mesh, x, w, (xs, ws, os_)


def xla_fn(mesh, specs):
    import jax
    from jax.sharding import NamedSharding

    xs, ws, os_ = specs
    return jax.jit(lambda x, w: x @ w.T, in_shardings=(NamedSharding(mesh, xs), NamedSharding(mesh, ws)),
                   out_shardings=NamedSharding(mesh, os_))


def child_windowed(quick, path):
    import jax

    tp = len(jax.devices())
    res = {}
    for op, T, K, N in shapes(tp, quick):
        mesh, x, w, specs = setup(op, T, K, N)
        res[f"{op} {T} {K} {N}"] = timeit(xla_fn(mesh, specs), (x, w))
    with open(path, "w") as f:
        json.dump(res, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="one AG and one RS shape")
    p.add_argument("--child-windowed", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_windowed:
        return child_windowed(a.quick, a.child_windowed)

    # XLA's windowed einsum first, in a child process (its flags are process-wide).
    tmp = f"/tmp/te_comm_jax_windowed_{os.getpid()}.json"
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + WINDOWED).strip())
    cmd = [sys.executable, os.path.abspath(__file__), "--child-windowed", tmp] + (["--quick"] if a.quick else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    windowed = {}
    if r.returncode == 0:
        with open(tmp) as f:
            windowed = json.load(f)
        os.unlink(tmp)
    else:
        print(f"windowed-einsum child failed (rc {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}", flush=True)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import transformer_engine_comm.jax as tj

    tp = len(jax.devices())
    mesh0 = setup("ag", 8, 8, 8)[0]
    ctx = tj.tp_context(mesh0, "tp")

    def smap(mesh, f, ins, out):
        return jax.jit(tj.tp_shard_map(f, mesh, ins, out))

    rows = []
    for op, T, K, N in shapes(tp, a.quick):
        mesh, x, w, specs = setup(op, T, K, N)
        xs, ws, os_ = specs
        if op == "ag":
            ours = smap(mesh, lambda x, w: tj.all_gather_gemm(x, w, ctx=ctx), (xs, ws), os_)
            # The GEMM alone: each device multiplies a whole [T, K] (its own copy, no comm).
            xfull = jax.jit(lambda k: jax.random.normal(k, (T * tp, K), jnp.bfloat16),
                            out_shardings=jax.sharding.NamedSharding(mesh, P("tp", None)))(jax.random.PRNGKey(2))
            gemm = smap(mesh, lambda x, w: x @ w.T, (P("tp", None), ws), P("tp", None))
            gemm_args = (xfull, w)
            coll = smap(mesh, lambda x: jax.lax.all_gather(x, "tp", tiled=True), (xs,), P(None, None))
            coll_args = (x,)
        else:
            ours = smap(mesh, lambda x, w: tj.gemm_reduce_scatter(x, w, ctx=ctx), (xs, ws), os_)
            gemm = smap(mesh, lambda x, w: x @ w.T, (xs, ws), P(None, "tp"))  # [T, N] partials, kept
            gemm_args = (x, w)
            y0 = jax.jit(lambda k: jax.random.normal(k, (T, N * tp), jnp.bfloat16),
                         out_shardings=jax.sharding.NamedSharding(mesh, P(None, "tp")))(jax.random.PRNGKey(1))
            coll = smap(mesh, lambda y: jax.lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True),
                        (P(None, "tp"),), P("tp", None))
            coll_args = (y0,)
        xla = xla_fn(mesh, specs)
        got, ref = ours(x, w), xla(x, w)
        err = float(jnp.linalg.norm((got.astype(jnp.float32) - ref.astype(jnp.float32)).ravel())
                    / jnp.linalg.norm(ref.astype(jnp.float32).ravel()))
        t = {name: timeit(f, args) for name, f, args in
             (("ours", ours, (x, w)), ("xla", xla, (x, w)), ("gemm", gemm, gemm_args), ("coll", coll, coll_args))}
        t["windowed"] = windowed.get(f"{op} {T} {K} {N}")
        bound = max(t["gemm"], t["coll"])
        rows.append((op, T, K, N, t, bound, err))
        print(f"{op} {T}x{K}x{N}: ours {t['ours']:.3f} ms, xla {t['xla']:.3f}, windowed {t['windowed']}, "
              f"gemm {t['gemm']:.3f}, coll {t['coll']:.3f}, rel err {err:.1e}", flush=True)
    ctx.close()

    def ratio(v, b):
        return f"{v / b:.3f}" if v is not None else "-"

    def ms(v):
        return f"{v:.3f}" if v is not None else "-"

    dev = jax.devices()[0].device_kind
    lines = [f"tp = {tp} ({dev}), bf16, jax {jax.__version__}; ms = median of 9 rounds of 10 back-to-back calls "
             "(wall clock to completion); bound = max(GEMM alone, collective alone)", "",
             "| op | tokens x K x N | ours ms | XLA ms | XLA windowed ms | GEMM ms | coll ms | ours/bound | "
             "XLA/bound | windowed/bound | rel err vs XLA |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for op, T, K, N, t, b, err in rows:
        lines.append(f"| {op.upper()} | {T}x{K}x{N} | {ms(t['ours'])} | {ms(t['xla'])} | {ms(t['windowed'])} | "
                     f"{ms(t['gemm'])} | {ms(t['coll'])} | {ratio(t['ours'], b)} | {ratio(t['xla'], b)} | "
                     f"{ratio(t['windowed'], b)} | {err:.1e} |")

    def geo(key):
        v = [t[key] / b for *_, t, b, _ in rows if t[key] is not None]
        return float(np.exp(np.mean(np.log(v)))) if v else None

    lines.append("")
    lines.append("geomean /bound: " + ", ".join(f"{k} {geo(k):.3f}" for k in ("ours", "xla", "windowed")
                                                 if geo(k) is not None))
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
