"""GPU checks of the library's quantization kernels against the torch reference of
transformer_engine_comm.torch.fp8 (``reference=True``), bit for bit: every input dtype
(float32 / bfloat16 / float16) and FP8 output (e4m3 / e5m2), rowwise, columnwise
(transposed) and both from one kernel, shapes with tails, one row, odd sizes, N-D and
unaligned pointers, inputs with special values (+-0, subnormals, ties, values past the FP8
range, +-inf, NaN); amax exact; TE's scale-from-amax and delayed-scaling update against a
numpy transcription of TE's kernels; transpose, dequantize, the noop flag, and current
scaling end to end. One GPU, one process: ``python3 -m pytest python/tests/test_quantize.py``.
Skipped without torch or a GPU."""
import math
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from transformer_engine_comm import _capi  # noqa: E402
from transformer_engine_comm.torch import fp8  # noqa: E402

DEV = torch.device("cuda", 0)
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(1, 1), (1, 7), (3, 5), (64, 64), (128, 256), (129, 72), (4096, 8), (16, 4104),
          (200, 1000), (17, 33, 40), (2, 64, 192), (1000,), (0, 16)]
FLOAT_MAX = float(np.finfo(np.float32).max)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    assert fp8._library() is not None, "the library backend must be active on CUDA"


def special_input(shape, dtype, scale):
    """Random data of mixed magnitudes with special values sprinkled in."""
    n = math.prod(shape)
    x = torch.randn(n, device=DEV, dtype=torch.float32)
    x *= torch.exp2(torch.randint(-20, 12, (n,), device=DEV).float())
    fmax = 57344.0
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -3e-8,
                             448.0 / scale, 464.0 / scale, 480.0 / scale, fmax / scale, 1e30,
                             0.5 / scale, 0.5625 / scale, 2 ** -9 / scale, 3 * 2 ** -10 / scale],
                            device=DEV)
    if n:
        idx = torch.randint(0, n, (min(n, 64),), device=DEV)
        x[idx] = specials[torch.randint(0, len(specials), (len(idx),), device=DEV)]
    return x.to(dtype).reshape(shape)


def same_bits(a, b, what):
    """Equal FP8 bytes, NaN compared as NaN (the sign of a NaN is not specified)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(na, nb), f"{what}: NaN positions differ"
    ua, ub = a.view(torch.uint8)[~na], b.view(torch.uint8)[~nb]
    bad = (ua != ub).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {ua.numel()} bytes differ, first at {bad[0].item()}: " \
                             f"{ua[bad[0]].item():#x} vs {ub[bad[0]].item():#x}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", FP8, ids=str)
def test_quantize_bit_exact(shape, in_dtype, out_dtype):
    scale_v = float(torch.empty(()).uniform_(0.3, 40.0))
    x = special_input(shape, in_dtype, scale_v)
    scale = torch.tensor([scale_v], device=DEV)
    for rowwise, columnwise in ((True, False), (False, True), (True, True)):
        amax, amax_ref = torch.full((1,), 0.125, device=DEV), torch.full((1,), 0.125, device=DEV)
        sinv, sinv_ref = torch.full((1,), -1.0, device=DEV), torch.full((1,), -1.0, device=DEV)
        q, q_t = fp8.quantize(x, out_dtype, scale, amax=amax, scale_inv=sinv, rowwise=rowwise, columnwise=columnwise)
        r, r_t = fp8.quantize(x, out_dtype, scale, amax=amax_ref, scale_inv=sinv_ref, rowwise=rowwise,
                              columnwise=columnwise, reference=True)
        torch.cuda.synchronize()
        what = f"{shape} {in_dtype}->{out_dtype} row={rowwise} col={columnwise}"
        if rowwise:
            same_bits(q, r, what + " rowwise")
        else:
            assert q is None
        if columnwise:
            same_bits(q_t, r_t, what + " columnwise")
        else:
            assert q_t is None
        assert torch.equal(amax, amax_ref), (what, amax.item(), amax_ref.item())  # running max, exact
        assert torch.equal(sinv, sinv_ref), (what, sinv.item(), sinv_ref.item())  # empty inputs too


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
def test_quantize_unaligned_and_poisoned(in_dtype):
    # An input that starts one element into its buffer takes the scalar path; every output
    # element must be written (outputs poisoned first).
    flat = torch.randn(1 + 96 * 40, device=DEV).to(in_dtype)
    x = flat[1:].view(96, 40)
    scale = torch.tensor([3.0], device=DEV)
    for out_dtype in FP8:
        r, r_t = fp8.quantize(x, out_dtype, scale, columnwise=True, reference=True)
        lib = fp8._library()
        q, q_t = lib.quantize(x, out_dtype, scale, None, None, True, True)
        same_bits(q, r, "unaligned rowwise")
        same_bits(q_t, r_t, "unaligned columnwise")
    # Poison: outputs allocated with 0xff everywhere must be overwritten completely.
    x = torch.randn(256, 512, device=DEV).to(in_dtype)
    q = torch.full((256, 512), 0x7f, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    q_t = torch.full((512, 256), 0x7f, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    with _capi.Tensor(x.data_ptr(), _dt(x.dtype), x.shape) as ti, \
            _capi.Tensor(q.data_ptr(), _capi.DType.kNVTEFloat8E4M3, q.shape, scale=scale.data_ptr()) as to:
        to.set_param(_capi.TensorParam.kNVTEColumnwiseData, q_t.data_ptr(), _capi.DType.kNVTEFloat8E4M3, q_t.shape)
        _capi.quantize_v2(ti, to, None, torch.cuda.current_stream().cuda_stream)
    r, r_t = fp8.quantize(x, torch.float8_e4m3fn, scale, columnwise=True, reference=True)
    same_bits(q, r, "poisoned rowwise")
    same_bits(q_t, r_t, "poisoned columnwise")


def _dt(d):
    return {torch.float32: _capi.DType.kNVTEFloat32, torch.bfloat16: _capi.DType.kNVTEBFloat16,
            torch.float16: _capi.DType.kNVTEFloat16, torch.float8_e4m3fn: _capi.DType.kNVTEFloat8E4M3,
            torch.float8_e5m2: _capi.DType.kNVTEFloat8E5M2}[d]


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 4097, 1 << 20, (1 << 20) + 3])
def test_compute_amax_exact(in_dtype, n):
    x = special_input((n,), in_dtype, 1.0)
    amax = torch.full((1,), 1e30, device=DEV)  # overwritten, not a running max
    fp8.compute_amax(x, amax)
    ref = fp8.compute_amax(x, reference=True)
    torch.cuda.synchronize()
    assert torch.equal(amax, ref), (amax.item(), ref.item())
    # Unaligned start: the scalar path.
    if n > 2:
        y = x[1:]
        assert torch.equal(fp8.compute_amax(y), fp8.compute_amax(y, reference=True))


def te_scale_from_amax(amax, fp8_max, pow2, eps):
    """TE's compute_scale_from_amax (recipe_common.cuh), in float32."""
    a = np.float32(amax)
    if a < np.float32(eps):
        a = np.float32(eps)
    if np.isinf(a) or a == 0 or np.isnan(a):
        return np.float32(1.0)
    with np.errstate(over="ignore"):
        s = np.float32(fp8_max) / a
    if np.isinf(s):
        s = np.float32(FLOAT_MAX)
    if pow2:
        s = np.frombuffer(struct.pack("<I", struct.unpack("<I", struct.pack("<f", s))[0] & 0xFF800000), "<f4")[0]
    return np.float32(s)


@pytest.mark.parametrize("out_dtype", FP8, ids=str)
def test_compute_scale_from_amax_te_rule(out_dtype):
    fmax = fp8.FP8_MAX[out_dtype]
    amaxes = [0.0, 1e-45, 1e-40, 1e-38, 2.0 ** -126, 0.37, 1.0, 3.7, 448.0, 1e6, 3e38, float("inf"), float("nan")]
    for eps in (0.0, 1e-3, 2.0):
        for pow2 in (False, True):
            for a in amaxes:
                amax = torch.tensor([a], device=DEV)
                scale = torch.full((1,), -5.0, device=DEV)
                fp8.compute_scale_from_amax(amax, out_dtype, scale, epsilon=eps, force_pow_2_scales=pow2)
                want = te_scale_from_amax(a, fmax, pow2, eps)
                got = np.float32(scale.item())
                assert got.tobytes() == want.tobytes(), (a, eps, pow2, got, want)


def te_delayed_update(hist, scale, algo, fp8_max, margin):
    """TE's amax_and_scale_update kernel (delayed_scaling.cu) in numpy float32."""
    h = hist.reshape(hist.shape[0], -1).astype(np.float32)
    n = h.shape[1]
    new_h = np.empty_like(h)
    new_s = np.empty(n, np.float32)
    scaled_max = np.float32(fp8_max) * np.float32(2.0) ** np.float32(-margin)
    for c in range(n):
        col = h[:, c]
        last = col[0]
        rolled = np.concatenate([col[1:], [last]])
        m = np.float32(0)
        for v in rolled:  # fmaxf: NaN ignored
            if not np.isnan(v):
                m = max(m, v)
        new_h[:, c] = rolled
        new_h[0, c] = 0
        amax = last if algo == "most_recent" else m
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            s = scaled_max / amax if (np.isfinite(amax) and amax > 0) else scale.reshape(-1)[c]
        if np.isinf(s):
            s = np.float32(FLOAT_MAX)
        new_s[c] = s
    return new_h.reshape(hist.shape), new_s.reshape(scale.shape)


@pytest.mark.parametrize("shape", [(1,), (16,), (1024,), (1025,), (8, 3), (300, 5)], ids=str)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 1.0, 0.5])
def test_delayed_scaling_update_te_rule(shape, algo, margin):
    for out_dtype in FP8:
        h = (torch.rand(shape, device=DEV) * 100).float()
        if h.numel() > 3:
            h.view(-1)[1] = float("inf")
            h.view(-1)[2] = 0.0
            h.view(-1)[3] = 1e-44
        n = 1 if len(shape) == 1 else shape[1]
        s = torch.rand(n, device=DEV) + 0.5
        want_h, want_s = te_delayed_update(h.cpu().numpy(), s.cpu().numpy(), algo, fp8.FP8_MAX[out_dtype], margin)
        fp8.delayed_scaling_update(h, s, out_dtype, margin=margin, amax_compute_algo=algo)
        torch.cuda.synchronize()
        assert np.array_equal(h.cpu().numpy(), want_h), (shape, algo, margin)
        assert s.cpu().numpy().tobytes() == want_s.tobytes(), (shape, algo, margin, s, want_s)
    # A zero history keeps the scale.
    h = torch.zeros(shape, device=DEV)
    s0 = torch.rand(1 if len(shape) == 1 else shape[1], device=DEV) + 0.5
    s = s0.clone()
    fp8.delayed_scaling_update(h, s, torch.float8_e4m3fn, margin=margin, amax_compute_algo=algo)
    assert torch.equal(s, s0)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (129, 72), (1000, 33), (4096, 4096)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_transpose(shape, dtype):
    x = torch.randn(shape, device=DEV).to(dtype)
    y = fp8.transpose(x)
    assert torch.equal(y.view(torch.uint8) if y.element_size() == 1 else y,
                       (x.t().contiguous().view(torch.uint8) if x.element_size() == 1 else x.t().contiguous()))


@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_dequantize(fp8_dtype, dtype):
    q = torch.randint(0, 256, (333, 77), dtype=torch.uint8, device=DEV).view(fp8_dtype)
    sinv = torch.tensor([0.37], device=DEV)
    got = fp8.dequantize(q, sinv, dtype)
    want = fp8.dequantize(q, sinv, dtype, reference=True)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_noop_flag_skips_every_kernel():
    x = torch.randn(256, 256, device=DEV, dtype=torch.bfloat16)
    q = torch.zeros(256, 256, dtype=torch.uint8, device=DEV)
    amax = torch.full((1,), 7.0, device=DEV)
    scale = torch.full((1,), 2.0, device=DEV)
    flag = torch.ones(1, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    with _capi.Tensor(x.data_ptr(), _capi.DType.kNVTEBFloat16, x.shape) as ti, \
            _capi.Tensor(q.data_ptr(), _capi.DType.kNVTEFloat8E4M3, q.shape, scale=scale.data_ptr(),
                         amax=amax.data_ptr()) as to, \
            _capi.Tensor(flag.data_ptr(), _capi.DType.kNVTEFloat32, (1,)) as tn, \
            _capi.QuantizationConfig(noop_tensor=tn) as cfg:
        _capi.quantize_v2(ti, to, cfg, stream)
        _capi.compute_amax(ti, to, cfg, stream)
        _capi.compute_scale_from_amax(to, cfg, stream)
        torch.cuda.synchronize()
        assert int(q.count_nonzero()) == 0 and amax.item() == 7.0 and scale.item() == 2.0
        flag.zero_()
        _capi.compute_amax(ti, to, cfg, stream)
        _capi.compute_scale_from_amax(to, cfg, stream)
        _capi.quantize_v2(ti, to, cfg, stream)
        torch.cuda.synchronize()
        ref_amax = fp8.compute_amax(x, reference=True)
        assert torch.equal(amax, ref_amax)
        assert scale.item() == te_scale_from_amax(ref_amax.item(), 448.0, False, 0.0)
        assert int(q.count_nonzero()) > 0


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_meta_end_to_end(recipe):
    """Several casts through Fp8Meta (the library path) against the same steps on the torch
    reference: same bytes, same scale_inv, same scaling state after every step."""
    r = fp8.Float8CurrentScaling() if recipe == "current" else fp8.DelayedScaling(amax_history_len=4, margin=1)
    lib_meta = fp8.Fp8Meta(r, torch.float8_e4m3fn, DEV)
    ref_meta = fp8.Fp8Meta(r, torch.float8_e4m3fn, DEV)
    backend = fp8._BACKEND
    for step in range(5):
        x = torch.randn(512, 768, device=DEV, dtype=torch.bfloat16) * (step + 1)
        a = lib_meta.cast(x, columnwise=True)
        fp8._BACKEND = None  # the torch reference for the same step
        try:
            b = ref_meta.cast(x, columnwise=True)
        finally:
            fp8._BACKEND = backend
        same_bits(a.data, b.data, f"{recipe} step {step} rowwise")
        same_bits(a.data_t, b.data_t, f"{recipe} step {step} columnwise")
        assert torch.equal(a.scale_inv, b.scale_inv)
        assert torch.equal(lib_meta.scale, ref_meta.scale)
        if recipe == "delayed":
            assert torch.equal(lib_meta.amax_history, ref_meta.amax_history)


PACKED_CASES = [  # recipe, FP8 dtype, input dtype, rowwise, columnwise, amax reduced over a group
    (fp8.DelayedScaling(amax_history_len=4, margin=1), torch.float8_e4m3fn, torch.bfloat16, True, True, False),
    (fp8.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent"), torch.float8_e5m2, torch.float16,
     False, True, True),
    (fp8.Float8CurrentScaling(amax_epsilon=1e-3, force_pow_2_scales=True), torch.float8_e4m3fn, torch.float32,
     True, False, False),
    (fp8.Float8CurrentScaling(), torch.float8_e5m2, torch.bfloat16, True, True, True),
]
A, S, Q, U = _capi.CAST_AMAX, _capi.CAST_SCALE, _capi.CAST_QUANTIZE, _capi.CAST_UPDATE


@pytest.mark.parametrize("case", PACKED_CASES, ids=["delayed", "delayed-reduced", "current-pow2", "current-reduced"])
def test_fp8_meta_packed_cast_matches_the_primitives(case, monkeypatch):
    """Fp8Meta.cast through nvte_comm_cast_packed (one foreign call; two where the amax is
    reduced over a group: the reduction between them) against the same casts through the
    separate primitives (a backend without it): same bytes, scale_inv and scaling state
    after every step, and the steps each call ran."""
    recipe, odt, idt, rowwise, columnwise, reduced = case
    backend = fp8._library()
    assert backend.cast_packed is not None, "the library exports nvte_comm_cast_packed"
    ran = []

    def counted(ptr, fn=backend.cast_packed):
        ran.append(ptr.contents.steps)
        return fn(ptr)

    monkeypatch.setattr(backend, "cast_packed", counted)
    packed = fp8.Fp8Meta(recipe, odt, DEV)
    separate = fp8.Fp8Meta(recipe, odt, DEV)
    if reduced:  # a group of more than one rank (one process: its "reduction" doubles the
        # amax, so that a reduction out of order shows in the scale)
        for m in (packed, separate):
            monkeypatch.setattr(m, "_reduces", lambda: True)
            monkeypatch.setattr(m, "_reduce", lambda amax: amax.mul_(2))
    delayed = isinstance(recipe, fp8.DelayedScaling)
    for step in range(5):
        x = (torch.randn(384, 640, device=DEV) * (step + 1) * 0.7).to(idt)
        del ran[:]
        a = packed.cast(x, rowwise=rowwise, columnwise=columnwise)
        monkeypatch.setattr(backend, "cast_packed", None)
        try:
            b = separate.cast(x, rowwise=rowwise, columnwise=columnwise)
        finally:
            monkeypatch.setattr(backend, "cast_packed", counted)
        w = f"{recipe} step {step}"
        if delayed and step == 0:
            assert ran == [], w + ": the first delayed cast (priming) takes the primitives"
        elif delayed:
            assert ran == ([Q, U] if reduced else [Q | U]), (w, ran)
        else:
            assert ran == ([A, S | Q] if reduced else [A | S | Q]), (w, ran)
        for got, want, what in ((a.data, b.data, "rowwise"), (a.data_t, b.data_t, "columnwise")):
            assert (got is None) == (want is None), w + " " + what
            if got is not None:
                same_bits(got, want, f"{w} {what}")
        assert torch.equal(a.scale_inv, b.scale_inv), w
        assert torch.equal(packed.scale, separate.scale), w
        if delayed:
            assert torch.equal(packed.amax_history, separate.amax_history), w
        else:
            assert torch.equal(packed._amax, separate._amax), w


def test_fp8_meta_packed_cast_follows_its_tensors():
    """A copy of a scaling state (copy.deepcopy) casts with its own tensors, not the
    original's: the packed struct is not copied, and a state whose tensors were replaced
    makes a new one."""
    import copy

    m = fp8.Fp8Meta(fp8.Float8CurrentScaling(), torch.float8_e4m3fn, DEV)
    x = torch.randn(128, 256, device=DEV)
    m.cast(x)
    c = copy.deepcopy(m)
    assert c._plan is None and c.scale.data_ptr() != m.scale.data_ptr()
    c.cast(x * 4)
    assert torch.equal(m._amax, x.abs().amax().reshape(1))
    assert torch.equal(c._amax, (x * 4).abs().amax().reshape(1))
    m.scale = torch.ones(1, device=DEV)  # replaced, not written in place
    m.cast(x * 2)
    assert torch.equal(m.scale, fp8.compute_scale_from_amax(m._amax, torch.float8_e4m3fn))


# The cast + transpose kernels (NVTE_COMM_CAST_TRANSPOSE, read at each columnwise call):
# v3 (default: v2 where its tiles do not fit), v2, v1 (the previous kernel) and the bench variants of v2 and v3 (bf16 -> e4m3
# on the vector path, v3 on whole tiles only; every other case runs v2 under those names).
# src/kernels.rs's unit test checks that these lists name every value.
CT_VARIANTS = ["v3", "v2", "v1"]
CT_BENCH_VARIANTS = ["v2-np", "v2-tr64", "v2-tr64-np", "v2-tr64-g16", "v2-g16", "v2-cs", "v2-g32-cs",
                     "v2-pf0", "v2-m4-np", "v3-r256c128", "v3-r256c64-m4", "v3-r256c64-bs-m4", "v3-r512c64",
                     "v3-r512c64-bs", "v3-nohint", "v3-cs", "v3-ef"]
# Odd sizes (rows % 16 != 0: byte transposed stores; cols % 8 != 0: the element path),
# partial edge tiles, and more tiles than one persistent wave (blocks loop over tiles).
CT_SHAPES = [(129, 72), (300, 1000), (520, 136), (1000, 33), (7, 4100), (1040, 8200), (2048, 4096), (768, 384)]


def _cast_transpose_case(x, out_dtype, what, noop=False):
    """Rowwise + columnwise and columnwise alone through the library (poisoned outputs)
    against the torch reference: same bytes, amax exact (a running max), scale_inv. With
    `noop`, a flag holding 1: nothing may change."""
    scale_v = float(torch.empty(()).uniform_(0.3, 40.0))
    scale = torch.tensor([scale_v], device=DEV)
    cols = x.shape[-1]
    rows = x.numel() // cols
    odt = _dt(out_dtype)
    stream = torch.cuda.current_stream().cuda_stream
    for rowwise in (True, False):
        q = torch.full((rows, cols), 0x7f, dtype=torch.uint8, device=DEV)
        q_t = torch.full((cols, rows), 0x7f, dtype=torch.uint8, device=DEV)
        amax = torch.full((1,), 0.125, device=DEV)
        sinv = torch.full((1,), -1.0, device=DEV)
        flag = torch.ones(1, device=DEV)
        with _capi.Tensor(x.data_ptr(), _dt(x.dtype), (rows, cols)) as ti, \
                _capi.Tensor(q.data_ptr() if rowwise else 0, odt, q.shape, scale=scale.data_ptr(),
                             amax=amax.data_ptr(), scale_inv=sinv.data_ptr()) as to, \
                _capi.Tensor(flag.data_ptr(), _capi.DType.kNVTEFloat32, (1,)) as tn, \
                _capi.QuantizationConfig(noop_tensor=tn if noop else None) as cfg:
            to.set_param(_capi.TensorParam.kNVTEColumnwiseData, q_t.data_ptr(), odt, q_t.shape)
            _capi.quantize_v2(ti, to, cfg, stream)
        torch.cuda.synchronize()
        w = f"{what} rowwise={rowwise}"
        if noop:
            assert int((q != 0x7f).sum()) == 0 and int((q_t != 0x7f).sum()) == 0, w
            assert amax.item() == 0.125 and sinv.item() == -1.0, w
            continue
        amax_ref = torch.full((1,), 0.125, device=DEV)
        r, r_t = fp8.quantize(x.reshape(rows, cols), out_dtype, scale, amax=amax_ref, rowwise=True,
                              columnwise=True, reference=True)
        if rowwise:
            same_bits(q.view(out_dtype), r, w + " rowwise")
        else:
            assert int((q != 0x7f).sum()) == 0, w + ": rowwise data written although not asked for"
        same_bits(q_t.view(out_dtype), r_t, w + " columnwise")
        assert torch.equal(amax, amax_ref), (w, amax.item(), amax_ref.item())
        assert torch.equal(sinv, scale.reciprocal()), (w, sinv.item())


@pytest.mark.parametrize("variant", CT_VARIANTS)
@pytest.mark.parametrize("shape", CT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", FP8, ids=str)
def test_cast_transpose_bit_exact(variant, shape, in_dtype, out_dtype, monkeypatch):
    monkeypatch.setenv("NVTE_COMM_CAST_TRANSPOSE", variant)
    x = special_input(shape, in_dtype, 8.0)
    _cast_transpose_case(x, out_dtype, f"{variant} {shape} {in_dtype}->{out_dtype}")


@pytest.mark.parametrize("variant", CT_VARIANTS + CT_BENCH_VARIANTS)
def test_cast_transpose_variants(variant, monkeypatch):
    """Every value of NVTE_COMM_CAST_TRANSPOSE on bf16 -> e4m3 (the bench variants' own
    kernels; 8192 x 8192 is the benchmark's shape) and on a cast they leave to v2;
    unaligned input (the element path); the noop flag."""
    monkeypatch.setenv("NVTE_COMM_CAST_TRANSPOSE", variant)
    for shape in [(64, 64), (300, 1000), (1040, 8200), (2048, 4096), (2560, 640), (4096, 128), (8192, 8192)]:
        x = special_input(shape, torch.bfloat16, 8.0)
        _cast_transpose_case(x, torch.float8_e4m3fn, f"{variant} {shape}")
    _cast_transpose_case(special_input((512, 256), torch.float16, 8.0), torch.float8_e5m2, f"{variant} f16->e5m2")
    flat = special_input((1 + 96 * 40,), torch.bfloat16, 8.0)
    _cast_transpose_case(flat[1:].view(96, 40), torch.float8_e4m3fn, f"{variant} unaligned")
    _cast_transpose_case(special_input((256, 512), torch.bfloat16, 8.0), torch.float8_e4m3fn,
                         f"{variant} noop", noop=True)


def test_cast_transpose_knob_is_checked(monkeypatch):
    monkeypatch.setenv("NVTE_COMM_CAST_TRANSPOSE", "v9")
    x = torch.randn(64, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(_capi.CommError, match="NVTE_COMM_CAST_TRANSPOSE"):
        fp8._library().quantize(x, torch.float8_e4m3fn, torch.ones(1, device=DEV), None, None, True, True)
