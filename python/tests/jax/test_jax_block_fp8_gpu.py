"""Float8BlockScaling in the JAX layers on ONE GPU (tp 1, in this process): the library's block
GEMM custom call (te_comm_block_gemm) against the dequantized dot, its epilogues, and the
training step on it against the dequantized-dot path; the MLP's loss
and gradients under jit against bf16 and against the block math composed from the casts
(the emulation), and the compiled step really quantizes (e4m3 arrays survive XLA's
optimizations: the f32 -> f8 -> f32 round trips are not folded away). Skipped without jax,
its CUDA plugin or a GPU."""
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")


def _gpu():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


pytestmark = pytest.mark.skipif(not _gpu(), reason="SKIPPED (JAX block FP8 GPU tests): no JAX GPU device")


def _setup():
    import jax.numpy as jnp
    import transformer_engine_comm.jax as tj
    from jax.sharding import Mesh

    ctx = tj.tp_context(Mesh(np.array(_gpu()[:1]), ("tp",)), "tp")
    rng = np.random.default_rng(0)
    T, H, F = 512, 512, 1024
    bf = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((T, H)), bf)
    w1 = jnp.asarray(rng.standard_normal((F, H)) * 0.05, bf)
    w2 = jnp.asarray(rng.standard_normal((H, F)) * 0.05, bf)
    b1, b2 = jnp.zeros((F,), bf), jnp.zeros((H,), bf)
    return tj, ctx, (x, w1, b1, w2, b2)


def test_block_mlp_on_gpu_vs_bf16_and_emulation():
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    tj, ctx, (x, w1, b1, w2, b2) = _setup()
    r = tj.Float8BlockScaling()

    def loss(w1, w2, fp8):
        return jnp.mean(tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=fp8).astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(lambda a, b: loss(a, b, r), argnums=(0, 1)))
    lb, (g1, g2) = step(w1, w2)
    lf, (f1, f2) = jax.jit(jax.value_and_grad(lambda a, b: loss(a, b, False), argnums=(0, 1)))(w1, w2)
    assert abs(float(lb) - float(lf)) / float(lf) < 0.02, (float(lb), float(lf))
    for a, b in ((g1, f1), (g2, f2)):
        e = float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        assert e < 0.15, e
    # The forward through fc1 is the block math: x (1D) . W1 (2D)^T, exactly the emulation's
    h = tj.column_parallel_dense(x, w1, b1, ctx=ctx, fp8=r)
    ref = np.asarray(F.dequantize_block(F.quantize_block(x, 1), 1), np.float64) @ \
        np.asarray(F.dequantize_block(F.quantize_block(w1, 2), 2), np.float64).T
    e = np.linalg.norm(np.asarray(h, np.float64) - ref) / np.linalg.norm(ref)
    assert e < 1e-2, e
    # The compiled step holds e4m3 arrays: the casts were not folded into bf16 math.
    hlo = step.lower(w1, w2).compile().as_text()
    assert "f8e4m3fn" in hlo, "the compiled block FP8 step holds no e4m3 array"


# ---- the library's block-scaled GEMM (te_comm_block_gemm) against the dequantized dot ----

def _q(seed, rows, cols, dim, scale=1.0):
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * scale
    return F.quantize_block(jnp.asarray(x, jnp.bfloat16), dim)


@pytest.mark.parametrize("dims", [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_block_gemm_matches_the_dequantized_dot(dims, out):
    from transformer_engine_comm.jax import fp8 as F

    M, N, K = 384, 640, 1024
    qa, qb = _q(1, M, K, dims[0]), _q(2, N, K, dims[1], 0.05)
    lib = jax.jit(lambda a, b: F.block_dot(a, dims[0], b, dims[1], out, gemm="library"))
    ref = np.asarray(F.block_dot(qa, dims[0], qb, dims[1], "float32", exact_bf16=False, gemm="dequant"), np.float64)
    got = np.asarray(lib(qa, qb), np.float64)
    # f32: the FP8 tensor cores' accumulation inside a 128-value block (1e-4 .. 3e-4
    # measured, tests_c/test_block_gemm); bf16: the output's rounding
    tol = 1e-3 if out == "float32" else 1e-2
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < tol, (dims, out, err)
    # the jitted call replays (XLA may run it from a command buffer): the same bits
    np.testing.assert_array_equal(np.asarray(lib(qa, qb), np.float64), got)
    assert "te_comm_block_gemm" in lib.lower(qa, qb).compile().as_text()


def test_block_gemm_epilogues():
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F, ops

    M, N, K = 256, 384, 512
    qa, qb = _q(3, M, K, 1), _q(4, N, K, 2, 0.05)
    sa, sb = ops.gemm_ready_scales(qa.scale_inv, M, K, 1), ops.gemm_ready_scales(qb.scale_inv, N, K, 2)
    ref = np.asarray(F.block_dot(qa, 1, qb, 2, "float32", exact_bf16=False, gemm="dequant"), np.float64)
    bias = jnp.asarray(np.random.default_rng(5).standard_normal(N), jnp.float32)
    y = ops.block_gemm(qa.q, sa, qb.q, sb, a_block_dim=1, b_block_dim=2, out_dtype="float32",
                       bias=bias.astype(jnp.bfloat16))
    want = ref + np.asarray(bias.astype(jnp.bfloat16), np.float64)
    assert np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max() < 2e-3
    pre = jnp.asarray(np.random.default_rng(6).standard_normal((M, N)), jnp.bfloat16)
    g = ops.block_gemm(qa.q, sa, qb.q, sb, a_block_dim=1, b_block_dim=2, out_dtype="bfloat16", dgelu_pre=pre)
    p = np.asarray(pre, np.float64)
    gelu_grad = np.asarray(jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(
        jnp.asarray(p.ravel(), jnp.float32)), np.float64).reshape(M, N)
    want = ref * gelu_grad
    assert np.abs(np.asarray(g, np.float64) - want).max() / np.abs(want).max() < 2e-2


def test_block_mlp_training_step_on_the_library_gemm():
    """The MLP's training step under Float8BlockScaling: on the GPU its six GEMMs are the
    library's block GEMM (in the compiled step), and its loss and gradients match the
    dequantized-dot path (the same block products; accumulation order only)."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    tj, ctx, (x, w1, b1, w2, b2) = _setup()
    r = tj.Float8BlockScaling()

    def step_with(mode):
        def loss(w1, w2):
            old = F.BLOCK_GEMM
            F.BLOCK_GEMM = mode  # read at trace time
            try:
                return jnp.mean(tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=r).astype(jnp.float32) ** 2)
            finally:
                F.BLOCK_GEMM = old
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    lib, deq = step_with("auto"), step_with("dequant")
    assert lib.lower(w1, w2).compile().as_text().count("te_comm_block_gemm") >= 6
    assert "te_comm_block_gemm" not in deq.lower(w1, w2).compile().as_text()
    (ll, gl), (ld, gd) = lib(w1, w2), deq(w1, w2)
    assert abs(float(ll) - float(ld)) / float(ld) < 1e-3, (float(ll), float(ld))
    for a, b in zip(gl, gd):
        e = float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        assert e < 2e-2, e
    # a few optimizer steps on the library's GEMM lower the loss
    w = (w1, w2)
    for _ in range(3):
        _, g = lib(*w)
        w = tuple((p.astype(jnp.float32) - 0.5 * q.astype(jnp.float32)).astype(p.dtype) for p, q in zip(w, g))
    assert float(lib(*w)[0]) < float(ll)
