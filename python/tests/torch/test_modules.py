"""transformer_engine_comm.torch.modules (ColumnParallelLinear, RowParallelLinear,
LayerNormMLP) on GPUs: the overlap build (comm-GEMM ops + userbuffers) against the
reference build (comm_overlap=False: torch.distributed NCCL collectives + torch matmuls,
autograd backward), same parameters, same inputs, same upstream gradient: the outputs, the
input gradient and every parameter gradient must agree within bf16 (FP8: e4m3) tolerance
(relative error ||a - b|| / ||b||). The reference build is itself checked against a float32
single-GPU computation of the whole (unsharded) layer. Groups: the world (tp = world) and,
on 4+ ranks, tp-2 subgroups (consecutive and strided ranks).

Every rank generates the global tensors from one seed and takes its shard; all checks are
agreed on across the ranks (conftest.check_all). Run by scripts/torch-gpu.sh under
torchrun (skips itself elsewhere)."""


import pytest

from _gpu import require_torchrun_gpus

torch, dist = require_torchrun_gpus()

import torch.nn.functional as F  # noqa: E402

from transformer_engine_comm.torch import fp8 as tfp8  # noqa: E402
from transformer_engine_comm.torch import modules as tm  # noqa: E402


def fp8_recipe(name):
    return tfp8.recipe_from_name(name)

BF16 = torch.bfloat16
# (seq, batch, hidden, ffn): tokens = seq * batch, sharded over tp along seq.
S, B, H, FFN = 128, 2, 256, 1024
TOL = 2e-2  # overlap vs reference, bf16
TOL_FP8 = 4e-2  # overlap vs reference, FP8 GEMMs (same quantized operands; accumulation may differ)
TOL_FULL = 3e-2  # reference (bf16) vs the float32 single-GPU layer

COL_FLAGS = {
    # TE's defaults: AG+GEMM forward; bulk AG beside dgrad, bulk RS beside wgrad.
    "te_default": dict(ub_overlap_ag=True, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True, ub_bulk_wgrad=True),
    "rs_dgrad": dict(ub_overlap_ag=True, ub_overlap_rs_dgrad=True, ub_bulk_dgrad=False, ub_bulk_wgrad=False),
    "bulk_only": dict(ub_overlap_ag=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True, ub_bulk_wgrad=True),
    "none": dict(ub_overlap_ag=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False, ub_bulk_wgrad=False),
}
ROW_FLAGS = {
    "rs_ag": dict(ub_overlap_rs=True, ub_overlap_ag=True),
    "rs_only": dict(ub_overlap_rs=True, ub_overlap_ag=False),
    "ag_only": dict(ub_overlap_rs=False, ub_overlap_ag=True),
}
MLP_FLAGS = {
    "te_default": dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=False,
                       ub_bulk_dgrad=True, ub_bulk_wgrad=True),
    "rs_dgrad": dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True,
                     ub_bulk_dgrad=False, ub_bulk_wgrad=False),
    "bulk_only": dict(ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                      ub_bulk_dgrad=True, ub_bulk_wgrad=True),
}


# ----------------------------------------------------------------------------- helpers


def pick_group(tc, subgroups, layout):
    if layout == "world":
        return tc.group
    if subgroups is None:
        pytest.skip("needs a world of 4 or more ranks (an even number) for tp-2 subgroups")
    return subgroups[0] if layout == "tp2" else subgroups[1]


def shard(t, dim, group):
    return t.chunk(group.size(), dim)[group.rank()].contiguous()


def full_params(tc, kind, seed, bias=True):
    """Global parameters of one layer (identical on every rank): bf16 values held in
    float32, so that the float32 reference starts from exactly the modules' values."""
    p = {}
    if kind == "col":
        p["weight"] = tc.gen((FFN, H), seed, -0.08, 0.08)
        if bias:
            p["bias"] = tc.gen((FFN,), seed + 1, -0.5, 0.5)
    elif kind == "row":
        p["weight"] = tc.gen((H, FFN), seed, -0.05, 0.05)
        if bias:
            p["bias"] = tc.gen((H,), seed + 1, -0.5, 0.5)
    else:
        p["layer_norm_weight"] = tc.gen((H,), seed + 2, 0.5, 1.5)
        p["layer_norm_bias"] = tc.gen((H,), seed + 3, -0.2, 0.2)
        p["fc1.weight"] = tc.gen((FFN, H), seed, -0.08, 0.08)
        p["fc2.weight"] = tc.gen((H, FFN), seed + 4, -0.05, 0.05)
        if bias:
            p["fc1.bias"] = tc.gen((FFN,), seed + 1, -0.5, 0.5)
            p["fc2.bias"] = tc.gen((H,), seed + 5, -0.5, 0.5)
    return {n: t.to(BF16).float() for n, t in p.items()}


def shard_of(kind, name, t, group):
    """This rank's shard of the global parameter (or gradient) ``name``."""
    if kind == "col" or name.startswith("fc1."):
        return shard(t, 0, group)
    if (kind == "row" and name == "weight") or name == "fc2.weight":
        return shard(t, 1, group)
    return t  # replicated: row bias, fc2 bias, LayerNorm


def build(tc, kind, group, overlap, flags, *, fp8=False, bias=True, sp=True, seed=1, recipe=None):
    kw = dict(tp_group=group, comm_overlap=overlap, fp8=fp8, sequence_parallel=sp, params_dtype=BF16,
              device=tc.device, seed=seed, fp8_recipe=recipe)
    if kind == "col":
        return tm.ColumnParallelLinear(H, FFN, bias, **kw, **flags)
    if kind == "row":
        return tm.RowParallelLinear(FFN, H, bias, **kw, **flags)
    return tm.LayerNormMLP(H, FFN, bias=bias, **kw, **flags)


def load(model, kind, full, group):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_of(kind, name, full[name], group))


def full_layer(kind, full, x, sp=True):
    """float32 single-GPU forward of the unsharded layer."""
    if kind == "col":
        return F.linear(x, full["weight"], full.get("bias"))
    if kind == "row":
        return F.linear(x, full["weight"], full.get("bias"))
    ln = F.layer_norm(x, (H,), full["layer_norm_weight"], full["layer_norm_bias"], 1e-5)
    h = F.gelu(F.linear(ln, full["fc1.weight"], full.get("fc1.bias")), approximate="tanh")
    return F.linear(h, full["fc2.weight"], full.get("fc2.bias"))


def io_shapes(kind):
    """(input, output) global shapes."""
    if kind == "col":
        return (S, B, H), (S, B, FFN)
    if kind == "row":
        return (S, B, FFN), (S, B, H)
    return (S, B, H), (S, B, H)


def local_io(kind, x, g, group, sp=True):
    """This rank's input and upstream gradient from the global ones."""
    if kind == "col":
        return (shard(x, 0, group) if sp else x), shard(g, 2, group)
    if kind == "row":
        return shard(x, 2, group), (shard(g, 0, group) if sp else g)
    return (shard(x, 0, group) if sp else x), (shard(g, 0, group) if sp else g)


def local_out(kind, y, group, sp=True):
    """This rank's part of the global output."""
    if kind == "col":
        return shard(y, 2, group)
    return shard(y, 0, group) if sp else y


def local_dx(kind, dx, group, sp=True):
    if kind == "row":
        return shard(dx, 2, group)
    return shard(dx, 0, group) if sp else dx


def run(model, x, g, x_grad=True):
    x = x.detach().clone().requires_grad_(x_grad)
    for p in model.parameters():
        p.grad = None
    y = model(x)
    y.backward(g.to(y.dtype))
    if y.is_cuda:
        torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return y.detach(), (x.grad.detach().clone() if x_grad else None), grads


def compare(tc, what, kind, group, ovl, ref, tol, full=None, full_tol=None, sp=True):
    """Agree across ranks that overlap ~ reference (and reference ~ float32 full layer)."""
    (yo, dxo, go), (yr, dxr, gr) = ovl, ref
    errs, msgs = {}, []
    if tuple(yo.shape) != tuple(yr.shape):
        msgs.append(f"output shape {tuple(yo.shape)} != reference {tuple(yr.shape)}")
    else:
        errs["out"] = tc.rel_err(yo, yr)
    if dxr is not None:
        if dxo is None or tuple(dxo.shape) != tuple(dxr.shape):
            msgs.append(f"dgrad shape {None if dxo is None else tuple(dxo.shape)} != {tuple(dxr.shape)}")
        else:
            errs["dx"] = tc.rel_err(dxo, dxr)
    for n in gr:
        if n not in go or go[n].shape != gr[n].shape:
            msgs.append(f"grad {n}: missing or wrong shape")
        else:
            errs["d" + n] = tc.rel_err(go[n], gr[n])
    bad = {k: v for k, v in errs.items() if not v < tol}
    if full is not None:
        yf, dxf, gf = full
        ferrs = {"out": tc.rel_err(yr, local_out(kind, yf, group, sp))}
        if dxr is not None:
            ferrs["dx"] = tc.rel_err(dxr, local_dx(kind, dxf, group, sp))
        for n in gr:
            ferrs["d" + n] = tc.rel_err(gr[n], shard_of(kind, n, gf[n], group))
        bad.update({f"ref/f32 {k}": v for k, v in ferrs.items() if not v < full_tol})
    ok = not bad and not msgs
    detail = "; ".join(msgs + [f"{k}={v:.3g}" for k, v in bad.items()])
    worst = max(errs.values()) if errs else float("nan")
    tc.check_all(ok, f"{what}: {detail} (tol {tol:g}; worst overlap/ref {worst:.3g})")


def case(tc, kind, group, flags, *, fp8=False, bias=True, sp=True, seed=5, iters=1, x_grad=True, check_full=True,
         recipe=None):
    full = full_params(tc, kind, seed, bias)
    ref = build(tc, kind, group, False, flags, fp8=fp8, bias=bias, sp=sp, recipe=recipe)
    ovl = build(tc, kind, group, True, flags, fp8=fp8, bias=bias, sp=sp, recipe=recipe)
    load(ref, kind, full, group)
    load(ovl, kind, full, group)
    xs, gs = io_shapes(kind)
    for it in range(iters):
        # Fresh inputs every iteration: a stale buffer from the previous call would show.
        x = tc.gen(xs, seed + 100 + it, -2.0, 2.0).to(BF16)
        g = tc.gen(gs, seed + 200 + it).to(BF16).float()
        xl, gl = local_io(kind, x, g, group, sp)
        r = run(ref, xl, gl, x_grad)
        o = run(ovl, xl, gl, x_grad)
        f = None
        if check_full and not fp8:
            fp = {n: t.clone().requires_grad_(True) for n, t in full.items()}
            xf = x.float().requires_grad_(x_grad)
            yf = full_layer(kind, fp, xf, sp)
            yf.backward(g)
            f = (yf.detach(), xf.grad if x_grad else None, {n: t.grad for n, t in fp.items()})
        what = f"{kind} tp={group.size()} flags={flags} fp8={fp8} {recipe} bias={bias} sp={sp} iter={it}"
        compare(tc, what, kind, group, o, r, TOL_FP8 if fp8 else TOL, f, TOL_FULL, sp)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", ["world", "tp2"])
@pytest.mark.parametrize("flags", list(COL_FLAGS), ids=list(COL_FLAGS))
def test_column_parallel(tc, subgroups, layout, flags):
    group = pick_group(tc, subgroups, layout)
    case(tc, "col", group, COL_FLAGS[flags])


@pytest.mark.parametrize("layout", ["world", "tp2"])
@pytest.mark.parametrize("flags", list(ROW_FLAGS), ids=list(ROW_FLAGS))
def test_row_parallel(tc, subgroups, layout, flags):
    group = pick_group(tc, subgroups, layout)
    case(tc, "row", group, ROW_FLAGS[flags])


@pytest.mark.parametrize("layout", ["world", "tp2", "strided"])
@pytest.mark.parametrize("flags", list(MLP_FLAGS), ids=list(MLP_FLAGS))
def test_layernorm_mlp(tc, subgroups, layout, flags):
    if layout == "strided" and flags != "te_default":
        pytest.skip("strided groups: TE's default flags only")
    group = pick_group(tc, subgroups, layout)
    # Three iterations with fresh inputs through the same modules (cached buffers reused).
    case(tc, "mlp", group, MLP_FLAGS[flags], iters=3)


@pytest.mark.parametrize("kind", ["col", "row", "mlp"])
def test_no_bias(tc, kind):
    flags = {"col": COL_FLAGS["te_default"], "row": ROW_FLAGS["rs_ag"], "mlp": MLP_FLAGS["te_default"]}[kind]
    case(tc, kind, tc.group, flags, bias=False)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("layout", ["world", "tp2"])
@pytest.mark.parametrize("kind", ["col", "row", "mlp"])
def test_fp8(tc, subgroups, layout, kind, recipe):
    # Forward, dgrad and wgrad in FP8 in both builds; the FP8 all-gathers (x forward and
    # re-gathered, dY of the row layer) and the scales shared over the group. Three
    # iterations: delayed scaling's histories advance alike in both builds.
    group = pick_group(tc, subgroups, layout)
    flags = {"col": COL_FLAGS["te_default"], "row": ROW_FLAGS["rs_ag"], "mlp": MLP_FLAGS["te_default"]}[kind]
    case(tc, kind, group, flags, fp8=True, recipe=fp8_recipe(recipe), iters=3)


@pytest.mark.parametrize("flags", ["rs_dgrad", "bulk_only"])
def test_fp8_mlp_flags(tc, flags):
    case(tc, "mlp", tc.group, MLP_FLAGS[flags], fp8=True, recipe=fp8_recipe("current"), iters=2)


@pytest.mark.parametrize("kind", ["col", "row", "mlp"])
def test_fp8_no_sequence_parallel(tc, kind):
    flags = {"col": COL_FLAGS["rs_dgrad"], "row": ROW_FLAGS["rs_ag"], "mlp": MLP_FLAGS["te_default"]}[kind]
    case(tc, kind, tc.group, flags, fp8=True, sp=False)


@pytest.mark.parametrize("kind", ["col", "row", "mlp"])
def test_no_sequence_parallel(tc, kind):
    # Replicated tokens: no gathers; row forward = GEMM + all-reduce, column dgrad all-reduced.
    flags = {"col": COL_FLAGS["rs_dgrad"], "row": ROW_FLAGS["rs_ag"], "mlp": MLP_FLAGS["te_default"]}[kind]
    case(tc, kind, tc.group, flags, sp=False)


def test_column_input_without_grad(tc):
    # First layer of a model: no dgrad, the bulk overlap has no GEMM to hide behind.
    case(tc, "col", tc.group, COL_FLAGS["te_default"], x_grad=False)


def test_init_identical_across_builds(tc, subgroups):
    """Same seed -> the same parameters in both builds, equal to this rank's shard of the
    full matrix drawn on the CPU (so also independent of the TP size)."""
    groups = [tc.group] + ([subgroups[0]] if subgroups is not None else [])
    for group in groups:
        a = build(tc, "mlp", group, True, MLP_FLAGS["te_default"], seed=1234)
        b = build(tc, "mlp", group, False, MLP_FLAGS["te_default"], seed=1234)
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        same = all(torch.equal(pa[n], pb[n]) for n in pa)
        g = torch.Generator(device="cpu").manual_seed(1234)
        w1 = torch.empty(FFN, H).normal_(0.0, 0.02, generator=g)
        g = torch.Generator(device="cpu").manual_seed(1235)
        w2 = torch.empty(H, FFN).normal_(0.0, 0.02, generator=g)
        dev = pa["fc1.weight"].device
        exp1 = shard(w1, 0, group).to(dev, BF16)
        exp2 = shard(w2, 1, group).to(dev, BF16)
        shards_ok = torch.equal(pa["fc1.weight"], exp1) and torch.equal(pa["fc2.weight"], exp2)
        tc.check_all(same and shards_ok, f"tp={group.size()}: builds equal={same}, shards of the full init={shards_ok}")


def test_meta_device(tc):
    m = tm.LayerNormMLP(H, FFN, tp_group=tc.group, device="meta")
    assert m.fc1.weight.shape == (FFN // tc.size, H)
    assert m.fc2.weight.shape == (H, FFN // tc.size)
    assert m.fc2.bias.shape == (H,) and m.layer_norm_weight.shape == (H,)
