"""Block-scaled FP8 (Float8BlockScaling) in transformer_engine_comm.torch.modules at tp > 1
(under torchrun, scripts/torch-gpu.sh): the overlap build against the reference build
(both run the block path: torch.distributed collectives in bf16 around the library's block
casts and GEMMs), and each rank's output and gradients against the unsharded layer's block
math (the torch emulation of the whole layer on the gathered tensors: with 128-aligned
shards a block of a shard is a block of the whole tensor, so they agree up to the GEMMs'
accumulation order). Skips itself outside torchrun with 2+ GPU ranks."""
import pytest

from _gpu import require_torchrun_gpus

torch, dist = require_torchrun_gpus()

import test_modules as M  # noqa: E402  (the module tests' helpers: shapes, shards, builds)
from transformer_engine_comm.torch import fp8 as tfp8  # noqa: E402

BLOCK = tfp8.Float8BlockScaling()
TOL_SAME = 3e-2  # overlap vs reference (same block operands)
TOL_EMU = 3e-2  # a rank's shard vs the unsharded block emulation


def _emulated_layer(x, w, b, g):
    """(y, dx, dw, db) of ``y = x W^T + b`` in block FP8 (x, dY 1D; W 2D), torch emulation."""
    q = tfp8.quantize_block
    xq = q(x, 1, rowwise=True, columnwise=True, reference=True)
    wq = q(w, 2, rowwise=True, columnwise=True, reference=True)
    gq = q(g, 1, rowwise=True, columnwise=True, reference=True)
    y = tfp8.block_gemm(xq.rowwise(), wq.rowwise(), torch.float32, reference=True) + b
    dx = tfp8.block_gemm(gq.rowwise(), wq.columnwise(), torch.float32, reference=True)
    dw = tfp8.block_gemm(gq.columnwise(), xq.columnwise(), torch.float32, reference=True)
    return y, dx, dw, g.sum(0)


@pytest.mark.parametrize("kind", ["col", "row"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
def test_block_linear_tp_vs_reference_and_emulation(tc, kind, sp):
    group = tc.group
    flags = M.COL_FLAGS["te_default"] if kind == "col" else M.ROW_FLAGS["rs_ag"]
    M.case(tc, kind, group, flags, fp8=True, recipe=BLOCK, sp=sp, iters=2)
    full = M.full_params(tc, kind, 5)
    ovl = M.build(tc, kind, group, True, flags, fp8=True, recipe=BLOCK, sp=sp)
    M.load(ovl, kind, full, group)
    xs, gs = M.io_shapes(kind)
    x = tc.gen(xs, 105, -2.0, 2.0).to(torch.bfloat16)
    g = tc.gen(gs, 205).to(torch.bfloat16)
    xl, gl = M.local_io(kind, x, g.float(), group, sp)
    y, dx, grads = M.run(ovl, xl, gl)
    fy, fdx, fdw, fdb = _emulated_layer(x.reshape(-1, xs[-1]), full["weight"].to(torch.bfloat16), full["bias"],
                                        g.reshape(-1, gs[-1]))
    fy, fdx = fy.reshape(*xs[:-1], gs[-1]), fdx.reshape(xs)
    errs = {
        "out": tc.rel_err(y, M.local_out(kind, fy, group, sp)),
        "dx": tc.rel_err(dx, M.local_dx(kind, fdx, group, sp)),
        "dweight": tc.rel_err(grads["weight"], M.shard_of(kind, "weight", fdw, group)),
        "dbias": tc.rel_err(grads["bias"], M.shard_of(kind, "bias", fdb, group)),
    }
    bad = {k: v for k, v in errs.items() if not v < TOL_EMU}
    tc.check_all(not bad, f"block {kind} sp={sp} vs the unsharded block emulation: {bad} (all {errs})")


def test_block_mlp_tp_vs_reference(tc):
    M.case(tc, "mlp", tc.group, M.MLP_FLAGS["te_default"], fp8=True, recipe=BLOCK, iters=3)
