"""Tensor-parallel autograd modules with communication/GEMM overlap (Transformer Engine-like).

Layout (Megatron/TE sequence parallelism): outside the tensor-parallel (TP) region the
tokens are sharded across the TP group along dim 0 (the sequence dimension of
``[seq, batch, hidden]`` inputs, or the rows of ``[tokens, hidden]``); inside it the
hidden dimension is sharded. Every module flattens its input to 2-D ``[tokens, features]``
(dim 0 outermost), so ``[s/tp, b, h]`` and ``[s/tp * b, h]`` behave the same.

- :class:`ColumnParallelLinear`  weight ``[out/tp, in]``:
  ``[n/tp, in] -> AG over tokens -> [n, in] @ W^T (+b) -> [n, out/tp]``
- :class:`RowParallelLinear`     weight ``[out, in/tp]``:
  ``[n, in/tp] @ W^T -> RS over tokens -> [n/tp, out] (+b, added once)``
- :class:`LayerNormMLP`          LayerNorm (replicated parameters) -> fc1 (column) + GELU ->
  fc2 (row).  ``[n/tp, h] -> [n/tp, h]``.

Two builds of every module (``comm_overlap``):

- ``comm_overlap=False`` -- the *reference*: plain ``torch.distributed`` collectives
  (NCCL, or any backend: it runs on CPU with gloo too) around ``torch`` matmuls, composed
  from small differentiable collectives so that autograd derives every gradient (no
  hand-written backward for the GEMMs). The ``ub_*`` flags are ignored.
- ``comm_overlap=True`` -- hand-written forward/backward that run each communication
  step its flag selects through this package: the comm-GEMM ops
  (:func:`transformer_engine_comm.torch.ops.all_gather_gemm`, ``gemm_reduce_scatter``,
  ``gemm_all_reduce``) or the userbuffers objects
  (:class:`transformer_engine_comm.torch.userbuffers.CommOverlap`); a step whose flag is
  off uses a synchronous ``torch.distributed`` collective and a torch matmul. The flags
  (TE's userbuffers flag names):

  ``ub_overlap_ag``        column forward: AG(x) + GEMM ring-overlapped (``ops.all_gather_gemm``,
                           fc1's bias + GELU fused in its epilogue); row backward: AG(dY) +
                           dgrad GEMM by the userbuffers ring (``CommOverlap.split_overlap_ag``,
                           which also hands back the gathered dY for the wgrad GEMM).
  ``ub_overlap_rs``        row forward: GEMM + RS(y) (``ops.gemm_reduce_scatter``, bias added
                           once; ``ops.gemm_all_reduce`` when ``sequence_parallel=False``).
  ``ub_overlap_rs_dgrad``  column backward: dgrad GEMM + RS(dX) fused (``ops.gemm_reduce_scatter``;
                           ``ops.gemm_all_reduce`` without SP). The re-gather of the input for
                           the wgrad GEMM then runs beside it as an async NCCL all-gather, and
                           the two bulk flags are ignored (as in TE).
  ``ub_bulk_dgrad``        column backward: the re-gather of the layer input (the wgrad GEMM
                           needs it) is a userbuffers *bulk all-gather*
                           (``CommOverlap.bulk_overlap("ag")``) running beside the dgrad GEMM;
                           the wgrad GEMM reads the gathered input from the buffer.
  ``ub_bulk_wgrad``        column backward: the reduce-scatter of the dgrad runs beside the
                           wgrad GEMM as an *asynchronous torch.distributed collective* (NCCL
                           runs it on its own stream while the current stream computes the
                           GEMM; ``Work.wait()`` joins them) -- not through a userbuffers bulk
                           object: the userbuffers GEMMs are TN-only and the wgrad GEMM
                           (dY^T @ X, contracting over the tokens) would need both
                           activations transposed first.

  The ops and userbuffers GEMMs take the weight as the TN operand (``y = x @ weight^T``); the
  GEMMs with the weight *not* transposed (dgrad ``dY @ W``: ``ub_overlap_rs_dgrad``,
  ``ub_bulk_dgrad``, the row-parallel ``ub_overlap_ag``) are given ``W^T`` as a contiguous
  copy, made in each backward pass (one copy of this rank's weight shard).
  Userbuffers objects are created on first use (collectively over the TP group), cached per
  (group, shape, dtype) and shared between modules; :func:`destroy_module_userbuffers`
  closes them.

Parameters are initialised from a CPU ``torch.Generator`` seeded with ``seed``: the
*full* (unsharded) matrix is drawn, and each rank keeps its shard, so the overlap and the
reference build -- and builds with different TP sizes -- start from the same global
weights given the same seed (weights ~ N(0, init_std), biases 0, LayerNorm gamma 1 / beta 0).

FP8 (``fp8=True``): the forward GEMMs quantize their inputs per tensor to
``float8_e4m3fn`` with the scale taken from the *current* amax (``scale = 448 / amax``,
no amax history: "delayed-scaling-like"; an input that is all-gathered before its GEMM
uses the amax of the whole gathered tensor, i.e. an all-reduce(MAX) of the local amaxes
over the TP group, so that every rank's shard has the same scale). The overlap build
passes the FP8 tensors and their ``scale_inv`` to the ops; the reference build runs
``torch._scaled_mm`` (CUDA; dequantized fp32 matmul elsewhere). Outputs stay in the
parameter dtype. The backward pass is *not* quantized: it runs in the parameter dtype on
the unquantized saved inputs and weights (a straight-through estimator of the FP8
forward), in both builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "LayerNormMLP",
    "destroy_module_userbuffers",
    "quantize_fp8",
    "tp_size_rank",
]

FP8_E4M3_MAX = 448.0
_GELU_APPROX = "tanh"  # cuBLASLt's GELU epilogue (and TE's "gelu") is the tanh approximation


# ============================================================================ helpers


def tp_size_rank(group=None) -> Tuple[int, int]:
    """(size, rank) of ``group`` (None = world); (1, 0) without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _ops():
    # Imported lazily: the reference build (and importing this module) needs neither the
    # compiled library nor CUDA.
    from . import ops

    return ops


_USERBUFFERS = {}


def _get_userbuffer(group, rows: int, cols: int, dtype: torch.dtype):
    """A userbuffers object (``CommOverlap``) with a ``[rows, cols]`` buffer over ``group``,
    cached per (group, shape, dtype, device) and shared by every module that needs that
    shape (their calls are ordered on the stream, and the library's arrival barrier keeps
    peers off a buffer until this rank has reached its next call). Created on first use:
    collective over the group (all its ranks reach the same backward steps in order)."""
    from ._context import group_name_of
    from .userbuffers import CommOverlap

    key = (group_name_of(group), int(rows), int(cols), dtype, torch.cuda.current_device())
    ub = _USERBUFFERS.get(key)
    if ub is None or getattr(ub, "_ov", None) is None:
        ub = CommOverlap((int(rows), int(cols)), dtype, group)
        _USERBUFFERS[key] = ub
    return ub


def destroy_module_userbuffers() -> None:
    """Close the userbuffers objects the modules created (also closed at exit by
    ``transformer_engine_comm.torch.destroy_userbuffers()``). Collective in effect: do it
    on every rank, after the last backward pass, before destroying the process groups."""
    objs = list(_USERBUFFERS.values())
    _USERBUFFERS.clear()
    if objs and torch.cuda.is_available():
        torch.cuda.synchronize()
    for ub in objs:
        ub.close()


def _flat(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"expected an input of at least 2 dimensions, got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1]).contiguous()


def _all_gather(x: torch.Tensor, group, async_op: bool = False):
    """AG along dim 0 -> (out, work or None). FP8 tensors travel as bytes."""
    ws = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((ws * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        work = dist.all_gather_into_tensor(
            out.view(torch.uint8), x.view(torch.uint8), group=group, async_op=async_op
        )
    else:
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    return out, work


def _reduce_scatter(x: torch.Tensor, group, async_op: bool = False):
    """Sum over ranks, this rank's block of dim 0 -> (out, work or None)."""
    ws = dist.get_world_size(group)
    if x.shape[0] % ws:
        raise ValueError(
            f"reduce-scatter over {ws} ranks needs dim 0 divisible by {ws}, got shape {tuple(x.shape)}"
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // ws,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = dist.reduce_scatter_tensor(out, x, group=group, async_op=async_op)
    return out, work


def _all_reduce(x: torch.Tensor, group, async_op: bool = False):
    x = x.contiguous()
    work = dist.all_reduce(x, group=group, async_op=async_op)
    return x, work


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _amax(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def quantize_fp8(t: torch.Tensor, group=None, reduce_amax: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor ``float8_e4m3fn`` quantization from the current amax.

    Returns ``(q, scale_inv)``: ``q = fp8(t * scale)`` with ``scale = 448 / amax`` (1 when
    amax is 0), ``scale_inv = 1 / scale`` a 0-dim float32 tensor on ``t``'s device. With
    ``reduce_amax``, amax is the maximum over the ranks of ``group`` (None = world; an
    all-reduce MAX), so shards that are gathered afterwards share one scale.
    """
    amax = _amax(t)
    if reduce_amax and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = torch.where(amax > 0, FP8_E4M3_MAX / amax, torch.ones_like(amax))
    q = (t.detach().float() * scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reciprocal()


def _fp8_mm(xq, x_si, wq, w_si, out_dtype) -> torch.Tensor:
    """``(xq * x_si) @ (wq * w_si)^T`` -> out_dtype. cuBLASLt FP8 GEMM (torch._scaled_mm)
    on CUDA when the sizes allow it (multiples of 16), else a dequantized fp32 matmul."""
    n, k = xq.shape
    m = wq.shape[0]
    if xq.is_cuda and n % 16 == 0 and k % 16 == 0 and m % 16 == 0:
        return torch._scaled_mm(
            xq,
            wq.t(),
            scale_a=x_si.reshape(()).float(),
            scale_b=w_si.reshape(()).float(),
            out_dtype=out_dtype,
            use_fast_accum=True,
        )
    x = xq.float() * x_si
    w = wq.float() * w_si
    return (x @ w.t()).to(out_dtype)


def _gelu_backward(dy: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(dy, pre, approximate=_GELU_APPROX)


def _init_weight_shard(param: torch.Tensor, full_shape, dim: int, tp_rank: int, tp_size: int,
                       std: float, seed: int) -> None:
    """Fill ``param`` with this rank's ``dim``-shard of a full N(0, std) matrix drawn from a
    CPU generator seeded with ``seed`` (identical for every build and TP size)."""
    if param.device.type == "meta":
        return
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    full = torch.empty(tuple(full_shape), dtype=torch.float32)
    full.normal_(0.0, std, generator=g)
    shard = full.chunk(tp_size, dim=dim)[tp_rank]
    with torch.no_grad():
        param.copy_(shard)


def _default_seed() -> int:
    # Drawn from torch's default CPU generator: ranks that called torch.manual_seed(s)
    # alike draw the same value.
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


# ============================================================= reference: autograd pieces


class _AllGatherSeq(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)[0]

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy, ctx.group)[0], None


class _ReduceScatterSeq(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0. Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)[0]

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.group)[0], None


class _AllReduceFwd(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)[0]

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _AllReduceBwd(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient.

    Used (a) on a replicated input entering the TP region without sequence parallelism
    and (b) on replicated parameters that act on sequence-sharded tokens (LayerNorm
    gamma/beta, the row-parallel bias in the reference build): each rank's gradient is
    the partial over its tokens, the all-reduce completes it (identical on every rank).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy.clone(), ctx.group)[0], None


class _Fp8Linear(torch.autograd.Function):
    """Reference FP8 linear: forward quantizes x and w (current amax) and runs an FP8 GEMM
    (+ bias in the output dtype); backward is the bf16 linear backward on the unquantized
    x and w (straight-through)."""

    @staticmethod
    def forward(ctx, x, w, b):
        xq, x_si = quantize_fp8(x)
        wq, w_si = quantize_fp8(w)
        y = _fp8_mm(xq, x_si, wq, w_si, x.dtype)
        if b is not None:
            y = y + b
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def _ref_linear(x, w, b, fp8: bool):
    if fp8:
        return _Fp8Linear.apply(x, w, b)
    return F.linear(x, w, b)


# ============================================================ overlap build: hand-written


@dataclass(frozen=True)
class _Cfg:
    group: object  # ProcessGroup or None (world)
    tp: int
    sequence_parallel: bool
    ub_overlap_ag: bool
    ub_overlap_rs: bool
    ub_overlap_rs_dgrad: bool
    ub_bulk_dgrad: bool
    ub_bulk_wgrad: bool
    fp8: bool

    @property
    def comm(self) -> bool:
        return self.tp > 1


def _weight_t(weight: torch.Tensor) -> torch.Tensor:
    # The ops take the weight operand as [m, k] with y = x @ weight^T (TN). A GEMM with the
    # weight *not* transposed (dgrad: dY @ W) therefore needs W^T as a contiguous [k, m]
    # matrix: one transposed copy of the weight shard per backward.
    return weight.t().contiguous()


class _ColumnParallelFn(torch.autograd.Function):
    """Column-parallel linear (+ optional fused tanh-GELU), overlap build.

    Forward  (SP): y = AG(x) @ W^T + b           [n/tp, k] -> [n, m/tp]
    Backward (SP): dgrad = RS(dY @ W)            [n, m/tp] -> [n/tp, k]
                   wgrad = dY^T @ AG(x)          (x re-gathered: not kept gathered)
                   bgrad = sum_rows(dY)
    Without SP the input is replicated: no gather, and the dgrad is all-reduced.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, cfg: _Cfg, gelu: bool):
        group = cfg.group
        sp = cfg.comm and cfg.sequence_parallel
        pre = None
        if cfg.fp8:
            # A gathered input needs one scale on every rank: amax over the group.
            xq, x_si = quantize_fp8(x, group, reduce_amax=sp)
            wq, w_si = quantize_fp8(weight)
        if sp and cfg.ub_overlap_ag:
            ops = _ops()
            if cfg.fp8:
                out = ops.all_gather_gemm(
                    xq, wq, bias, group=group, gelu=gelu,
                    x_scale_inv=x_si.reshape(1), w_scale_inv=w_si.reshape(1), out_dtype=x.dtype,
                )
            else:
                out = ops.all_gather_gemm(x, weight, bias, group=group, gelu=gelu)
            if gelu:
                y, pre = out
            else:
                y = out
        else:
            if cfg.fp8:
                if sp:
                    xq = _all_gather(xq, group)[0]
                y = _fp8_mm(xq, x_si, wq, w_si, x.dtype)
                if bias is not None:
                    y = y + bias
            else:
                x_in = _all_gather(x, group)[0] if sp else x
                y = F.linear(x_in, weight, bias)
            if gelu:
                pre = y
                y = F.gelu(pre, approximate=_GELU_APPROX)
        ctx.cfg = cfg
        ctx.gelu = gelu
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, pre)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, pre = ctx.saved_tensors
        cfg: _Cfg = ctx.cfg
        group = cfg.group
        if ctx.gelu:
            dy = _gelu_backward(dy, pre)
        dy = dy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        sp = cfg.comm and cfg.sequence_parallel
        n_local, k = x.shape

        x_full, dx, dx_partial, red_work = x, None, None, None
        if need_dx and cfg.comm and cfg.ub_overlap_rs_dgrad:
            # dgrad GEMM + reduce-scatter (all-reduce without SP) fused in the library. The
            # input re-gather for the wgrad GEMM runs beside it as an async NCCL all-gather
            # (as TE does when the dgrad RS is overlapped).
            ag_work = None
            if need_dw and sp:
                x_full, ag_work = _all_gather(x, group, async_op=True)
            ops = _ops()
            fn = ops.gemm_reduce_scatter if sp else ops.gemm_all_reduce
            dx = fn(dy, _weight_t(weight), None, group=group)
            _wait(ag_work)
        else:
            if need_dx and need_dw and sp and cfg.ub_bulk_dgrad:
                # Userbuffers bulk all-gather of the input beside the dgrad GEMM (which the
                # library runs: TN with W^T); the gathered input stays in the buffer.
                ub = _get_userbuffer(group, n_local * cfg.tp, k, x.dtype)
                ub.copy_into_buffer(x, local_chunk=True)
                dx_partial = torch.empty((dy.shape[0], k), dtype=dy.dtype, device=dy.device)
                ub.bulk_overlap("ag", _weight_t(weight), dy, dx_partial)
                x_full = ub.get_buffer()
            else:
                if need_dw and sp:
                    x_full = _all_gather(x, group)[0]
                if need_dx:
                    dx_partial = dy @ weight  # [n, k]
            if dx_partial is not None:
                # The dgrad reduction, in the background beside the wgrad GEMM when
                # ub_bulk_wgrad (async NCCL collective; see the module docstring).
                async_op = cfg.ub_bulk_wgrad and need_dw
                if sp:
                    dx, red_work = _reduce_scatter(dx_partial, group, async_op=async_op)
                elif cfg.comm:
                    dx, red_work = _all_reduce(dx_partial, group, async_op=async_op)
                else:
                    dx = dx_partial

        dw = dy.t() @ x_full if need_dw else None
        db = dy.sum(0) if need_db else None
        _wait(red_work)
        return dx, dw, db, None, None


class _RowParallelFn(torch.autograd.Function):
    """Row-parallel linear, overlap build.

    Forward  (SP): y = RS(x @ W^T) + b           [n, k/tp] -> [n/tp, m] (b added once)
    Backward (SP): dY_full = AG(dY)              [n/tp, m] -> [n, m]
                   dgrad = dY_full @ W           [n, k/tp]
                   wgrad = dY_full^T @ x
                   bgrad = sum_rows(dY_full)     (complete on every rank: no all-reduce)
    Without SP: y = AR(x @ W^T) + b; the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, cfg: _Cfg):
        group = cfg.group
        if cfg.fp8:
            xq, x_si = quantize_fp8(x)
            wq, w_si = quantize_fp8(weight)
        if cfg.comm and cfg.ub_overlap_rs:
            ops = _ops()
            fn = ops.gemm_reduce_scatter if cfg.sequence_parallel else ops.gemm_all_reduce
            if cfg.fp8:
                y = fn(xq, wq, bias, group=group, x_scale_inv=x_si.reshape(1),
                       w_scale_inv=w_si.reshape(1), out_dtype=x.dtype)
            else:
                y = fn(x, weight, bias, group=group)
        else:
            if cfg.fp8:
                partial = _fp8_mm(xq, x_si, wq, w_si, x.dtype)
            else:
                partial = F.linear(x, weight)
            if cfg.comm and cfg.sequence_parallel:
                y = _reduce_scatter(partial, group)[0]
            elif cfg.comm:
                y = _all_reduce(partial, group)[0]
            else:
                y = partial
            if bias is not None:
                y = y + bias
        ctx.cfg = cfg
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        cfg: _Cfg = ctx.cfg
        group = cfg.group
        dy = dy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        sp = cfg.comm and cfg.sequence_parallel

        dx = None
        if sp and cfg.ub_overlap_ag and need_dx:
            # dgrad = AG(dY) @ W by the userbuffers ring all-gather GEMM (TN: W^T as the
            # weight operand); the gathered dY comes back through x_copy for wgrad/bgrad.
            n, m = dy.shape[0] * cfg.tp, dy.shape[1]
            ub = _get_userbuffer(group, n, m, dy.dtype)
            dx = torch.empty((n, x.shape[1]), dtype=dy.dtype, device=dy.device)
            dy_full = None
            if need_dw or need_db:
                dy_full = torch.empty((n, m), dtype=dy.dtype, device=dy.device)
            ub.split_overlap_ag(_weight_t(weight), dy, dx, x_copy=dy_full)
        else:
            dy_full = _all_gather(dy, group)[0] if sp else dy
            if need_dx:
                dx = dy_full @ weight
        dw = dy_full.t() @ x if need_dw else None
        db = dy_full.sum(0) if need_db else None
        return dx, dw, db, None


# ======================================================================== the modules


class _TPModule(nn.Module):
    def _setup_tp(self, tp_group, sequence_parallel, comm_overlap, fp8):
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_rank(tp_group)
        self.sequence_parallel = bool(sequence_parallel)
        self.comm_overlap = bool(comm_overlap)
        self.fp8 = bool(fp8)


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} = {a} must be divisible by the tensor-parallel size {b}")
    return a // b


class ColumnParallelLinear(_TPModule):
    """Linear layer with the output features sharded across the TP group.

    ``weight``: ``[out_features / tp, in_features]`` (this rank's rows of the full weight);
    ``bias``: ``[out_features / tp]``.

    Input ``[..., in_features]`` with dim 0 sharded across the group (sequence parallel),
    output ``[tp * dim0, ..., out_features / tp]`` (all tokens, this rank's features).
    With ``sequence_parallel=False`` the input is replicated and dim 0 is kept.

    ``comm_overlap=False`` builds the reference (torch.distributed collectives + torch
    matmuls, autograd backward; ub flags ignored). With ``comm_overlap=True``:

    - forward: ``ub_overlap_ag`` -> ``ops.all_gather_gemm`` (ring AG overlapped with the
      GEMM chunks), else ``dist.all_gather_into_tensor`` then a torch matmul;
    - backward: dgrad = dY @ W reduce-scattered over the tokens, wgrad = dY^T @ AG(x) with
      the input re-gathered (it is not kept gathered from the forward pass):

      * ``ub_overlap_rs_dgrad``: ``ops.gemm_reduce_scatter(dY, W^T)`` (W^T: a transposed
        contiguous copy of the shard), the re-gather an async NCCL all-gather beside it;
      * else ``ub_bulk_dgrad``: userbuffers bulk all-gather of x beside the dgrad GEMM
        (``CommOverlap.bulk_overlap``), else a synchronous all-gather and a torch GEMM;
        then the dgrad reduce-scatter: an async NCCL ``reduce_scatter_tensor`` beside the
        wgrad GEMM with ``ub_bulk_wgrad``, else synchronous.

    ``fp8=True``: forward GEMM in FP8 (see the module docstring); backward in
    ``params_dtype``.

    Init: the full ``[out_features, in_features]`` weight ~ N(0, init_std) from a CPU
    generator seeded with ``seed`` (None: a seed drawn from torch's default generator, so
    ``torch.manual_seed`` alike on every rank gives the same weights), this rank's rows
    kept; bias 0.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group=None,
        sequence_parallel: bool = True,
        comm_overlap: bool = True,
        ub_overlap_ag: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        fp8: bool = False,
        params_dtype: torch.dtype = torch.bfloat16,
        device="cuda",
        seed: Optional[int] = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        self._setup_tp(tp_group, sequence_parallel, comm_overlap, fp8)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.out_features_per_rank = _divide(self.out_features, self.tp_size, "out_features")
        self.ub_overlap_ag = bool(ub_overlap_ag)
        self.ub_overlap_rs_dgrad = bool(ub_overlap_rs_dgrad)
        # TE: with the dgrad reduce-scatter fused into the dgrad GEMM the bulk overlaps are off.
        self.ub_bulk_dgrad = bool(ub_bulk_dgrad) and not self.ub_overlap_rs_dgrad
        self.ub_bulk_wgrad = bool(ub_bulk_wgrad) and not self.ub_overlap_rs_dgrad
        self.seed = _default_seed() if seed is None else int(seed)
        self.weight = nn.Parameter(
            torch.empty(self.out_features_per_rank, self.in_features, dtype=params_dtype, device=device)
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features_per_rank, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        _init_weight_shard(self.weight, (self.out_features, self.in_features), 0,
                           self.tp_rank, self.tp_size, init_std, self.seed)

    def _cfg(self) -> _Cfg:
        return _Cfg(
            group=self.tp_group,
            tp=self.tp_size,
            sequence_parallel=self.sequence_parallel,
            ub_overlap_ag=self.ub_overlap_ag,
            ub_overlap_rs=False,
            ub_overlap_rs_dgrad=self.ub_overlap_rs_dgrad,
            ub_bulk_dgrad=self.ub_bulk_dgrad,
            ub_bulk_wgrad=self.ub_bulk_wgrad,
            fp8=self.fp8,
        )

    def _forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        lead = tuple(x.shape[:-1])
        x2 = _flat(x)
        comm = self.tp_size > 1
        if self.comm_overlap:
            y = _ColumnParallelFn.apply(x2, self.weight, self.bias, self._cfg(), gelu)
        else:
            if comm and self.sequence_parallel:
                xg = _AllGatherSeq.apply(x2, self.tp_group)
            elif comm:
                xg = _AllReduceBwd.apply(x2, self.tp_group)
            else:
                xg = x2
            y = _ref_linear(xg, self.weight, self.bias, self.fp8)
            if gelu:
                y = F.gelu(y, approximate=_GELU_APPROX)
        if comm and self.sequence_parallel and lead:
            lead = (lead[0] * self.tp_size,) + lead[1:]
        return y.reshape(lead + (self.out_features_per_rank,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, gelu=False)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features_per_rank}/rank), bias={self.bias is not None}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}, comm_overlap={self.comm_overlap}, "
            f"ub_overlap_ag={self.ub_overlap_ag}, ub_overlap_rs_dgrad={self.ub_overlap_rs_dgrad}, "
            f"ub_bulk_dgrad={self.ub_bulk_dgrad}, ub_bulk_wgrad={self.ub_bulk_wgrad}, fp8={self.fp8}"
        )


class RowParallelLinear(_TPModule):
    """Linear layer with the input features sharded across the TP group.

    ``weight``: ``[out_features, in_features / tp]``; ``bias``: ``[out_features]``
    (replicated, added once after the reduction).

    Input ``[..., in_features / tp]`` (all tokens, this rank's features), output
    ``[dim0 / tp, ..., out_features]`` (this rank's tokens, reduced over the group).
    With ``sequence_parallel=False`` the output is all-reduced and dim 0 is kept.

    ``comm_overlap=True``:

    - forward: ``ub_overlap_rs`` -> ``ops.gemm_reduce_scatter`` (pipelined GEMM + RS, bias
      added once; ``ops.gemm_all_reduce`` without sequence parallelism), else torch GEMM +
      ``dist.reduce_scatter_tensor`` (``all_reduce``) + bias;
    - backward: ``ub_overlap_ag`` -> dgrad = AG(dY) @ W by the userbuffers ring
      (``CommOverlap.split_overlap_ag`` with a transposed contiguous copy of ``W``), which
      also returns the gathered dY (``x_copy``) for wgrad = AG(dY)^T @ x; else dY is
      all-gathered once and both GEMMs are torch GEMMs. bgrad is the column sum of the
      gathered dY (complete: no all-reduce).

    The reference build (``comm_overlap=False``) adds the bias after the reduce-scatter and
    all-reduces its (token-partial) gradient over the group.

    Init: the full weight ~ N(0, init_std) from a CPU generator seeded with ``seed``, this
    rank's columns kept; bias 0.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group=None,
        sequence_parallel: bool = True,
        comm_overlap: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_ag: bool = True,
        fp8: bool = False,
        params_dtype: torch.dtype = torch.bfloat16,
        device="cuda",
        seed: Optional[int] = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        self._setup_tp(tp_group, sequence_parallel, comm_overlap, fp8)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.in_features_per_rank = _divide(self.in_features, self.tp_size, "in_features")
        self.ub_overlap_rs = bool(ub_overlap_rs)
        self.ub_overlap_ag = bool(ub_overlap_ag)
        self.seed = _default_seed() if seed is None else int(seed)
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features_per_rank, dtype=params_dtype, device=device)
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        _init_weight_shard(self.weight, (self.out_features, self.in_features), 1,
                           self.tp_rank, self.tp_size, init_std, self.seed)

    def _cfg(self) -> _Cfg:
        return _Cfg(
            group=self.tp_group,
            tp=self.tp_size,
            sequence_parallel=self.sequence_parallel,
            ub_overlap_ag=self.ub_overlap_ag,
            ub_overlap_rs=self.ub_overlap_rs,
            ub_overlap_rs_dgrad=False,
            ub_bulk_dgrad=False,
            ub_bulk_wgrad=False,
            fp8=self.fp8,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = tuple(x.shape[:-1])
        x2 = _flat(x)
        comm = self.tp_size > 1
        if comm and self.sequence_parallel:
            if not lead or lead[0] % self.tp_size:
                raise ValueError(
                    f"RowParallelLinear (sequence parallel): dim 0 of the input {tuple(x.shape)} "
                    f"must be divisible by the tensor-parallel size {self.tp_size}"
                )
            lead = (lead[0] // self.tp_size,) + lead[1:]
        if self.comm_overlap:
            y = _RowParallelFn.apply(x2, self.weight, self.bias, self._cfg())
        else:
            y = _ref_linear(x2, self.weight, None, self.fp8)
            if comm and self.sequence_parallel:
                y = _ReduceScatterSeq.apply(y, self.tp_group)
            elif comm:
                y = _AllReduceFwd.apply(y, self.tp_group)
            if self.bias is not None:
                b = self.bias
                if comm and self.sequence_parallel:
                    b = _AllReduceBwd.apply(b, self.tp_group)
                y = y + b
        return y.reshape(lead + (self.out_features,))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features_per_rank}/rank), "
            f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}, comm_overlap={self.comm_overlap}, "
            f"ub_overlap_rs={self.ub_overlap_rs}, ub_overlap_ag={self.ub_overlap_ag}, fp8={self.fp8}"
        )


class LayerNormMLP(nn.Module):
    """LayerNorm -> fc1 (column parallel) -> tanh-GELU -> fc2 (row parallel), TE-like.

    Input/output ``[..., hidden_size]`` with dim 0 sharded across the TP group (sequence
    parallel; replicated with ``sequence_parallel=False``). The LayerNorm parameters
    (``layer_norm_weight``, ``layer_norm_bias``) are replicated; with sequence parallelism
    their gradients are all-reduced over the TP group inside the backward pass, so every
    rank ends with the full gradient.

    Flags as TE's userbuffers flags (see the module docstring): ``ub_overlap_ag`` (fc1
    forward AG+GEMM, fc2 backward AG+dgrad), ``ub_overlap_rs`` (fc2 forward GEMM+RS),
    ``ub_overlap_rs_dgrad`` (fc1 backward dgrad GEMM+RS), ``ub_bulk_dgrad`` /
    ``ub_bulk_wgrad`` (fc1 backward bulk overlaps). ``comm_overlap=False`` is the reference
    build on plain torch.distributed collectives and torch matmuls.

    In the overlap build fc1's GELU is fused into the all-gather GEMM's epilogue (bias +
    GELU, the pre-activation kept for the backward) when ``ub_overlap_ag`` is on.
    ``fp8=True`` runs both forward GEMMs in FP8 (backward in ``params_dtype``).

    Parameter names: ``layer_norm_weight``, ``layer_norm_bias``, ``fc1.weight``,
    ``fc1.bias``, ``fc2.weight``, ``fc2.bias``. fc1's weight is drawn with ``seed``, fc2's
    with ``seed + 1``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        tp_group=None,
        eps: float = 1e-5,
        bias: bool = True,
        sequence_parallel: bool = True,
        comm_overlap: bool = True,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        fp8: bool = False,
        params_dtype: torch.dtype = torch.bfloat16,
        device="cuda",
        seed: Optional[int] = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.ffn_hidden_size = int(ffn_hidden_size)
        self.eps = float(eps)
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_rank(tp_group)
        self.sequence_parallel = bool(sequence_parallel)
        self.comm_overlap = bool(comm_overlap)
        self.fp8 = bool(fp8)
        self.seed = _default_seed() if seed is None else int(seed)
        self.layer_norm_weight = nn.Parameter(torch.ones(self.hidden_size, dtype=params_dtype, device=device))
        self.layer_norm_bias = nn.Parameter(torch.zeros(self.hidden_size, dtype=params_dtype, device=device))
        common = dict(
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            comm_overlap=comm_overlap,
            fp8=fp8,
            params_dtype=params_dtype,
            device=device,
            init_std=init_std,
        )
        self.fc1 = ColumnParallelLinear(
            self.hidden_size, self.ffn_hidden_size, bias,
            ub_overlap_ag=ub_overlap_ag, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
            seed=self.seed, **common,
        )
        self.fc2 = RowParallelLinear(
            self.ffn_hidden_size, self.hidden_size, bias,
            ub_overlap_rs=ub_overlap_rs, ub_overlap_ag=ub_overlap_ag,
            seed=self.seed + 1, **common,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.layer_norm_weight, self.layer_norm_bias
        if self.sequence_parallel and self.tp_size > 1:
            w = _AllReduceBwd.apply(w, self.tp_group)
            b = _AllReduceBwd.apply(b, self.tp_group)
        ln_out = F.layer_norm(x, (self.hidden_size,), w, b, self.eps)
        h = self.fc1._forward(ln_out, gelu=True)
        return self.fc2(h)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, eps={self.eps}, "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
            f"comm_overlap={self.comm_overlap}, fp8={self.fp8}"
        )
