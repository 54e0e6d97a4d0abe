"""transformer_engine_comm.torch.modules on ONE GPU (tp 1): the overlap build (plain tp-1
path, and the library path forced with force_library_path=True: comm-GEMM ops and
userbuffers over a one-rank group) against the reference build, FP8 (both recipes) against
float, and CUDA graph capture of forward + backward with fp8=True.

Runs standalone (``python -m pytest python/tests/torch/test_modules_tp1.py``: a one-rank
NCCL group is created here) and under scripts/torch-gpu.sh's torchrun (every rank then
runs the tests on its own one-rank group)."""
import gc
import os
import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch, "cuda"):
    pytest.skip("torch is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_nccl_available():
    pytest.skip("torch.distributed with NCCL is not available", allow_module_level=True)

from transformer_engine_comm.torch import fp8  # noqa: E402
from transformer_engine_comm.torch import modules as tm  # noqa: E402

BF16 = torch.bfloat16
S, B, H, FFN = 128, 2, 256, 1024
TOL_BF16 = 1e-2  # overlap vs reference, bf16 (same GEMMs; the library's may tile differently)
TOL_FP8_SAME = 3e-2  # overlap vs reference, FP8 (same quantized operands; accumulation may differ)
FP8_OUT_TOL, FP8_GRAD_TOL = 0.08, 0.15  # FP8 vs float (e4m3 / e5m2 rounding, two layers)

MLP_FLAGS = {
    "te_default": dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=False,
                       ub_bulk_dgrad=True, ub_bulk_wgrad=True),
    "rs_dgrad": dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True,
                     ub_bulk_dgrad=False, ub_bulk_wgrad=False),
    "none": dict(ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                 ub_bulk_dgrad=False, ub_bulk_wgrad=False),
}


@pytest.fixture(scope="module")
def group():
    """A one-rank NCCL group: this rank's own (torchrun with more ranks), or the world of a
    standalone run (created here)."""
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.backends.cuda.matmul.allow_tf32 = False
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return mine


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


def build(group, overlap, *, fp8_on=False, recipe=None, force=False, flags="te_default", dtype=BF16, seed=3):
    return tm.LayerNormMLP(H, FFN, tp_group=group, comm_overlap=overlap, fp8=fp8_on, fp8_recipe=recipe,
                           force_library_path=force, params_dtype=dtype, device=dev(), seed=seed,
                           **MLP_FLAGS[flags])


def run(m, x, g, **kw):
    x = x.detach().clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    y = m(x, **kw)
    y.backward(g.to(y.dtype))
    torch.cuda.synchronize()
    return [y.detach().float(), x.grad.float()] + [p.grad.float() for p in m.parameters()]


def names(m):
    return ["out", "dx"] + ["d" + n for n, _ in m.named_parameters()]


def check(what, m, got, ref, tol, skip_zero=True):
    errs = {n: rel(a, b) for n, a, b in zip(names(m), got, ref) if not (skip_zero and b.abs().max() == 0)}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"{what}: {bad} (tol {tol}; all {errs})"


def inputs(seed=0):
    return data(100 + seed, S, B, H).to(BF16), data(200 + seed, S, B, H, scale=0.1).to(BF16)


# ------------------------------------------------------------------- bf16


@pytest.mark.parametrize("force", [False, True], ids=["plain", "forced"])
@pytest.mark.parametrize("flags", list(MLP_FLAGS))
def test_bf16_overlap_vs_reference(group, flags, force):
    if not force and flags != "te_default":
        pytest.skip("the plain tp-1 path ignores the flags")
    ref, ovl = build(group, False), build(group, True, force=force, flags=flags)
    for it in range(3):  # fresh inputs through the same modules (cached userbuffers reused)
        x, g = inputs(it)
        check(f"bf16 flags={flags} forced={force} iter={it}", ovl, run(ovl, x, g), run(ref, x, g), TOL_BF16)


def test_forced_vs_plain_bf16(group):
    a, b = build(group, True, force=True), build(group, True)
    x, g = inputs(5)
    check("forced vs plain", a, run(a, x, g), run(b, x, g), TOL_BF16)


@pytest.mark.parametrize("frozen", ["fc1", "fc2", "input"])
@pytest.mark.parametrize("build_kind", ["plain", "forced", "fp8_forced"])
def test_frozen_parts(group, frozen, build_kind):
    """LayerNormMLP's one autograd node with a frozen layer or an input without gradient:
    the same gradients (and the same missing ones) as the reference build."""
    fp8_on = build_kind == "fp8_forced"
    r = fp8.recipe_from_name("delayed") if fp8_on else None
    ref = build(group, False, fp8_on=fp8_on, recipe=r)
    ovl = build(group, True, fp8_on=fp8_on, recipe=r, force=build_kind != "plain")
    for m in (ref, ovl):
        if frozen != "input":
            for p in getattr(m, frozen).parameters():
                p.requires_grad_(False)
    x, g = inputs(7)

    def go(m):
        xi = x.detach().clone().requires_grad_(frozen != "input")
        for p in m.parameters():
            p.grad = None
        y = m(xi)
        y.backward(g.to(y.dtype))
        torch.cuda.synchronize()
        return [y.detach()] + [None if t.grad is None else t.grad.float() for t in [xi] + list(m.parameters())]

    a, b = go(ovl), go(ref)
    tol = TOL_FP8_SAME if fp8_on else TOL_BF16
    for n, u, v in zip(names(ovl), a, b):
        assert (u is None) == (v is None), f"{frozen} {build_kind}: {n} is None in one build only"
        if u is not None and v.abs().max() > 0:
            assert rel(u, v) < tol, f"{frozen} {build_kind}: {n} rel {rel(u, v):.3g}"
    assert (a[1] is None) == (frozen == "input")
    assert all(t is None for t, (n, _) in zip(a[2:], ovl.named_parameters()) if n.startswith(frozen))


# ------------------------------------------------------------------- FP8


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("force", [False, True], ids=["plain", "forced"])
@pytest.mark.parametrize("flags", ["te_default", "rs_dgrad"])
def test_fp8_overlap_vs_reference(group, recipe, force, flags):
    if not force and flags != "te_default":
        pytest.skip("the plain tp-1 path ignores the flags")
    r = fp8.recipe_from_name(recipe)
    ref = build(group, False, fp8_on=True, recipe=r)
    ovl = build(group, True, fp8_on=True, recipe=r, force=force, flags=flags)
    for it in range(3):  # delayed scaling: both builds' histories advance alike
        x, g = inputs(it)
        check(f"fp8 {recipe} flags={flags} forced={force} iter={it}", ovl, run(ovl, x, g), run(ref, x, g),
              TOL_FP8_SAME)
    for role in ("input", "weight", "grad_output"):
        for sub in ("fc1", "fc2"):
            a, b = getattr(ovl, sub).fp8_meta[role].scale, getattr(ref, sub).fp8_meta[role].scale
            assert rel(a, b) < 1e-6, (sub, role, a, b)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("force", [False, True], ids=["plain", "forced"])
def test_fp8_gradients_vs_float(group, recipe, force):
    ref = build(group, False, dtype=torch.float32)
    f8m = build(group, True, fp8_on=True, recipe=fp8.recipe_from_name(recipe), force=force)
    x, g = inputs(7)
    run(f8m, x, g)  # a first step: delayed scaling then has a history
    got = run(f8m, x, g)
    want = run(ref, x.float(), g.float())
    errs = {n: rel(a, b) for n, a, b in zip(names(ref), got, want) if b.abs().max() > 0}
    assert errs["out"] < FP8_OUT_TOL and max(errs.values()) < FP8_GRAD_TOL, errs
    # Really FP8: not the bf16 numbers.
    bf = run(build(group, True), x, g)
    assert rel(got[1], bf[1]) > 1e-3


def test_fp8_is_first_microbatch(group):
    m = build(group, True, fp8_on=True, force=True)
    x, g = inputs(8)
    a = run(m, x, g, is_first_microbatch=True)
    c1 = m.fc1._f8.cached_weight
    b = run(m, x, g, is_first_microbatch=False)
    assert m.fc1._f8.cached_weight is c1
    assert torch.equal(a[1], b[1]) or rel(b[1], a[1]) < TOL_FP8_SAME  # input scales advanced (delayed)


# ------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("force", [False, True], ids=["plain", "forced"])
def test_fp8_cuda_graph_matches_eager(group, recipe, force):
    """make_graphed_callables on an fp8=True LayerNormMLP: replays match the eager module
    step for step (same state: both start from reset FP8 metas)."""
    r = fp8.recipe_from_name(recipe)
    eager = build(group, True, fp8_on=True, recipe=r, force=force)
    graphed_mod = build(group, True, fp8_on=True, recipe=r, force=force)  # same seed: same weights
    x0, g0 = inputs(9)
    run(eager, x0, g0)  # first eager calls: contexts and userbuffers created (not allowed in capture)
    sample = x0.detach().clone().requires_grad_(True)
    # Collect garbage before capturing, as training loops do: torch (2.11) no longer does it
    # when a capture begins, and a collection during the capture may free objects whose
    # release is not capturable (garbage of the tests before this one: seen under
    # scripts/torch-gpu.sh after test_modules.py, 2026-11-26).
    gc.collect()
    graphed = torch.cuda.make_graphed_callables(graphed_mod, (sample,))

    def reset(m):
        for sub in (m.fc1, m.fc2):
            for meta in sub.fp8_meta.values():
                meta.scale.fill_(1.0)
                if meta.amax_history is not None:
                    meta.amax_history.zero_()

    reset(eager)
    reset(graphed_mod)
    torch.cuda.synchronize()
    replays_match(eager, graphed, graphed_mod, f"graph {recipe} forced={force}")


def replays_match(eager, graphed, graphed_mod, what, steps=4):
    """``steps`` fresh batches: the graphed callable's output and gradients (its module's
    parameters) match the eager module's within 1e-3."""
    for it in range(steps):
        x, g = inputs(10 + it)
        e = run(eager, x, g)
        xs = x.detach().clone().requires_grad_(True)
        for p in graphed_mod.parameters():
            p.grad = None
        y = graphed(xs)
        y.backward(g)
        torch.cuda.synchronize()
        gr = [y.detach().float(), xs.grad.float()] + [p.grad.float() for p in graphed_mod.parameters()]
        check(f"{what} step {it}", eager, gr, e, 1e-3)


@pytest.mark.parametrize("force", [False, True], ids=["plain", "forced"])
def test_fp8_delayed_capture_keeps_primed_states(group, force):
    """Delayed scaling as a training loop graphs it: one eager step on real data primes
    every role (its first cast takes the scale from the tensor), then
    make_graphed_callables inside fp8.keep_delayed_states. Its warm-up passes (uninitialised
    gradients) change the histories; on exit every state is the primed one again, equal
    to the eager module's, and the replays match the eager steps from the first one on,
    with no reset."""
    r = fp8.recipe_from_name("delayed")
    eager = build(group, True, fp8_on=True, recipe=r, force=force)
    graphed_mod = build(group, True, fp8_on=True, recipe=r, force=force)
    x0, g0 = inputs(9)
    run(eager, x0, g0)
    run(graphed_mod, x0, g0)
    for p in graphed_mod.parameters():
        p.grad = None
    sample = x0.detach().clone().requires_grad_(True)
    gc.collect()
    with fp8.keep_delayed_states(graphed_mod) as states:
        before = [(s.scale.clone(), s.amax_history.clone()) for s in states]
        graphed = torch.cuda.make_graphed_callables(graphed_mod, (sample,))
        torch.cuda.synchronize()
        changed = sum(not torch.equal(h, s.amax_history) for (_, h), s in zip(before, states))
    assert len(states) == 6, f"{len(states)} delayed states (fc1 and fc2: input, weight, grad_output)"
    assert changed > 0, "the capture's warm-up changed no amax history: nothing for keep_delayed_states to undo"
    for a, b in zip(fp8.delayed_states(graphed_mod), fp8.delayed_states(eager)):
        assert a.primed and b.primed
        assert torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history), (
            f"state not restored: scale {a.scale.item()} vs {b.scale.item()}")
    replays_match(eager, graphed, graphed_mod, f"graph delayed (primed, kept) forced={force}")
