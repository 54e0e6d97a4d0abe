"""Host (CPU) tests of transformer_engine_comm.torch.modules: one process, a one-rank gloo
group, tp 1. The reference build (comm_overlap=False) and the overlap build's tp-1 path
(plain torch, no library call) run on the CPU, FP8 GEMMs as dequantized fp32 matmuls of
the same FP8 values -- so the FP8 wiring (which operands are cast, in which format, with
which scale, which layouts) is checked exactly against an independent emulation, and FP8
training against float training."""
import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from transformer_engine_comm.torch import fp8  # noqa: E402
from transformer_engine_comm.torch import modules as tm  # noqa: E402

H, FFN, N = 64, 256, 96
F32 = torch.float32
FP8_OUT_TOL = 0.08  # FP8 vs float, relative (see test_fp8_gradients_close_to_float)
FP8_GRAD_TOL = 0.15


@pytest.fixture(scope="module", autouse=True)
def gloo_world():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = False
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        created = True
    yield
    if created:
        dist.destroy_process_group()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _q(t, dtype, scale):
    """Independent emulation of a per-tensor cast: dequantized value of fp8(clamp(t*scale))."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def _cur_scale(t, dtype):
    return torch.finfo(dtype).max / t.abs().amax().float()


def _data(seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _grads(m, x, g, **kw):
    x = x.clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    y = m(x, **kw)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


# ------------------------------------------------------------------ FP8 wiring, exact


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fmt", [fp8.Format.HYBRID, fp8.Format.E4M3])
@pytest.mark.parametrize("kind", ["col", "row"])
def test_fp8_linear_matches_emulation(kind, fmt, overlap):
    """Current scaling: forward, dgrad and wgrad are the FP8 GEMMs of the quantized x, W, dY
    (dY in the backward format), computed here independently."""
    recipe = fp8.Float8CurrentScaling(fp8_format=fmt)
    cls = tm.ColumnParallelLinear if kind == "col" else tm.RowParallelLinear
    m = cls(H, FFN, True, comm_overlap=overlap, fp8=True, fp8_recipe=recipe, device="cpu",
            params_dtype=F32, seed=4)
    with torch.no_grad():
        m.bias.copy_(_data(9, FFN, scale=0.3))
    x, g = _data(1, N, H), _data(2, N, FFN, scale=1e-3)
    y, dx, grads = _grads(m, x, g)
    W, b = m.weight.detach(), m.bias.detach()
    fwd, bwd = fp8.fwd_dtype(fmt), fp8.bwd_dtype(fmt)  # Format.X.fwd / .bwd: the dtypes' names
    xq = _q(x, fwd, _cur_scale(x, fwd))
    wq = _q(W, fwd, _cur_scale(W, fwd))
    gq = _q(g, bwd, _cur_scale(g, bwd))
    torch.testing.assert_close(y, xq @ wq.t() + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, gq @ wq, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads["weight"], gq.t() @ xq, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads["bias"], g.sum(0), rtol=1e-5, atol=1e-7)  # from the unquantized dY
    # Not a no-op: the FP8 results differ from the float ones.
    assert _rel(dx, g @ W) > 1e-4


def test_fp8_mlp_gelu_backward_matches_emulation():
    """LayerNormMLP, current scaling: fc1's dY is GELU's backward of fc2's FP8 dgrad on the
    saved pre-activation, then cast in the backward format."""
    recipe = fp8.Float8CurrentScaling()
    fwd, bwd = fp8.fwd_dtype(recipe), fp8.bwd_dtype(recipe)
    m = tm.LayerNormMLP(H, FFN, comm_overlap=False, fp8=True, fp8_recipe=recipe, device="cpu",
                        params_dtype=F32, seed=5)
    x, g = _data(3, N, H), _data(4, N, H, scale=1e-2)
    y, dx, grads = _grads(m, x, g)
    p = {n: t.detach() for n, t in m.named_parameters()}
    qs = lambda t, d: _q(t, d, _cur_scale(t, d))  # noqa: E731
    ln = F.layer_norm(x, (H,), p["layer_norm_weight"], p["layer_norm_bias"], 1e-5)
    pre = qs(ln, fwd) @ qs(p["fc1.weight"], fwd).t() + p["fc1.bias"]
    h = F.gelu(pre, approximate="tanh")
    y_ref = qs(h, fwd) @ qs(p["fc2.weight"], fwd).t() + p["fc2.bias"]
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    gq = qs(g, bwd)
    torch.testing.assert_close(grads["fc2.weight"], gq.t() @ qs(h, fwd), rtol=1e-5, atol=1e-7)
    dh = gq @ qs(p["fc2.weight"], fwd)
    dpre = torch.ops.aten.gelu_backward(dh, pre, approximate="tanh")
    torch.testing.assert_close(grads["fc1.weight"], qs(dpre, bwd).t() @ qs(ln, fwd), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grads["fc1.bias"], dpre.sum(0), rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------- FP8 vs float, bounds


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_gradients_close_to_float(recipe):
    """FP8 (HYBRID) vs the float module: relative errors of e4m3 / e5m2 size (a few %),
    after a warm-up step so that delayed scaling has an amax history."""
    kw = dict(comm_overlap=False, device="cpu", params_dtype=F32, seed=6)
    ref = tm.LayerNormMLP(H, FFN, **kw)
    f8m = tm.LayerNormMLP(H, FFN, fp8=True, fp8_recipe=fp8.recipe_from_name(recipe), **kw)
    x, g = _data(5, N, H), _data(6, N, H, scale=1e-2)
    _grads(f8m, x, g)  # step 0: delayed scaling casts with scale 1
    yr, dxr, gr = _grads(ref, x, g)
    yf, dxf, gf = _grads(f8m, x, g)
    errs = {"out": _rel(yf, yr), "dx": _rel(dxf, dxr)}
    errs.update({"d" + n: _rel(gf[n], gr[n]) for n in gr})
    print(errs)
    # e4m3 rounds to a relative spacing of 2^-3 (rms error ~3.6 % per element), e5m2 to
    # 2^-2 (~7 %); a GEMM of two quantized operands, two layers deep: ~5-10 %.
    assert errs["out"] < FP8_OUT_TOL, errs
    assert max(errs.values()) < FP8_GRAD_TOL, errs


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_training_tracks_float(recipe):
    """10 Adam steps: the FP8 model's loss falls and stays within 2 % of the float one."""
    def train(fp8_on):
        m = tm.LayerNormMLP(H, FFN, comm_overlap=False, fp8=fp8_on, device="cpu", params_dtype=F32, seed=7,
                            fp8_recipe=fp8.recipe_from_name(recipe) if fp8_on else None)
        opt = torch.optim.Adam(m.parameters(), lr=2e-3)
        x, t = _data(7, N, H), _data(8, N, H, scale=0.5)
        losses = []
        for _ in range(10):
            loss = ((m(x) - t) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    lf, l8 = train(False), train(True)
    assert l8[-1] < 0.9 * l8[0], l8
    for a, b in zip(l8, lf):
        assert abs(a - b) <= 0.02 * b, (l8, lf)


# ---------------------------------------------------------- delayed scaling state


def test_delayed_scaling_state_evolves_as_te():
    """Per role: entry 0 of the history is the cast tensor's amax, the next scale is
    fp8_max / max(history) / 2**margin, the history rolls; the first cast takes its scale from
    the tensor itself."""
    L, margin = 4, 1
    recipe = fp8.DelayedScaling(margin=margin, amax_history_len=L)
    m = tm.ColumnParallelLinear(H, FFN, True, comm_overlap=False, fp8=True, fp8_recipe=recipe, device="cpu",
                                params_dtype=F32, seed=8)
    meta = m.fp8_meta
    assert meta["input"].fp8_dtype == torch.float8_e4m3fn and meta["grad_output"].fp8_dtype == torch.float8_e5m2
    hist = {r: [] for r in meta}
    for step in range(6):
        x, g = _data(20 + step, N, H, scale=1.0 + step), _data(40 + step, N, FFN, scale=10.0 ** -step)
        scales_before = {r: meta[r].scale.item() for r in meta}
        if step == 0:
            # The first cast of each role has no history: its scale comes from the tensor
            # itself (fp8.Fp8Meta's priming), with the margin.
            assert all(s == 1.0 for s in scales_before.values())
            for role, t in (("input", x), ("weight", m.weight.detach())):
                scales_before[role] = torch.finfo(meta[role].fp8_dtype).max / t.abs().amax().item() / 2 ** margin
        y, dx, grads = _grads(m, x, g)
        xq_ref = _q(x, torch.float8_e4m3fn, scales_before["input"])
        wq_ref = _q(m.weight.detach(), torch.float8_e4m3fn, scales_before["weight"])
        # The forward used the scales from before this step (delayed).
        torch.testing.assert_close(y, xq_ref @ wq_ref.t() + m.bias.detach(), rtol=1e-5, atol=1e-5)
        for role, t in (("input", x), ("weight", m.weight.detach()), ("grad_output", g)):
            hist[role].insert(0, t.abs().amax().item())
            window = hist[role][:L]
            fmax = torch.finfo(meta[role].fp8_dtype).max
            want = fmax / max(window) / 2 ** margin
            assert meta[role].scale.item() == pytest.approx(want, rel=1e-6), (role, step)
            # After the update the history rolled: newest amax last, entry 0 zeroed.
            h = meta[role].amax_history.tolist()
            assert h[0] == 0.0 and h[-1] == pytest.approx(window[0], rel=1e-6), (role, step, h)


def test_reduce_amax_off_rejected_when_gathered(monkeypatch):
    # One rank: nothing is gathered, so reduce_amax=False is allowed.
    m = tm.ColumnParallelLinear(H, FFN, comm_overlap=False, fp8=True, device="cpu",
                                fp8_recipe=fp8.DelayedScaling(reduce_amax=False))
    assert m.fp8_recipe.reduce_amax is False
    # Two ranks with sequence parallelism: the shards are gathered in FP8 and need one
    # scale, so a recipe that does not reduce the amaxes is refused (module construction
    # asks tp_size_rank only; no process group is needed for the check).
    monkeypatch.setattr(tm, "tp_size_rank", lambda group=None: (2, 0))
    with pytest.raises(ValueError, match="reduce_amax=False"):
        tm.ColumnParallelLinear(H, 2 * FFN, comm_overlap=False, fp8=True, device="cpu",
                                fp8_recipe=fp8.DelayedScaling(reduce_amax=False))
    # Without sequence parallelism nothing is gathered: allowed at tp 2 too.
    tm.ColumnParallelLinear(H, 2 * FFN, comm_overlap=False, fp8=True, device="cpu", sequence_parallel=False,
                            fp8_recipe=fp8.DelayedScaling(reduce_amax=False))


# ------------------------------------------------------------ is_first_microbatch


def _weight_casts(m):
    return int((m.fp8_meta["weight"].amax_history != 0).sum().item())


def test_is_first_microbatch_caches_the_weight_cast():
    recipe = fp8.DelayedScaling(amax_history_len=16)
    m = tm.ColumnParallelLinear(H, FFN, True, comm_overlap=False, fp8=True, fp8_recipe=recipe, device="cpu",
                                params_dtype=F32, seed=9)
    m.fp8_meta  # creates the FP8 state
    st = m._f8
    x, g = _data(60, N, H), _data(61, N, FFN)
    # None: a cast on every forward (one amax entry each), nothing cached.
    _grads(m, x, g)
    _grads(m, x, g)
    assert _weight_casts(m) == 2 and st.cached_weight is None
    # True: cast and cache; False: the cache, no new cast.
    y1, dx1, g1 = _grads(m, x, g, is_first_microbatch=True)
    c = st.cached_weight
    assert c is not None and c.data is not None and c.data_t is not None
    y2, dx2, g2 = _grads(m, x, g, is_first_microbatch=False)
    assert _weight_casts(m) == 3 and st.cached_weight is c
    torch.testing.assert_close(dx2, dx1, rtol=0, atol=0)
    # An in-place update (the optimizer) bumps the version counter: False recasts.
    with torch.no_grad():
        m.weight.mul_(2.0)
    y3, dx3, g3 = _grads(m, x, g, is_first_microbatch=False)
    assert _weight_casts(m) == 4 and st.cached_weight is not c
    assert _rel(dx3, 2.0 * dx1) < 0.1  # the doubled weight was used, not the stale cast
    # None drops the cache.
    _grads(m, x, g)
    assert st.cached_weight is None


def test_is_first_microbatch_through_layernorm_mlp():
    m = tm.LayerNormMLP(H, FFN, comm_overlap=True, fp8=True, device="cpu", params_dtype=F32, seed=10)
    x, g = _data(62, N, H), _data(63, N, H)
    _grads(m, x, g, is_first_microbatch=True)
    _grads(m, x, g, is_first_microbatch=False)
    _grads(m, x, g, is_first_microbatch=False)
    assert _weight_casts(m.fc1) == 1 and _weight_casts(m.fc2) == 1
    assert m.fc1._f8.cached_weight is not None and m.fc2._f8.cached_weight is not None


# ------------------------------------------------------------ builds at tp 1, bf16


@pytest.mark.parametrize("kind", ["col", "row", "mlp"])
@pytest.mark.parametrize("bias", [True, False])
def test_overlap_build_tp1_matches_reference(kind, bias):
    """The hand-written tp-1 path of the overlap build (no library call at tp 1) against the
    autograd-derived reference build, float32 on the CPU."""
    kw = dict(device="cpu", params_dtype=F32, seed=11)
    if kind == "mlp":
        a, b = (tm.LayerNormMLP(H, FFN, bias=bias, comm_overlap=o, **kw) for o in (True, False))
        gshape = (N, H)
    else:
        cls = tm.ColumnParallelLinear if kind == "col" else tm.RowParallelLinear
        a, b = (cls(H, FFN, bias, comm_overlap=o, **kw) for o in (True, False))
        gshape = (N, FFN)
    x = _data(70, 4, N // 4, H)  # 3-D input: flattened and restored
    g = _data(71, 4, N // 4, gshape[1])
    ya, dxa, ga = _grads(a, x, g)
    yb, dxb, gb = _grads(b, x, g)
    assert ya.shape == yb.shape == (4, N // 4, gshape[1])
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dxa, dxb, rtol=1e-5, atol=1e-6)
    for n in gb:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-5, atol=1e-6)


def test_no_input_grad_and_no_grad_mode():
    m = tm.LayerNormMLP(H, FFN, comm_overlap=True, fp8=True, device="cpu", params_dtype=F32, seed=12)
    x = _data(72, N, H)
    y = m(x)  # input without grad: no dgrad of fc1 needed
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    with torch.no_grad():
        y2 = m(x)
    assert y2.shape == (N, H) and not y2.requires_grad


def test_force_library_path_flag_and_env(monkeypatch):
    m = tm.ColumnParallelLinear(H, FFN, device="cpu", force_library_path=True)
    assert m.force_library_path and m._cfg().comm and m._cfg().sp  # the communicating path at tp 1
    plain = tm.ColumnParallelLinear(H, FFN, device="cpu")
    assert not plain._cfg().comm
    monkeypatch.setenv("TE_COMM_FORCE_LIBRARY_PATH", "1")
    e = tm.LayerNormMLP(H, FFN, device="cpu")
    assert e.fc1.force_library_path and e.fc2._cfg().comm
    monkeypatch.setenv("TE_COMM_FORCE_LIBRARY_PATH", "0")
    assert not tm.RowParallelLinear(FFN, H, device="cpu").force_library_path
    # The reference build never takes the library path.
    assert not tm.ColumnParallelLinear(H, FFN, device="cpu", comm_overlap=False, force_library_path=True)._cfg().comm


def test_bad_recipe_rejected():
    with pytest.raises(TypeError):
        tm.ColumnParallelLinear(H, FFN, device="cpu", fp8=True, fp8_recipe="delayed")
