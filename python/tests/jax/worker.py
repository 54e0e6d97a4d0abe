"""One rank of the JAX GPU tests (launched by python/tests/jax/test_jax_gpu.py, one process
per rank; environment: TEC_NP, TEC_RANK, TEC_PORT, TEC_GPU, TEC_CHECKS).

Every rank draws the same global inputs from one seed, computes the reference of the
whole problem itself in float32 (jnp on its device: no collective, so ranks may share a
GPU), and checks its own part. Each check prints ``PASS name`` or ``FAIL name: why``;
the exit status is the number of failures (capped). Modes:

- process-local: one device per process, the ops on each process's local arrays under
  ``jax.jit`` (tp = TEC_NP; ranks may share one GPU: the library's IPC works, and no
  XLA collective is used);
- shard_map (TEC_NP = 1): one process drives all its local GPUs, the layers inside
  ``jax.jit(shard_map(...))`` over a ``tp`` mesh axis (tp = local device count).
"""
from __future__ import annotations

import os
import sys
import time
import traceback

NP = int(os.environ.get("TEC_NP", "1"))
RANK = int(os.environ.get("TEC_RANK", "0"))
PORT = int(os.environ.get("TEC_PORT", "0"))
GPU = int(os.environ.get("TEC_GPU", "0"))

import numpy as np  # noqa: E402

import jax  # noqa: E402

if NP > 1:
    jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NP, process_id=RANK, local_device_ids=[GPU])

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import transformer_engine_comm.jax as tj  # noqa: E402

failures = []


def check(name, fn):
    t0 = time.time()
    try:
        msg = fn()
        print(f"PASS {name}{(': ' + msg) if msg else ''} ({time.time() - t0:.1f} s)", flush=True)
    except Exception as e:  # noqa: BLE001
        failures.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def rel_err(got, ref):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"shape {got.shape} != reference {ref.shape}")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def expect_close(what, got, ref, tol):
    e = rel_err(got, ref)
    if not e <= tol:  # also catches NaN
        raise AssertionError(f"{what}: relative error {e:.3g} > {tol}")
    return e


def block(n, tp, r):
    b = -(-n // tp)
    lo = min(r * b, n)
    return lo, min(lo + b, n)


def rnd(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


dev = jax.local_devices()[0]


def put(a, dtype):
    return jax.device_put(jnp.asarray(a, dtype), dev)


def gelu_np(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


# ----------------------------------------------------------------- process-local mode


def local_checks():
    # One process (NP 1): this process's one device, whatever else is visible (a mesh of
    # every local GPU would make a group of them, of which this worker is no single rank).
    mesh = Mesh(np.array(jax.devices() if NP > 1 else [dev]), ("tp",))
    ctx = tj.tp_context(mesh, "tp")
    tp, r = ctx.size, ctx.rank
    assert tp == NP, (tp, NP)
    rng = np.random.default_rng(1234)
    # The test's own exchange of results between ranks (not the contexts').
    results = tj.KVExchange("te_comm/jax-test", r, tp) if tp > 1 else None

    def sum_over_ranks(a):
        a = np.array(a, np.float32)  # keeps 0-d scalars 0-d
        if results is None:
            return a
        return np.frombuffer(results.allgather(a.tobytes()), np.float32).reshape((tp,) + a.shape).sum(0)

    def ag_case(T, K, N, dtype, tol, bias=True, gelu=False, gathered=True, fp8=False):
        X, W, B = rnd(rng, (T, K)), rnd(rng, (N * tp, K), K**-0.5), rnd(rng, (N * tp,))
        x0, x1 = block(T, tp, r)
        w_l, b_l = W[r * N:(r + 1) * N], B[r * N:(r + 1) * N]
        kw = {}
        if fp8:
            sx, sw = 448 / np.abs(X).max(), 448 / np.abs(W).max()
            xq = jnp.asarray(X[x0:x1] * sx, jnp.float8_e4m3fn)
            wq = jnp.asarray(w_l * sw, jnp.float8_e4m3fn)
            Xs = np.asarray(jnp.asarray(X * sx, jnp.float8_e4m3fn), np.float32)  # stored values
            Xd = Xs / sx
            Wd = np.asarray(wq, np.float32) / sw
            x_in, w_in = jax.device_put(xq, dev), jax.device_put(wq, dev)
            kw = dict(x_scale_inv=put([1 / sx], jnp.float32), w_scale_inv=put([1 / sw], jnp.float32))
            ref = Xd @ Wd.T
        else:
            x_in, w_in = put(X[x0:x1], dtype), put(w_l, dtype)
            Xd = Xs = np.asarray(jnp.asarray(X, dtype), np.float32)
            ref = Xd @ np.asarray(jnp.asarray(w_l, dtype), np.float32).T
        out_dt = jnp.bfloat16 if fp8 else dtype
        if bias:
            b_in = put(b_l, out_dt)
            ref = ref + np.asarray(jnp.asarray(b_l, out_dt), np.float32)
        f = jax.jit(lambda x, w, b: tj.all_gather_gemm(x, w, b, ctx=ctx, n_tokens=T, gelu=gelu,
                                                       return_gathered=gathered, **kw))
        errs = []
        for it in range(3):  # repeated executions (replays when command buffers are on)
            out = f(x_in, w_in, b_in if bias else None)
            out = out if isinstance(out, tuple) else (out,)
            i = 0
            if gelu:
                errs.append(expect_close("gelu(y)", out[0], gelu_np(ref), tol))
                errs.append(expect_close("pre-activation", out[1], ref, tol))
                i = 2
            else:
                errs.append(expect_close("y", out[0], ref, tol))
                i = 1
            if gathered:
                g = np.asarray(jnp.asarray(out[i], jnp.float32))
                if not np.array_equal(g, Xs):
                    raise AssertionError("the gathered input differs from the inputs of all ranks")
        return f"max rel err {max(errs):.2e}"

    def rs_case(T, K, N, dtype, tol, all_reduce=False, bias=True, fp8=False):
        X, W, B = rnd(rng, (T, K * tp)), rnd(rng, (N, K * tp), (K * tp) ** -0.5), rnd(rng, (N,))
        xs, ws = X[:, r * K:(r + 1) * K], W[:, r * K:(r + 1) * K]
        kw = {}
        if fp8:  # per-rank scales: each rank's partial product is scaled in its own GEMM
            sx, sw = 448 / np.abs(xs).max(), 448 / np.abs(ws).max()
            xq, wq = jnp.asarray(xs * sx, jnp.float8_e4m3fn), jnp.asarray(ws * sw, jnp.float8_e4m3fn)
            x_in, w_in = jax.device_put(xq, dev), jax.device_put(wq, dev)
            kw = dict(x_scale_inv=put([1 / sx], jnp.float32), w_scale_inv=put([1 / sw], jnp.float32))
            # the reference needs every rank's quantized shard: quantize each the same way
            parts = []
            for q in range(tp):
                xq_, wq_ = X[:, q * K:(q + 1) * K], W[:, q * K:(q + 1) * K]
                a, b = 448 / np.abs(xq_).max(), 448 / np.abs(wq_).max()
                parts.append((np.asarray(jnp.asarray(xq_ * a, jnp.float8_e4m3fn), np.float32) / a)
                             @ (np.asarray(jnp.asarray(wq_ * b, jnp.float8_e4m3fn), np.float32) / b).T)
            ref = sum(parts)
        else:
            x_in, w_in = put(xs, dtype), put(ws, dtype)
            ref = np.asarray(jnp.asarray(X, dtype), np.float32) @ np.asarray(jnp.asarray(W, dtype), np.float32).T
        out_dt = jnp.bfloat16 if fp8 else dtype
        if bias:
            ref = ref + np.asarray(jnp.asarray(B, out_dt), np.float32)
        if not all_reduce:
            lo, hi = block(T, tp, r)
            ref = ref[lo:hi]
        op = tj.gemm_all_reduce if all_reduce else tj.gemm_reduce_scatter
        f = jax.jit(lambda x, w, b: op(x, w, b, ctx=ctx, **kw))
        errs = [expect_close("y", f(x_in, w_in, put(B, out_dt) if bias else None), ref, tol) for _ in range(3)]
        return f"max rel err {max(errs):.2e}"

    bf, tol = jnp.bfloat16, 1e-2
    check(f"tp{tp} ag bf16 bias+gathered", lambda: ag_case(256 * tp, 512, 384, bf, tol))
    check(f"tp{tp} ag bf16 gelu", lambda: ag_case(128 * tp, 256, 256, bf, tol, gelu=True, gathered=False))
    check(f"tp{tp} ag fp16 no bias", lambda: ag_case(64 * tp, 256, 128, jnp.float16, 5e-3, bias=False))
    check(f"tp{tp} ag uneven tokens", lambda: ag_case(128 * tp + 3, 256, 128, bf, tol))
    check(f"tp{tp} ag fp8 e4m3", lambda: ag_case(256 * tp, 512, 256, bf, tol, fp8=True))
    check(f"tp{tp} rs bf16 bias", lambda: rs_case(256 * tp, 256, 384, bf, tol))
    check(f"tp{tp} rs uneven tokens", lambda: rs_case(128 * tp + 5, 256, 256, bf, tol))
    check(f"tp{tp} rs fp8 e4m3", lambda: rs_case(256 * tp, 256, 256, bf, 2e-2, fp8=True))
    check(f"tp{tp} ar bf16 bias", lambda: rs_case(128 * tp, 256, 256, bf, tol, all_reduce=True))

    def layouts():
        """Every layout the ops take (TE's transa / transb: TN, NN, NT) vs jnp.dot, and
        FP8 TN with the e4m3 x e5m2 mix of a HYBRID backward."""
        T, K, N = 64 * tp, 128, 96
        errs = []
        X, W = rnd(rng, (T, K)), rnd(rng, (N, K), K**-0.5)
        x0, x1 = block(T, tp, r)
        Xb, Wb = (np.asarray(jnp.asarray(a, bf), np.float32) for a in (X, W))
        for ta, tb in ((True, False), (False, False), (False, True)):
            w_in = put(W if ta else W.T, bf)
            x_in = put(X[x0:x1] if not tb else X[x0:x1].T, bf)
            f = jax.jit(lambda x, w, ta=ta, tb=tb: tj.all_gather_gemm(x, w, ctx=ctx, transa=ta, transb=tb))
            errs.append(expect_close(f"ag ta={ta} tb={tb}", f(x_in, w_in), Xb @ Wb.T, 1e-2))
        Xr, Wr = rnd(rng, (T, K * tp)), rnd(rng, (N, K * tp), (K * tp) ** -0.5)
        xs, ws = Xr[:, r * K:(r + 1) * K], Wr[:, r * K:(r + 1) * K]
        ref = np.asarray(jnp.asarray(Xr, bf), np.float32) @ np.asarray(jnp.asarray(Wr, bf), np.float32).T
        for ta, tb in ((True, False), (False, False), (False, True)):
            w_in = put(ws if ta else ws.T, bf)
            x_in = put(xs if not tb else xs.T, bf)
            for ar in (False, True):
                op = tj.gemm_all_reduce if ar else tj.gemm_reduce_scatter
                f = jax.jit(lambda x, w, ta=ta, tb=tb, op=op: op(x, w, ctx=ctx, transa=ta, transb=tb))
                want = ref if ar else ref[x0:x1]
                errs.append(expect_close(f"{'ar' if ar else 'rs'} ta={ta} tb={tb}", f(x_in, w_in), want, 1e-2))
        # FP8 TN, A = weight e4m3, B = gradient e5m2 (gathered, as the row layer's backward)
        sx, sw = 57344 / np.abs(X).max() / 4, 448 / np.abs(W).max()
        xq = np.asarray(jnp.asarray(X * sx, jnp.float8_e5m2).astype(jnp.float32)) / sx
        wq = np.asarray(jnp.asarray(W * sw, jnp.float8_e4m3fn).astype(jnp.float32)) / sw
        f = jax.jit(lambda x, w, a, b: tj.all_gather_gemm(x, w, ctx=ctx, x_scale_inv=a, w_scale_inv=b,
                                                          return_gathered=True))
        y, g = f(jax.device_put(jnp.asarray(X[x0:x1] * sx, jnp.float8_e5m2), dev),
                 jax.device_put(jnp.asarray(W * sw, jnp.float8_e4m3fn), dev), put([1 / sx], jnp.float32),
                 put([1 / sw], jnp.float32))
        errs.append(expect_close("ag fp8 e5m2 x e4m3", y, xq @ wq.T, 2e-2))
        if g.dtype != jnp.float8_e5m2 or not np.array_equal(np.asarray(g.astype(jnp.float32)) / sx, xq):
            raise AssertionError("the gathered e5m2 input differs")
        return f"max rel err {max(errs):.2e} over {len(errs)} layouts"

    check(f"tp{tp} layouts (TN, NN, NT) and FP8 e5m2 x e4m3", layouts)

    def fp8_training_tp1():
        """tp 1 with the library forced (the comm-GEMMs in FP8, TN) and XLA's FP8 GEMMs:
        gradients vs float32 jax.grad, delayed scaling's state over steps, loss within 2 %."""
        T, H, F = 256, 256, 512
        X, W1, B1 = rnd(rng, (T, H)), rnd(rng, (F, H), H**-0.5), rnd(rng, (F,), 0.1)
        W2, B2 = rnd(rng, (H, F), F**-0.5), rnd(rng, (H,), 0.1)

        def ref_loss(x, w1, b1, w2, b2):
            return jnp.sum((jax.nn.gelu(x @ w1.T + b1, approximate=True) @ w2.T + b2) ** 2) / T

        full = [jnp.asarray(np.asarray(jnp.asarray(a, bf), np.float32)) for a in (X, W1, B1, W2, B2)]
        ref = [np.asarray(g) for g in jax.jit(jax.grad(ref_loss, argnums=range(5)))(*full)]
        out = []
        for recipe in (tj.DelayedScaling(amax_history_len=8), tj.CurrentScaling(), tj.CurrentScaling(tj.Format.E4M3)):
            for lib in (True, None):
                def loss(x, w1, b1, w2, b2, m, recipe=recipe, lib=lib):
                    y = tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=recipe, fp8_meta=m, library=lib)
                    return jnp.sum(y.astype(jnp.float32) ** 2) / T
                g = jax.jit(jax.grad(loss, argnums=range(6)))
                meta = tj.fp8_meta_init(recipe, 2) if recipe.delayed else None
                args = [put(a, bf) for a in (X, W1, B1, W2, B2)]
                for it in range(3):  # delayed: step 0 quantizes with scale 1, later steps with the history's
                    gs = g(*args, meta)
                    if meta is not None:
                        meta = tj.fp8_meta_update(gs[5], recipe)
                errs = [expect_close(n, a, b, 0.12) for n, a, b in zip(("dx", "dw1", "db1", "dw2", "db2"), gs, ref)]
                out.append(f"{type(recipe).__name__}{'' if lib else ' xla'} {max(errs):.2e}")
        return "max rel err of the 5 gradients: " + ", ".join(out)

    if tp == 1:
        check("tp1 fp8 training gradients (library forced and XLA), delayed and current", fp8_training_tp1)

    def grads():
        T, H, F = 128 * tp, 256, 512
        X, W1, B1 = rnd(rng, (T, H)), rnd(rng, (F, H), H**-0.5), rnd(rng, (F,), 0.1)
        W2, B2 = rnd(rng, (H, F), F**-0.5), rnd(rng, (H,), 0.1)
        Fl = F // tp
        x0, x1 = block(T, tp, r)

        def ref_loss(x, w1, b1, w2, b2):
            h = jax.nn.gelu(x @ w1.T + b1, approximate=True)
            return jnp.sum((h @ w2.T + b2) ** 2) / T

        args = [jnp.asarray(a) for a in (X, W1, B1, W2, B2)]
        ref = jax.jit(jax.grad(ref_loss, argnums=range(5)))(*args)
        ref = [np.asarray(g) for g in ref]
        loc = dict(x=put(X[x0:x1], bf), w1=put(W1[r * Fl:(r + 1) * Fl], bf), b1=put(B1[r * Fl:(r + 1) * Fl], bf),
                   w2=put(W2[:, r * Fl:(r + 1) * Fl], bf), b2=put(B2, bf))

        def loss(x, w1, b1, w2, b2):
            y = tj.mlp(x, w1, b1, w2, b2, ctx=ctx)
            return jnp.sum(y.astype(jnp.float32) ** 2) / T

        g = jax.jit(jax.grad(loss, argnums=range(5)))(*loc.values())
        errs = {
            "dx": expect_close("dx", g[0], ref[0][x0:x1], 3e-2),
            "dw1": expect_close("dw1", g[1], ref[1][r * Fl:(r + 1) * Fl], 3e-2),
            "db1": expect_close("db1", g[2], ref[2][r * Fl:(r + 1) * Fl], 3e-2),
            "dw2": expect_close("dw2", g[3], ref[3][:, r * Fl:(r + 1) * Fl], 3e-2),
        }
        # db2: each rank returns its tokens' share (shard_map would sum them): sum over ranks.
        db2 = sum_over_ranks(np.asarray(jnp.asarray(g[4], jnp.float32)))
        errs["db2 (sum of shares)"] = expect_close("db2", db2, ref[4], 3e-2)
        return ", ".join(f"{k} {v:.1e}" for k, v in errs.items())

    check(f"tp{tp} mlp gradients vs jax.grad of the whole model", grads)

    def training():
        T, H, F = 128 * tp, 256, 512
        Fl = F // tp
        X, Y = rnd(rng, (T, H)), rnd(rng, (T, H))
        W1, W2 = rnd(rng, (F, H), H**-0.5), rnd(rng, (H, F), F**-0.5)
        x0, x1 = block(T, tp, r)
        lr = 0.5

        def ref_step(w1, w2):
            def loss(w1, w2):
                h = jax.nn.gelu(jnp.asarray(X) @ w1.T, approximate=True)
                return jnp.mean((h @ w2.T - Y) ** 2)
            l, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
            return l, w1 - lr * g1, w2 - lr * g2

        @jax.jit
        def step(x, y, w1, w2):
            def loss(w1, w2):
                out = tj.mlp(x, w1, None, w2, None, ctx=ctx)
                return jnp.sum((out.astype(jnp.float32) - y) ** 2) / (T * H)
            l, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
            return l, (w1.astype(jnp.float32) - lr * g1).astype(bf), (w2.astype(jnp.float32) - lr * g2).astype(bf)

        w1, w2 = put(W1[r * Fl:(r + 1) * Fl], bf), put(W2[:, r * Fl:(r + 1) * Fl], bf)
        rw1, rw2 = jnp.asarray(W1), jnp.asarray(W2)
        x, y = put(X[x0:x1], bf), put(Y[x0:x1], jnp.float32)
        losses, ref_losses = [], []
        for _ in range(5):
            l, w1, w2 = step(x, y, w1, w2)
            rl, rw1, rw2 = ref_step(rw1, rw2)
            losses.append(float(sum_over_ranks(np.float32(l))))
            ref_losses.append(float(rl))
        if not losses[-1] < losses[0]:
            raise AssertionError(f"loss did not decrease: {losses}")
        for a, b in zip(losses, ref_losses):
            if abs(a - b) > 0.03 * abs(b):
                raise AssertionError(f"losses {losses} vs reference {ref_losses}")
        expect_close("w1 after 5 steps", w1, np.asarray(rw1)[r * Fl:(r + 1) * Fl], 3e-2)
        return f"losses {[round(v, 4) for v in losses]} (reference {[round(v, 4) for v in ref_losses]})"

    check(f"tp{tp} training steps vs reference", training)

    def closed():
        c2 = tj.tp_context(mesh, "tp")
        f = jax.jit(lambda x, w: tj.gemm_all_reduce(x, w, ctx=c2))
        x, w = put(rnd(rng, (64, 64)), bf), put(rnd(rng, (64, 64)), bf)
        f(x, w).block_until_ready()
        c2.close()
        try:
            f(x, w).block_until_ready()
        except Exception as e:  # noqa: BLE001
            if "no context is bound" not in str(e):
                raise AssertionError(f"unexpected error after close: {e}") from e
            return "a closed context's executable fails with: no context is bound ..."
        raise AssertionError("an executable ran after its context was closed")

    check(f"tp{tp} closed context is an error", closed)
    ctx.close()


# --------------------------------------------------------------------- shard_map mode


def shard_map_checks():
    """Layers inside jit(shard_map) over a mesh of every device of the run: one process's
    local GPUs, or one device per process (global arrays). Each process compares its own
    shards with the whole model computed locally; with XLA collectives available (not
    several processes on one GPU, where NCCL refuses a duplicate GPU) also the gradients
    vs the same layers on lax.all_gather / psum_scatter, and the FP8 layers (their amax
    is a pmax over the axis)."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("tp",))
    ctx = tj.tp_context(mesh, "tp")
    tp = ctx.size
    shared = os.environ.get("TEC_SHARED") == "1"
    rng = np.random.default_rng(99)
    T, H, F = 128 * tp, 256, 512
    X, W1, B1 = rnd(rng, (T, H)), rnd(rng, (F, H), H**-0.5), rnd(rng, (F,), 0.1)
    W2, B2 = rnd(rng, (H, F), F**-0.5), rnd(rng, (H,), 0.1)
    bf = jnp.bfloat16
    specs = (P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P())
    glob = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, sp), lambda idx, a=a: jnp.asarray(a[idx], bf))
            for a, sp in zip((X, W1, B1, W2, B2), specs)]

    def smap(f, out):
        return tj.tp_shard_map(f, mesh, specs, out, ctx=ctx)

    def ref_model(x, w1, b1, w2, b2):
        h = jax.nn.gelu(x @ w1.T + b1, approximate=True)
        return h @ w2.T + b2

    def lax_layers(x, w1, b1, w2, b2):  # the same layers on XLA's collectives
        xt = jax.lax.all_gather(x, "tp", tiled=True)
        h = jax.nn.gelu((xt @ w1.T + b1).astype(bf), approximate=True)
        return (jax.lax.psum_scatter(h @ w2.T, "tp", scatter_dimension=0, tiled=True) + b2).astype(bf)

    def close_shards(what, got, ref, tol):
        """Each of this process's shards of `got` against the same slice of `ref`."""
        errs = [expect_close(f"{what}{sh.index}", sh.data, np.asarray(ref)[sh.index], tol)
                for sh in got.addressable_shards]
        return max(errs)

    full = [jnp.asarray(a) for a in (X, W1, B1, W2, B2)]
    for fp8 in (False, True):
        name = "fp8" if fp8 else "bf16"
        if fp8 and shared:
            print(f"SKIP shard_map tp{tp} mlp fp8: its amax pmax is an XLA collective, which NCCL refuses "
                  "with several processes on one GPU", flush=True)
            continue

        def fwd(fp8=fp8):
            f = jax.jit(smap(lambda *a: tj.mlp(*a, ctx=ctx, fp8=fp8), P("tp", None)))
            ref = np.asarray(ref_model(*full))
            # Several executions: XLA instantiates a command buffer after the first runs.
            errs = [close_shards("y", f(*glob), ref, 6e-2 if fp8 else 2e-2) for _ in range(4)]
            return f"max rel err {max(errs):.2e} over 4 executions"

        check(f"shard_map tp{tp} mlp {name} forward", fwd)
        if shared:
            print(f"SKIP shard_map tp{tp} gradients: the replicated bias's gradient is a psum (an XLA "
                  "collective, which NCCL refuses with several processes on one GPU)", flush=True)
            continue

        def grad(fp8=fp8):
            def loss_with(layer):
                return lambda *a: jnp.sum(smap(layer, P("tp", None))(*a).astype(jnp.float32) ** 2) / T
            # FP8: both layers' backward GEMMs in FP8 too (HYBRID: e5m2 gradients)
            gf = jax.jit(jax.grad(loss_with(lambda *a: tj.mlp(*a, ctx=ctx, fp8=fp8, library=True)), argnums=range(5)))
            ref = jax.jit(jax.grad(loss_with(lax_layers), argnums=range(5)))(*glob)
            whole = jax.grad(lambda *a: jnp.sum(ref_model(*a) ** 2) / T, argnums=range(5))(*full)
            tol = 1.2e-1 if fp8 else 3e-2
            errs = []
            def vs_global(what, got, want):
                # Both global arrays of one sharding: shard by shard (other processes' are
                # not addressable here).
                shards = {str(s.index): s.data for s in want.addressable_shards}
                return max(expect_close(f"{what}{s.index}", s.data, np.asarray(jnp.asarray(shards[str(s.index)], jnp.float32)), tol)
                           for s in got.addressable_shards)

            for _ in range(4):
                g = gf(*glob)
                for n, a, b, w in zip(("dx", "dw1", "db1", "dw2", "db2"), g, ref, whole):
                    errs.append(vs_global(n, a, b))
                    errs.append(close_shards(n + " (whole model)", a, np.asarray(w), 2 * tol))
            return "vs lax.all_gather / psum_scatter layers and the whole model: max rel err " + f"{max(errs):.2e}"

        check(f"shard_map tp{tp} mlp {name} gradients", grad)

    def grad_no_sp():
        # Without sequence parallelism: x replicated, the row layer all-reduces (out P()).
        specs_ar = (P(), P("tp", None), P("tp"), P(None, "tp"), P())
        glob_ar = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, sp), lambda idx, a=a: jnp.asarray(a[idx], bf))
                   for a, sp in zip((X, W1, B1, W2, B2), specs_ar)]

        model = tj.tp_shard_map(lambda *b: tj.mlp(*b, ctx=ctx, sequence_parallel=False), mesh, specs_ar, P(), ctx=ctx)
        loss = lambda *a: jnp.sum(model(*a).astype(jnp.float32) ** 2) / T  # noqa: E731
        g = jax.jit(jax.grad(loss, argnums=range(5)))(*glob_ar)
        whole = jax.grad(lambda *a: jnp.sum(ref_model(*a) ** 2) / T, argnums=range(5))(*full)
        errs = [close_shards(n, a, np.asarray(w), 6e-2) for n, a, w in zip(("dx", "dw1", "db1", "dw2", "db2"), g, whole)]
        return f"vs the whole model: max rel err {max(errs):.2e}"

    if not shared:
        check(f"shard_map tp{tp} mlp without sequence parallelism, gradients", grad_no_sp)
    ctx.close()


if __name__ == "__main__":
    which = os.environ.get("TEC_CHECKS", "local")
    print(f"rank {RANK}/{NP}: jax {jax.__version__}, devices {jax.local_devices()}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    if which == "local":
        local_checks()
    elif which == "shard_map":
        shard_map_checks()
    else:
        raise SystemExit(f"TEC_CHECKS={which!r}")
    from transformer_engine_comm import _capi
    import ctypes

    cnt = [ctypes.c_uint64() for _ in range(3)]
    _capi.check(_capi.lib().nvte_comm_xla_counters(*[ctypes.byref(c) for c in cnt]), "counters")
    executed, captured, initialized = (c.value for c in cnt)
    print(f"rank {RANK}: handler calls executed {executed}, captured into command buffers {captured}, "
          f"initialize stages {initialized}", flush=True)
    if os.environ.get("TEC_EXPECT_CAPTURE") == "1" and captured == 0:
        failures.append("command buffers")
        print("FAIL command buffers: XLA_FLAGS enable CUSTOM_CALL command buffers but no call was captured", flush=True)
    if os.environ.get("TEC_EXPECT_CAPTURE") == "0" and captured != 0:
        failures.append("command buffers off")
        print(f"FAIL command buffers off: {captured} calls were captured", flush=True)
    print(f"rank {RANK}: {len(failures)} failed" + (f": {failures}" if failures else ""), flush=True)
    sys.stdout.flush()
    os._exit(min(len(failures), 100))
