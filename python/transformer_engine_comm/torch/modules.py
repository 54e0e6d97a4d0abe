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
  (NCCL, or any backend: it runs on CPU with gloo too) around ``torch`` matmuls. In bf16
  it is composed from small differentiable collectives so that autograd derives every
  gradient (no hand-written backward for the GEMMs). With ``fp8=True`` the GEMMs' FP8
  backward cannot be derived by autograd: the reference then runs the hand-written
  functions below with every ``ub_*`` flag off (synchronous ``torch.distributed``
  collectives carrying FP8 bytes, ``torch._scaled_mm``). The ``ub_*`` flags are ignored.
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
  ``ub_bulk_wgrad``        column backward: the reduce-scatter of the dgrad is a userbuffers
                           *bulk reduce-scatter* (``CommOverlap.bulk_overlap("rs")``) running
                           beside the wgrad GEMM, which the library runs (bf16: the NT GEMM
                           ``dW = dY^T X``; FP8: TN on the transposed FP8 operands). The dgrad
                           is copied into the buffer with ``copy_into_buffer`` (which waits
                           until the peers are done with the buffer's previous call: a peer
                           may still read it). Without sequence parallelism the dgrad is
                           all-reduced instead: an async NCCL all-reduce beside the wgrad GEMM.

  :class:`LayerNormMLP` runs fc1, GELU and fc2 as one autograd node (one hand-written
  backward a step), and, as TE's LayerNormMLP, fuses GELU's backward into fc2's dgrad GEMM
  (cuBLASLt's DGELU epilogue reading fc1's saved pre-activation: no separate pass over the
  ``[n, ffn/tp]`` activations) in bf16 / fp16 wherever that GEMM is the library's: the
  userbuffers ring with ``ub_overlap_ag`` at tp > 1 (``split_overlap_ag(..., grad=True)``),
  :func:`transformer_engine_comm.torch.gemm.gemm` otherwise. FP8 dgrads keep GELU's
  backward as a separate op.

  The GEMMs take TE's layouts (``transa`` / ``transb`` of the ops and the userbuffers
  methods): in bf16 the dgrad GEMMs are NN (``dY @ W``, the weight as stored) and the wgrad
  GEMM of the bulk overlap is NT -- no copy of the weight is made in any pass. FP8 GEMMs
  are TN (what Hopper's FP8 GEMMs take) on the transposed FP8 copies that the casts write
  (see FP8 below).
  Userbuffers objects are created on first use (collectively over the TP group), cached per
  (role, group, shape, dtype) and shared between modules; :func:`destroy_module_userbuffers`
  closes them.

  At tp 1 nothing is communicated and the overlap build runs the plain torch path (no
  communication; the library's GEMM only where it fuses an epilogue: GELU, DGELU, the bias
  gradient). ``force_library_path=True`` (or ``TE_COMM_FORCE_LIBRARY_PATH=1`` in the
  environment when the module is built) makes a tp-1 overlap build run exactly the calls
  it would make at tp > 1 (library ops and userbuffers over the one-rank group, the GELU
  epilogue, the NCCL collectives of the steps whose flag is off): a benchmark switch, so that
  the library path's host cost and kernel count are measurable on one GPU. It needs an
  initialised process group. At tp 1 it leaves out only the buffer copies that move nothing
  there: the bulk all-gather's input is not copied into its buffer (the wgrad GEMM reads the
  input itself), the dgrad beside it is not reduce-scattered (the one-rank reduction is the
  identity), and the row backward's dgrad is one GEMM on dY (the gathered dY is dY): the
  comm-GEMM op, or the library's GEMM with the DGELU epilogue inside LayerNormMLP.

Parameters are initialised from a CPU ``torch.Generator`` seeded with ``seed``: the
*full* (unsharded) matrix is drawn, and each rank keeps its shard, so the overlap and the
reference build -- and builds with different TP sizes -- start from the same global
weights given the same seed (weights ~ N(0, init_std), biases 0, LayerNorm gamma 1 / beta 0).

FP8 (``fp8=True``, ``fp8_recipe``: :class:`~transformer_engine_comm.torch.fp8.DelayedScaling`
(the default) or :class:`~transformer_engine_comm.torch.fp8.Float8CurrentScaling`), both
builds:

- What runs in FP8: all three GEMMs of every linear layer -- forward ``y = x W^T``, dgrad
  ``dX = dY W``, wgrad ``dW = dY^T X`` -- with per-tensor scales. Forward tensors (the
  layer input and the weight) use the recipe's forward format (e4m3), the gradient dY its
  backward format (e5m2 under ``Format.HYBRID``, e4m3 under ``Format.E4M3``). The GEMM
  outputs, the bias (added in the GEMM's epilogue), GELU and its backward, LayerNorm, the
  bias gradients (column sums of dY before its cast, as TE's cast+dbias) and the weight
  gradients are in the parameter dtype.
- Casts: each cast writes exactly the outputs its GEMMs need, in one pass
  (:meth:`~transformer_engine_comm.torch.fp8.Fp8Meta.cast`): the input rowwise (forward)
  and transposed (wgrad), the weight rowwise (forward) and transposed (dgrad), dY rowwise
  (dgrad) and transposed (wgrad). Only the FP8 copies are saved for the backward (the
  input as FP8: half the bytes of bf16), plus fc1's bf16 pre-activation for GELU's
  backward.
- Scales: each module keeps one :class:`~transformer_engine_comm.torch.fp8.Fp8Meta` per
  tensor role (``module.fp8_meta["input"|"weight"|"grad_output"]``). Delayed scaling: a
  cast uses the role's current scale and writes the tensor's amax into entry 0 of the
  amax history; then the scale for the next cast is updated from the history
  (``(fp8_max / amax) / 2**margin``, amax = max of the history or its newest entry) and the
  history rolled (TE's ``amax_and_scale_update``); a role's first cast, with no history
  yet, takes its scale from the tensor itself (``fp8.Fp8Meta``; TE starts from 1). Current
  scaling: the scale comes from the tensor's own amax at each cast. A tensor that is
  all-gathered before its GEMM (the column-parallel input and the row-parallel dY with
  sequence parallelism at tp > 1) has its amax max-reduced over the TP group, so all shards
  share one scale.
- Weights: one cast per optimizer step with TE's ``is_first_microbatch`` on ``forward``:
  None casts on every forward; True casts and caches (rowwise and transposed); False reuses
  the cache -- unless the weight changed in place since (its version counter or storage
  differs), then it recasts.
- Communication: the all-gathers carry FP8 bytes. The column-parallel input is cast on each
  rank (shared scale) and gathered in FP8 (the overlap build passes the FP8 shard to
  ``ops.all_gather_gemm``); for the wgrad GEMM the backward re-gathers the saved FP8 shard
  (half the bytes of a bf16 re-gather; nothing gathered is kept between the passes) and
  transposes it. The row-parallel backward casts its dY shard, gathers the FP8 bytes
  (``split_overlap_ag`` on an FP8 buffer in the overlap build), runs the dgrad on them and
  the wgrad on their transpose; its bias gradient is the all-reduced column sum of the
  local bf16 dY.
- Accumulation (TE's defaults, module constants :data:`FP8_FWD_FAST_ACCUM` = True,
  :data:`FP8_DGRAD_FAST_ACCUM` = :data:`FP8_WGRAD_FAST_ACCUM` = False): fast accumulation in
  the forward GEMM, full precision (split accumulator) in dgrad and wgrad. The comm-GEMM ops
  accumulate as the library does for their FP8 GEMMs.
- Local FP8 GEMMs run ``torch._scaled_mm`` on CUDA (sizes multiples of 16); elsewhere (CPU,
  odd sizes) a dequantized fp32 matmul of the same FP8 values.

Block-scaled FP8 (``fp8_recipe=``:class:`~transformer_engine_comm.torch.fp8.Float8BlockScaling`,
TE's / DeepSeek-V3's): e4m3 everywhere, one scale per 1 x 128 block (1D; by default the input
and dY) or 128 x 128 tile (2D; by default the weight), each from its block's own amax, with the
role's QParams (power-of-2 scales by default). No scaling state (``fp8_meta`` is empty). Each
tensor is cast once into exactly the forms its GEMMs read (``fp8.quantize_block``: the library's
``nvte_quantize_v2`` into ``NVTE_BLOCK_SCALING_1D/2D`` tensors on CUDA): the input rowwise
(forward) and columnwise (wgrad: the transposed tensor quantized along its rows), the weight
rowwise and columnwise (dgrad; one cast per step with ``is_first_microbatch``), dY rowwise
(dgrad) and columnwise (wgrad). The GEMMs (``fp8.block_gemm``: the library's TN
``nvte_cublas_gemm`` with split accumulation, as TE's recipe requires) are forward
``x . W^T`` (1D x 2D; the bias in its epilogue), dgrad ``dY . (W^T)^T`` and wgrad
``dY^T . (X^T)^T`` (1D x 1D); in LayerNormMLP fc2's dgrad GEMM also runs GELU's backward
(DGELU epilogue); bias gradients are column sums of bf16 dY. Only the columnwise FP8
forms are saved for the backward. Communication is not block-scaled yet: at tp > 1 the input /
dY are gathered in the activations' dtype before their casts and the dgrad / forward outputs
reduced after the GEMMs with ``torch.distributed``; the ``ub_*`` flags do not apply. CPU
tensors run the same arithmetic as torch ops (the emulation the GPU tests compare against).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _core
from . import fp8 as _fp8

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "LayerNormMLP",
    "FP8_DGRAD_FAST_ACCUM",
    "FP8_FWD_FAST_ACCUM",
    "FP8_WGRAD_FAST_ACCUM",
    "destroy_module_userbuffers",
    "tp_size_rank",
]

_GELU_APPROX = "tanh"  # cuBLASLt's GELU epilogue (and TE's "gelu") is the tanh approximation

# FP8 GEMM accumulation, TE's defaults: fast (FP8 accumulator folded into fp32 less often)
# in the forward GEMM, full precision (split accumulator) for the gradients.
FP8_FWD_FAST_ACCUM = True
FP8_DGRAD_FAST_ACCUM = False
FP8_WGRAD_FAST_ACCUM = False

_FP8_DTYPES = _fp8.FP8_DTYPES


# ============================================================================ helpers


def tp_size_rank(group=None) -> Tuple[int, int]:
    """(size, rank) of ``group`` (None = world); (1, 0) without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


_OPS = None


def _ops():
    # Imported lazily (once): the reference build (and importing this module) needs neither
    # the compiled library nor CUDA.
    global _OPS
    if _OPS is None:
        from . import ops

        _OPS = ops
    return _OPS


_USERBUFFERS = {}


def _get_userbuffer(role: str, group, rows: int, cols: int, dtype: torch.dtype):
    """A userbuffers object (``CommOverlap``) with a ``[rows, cols]`` buffer over ``group``,
    cached per (role, group, shape, dtype, device) and shared by every module that needs it
    (their calls are ordered on the stream; the library keeps peers off a buffer until this
    rank has reached its next call, and ``copy_into_buffer`` waits until the peers are done
    with the previous one). ``role`` separates buffers that are live at the same time (the
    column backward's gathered input and its dgrad being reduce-scattered). Created on first
    use: collective over the group (all its ranks reach the same backward steps in order)."""
    dev = torch.cuda.current_device()
    # Looked up by the group object first (no name resolution per call), then by name.
    ub = _UB_BY_GROUP.get((role, group, rows, cols, dtype, dev))
    if ub is not None and ub._ov is not None:
        return ub
    from ._context import group_name_of
    from .userbuffers import CommOverlap

    key = (role, group_name_of(group), rows, cols, dtype, dev)
    ub = _USERBUFFERS.get(key)
    if ub is None or ub._ov is None:
        ub = CommOverlap((rows, cols), dtype, group)
        _USERBUFFERS[key] = ub
    _UB_BY_GROUP[(role, group, rows, cols, dtype, dev)] = ub
    return ub


_UB_BY_GROUP = {}


def destroy_module_userbuffers() -> None:
    """Close the userbuffers objects the modules created (also closed at exit by
    ``transformer_engine_comm.torch.destroy_userbuffers()``). Collective in effect: do it
    on every rank, after the last backward pass, before destroying the process groups."""
    objs = list(_USERBUFFERS.values())
    _USERBUFFERS.clear()
    _UB_BY_GROUP.clear()
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
    if x.dtype in _FP8_DTYPES:
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


def _fp8_gemm(a: torch.Tensor, a_si: torch.Tensor, b: torch.Tensor, b_si: torch.Tensor,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, fast_accum: bool = False,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TN FP8 GEMM: ``(a * a_si) @ (b * b_si)^T (+ bias)`` -> ``out_dtype``, a ``[M, K]`` and
    b ``[N, K]`` row-major FP8 (not both e5m2), scale_invs one-element float32.

    CUDA with K, N (and M) multiples of 16: without a bias, the library's nvte_cublas_gemm
    (TN, A = b, B = a; one packed foreign call: about half the host time of
    torch._scaled_mm at the tp-4 shape, bench/host_step_breakdown.py, 2026-12-03); else
    cuBLASLt through ``torch._scaled_mm`` (b.t() is
    the column-major operand it wants; bias in the epilogue where its dtype allows);
    elsewhere a dequantized fp32 matmul of the same values. ``out``: written in place."""
    if a.is_cuda and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and a.shape[0] % 16 == 0:
        if bias is None and a.is_contiguous() and b.is_contiguous() and _library_gemm():
            return _gemm()(b, a, transa=True, transb=False, out_dtype=out_dtype, out=out, a_scale_inv=b_si,
                           b_scale_inv=a_si, use_split_accumulator=not fast_accum)
        fuse_bias = bias is None or (bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16))
        kw = {} if out is None else {"out": out}
        y = torch._scaled_mm(a, b.t(), scale_a=a_si, scale_b=b_si, bias=bias if fuse_bias else None,
                             out_dtype=out_dtype, use_fast_accum=fast_accum, **kw)
        if not fuse_bias:
            y.add_(bias)
        return y
    y = (a.float() * a_si) @ (b.float() * b_si).t()
    if bias is not None:
        y = y + bias.float()
    if out is not None:
        return out.copy_(y)
    return y.to(out_dtype)


_GEMM = None
_LIBRARY_GEMM = None


def _library_gemm() -> bool:
    """Whether the library runs the FP8 GEMMs (its quantization backend is active and it
    exports the packed nvte_cublas_gemm; looked up once)."""
    global _LIBRARY_GEMM
    if _LIBRARY_GEMM is None:
        from .. import _capi

        _LIBRARY_GEMM = _fp8._library() is not None and _capi.has_function("nvte_comm_cublas_gemm_packed")
    return _LIBRARY_GEMM


def _gemm():
    # The library's nvte_cublas_gemm with TE's epilogues (imported lazily, once, as _ops).
    global _GEMM
    if _GEMM is None:
        from .gemm import gemm

        _GEMM = gemm
    return _GEMM


def _epilogues(t: torch.Tensor, m: int) -> bool:
    """Whether a local bf16/fp16 GEMM producing ``[*, m]`` runs through the library's
    nvte_cublas_gemm to fuse TE's epilogues (GELU with its pre-activation in the forward,
    GELU's backward in fc2's dgrad GEMM, the bias gradient in the wgrad GEMM): CUDA tensors,
    16-bit, m a multiple of 8 (cuBLASLt's aux leading dimension). Measured on one H100 (bench/gemm_epilogues.py): fc1's
    linear+bias+GELU 0.94x and the wgrad with its bias gradient 0.98x the unfused torch ops."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and m % 8 == 0


def _wgrad(x: torch.Tensor, dy: torch.Tensor, need_db: bool):
    """``(dW, db)`` = ``(dY^T @ X, dY.sum(0) or None)``: one NT GEMM with the bias gradient
    in its epilogue (BGRADB) where :func:`_epilogues` allows, else torch."""
    if need_db and _epilogues(dy, x.shape[1]) and x.dtype == dy.dtype and x.is_contiguous():
        # dW and db in one allocation (db 256-byte aligned after dW): db on its own would
        # come from the allocator's small-block pool, whose addresses move whenever the
        # caller keeps a small tensor per step (a logged loss), and a GEMM whose pointers
        # change every step never replays the library's CUDA graph of it
        # (NVTE_COMM_GEMM_GRAPHS). Autograd takes both views as the gradients (they share
        # one storage, disjoint ranges: the buffer lives while either gradient does).
        m, k = dy.shape[1], x.shape[1]
        off = -(-(m * k) // 128) * 128
        buf = torch.empty(off + m, dtype=dy.dtype, device=dy.device)
        dw, db = buf[: m * k].view(m, k), buf[off:]
        _gemm()(x, dy, transa=False, transb=True, bias_grad=db, out=dw)
        return dw, db
    return dy.t() @ x, None


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


# ============================================================ hand-written functions
#
# The overlap build (bf16 and FP8) and the FP8 reference build (every flag off) run these.


@dataclass(frozen=True)
class _Cfg:
    """A module's communication plan, fixed at construction (one object per module)."""

    group: object  # ProcessGroup or None (world)
    tp: int
    sequence_parallel: bool
    comm: bool  # run the communicating path: tp > 1, or the library path forced at tp 1
    sp: bool  # comm and sequence_parallel: tokens gathered / reduce-scattered
    ub_overlap_ag: bool
    ub_overlap_rs: bool
    ub_overlap_rs_dgrad: bool
    ub_bulk_dgrad: bool
    ub_bulk_wgrad: bool
    fp8: bool


class _BlockFp8State:
    """One module's FP8 state under :class:`~transformer_engine_comm.torch.fp8.Float8BlockScaling`:
    no scaling state (every block's scale comes from the block itself), only the recipe's
    block dims and QParams per role and the cached weight cast (``is_first_microbatch``)."""

    block = True

    def __init__(self, recipe, device):
        self.recipe = recipe
        self.device = torch.device(device)
        self.dims = recipe.block_dims  # (input, weight, grad_output)
        self._q = recipe.qparams
        self.cached_weight: Optional[_fp8.BlockFp8Tensor] = None
        self._cached_key = None

    def metas(self):
        return {}

    def _cast(self, role: int, t: torch.Tensor, rowwise: bool, columnwise: bool) -> _fp8.BlockFp8Tensor:
        q = self._q[role]
        return _fp8.quantize_block(t, self.dims[role], rowwise=rowwise, columnwise=columnwise,
                                   power_2_scale=q.power_2_scale, amax_epsilon=q.amax_epsilon)

    def cast_input(self, x, columnwise: bool) -> _fp8.BlockFp8Tensor:
        return self._cast(0, x, True, columnwise)

    def cast_grad(self, dy, rowwise: bool, columnwise: bool) -> _fp8.BlockFp8Tensor:
        return self._cast(2, dy, rowwise, columnwise)

    def cast_weight(self, w: torch.Tensor, first: Optional[bool], need_t: bool) -> _fp8.BlockFp8Tensor:
        """As :meth:`_Fp8State.cast_weight`: the rowwise form (forward) and the columnwise
        form (dgrad), from one cast of the weight."""
        if first is None:
            self.cached_weight = None
            return self._cast(1, w, True, need_t)
        if not first and self.cached_weight is not None and self._cached_key == (w._version, w.data_ptr()):
            return self.cached_weight
        c = self._cast(1, w, True, True)
        self.cached_weight = c
        self._cached_key = (w._version, w.data_ptr())
        return c


class _Fp8State:
    """One module's FP8 state: an :class:`~transformer_engine_comm.torch.fp8.Fp8Meta` per
    tensor role (input and weight in the recipe's forward format, grad_output in its
    backward format) and the cached weight cast (``is_first_microbatch``)."""

    block = False

    def __init__(self, recipe, device, input_group, grad_group):
        fmt = recipe.fp8_format
        self.recipe = recipe
        self.device = torch.device(device)
        self.input = _fp8.Fp8Meta(recipe, fmt.fwd, self.device, group=input_group)
        self.weight = _fp8.Fp8Meta(recipe, fmt.fwd, self.device)
        self.grad_output = _fp8.Fp8Meta(recipe, fmt.bwd, self.device, group=grad_group)
        self.cached_weight: Optional[_fp8.Fp8Tensor] = None
        self._cached_key = None

    def metas(self):
        return {"input": self.input, "weight": self.weight, "grad_output": self.grad_output}

    def cast_weight(self, w: torch.Tensor, first: Optional[bool], need_t: bool) -> _fp8.Fp8Tensor:
        """TE's ``is_first_microbatch``: None casts (rowwise, transposed when the dgrad needs
        it) and keeps nothing; True casts both layouts and caches them; False reuses the
        cache unless the weight changed in place since (version counter or storage)."""
        if first is None:
            self.cached_weight = None
            return self.weight.cast(w, rowwise=True, columnwise=need_t)
        if not first and self.cached_weight is not None and self._cached_key == (w._version, w.data_ptr()):
            return self.cached_weight
        c = self.weight.cast(w, rowwise=True, columnwise=True)
        self.cached_weight = c
        self._cached_key = (w._version, w.data_ptr())
        return c


def _bulk_rs_wanted(cfg: _Cfg, need_dw: bool) -> bool:
    """Whether the column dgrad's reduce-scatter runs as a userbuffers bulk RS beside the
    wgrad GEMM. Not at tp 1: there it would only copy the dgrad out of the buffer (64 MiB,
    about 45 us per step at the tp-4 shape on an H100, 2026-11-26)."""
    return cfg.sp and cfg.ub_bulk_wgrad and need_dw and cfg.tp > 1


def _dx_reduce(cfg: _Cfg, dx_partial, need_dw: bool):
    """The column dgrad's reduction when the wgrad GEMM is not run by a bulk RS:
    -> (dx, work to wait for after the wgrad GEMM, or None). At tp 1 the dgrad itself (a
    one-rank collective would only copy it)."""
    if cfg.tp == 1:
        return dx_partial, None
    if cfg.sp:
        return _reduce_scatter(dx_partial, cfg.group)[0], None
    if cfg.comm:
        # Without SP: all-reduce, asynchronous beside the wgrad GEMM when ub_bulk_wgrad.
        return _all_reduce(dx_partial, cfg.group, async_op=cfg.ub_bulk_wgrad and need_dw)
    return dx_partial, None


class _ColumnParallelFn(torch.autograd.Function):
    """Column-parallel linear (+ optional fused tanh-GELU).

    Forward  (SP): y = AG(x) @ W^T + b           [n/tp, k] -> [n, m/tp]
    Backward (SP): dgrad = RS(dY @ W)            [n, m/tp] -> [n/tp, k]
                   wgrad = dY^T @ AG(x)          (x re-gathered: not kept gathered)
                   bgrad = sum_rows(dY)
    Without SP the input is replicated: no gather, and the dgrad is all-reduced.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, cfg: _Cfg, gelu: bool, f8: Optional[_Fp8State],
                first_microbatch: Optional[bool], grad: bool):
        return _column_forward(ctx, x, weight, bias, cfg, gelu, f8, first_microbatch, grad)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _column_grads(ctx, dy)
        return dx, dw, db, None, None, None, None, None


def _column_forward(ctx, x, weight, bias, cfg: _Cfg, gelu: bool, f8: Optional[_Fp8State],
                    first_microbatch: Optional[bool], grad: bool):
    """_ColumnParallelFn's forward on ``ctx`` (the Function's, or a :class:`_SubCtx`)."""
    group = cfg.group
    need_dx = grad and ctx.needs_input_grad[0]
    need_dw = grad and ctx.needs_input_grad[1]
    pre = None
    fused = cfg.sp and cfg.ub_overlap_ag
    if cfg.fp8 and f8.block:
        fused = False  # block scaling: torch.distributed collectives around the library's block GEMMs
        out, saved = _column_forward_block(x, weight, bias, cfg, f8, first_microbatch, need_dx, need_dw)
        ctx.f8 = f8
        ctx.w_dtype = weight.dtype
    elif cfg.fp8:
        odt = weight.dtype
        # A gathered input's meta max-reduces its amax over the group: one scale.
        xf = f8.input.cast(x, rowwise=True, columnwise=need_dw and not cfg.sp)
        wf = f8.cast_weight(weight, first_microbatch, need_dx)
        if fused:
            out = _ops().all_gather_gemm(xf.data, wf.data, bias, group=group, gelu=gelu,
                                         x_scale_inv=xf.scale_inv, w_scale_inv=wf.scale_inv,
                                         out_dtype=odt)
        else:
            xg = _all_gather(xf.data, group)[0] if cfg.sp else xf.data
            out = _fp8_gemm(xg, xf.scale_inv, wf.data, wf.scale_inv, odt, bias, FP8_FWD_FAST_ACCUM)
        # Saved: the FP8 shard (SP: re-gathered in the backward) or the transposed FP8
        # input, the transposed FP8 weight; never the bf16 input.
        x_save = (xf.data if cfg.sp else xf.data_t) if need_dw else None
        saved = (x_save, xf.scale_inv, wf.data_t if need_dx else None, wf.scale_inv)
        ctx.f8 = f8
        ctx.w_dtype = weight.dtype
    else:
        if fused:
            out = _ops().all_gather_gemm(x, weight, bias, group=group, gelu=gelu)
        else:
            x_in = _all_gather(x, group)[0] if cfg.sp else x
            if gelu and _epilogues(x_in, weight.shape[0]):
                # Bias + GELU in the GEMM's epilogue (the pre-activation as its aux
                # output): no separate GELU pass over the [n, m] activations.
                out = _gemm()(weight, x_in, transa=True, transb=False, bias=bias, gelu=True)
                fused = True
            else:
                out = F.linear(x_in, weight, bias)
        saved = (x if need_dw else None, weight if need_dx else None)
    if fused and gelu:
        y, pre = out
    elif gelu:
        pre = out
        y = F.gelu(pre, approximate=_GELU_APPROX)
    else:
        y = out
    ctx.save_for_backward(*saved, pre)
    ctx.k = x.shape[1]
    ctx.cfg = cfg
    ctx.gelu = gelu
    ctx.has_bias = bias is not None
    return y


def _column_grads(ctx, dy, gelu_done: bool = False):
    """_ColumnParallelFn's backward -> (dx, dw, db). ``gelu_done``: ``dy`` is already the
    gradient of the pre-activation (the GELU backward ran in the next layer's dgrad GEMM)."""
    cfg: _Cfg = ctx.cfg
    *saved, pre = ctx.saved_tensors
    if ctx.gelu and not gelu_done:
        dy = _gelu_backward(dy, pre)
    dy = dy.contiguous()
    if cfg.fp8 and ctx.f8.block:
        return _column_backward_block(ctx, cfg, dy, *saved)
    if cfg.fp8:
        return _column_backward_fp8(ctx, cfg, dy, *saved)
    return _column_backward(ctx, cfg, dy, *saved)


def _bulk_rs_beside_wgrad(cfg: _Cfg, dx_partial, dw_shape, dw_dtype, a, b, **gemm_kwargs):
    """The column backward's dgrad reduce-scatter as a userbuffers bulk RS beside the wgrad
    GEMM (``bulk_overlap("rs", a, b, dW, ...)``): returns ``(dx, dW)``. The dgrad enters the
    buffer first (tp > 1 only: see :func:`_bulk_rs_wanted`)."""
    n, k = dx_partial.shape
    ub_rs = _get_userbuffer("rs", cfg.group, n, k, dx_partial.dtype)
    ub_rs.copy_into_buffer(dx_partial)
    dx = torch.empty((n // cfg.tp, k), dtype=dx_partial.dtype, device=dx_partial.device)
    dw = torch.empty(dw_shape, dtype=dw_dtype, device=dx_partial.device)
    ub_rs.bulk_overlap("rs", a, b, dw, rs_output=dx, **gemm_kwargs)
    return dx, dw


def _column_backward(ctx, cfg: _Cfg, dy, x, weight):
    group = cfg.group
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    n = dy.shape[0]
    x_full, dx, dw, red_work = x, None, None, None
    if need_dx and cfg.comm and cfg.ub_overlap_rs_dgrad:
        # dgrad GEMM (NN: dY @ W) + reduce-scatter (all-reduce without SP) fused in the
        # library; the input re-gather for the wgrad GEMM runs beside it as an async NCCL
        # all-gather (as TE does when the dgrad RS is overlapped).
        ag_work = None
        if need_dw and cfg.sp:
            x_full, ag_work = _all_gather(x, group, async_op=True)
        ops = _ops()
        fn = ops.gemm_reduce_scatter if cfg.sp else ops.gemm_all_reduce
        dx = fn(dy, weight, None, group=group, transa=False)
        _wait(ag_work)
    else:
        k = ctx.k
        dx_partial = None
        if need_dx and need_dw and cfg.sp and cfg.ub_bulk_dgrad:
            # Userbuffers bulk all-gather of the input beside the dgrad GEMM (NN, run by
            # the library); the gathered input stays in the buffer for the wgrad GEMM.
            ub = _get_userbuffer("ag", group, n, k, x.dtype)
            if cfg.tp > 1:
                ub.copy_into_buffer(x, local_chunk=True)
            dx_partial = torch.empty((n, k), dtype=dy.dtype, device=dy.device)
            ub.bulk_overlap("ag", weight, dy, dx_partial, transa=False)
            # At tp 1 the gathered input is the input itself (the buffer is not filled).
            x_full = ub.get_buffer() if cfg.tp > 1 else x
        else:
            if need_dw and cfg.sp:
                x_full = _all_gather(x, group)[0]
            if need_dx:
                dx_partial = dy @ weight  # [n, k]
        if dx_partial is not None:
            if _bulk_rs_wanted(cfg, need_dw):
                # Bulk reduce-scatter of the dgrad beside the wgrad GEMM, both in the
                # library: NT, A = X [n, k] (transa=False), B = dY [n, m] (transb=True),
                # D = dW [m, k].
                dx, dw = _bulk_rs_beside_wgrad(cfg, dx_partial, (dy.shape[1], k), dy.dtype, x_full, dy,
                                               transa=False, transb=True)
            else:
                dx, red_work = _dx_reduce(cfg, dx_partial, need_dw)
    db = None
    if need_dw and dw is None:
        dw, db = _wgrad(x_full, dy, need_db)
    if need_db and db is None:
        db = dy.sum(0)
    _wait(red_work)
    return dx, dw, db


def _column_backward_fp8(ctx, cfg: _Cfg, dy, x_sv, x_si, w_t, w_si):
    f8: _Fp8State = ctx.f8
    group = cfg.group
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    n, m = dy.shape
    k = ctx.k
    odt = ctx.w_dtype
    # dY: rowwise for the dgrad, transposed for the wgrad, one cast; dbias from bf16 dY.
    dyf = f8.grad_output.cast(dy, rowwise=need_dx, columnwise=need_dw)
    db = dy.sum(0) if need_db else None
    x_t = None if cfg.sp else x_sv  # without SP the forward saved X^T
    x_full, dx, dw, red_work = None, None, None, None
    if need_dx and cfg.comm and cfg.ub_overlap_rs_dgrad:
        ag_work = None
        if need_dw and cfg.sp:
            x_full, ag_work = _all_gather(x_sv, group, async_op=True)  # FP8 bytes
        ops = _ops()
        fn = ops.gemm_reduce_scatter if cfg.sp else ops.gemm_all_reduce
        dx = fn(dyf.data, w_t, None, group=group, x_scale_inv=dyf.scale_inv, w_scale_inv=w_si, out_dtype=odt)
        _wait(ag_work)
        if need_dw and cfg.sp:
            x_t = _fp8.transpose(x_full)
    else:
        dx_partial = None
        if need_dx and need_dw and cfg.sp and cfg.ub_bulk_dgrad:
            # FP8 bulk all-gather of the saved FP8 shard beside the FP8 dgrad GEMM (TN:
            # dY [n, m] x W^T [k, m]).
            ub = _get_userbuffer("ag", group, n, k, x_sv.dtype)
            if cfg.tp > 1:
                ub.copy_into_buffer(x_sv, local_chunk=True)
            dx_partial = torch.empty((n, k), dtype=odt, device=dy.device)
            ub.bulk_overlap("ag", w_t, dyf.data, dx_partial, x_scale_inv=dyf.scale_inv, w_scale_inv=w_si,
                            use_split_accumulator=not FP8_DGRAD_FAST_ACCUM)
            x_full = ub.get_buffer() if cfg.tp > 1 else x_sv
        else:
            if need_dw and cfg.sp:
                x_full = _all_gather(x_sv, group)[0]
            if need_dx:
                dx_partial = _fp8_gemm(dyf.data, dyf.scale_inv, w_t, w_si, odt, None, FP8_DGRAD_FAST_ACCUM)
        if need_dw and cfg.sp:
            x_t = _fp8.transpose(x_full)  # [k, n], read before the buffer's next use
        if dx_partial is not None:
            if _bulk_rs_wanted(cfg, need_dw):
                # Bulk RS of the dgrad beside the FP8 wgrad GEMM (TN: dY^T [m, n] x X^T [k, n]).
                dx, dw = _bulk_rs_beside_wgrad(cfg, dx_partial, (m, k), odt, x_t, dyf.data_t,
                                               x_scale_inv=dyf.scale_inv, w_scale_inv=x_si,
                                               use_split_accumulator=not FP8_WGRAD_FAST_ACCUM)
            else:
                dx, red_work = _dx_reduce(cfg, dx_partial, need_dw)
    if need_dw and dw is None:
        dw = _fp8_gemm(dyf.data_t, dyf.scale_inv, x_t, x_si, odt, None, FP8_WGRAD_FAST_ACCUM)
    _wait(red_work)
    return dx, dw, db


class _RowParallelFn(torch.autograd.Function):
    """Row-parallel linear.

    Forward  (SP): y = RS(x @ W^T) + b           [n, k/tp] -> [n/tp, m] (b added once)
    Backward (SP): dY_full = AG(dY)              [n/tp, m] -> [n, m]
                   dgrad = dY_full @ W           [n, k/tp]
                   wgrad = dY_full^T @ x
                   bgrad = sum_rows(dY_full)     (complete on every rank)
    Without SP: y = AR(x @ W^T) + b; the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, cfg: _Cfg, f8: Optional[_Fp8State], first_microbatch: Optional[bool],
                grad: bool):
        return _row_forward(ctx, x, weight, bias, cfg, f8, first_microbatch, grad)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _row_grads(ctx, dy)
        return dx, dw, db, None, None, None, None


def _row_forward(ctx, x, weight, bias, cfg: _Cfg, f8: Optional[_Fp8State], first_microbatch: Optional[bool],
                 grad: bool):
    """_RowParallelFn's forward on ``ctx`` (the Function's, or a :class:`_SubCtx`)."""
    group = cfg.group
    need_dx = grad and ctx.needs_input_grad[0]
    need_dw = grad and ctx.needs_input_grad[1]
    fused = cfg.comm and cfg.ub_overlap_rs
    # Without communication the bias goes into the GEMM's epilogue.
    gemm_bias = bias if not cfg.comm else None
    if cfg.fp8 and f8.block:
        fused = False  # block scaling: torch.distributed collectives around the library's block GEMMs
        y, saved = _row_forward_block(x, weight, gemm_bias, f8, first_microbatch, need_dx, need_dw)
        ctx.save_for_backward(*saved)
        ctx.f8 = f8
        ctx.w_dtype = weight.dtype
    elif cfg.fp8:
        odt = weight.dtype
        xf = f8.input.cast(x, rowwise=True, columnwise=need_dw)
        wf = f8.cast_weight(weight, first_microbatch, need_dx)
        if fused:
            ops = _ops()
            fn = ops.gemm_reduce_scatter if cfg.sequence_parallel else ops.gemm_all_reduce
            y = fn(xf.data, wf.data, bias, group=group, x_scale_inv=xf.scale_inv,
                   w_scale_inv=wf.scale_inv, out_dtype=odt)
        else:
            y = _fp8_gemm(xf.data, xf.scale_inv, wf.data, wf.scale_inv, odt, gemm_bias, FP8_FWD_FAST_ACCUM)
        ctx.save_for_backward(xf.data_t if need_dw else None, xf.scale_inv,
                              wf.data_t if need_dx else None, wf.scale_inv)
        ctx.f8 = f8
        ctx.w_dtype = weight.dtype
    else:
        if fused:
            ops = _ops()
            fn = ops.gemm_reduce_scatter if cfg.sequence_parallel else ops.gemm_all_reduce
            y = fn(x, weight, bias, group=group)
        else:
            y = F.linear(x, weight, gemm_bias)
        ctx.save_for_backward(x if need_dw else None, weight if need_dx else None)
    if not fused and cfg.comm:
        if cfg.sp:
            y = _reduce_scatter(y, group)[0]
        else:
            y = _all_reduce(y, group)[0]
        if bias is not None:
            y = y + bias
    ctx.cfg = cfg
    ctx.has_bias = bias is not None
    return y


def _row_grads(ctx, dy, gelu_pre: Optional[torch.Tensor] = None):
    """_RowParallelFn's backward -> (dx, dw, db). With ``gelu_pre`` (the previous layer's
    GELU pre-activation, shaped as dx) dx is the gradient of that pre-activation: the GELU
    backward runs in the dgrad GEMM's epilogue (DGELU) where the path allows, else after it."""
    cfg: _Cfg = ctx.cfg
    dy = dy.contiguous()
    if cfg.fp8 and ctx.f8.block:
        return _row_backward_block(ctx, cfg, dy, gelu_pre)
    if cfg.fp8:
        dx, dw, db = _row_backward_fp8(ctx, cfg, dy)
        if gelu_pre is not None and dx is not None:
            dx = _gelu_backward(dx, gelu_pre)
        return dx, dw, db
    return _row_backward(ctx, cfg, dy, gelu_pre)


def _row_backward(ctx, cfg: _Cfg, dy, gelu_pre: Optional[torch.Tensor] = None):
    """bf16 / fp16 row backward; with ``gelu_pre``, dx is the GELU pre-activation's gradient
    (see :func:`_row_grads`)."""
    x, weight = ctx.saved_tensors
    group = cfg.group
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    dx = None
    # DGELU in the dgrad GEMM's epilogue (the library's GEMMs; cuBLASLt's aux leading
    # dimension wants m % 8 == 0).
    dgelu = gelu_pre is not None and _epilogues(dy, weight.shape[1])
    if cfg.sp and cfg.ub_overlap_ag and need_dx:
        # dgrad = AG(dY) @ W by the userbuffers ring all-gather GEMM (NN: the weight as
        # stored, transa=False); the gathered dY comes back through x_copy for wgrad/bgrad.
        n, m = dy.shape[0] * cfg.tp, dy.shape[1]
        dy_full = None
        if cfg.tp == 1:
            # The gathered dY is dY. The comm-GEMM op, not the userbuffers object: its
            # buffer would have to hold dY after the call (a copy nobody reads); with the
            # DGELU epilogue, the library's GEMM (the comm-GEMM ops have no DGELU).
            dy_full = dy
            if dgelu:
                dx = _gemm()(weight, dy, transa=False, transb=False, dgelu_pre=gelu_pre)
            else:
                dx = _ops().all_gather_gemm(dy, weight, None, group=group, transa=False)
        else:
            ub = _get_userbuffer("ag", group, n, m, dy.dtype)
            dx = torch.empty((n, weight.shape[1]), dtype=dy.dtype, device=dy.device)
            if need_dw or need_db:
                dy_full = torch.empty((n, m), dtype=dy.dtype, device=dy.device)
            ub.split_overlap_ag(weight, dy, dx, x_copy=dy_full, transa=False,
                                pre_gelu_out=gelu_pre if dgelu else None, grad=dgelu)
    else:
        dy_full = _all_gather(dy, group)[0] if cfg.sp else dy
        if need_dx:
            if dgelu:
                dx = _gemm()(weight, dy_full, transa=False, transb=False, dgelu_pre=gelu_pre)
            else:
                dx = dy_full @ weight
                dgelu = False
    if gelu_pre is not None and dx is not None and not dgelu:
        dx = _gelu_backward(dx, gelu_pre)
    dw, db = _wgrad(x, dy_full, need_db) if need_dw else (None, None)
    if need_db and db is None:
        db = dy_full.sum(0)
    return dx, dw, db


def _row_backward_fp8(ctx, cfg: _Cfg, dy):
    x_t, x_si, w_t, w_si = ctx.saved_tensors
    f8: _Fp8State = ctx.f8
    group = cfg.group
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    odt = ctx.w_dtype
    dx = None
    if cfg.sp:
        # Cast the dY shard (amax max-reduced over the group: one scale), gather FP8 bytes,
        # dgrad on the gathered rows, wgrad on their transpose.
        dyf = f8.grad_output.cast(dy, rowwise=True, columnwise=False)
        n, m = dy.shape[0] * cfg.tp, dy.shape[1]
        if cfg.ub_overlap_ag and need_dx:
            ub = _get_userbuffer("ag", group, n, m, dyf.dtype)
            dx = torch.empty((n, w_t.shape[0]), dtype=odt, device=dy.device)
            if cfg.tp == 1:
                dy_full = dyf.data  # the gathered dY is dY: no copy of it out of the buffer
            else:
                dy_full = torch.empty((n, m), dtype=dyf.dtype, device=dy.device) if need_dw else None
            ub.split_overlap_ag(w_t, dyf.data, dx, x_copy=dy_full if cfg.tp > 1 else None,
                                x_scale_inv=dyf.scale_inv, w_scale_inv=w_si,
                                use_split_accumulator=not FP8_DGRAD_FAST_ACCUM)
        else:
            dy_full = _all_gather(dyf.data, group)[0]
            if need_dx:
                dx = _fp8_gemm(dy_full, dyf.scale_inv, w_t, w_si, odt, None, FP8_DGRAD_FAST_ACCUM)
        dy_t = _fp8.transpose(dy_full) if need_dw else None
        db = dy.sum(0) if need_db else None
        if db is not None and cfg.tp > 1:  # the shards' sums (a one-rank group: the sum itself)
            db = _all_reduce(db, group)[0]
    else:
        dyf = f8.grad_output.cast(dy, rowwise=need_dx, columnwise=need_dw)
        if need_dx:
            dx = _fp8_gemm(dyf.data, dyf.scale_inv, w_t, w_si, odt, None, FP8_DGRAD_FAST_ACCUM)
        dy_t = dyf.data_t
        db = dy.sum(0) if need_db else None
    dw = _fp8_gemm(dy_t, dyf.scale_inv, x_t, x_si, odt, None, FP8_WGRAD_FAST_ACCUM) if need_dw else None
    return dx, dw, db


# ------------------------------------------------------------- block-scaled FP8 layers
#
# Float8BlockScaling: every GEMM is TN on rowwise forms (fp8.block_gemm): forward x . W^T
# (x's rowwise 1D form, W's rowwise 2D form), dgrad dY . W (dY rowwise, W's columnwise form
# = W^T's rowwise), wgrad dY^T . X (the columnwise forms of dY and X). Communication stays
# in the activations' dtype (torch.distributed: the all-gathers before the casts, the
# reduce-scatters / all-reduces after the GEMMs); the ub_* flags do not apply.


def _column_forward_block(x, weight, bias, cfg: _Cfg, f8: _BlockFp8State, first_microbatch, need_dx, need_dw):
    """-> (out, tensors to save). The (gathered) input is cast once, rowwise for the
    forward and columnwise for the wgrad: only that FP8 form is saved."""
    x_in = _all_gather(x, cfg.group)[0] if cfg.sp else x
    xf = f8.cast_input(x_in, columnwise=need_dw)
    wf = f8.cast_weight(weight, first_microbatch, need_dx)
    out = _fp8.block_gemm(xf.rowwise(), wf.rowwise(), weight.dtype, bias=bias)
    saved = ((xf.data_t, xf.scale_inv_t) if need_dw else (None, None)) + \
        ((wf.data_t, wf.scale_inv_t) if need_dx else (None, None))
    return out, saved


def _column_backward_block(ctx, cfg: _Cfg, dy, x_t, x_tsi, w_t, w_tsi):
    f8: _BlockFp8State = ctx.f8
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    odt = ctx.w_dtype
    xd, wd, _ = f8.dims
    dyf = f8.cast_grad(dy, rowwise=need_dx, columnwise=need_dw) if (need_dx or need_dw) else None
    db = dy.sum(0) if need_db else None
    dx = red_work = None
    if need_dx:
        dx_partial = _fp8.block_gemm(dyf.rowwise(), _fp8.BlockOperand(w_t, w_tsi, wd), odt)
        dx, red_work = _dx_reduce(cfg, dx_partial, need_dw)
    dw = _fp8.block_gemm(dyf.columnwise(), _fp8.BlockOperand(x_t, x_tsi, xd), odt) if need_dw else None
    _wait(red_work)
    return dx, dw, db


def _row_forward_block(x, weight, gemm_bias, f8: _BlockFp8State, first_microbatch, need_dx, need_dw):
    """-> (y before its reduction, tensors to save)."""
    xf = f8.cast_input(x, columnwise=need_dw)
    wf = f8.cast_weight(weight, first_microbatch, need_dx)
    y = _fp8.block_gemm(xf.rowwise(), wf.rowwise(), weight.dtype, bias=gemm_bias)
    saved = ((xf.data_t, xf.scale_inv_t) if need_dw else (None, None)) + \
        ((wf.data_t, wf.scale_inv_t) if need_dx else (None, None))
    return y, saved


def _row_backward_block(ctx, cfg: _Cfg, dy, gelu_pre: Optional[torch.Tensor] = None):
    """With ``gelu_pre`` (LayerNormMLP's fc1 pre-activation) dx is its gradient: the GELU
    backward in the dgrad GEMM's epilogue (DGELU)."""
    x_t, x_tsi, w_t, w_tsi = ctx.saved_tensors
    f8: _BlockFp8State = ctx.f8
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    odt = ctx.w_dtype
    xd, wd, _ = f8.dims
    dy_full = _all_gather(dy, cfg.group)[0] if cfg.sp else dy
    dyf = f8.cast_grad(dy_full, rowwise=need_dx, columnwise=need_dw) if (need_dx or need_dw) else None
    dx = _fp8.block_gemm(dyf.rowwise(), _fp8.BlockOperand(w_t, w_tsi, wd), odt,
                         dgelu_pre=gelu_pre) if need_dx else None
    dw = _fp8.block_gemm(dyf.columnwise(), _fp8.BlockOperand(x_t, x_tsi, xd), odt) if need_dw else None
    db = dy_full.sum(0) if need_db else None
    return dx, dw, db


class _SubCtx:
    """One layer's share of :class:`_MLPFn`'s context: what the layer functions read and set
    on an autograd ctx (needs_input_grad, save_for_backward / saved_tensors, attributes).
    The tensors it is given to save go to the real ctx's save_for_backward (version checks,
    saved-tensor hooks), and come back in the backward."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _MLPFn(torch.autograd.Function):
    """fc1 (column parallel, GELU) then fc2 (row parallel) as one autograd node: one Python
    node a step instead of two, and fc2's dgrad GEMM fuses GELU's backward (DGELU epilogue,
    as TE's LayerNormMLP) where the path allows (bf16 / fp16, the library's GEMMs). Each
    layer's work is its Function's (:func:`_column_forward`, :func:`_row_forward`,
    :func:`_column_grads`, :func:`_row_grads`). ``layers``: (fc1's cfg, fc1's FP8 state,
    fc2's cfg, fc2's FP8 state)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, layers, first_microbatch: Optional[bool], grad: bool):
        cfg1, f1, cfg2, f2 = layers
        nig = ctx.needs_input_grad
        c1 = _SubCtx(nig[0:3])
        h = _column_forward(c1, x, w1, b1, cfg1, True, f1, first_microbatch, grad)
        c2 = _SubCtx((any(nig[0:3]), nig[3], nig[4]))
        y = _row_forward(c2, h, w2, b2, cfg2, f2, first_microbatch, grad)
        ctx.n1 = len(c1.saved_tensors)
        ctx.save_for_backward(*c1.saved_tensors, *c2.saved_tensors)
        c1.saved_tensors = c2.saved_tensors = ()
        ctx.c1, ctx.c2 = c1, c2
        return y

    @staticmethod
    def backward(ctx, dy):
        c1, c2 = ctx.c1, ctx.c2
        saved = ctx.saved_tensors
        c1.saved_tensors, c2.saved_tensors = saved[:ctx.n1], saved[ctx.n1:]
        try:
            pre = c1.saved_tensors[-1]  # fc1's pre-activation (its saved tensors end with it)
            dh, dw2, db2 = _row_grads(c2, dy, gelu_pre=pre)
            dx, dw1, db1 = (None, None, None) if dh is None else _column_grads(c1, dh, gelu_done=True)
        finally:
            c1.saved_tensors = c2.saved_tensors = ()
        return dx, dw1, db1, dw2, db2, None, None, None


# ======================================================================== the modules


def _env_force_library_path() -> bool:
    return os.environ.get("TE_COMM_FORCE_LIBRARY_PATH", "") not in ("", "0")


class _TPModule(nn.Module):
    def _setup_tp(self, tp_group, sequence_parallel, comm_overlap, fp8, fp8_recipe, force_library_path):
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_rank(tp_group)
        self.sequence_parallel = bool(sequence_parallel)
        self.comm_overlap = bool(comm_overlap)
        self.fp8 = bool(fp8)
        if fp8_recipe is not None and not isinstance(
                fp8_recipe, (_fp8.DelayedScaling, _fp8.Float8CurrentScaling, _fp8.Float8BlockScaling)):
            raise TypeError("fp8_recipe must be a DelayedScaling, Float8CurrentScaling or Float8BlockScaling, "
                            f"got {fp8_recipe!r}")
        self.fp8_recipe = (fp8_recipe if fp8_recipe is not None else _fp8.DelayedScaling()) if self.fp8 else fp8_recipe
        # Read once, here: a benchmark switch (see the module docstring).
        self.force_library_path = bool(force_library_path) or _env_force_library_path()
        if self.force_library_path and self.comm_overlap and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("force_library_path needs an initialised torch.distributed process group "
                             "(the library's ops run over the tensor-parallel group)")
        gathered = self.sequence_parallel and self.tp_size > 1
        if (self.fp8 and gathered and isinstance(self.fp8_recipe, _fp8.DelayedScaling)
                and not self.fp8_recipe.reduce_amax):
            raise ValueError("fp8 with sequence parallelism at tp > 1 gathers FP8 shards, which need one "
                             "scale: DelayedScaling(reduce_amax=False) cannot be used")
        self._f8: Optional[_Fp8State] = None

    def _make_cfg(self, **flags) -> _Cfg:
        if not self.comm_overlap:
            # Reference build: only used with fp8 (every flag off, torch.distributed).
            flags = {k: False for k in flags}
        comm = self.tp_size > 1 or (self.comm_overlap and self.force_library_path)
        return _Cfg(group=self.tp_group, tp=self.tp_size, sequence_parallel=self.sequence_parallel,
                    comm=comm, sp=comm and self.sequence_parallel, fp8=self.fp8, **flags)

    def _group_or_world(self):
        return self.tp_group if self.tp_group is not None else dist.group.WORLD

    def _fp8_groups(self):  # (input group, grad_output group): those gathered
        raise NotImplementedError

    def _fp8_state(self) -> _Fp8State:
        f = self._f8
        dev = self.weight.device
        if f is None or f.device != dev:
            if isinstance(self.fp8_recipe, _fp8.Float8BlockScaling):
                f = self._f8 = _BlockFp8State(self.fp8_recipe, dev)
            else:
                ig, gg = self._fp8_groups()
                f = self._f8 = _Fp8State(self.fp8_recipe, dev, ig, gg)
        return f

    @property
    def fp8_meta(self):
        """``{"input", "weight", "grad_output"}`` -> :class:`~transformer_engine_comm.torch.fp8.Fp8Meta`
        (the scaling state of each FP8 tensor role); None without ``fp8``."""
        if not self.fp8:
            return None
        return self._fp8_state().metas()


def _size_arg(v, what: str) -> int:
    """A module's size argument: an integer in [0, 2**63) (ValueError naming it otherwise:
    2.5 or "1024" are not truncated or parsed)."""
    return _core.check_size(v, what)


def _params_dtype(dtype) -> torch.dtype:
    """``params_dtype``: a torch.dtype, or a name ("bf16", "float32", ...) / numpy or JAX
    dtype mapped onto torch's; TypeError naming it otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    from ._context import torch_dtype

    return torch_dtype(dtype, "params_dtype")


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
    matmuls; ub flags ignored). With ``comm_overlap=True``:

    - forward: ``ub_overlap_ag`` -> ``ops.all_gather_gemm`` (ring AG overlapped with the
      GEMM chunks), else ``dist.all_gather_into_tensor`` then a torch matmul;
    - backward: dgrad = dY @ W reduce-scattered over the tokens, wgrad = dY^T @ AG(x) with
      the input re-gathered (it is not kept gathered from the forward pass):

      * ``ub_overlap_rs_dgrad``: ``ops.gemm_reduce_scatter(dY, W, transa=False)``, the
        re-gather an async NCCL all-gather beside it;
      * else ``ub_bulk_dgrad``: userbuffers bulk all-gather of x beside the dgrad GEMM
        (``CommOverlap.bulk_overlap("ag", W, dY, transa=False)``), else a synchronous
        all-gather and a torch GEMM; then the dgrad reduce-scatter: a userbuffers bulk
        reduce-scatter beside the library's wgrad GEMM with ``ub_bulk_wgrad``
        (``CommOverlap.bulk_overlap("rs", X, dY, transa=False, transb=True)``), else
        synchronous.

    ``fp8=True`` (``fp8_recipe``: TE's DelayedScaling (default) or Float8CurrentScaling):
    forward, dgrad and wgrad GEMMs in FP8 (see the module docstring);
    ``forward(x, is_first_microbatch)`` caches the weight's FP8 cast as TE does.
    ``force_library_path``: at tp 1, run the library path anyway (benchmarks).

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
        fp8_recipe: Optional[_fp8.Recipe] = None,
        force_library_path: bool = False,
        params_dtype: torch.dtype = torch.bfloat16,
        device="cuda",
        seed: Optional[int] = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        in_features, out_features = _size_arg(in_features, "in_features"), _size_arg(out_features, "out_features")
        params_dtype = _params_dtype(params_dtype)
        self._setup_tp(tp_group, sequence_parallel, comm_overlap, fp8, fp8_recipe, force_library_path)
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
        self._cfg_obj = self._make_cfg(
            ub_overlap_ag=self.ub_overlap_ag,
            ub_overlap_rs=False,
            ub_overlap_rs_dgrad=self.ub_overlap_rs_dgrad,
            ub_bulk_dgrad=self.ub_bulk_dgrad,
            ub_bulk_wgrad=self.ub_bulk_wgrad,
        )

    def _cfg(self) -> _Cfg:
        """The communication plan (fixed at construction: the flags are read once)."""
        return self._cfg_obj

    def _fp8_groups(self):
        # The input is gathered (one scale over the group) with SP at tp > 1.
        gathered = self.sequence_parallel and self.tp_size > 1
        return (self._group_or_world() if gathered else None), None

    def _forward(self, x: torch.Tensor, gelu: bool = False, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        lead = tuple(x.shape[:-1])
        x2 = _flat(x)
        cfg = self._cfg_obj
        if self.comm_overlap or self.fp8:
            f8 = self._fp8_state() if self.fp8 else None
            y = _ColumnParallelFn.apply(x2, self.weight, self.bias, cfg, gelu, f8, is_first_microbatch,
                                        torch.is_grad_enabled())
        else:
            comm = self.tp_size > 1
            if comm and self.sequence_parallel:
                xg = _AllGatherSeq.apply(x2, self.tp_group)
            elif comm:
                xg = _AllReduceBwd.apply(x2, self.tp_group)
            else:
                xg = x2
            y = F.linear(xg, self.weight, self.bias)
            if gelu:
                y = F.gelu(y, approximate=_GELU_APPROX)
        if cfg.sp and lead:
            lead = (lead[0] * self.tp_size,) + lead[1:]
        return y.reshape(lead + (self.out_features_per_rank,))

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        return self._forward(x, gelu=False, is_first_microbatch=is_first_microbatch)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features_per_rank}/rank), bias={self.bias is not None}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}, comm_overlap={self.comm_overlap}, "
            f"ub_overlap_ag={self.ub_overlap_ag}, ub_overlap_rs_dgrad={self.ub_overlap_rs_dgrad}, "
            f"ub_bulk_dgrad={self.ub_bulk_dgrad}, ub_bulk_wgrad={self.ub_bulk_wgrad}, fp8={self.fp8}"
            + (f", fp8_recipe={self.fp8_recipe}" if self.fp8 else "")
            + (", force_library_path=True" if self.force_library_path else "")
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
      (``CommOverlap.split_overlap_ag(W, dY, transa=False)``: NN, no weight copy), which
      also returns the gathered dY (``x_copy``) for wgrad = AG(dY)^T @ x; else dY is
      all-gathered once and both GEMMs are torch GEMMs. bgrad is the column sum of the
      gathered dY (complete: no all-reduce); FP8: the all-reduced column sum of the local dY.

    The bf16 reference build (``comm_overlap=False``) adds the bias after the reduce-scatter
    and all-reduces its (token-partial) gradient over the group.

    ``fp8``, ``fp8_recipe``, ``is_first_microbatch``, ``force_library_path``: as
    :class:`ColumnParallelLinear`.

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
        fp8_recipe: Optional[_fp8.Recipe] = None,
        force_library_path: bool = False,
        params_dtype: torch.dtype = torch.bfloat16,
        device="cuda",
        seed: Optional[int] = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        in_features, out_features = _size_arg(in_features, "in_features"), _size_arg(out_features, "out_features")
        params_dtype = _params_dtype(params_dtype)
        self._setup_tp(tp_group, sequence_parallel, comm_overlap, fp8, fp8_recipe, force_library_path)
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
        self._cfg_obj = self._make_cfg(
            ub_overlap_ag=self.ub_overlap_ag,
            ub_overlap_rs=self.ub_overlap_rs,
            ub_overlap_rs_dgrad=False,
            ub_bulk_dgrad=False,
            ub_bulk_wgrad=False,
        )

    def _cfg(self) -> _Cfg:
        """The communication plan (fixed at construction: the flags are read once)."""
        return self._cfg_obj

    def _fp8_groups(self):
        # dY is gathered in the backward (one scale over the group) with SP at tp > 1.
        gathered = self.sequence_parallel and self.tp_size > 1
        return None, (self._group_or_world() if gathered else None)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        lead = tuple(x.shape[:-1])
        x2 = _flat(x)
        cfg = self._cfg_obj
        if cfg.sp:
            if not lead or lead[0] % self.tp_size:
                raise ValueError(
                    f"RowParallelLinear (sequence parallel): dim 0 of the input {tuple(x.shape)} "
                    f"must be divisible by the tensor-parallel size {self.tp_size}"
                )
            lead = (lead[0] // self.tp_size,) + lead[1:]
        if self.comm_overlap or self.fp8:
            f8 = self._fp8_state() if self.fp8 else None
            y = _RowParallelFn.apply(x2, self.weight, self.bias, cfg, f8, is_first_microbatch,
                                     torch.is_grad_enabled())
        else:
            comm = self.tp_size > 1
            y = F.linear(x2, self.weight, None if comm else self.bias)
            if comm and self.sequence_parallel:
                y = _ReduceScatterSeq.apply(y, self.tp_group)
            elif comm:
                y = _AllReduceFwd.apply(y, self.tp_group)
            if comm and self.bias is not None:
                b = self.bias
                if self.sequence_parallel:
                    b = _AllReduceBwd.apply(b, self.tp_group)
                y = y + b
        return y.reshape(lead + (self.out_features,))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features_per_rank}/rank), "
            f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}, comm_overlap={self.comm_overlap}, "
            f"ub_overlap_rs={self.ub_overlap_rs}, ub_overlap_ag={self.ub_overlap_ag}, fp8={self.fp8}"
            + (f", fp8_recipe={self.fp8_recipe}" if self.fp8 else "")
            + (", force_library_path=True" if self.force_library_path else "")
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

    The overlap build and the FP8 builds run fc1, GELU and fc2 as one autograd node (as
    TE's LayerNormMLP, which has no submodules): fc2's dgrad GEMM applies GELU's backward in
    its epilogue (DGELU) in bf16 / fp16. Two consequences: forward hooks registered on
    ``fc1`` / ``fc2`` do not fire in those builds (the node calls the layers' functions, not
    their ``forward``), and fc2's saved tensors live until fc1's gradients are done (about
    one ``[tokens, ffn/tp]`` activation more at the backward's peak than two nodes).
    ``fp8=True`` runs fc1's and fc2's forward, dgrad and wgrad GEMMs in FP8 with
    ``fp8_recipe`` (each linear layer keeps its own scaling state);
    ``forward(x, is_first_microbatch)`` is passed down to both (one weight cast per
    optimizer step with True / False). ``force_library_path``: passed down (benchmarks).

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
        fp8_recipe: Optional[_fp8.Recipe] = None,
        force_library_path: bool = False,
        params_dtype: torch.dtype = torch.bfloat16,
        device="cuda",
        seed: Optional[int] = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.hidden_size = _size_arg(hidden_size, "hidden_size")
        self.ffn_hidden_size = _size_arg(ffn_hidden_size, "ffn_hidden_size")
        params_dtype = _params_dtype(params_dtype)
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
            fp8_recipe=fp8_recipe,
            force_library_path=force_library_path,
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
        self.fp8_recipe = self.fc1.fp8_recipe
        self.force_library_path = self.fc1.force_library_path
        self._ln_allreduce = self.sequence_parallel and self.tp_size > 1
        self._layers = None  # (fc1's cfg, None, fc2's cfg, None) without FP8, built on the first forward

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        w, b = self.layer_norm_weight, self.layer_norm_bias
        if self._ln_allreduce:
            w = _AllReduceBwd.apply(w, self.tp_group)
            b = _AllReduceBwd.apply(b, self.tp_group)
        ln_out = F.layer_norm(x, (self.hidden_size,), w, b, self.eps)
        fc1, fc2 = self.fc1, self.fc2
        if not (self.comm_overlap or self.fp8):  # the reference build without FP8: torch's layers
            h = fc1._forward(ln_out, gelu=True, is_first_microbatch=is_first_microbatch)
            return fc2(h, is_first_microbatch=is_first_microbatch)
        # Both layers in one autograd node (see _MLPFn). fc1 gathers the tokens where fc2
        # scatters them (both layers share the sequence-parallel setting and the group):
        # the output has the input's shape.
        if self.fp8:  # the layers' current FP8 states (re-made when a layer moved device)
            layers = (fc1._cfg_obj, fc1._fp8_state(), fc2._cfg_obj, fc2._fp8_state())
        else:
            layers = self._layers
            if layers is None:
                layers = self._layers = (fc1._cfg_obj, None, fc2._cfg_obj, None)
        y = _MLPFn.apply(_flat(ln_out), fc1.weight, fc1.bias, fc2.weight, fc2.bias, layers, is_first_microbatch,
                         torch.is_grad_enabled())
        return y.reshape(ln_out.shape)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, eps={self.eps}, "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
            f"comm_overlap={self.comm_overlap}, fp8={self.fp8}"
            + (f", fp8_recipe={self.fp8_recipe}" if self.fp8 else "")
            + (", force_library_path=True" if self.force_library_path else "")
        )
