"""Float8BlockScaling in the JAX layers on ONE GPU (tp 1, in this process): the MLP's loss
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
