"""Block-scaled FP8 (Float8BlockScaling) in transformer_engine_comm.torch on ONE GPU: the
library's block casts (nvte_quantize_v2 into NVTE_BLOCK_SCALING_1D/2D tensors) bit for bit
against the torch emulation, its block-scaled GEMMs (nvte_cublas_gemm, TN) against the fp32
matmul of the dequantized operands, the modules (ColumnParallelLinear, RowParallelLinear,
LayerNormMLP) forward + backward against the same modules on the emulation, and CUDA graph
capture / replay. No process group is needed (tp 1). Skipped without a GPU."""
import gc

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch, "cuda") or not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from transformer_engine_comm.torch import fp8  # noqa: E402
from transformer_engine_comm.torch import modules as tm  # noqa: E402

BF16 = torch.bfloat16
S, B, H, FFN = 128, 2, 256, 1024
EMU_TOL = 2e-2  # library vs emulation (same quantized operands; accumulation order, bf16 outputs)
FP8_OUT_TOL, FP8_GRAD_TOL = 0.08, 0.15  # block FP8 vs bf16


def dev():
    return torch.device("cuda", torch.cuda.current_device())


def data(seed, *shape, scale=1.0):
    g = torch.Generator(device=dev()).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev()) * scale


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def library():
    lib = fp8._library()
    if lib is None or not lib.has_block:
        pytest.skip("the loaded library creates no NVTE_BLOCK_SCALING tensors (block quantization not built in)")
    return lib


@pytest.fixture
def emulation(monkeypatch):
    """Every FP8 primitive on torch's arithmetic (the library backend switched off)."""
    def use():
        monkeypatch.setattr(fp8, "_library", lambda: None)
    return use


# ------------------------------------------------------------------- casts


@pytest.mark.parametrize("shape", [(256, 512), (128, 1024), (384, 256), (1024, 4096)])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("pow2, eps", [(True, 0.0), (False, 0.0), (True, 1e-3)])
def test_quantize_block_bit_exact(shape, block_dim, dtype, pow2, eps):
    lib = library()
    x = (data(1, *shape) * torch.logspace(-3, 2, shape[1], device=dev())).to(dtype)
    x[0, :7] = 0.0  # a partly-zero block
    kw = dict(rowwise=True, columnwise=True, power_2_scale=pow2, amax_epsilon=eps)
    got = fp8.quantize_block(x, block_dim, **kw)
    if lib.block_quantize is False:
        pytest.skip("the loaded library has block tensors but no block-scaled cast (nvte_quantize)")
    ref = fp8.quantize_block(x, block_dim, reference=True, **kw)
    torch.cuda.synchronize()
    r, c = shape
    for form in ("rowwise", "columnwise"):
        g, e = getattr(got, form)(), getattr(ref, form)()
        assert g.data.shape == e.data.shape and g.scale_inv.shape == e.scale_inv.shape
        assert torch.equal(g.data.view(torch.uint8), e.data.view(torch.uint8)), f"{form} data differs"
        rr, cc = g.data.shape
        nb = -(-cc // fp8.BLOCK_LEN)
        valid = (slice(0, nb), slice(0, rr)) if block_dim == 1 else (slice(None), slice(0, nb))
        assert torch.equal(g.scale_inv[valid], e.scale_inv[valid]), f"{form} scale_inv differs"
    # The emulation's dequantized values are x within e4m3's rounding.
    assert rel(fp8.dequantize_block(ref.rowwise()), x.float()) < 0.05


@pytest.mark.parametrize("shape", [(200, 300), (1, 128), (256, 130)])
@pytest.mark.parametrize("block_dim", [1, 2])
def test_quantize_block_other_shapes(shape, block_dim):
    """Shapes the library's cast does not take (rows or columns not multiples of 128, as
    TE's is_quantizable) are cast by the torch arithmetic on the GPU: the reference's bytes."""
    x = data(3, *shape).to(BF16)
    got = fp8.quantize_block(x, block_dim, rowwise=True, columnwise=True)
    ref = fp8.quantize_block(x.cpu(), block_dim, rowwise=True, columnwise=True)
    for form in ("rowwise", "columnwise"):
        g, e = getattr(got, form)(), getattr(ref, form)()
        assert g.data.is_cuda and torch.equal(g.data.cpu().view(torch.uint8), e.data.view(torch.uint8))


# ------------------------------------------------------------------- GEMMs


@pytest.mark.parametrize("m, k, n", [(256, 512, 384), (512, 1024, 256), (128, 128, 128)])
@pytest.mark.parametrize("b_dim", [1, 2], ids=["1Dx1D", "1Dx2D"])
def test_block_gemm_vs_emulation(m, k, n, b_dim):
    library()
    a = fp8.quantize_block(data(2, m, k).to(BF16), 1).rowwise()
    b = fp8.quantize_block(data(3, n, k, scale=0.02).to(BF16), b_dim).rowwise()
    got = fp8.block_gemm(a, b, BF16)
    ref = fp8.block_gemm(a, b, torch.float32, reference=True)
    bias = data(5, n).to(BF16)
    got_b = fp8.block_gemm(a, b, BF16, bias=bias)  # the bias in the GEMM's epilogue
    pre = data(6, m, n).to(BF16)
    got_g = fp8.block_gemm(a, b, BF16, dgelu_pre=pre)  # GELU's backward after the GEMM
    got_gf = fp8.block_gemm(a, b, BF16, dgelu_pre=pre, fuse_dgelu=True)  # in the epilogue
    ref_g = torch.ops.aten.gelu_backward(ref, pre.float(), approximate="tanh")
    torch.cuda.synchronize()
    assert got.shape == (m, n) and got.dtype == BF16
    assert rel(got.float(), ref) < 1e-2
    assert rel(got_b.float(), ref + bias.float()) < 1e-2
    assert rel(got_g.float(), ref_g) < 1e-2
    assert rel(got_gf.float(), ref_g) < 1e-2


# ------------------------------------------------------------------- modules


def mlp(recipe, fp8_on=True, seed=3):
    return tm.LayerNormMLP(H, FFN, comm_overlap=False, fp8=fp8_on, fp8_recipe=recipe, params_dtype=BF16,
                           device=dev(), seed=seed)


def run(m, x, g, **kw):
    x = x.detach().clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    y = m(x, **kw)
    y.backward(g.to(y.dtype))
    torch.cuda.synchronize()
    return [y.detach().float(), x.grad.float()] + [p.grad.float() for p in m.parameters()]


def check(what, m, got, ref, tol):
    names = ["out", "dx"] + ["d" + n for n, _ in m.named_parameters()]
    errs = {n: rel(a, b) for n, a, b in zip(names, got, ref) if b.abs().max() > 0}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"{what}: {bad} (tol {tol}; all {errs})"


def inputs(seed=0):
    return data(100 + seed, S, B, H).to(BF16), data(200 + seed, S, B, H, scale=0.1).to(BF16)


@pytest.mark.parametrize("dims", [(1, 2, 1), (1, 1, 1), (2, 1, 1)], ids=["te_default", "all_1d", "x_2d"])
def test_mlp_block_fp8_vs_emulation(emulation, dims):
    library()
    r = fp8.Float8BlockScaling(x_block_scaling_dim=dims[0], w_block_scaling_dim=dims[1],
                               grad_block_scaling_dim=dims[2])
    m = mlp(r)
    x, g = inputs(1)
    got = run(m, x, g)
    emulation()
    ref = run(mlp(r), x, g)
    check(f"block {dims} vs emulation", m, got, ref, EMU_TOL)


def test_mlp_block_fp8_vs_bf16():
    library()
    x, g = inputs(2)
    ref = run(mlp(None, fp8_on=False), x, g)
    m = mlp(fp8.Float8BlockScaling())
    got = run(m, x, g)
    check("block out", m, got[:1], ref[:1], FP8_OUT_TOL)
    check("block grads", m, got[1:], ref[1:], FP8_GRAD_TOL)


@pytest.mark.parametrize("cls", ["column", "row"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_block_fp8_vs_emulation(emulation, cls, bias):
    library()
    r = fp8.Float8BlockScaling()
    k, n = (H, FFN) if cls == "column" else (FFN, H)
    make = tm.ColumnParallelLinear if cls == "column" else tm.RowParallelLinear

    def build():
        return make(k, n, bias=bias, comm_overlap=False, fp8=True, fp8_recipe=r, params_dtype=BF16,
                    device=dev(), seed=5)

    m = build()
    x, g = data(7, S * B, k).to(BF16), data(8, S * B, n, scale=0.1).to(BF16)
    got = run(m, x, g)
    emulation()
    ref = run(build(), x, g)
    check(f"{cls} bias={bias}", m, got, ref, EMU_TOL)


def test_block_weight_cast_cached_per_step():
    library()
    m = mlp(fp8.Float8BlockScaling())
    x, g = inputs(3)
    a = run(m, x, g, is_first_microbatch=True)
    cached = m.fc1._f8.cached_weight
    assert cached is not None and cached.data_t is not None and cached.block_dim == 2
    b = run(m, x, g, is_first_microbatch=False)
    assert m.fc1._f8.cached_weight is cached  # reused, not recast
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    with torch.no_grad():
        m.fc1.weight.mul_(2.0)  # changed in place: recast
    run(m, x, g, is_first_microbatch=False)
    assert m.fc1._f8.cached_weight is not cached


def test_block_fp8_cuda_graph_matches_eager():
    library()
    r = fp8.Float8BlockScaling()
    eager, graphed_mod = mlp(r), mlp(r)
    x0, g0 = inputs(9)
    run(eager, x0, g0)
    sample = x0.detach().clone().requires_grad_(True)
    gc.collect()
    graphed = torch.cuda.make_graphed_callables(graphed_mod, (sample,))
    torch.cuda.synchronize()
    for it in range(3):
        x, g = inputs(10 + it)
        e = run(eager, x, g)
        xs = x.detach().clone().requires_grad_(True)
        for p in graphed_mod.parameters():
            p.grad = None
        y = graphed(xs)
        y.backward(g)
        torch.cuda.synchronize()
        gr = [y.detach().float(), xs.grad.float()] + [p.grad.float() for p in graphed_mod.parameters()]
        check(f"graph step {it}", eager, gr, e, 1e-3)
