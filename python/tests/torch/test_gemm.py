"""transformer_engine_comm.torch.gemm (TE's nvte_cublas_gemm on torch tensors) on one GPU:
every layout and epilogue against an fp32 torch reference of the same inputs, FP8 TN, the
signature cache (a second call with the same shapes but other tensors, other pointers,
poisoned outputs), and the argument errors. Runs standalone (no process group needed)."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch, "cuda"):
    pytest.skip("torch is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from _gpu import gelu_tanh_grad  # noqa: E402
from transformer_engine_comm.torch import gemm as G  # noqa: E402

gemm = G.gemm
DEV = "cuda"
BF16, F16 = torch.bfloat16, torch.float16
TOL = {BF16: 2e-2, F16: 4e-3}


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def op(t, trans):
    return t.t() if trans else t


def ref(A, B, transa, transb):
    """D [n, m] = op(B) . op(A) in fp32, op(A) [k, m] (A^T with transa), op(B) [n, k] (B^T
    with transb): TE's "TN" is D = B . A^T."""
    return op(B.float(), transb) @ op(A.float(), transa)


def make(shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEV, dtype)


M, N, K = 192, 256, 128
LAYOUTS = {  # (transa, transb) -> (A shape, B shape)
    "TN": ((True, False), (M, K), (N, K)),
    "NN": ((False, False), (K, M), (N, K)),
    "NT": ((False, True), (K, M), (K, N)),
}


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_and_cache(layout, dtype):
    (ta, tb), sa, sb = LAYOUTS[layout]
    for seed in (1, 2):  # the second call reuses the first's validated signature
        A, B = make(sa, dtype, seed), make(sb, dtype, seed + 10)
        D = gemm(A, B, transa=ta, transb=tb)
        assert D.shape == (N, M) and D.dtype == dtype
        assert rel(D, ref(A, B, ta, tb)) < TOL[dtype]


@pytest.mark.parametrize("dtype,out_dtype", [(BF16, BF16), (BF16, torch.float32), (F16, F16), (F16, torch.float32)])
def test_out_dtype_and_given_out(dtype, out_dtype):
    A, B = make((M, K), dtype, 3), make((N, K), dtype, 4)
    D = gemm(A, B, transa=True, transb=False, out_dtype=out_dtype)
    assert D.dtype == out_dtype and rel(D, ref(A, B, True, False)) < 2e-2
    out = torch.full((N, M), float("nan"), dtype=out_dtype, device=DEV)
    assert gemm(A, B, transa=True, transb=False, out=out) is out
    assert rel(out, ref(A, B, True, False)) < 2e-2
    with pytest.raises(Exception, match="not supported"):  # the library's rule: 16-bit in, same 16-bit or fp32 out
        gemm(A, B, transa=True, transb=False, out_dtype=F16 if dtype == BF16 else BF16)


def test_bias_gelu_and_accumulate():
    A, B = make((M, K), BF16, 5), make((N, K), BF16, 6)
    bias = make((M,), BF16, 7)
    r = ref(A, B, True, False) + bias.float()
    assert rel(gemm(A, B, transa=True, transb=False, bias=bias), r) < 2e-2
    for _ in range(2):
        D, pre = gemm(A, B, transa=True, transb=False, bias=bias, gelu=True)
        assert rel(pre, r) < 2e-2
        assert rel(D, torch.nn.functional.gelu(r, approximate="tanh")) < 2e-2
    out = make((N, M), BF16, 8)
    want = out.float() + ref(A, B, True, False)
    gemm(A, B, transa=True, transb=False, out=out, accumulate=True)
    assert rel(out, want) < 2e-2


def test_dgelu_and_bias_grads():
    # dgrad with the GELU backward: D = (dY . W) * gelu'(pre), bias_grad = D.sum(0) [m].
    dY, W = make((N, K), BF16, 9), make((K, M), BF16, 10)
    pre = make((N, M), BF16, 11)
    want = ref(W, dY, False, False) * gelu_tanh_grad(pre)
    for _ in range(2):
        D = gemm(W, dY, transa=False, transb=False, dgelu_pre=pre)
        assert rel(D, want) < 2e-2
    db = torch.full((M,), float("nan"), dtype=BF16, device=DEV)
    D = gemm(W, dY, transa=False, transb=False, dgelu_pre=pre, bias_grad=db)
    assert rel(D, want) < 2e-2 and rel(db, want.sum(0)) < 3e-2
    # wgrad with the bias gradient (BGRADB): dW [n, m] = dY^T . X, db = dY.sum(0) [n].
    X, dY2 = make((K, M), BF16, 12), make((K, N), BF16, 13)
    db = torch.full((N,), float("nan"), dtype=BF16, device=DEV)
    dW = gemm(X, dY2, transa=False, transb=True, bias_grad=db)
    assert rel(dW, dY2.float().t() @ X.float()) < 2e-2
    assert rel(db, dY2.float().sum(0)) < 2e-2


def _graph_cases():
    """(name, shapes, call(t) -> outputs, want(t, acc_before) -> fp32 references) for the
    graph-replay test: each kind of cuBLASLt call a plan may replay (acc_before: the
    accumulating case's output before the call, else None)."""
    def tn_bias_gelu(t):
        return gemm(t["A"], t["B"], transa=True, transb=False, bias=t["bias"], gelu=True)

    def tn_bias_gelu_want(t, _):
        r = ref(t["A"], t["B"], True, False) + t["bias"].float()
        return torch.nn.functional.gelu(r, approximate="tanh"), r

    def nn_dgelu_bgrad(t):
        return gemm(t["W"], t["dY"], transa=False, transb=False, dgelu_pre=t["pre"], bias_grad=t["db"]), t["db"]

    def nn_dgelu_bgrad_want(t, _):
        d = ref(t["W"], t["dY"], False, False) * gelu_tanh_grad(t["pre"])
        return d, d.sum(0)

    def nt_bgrad(t):
        return gemm(t["X"], t["dY2"], transa=False, transb=True, bias_grad=t["db2"]), t["db2"]

    def nt_bgrad_want(t, _):
        return t["dY2"].float().t() @ t["X"].float(), t["dY2"].float().sum(0)

    def tn_accumulate(t):
        gemm(t["A"], t["B"], transa=True, transb=False, out=t["acc"], accumulate=True)
        return (t["acc"],)

    def tn_accumulate_want(t, acc_before):
        return (acc_before + ref(t["A"], t["B"], True, False),)

    big = (512, 1024, 2048)  # above the own kernel's size: cuBLASLt, tuned on first use
    return [
        ("tn_bias_gelu", {"A": (M, K), "B": (N, K), "bias": (M,)}, tn_bias_gelu, tn_bias_gelu_want),
        ("tn_big", {"A": (big[0], big[2]), "B": (big[1], big[2])},
         lambda t: (gemm(t["A"], t["B"], transa=True, transb=False),),
         lambda t, _: (ref(t["A"], t["B"], True, False),)),
        ("nn_dgelu_bgrad", {"W": (K, M), "dY": (N, K), "pre": (N, M), "db": (M,)}, nn_dgelu_bgrad,
         nn_dgelu_bgrad_want),
        ("nt_bgrad", {"X": (K, M), "dY2": (K, N), "db2": (N,)}, nt_bgrad, nt_bgrad_want),
        ("tn_accumulate", {"A": (M, K), "B": (N, K), "acc": (N, M)}, tn_accumulate, tn_accumulate_want),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _graph_cases()])
def test_repeated_calls_follow_data_and_pointers(case):
    """A plan's repeated calls replay a CUDA graph of their matmul (NVTE_COMM_GEMM_GRAPHS):
    the same tensors refilled in place before every call (direct, captured, then replayed
    calls; the bias gradients poisoned with NaN), each result against fp32; then new
    tensors (new pointers); then the calls inside the user's own torch CUDA graph,
    replayed with new data."""
    _, shapes, call, want = next(c for c in _graph_cases() if c[0] == case)
    seed = [100]

    def fill(t):
        """New data in every tensor (NaN in the bias gradients); returns the accumulating
        case's output before the call (fp32), else None."""
        for name, x in t.items():
            seed[0] += 1
            x.copy_(make(shapes[name], BF16, seed[0]))
            if name in ("db", "db2"):
                x.fill_(float("nan"))
        return t["acc"].float().clone() if "acc" in t else None

    def check(got, t, acc_before, what):
        torch.cuda.synchronize()
        for g, r in zip(got, want(t, acc_before)):
            assert rel(g, r) < 3e-2, (case, what, rel(g, r))

    for tensors_round in range(2):  # the second round: new tensors, new pointers
        t = {name: torch.empty(shape, dtype=BF16, device=DEV) for name, shape in shapes.items()}
        for _ in range(4):
            acc_before = fill(t)
            check(call(t), t, acc_before, "eager")
    # Inside the user's capture the library calls cuBLASLt directly; the replay follows the data.
    fill(t)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        call(t)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            outs = call(t)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        acc_before = fill(t)
        g.replay()
        check(outs, t, acc_before, "user graph")


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_tn(fmt):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 GEMMs need Hopper")
    A32, B32 = make((M, K), torch.float32, 14), make((N, K), torch.float32, 15)
    sa = torch.tensor([0.5], device=DEV)
    sb = torch.tensor([2.0], device=DEV)
    A = (A32 / sa).to(torch.float8_e4m3fn)
    B = (B32 / sb).to(fmt)
    want = (B.float() * sb) @ (A.float() * sa).t()
    for acc in (False, True):
        D = gemm(A, B, transa=True, transb=False, a_scale_inv=sa, b_scale_inv=sb, use_split_accumulator=acc)
        assert D.dtype == BF16 and rel(D, want) < 1e-2


def test_signature_cache(monkeypatch):
    """A call whose signature was validated before is not validated again; any change of
    signature (output dtype, an epilogue operand, a shape) is."""
    seen = []
    orig = G._check
    monkeypatch.setattr(G, "_check", lambda *a: seen.append(a) or orig(*a))
    G._plans.clear()
    A, B = make((M, K), BF16, 20), make((N, K), BF16, 21)
    r1 = gemm(A, B, transa=True, transb=False)
    A2, B2 = make((M, K), BF16, 22), make((N, K), BF16, 23)
    r2 = gemm(A2, B2, transa=True, transb=False)  # same signature, other tensors
    assert len(seen) == 1
    assert rel(r1, ref(A, B, True, False)) < 2e-2 and rel(r2, ref(A2, B2, True, False)) < 2e-2
    gemm(A, B, transa=True, transb=False, out_dtype=torch.float32)
    gemm(A, B, transa=True, transb=False, bias=make((M,), BF16, 24))
    assert len(seen) == 3
    with pytest.raises(ValueError, match="elements"):  # a new signature is validated
        gemm(A, B, transa=True, transb=False, bias=make((M + 8,), BF16, 25))
    assert len(seen) == 4


def test_errors():
    A, B = make((M, K), BF16, 16), make((N, K), BF16, 17)
    with pytest.raises(ValueError, match="contiguous"):
        gemm(A.t().contiguous().t(), B, transa=True, transb=False)
    gemm(A, B, transa=True, transb=False)  # cached signature: contiguity is still checked
    with pytest.raises(ValueError, match="contiguous"):
        gemm(A, B.t().contiguous().t(), transa=True, transb=False)
    with pytest.raises(ValueError, match="disagree on k"):
        gemm(A, make((N, K + 8), BF16, 18), transa=True, transb=False)
    with pytest.raises(ValueError, match="2-D CUDA"):
        gemm(A.cpu(), B, transa=True, transb=False)
    with pytest.raises(ValueError, match="2-D CUDA"):
        gemm("A", B, transa=True, transb=False)
    with pytest.raises(ValueError, match="out must be"):
        gemm(A, B, transa=True, transb=False, out=torch.empty((M, N), dtype=BF16, device=DEV))
    with pytest.raises(ValueError, match="accumulate"):
        gemm(A, B, transa=True, transb=False, accumulate=True)
    with pytest.raises(ValueError, match="exclude"):
        gemm(A, B, transa=True, transb=False, gelu=True, dgelu_pre=torch.empty((N, M), dtype=BF16, device=DEV))
    with pytest.raises(ValueError, match="elements"):
        gemm(A, B, transa=True, transb=False, bias=torch.empty((M + 1,), dtype=BF16, device=DEV))
    with pytest.raises(ValueError, match="gelu .* bias_grad"):
        gemm(A, B, transa=True, transb=False, gelu=True, bias_grad=torch.empty((M,), dtype=BF16, device=DEV))
    # A bias of any dimensions with m elements is taken as a vector (TE's tensors).
    b3 = make((M,), BF16, 19)
    D = gemm(A, B, transa=True, transb=False, bias=b3.reshape(1, M, 1))
    assert rel(D, ref(A, B, True, False) + b3.float()) < 2e-2
    f8 = A.to(torch.float8_e4m3fn)
    s = torch.ones(1, device=DEV)
    with pytest.raises(ValueError, match="TN"):
        gemm(f8, B.to(torch.float8_e4m3fn), transa=False, transb=False, a_scale_inv=s, b_scale_inv=s)
    with pytest.raises(ValueError, match="scale_inv"):
        gemm(f8, B.to(torch.float8_e4m3fn), transa=True, transb=False)
    with pytest.raises(ValueError, match="one element"):
        gemm(f8, B.to(torch.float8_e4m3fn), transa=True, transb=False, a_scale_inv=torch.ones(2, device=DEV),
             b_scale_inv=s)
