"""Float8BlockScaling in the JAX layers, on the host (CPU devices): the jnp block casts bit
for bit against an independent numpy reference (TE's compute_scale_from_amax per 1 x 128
block / 128 x 128 tile, saturating e4m3 cast, the columnwise form), the block dot against
the fp32 product of the dequantized operands, and the layers' forward and backward at tp 1
against that composition and against float. Without jax they skip, unless
TE_COMM_REQUIRE_JAX=1 (scripts/test.sh sets it)."""
import os

import numpy as np
import pytest

try:
    import jax

    HAVE_JAX = True
except ImportError:
    HAVE_JAX = False

if not HAVE_JAX and os.environ.get("TE_COMM_REQUIRE_JAX") == "1":
    raise RuntimeError("TE_COMM_REQUIRE_JAX=1 but jax cannot be imported")
pytestmark = pytest.mark.skipif(not HAVE_JAX, reason="SKIPPED: jax is not installed")

from block_fp8_reference import np_quantize  # noqa: E402


def data(seed, *shape, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 128), (130, 129)])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("eps, pow2", [(0.0, True), (0.0, False), (0.5, True)])
def test_quantize_block_matches_numpy_reference(shape, dim, eps, pow2):
    from transformer_engine_comm.jax import fp8 as F

    x = data(1, *shape) * np.logspace(-2, 2, shape[1], dtype=np.float32)
    x[0, :5] = 0.0
    got = F.quantize_block(jax.numpy.asarray(x), dim, power_2_scale=pow2, amax_epsilon=eps)
    q, sinv = np_quantize(x, dim, eps, pow2)
    np.testing.assert_array_equal(np.asarray(got.q).astype(np.float32), q)
    np.testing.assert_array_equal(np.asarray(got.scale_inv), sinv)
    assert got.q.dtype == jax.numpy.float8_e4m3fn
    if pow2:  # power-of-2 scales: every scale_inv is 2^k
        m, _ = np.frexp(sinv)
        assert (m == 0.5).all()


def test_div_rn_is_correctly_rounded():
    """The scales' division is IEEE's (numpy's f32 division), whatever the backend divides with."""
    from transformer_engine_comm.jax import fp8 as F

    rng = np.random.default_rng(5)
    d = np.concatenate([rng.uniform(1e-6, 1e6, 20000), np.exp(rng.uniform(-80, 80, 20000))]).astype(np.float32)
    for n in (np.float32(448.0), np.float32(57344.0), np.float32(1.0)):
        want = n / d
        got = np.asarray(F.div_rn(n, jax.numpy.asarray(d)))
        ok = np.isfinite(want)
        bad = np.nonzero((got != want) & ok)[0]
        assert bad.size == 0, (n, bad.size, d[bad[:5]], want[bad[:5]], got[bad[:5]])
    # The correction itself: a first quotient one or two ulps off either way (a GPU's
    # approximate division is within 2 ulps) comes back correctly rounded.
    mn = np.float32(448.0 / 512.0)
    md = np.frexp(d)[0].astype(np.float32)
    want = mn / md
    for off in (-np.inf, np.inf):
        q0 = want
        for _ in range(2):
            q0 = np.nextafter(q0, np.float32(off)).astype(np.float32)
            got = np.asarray(F._div_mantissas(jax.numpy.float32(mn), jax.numpy.asarray(md), jax.numpy.asarray(q0)))
            np.testing.assert_array_equal(got, want)


def test_columnwise_forms():
    from transformer_engine_comm.jax import fp8 as F

    x = jax.numpy.asarray(data(2, 256, 384) * np.linspace(0.01, 5, 384, dtype=np.float32))
    c1 = F.block_columnwise(x, 1)
    q, sinv = np_quantize(np.asarray(x).T, 1)  # 1D: the transpose quantized along its rows
    np.testing.assert_array_equal(np.asarray(c1.q).astype(np.float32), q)
    np.testing.assert_array_equal(np.asarray(c1.scale_inv), sinv)
    r1 = F.quantize_block(x, 1)
    assert not np.array_equal(np.asarray(r1.q).T.astype(np.float32), q)  # not the transposed rowwise bytes
    c2, r2 = F.block_columnwise(x, 2), F.quantize_block(x, 2)
    np.testing.assert_array_equal(np.asarray(c2.q), np.asarray(r2.q).T)
    np.testing.assert_array_equal(np.asarray(c2.scale_inv), np.asarray(r2.scale_inv).T)


@pytest.mark.parametrize("b_dim", [1, 2])
def test_block_dot_is_the_dequantized_product(b_dim):
    from transformer_engine_comm.jax import fp8 as F

    a, b = data(3, 256, 512), data(4, 384, 512, scale=0.02)
    qa, qb = F.quantize_block(jax.numpy.asarray(a), 1), F.quantize_block(jax.numpy.asarray(b), b_dim)
    ref = (np.asarray(F.dequantize_block(qa, 1)).astype(np.float64)
           @ np.asarray(F.dequantize_block(qb, b_dim)).astype(np.float64).T)
    for exact in (True, False):
        got = np.asarray(F.block_dot(qa, 1, qb, b_dim, np.float32, exact_bf16=exact), np.float64)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    # and the block FP8 product is close to the float one
    assert np.linalg.norm(ref - a.astype(np.float64) @ b.T) / np.linalg.norm(a @ b.T) < 0.05
    with pytest.raises(ValueError, match="2D by 2D"):
        F.block_dot(F.quantize_block(jax.numpy.asarray(a), 2), 2, qb, 2, np.float32)


_made = []


@pytest.fixture(autouse=True)
def _close_contexts():
    """Close the tests' TP contexts after each test: a live context keeps its key bound in
    the library (the keys are a process-wide counter that other test files' binding tests
    use)."""
    yield
    while _made:
        _made.pop().close()


def _ctx1(capi):
    import transformer_engine_comm.jax as tj
    from jax.sharding import Mesh

    ctx = tj.tp_context(Mesh(np.array(jax.devices()[:1]), ("tp",)), "tp")
    _made.append(ctx)
    return ctx


def _block_mlp_grad_for_cuda(capi, T, H, Fh):
    """The StableHLO text of the Float8BlockScaling MLP's gradient (x [T, H], the hidden
    size Fh; all five inputs), lowered for CUDA at tp 1 (fp8.BLOCK_GEMM / BLOCK_CASTS as
    the caller set them)."""
    import jax.numpy as jnp
    import transformer_engine_comm.jax as tj

    ctx = _ctx1(capi)
    r = tj.Float8BlockScaling()

    def loss(x, w1, b1, w2, b2):
        return jnp.mean(tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=r).astype(jnp.float32) ** 2)

    shapes = [(T, H), (Fh, H), (Fh,), (H, Fh), (H,)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    return jax.jit(jax.grad(loss, argnums=range(5))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_dense_forward_backward_is_the_block_math(capi):
    import jax.numpy as jnp
    import transformer_engine_comm.jax as tj
    from transformer_engine_comm.jax import fp8 as F

    ctx = _ctx1(capi)
    T, K, N = 256, 256, 384
    x, w, b = (jnp.asarray(a, jnp.bfloat16) for a in (data(5, T, K), data(6, N, K, scale=0.05), data(7, N)))
    g = jnp.asarray(data(8, T, N, scale=0.1), jnp.bfloat16)
    r = tj.Float8BlockScaling()
    y, vjp = jax.vjp(lambda x, w, b: tj.column_parallel_dense(x, w, b, ctx=ctx, fp8=r), x, w, b)
    dx, dw, db = vjp(g)
    f32 = np.float64

    def deq(t, d):
        return np.asarray(F.dequantize_block(t, d), f32)

    # forward: x (1D) . W (2D)^T; dgrad: dy (1D) . (W^T, 2D)^T; wgrad: dy^T (1D) . (x^T, 1D)^T
    y_ref = deq(F.quantize_block(x, 1), 1) @ deq(F.quantize_block(w, 2), 2).T + np.asarray(b, f32)
    dx_ref = deq(F.quantize_block(g, 1), 1) @ deq(F.block_columnwise(w, 2), 2).T
    dw_ref = deq(F.block_columnwise(g, 1), 1) @ deq(F.block_columnwise(x, 1), 1).T
    for name, got, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        e = np.linalg.norm(np.asarray(got, f32) - ref) / np.linalg.norm(ref)
        assert e < 1e-2, (name, e)  # bf16 outputs
    np.testing.assert_allclose(np.asarray(db, np.float32), np.asarray(g, np.float32).sum(0), rtol=2e-2, atol=2e-2)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    # and close to the float layer
    yf, vf = jax.vjp(lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32).T, x, w)
    for got, ref in ((y - b, yf), (dx, vf(g.astype(jnp.float32))[0])):
        e = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        assert e < 0.08, e


def test_mlp_block_jit_and_refusals(capi):
    import jax.numpy as jnp
    import transformer_engine_comm.jax as tj

    ctx = _ctx1(capi)
    T, H, Fh = 256, 256, 512
    bf = jnp.bfloat16
    x = jnp.asarray(data(9, T, H), bf)
    w1, w2 = jnp.asarray(data(10, Fh, H, scale=0.05), bf), jnp.asarray(data(11, H, Fh, scale=0.05), bf)
    b1, b2 = jnp.zeros((Fh,), bf), jnp.zeros((H,), bf)
    r = tj.Float8BlockScaling()

    def loss(x, w1, w2, fp8):
        return jnp.mean(tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=fp8).astype(jnp.float32) ** 2)

    lb, gb = jax.jit(jax.value_and_grad(lambda *a: loss(*a, r), argnums=(1, 2)))(x, w1, w2)
    lf, gf = jax.jit(jax.value_and_grad(lambda *a: loss(*a, False), argnums=(1, 2)))(x, w1, w2)
    assert abs(float(lb) - float(lf)) / float(lf) < 0.02
    for a, b in zip(gb, gf):
        e = float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        assert e < 0.15, e
    with pytest.raises(ValueError, match="no state"):
        tj.column_parallel_dense(x, w1, b1, ctx=ctx, fp8=r, fp8_meta=tj.fp8_meta_init(tj.DelayedScaling(amax_history_len=2)))
    # mlp (one function for both layers under block scaling) refuses a state for either
    # layer, and takes a pair of Nones as none.
    for meta in ((None, tj.fp8_meta_init(tj.DelayedScaling(amax_history_len=2))),
                 (tj.fp8_meta_init(tj.DelayedScaling(amax_history_len=2)), None)):
        with pytest.raises(ValueError, match="no state"):
            tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=r, fp8_meta=meta)
    tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=r, fp8_meta=(None, None))
    # At tp 1 nothing is communicated: library=True runs the same block math.
    a = tj.column_parallel_dense(x, w1, b1, ctx=ctx, fp8=r)
    b = tj.column_parallel_dense(x, w1, b1, ctx=ctx, fp8=r, library=True)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


_TP4 = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import transformer_engine_comm.jax as tj

mesh = Mesh(np.array(jax.devices()), ("tp",))
assert len(jax.devices()) == 4
ctx4 = tj.tp_context(mesh, "tp")
ctx1 = tj.tp_context(Mesh(np.array(jax.devices()[:1]), ("tp",)), "tp")
rng = np.random.default_rng(0)
T, H, F = 512, 256, 1024  # F / 4 = 256: the shards' blocks are blocks of the whole tensors
bf = jnp.bfloat16
x = jnp.asarray(rng.standard_normal((T, H)), bf)
w1 = jnp.asarray(rng.standard_normal((F, H)) * 0.05, bf)
b1 = jnp.asarray(rng.standard_normal((F,)) * 0.1, bf)
w2 = jnp.asarray(rng.standard_normal((H, F)) * 0.05, bf)
b2 = jnp.asarray(rng.standard_normal((H,)) * 0.1, bf)
r = tj.Float8BlockScaling()

def loss(model):
    return lambda x, w1, b1, w2, b2: jnp.sum(model(x, w1, b1, w2, b2).astype(jnp.float32) ** 2) / T

one = lambda x, w1, b1, w2, b2: tj.mlp(x, w1, b1, w2, b2, ctx=ctx1, fp8=r)
ref_l, ref_g = jax.jit(jax.value_and_grad(loss(one), argnums=(0, 1, 2, 3, 4)))(x, w1, b1, w2, b2)
for sp in (True, False):
    specs = ((P("tp", None) if sp else P()), P("tp", None), P("tp"), P(None, "tp"), P())
    four = tj.tp_shard_map(lambda x, w1, b1, w2, b2: tj.mlp(x, w1, b1, w2, b2, ctx=ctx4, fp8=r, sequence_parallel=sp),
                           mesh, specs, P("tp", None) if sp else P())
    l, g = jax.jit(jax.value_and_grad(loss(four), argnums=(0, 1, 2, 3, 4)))(x, w1, b1, w2, b2)
    assert abs(float(l) - float(ref_l)) <= 1e-2 * abs(float(ref_l)), (sp, float(l), float(ref_l))
    for name, a, b in zip(("x", "w1", "b1", "w2", "b2"), g, ref_g):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        e = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert e < 2e-2, (sp, name, e)
print("OK")
"""


def test_block_mlp_tp4_matches_tp1(capi):
    """The MLP under block scaling at tp 4 in shard_map (CPU devices; XLA's collectives
    around the block GEMMs), with and without sequence parallelism: the loss and every
    gradient match the tp-1 layer's (128-aligned shards quantize as the whole tensors)."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")  # four host devices, also where a GPU is present
    out = subprocess.run([sys.executable, "-c", _TP4], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-4000:]


# ---- the library's block-scaled GEMM (ops.block_gemm): layout, fallback, lowering -------

@pytest.mark.parametrize("shape", [(256, 384), (130, 300), (1, 129), (1152, 640)])
@pytest.mark.parametrize("dim", [1, 2])
def test_gemm_ready_scales_match_numpy(shape, dim):
    from transformer_engine_comm.jax import fp8 as F, ops

    rows, cols = shape
    q = F.quantize_block(jax.numpy.asarray(data(20 + dim, rows, cols)), dim)
    s = np.asarray(q.scale_inv)
    nb, mb = -(-cols // 128), -(-rows // 128)
    want_shape = (nb, -(-rows // 4) * 4) if dim == 1 else (mb, -(-nb // 4) * 4)
    ref = np.ones(want_shape, np.float32)
    if dim == 1:
        ref[:, :rows] = s.T  # entry (column block, row)
    else:
        ref[:, :nb] = s  # entry (row block, column block)
    got = np.asarray(ops.gemm_ready_scales(q.scale_inv, rows, cols, dim))
    assert ops.gemm_ready_scale_shape(rows, cols, dim) == want_shape
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(ValueError, match="must be"):
        ops.gemm_ready_scales(q.scale_inv.T, rows, cols, dim) if rows != nb or dim == 2 else ops.gemm_ready_scales(
            q.scale_inv[:, :0], rows, cols, dim)


def test_gemm_ready_scale_shapes_are_the_librarys():
    from transformer_engine_comm.jax import ops

    # src/tensor.rs's scale_shape: one_d_rowwise_gemm_ready(130, 300) = [3, 132],
    # two_d_rowwise(1152, 640) = [9, 8]
    assert ops.gemm_ready_scale_shape(130, 300, 1) == (3, 132)
    assert ops.gemm_ready_scale_shape(1152, 640, 2) == (9, 8)
    with pytest.raises(ValueError, match="block_dim"):
        ops.gemm_ready_scale_shape(128, 128, 3)


def test_block_dot_falls_back_to_the_dequantized_dot_on_cpu(monkeypatch):
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F, ops

    assert jax.default_backend() == "cpu" and not ops.block_gemm_available()
    qa, qb = F.quantize_block(jnp.asarray(data(30, 256, 512)), 1), F.quantize_block(jnp.asarray(data(31, 384, 512)), 2)
    assert not F._block_gemm_on_library(qa, 1, qb, 2, jnp.bfloat16, "auto")
    auto = np.asarray(F.block_dot(qa, 1, qb, 2, jnp.float32), np.float32)
    ref = np.asarray(F.block_dot(qa, 1, qb, 2, jnp.float32, gemm="dequant"), np.float32)
    np.testing.assert_array_equal(auto, ref)
    assert F._block_gemm_on_library(qa, 1, qb, 2, jnp.bfloat16, "library")
    monkeypatch.setattr(F, "BLOCK_GEMM", "dequant")
    assert not F._block_gemm_on_library(qa, 1, qb, 2, jnp.bfloat16, None)
    # Shapes cuBLASLt's block GEMM does not take: an error with "library", the dot with "auto"
    odd = F.quantize_block(jnp.asarray(data(32, 100, 520)), 1)
    with pytest.raises(ValueError, match="does not take"):
        F.block_dot(odd, 1, F.quantize_block(jnp.asarray(data(33, 64, 520)), 1), 1, jnp.float32, gemm="library")
    assert not ops.block_gemm_fits(256, 384, 520, jnp.float8_e4m3fn, jnp.float8_e4m3fn, 1, 1)  # k % 16
    assert not ops.block_gemm_fits(100, 384, 512, jnp.float8_e4m3fn, jnp.float8_e4m3fn, 1, 2)  # m % 8, a 1D
    assert ops.block_gemm_fits(100, 384, 512, jnp.float8_e4m3fn, jnp.float8_e4m3fn, 2, 1)
    assert not ops.block_gemm_fits(256, 384, 512, jnp.float8_e5m2, jnp.float8_e5m2, 1, 1)
    assert not ops.block_gemm_fits(256, 384, 512, jnp.bfloat16, jnp.float8_e4m3fn, 1, 1)
    with pytest.raises(ValueError, match="'auto', 'library' or 'dequant'"):
        F.block_dot(qa, 1, qb, 2, jnp.float32, gemm="cublas")


def _block_calls(txt):
    import re

    return re.findall(r"custom_call @te_comm_block_gemm\((.*?)\) \{.*?mhlo.backend_config = \{([^}]*)\}.*?\} : "
                      r"\((.*?)\) -> (.*?)\n", txt)


def test_block_gemm_lowers_to_the_custom_call(capi):
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F, ops

    def f(a, b):
        qa, qb = F.quantize_block(a, 1), F.quantize_block(b, 2)
        return F.block_dot(qa, 1, qb, 2, jnp.bfloat16, gemm="library")

    args = [jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((384, 512), jnp.bfloat16)]
    txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = _block_calls(txt)
    assert len(calls) == 1, txt[-3000:]
    _, attrs, ins, outs = calls[0]
    # the GEMM-ready scales: a 1D [K/128, roundup(M, 4)], b 2D [N/128, roundup(K/128, 4)]
    assert ins.split(", ") == ["tensor<256x512xf8E4M3FN>", "tensor<4x256xf32>", "tensor<384x512xf8E4M3FN>",
                               "tensor<3x4xf32>"], ins
    assert "tensor<256x384xbf16>" in outs and f"tensor<{ops.BLOCK_WORKSPACE_BYTES}xui8>" in outs, outs
    kv = dict(x.split(" = ") for x in attrs.split(", "))
    assert kv["a_block_dim"].startswith("1 ") and kv["b_block_dim"].startswith("2 "), kv
    assert kv["has_bias"] == "false" and kv["dgelu"] == "false", kv
    # Refused at trace time: the compact scales, bias with dgelu
    qa = F.quantize_block(jnp.zeros((256, 512), jnp.bfloat16), 1)
    with pytest.raises(ValueError, match="GEMM-ready"):
        ops.block_gemm(qa.q, qa.scale_inv, qa.q, qa.scale_inv, a_block_dim=1, b_block_dim=1)
    s = ops.gemm_ready_scales(qa.scale_inv, 256, 512, 1)
    with pytest.raises(ValueError, match="not both"):
        ops.block_gemm(qa.q, s, qa.q, s, a_block_dim=1, b_block_dim=1, bias=jnp.zeros((256,)),
                       dgelu_pre=jnp.zeros((256, 256)))


def test_block_layers_training_step_lowers_to_block_gemms(capi, monkeypatch):
    """The MLP's jitted training step under Float8BlockScaling, lowered for CUDA with the
    library's GEMM: each dense's three GEMMs (forward, dgrad, wgrad) are block GEMM calls."""
    from transformer_engine_comm.jax import fp8 as F

    monkeypatch.setattr(F, "BLOCK_GEMM", "library")
    txt = _block_mlp_grad_for_cuda(capi, 256, 256, 512)
    calls = _block_calls(txt)
    assert len(calls) == 6, len(calls)
    dims = sorted((dict(x.split(" = ") for x in a.split(", "))["a_block_dim"][0],
                   dict(x.split(" = ") for x in a.split(", "))["b_block_dim"][0]) for _, a, _, _ in calls)
    # forward x (1D) . w (2D); dgrad dy (1D) . w^T (2D); wgrad dy^T (1D) . x^T (1D)
    assert dims == [("1", "1")] * 2 + [("1", "2")] * 4, dims
    # the forwards' bias in the GEMM's epilogue (bf16 output)
    biased = [dict(x.split(" = ") for x in a.split(", "))["has_bias"] for _, a, _, _ in calls]
    assert biased.count("true") == 2, biased


# ---- the library's block quantization (ops.block_quantize): layout, rules, lowering ------

def _quantize_calls(txt):
    import re

    return re.findall(r"custom_call @te_comm_block_quantize\((.*?)\) \{.*?mhlo.backend_config = \{([^}]*)\}.*?\} : "
                      r"\((.*?)\) -> (.*?)\n", txt)


def _kv(attrs):
    return dict(x.split(" = ") for x in attrs.split(", "))


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("rowwise, columnwise", [(True, True), (True, False), (False, True)])
def test_block_quantize_lowers_to_the_custom_call(capi, dim, rowwise, columnwise):
    """One custom call per cast: the input in, the asked-for directions out at their
    shapes (columnwise data the transpose), the scales at TE's GEMM-ready shapes, the
    recipe's options as attributes."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import ops

    R, C = 384, 640  # odd multiples of 128: 2D scales padded to a multiple of 4

    def f(x):
        return ops.block_quantize(x, dim, power_2_scale=False, amax_epsilon=0.5, rowwise=rowwise,
                                  columnwise=columnwise)

    txt = jax.jit(f).trace(jax.ShapeDtypeStruct((R, C), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    calls = _quantize_calls(txt)
    assert len(calls) == 1, txt[-3000:]
    _, attrs, ins, outs = calls[0]
    assert ins == "tensor<384x640xbf16>", ins
    want = []
    if rowwise:
        want += ["tensor<384x640xf8E4M3FN>", "tensor<5x384xf32>" if dim == 1 else "tensor<3x8xf32>"]
    if columnwise:
        want += ["tensor<640x384xf8E4M3FN>", "tensor<3x640xf32>" if dim == 1 else "tensor<5x4xf32>"]
    assert outs.strip("()").split(", ") == want, outs
    kv = _kv(attrs)
    assert kv["block_dim"].startswith(f"{dim} ") and kv["power_2_scale"] == "false", kv
    assert kv["amax_epsilon"].startswith("5.000000e-01"), kv
    assert kv["rowwise"] == str(rowwise).lower() and kv["columnwise"] == str(columnwise).lower(), kv
    # the GEMM-ready shapes are ops.gemm_ready_scale_shape of the data as stored
    assert ops.gemm_ready_scale_shape(R, C, dim) == ((5, 384) if dim == 1 else (3, 8))
    assert ops.gemm_ready_scale_shape(C, R, dim) == ((3, 640) if dim == 1 else (5, 4))


def test_block_quantize_refuses_at_trace_time(capi):
    import jax.numpy as jnp
    from transformer_engine_comm.jax import ops

    x = jnp.zeros((256, 384), jnp.bfloat16)
    for bad, match in ((jnp.zeros((200, 384), jnp.bfloat16), "multiples of 128"),
                       (jnp.zeros((256, 130), jnp.float32), "multiples of 128"),
                       (jnp.zeros((256, 384), jnp.int32), "float32 / bfloat16 / float16"),
                       (jnp.zeros((2, 128, 384), jnp.bfloat16), "2-D")):
        with pytest.raises(ValueError, match=match):
            ops.block_quantize(bad, 1)
    with pytest.raises(ValueError, match="block_dim"):
        ops.block_quantize(x, 3)
    with pytest.raises(ValueError, match="rowwise and / or columnwise"):
        ops.block_quantize(x, 1, rowwise=False)
    with pytest.raises(ValueError, match="amax_epsilon"):
        ops.block_quantize(x, 1, amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="not an FP8 type"):
        ops.block_quantize(x, 1, dtype="bfloat16")
    assert ops.block_quantize_fits((128, 256), jnp.float16) and not ops.block_quantize_fits((0, 128), jnp.float32)


@pytest.mark.parametrize("shape", [(256, 384), (384, 1152), (128, 128)])
@pytest.mark.parametrize("dim", [1, 2])
def test_gemm_ready_casts_are_the_compact_casts(shape, dim):
    """BlockQReady (GEMM-ready scales, what the library's quantization writes) and BlockQ
    (compact) hold the same cast: compact_scales inverts gemm_ready_scales, for the rowwise
    and the columnwise forms, and block_dot / dequantize_block take either."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F, ops

    x = jnp.asarray(data(40 + dim, *shape))
    for t in (F.quantize_block(x, dim), F.block_columnwise(x, dim)):
        rows, cols = t.q.shape
        ready = F.BlockQReady(t.q, ops.gemm_ready_scales(t.scale_inv, rows, cols, dim))
        back = F.compact_scales(ready, dim)
        np.testing.assert_array_equal(np.asarray(back.scale_inv), np.asarray(t.scale_inv))
        np.testing.assert_array_equal(np.asarray(F.dequantize_block(ready, dim)),
                                      np.asarray(F.dequantize_block(t, dim)))
    a = F.quantize_block(jnp.asarray(data(50, 256, shape[1])), 1)
    b = F.quantize_block(x, dim)
    rb = F.BlockQReady(b.q, ops.gemm_ready_scales(b.scale_inv, *b.q.shape, dim))
    np.testing.assert_array_equal(np.asarray(F.block_dot(a, 1, rb, dim, jnp.float32)),
                                  np.asarray(F.block_dot(a, 1, b, dim, jnp.float32)))


def test_block_casts_follow_the_gemm_mode(monkeypatch):
    """Where the layers cast: the library's kernel with the library's GEMM (and whole 128 x
    128 tiles), jnp otherwise; BLOCK_CASTS overrides."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F, ops

    on = F.block_casts_on_library
    bf = jnp.bfloat16
    assert not ops.block_gemm_available()  # CPU
    assert not on((256, 384), bf, "auto", "auto")  # auto on CPU: the jnp casts, as the GEMM's dequantized dot
    assert on((256, 384), bf, "library", "auto")
    assert not on((256, 200), bf, "library", "auto")  # not whole tiles: jnp, whatever the mode
    assert not on((256, 384), bf, "dequant", "auto")
    assert on((256, 384), bf, "dequant", "library")
    assert not on((256, 384), bf, "library", "jnp")
    monkeypatch.setattr(ops, "block_gemm_available", lambda: True)  # as on a Hopper GPU
    assert on((256, 384), jnp.float32, "auto", "auto") and not on((256, 384), jnp.int8, "auto", "auto")
    monkeypatch.setattr(F, "BLOCK_CASTS", "jnp")
    assert not on((256, 384), bf)
    with pytest.raises(ValueError, match="'auto', 'library' or 'jnp'"):
        on((256, 384), bf, "auto", "torch")


@pytest.mark.parametrize("casts, want", [("auto", 6), ("jnp", 0)])
def test_block_training_step_lowers_to_block_quantizes(capi, monkeypatch, casts, want):
    """The MLP's jitted training step, lowered for CUDA with the library's GEMM: every cast
    (x, w1, gelu(h), w2 forward, the GELU fused into h's cast; the two output gradients
    backward, each with its bias gradient, fc1's with the GELU's backward) is one block
    quantize call writing both directions, feeding the six block GEMMs their GEMM-ready scales; with BLOCK_CASTS "jnp"
    none (the jnp casts)."""
    from transformer_engine_comm.jax import fp8 as F

    monkeypatch.setattr(F, "BLOCK_GEMM", "library")
    monkeypatch.setattr(F, "BLOCK_CASTS", casts)
    txt = _block_mlp_grad_for_cuda(capi, 256, 384, 640)
    calls = _quantize_calls(txt)
    assert len(calls) == want, len(calls)
    assert len(_block_calls(txt)) == 6
    # The MLP's GELU backward rides in fc1's output-gradient cast, not in a GEMM epilogue
    assert [_kv(a)["dgelu"] for _, a, _, _ in _block_calls(txt)].count("true") == 0
    # The GEMMs take the library quantization's scales as they are: no conversion to the
    # GEMM-ready layout (the jnp casts' scales are transposed and padded to it)
    assert ("stablehlo.pad" in txt) == (want == 0)
    if not want:
        return
    got = sorted((ins, _kv(a)["block_dim"][0]) for _, a, ins, _ in calls)
    # x [T, H] 1D, w1 [F, H] 2D, h [T, F] 1D, w2 [H, F] 2D; backward dy [T, H], and the
    # gradient at gelu(h) [T, F] 1D with h (the GELU's input) beside it
    assert got == sorted([("tensor<256x384xbf16>", "1"), ("tensor<640x384xbf16>", "2"), ("tensor<256x640xbf16>", "1"),
                          ("tensor<384x640xbf16>", "2"), ("tensor<256x384xbf16>", "1"),
                          ("tensor<256x640xbf16>, tensor<256x640xbf16>", "1")]), got
    for _, a, _, outs in calls:
        kv = _kv(a)
        assert kv["rowwise"] == kv["columnwise"] == "true" and kv["power_2_scale"] == "true", kv
        assert len(outs.strip("()").split(", ")) == 4 + (kv["dbias"] == "true"), outs
    # The GELU rides in h's cast (fc2's input), its backward in fc1's output-gradient cast;
    # the bias gradients in the output gradients' casts (one more result each: the [T/128,
    # N] f32 partial sums)
    fused = sorted((ins, _kv(a)["gelu"], _kv(a)["dgelu"], _kv(a)["dbias"], outs.strip("()").split(", ")[4:])
                   for _, a, ins, outs in calls if "true" in (_kv(a)["gelu"], _kv(a)["dbias"]))
    assert fused == sorted([("tensor<256x640xbf16>", "true", "false", "false", []),
                            ("tensor<256x384xbf16>", "false", "false", "true", ["tensor<2x384xf32>"]),
                            ("tensor<256x640xbf16>, tensor<256x640xbf16>", "false", "true", "true",
                             ["tensor<2x640xf32>"])]), fused


def test_block_mlp_gelu_backward_is_the_unfused_layers(capi):
    """The block MLP fuses the GELU into the second layer's input casts and its backward into
    the first layer's output-gradient casts (on the library: the quantize kernel; on the
    reference path: fp8.act_in_f32, float32 rounded once), so the loss and every gradient
    equal, bit for bit, those of the layers composed by hand (column, a GELU computed the
    same way, row)."""
    import jax.numpy as jnp
    import transformer_engine_comm.jax as tj
    from transformer_engine_comm.jax import fp8 as F

    ctx = _ctx1(capi)
    T, H, Fh = 256, 256, 384
    bf = jnp.bfloat16
    x = jnp.asarray(data(60, T, H), bf)
    w1, w2 = jnp.asarray(data(61, Fh, H, scale=0.05), bf), jnp.asarray(data(62, H, Fh, scale=0.05), bf)
    b1, b2 = jnp.asarray(data(63, Fh, scale=0.1), bf), jnp.asarray(data(64, H, scale=0.1), bf)
    r = tj.Float8BlockScaling()

    def fused(x, w1, b1, w2, b2):
        return tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=r)

    gelu = jax.custom_vjp(lambda h: F.act_in_f32(h, gelu=True))
    gelu.defvjp(lambda h: (F.act_in_f32(h, gelu=True), h), lambda h, g: (F.act_in_f32(g, dgelu_pre=h),))

    def by_hand(x, w1, b1, w2, b2):
        h = gelu(tj.column_parallel_dense(x, w1, b1, ctx=ctx, fp8=r))
        return tj.row_parallel_dense(h, w2, b2, ctx=ctx, fp8=r)

    def step(model):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.mean(model(*a).astype(jnp.float32) ** 2),
                                          argnums=range(5)))

    (la, ga), (lb, gb) = step(fused)(x, w1, b1, w2, b2), step(by_hand)(x, w1, b1, w2, b2)
    assert float(la) == float(lb)
    for a, b in zip(ga, gb):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # block_dot's dgelu_pre off the library: JAX's GELU VJP of the product
    qa, qb = F.quantize_block(x, 1), F.quantize_block(w2.T.astype(bf), 2)
    pre = jnp.asarray(data(65, T, Fh), bf)
    got = F.block_dot(qa, 1, qb, 2, bf, dgelu_pre=pre)
    want = F._gelu_vjp(pre, F.block_dot(qa, 1, qb, 2, bf))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="not both"):
        F.block_dot(qa, 1, qb, 2, bf, bias=b1, dgelu_pre=pre)
