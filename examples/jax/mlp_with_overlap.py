#!/usr/bin/env python3
"""Tensor-parallel MLP training with communication hidden behind the GEMMs, in JAX.

One command, one process driving every local GPU (JAX's default on one host):

    python3 examples/jax/mlp_with_overlap.py                 # bf16, overlap on
    python3 examples/jax/mlp_with_overlap.py --fp8           # FP8 (e4m3) forward GEMMs
    python3 examples/jax/mlp_with_overlap.py --no-comm-overlap   # XLA's all_gather / psum_scatter

Several processes, one GPU each (e.g. across nodes: the TP group must stay inside a node):

    python3 examples/jax/mlp_with_overlap.py --coordinator HOST:PORT --num-processes N --process-id I

The MLP is ``row(gelu(column(x)))`` with sequence parallelism: the column layer's forward
all-gathers the tokens inside its GEMM (``all_gather_gemm``), the row layer's
reduce-scatters its output inside its GEMM (``gemm_reduce_scatter``); the backward pass
swaps them. Both run inside ``jax.jit(shard_map(...))`` over a ``tp`` mesh axis. Prints
the loss and step time; the run with ``--no-comm-overlap`` computes the same losses.
"""
import argparse
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (NVLS)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (all TP ranks together)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fp8", action="store_true", help="FP8 (e4m3, current scaling) forward GEMMs")
    p.add_argument("--no-comm-overlap", action="store_true", help="XLA's collectives, then the GEMMs")
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
    ctx = None if a.no_comm_overlap else tj.tp_context(mesh, "tp")
    bf = jnp.bfloat16
    specs = (P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P())

    def layers(x, w1, b1, w2, b2):
        if ctx is not None:
            return tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=a.fp8)
        xt = jax.lax.all_gather(x, "tp", tiled=True)
        h = jax.nn.gelu(xt @ w1.T + b1, approximate=True)
        return jax.lax.psum_scatter(h @ w2.T, "tp", scatter_dimension=0, tiled=True) + b2

    model = tj.tp_shard_map(layers, mesh, specs, P("tp", None))

    def loss_fn(params, x, y):
        out = model(x, *params).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        new = tuple((p.astype(jnp.float32) - a.lr * g.astype(jnp.float32)).astype(p.dtype) for p, g in zip(params, grads))
        return new, loss

    rng = np.random.default_rng(a.seed)

    def glob(arr, spec, dtype):
        s = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(arr.shape, s, lambda idx: jnp.asarray(arr[idx], dtype))

    w1 = rng.standard_normal((F, H), np.float32) * H**-0.5
    w2 = rng.standard_normal((H, F), np.float32) * F**-0.5
    params = (glob(w1, specs[1], bf), glob(np.zeros(F, np.float32), specs[2], bf),
              glob(w2, specs[3], bf), glob(np.zeros(H, np.float32), specs[4], bf))
    x = glob(rng.standard_normal((T, H), np.float32), specs[0], bf)
    target = glob(np.tanh(rng.standard_normal((T, H), np.float32)), P("tp", None), jnp.float32)

    mode = "XLA collectives, no overlap" if ctx is None else f"overlap ({'fp8' if a.fp8 else 'bf16'})"
    print(f"tp = {tp} ({jax.devices()[0].device_kind}), tokens {T}, hidden {H}, ffn {F}: {mode}", flush=True)
    times, losses = [], []
    for i in range(a.steps):
        t0 = time.perf_counter()
        params, loss = step(params, x, target)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if i < 3 or i % 10 == 9 or i == a.steps - 1:
            print(f"step {i + 1:4d}  loss {loss:.6f}  {times[-1] * 1e3:8.2f} ms", flush=True)
    steady = sorted(times[min(3, len(times) - 1):])
    print(f"median step time {steady[len(steady) // 2] * 1e3:.2f} ms (steps after the 3rd); "
          f"loss {losses[0]:.6f} -> {losses[-1]:.6f}", flush=True)
    if not losses[-1] < losses[0] or not np.isfinite(losses[-1]):
        raise SystemExit("the loss did not decrease")
    if ctx is not None:
        ctx.close()


if __name__ == "__main__":
    main()
