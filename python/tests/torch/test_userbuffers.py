"""transformer_engine_comm.torch.CommOverlap (userbuffers-style objects) against float32
torch references: split all-gather + GEMM, pipelined and ring GEMM + reduce-scatter, bulk
all-gather / reduce-scatter beside a GEMM; NCCL and callback bootstraps, tensor-parallel
groups smaller than the world, torch views of the registered buffer. Every algorithm runs
several calls back to back (no host synchronisation, one rank delayed in turn, fresh inputs
each call) and every call's output is checked. Run by scripts/torch-gpu.sh."""


import pytest

from _gpu import gelu_tanh_grad, require_torchrun_gpus

torch, dist = require_torchrun_gpus()

import torch.nn.functional as F  # noqa: E402

import transformer_engine_comm.torch as te  # noqa: E402

E4M3 = torch.float8_e4m3fn
ITERS = 8
M, K, COLS = 192, 256, 256


def rows_per_rank():
    return 128


def scalar(v, device):
    return torch.tensor([float(v)], dtype=torch.float32, device=device)


def tp_of(ub):
    return ub.tp_size, ub.tp_rank


def members(tc, ub):
    """World ranks of ub's tensor-parallel group, in tp-rank order (all_gather of world ranks)."""
    out = [None] * ub.group.size()
    dist.all_gather_object(out, tc.rank, group=ub.group)
    tp, r = tp_of(ub)
    me = ub.group.rank()
    first = me // tp * tp
    return out[first:first + tp]


def check_calls(tc, what, outs, refs, tol, exact=False):
    if exact:
        bad = [i for i, (o, r) in enumerate(zip(outs, refs)) if not torch.equal(o, r)]
        tc.check_all(not bad, f"{what}: calls {bad} differ from the reference (exact)")
        return
    errs = [tc.rel_err(o, r) for o, r in zip(outs, refs)]
    tc.check_all(all(e < tol for e in errs), f"{what}: rel_errs {[f'{e:.2g}' for e in errs]} (tol {tol:g})")


# ----------------------------------------------------------------------------- split AG


def run_split_ag(tc, group, *, dtype=torch.bfloat16, bootstrap="nccl", prefilled=False, epilogue=False,
                 fp8=False, tp_size=None, transport=None, seed=0):
    nc = rows_per_rank()
    ub = te.CommOverlap((nc * (tp_size or group.size()), K), E4M3 if fp8 else dtype, group,
                        tp_size=tp_size, bootstrap=bootstrap, transport=transport)
    try:
        tp, r = tp_of(ub)
        ranks = members(tc, ub)
        n = nc * tp
        od = torch.bfloat16 if fp8 else dtype
        outs, pres, refs, prerefs = [], [], [], []
        x_copy = torch.empty((n, K), dtype=ub.dtype, device=tc.device)
        for it in range(ITERS):
            s = seed + 1000 * it
            # Every member's rows (to build the reference); this rank's weight.
            xs = [tc.gen((nc, K), s + w) for w in ranks]
            w = tc.gen((M, K), s + 100 + tc.rank)
            b = tc.gen((M,), s + 200 + tc.rank).to(od)
            if fp8:
                xq = [(x * 2.0).to(E4M3) for x in xs]
                wq = (w * 4.0).to(E4M3)
                xsi, wsi = scalar(0.5, tc.device), scalar(0.25, tc.device)
                xd = torch.cat([q.float() * 0.5 for q in xq])
                wd = wq.float() * 0.25
            else:
                xq = [x.to(dtype) for x in xs]
                wq = w.to(dtype)
                xsi = wsi = None
                xd = torch.cat([q.float() for q in xq])
                wd = wq.float()
            ref = xd @ wd.T
            if epilogue:
                ref = ref + b.float()
            out = torch.full((n, M), float("nan"), dtype=od, device=tc.device)
            pre = torch.full((n, M), float("nan"), dtype=od, device=tc.device) if epilogue else None
            tc.skew(it)
            if prefilled:
                ub.copy_into_buffer(xq[r], local_chunk=True)
                ub.split_overlap_ag(wq, None, out, bias=b if epilogue else None, pre_gelu_out=pre,
                                    x_copy=x_copy, x_scale_inv=xsi, w_scale_inv=wsi)
            else:
                ub.split_overlap_ag(wq, xq[r], out, bias=b if epilogue else None, pre_gelu_out=pre,
                                    x_copy=x_copy, x_scale_inv=xsi, w_scale_inv=wsi)
            outs.append(out)
            refs.append(F.gelu(ref, approximate="tanh") if epilogue else ref)
            if epilogue:
                pres.append(pre)
                prerefs.append(ref)
        ub.synchronize()
        torch.cuda.synchronize()
        what = f"split_ag {ub.dtype} tp={tp} bootstrap={bootstrap} prefilled={prefilled} epilogue={epilogue}"
        tol = 5e-2 if fp8 else 1e-2
        check_calls(tc, what, outs, refs, tol)
        if epilogue:
            check_calls(tc, what + " pre_gelu_out", pres, prerefs, tol)
        gathered = torch.cat([q.view(torch.uint8) for q in xq])
        tc.check_all(torch.equal(x_copy.view(torch.uint8), gathered), what + ": x_copy is the gathered x of the last call")
    finally:
        ub.close()


@pytest.mark.parametrize("bootstrap", ["nccl", "callbacks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_ag(tc, dtype, bootstrap):
    run_split_ag(tc, tc.group, dtype=dtype, bootstrap=bootstrap, seed=1)


def test_split_ag_prefilled_buffer(tc):
    run_split_ag(tc, tc.group, prefilled=True, seed=2)


def test_split_ag_bias_gelu(tc):
    run_split_ag(tc, tc.group, epilogue=True, seed=3)


def test_split_ag_fp8(tc):
    run_split_ag(tc, tc.group, fp8=True, seed=4)


def test_split_ag_nccl_transport(tc):
    run_split_ag(tc, tc.group, transport="nccl", seed=5)


# ----------------------------------------------------------------------------- split RS


def run_split_rs(tc, group, *, p2p=False, dtype=torch.bfloat16, fp8_in=False, fp8_buffer=False,
                 bootstrap="nccl", tp_size=None, transport=None, seed=0, transa=True, transb=False):
    nc = rows_per_rank()
    tp_n = tp_size or group.size()
    n = nc * tp_n
    od = torch.bfloat16 if (fp8_in or fp8_buffer) else dtype
    ub = te.CommOverlap((n, M), E4M3 if fp8_buffer else od, group, tp_size=tp_size, bootstrap=bootstrap,
                        transport=transport)
    try:
        tp, r = tp_of(ub)
        ranks = members(tc, ub)
        kl = K // 2
        outs, refs = [], []
        bscale = scalar(8.0, tc.device) if fp8_buffer else None
        bsinv = scalar(1.0 / 8.0, tc.device) if fp8_buffer else None
        for it in range(ITERS):
            s = seed + 1000 * it
            total = torch.zeros((n, M), dtype=torch.float32, device=tc.device)
            mine = None
            for w_rank in ranks:  # every member's partial, for the reference
                x = tc.gen((n, kl), s + w_rank)
                w = tc.gen((M, kl), s + 100 + w_rank)
                if fp8_in:
                    xq, wq = (x * 2.0).to(E4M3), (w * 4.0).to(E4M3)
                    part = (xq.float() * 0.5) @ (wq.float() * 0.25).T
                else:
                    xq, wq = x.to(dtype), w.to(dtype)
                    part = xq.float() @ wq.float().T
                total += part
                if w_rank == tc.rank:
                    mine = (xq, wq)
            xsi, wsi = (scalar(0.5, tc.device), scalar(0.25, tc.device)) if fp8_in else (None, None)
            out = torch.full((nc, M), float("nan"), dtype=od, device=tc.device)
            tc.skew(it)
            fn = ub.split_overlap_rs_p2p if p2p else ub.split_overlap_rs
            wl = mine[1] if transa else mine[1].t().contiguous()  # NN / NT: weight [k_local, m]
            xl = mine[0].t().contiguous() if transb else mine[0]  # NT: x [k_local, n]
            fn(wl, xl, out, x_scale_inv=xsi, w_scale_inv=wsi, buffer_scale=bscale, buffer_scale_inv=bsinv,
               transa=transa, transb=transb)
            outs.append(out)
            refs.append(total[r * nc:(r + 1) * nc])
        ub.synchronize()
        torch.cuda.synchronize()
        what = (f"split_rs{'_p2p' if p2p else ''} in={'fp8' if fp8_in else dtype} buffer={ub.dtype} tp={tp} "
                f"bootstrap={bootstrap} transa={transa} transb={transb}")
        check_calls(tc, what, outs, refs, 8e-2 if fp8_buffer else 5e-2 if fp8_in else 1e-2)
    finally:
        ub.close()


@pytest.mark.parametrize("p2p", [False, True], ids=["pipelined", "p2p"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_rs(tc, p2p, dtype):
    run_split_rs(tc, tc.group, p2p=p2p, dtype=dtype, seed=11)


@pytest.mark.parametrize("p2p", [False, True], ids=["pipelined", "p2p"])
def test_split_rs_fp8_inputs(tc, p2p):
    run_split_rs(tc, tc.group, p2p=p2p, fp8_in=True, seed=12)


@pytest.mark.parametrize("p2p", [False, True], ids=["pipelined", "p2p"])
def test_split_rs_fp8_buffer(tc, p2p):
    run_split_rs(tc, tc.group, p2p=p2p, fp8_in=True, fp8_buffer=True, seed=13)


def test_split_rs_callbacks_nccl_transport(tc):
    run_split_rs(tc, tc.group, p2p=True, bootstrap="callbacks", transport="nccl", seed=14)


# ----------------------------------------------------------------------------- bulk


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("transport", [None, "nccl"], ids=["default", "nccl"])
def test_bulk(tc, kind, transport):
    nc = rows_per_rank()
    tp_all = tc.size
    n = nc * tp_all
    ub = te.CommOverlap((n, COLS), torch.bfloat16, tc.group, transport=transport)
    try:
        tp, r = tp_of(ub)
        ranks = members(tc, ub)
        got, want, gemm, gemm_ref = [], [], [], []
        ng = 320
        for it in range(ITERS):
            s = 50 + 1000 * it
            w = tc.gen((M, K), s + 300 + tc.rank).to(torch.bfloat16)
            x2 = tc.gen((ng, K), s + 400 + tc.rank).to(torch.bfloat16)
            out = torch.full((ng, M), float("nan"), dtype=torch.bfloat16, device=tc.device)
            tc.skew(it)
            if kind == "ag":
                chunks = [tc.gen((nc, COLS), s + q).to(torch.bfloat16) for q in ranks]
                ub.copy_into_buffer(chunks[r], local_chunk=True)
                ub.bulk_overlap("ag", w, x2, out)
                got.append(ub.get_buffer().clone())
                want.append(torch.cat(chunks))
            else:
                fulls = [tc.gen((n, COLS), s + q).to(torch.bfloat16) for q in ranks]
                ro = torch.full((nc, COLS), float("nan"), dtype=torch.bfloat16, device=tc.device)
                ub.copy_into_buffer(fulls[r], local_chunk=False)
                ub.bulk_overlap(te.CommOverlapType.RS, w, x2, out, rs_output=ro)
                got.append(ro)
                want.append(sum(f.float() for f in fulls)[r * nc:(r + 1) * nc])
            gemm.append(out)
            gemm_ref.append(x2.float() @ w.float().T)
        ub.synchronize()
        torch.cuda.synchronize()
        what = f"bulk_{kind} transport={transport}"
        check_calls(tc, what + " collective", got, want, 1e-2, exact=(kind == "ag"))
        check_calls(tc, what + " concurrent GEMM", gemm, gemm_ref, 1e-2)
    finally:
        ub.close()


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("transa,transb", [(False, False), (False, True)], ids=["NN", "NT"])
@pytest.mark.parametrize("p2p", [False, True], ids=["pipelined", "p2p"])
def test_split_rs_layouts(tc, p2p, transa, transb):
    run_split_rs(tc, tc.group, p2p=p2p, seed=8000, transa=transa, transb=transb)


@pytest.mark.parametrize("transa,transb", [(False, False), (False, True)], ids=["NN", "NT"])
def test_split_ag_layouts(tc, transa, transb):
    """AG(x) with weight [k, m] (NN) and x_local [k, n / tp] gathered along its columns (NT)."""
    nc = rows_per_rank()
    n = nc * tc.size
    ub = te.CommOverlap((n, K), torch.bfloat16, tc.group)
    try:
        tp, r = tp_of(ub)
        ranks = members(tc, ub)
        outs, refs = [], []
        for it in range(ITERS):
            s = 8100 + 1000 * it
            xs = [tc.gen((nc, K), s + q).to(torch.bfloat16) for q in ranks]
            w = tc.gen((M, K), s + 500 + tc.rank).to(torch.bfloat16)
            out = torch.full((n, M), float("nan"), dtype=torch.bfloat16, device=tc.device)
            tc.skew(it)
            xl = xs[r].t().contiguous() if transb else xs[r]
            wl = w if transa else w.t().contiguous()
            ub.split_overlap_ag(wl, xl, out, transa=transa, transb=transb)
            outs.append(out)
            refs.append(torch.cat(xs).float() @ w.float().T)
        ub.synchronize()
        torch.cuda.synchronize()
        check_calls(tc, f"split_ag transa={transa} transb={transb}", outs, refs, 1e-2)
        with pytest.raises(ValueError, match="needs x_local"):
            ub.split_overlap_ag(w.t().contiguous(), None, outs[0], transa=False, transb=True)
        with pytest.raises(ValueError, match="TT layout"):
            ub.split_overlap_ag(w, xs[r].t().contiguous(), outs[0], transa=True, transb=True)
    finally:
        ub.close()


def test_split_ag_dgelu(tc):
    """grad=True: the DGELU epilogue reads pre_gelu_out (TE's fc2 dgrad with GELU's backward
    fused, as LayerNormMLP runs it): out = (AG(dY) @ W) * gelu'(pre), NN, with x_copy."""
    nc = rows_per_rank()
    n = nc * tc.size
    ub = te.CommOverlap((n, K), torch.bfloat16, tc.group)
    try:
        tp, r = tp_of(ub)
        ranks = members(tc, ub)
        outs, refs = [], []
        x_copy = torch.empty((n, K), dtype=torch.bfloat16, device=tc.device)
        for it in range(ITERS):
            s = 8300 + 1000 * it
            dys = [tc.gen((nc, K), s + q).to(torch.bfloat16) for q in ranks]
            w = tc.gen((K, M), s + 500 + tc.rank).to(torch.bfloat16)  # [k, m]: NN
            pre = tc.gen((n, M), s + 600 + tc.rank).to(torch.bfloat16)
            out = torch.full((n, M), float("nan"), dtype=torch.bfloat16, device=tc.device)
            tc.skew(it)
            ub.split_overlap_ag(w, dys[r], out, x_copy=x_copy, transa=False, pre_gelu_out=pre, grad=True)
            outs.append(out)
            refs.append((torch.cat(dys).float() @ w.float()) * gelu_tanh_grad(pre))
        ub.synchronize()
        torch.cuda.synchronize()
        check_calls(tc, "split_ag DGELU (grad=True)", outs, refs, 1e-2)
        tc.check_all(torch.equal(x_copy, torch.cat(dys)), "split_ag DGELU: x_copy is the gathered dY")
        with pytest.raises(ValueError, match="reads pre_gelu_out"):
            ub.split_overlap_ag(w, dys[r], outs[0], transa=False, grad=True)
        with pytest.raises(ValueError, match="takes no bias"):
            ub.split_overlap_ag(w, dys[r], outs[0], transa=False, pre_gelu_out=pre, grad=True,
                                bias=torch.zeros(M, dtype=torch.bfloat16, device=tc.device))
    finally:
        ub.close()


@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_bulk_beside_wgrad_nt(tc, kind):
    """The modules' bulk wgrad overlap: the collective on the buffer beside dW = dY^T X,
    an NT GEMM (weight = X [tokens, k] with transa=False, x = dY [tokens, m] with
    transb=True, out dW [m, k]), then accumulated into (accumulate=True)."""
    nc = rows_per_rank()
    n = nc * tc.size
    ub = te.CommOverlap((n, COLS), torch.bfloat16, tc.group)
    try:
        tp, r = tp_of(ub)
        ranks = members(tc, ub)
        tokens = 320
        got, want, gemm, gemm_ref = [], [], [], []
        for it in range(ITERS):
            s = 8200 + 1000 * it
            X = tc.gen((tokens, K), s + 300 + tc.rank).to(torch.bfloat16)
            dY = tc.gen((tokens, M), s + 400 + tc.rank).to(torch.bfloat16)
            dW = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=tc.device)
            tc.skew(it)
            if kind == "ag":
                chunks = [tc.gen((nc, COLS), s + q).to(torch.bfloat16) for q in ranks]
                ub.copy_into_buffer(chunks[r], local_chunk=True)
                ub.bulk_overlap("ag", X, dY, dW, transa=False, transb=True)
                got.append(ub.get_buffer().clone())
                want.append(torch.cat(chunks))
            else:
                fulls = [tc.gen((n, COLS), s + q).to(torch.bfloat16) for q in ranks]
                ro = torch.full((nc, COLS), float("nan"), dtype=torch.bfloat16, device=tc.device)
                ub.copy_into_buffer(fulls[r], local_chunk=False)
                ub.bulk_overlap("rs", X, dY, dW, rs_output=ro, transa=False, transb=True)
                got.append(ro)
                want.append(sum(f.float() for f in fulls)[r * nc:(r + 1) * nc])
            ref = dY.float().T @ X.float()
            gemm.append(dW.clone())
            gemm_ref.append(ref)
            # gradient accumulation: dW += dY^T X (the next micro-batch's)
            if kind == "ag":
                ub.copy_into_buffer(chunks[r], local_chunk=True)
                ub.bulk_overlap("ag", X, dY, dW, transa=False, transb=True, accumulate=True)
            else:
                ub.copy_into_buffer(fulls[r], local_chunk=False)
                ub.bulk_overlap("rs", X, dY, dW, rs_output=ro, transa=False, transb=True, accumulate=True)
            gemm.append(dW)
            gemm_ref.append(2.0 * ref)
        ub.synchronize()
        torch.cuda.synchronize()
        check_calls(tc, f"bulk_{kind} beside NT wgrad: collective", got, want, 1e-2, exact=(kind == "ag"))
        check_calls(tc, f"bulk_{kind} beside NT wgrad: dW (then accumulated)", gemm, gemm_ref, 1e-2)
    finally:
        ub.close()


# ----------------------------------------------------------------------------- groups


@pytest.mark.parametrize("layout", ["consecutive", "strided", "tp_size"])
def test_subgroups(tc, subgroups, layout):
    if subgroups is None:
        pytest.skip("needs a world of 4 or more ranks (an even number) for tp-2 groups")
    if layout == "tp_size":  # the world group, split into consecutive tp-2 blocks by the library
        group, tp_size = tc.group, 2
    else:
        group, tp_size = (subgroups[0] if layout == "consecutive" else subgroups[1]), None
    run_split_ag(tc, group, tp_size=tp_size, seed=61)
    run_split_rs(tc, group, tp_size=tp_size, seed=62)
    run_split_rs(tc, group, p2p=True, tp_size=tp_size, bootstrap="callbacks", seed=63)


# ----------------------------------------------------------------------------- buffer views


def test_get_buffer_views(tc):
    nc = rows_per_rank()
    n = nc * tc.size
    with te.CommOverlap((n, K), torch.bfloat16, tc.group) as ub:
        whole, chunk = ub.get_buffer(), ub.get_buffer(local_chunk=True)
        assert whole.shape == (n, K) and whole.dtype == torch.bfloat16 and whole.device == tc.device
        assert chunk.shape == (nc, K) and chunk.data_ptr() == whole.data_ptr() + ub.tp_rank * nc * K * 2
        assert ub.get_buffer(shape=(n * K,)).shape == (n * K,)
        x = tc.gen((nc, K), 70 + tc.rank).to(torch.bfloat16)
        ub.copy_into_buffer(x, local_chunk=True)
        torch.cuda.synchronize()
        tc.check_all(torch.equal(chunk, x), "copy_into_buffer(local_chunk=True) lands in get_buffer(local_chunk=True)")
        # Written through the torch view, then gathered by the GEMM (TE's write-into-ubuf pattern).
        ub.synchronize()
        dist.barrier(device_ids=[tc.device.index])
        xs = [tc.gen((nc, K), 80 + q).to(torch.bfloat16) for q in range(tc.size)]
        chunk.copy_(xs[tc.rank])
        w = tc.gen((M, K), 90 + tc.rank).to(torch.bfloat16)
        out = torch.full((n, M), float("nan"), dtype=torch.bfloat16, device=tc.device)
        ub.split_overlap_ag(w, None, out)
        torch.cuda.synchronize()
        check_calls(tc, "split_ag on a buffer written through get_buffer()", [out],
                    [torch.cat(xs).float() @ w.float().T], 1e-2)
    with pytest.raises(RuntimeError, match="closed"):
        ub.get_buffer()


def test_errors_and_close(tc):
    nc = rows_per_rank()
    n = nc * tc.size
    ub = te.CommOverlap((n, K), torch.bfloat16, tc.group)
    w = torch.zeros((M, K), dtype=torch.bfloat16, device=tc.device)
    with pytest.raises(TypeError, match="dtype"):
        ub.copy_into_buffer(torch.zeros((nc, K), dtype=torch.float16, device=tc.device), local_chunk=True)
    with pytest.raises(ValueError, match="elements"):
        ub.copy_into_buffer(torch.zeros((nc + 1, K), dtype=torch.bfloat16, device=tc.device), local_chunk=True)
    with pytest.raises(ValueError, match="x_local=None"):
        ub.split_overlap_ag(w, None, torch.zeros((n + 8, M), dtype=torch.bfloat16, device=tc.device))
    with pytest.raises(ValueError, match="rs_output"):
        ub.bulk_overlap("rs", w, torch.zeros((8, K), dtype=torch.bfloat16, device=tc.device),
                        torch.zeros((8, M), dtype=torch.bfloat16, device=tc.device))
    with pytest.raises(ValueError, match="comm_type"):
        ub.bulk_overlap("allreduce", w, w, torch.zeros((M, M), dtype=torch.bfloat16, device=tc.device))
    with pytest.raises(ValueError, match="divisible"):
        te.CommOverlap((n + 1, K), torch.bfloat16, tc.group)
    ub8 = te.CommOverlap((n, M), E4M3, tc.group)
    with pytest.raises(ValueError, match="buffer_scale"):
        ub8.split_overlap_rs(w.to(E4M3), torch.zeros((n, K), dtype=E4M3, device=tc.device),
                             torch.zeros((nc, M), dtype=torch.bfloat16, device=tc.device),
                             x_scale_inv=scalar(1, tc.device), w_scale_inv=scalar(1, tc.device))
    ub.close()
    ub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ub.synchronize()
    te.destroy_userbuffers()  # closes ub8
    with pytest.raises(RuntimeError, match="closed"):
        ub8.get_buffer()
