"""transformer_engine_comm.torch.optim.LeanFusedAdam on one GPU: bit-identical parameters
and states to torch.optim.Adam(fused=True) over several steps (bf16 and fp32 parameters,
mixed dtypes in one group, two groups, amsgrad, weight decay, AdamW, an LR scheduler), the
lean path taken where it applies and torch's step where it must (a parameter without a
gradient, a hook, a closure, the profiler, a capture), state_dict round trips, zero_grad.
Runs standalone (no process group needed)."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch, "cuda"):
    pytest.skip("torch is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from transformer_engine_comm.torch import optim as O  # noqa: E402

DEV = "cuda"
SHAPES = [(64, 32), (32,), (128, 64), (7,)]


def params(dtypes, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, d)) for s, d in zip(SHAPES, dtypes)]


def clone(ps):
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


def set_grads(a, b, step, skip=()):
    g = torch.Generator(device="cpu").manual_seed(100 + step)
    for i, (p, q) in enumerate(zip(a, b)):
        if i in skip:
            p.grad = q.grad = None
            continue
        v = torch.randn(p.shape, generator=g).to(DEV, p.dtype)
        p.grad, q.grad = v.clone(), v.clone()


def same(opt_a, opt_b, a, b):
    for p, q in zip(a, b):
        assert torch.equal(p, q), "parameters differ"
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"state {k} differs"


class Counting:
    """Counts torch's step calls made by LeanFusedAdam (its fallbacks)."""

    def __init__(self, monkeypatch):
        self.n = 0
        inner = O._TORCH_STEP

        def counted(*a, **k):
            self.n += 1
            return inner(*a, **k)

        monkeypatch.setattr(O, "_TORCH_STEP", counted)


@pytest.mark.parametrize("dtypes", [[torch.bfloat16] * 4, [torch.float32] * 4,
                                    [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]])
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1}, {"amsgrad": True, "betas": (0.8, 0.95)},
                                {"weight_decay": 0.05, "decoupled_weight_decay": True}])
def test_bit_identical(dtypes, kw, monkeypatch):
    a = params(dtypes)
    b = clone(a)
    lean = O.LeanFusedAdam(a, lr=1e-2, **kw)
    ref = torch.optim.Adam(b, lr=1e-2, fused=True, **kw)
    c = Counting(monkeypatch)
    for step in range(6):
        set_grads(a, b, step)
        lean.step()
        ref.step()
        same(lean, ref, a, b)
    assert c.n == 1, "only the first step (state initialisation) takes torch's path"


def test_groups_and_scheduler(monkeypatch):
    a = params([torch.bfloat16] * 4)
    b = clone(a)
    lean = O.LeanFusedAdam([{"params": a[:2]}, {"params": a[2:], "lr": 3e-3, "eps": 1e-6}], lr=1e-2)
    ref = torch.optim.Adam([{"params": b[:2]}, {"params": b[2:], "lr": 3e-3, "eps": 1e-6}], lr=1e-2, fused=True)
    s1 = torch.optim.lr_scheduler.StepLR(lean, step_size=2, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    c = Counting(monkeypatch)
    for step in range(6):
        set_grads(a, b, step)
        lean.step()
        ref.step()
        s1.step()
        s2.step()
        same(lean, ref, a, b)
    assert lean.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < 1e-2
    assert c.n == 1


def test_fallbacks(monkeypatch):
    a = params([torch.bfloat16] * 4)
    b = clone(a)
    lean = O.LeanFusedAdam(a, lr=1e-2)
    ref = torch.optim.Adam(b, lr=1e-2, fused=True)
    c = Counting(monkeypatch)
    step = 0

    def both(skip=(), **kw):
        nonlocal step
        set_grads(a, b, step, skip)
        step += 1
        out = lean.step(**kw)
        ref.step(**kw)
        same(lean, ref, a, b)
        return out

    both()
    assert c.n == 1  # the first step initialises the state through torch's path
    both(skip=(1,))  # a parameter without its gradient: torch's step skips it
    assert c.n == 2
    both()
    assert c.n == 2  # lean again
    calls = []
    h = lean.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    both()
    assert c.n == 3 and calls == [1]  # a hook: torch's step, the hook called
    h.remove()
    assert both(closure=lambda: torch.tensor(2.0)) == torch.tensor(2.0)
    assert c.n == 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        both()
    assert c.n == 5
    both()
    assert c.n == 5
    lean.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=DEV))]})
    lean.param_groups[-1]["params"][0].grad = torch.ones(3, device=DEV)
    ref.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=DEV))]})
    ref.param_groups[-1]["params"][0].grad = torch.ones(3, device=DEV)
    both()  # the new group has no state yet: torch's step
    assert c.n == 6
    assert torch.equal(lean.param_groups[-1]["params"][0], ref.param_groups[-1]["params"][0])
    lean.param_groups[-1]["params"][0].grad = torch.ones(3, device=DEV)
    ref.param_groups[-1]["params"][0].grad = torch.ones(3, device=DEV)
    both()
    assert c.n == 6  # lean, the new group included
    assert torch.equal(lean.param_groups[-1]["params"][0], ref.param_groups[-1]["params"][0])


def test_state_dict_round_trip(monkeypatch):
    a = params([torch.float32] * 4)
    b = clone(a)
    lean = O.LeanFusedAdam(a, lr=1e-2)
    ref = torch.optim.Adam(b, lr=1e-2, fused=True)
    for step in range(3):
        set_grads(a, b, step)
        lean.step()
        ref.step()
    sd = lean.state_dict()
    assert sd["state"][0].keys() == ref.state_dict()["state"][0].keys()
    # A fresh optimizer loads the state (new state tensors): its lean lists are rebuilt.
    lean2 = O.LeanFusedAdam(a, lr=1e-2)
    set_grads(a, b, 10)
    lean2.step()  # initialises its own state (torch's path) ...
    lean2.load_state_dict(sd)  # ... then takes the saved one
    c = Counting(monkeypatch)
    for p, q in zip(a, b):
        p.data.copy_(q.data)
    for step in range(3, 6):
        set_grads(a, b, step)
        lean2.step()
        ref.step()
        same(lean2, ref, a, b)
    assert c.n == 0


def test_zero_grad_and_cpu():
    a = params([torch.bfloat16] * 4)
    lean = O.LeanFusedAdam(a, lr=1e-2)
    for p in a:
        p.grad = torch.ones_like(p)
    lean.zero_grad()
    assert all(p.grad is None for p in a)
    for p in a:
        p.grad = torch.ones_like(p)
    lean.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in a)
    # CPU parameters: torch's path throughout, results as torch's.
    x = [torch.nn.Parameter(torch.randn(5, 5))]
    y = [torch.nn.Parameter(x[0].detach().clone())]
    o1, o2 = O.LeanFusedAdam(x, lr=1e-2), torch.optim.Adam(y, lr=1e-2, fused=True)
    for _ in range(3):
        g = torch.randn(5, 5)
        x[0].grad, y[0].grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.equal(x[0], y[0])


def test_graph_capture_falls_back(monkeypatch):
    a = params([torch.float32] * 4)
    lean = O.LeanFusedAdam(a, lr=1e-2, capturable=True)
    for p in a:
        p.grad = torch.ones_like(p)
    lean.step()  # state
    c = Counting(monkeypatch)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lean.step()  # warm-up on the side stream (lean)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            lean.step()  # inside a capture: torch's step (capturable)
    torch.cuda.current_stream().wait_stream(s)
    assert c.n == 1
    before = [p.detach().clone() for p in a]
    g.replay()
    torch.cuda.synchronize()
    assert any(not torch.equal(p, q) for p, q in zip(a, before))


def test_changes_after_the_lists_were_made(monkeypatch):
    """A parameter swapped into a group, the state cleared, a tensor learning rate set
    later, a copy of the optimizer: the results stay torch's."""
    import copy

    a = params([torch.float32] * 4)
    b = clone(a)
    lean = O.LeanFusedAdam(a, lr=1e-2, fused=True)  # Adam's own arguments are taken
    ref = torch.optim.Adam(b, lr=1e-2, fused=True)
    c = Counting(monkeypatch)
    step = 0

    def both():
        nonlocal step
        set_grads(a, b, step)
        step += 1
        lean.step()
        ref.step()
        same(lean, ref, a, b)

    both()
    both()
    assert c.n == 1
    # A new parameter in place of an old one: updated from its first step on.
    a[1] = torch.nn.Parameter(torch.zeros(SHAPES[1], device=DEV))
    b[1] = torch.nn.Parameter(torch.zeros(SHAPES[1], device=DEV))
    lean.param_groups[0]["params"][1] = a[1]
    ref.param_groups[0]["params"][1] = b[1]
    both()  # its state is new: torch's step
    both()  # lean again, with it
    assert c.n == 2 and a[1].abs().sum() > 0
    # The state cleared: the moments start again, and the state holds them.
    lean.state.clear()
    ref.state.clear()
    both()
    both()
    assert c.n == 3 and len(lean.state) == 4
    # A tensor learning rate set after the lists were made: torch's step.
    lean.param_groups[0]["lr"] = torch.tensor(5e-3)
    ref.param_groups[0]["lr"] = torch.tensor(5e-3)
    both()
    assert c.n == 4
    lean.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 5e-3
    # A copy steps (its lists are made again) as the original would.
    twin = copy.deepcopy(lean)
    ta = [p for p in twin.param_groups[0]["params"]]
    set_grads(ta, b, step)
    twin.step()  # (the twin's own parameters; compared with ref's step below)
    ref.step()
    for p, q in zip(ta, b):
        assert torch.equal(p, q)


def test_frozen_parameter_falls_back_without_rebuilding(monkeypatch):
    """A parameter that never gets a gradient keeps every step on torch's path; the lists
    are not tried again each step meanwhile (only when the state or the groups change)."""
    a = params([torch.float32] * 4)
    lean = O.LeanFusedAdam(a, lr=1e-2)
    walked = []
    device_ok = O._lean_device

    def counted(p):
        walked.append(1)
        return device_ok(p)

    monkeypatch.setattr(O, "_lean_device", counted)
    c = Counting(monkeypatch)
    for _ in range(5):
        for i, p in enumerate(a):
            p.grad = None if i == 2 else torch.ones_like(p)
        lean.step()
    assert c.n == 5
    # Step 1: no state (no parameter looked at); step 2: parameters 0 and 1 looked at, 2
    # has no state; steps 3-5: the same state and groups, not tried again.
    assert len(walked) == 2
    assert a[2] not in lean.state and len(lean.state) == 3


def test_torch_step_keeps_its_grad_mode(monkeypatch):
    """The fallback is torch's step with its no-grad decorator, whether Adam.step is
    already wrapped in torch's hook wrapper (an Adam was built before this module loaded)
    or not yet."""
    import importlib

    adam_mod = importlib.import_module("torch.optim.adam")
    seen = []
    inner = adam_mod.adam

    def spy(*a, **k):
        seen.append(torch.is_grad_enabled())
        return inner(*a, **k)

    monkeypatch.setattr(adam_mod, "adam", spy)
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(2, device=DEV))], fused=True)  # hooks Adam.step
    hooked = torch.optim.Adam.step
    assert getattr(hooked, "hooked", False)
    try:
        for step_fn in (hooked, hooked.__wrapped__):  # hooked; as before any Adam was built
            monkeypatch.setattr(torch.optim.Adam, "step", step_fn)
            mod = importlib.reload(O)
            p = [torch.nn.Parameter(torch.randn(3, device=DEV))]
            opt = mod.LeanFusedAdam(p)
            p[0].grad = torch.randn(3, device=DEV)
            with torch.enable_grad():
                opt.step()  # the first step: torch's (state initialisation)
            assert seen == [False]
            seen.clear()
    finally:
        monkeypatch.setattr(torch.optim.Adam, "step", hooked)
        importlib.reload(O)
