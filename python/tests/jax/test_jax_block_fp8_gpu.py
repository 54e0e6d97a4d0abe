"""Float8BlockScaling in the JAX layers on ONE GPU (tp 1, in this process): the library's block
GEMM custom call (te_comm_block_gemm) against the dequantized dot, its epilogues, and the
training step on it against the dequantized-dot path; the library's block quantization
(te_comm_block_quantize) bit for bit against the jnp casts, and the training step with
it against the step with the jnp casts; the MLP's loss
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
    """The MLP's training step under Float8BlockScaling: on the GPU its GEMMs are the
    library's block GEMM (in the compiled step) fed by the library's casts, and its loss
    and gradients match the reference path (jnp casts, dequantized dots, JAX's GELU VJP).

    Error model: both paths take the same block FP8 products of the same FP8 operands
    wherever the tensors they quantize agree bit for bit; they differ in (a) the f32
    accumulation order (~1e-6), (b) the GELU backward (rounded once to bf16 in the dgrad's
    epilogue, twice on the reference path) and (c) the reference path's fused jnp casts,
    where XLA may skip a producer's bf16 rounding (excess precision; the library's kernel
    reads the stored bf16 tensor). A last-bit bf16 difference (2^-8 relative) in a tensor
    about to be quantized moves its e4m3 code one step (~2^-3 x 0.7 relative) with
    probability ~2^-8 / (2^-3 x 0.7): the rms relative difference of that operand is
    ~sqrt(2^-8 x 2^-3 x 0.7) ~ 1.9 % at most, against ~2.6 % (step / sqrt(12)) of
    quantization error in every quantized operand. So the paths' gradients must differ by
    less than either differs from the bf16 step's (the FP8 error, which compounds over
    more operands), and the library path be no further from bf16 than the reference."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    tj, ctx, (x, w1, b1, w2, b2) = _setup()
    r = tj.Float8BlockScaling()

    def step_with(mode, fp8=r):
        def loss(w1, w2):
            old = F.BLOCK_GEMM
            F.BLOCK_GEMM = mode  # read at trace time
            try:
                return jnp.mean(tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=fp8).astype(jnp.float32) ** 2)
            finally:
                F.BLOCK_GEMM = old
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    lib, deq, bf16 = step_with("auto"), step_with("dequant"), step_with("auto", False)
    # six GEMMs, less fc1's dgrad: x takes no gradient, XLA drops that call
    assert lib.lower(w1, w2).compile().as_text().count('custom_call_target="te_comm_block_gemm"') == 5
    assert "te_comm_block_gemm" not in deq.lower(w1, w2).compile().as_text()
    (ll, gl), (ld, gd), (_, gb) = lib(w1, w2), deq(w1, w2), bf16(w1, w2)
    assert abs(float(ll) - float(ld)) / float(ld) < 1e-3, (float(ll), float(ld))

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    for name, a, b, f in zip(("w1", "w2"), gl, gd, gb):
        e_ld, e_db, e_lb = rel(a, b), rel(b, f), rel(a, f)
        assert e_ld < e_db, (name, e_ld, e_db)
        assert e_lb < 1.1 * e_db, (name, e_lb, e_db)
    # a few optimizer steps on the library's GEMM lower the loss
    w = (w1, w2)
    for _ in range(3):
        _, g = lib(*w)
        w = tuple((p.astype(jnp.float32) - 0.5 * q.astype(jnp.float32)).astype(p.dtype) for p, q in zip(w, g))
    assert float(lib(*w)[0]) < float(ll)


# ---- the library's block quantization (te_comm_block_quantize) against the jnp casts ----

def _hard_input(rows, cols, dtype, seed=7):
    """Blocks of very different magnitudes, a zero tile, a tiny tile (its scale overflows to
    the input type's largest value; zeros in f16), values on the e4m3 grid, an infinity."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 12, size=(rows // 128, 1, cols // 128, 1))).repeat(128, 1).repeat(
        128, 3).reshape(rows, cols)
    x[:128, :128] = 0.0
    # tiny but normal values: 448 / amax overflows f32 (the scale is the input type's max)
    x[128:256, :128] = np.sign(x[128:256, :128]) * rng.uniform(5e-38, 1e-37, (min(rows, 256) - 128, 128))
    x[:128, 128:256] = np.round(x[:128, 128:256] * 16) / 16  # values on the e4m3 grid and its ties
    x[5, 300 % cols] = -np.inf
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape, dtype", [((384, 640), "bfloat16"), ((128, 1152), "float32"),
                                          ((1152, 256), "float16")])
def test_block_quantize_is_bit_exact_with_the_jnp_casts(shape, dim, pow2, dtype):
    """Rowwise and columnwise, from one call, the same bits as quantize_block /
    block_columnwise (TE's definition), scales included (GEMM-ready, compared through
    compact_scales); odd multiples of 128 (2D scales padded)."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    x = _hard_input(*shape, dtype)
    eps = 0.0 if pow2 else 1e-3
    kw = dict(power_2_scale=pow2, amax_epsilon=eps)
    lib = jax.jit(lambda x: F.quantize_block_library(x, dim, columnwise=True, **kw))
    row, col = lib(x)
    ref_r, ref_c = jax.jit(lambda x: (F.quantize_block(x, dim, **kw), F.block_columnwise(x, dim, **kw)))(x)
    for name, got, ref in (("rowwise", row, ref_r), ("columnwise", col, ref_c)):
        assert got.q.shape == ref.q.shape and got.q.dtype == jnp.float8_e4m3fn, name
        np.testing.assert_array_equal(np.asarray(got.q).view(np.uint8), np.asarray(ref.q).view(np.uint8),
                                      err_msg=f"{name} data")
        np.testing.assert_array_equal(np.asarray(F.compact_scales(got, dim).scale_inv), np.asarray(ref.scale_inv),
                                      err_msg=f"{name} scale_inv")
    # one direction alone writes the same; a replay (command buffer) the same bits
    r_only, _ = jax.jit(lambda x: F.quantize_block_library(x, dim, **kw))(x)
    _, c_only = jax.jit(lambda x: F.quantize_block_library(x, dim, rowwise=False, columnwise=True, **kw))(x)
    np.testing.assert_array_equal(np.asarray(r_only.q).view(np.uint8), np.asarray(row.q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(c_only.q).view(np.uint8), np.asarray(col.q).view(np.uint8))
    again, _ = lib(x)
    np.testing.assert_array_equal(np.asarray(again.q).view(np.uint8), np.asarray(row.q).view(np.uint8))
    assert "te_comm_block_quantize" in lib.lower(x).compile().as_text()


def _codes_and_values(t, dim):
    """(the FP8 codes as bytes, the dequantized values in float64) of a library cast."""
    from transformer_engine_comm.jax import fp8 as F

    return np.asarray(t.q).view(np.uint8), np.asarray(F.dequantize_block(t, dim, "float32"), np.float64)


def _gelu_sigmoid64(x):
    """sigmoid(2 u) = 0.5 (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), in float64
    without the cancellation of 1 + tanh(u) for negative x."""
    return 1.0 / (1.0 + np.exp(-2.0 * np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _gelu64(x):
    return x * _gelu_sigmoid64(x)


@pytest.mark.parametrize("act", ["gelu", "dgelu"])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_block_quantize_fuses_the_gelu(act, dim, dtype):
    """gelu=True casts gelu(x), dgelu_pre=p casts x * gelu'(p) (the GELU's backward), without
    storing it: against the same kernel's casts of the float64 values rounded to x's
    dtype, both directions. The kernel computes in float32 with an approximate exp (a few
    float ulps), so nearly every FP8 code is the same and none is more than one FP8 step
    away; the columnwise cast holds the same values as the rowwise one. (XLA's GELU of a
    bf16 array rounds its intermediates to bf16: further from float64 than this.)"""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((384, 640)) * 3, dtype)
    x64 = np.asarray(x, np.float64)
    if act == "gelu":
        kw = dict(gelu=True)
        g = jnp.asarray(_gelu64(x64), dtype)
    else:
        p = jnp.asarray(rng.standard_normal((384, 640)) * 3, dtype)
        kw = dict(dgelu_pre=p)
        g = jnp.asarray(x64 * _gelu_grad(np.asarray(p, np.float64)), dtype)
    fused = jax.jit(lambda x: F.quantize_block_library(x, dim, columnwise=True, **kw))(x)
    ref = jax.jit(lambda g: F.quantize_block_library(g, dim, columnwise=True))(g)
    for name, got, want in zip(("rowwise", "columnwise"), fused, ref):
        gq, gv = _codes_and_values(got, dim)
        wq, wv = _codes_and_values(want, dim)
        # (e4m3 -0 is 0x80: a value too small for either computation's float32 / float64 is
        # a zero of either sign)
        same = float(np.mean(np.where(gq == 0x80, 0, gq) == np.where(wq == 0x80, 0, wq)))
        assert same >= 0.999, (name, same)
        # one FP8 step: 2^-3 relative, or e4m3's subnormal step at the block's scale
        # (> 224 / amax with power-of-2 scales)
        assert np.all(np.abs(gv - wv) <= 2.0**-3 * np.abs(wv) + 2.0**-7 * np.abs(wv).max() / 448), name
    # the columnwise cast holds the same GELU values: 2D, the rowwise codes transposed;
    # 1D, dequantized within an FP8 step of the rowwise values
    rq, rv = _codes_and_values(fused[0], dim)
    cq, cv = _codes_and_values(fused[1], dim)
    if dim == 2:
        np.testing.assert_array_equal(cq, rq.T)
    else:
        assert np.all(np.abs(cv.T - rv) <= 2.0**-3 * np.maximum(np.abs(rv), np.abs(cv.T))
                      + 2.0**-7 * np.abs(rv).max() / 448)


@pytest.mark.parametrize("act", [None, "gelu", "dgelu"])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_block_quantize_bias_gradient(dtype, dim, act):
    """dbias=True: the column sums of what is cast, from the same read (the casts
    themselves unchanged, bit for bit), against float64 sums: f32 accumulation over the
    tiles' rows and then the tiles; with an activation (gelu, or dgelu with the GELU's
    input), the sums of its values (rounded to x's dtype: up to half an ulp of it each)."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((640, 384)), dtype)
    kw = dict(columnwise=True)
    x64 = np.asarray(x, np.float64)
    if act == "gelu":
        kw["gelu"] = True
        x64 = _gelu64(x64)
    elif act == "dgelu":
        p = jnp.asarray(rng.standard_normal((640, 384)) * 3, dtype)
        kw["dgelu_pre"] = p
        x64 = x64 * _gelu_grad(np.asarray(p, np.float64))
    row, col, db = jax.jit(lambda x: F.quantize_block_library(x, dim, dbias=True, **kw))(x)
    row0, col0 = jax.jit(lambda x: F.quantize_block_library(x, dim, **kw))(x)
    for a, b in ((row, row0), (col, col0)):
        np.testing.assert_array_equal(np.asarray(a.q).view(np.uint8), np.asarray(b.q).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(a.scale_inv), np.asarray(b.scale_inv))
    if dim == 2:  # 3 and 5 blocks: GEMM-ready scales padded to 4 and 8 columns, zeroed
        assert np.all(np.asarray(row.scale_inv)[:, 3:] == 0) and np.all(np.asarray(col.scale_inv)[:, 5:] == 0)
    assert db.shape == (384,) and db.dtype == jnp.float32
    rel = {"bfloat16": 2.0**-8, "float16": 2.0**-11}.get(dtype, 0.0) if act else 0.0
    err = np.abs(np.asarray(db, np.float64) - x64.sum(0))
    assert np.all(err <= (rel + 1e-5) * np.abs(x64).sum(0) + 1e-6), float((err / np.abs(x64).sum(0)).max())


def test_block_quantize_feeds_the_block_gemm():
    """The GEMM-ready scales go to the block GEMM as they are: the product equals the one
    of the jnp casts (whose scales are converted), bit for bit."""
    from transformer_engine_comm.jax import fp8 as F

    a, b = _hard_input(384, 1024, "bfloat16", 1), _hard_input(640, 1024, "bfloat16", 2)
    a, b = jax.numpy.where(jax.numpy.isinf(a), 0, a), jax.numpy.where(jax.numpy.isinf(b), 0, b)
    for bd in (1, 2):
        lib = jax.jit(lambda a, b: F.block_dot(F.quantize_block_library(a, 1)[0], 1,
                                               F.quantize_block_library(b, bd)[0], bd, "float32", gemm="library"))
        ref = jax.jit(lambda a, b: F.block_dot(F.quantize_block(a, 1), 1, F.quantize_block(b, bd), bd, "float32",
                                               gemm="library"))
        lib(a, b)  # the GEMM's first eager run of a shape times its candidate algorithms
        np.testing.assert_array_equal(np.asarray(lib(a, b)), np.asarray(ref(a, b)))


def _with_casts(casts, f):
    """``f`` traced with ``fp8.BLOCK_CASTS`` = ``casts`` (read at trace time)."""
    from transformer_engine_comm.jax import fp8 as F

    def g(*a):
        old = F.BLOCK_CASTS
        F.BLOCK_CASTS = casts
        try:
            return f(*a)
        finally:
            F.BLOCK_CASTS = old
    return g


def _block_mlp_step(casts):
    """The MLP's jitted training step (loss and the weights' gradients) under block
    scaling, with ``casts`` ("auto": the library's kernel; "jnp"), and its arguments."""
    import jax.numpy as jnp

    tj, ctx, (x, w1, b1, w2, b2) = _setup()
    r = tj.Float8BlockScaling()

    def loss(w1, w2):
        return jnp.mean(tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=r).astype(jnp.float32) ** 2)

    return jax.jit(_with_casts(casts, jax.value_and_grad(loss, argnums=(0, 1)))), (w1, w2)


def _steps_equal_bit_for_bit():
    """Run in a child process without XLA's excess precision: the step with the library's
    casts and the one with the jnp casts, compared bit for bit (AssertionError if not)."""
    out = {}
    for c in ("auto", "jnp"):
        step, args = _block_mlp_step(c)
        casts = step.lower(*args).compile().as_text().count('custom_call_target="te_comm_block_quantize"')
        assert casts == (6 if c == "auto" else 0), (c, casts)  # the library's casts, or none
        step(*args)  # the GEMMs' first eager runs time their candidates: then fixed
        loss, grads = step(*args)
        out[c] = [np.asarray(loss, np.float32)] + [np.asarray(g, np.float32) for g in grads]
    for name, a, b in zip(("loss", "dw1", "dw2"), out["auto"], out["jnp"]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    print("bit for bit: loss", float(out["auto"][0]))


def test_block_training_step_library_casts_equal_the_jnp_casts():
    """The MLP's training step with the library's casts (six quantize calls, both
    directions each) against the same step with the jnp casts. A layer whose inputs are the
    program's arguments gets the same FP8 operands either way: its forward and gradients
    are equal bit for bit. The whole step is equal bit for bit too once XLA rounds what it
    is asked to round: under its default excess precision, XLA computes a jnp cast's fused
    producer (the GELU and its gradient) in f32 without the rounding to bf16 that the
    library's kernel does (measured: dw1 3 % apart), so that comparison runs in a child
    process with ``--xla_allow_excess_precision=false``."""
    import os
    import subprocess
    import sys

    import jax.numpy as jnp

    tj, ctx, (x, w1, b1, w2, b2) = _setup()
    r = tj.Float8BlockScaling()

    def dense(x, w1):
        return tj.column_parallel_dense(x, w1, b1, ctx=ctx, fp8=r).astype(jnp.float32)

    gy = jnp.asarray(np.random.default_rng(3).standard_normal((x.shape[0], w1.shape[0])), jnp.float32)

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(dense, x, w)
        return (y,) + vjp(gy)

    one = {c: jax.jit(_with_casts(c, fwd_bwd)) for c in ("auto", "jnp")}
    step = {c: _block_mlp_step(c)[0] for c in ("auto", "jnp")}
    hlo = step["auto"].lower(w1, w2).compile().as_text()
    # six casts (x, w1, h, w2 and the two output gradients), five GEMMs (fc1's dgrad dropped:
    # x takes no gradient)
    assert hlo.count('custom_call_target="te_comm_block_quantize"') == 6, hlo.count("te_comm_block_quantize")
    assert hlo.count('custom_call_target="te_comm_block_gemm"') == 5
    assert "te_comm_block_quantize" not in step["jnp"].lower(w1, w2).compile().as_text()
    one["auto"](x, w1)  # the GEMMs' first eager runs time their candidates: then fixed
    for a, b in zip(one["auto"](x, w1), one["jnp"](x, w1)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip())
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); " \
           "import test_jax_block_fp8_gpu as t; t._steps_equal_bit_for_bit()"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "bit for bit" in p.stdout, (p.stdout[-2000:], p.stderr[-4000:])


def _gelu_grad(x):
    """d/dx of the tanh-approximate GELU, in float64: s + 2 x s (1 - s) du/dx with s =
    sigmoid(2 u) (the tanh form's 1 + tanh(u) cancels for negative x)."""
    s = _gelu_sigmoid64(x)
    return s + 2.0 * x * s * (1.0 - s) * np.sqrt(2.0 / np.pi) * (1.0 + 3 * 0.044715 * x * x)


def test_block_mlp_gelu_in_the_casts_and_the_dgelu_epilogue():
    """The block GEMM's DGELU epilogue (block_dot's dgelu_pre): the GEMM's f32 product times
    gelu'(pre), rounded once to bf16, within one bf16 ulp of the float64 product of the f32
    GEMM output and gelu'. The MLP's step, whose GELU rides in the casts (forward: fc2's
    input casts; backward: fc1's output-gradient casts, on the quantize kernel), against
    the layers composed by hand around a GELU computed in jnp the same way (float32,
    rounded once): the kernel's exp differs in the last float bits, so a few FP8 codes
    move by one step: the loss within 1e-3, both layers' gradients much closer to the
    composed step's than either is to the bf16 step's (the FP8 quantization error)."""
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    tj, ctx, (x, w1, b1, w2, b2) = _setup()
    r = tj.Float8BlockScaling()
    # the epilogue: dy [T, H] (1D) . w2^T's columnwise [F, H] (2D), pre [T, F]
    rng = np.random.default_rng(11)
    dy = jnp.asarray(rng.standard_normal((x.shape[0], w2.shape[0])) * 1e-2, jnp.bfloat16)
    pre = jnp.asarray(rng.standard_normal((x.shape[0], w2.shape[1])) * 2, jnp.bfloat16)
    qg, wc = F.quantize_block_library(dy, 1)[0], F.quantize_block_library(w2, 2, rowwise=False, columnwise=True)[1]
    fused = jax.jit(lambda: F.block_dot(qg, 1, wc, 2, jnp.bfloat16, gemm="library", dgelu_pre=pre))
    prod = jax.jit(lambda: F.block_dot(qg, 1, wc, 2, jnp.float32, gemm="library"))
    fused(), prod()  # the GEMMs' first eager runs time their candidates: then fixed
    ref = np.asarray(prod(), np.float64) * _gelu_grad(np.asarray(pre, np.float64))
    got = np.asarray(fused(), np.float64)
    # one rounding to bf16 (half an ulp: <= 2^-8 relative), within one ulp (2^-7) with
    # cuBLASLt's f32 tanh and the two GEMM plans' f32 accumulation orders
    tol = 2.0**-7 * np.abs(ref) + 1e-5 * np.abs(ref).max()
    bad = np.abs(got - ref) > tol
    assert not bad.any(), (bad.sum(), np.abs(got - ref)[bad][:5], ref[bad][:5])

    def fused_loss(w1, w2):
        return jnp.mean(tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=r).astype(jnp.float32) ** 2)

    gelu = jax.custom_vjp(lambda h: F.act_in_f32(h, gelu=True))
    gelu.defvjp(lambda h: (F.act_in_f32(h, gelu=True), h), lambda h, g: (F.act_in_f32(g, dgelu_pre=h),))

    def by_hand(w1, w2, fp8=r):
        h = gelu(tj.column_parallel_dense(x, w1, b1, ctx=ctx, fp8=fp8))
        return jnp.mean(tj.row_parallel_dense(h, w2, b2, ctx=ctx, fp8=fp8).astype(jnp.float32) ** 2)

    fs, hs = (jax.jit(jax.value_and_grad(f, argnums=(0, 1))) for f in (fused_loss, by_hand))
    bf = jax.jit(jax.value_and_grad(lambda a, b: by_hand(a, b, False), argnums=(0, 1)))
    txt = fs.lower(w1, w2).compile().as_text()
    assert txt.count('custom_call_target="te_comm_block_gemm"') == 5
    fs(w1, w2), hs(w1, w2)  # the GEMMs' first eager runs time their candidates: then fixed
    (lf, gf), (lh, gh), (_, gb) = fs(w1, w2), hs(w1, w2), bf(w1, w2)
    assert abs(float(lf) - float(lh)) <= 1e-3 * abs(float(lh)), (float(lf), float(lh))

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    for i in (0, 1):
        e_fh, e_hb, e_fb = rel(gf[i], gh[i]), rel(gh[i], gb[i]), rel(gf[i], gb[i])
        assert e_fh < 0.5 * e_hb, (i, e_fh, e_hb)  # the fusion's difference: below the FP8 error
        assert e_fb < 1.05 * e_hb, (i, e_fb, e_hb)  # and the fused step no further from bf16
