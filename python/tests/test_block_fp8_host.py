"""Block-scaled FP8 (Float8BlockScaling) in transformer_engine_comm.torch on the CPU: the
torch emulation (the reference the GPU tests compare the library against) bit for bit
against the independent numpy reference, TE's GEMM-ready scale_inv layouts, the emulated
block GEMM, and the modules' forward + backward under the recipe against bf16. Skipped
without torch (or without ml_dtypes, which the numpy reference casts with)."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8 dtypes", allow_module_level=True)
pytest.importorskip("ml_dtypes", reason="ml_dtypes (the numpy reference's e4m3 cast) is not installed")

import numpy as np  # noqa: E402

from block_fp8_reference import np_quantize  # noqa: E402
from transformer_engine_comm.torch import fp8  # noqa: E402
from transformer_engine_comm.torch import modules as tm  # noqa: E402


def data(seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("rows, cols, dim, col, want", [
    (256, 512, 1, False, (4, 256)), (200, 300, 1, False, (3, 200)), (5, 300, 1, False, (3, 8)),
    (256, 512, 1, True, (2, 512)), (200, 300, 1, True, (2, 300)),
    (256, 512, 2, False, (2, 4)), (200, 300, 2, False, (2, 4)), (1000, 130, 2, False, (8, 4)),
    (256, 512, 2, True, (4, 4)), (130, 1000, 2, True, (8, 4)),
])
def test_scale_shapes_are_tes(rows, cols, dim, col, want):
    assert fp8.block_scale_shape(rows, cols, dim, columnwise=col) == want


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 128), (130, 129)])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps, pow2", [(0.0, True), (0.0, False), (0.5, True)])
def test_emulation_matches_numpy_reference(shape, dim, dtype, eps, pow2):
    x = (data(1, *shape) * torch.logspace(-2, 2, shape[1])).to(dtype)
    x[0, :5] = 0.0
    vinf = float(torch.finfo(dtype).max)
    t = fp8.quantize_block(x, dim, rowwise=True, columnwise=True, power_2_scale=pow2, amax_epsilon=eps)
    assert t.data.dtype == torch.float8_e4m3fn and t.block_dim == dim
    xf = x.float().numpy()
    for form, ref_in in (("rowwise", xf), ("columnwise", xf.T)):
        op = getattr(t, form)()
        if dim == 2 and form == "columnwise":
            q, s = np_quantize(xf, 2, eps, pow2, vinf)
            q, s = q.T, s.T  # a tile of the transpose is the tile transposed
        else:
            q, s = np_quantize(ref_in, dim, eps, pow2, vinf)
        np.testing.assert_array_equal(op.data.float().numpy(), q)
        r, c = op.data.shape
        assert tuple(op.scale_inv.shape) == fp8.block_scale_shape(r, c, dim)
        np.testing.assert_array_equal(fp8._block_scale_grid(op).numpy(), s)


def test_block_gemm_emulation_is_the_dequantized_product():
    a = fp8.quantize_block(data(2, 256, 512), 1).rowwise()
    b = fp8.quantize_block(data(3, 384, 512, scale=0.02), 2).rowwise()
    y = fp8.block_gemm(a, b, torch.float32)
    ref = fp8.dequantize_block(a).double() @ fp8.dequantize_block(b).double().t()
    assert y.shape == (256, 384)
    assert ((y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()).item()
    with pytest.raises(ValueError, match="2D by 2D"):
        fp8.block_gemm(fp8.quantize_block(data(2, 256, 512), 2).rowwise(), b)
    with pytest.raises(ValueError, match="disagree on K"):
        fp8.block_gemm(a, fp8.quantize_block(data(3, 384, 256), 1).rowwise())


def _mlp(recipe, fp8_on=True):
    return tm.LayerNormMLP(256, 512, comm_overlap=False, fp8=fp8_on, fp8_recipe=recipe, params_dtype=torch.float32,
                           device="cpu", seed=3)


def _run(m, x, g, **kw):
    x = x.detach().clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    y = m(x, **kw)
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def test_modules_forward_backward_under_block_scaling():
    x, g = data(4, 256, 256), data(5, 256, 256, scale=0.1)
    ref = _run(_mlp(None, False), x, g)
    m = _mlp(fp8.Float8BlockScaling())
    got = _run(m, x, g, is_first_microbatch=True)
    assert m.fc1.fp8_meta == {} and m.fc2.fp8_meta == {}  # block scaling keeps no scaling state
    for i, (a, b) in enumerate(zip(got, ref)):
        if b.abs().max() > 0:
            e = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert e < (0.08 if i == 0 else 0.15), (i, e)
    cached = m.fc1._f8.cached_weight
    assert cached.block_dim == 2 and cached.data_t is not None
    again = _run(m, x, g, is_first_microbatch=False)
    assert m.fc1._f8.cached_weight is cached
    for a, b in zip(got, again):
        assert torch.equal(a, b)


def test_modules_take_only_the_recipe_family():
    with pytest.raises(TypeError, match="Float8BlockScaling"):
        tm.ColumnParallelLinear(64, 64, comm_overlap=False, fp8=True, fp8_recipe=object(), device="cpu")
