"""Shape rules of the torch ops without a GPU: the registered ops' fake (meta)
implementations under every layout (transa / transb), even and uneven shares, and the
argument errors, on meta tensors over torch's "fake" process group (any world size and
rank, no communication). Runs on CPU with torch installed (skipped without torch, and
under torchrun, whose process group the GPU tests own)."""

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch, "library"):  # without torch, "torch" is this folder (a namespace package)
    pytest.skip("torch is not installed", allow_module_level=True)
if "MASTER_ADDR" in os.environ:
    pytest.skip("under torchrun: the GPU tests own the process group", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

try:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
except Exception:  # pragma: no cover - torch without the fake backend
    FakeStore = None

import transformer_engine_comm.torch as te  # noqa: E402
from transformer_engine_comm.torch import ops as te_ops  # noqa: E402

BF = torch.bfloat16
E4M3 = torch.float8_e4m3fn
TP, RANK = 4, 3  # the last rank: the one uneven shares shorten


@pytest.fixture(scope="module")
def group():
    if FakeStore is None or not dist.is_available():
        pytest.skip("torch has no fake process group backend")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=TP)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def meta(*shape, dtype=BF):
    return torch.empty(shape, dtype=dtype, device="meta")


def share(g, r=RANK):
    return te.numroc(g, TP, r)


LAYOUTS = [(True, False), (False, False), (False, True)]  # TN, NN, NT
IDS = ["TN", "NN", "NT"]


def x_of(n, k, transb):
    return meta(k, n) if transb else meta(n, k)


def w_of(m, k, transa):
    return meta(m, k) if transa else meta(k, m)


@pytest.mark.parametrize("transa,transb", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("m,n,k", [(256, 128, 64), (250, 126, 64), (64, 3, 48)])
def test_all_gather_shapes(group, transa, transb, m, n, k):
    ml, nl = share(m), share(n)
    x, w = x_of(nl, k, transb), w_of(ml, k, transa)
    b = meta(ml)
    out = te.all_gather_gemm(x, w, b, group=group, n_global=n, m_global=m, transa=transa, transb=transb)
    assert out.device.type == "meta" and tuple(out.shape) == (n, ml) and out.dtype == BF
    y, pre = te.all_gather_gemm(x, w, b, group=group, n_global=n, m_global=m, transa=transa, transb=transb,
                                gelu=True) if ml % 8 == 0 else (out, out)
    assert tuple(y.shape) == tuple(pre.shape) == (n, ml)
    # The registered op itself (what torch.compile traces), argument for argument.
    o, p = torch.ops.te_comm.all_gather_gemm(x, w, None, None, None, group.group_name, n, m, None, False, 0, 0, "pg", "",
                                             transa, transb)
    assert tuple(o.shape) == (n, ml) and tuple(p.shape) == (0,)


@pytest.mark.parametrize("transa,transb", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("m,n,k", [(64, 128, 256), (64, 126, 250), (64, 250, 251)])
@pytest.mark.parametrize("op", ["rs", "ar"])
def test_k_split_shapes(group, op, transa, transb, m, n, k):
    kl = share(k)
    x, w = x_of(n, kl, transb), w_of(m, kl, transa)
    fn = te.gemm_reduce_scatter if op == "rs" else te.gemm_all_reduce
    out = fn(x, w, meta(m, dtype=torch.float32), group=group, k_global=k, transa=transa, transb=transb,
             out_dtype=torch.float32)
    rows = share(n) if op == "rs" else n
    assert tuple(out.shape) == (rows, m) and out.dtype == torch.float32
    y, pre = fn(x, w, group=group, k_global=k, transa=transa, transb=transb, gelu=True)
    assert tuple(y.shape) == tuple(pre.shape) == (rows, m)


def test_fake_tensor_mode(group):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake CUDA tensors (no GPU needed): the dispatcher, the fake kernel
        x = torch.empty(32, 64, dtype=BF, device="cuda")
        w = torch.empty(64, 48, dtype=BF, device="cuda")  # NN: weight [k, m]
        out = te.all_gather_gemm(x, w, group=group, transa=False)
        dy = torch.empty(64, 32, dtype=BF, device="cuda")  # NT at tp 4: dY^T @ X, x [k_local, n]
        dw = te.gemm_reduce_scatter(dy, torch.empty(64, 16, dtype=BF, device="cuda"), group=group, transa=False,
                                    transb=True)
    assert tuple(out.shape) == (32 * TP, 48) and out.device.type == "cuda"
    assert tuple(dw.shape) == (share(32), 16)
    assert not te_ops._fast, "fake tensors must not reach the direct path's cache"


def test_fp8_shapes_and_tn_only(group):
    x, w = meta(64, 128, dtype=E4M3), meta(32, 128, dtype=E4M3)
    s = torch.empty(1, device="meta")
    out = te.all_gather_gemm(x, w, group=group, x_scale_inv=s, w_scale_inv=s)
    assert tuple(out.shape) == (64 * TP, 32) and out.dtype == BF
    for transa, transb in [(False, False), (False, True)]:
        with pytest.raises(ValueError, match=r"FP8 inputs need the TN layout.*transa=False"):
            te.all_gather_gemm(meta(64, 128, dtype=E4M3), meta(128, 32, dtype=E4M3), group=group, x_scale_inv=s,
                               w_scale_inv=s, transa=transa, transb=transb)
        with pytest.raises(ValueError, match="FP8 inputs need the TN layout"):
            te.gemm_reduce_scatter(x, w, group=group, x_scale_inv=s, w_scale_inv=s, transa=transa, transb=transb)


@pytest.mark.parametrize("fn", [te.all_gather_gemm, te.gemm_reduce_scatter, te.gemm_all_reduce])
def test_layout_errors(group, fn):
    x, w = meta(64, 32), meta(48, 32)
    with pytest.raises(ValueError, match=r"transa=True with transb=True \(the TT layout\)"):
        fn(meta(32, 64), w, group=group, transa=True, transb=True)
    # k disagrees once a flag is flipped: the message names both flags and readings
    with pytest.raises(ValueError, match=r"read as \[k, m\], transa=False\) must agree on the \(local\) k"):
        fn(x, w, group=group, transa=False)
    with pytest.raises(ValueError, match=r"read as \[k, n\], transb=True"):
        fn(x, meta(32, 48), group=group, transa=False, transb=True)
    # a transposed view: the error suggests the flag
    with pytest.raises(ValueError, match="flip transa"):
        fn(x, meta(32, 48).t(), group=group)
    with pytest.raises(ValueError, match="flip transb"):
        fn(meta(32, 64).t(), w, group=group)
    with pytest.raises(TypeError, match="transa must be a bool"):
        fn(x, w, group=group, transa="yes")


def test_bias_follows_the_m_dimension(group):
    # NN: weight [k, m_local]; the bias has m_local elements, not weight.shape[0]
    x, w = meta(16, 32), meta(32, 48)
    out = te.all_gather_gemm(x, w, meta(48), group=group, transa=False)
    assert tuple(out.shape) == (16 * TP, 48)
    with pytest.raises(ValueError, match="bias must have 48 elements"):
        te.all_gather_gemm(x, w, meta(32), group=group, transa=False)
    with pytest.raises(ValueError, match="bias must have m = 48 elements"):
        te.gemm_all_reduce(x, w, meta(32), group=group, transa=False)


def test_uneven_share_errors(group):
    # n_global whose share on this rank differs from x's rows
    with pytest.raises(ValueError, match="n_global"):
        te.all_gather_gemm(meta(32, 16), meta(16, 16), group=group, n_global=32 * TP + TP)
    # NT: the k share lives in x's rows
    with pytest.raises(ValueError, match="k_global"):
        te.gemm_reduce_scatter(meta(16, 64), meta(16, 8), group=group, k_global=16 * TP + 3 * TP, transa=False,
                               transb=True)


def test_routing_of_meta_tensors(group):
    """Meta tensors never take the direct path (nor its prepared-call cache)."""
    before = dict(te_ops._fast)
    te.gemm_all_reduce(meta(16, 32), meta(48, 32), group=group)
    assert te_ops._fast == before
    assert not te_ops._direct(meta(2, 2))
