"""transformer_engine_comm.torch.userbuffers on ONE GPU (a one-rank group): every method
through its prepared path (validated once per signature, then only contiguity, the open
object, the handles by pointer and the C call), repeated with new tensors of the same
signature, and the checks that must hold on every call.

Runs standalone (``python -m pytest python/tests/torch/test_userbuffers_tp1.py``: a one-rank
NCCL group is created here) and under torchrun (each rank on its own one-rank group)."""
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

from transformer_engine_comm.torch.userbuffers import CommOverlap  # noqa: E402

BF16 = torch.bfloat16
N, K, M = 256, 128, 192


@pytest.fixture(scope="module")
def group():
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


def rnd(seed, *shape):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(BF16)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_copy_into_buffer_and_views(group):
    with CommOverlap((N, K), BF16, group) as ub:
        for seed in (1, 2):  # the second call reuses the first's validation
            x = rnd(seed, N, K)
            ub.copy_into_buffer(x)
            torch.cuda.synchronize()
            assert torch.equal(ub.get_buffer(), x)
            y = rnd(seed + 10, N, K)
            ub.copy_into_buffer(y, local_chunk=True)  # tp 1: the chunk is the buffer
            torch.cuda.synchronize()
            assert torch.equal(ub.get_buffer(local_chunk=True), y)
        with pytest.raises(TypeError, match="dtype"):
            ub.copy_into_buffer(rnd(3, N, K).float())
        with pytest.raises(ValueError, match="elements"):
            ub.copy_into_buffer(rnd(3, N, K + 1))
        with pytest.raises(ValueError, match="contiguous"):
            ub.copy_into_buffer(rnd(3, K, N).t())  # same signature as a valid call, other strides
    with pytest.raises(RuntimeError, match="closed"):
        ub.copy_into_buffer(rnd(4, N, K))


@pytest.mark.parametrize("layout", ["TN", "NN"])
def test_split_overlap_ag_repeated(group, layout):
    transa = layout == "TN"
    with CommOverlap((N, K), BF16, group) as ub:
        for seed in (1, 2, 3):
            x = rnd(seed, N, K)
            w = rnd(seed + 100, M, K) if transa else rnd(seed + 100, K, M)
            out = torch.empty(N, M, dtype=BF16, device="cuda")
            xc = torch.empty(N, K, dtype=BF16, device="cuda")
            ub.split_overlap_ag(w, x, out, x_copy=xc, transa=transa)
            ref = x.float() @ (w.float().t() if transa else w.float())
            torch.cuda.synchronize()
            assert rel(out, ref) < 1e-2, (seed, rel(out, ref))
            assert torch.equal(xc, x)
        with pytest.raises(ValueError, match="contiguous"):
            ub.split_overlap_ag(w, x, torch.empty(M, N, dtype=BF16, device="cuda").t(), transa=transa)
        with pytest.raises(ValueError, match="agree on k"):
            ub.split_overlap_ag(rnd(5, M, K + 8), x, out)


def test_bulk_overlap_repeated(group):
    with CommOverlap((N, K), BF16, group) as ag, CommOverlap((N, K), BF16, group) as rs:
        for seed in (1, 2):
            x = rnd(seed, N, K)
            dy = rnd(seed + 1, N, M)
            w = rnd(seed + 2, M, K)
            ag.copy_into_buffer(x, local_chunk=True)
            dx = torch.empty(N, K, dtype=BF16, device="cuda")
            ag.bulk_overlap("ag", w, dy, dx, transa=False)  # dgrad NN beside the gather
            torch.cuda.synchronize()
            assert torch.equal(ag.get_buffer(), x)
            assert rel(dx, dy.float() @ w.float()) < 1e-2
            rs.copy_into_buffer(dx)
            dx_out = torch.empty(N, K, dtype=BF16, device="cuda")
            dw = torch.empty(M, K, dtype=BF16, device="cuda")
            rs.bulk_overlap("rs", x, dy, dw, rs_output=dx_out, transa=False, transb=True)  # wgrad NT
            torch.cuda.synchronize()
            assert torch.equal(dx_out, dx)
            assert rel(dw, dy.float().t() @ x.float()) < 1e-2
        with pytest.raises(ValueError, match="rs_output"):
            rs.bulk_overlap("rs", x, dy, dw, transa=False, transb=True)
        with pytest.raises(ValueError, match="comm_type"):
            rs.bulk_overlap("xx", x, dy, dw, transa=False, transb=True)
        with pytest.raises(ValueError, match="contiguous"):
            rs.bulk_overlap("rs", x, dy, torch.empty(K, M, dtype=BF16, device="cuda").t(), rs_output=dx_out,
                            transa=False, transb=True)


def test_closed_on_another_thread_during_a_capture(group):
    """An object closed on another thread (as its finalizer would, run by a garbage
    collector there) while this thread captures a CUDA graph in torch's default (global)
    capture mode: the capture stays valid and the graph replays (the library releases with
    that thread's capture mode relaxed)."""
    import threading

    ub = CommOverlap((N, K), BF16, group)
    x = rnd(1, N, K)
    ub.copy_into_buffer(x, local_chunk=True)  # an eager call: the object's streams and buffer in use
    out = torch.empty(N, M, dtype=BF16, device="cuda")
    ub.split_overlap_ag(rnd(2, M, K), x, out)
    torch.cuda.synchronize()
    a = rnd(3, N, K)
    errors = []

    def close():
        try:
            ub.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # capture_error_mode "global"
        b = a * 2
        t = threading.Thread(target=close)
        t.start()
        t.join()
    assert not errors, errors
    a.copy_(rnd(4, N, K))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(b, a * 2)
