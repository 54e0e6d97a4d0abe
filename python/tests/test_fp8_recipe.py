"""Host tests of transformer_engine_comm.torch.fp8's reference arithmetic (the CPU path,
and the reference the library's kernels are checked against on the GPU): TE's delayed
scaling update, scale from amax, the saturating cast and its transposed copy."""
import math

import pytest

torch = pytest.importorskip("torch")
from transformer_engine_comm.torch import fp8  # noqa: E402


def _te_update(hist, scale, fmax, margin, algo):
    """TE's amax_and_scale_update, written out per element in plain Python."""
    L = len(hist)
    amax = max(hist) if algo == "max" else hist[0]
    if math.isfinite(amax) and amax > 0:
        s = (fmax / amax) / (2.0 ** margin)
        s = min(s, 3.4028234663852886e38) if math.isfinite(s) else 3.4028234663852886e38
    else:
        s = scale
    rolled = [hist[(i + 1) % L] for i in range(L)]
    rolled[0] = 0.0
    return rolled, s


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_delayed_update_matches_te(algo, margin, dtype):
    g = torch.Generator().manual_seed(7)
    hist = (torch.rand(5, generator=g) * 100).tolist()
    hist[2] = 0.0
    h = torch.tensor(hist, dtype=torch.float32)
    s = torch.tensor([0.5], dtype=torch.float32)
    fp8.delayed_scaling_update(h, s, dtype, margin=margin, amax_compute_algo=algo)
    want_h, want_s = _te_update([float(v) for v in torch.tensor(hist, dtype=torch.float32)], 0.5,
                                fp8.FP8_MAX[dtype], margin, algo)
    assert h.tolist() == pytest.approx(want_h, rel=0, abs=0)
    assert s.item() == pytest.approx(want_s, rel=1e-7)


def test_delayed_update_keeps_scale_on_zero_or_nonfinite_amax():
    for bad in (0.0, float("inf"), float("nan")):
        h = torch.tensor([bad], dtype=torch.float32)
        s = torch.tensor([3.0])
        fp8.delayed_scaling_update(h, s, fp8.E4M3, amax_compute_algo="most_recent")
        assert s.item() == 3.0
        assert h.tolist() == [0.0]


def test_delayed_update_max_skips_nan():
    h = torch.tensor([float("nan"), 4.0, 2.0])
    s = torch.ones(1)
    fp8.delayed_scaling_update(h, s, fp8.E4M3)
    assert s.item() == 112.0


def test_delayed_update_2d_history():
    h = torch.tensor([[1.0, 2.0], [4.0, 0.5], [0.0, 8.0]])
    s = torch.ones(2)
    fp8.delayed_scaling_update(h, s, fp8.E4M3)
    assert s.tolist() == pytest.approx([448.0 / 4.0, 448.0 / 8.0])
    assert h.tolist() == [[0.0, 0.0], [0.0, 8.0], [1.0, 2.0]]


def test_scale_from_amax_rules():
    f = fp8.compute_scale_from_amax
    assert f(torch.tensor([2.0]), fp8.E4M3).item() == 224.0
    assert f(torch.tensor([0.0]), fp8.E4M3).item() == 1.0
    assert f(torch.tensor([1e-45]), fp8.E4M3).item() == torch.finfo(torch.float32).max
    assert f(torch.tensor([0.0]), fp8.E4M3, epsilon=2.0).item() == 224.0
    assert f(torch.tensor([float("inf")]), fp8.E4M3).item() == 1.0
    assert f(torch.tensor([float("nan")]), fp8.E4M3).item() == 1.0
    # One correctly rounded division, not reciprocal-then-multiply.
    a = torch.tensor([3.3e-3])
    assert f(a, fp8.E4M3).item() == (torch.tensor([448.0]) / a).item()
    assert f(torch.tensor([3.0]), fp8.E4M3, force_pow_2_scales=True).item() == 128.0


def test_quantize_saturates_and_transposes():
    x = torch.tensor([[1000.0, -1000.0, 1.0], [float("nan"), 0.0, -0.0]], dtype=torch.float32)
    amax = torch.tensor([5.0])
    si = torch.empty(1)
    q, qt = fp8.quantize(x, fp8.E4M3, torch.tensor([1.0]), amax=amax, scale_inv=si, columnwise=True)
    assert q[0, 0].item() == 448.0 and q[0, 1].item() == -448.0
    assert math.isnan(q[1, 0].float().item())
    assert qt.shape == (3, 2) and torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert si.item() == 1.0
    # amax is a running maximum; NaN elements are ignored (fmaxf, as TE's amax kernels).
    q2, _ = fp8.quantize(x[:1], fp8.E4M3, torch.tensor([2.0]), amax=amax)
    assert amax.item() == 1000.0


def test_meta_delayed_first_cast_primes_then_history():
    m = fp8.Fp8Meta(fp8.DelayedScaling(amax_history_len=3, margin=1), fp8.E4M3, "cpu")
    x = torch.full((4, 4), 7.0)
    t = m.cast(x)
    # No history yet: the first cast takes its scale from its own amax (with the margin).
    assert t.scale_inv.item() == pytest.approx(7.0 * 2 / 448.0)
    assert m.amax_history.tolist() == [0.0, 0.0, 7.0]
    assert m.scale.item() == pytest.approx(448.0 / 7.0 / 2)
    t2 = m.cast(x * 2)
    assert t2.scale_inv.item() == pytest.approx(7.0 * 2 / 448.0)  # delayed: last step's scale
    assert t.scale_inv.item() == pytest.approx(7.0 * 2 / 448.0)  # each cast keeps its own
    assert m.amax_history.tolist() == [0.0, 7.0, 14.0]
    assert m.scale.item() == pytest.approx(448.0 / 14.0 / 2)


class _Roles(torch.nn.Module):
    """A module with fp8_meta roles as the FP8 modules have them (one state shared by two
    roles, as a tied weight would be, and one current-scaling role)."""

    def __init__(self, delayed, current):
        super().__init__()
        self.fp8_meta = {"input": delayed[0], "weight": delayed[1], "grad_output": delayed[0], "other": current}


def test_keep_delayed_states_restores_in_place():
    r = fp8.DelayedScaling(amax_history_len=3)
    a, b = (fp8.Fp8Meta(r, fp8.E4M3, "cpu") for _ in range(2))
    cur = fp8.Fp8Meta(fp8.Float8CurrentScaling(), fp8.E4M3, "cpu")
    outer = torch.nn.Sequential(_Roles((a, b), cur), _Roles((b, a), cur))
    assert fp8.delayed_states(outer) == [a, b]  # each once; current scaling has no history
    a.cast(torch.full((2, 2), 3.0))  # primed on real data
    ptrs = [(s.scale.data_ptr(), s.amax_history.data_ptr()) for s in (a, b)]
    before = [(s.scale.clone(), s.amax_history.clone(), s.primed) for s in (a, b)]
    with pytest.raises(RuntimeError):
        with fp8.keep_delayed_states(outer) as states:
            assert states == [a, b]
            for s in states:  # what a capture's warm-up on garbage gradients does
                s.cast(torch.full((2, 2), 1e4))
            assert not torch.equal(a.amax_history, before[0][1]) and b.primed
            raise RuntimeError("the capture failed")  # restored on the way out too
    for s, (scale, hist, primed), ptr in zip((a, b), before, ptrs):
        assert torch.equal(s.scale, scale) and torch.equal(s.amax_history, hist) and s.primed == primed
        assert (s.scale.data_ptr(), s.amax_history.data_ptr()) == ptr  # in place: graphs hold these
    assert a.primed and not b.primed


def test_meta_current_scaling():
    m = fp8.Fp8Meta(fp8.Float8CurrentScaling(), fp8.E5M2, "cpu")
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    t = m.cast(x, rowwise=False, columnwise=True)
    assert t.data is None and t.data_t.shape == (2, 2)
    assert t.scale_inv.item() == pytest.approx(3.0 / 57344.0)


def test_recipe_validation():
    with pytest.raises(ValueError):
        fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError):
        fp8.DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError):
        fp8.recipe_from_name("blockwise")
    assert isinstance(fp8.recipe_from_name("current"), fp8.Float8CurrentScaling)


def test_format_dtypes():
    # TE's Format: HYBRID = e4m3 forward / e5m2 backward; E4M3 everywhere. Format.X.fwd /
    # .bwd are the dtypes' names (the Format is the framework-neutral one); fwd_dtype /
    # bwd_dtype the torch dtypes.
    assert fp8.fwd_dtype(fp8.Format.HYBRID) == torch.float8_e4m3fn
    assert fp8.bwd_dtype(fp8.Format.HYBRID) == torch.float8_e5m2
    assert fp8.fwd_dtype(fp8.Format.E4M3) == torch.float8_e4m3fn
    assert fp8.bwd_dtype(fp8.Format.E4M3) == torch.float8_e4m3fn
    assert (fp8.Format.HYBRID.fwd, fp8.Format.HYBRID.bwd) == ("float8_e4m3fn", "float8_e5m2")
    assert fp8.dtypes(fp8.DelayedScaling()) == (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)
