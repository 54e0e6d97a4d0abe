"""Float8BlockScaling in the framework-neutral recipe family: TE's fields, defaults and
checks (block dims 1 or 2, no 2D x 2D GEMM, split accumulation, no E5M2; E4M3 only here),
QParams / MMParams, use_f32_scales, recipe_from_name("block"), and the same class from
torch and JAX. Host only: the core needs no framework; the framework checks skip without it."""
import dataclasses

import pytest

from transformer_engine_comm import recipe as R


def test_te_fields_and_defaults():
    names = [f.name for f in dataclasses.fields(R.Float8BlockScaling)]
    assert names == ["use_f32_scales", "fp8_format", "fp8_quant_fwd_inp", "fp8_quant_fwd_weight",
                     "fp8_quant_bwd_grad", "x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim",
                     "fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"]
    r = R.Float8BlockScaling()
    assert r.fp8_format is R.Format.E4M3 and r.use_f32_scales is False
    assert r.block_dims == (1, 2, 1)  # TE: activations and gradients 1D, weights 2D
    for q in r.qparams:  # TE's defaults: power-of-2 scales, no epsilon
        assert q == R.QParams(power_2_scale=True, amax_epsilon=0.0)
    for g in (r.fp8_gemm_fprop, r.fp8_gemm_dgrad, r.fp8_gemm_wgrad):
        assert g == R.MMParams(use_split_accumulator=True)
    assert r.dtypes == ("float8_e4m3fn",) * 3
    assert r.block and not r.delayed
    assert not R.DelayedScaling().block and not R.Float8CurrentScaling().block
    assert R.BLOCK_LEN == 128


def test_qparams_and_f32_scales():
    r = R.Float8BlockScaling(use_f32_scales=True)
    assert all(q.power_2_scale is False for q in r.qparams)
    q = R.QParams(power_2_scale=1, amax_epsilon=1)
    assert q.power_2_scale is True and q.amax_epsilon == 1.0 and type(q.amax_epsilon) is float
    r = R.Float8BlockScaling(use_f32_scales=True, fp8_quant_bwd_grad=q)  # an explicit QParams wins
    assert r.fp8_quant_bwd_grad is q and r.fp8_quant_fwd_inp.power_2_scale is False
    assert R.Float8BlockScaling() == R.Float8BlockScaling() and hash(R.Float8BlockScaling()) == hash(R.Float8BlockScaling())
    with pytest.raises(dataclasses.FrozenInstanceError):
        R.Float8BlockScaling().x_block_scaling_dim = 2


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(x_block_scaling_dim=3), ValueError, "x_block_scaling_dim must be 1 or 2"),
    (dict(w_block_scaling_dim=0), ValueError, "w_block_scaling_dim must be 1 or 2"),
    (dict(grad_block_scaling_dim=1.5), ValueError, "grad_block_scaling_dim"),
    (dict(grad_block_scaling_dim="1"), TypeError, "grad_block_scaling_dim"),
    (dict(x_block_scaling_dim=2), ValueError, "2D by 2D"),  # x 2D with the default 2D weights
    (dict(w_block_scaling_dim=1, x_block_scaling_dim=2, grad_block_scaling_dim=2), ValueError, "2D by 2D"),
    (dict(grad_block_scaling_dim=2), ValueError, "2D by 2D"),
    (dict(fp8_format=R.Format.E5M2), ValueError, "fp8_format"),
    (dict(fp8_format="hybrid"), ValueError, "fp8_format must be Format.E4M3"),
    (dict(fp8_gemm_wgrad=R.MMParams(use_split_accumulator=False)), ValueError, "split accumulation"),
    (dict(fp8_gemm_dgrad=True), TypeError, "fp8_gemm_dgrad must be an MMParams"),
    (dict(fp8_quant_fwd_inp=dict(power_2_scale=True)), TypeError, "fp8_quant_fwd_inp must be a QParams"),
    (dict(use_f32_scales="no"), TypeError, "use_f32_scales"),
])
def test_te_checks_name_the_field(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        R.Float8BlockScaling(**kwargs)


def test_valid_non_default_dims():
    r = R.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    assert r.block_dims == (2, 1, 1)
    assert R.Float8BlockScaling(w_block_scaling_dim=1).block_dims == (1, 1, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(amax_epsilon=-1.0), "amax_epsilon"),
    (dict(power_2_scale="y"), "power_2_scale"),
    (dict(stochastic_rounding=True), "NVFP4"),
    (dict(random_hadamard_transform=True), "NVFP4"),
])
def test_qparams_checks(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        R.QParams(**kwargs)


def test_unknown_te_keywords_refused():
    for kw in ("fp8_dpa", "fp8_mha", "backward_override"):
        with pytest.raises(TypeError, match=kw):
            R.Float8BlockScaling(**{kw: False})


def test_recipe_from_name_block():
    assert "block" in R.RECIPE_NAMES
    assert R.recipe_from_name("block") == R.Float8BlockScaling()
    assert R.recipe_from_name("block", w_block_scaling_dim=1).block_dims == (1, 1, 1)
    with pytest.raises(ValueError, match="blocks"):
        R.recipe_from_name("blocks")


def test_frameworks_export_the_core_class():
    try:
        from transformer_engine_comm.jax import fp8 as jf
    except ImportError:
        jf = None
    if jf is not None:
        assert jf.Float8BlockScaling is R.Float8BlockScaling
    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
    if torch is not None:
        from transformer_engine_comm.torch import fp8 as tf

        assert tf.Float8BlockScaling is R.Float8BlockScaling and tf.QParams is R.QParams
    if jf is None and torch is None:
        pytest.skip("neither JAX nor torch is installed")


@pytest.mark.parametrize("rows, cols, dim, col, want", [
    (256, 512, 1, False, (4, 256)), (200, 300, 1, False, (3, 200)), (5, 300, 1, False, (3, 8)),
    (256, 512, 1, True, (2, 512)), (200, 300, 1, True, (2, 300)),
    (256, 512, 2, False, (2, 4)), (200, 300, 2, False, (2, 4)), (1000, 130, 2, False, (8, 4)),
    (256, 512, 2, True, (4, 4)), (130, 1000, 2, True, (8, 4)),
])
def test_block_scale_shape_is_tes(rows, cols, dim, col, want):
    assert R.block_scale_shape(rows, cols, dim, columnwise=col) == want
    with pytest.raises(ValueError, match="block_dim"):
        R.block_scale_shape(rows, cols, 3)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("rows, cols", [(256, 512), (200, 300), (1, 128)])
def test_library_takes_the_block_layouts(capi, dim, rows, cols):
    """The block tensors the torch backend describes (rowwise data [rows, cols] and
    columnwise data [cols, rows], e4m3, each with its float32 scale_inv of
    block_scale_shape) are accepted by the library's tensor layer (no GPU needed)."""
    lib, P, DT = capi.lib(), capi.TensorParam, capi.DType
    mode = capi.ScalingMode.NVTE_BLOCK_SCALING_1D if dim == 1 else capi.ScalingMode.NVTE_BLOCK_SCALING_2D
    h = lib.nvte_create_tensor(int(mode))
    assert h and lib.nvte_comm_last_status() == 0, capi.last_error()
    t = capi.Tensor.from_handle(h)
    try:
        assert lib.nvte_tensor_scaling_mode(h) == int(mode)
        parts = ((P.kNVTERowwiseData, DT.kNVTEFloat8E4M3, (rows, cols)),
                 (P.kNVTERowwiseScaleInv, DT.kNVTEFloat32, R.block_scale_shape(rows, cols, dim)),
                 (P.kNVTEColumnwiseData, DT.kNVTEFloat8E4M3, (cols, rows)),
                 (P.kNVTEColumnwiseScaleInv, DT.kNVTEFloat32, R.block_scale_shape(rows, cols, dim, columnwise=True)))
        for i, (param, dt, shape) in enumerate(parts):
            t.set_param(param, 0x100000 * (i + 1), dt, shape)  # addresses only described, never read here
            assert t.get_param(param).shape == tuple(shape)
    finally:
        t.close()
