"""Comm-GEMM ops on torch tensors (TE's comm_gemm.h API: nvte_all_gather_gemm,
nvte_gemm_reduce_scatter, nvte_gemm_all_reduce), registered as torch custom ops
``te_comm::all_gather_gemm``, ``te_comm::gemm_reduce_scatter``, ``te_comm::gemm_all_reduce``
with fake (meta) implementations: usable eagerly, under CUDA graph capture and inside
``torch.compile(fullgraph=True)``.

Every op computes ``op(x) @ op(weight)`` with the tensor-parallel collective of its name
over a process group, asynchronously on ``torch.cuda.current_stream()``, in TE's
``nvte_cublas_gemm`` terms: A = weight, B = x, D = out [n, m]. ``transa`` / ``transb`` have
nvte_cublas_gemm's meaning: weight is [m, k] when transa (the default: ``x @ weight.T``)
and [k, m] otherwise (``x @ weight``); x is [n, k] unless transb, then [k, n] (``x.T @ ...``).
The layouts are TN (the default), NN (``transa=False``: e.g. dgrad ``dY @ W``) and NT
(``transa=False, transb=True``: e.g. wgrad ``dY.T @ X``); TT is refused (as TE), and FP8
inputs take TN only (Hopper's FP8 GEMMs). Shares follow block distribution
(:func:`numroc`: block = ceil(global / tp), the last ranks may get fewer rows, possibly
none); in the TN layout:

- ``all_gather_gemm(x [n_local, k], weight [m_local, k]) -> [n_global, m_local]``:
  x's rows are gathered from all ranks (n split), weight's rows are this rank's share of m.
- ``gemm_reduce_scatter(x [n, k_local], weight [m, k_local]) -> [numroc(n), m]``:
  k split; the sum over ranks, this rank's rows of it.
- ``gemm_all_reduce(x [n, k_local], weight [m, k_local]) -> [n, m]``: k split; the sum.

(Other layouts split the same dimensions: with transb, x is [k, n_local] / [k_local, n];
without transa, weight is [k, m_local] / [k_local, m].)

The bias is added once. ``gelu=True`` returns ``(gelu(y), y)`` with ``y`` the
pre-activation (tanh-approximate GELU, as cuBLASLt's epilogue): the all-gather GEMM fuses it
into the GEMM epilogue; the reduce-scatter / all-reduce apply it after the reduction.
FP8 (float8_e4m3fn / float8_e5m2 x and weight, not both e5m2) needs ``x_scale_inv`` and
``w_scale_inv`` (CUDA float32 one-element tensors: dequantized = fp8 value * scale_inv) and
writes ``out_dtype`` (bfloat16 by default; float16 or float32).

The first call on a group (per ``comm`` / ``transport``) creates the group's context:
collective, and not allowed during CUDA graph capture — run every op once eagerly with the
shapes you will capture (the library sizes its buffers on demand) before capturing.
Captured calls replay correctly on both transports (the library's peer waits read
device-resident call counters).

Host cost: a plain eager call (see :func:`_direct`) whose arguments have the shapes,
dtypes, devices and options of an earlier call reuses that call's validated plan (one
``nvte_comm_gemm_call_packed`` through ctypes, its argument struct filled in place); only
what may change between such calls (data pointers, contiguity, the current stream, grad
mode) is looked at again. The plans are dropped with the contexts (destroy_contexts).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import _capi, _core
from . import _context
from ._context import (
    DTYPES,
    FP8_DTYPES,
    block_offset,
    context_device,
    get_context,
    group_name_of,
    numroc,
    raw_stream,
    set_packed_operand,
)

__all__ = [
    "GemmAlgo",
    "all_gather_gemm",
    "block_offset",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "numroc",
    "set_debug_poison",
]


# NVTECommGemmAlgoType with short names (DEFAULT, SPLIT_P2P, ...), from the core.
GemmAlgo = _core.Algo

_poison = os.environ.get("TE_COMM_TORCH_POISON", "") not in ("", "0")


def set_debug_poison(enabled: bool) -> None:
    """Debugging / tests: fill every output with NaN before the library writes it (so an
    output the library failed to write cannot pass as correct)."""
    global _poison
    _poison = bool(enabled)


_algo_id = _core.algo_id


# ----------------------------------------------------------------------------- validation
#
# The rules (layouts, dtypes, block distribution, shapes) are the core's
# (transformer_engine_comm._core); here: the torch tensors' own checks, and the group's size
# and rank. A plan is made once per argument signature (see _prepared), and by the fake
# implementations when torch traces.

_Plan = _core.Plan


def _group_size_rank(group_name: str) -> Tuple[int, int]:
    pg = dist.distributed_c10d._resolve_process_group(group_name)
    return pg.size(), pg.rank()


def _check_tensor(op: str, what: str, t, ndim: Optional[int] = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cuda", "meta"):
        raise ValueError(f"{op}: {what} must be a CUDA tensor, got one on {t.device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {what} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {what} must be contiguous (row-major), got strides {t.stride()}")


def _check_scale_inv(op: str, what: str, t, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor for FP8 inputs, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(
            f"{op}: {what} must be a float32 tensor with one element, got {t.dtype} shape {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{op}: {what} is on {t.device} but x is on {device}")


_check_trans = _core.check_trans


def _check_common(
    op: str,
    x,
    weight,
    bias,
    x_scale_inv,
    w_scale_inv,
    out_dtype: Optional[torch.dtype],
    comm_sm_count: int,
    transa: bool = True,
    transb: bool = False,
) -> Tuple[bool, torch.dtype]:
    """Checks shared by the three ops; returns (fp8, output dtype)."""
    _check_tensor(op, "x", x)
    _check_tensor(op, "weight", weight)
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device} but x is on {x.device}")

    def check_scales():
        _check_scale_inv(op, "x_scale_inv", x_scale_inv, x.device)
        _check_scale_inv(op, "w_scale_inv", w_scale_inv, x.device)

    def check_bias():
        _check_tensor(op, "bias", bias, ndim=None)
        if bias.device != x.device:
            raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")

    return _core.check_operands(
        op, DTYPES, x.shape, x.dtype, weight.shape, weight.dtype, transa=transa, transb=transb, out_dtype=out_dtype,
        has_scales=x_scale_inv is not None or w_scale_inv is not None, check_fp8_scales=check_scales,
        b_dtype=None if bias is None else bias.dtype, check_bias=check_bias, comm_sm_count=comm_sm_count)


def _given(v: int) -> Optional[int]:
    """A registered op's global size argument: -1 (not given) -> None."""
    return None if v < 0 else v


def _plan_ag(x, weight, bias, x_scale_inv, w_scale_inv, group_name, n_global, m_global, out_dtype, gelu, comm_sm_count,
             transa=True, transb=False) -> _Plan:
    op = "te_comm.all_gather_gemm"
    fp8, od = _check_common(op, x, weight, bias, x_scale_inv, w_scale_inv, out_dtype, comm_sm_count, transa, transb)
    tp, rank = _group_size_rank(group_name)
    return _core.plan_all_gather(op, x.shape, weight.shape, nranks=tp, rank=rank, transa=transa, transb=transb,
                                 n_global=_given(n_global), m_global=_given(m_global), out_dtype=od, fp8=fp8,
                                 bias_numel=None if bias is None else bias.numel(), gelu=gelu)


def _plan_k_split(op, x, weight, bias, x_scale_inv, w_scale_inv, group_name, k_global, out_dtype, comm_sm_count,
                  scatter: bool, out_rows: int = -1, transa: bool = True, transb: bool = False) -> _Plan:
    fp8, od = _check_common(op, x, weight, bias, x_scale_inv, w_scale_inv, out_dtype, comm_sm_count, transa, transb)
    tp, rank = _group_size_rank(group_name)
    return _core.plan_k_split(op, x.shape, weight.shape, nranks=tp, rank=rank, scatter=scatter, transa=transa,
                              transb=transb, k_global=_given(k_global), out_rows=out_rows, out_dtype=od, fp8=fp8,
                              bias_numel=None if bias is None else bias.numel())


# ----------------------------------------------------------------------------- execution

_PACKED_OPS = _core.PACKED_OPS


class _Prepared:
    """One validated call: the context, the packed argument struct with everything but the
    data pointers and the stream filled in, and the output's shape and dtype. Calling it
    allocates the output(s), fills the pointers and the current stream, and makes the one C
    call (``nvte_comm_gemm_call_packed``). Thread-safe (a lock guards the struct: the
    autograd engine's threads may call too)."""

    __slots__ = ("what", "ctx", "ctx_h", "fn", "args", "ptr", "pa", "pb", "pd", "pbias", "ppre", "out_shape",
                 "out_dtype", "device", "dev", "gelu_pre", "fp8", "has_bias", "lock")

    def __init__(self, fn_name: str, ctx, p: _Plan, x, weight, bias, x_scale_inv, w_scale_inv, gelu_pre: bool,
                 algo: int, comm_sm_count: int, transa: bool, transb: bool):
        self.what = f"te_comm.{fn_name}"
        self.fn = _capi._fn("nvte_comm_gemm_call_packed")
        self.ctx = ctx  # keeps the context object alive
        self.ctx_h = ctx.handle
        a = _capi.GemmPacked()
        a.op = _PACKED_OPS[fn_name]
        a.comm_sm_count = int(comm_sm_count)
        a.m, a.n, a.k = p.m, p.n, p.k
        set_packed_operand(a.a, weight, tuple(weight.shape), weight.dtype, w_scale_inv if p.fp8 else None)
        set_packed_operand(a.b, x, tuple(x.shape), x.dtype, x_scale_inv if p.fp8 else None)
        set_packed_operand(a.d, None, p.out_shape, p.out_dtype)
        if bias is not None:
            set_packed_operand(a.bias, bias, (bias.numel(),), bias.dtype)
        if gelu_pre:
            set_packed_operand(a.pre_act_out, None, p.out_shape, p.out_dtype)
        a.transa, a.transb = bool(transa), bool(transb)
        a.grad = a.accumulate = False
        a.algo = int(algo)
        self.args = a
        self.ptr = ctypes.pointer(a)
        # The embedded operand structs share the struct's memory: set through them per call.
        self.pa, self.pb, self.pd, self.pbias, self.ppre = a.a, a.b, a.d, a.bias, a.pre_act_out
        self.out_shape = p.out_shape
        self.out_dtype = p.out_dtype
        self.device = x.device
        self.dev = x.device.index
        self.gelu_pre = bool(gelu_pre)
        self.fp8 = p.fp8
        self.has_bias = bias is not None
        self.lock = threading.Lock()

    def __call__(self, x, weight, bias, x_scale_inv, w_scale_inv):
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        pre = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device) if self.gelu_pre else None
        if _poison:
            out.fill_(float("nan"))
            if pre is not None:
                pre.fill_(float("nan"))
        err = None
        with self.lock:
            self.pa.data = weight.data_ptr()
            self.pb.data = x.data_ptr()
            self.pd.data = out.data_ptr()
            if self.has_bias:
                self.pbias.data = bias.data_ptr()
            if pre is not None:
                self.ppre.data = pre.data_ptr()
            if self.fp8:
                self.pa.scale_inv = w_scale_inv.data_ptr()
                self.pb.scale_inv = x_scale_inv.data_ptr()
            self.args.stream = raw_stream(self.dev)
            status = self.fn(self.ctx_h, self.ptr)
            if status:
                err = _capi.CommError(status, _capi.last_error(), self.what)  # the thread's message, now
        if err is not None:
            self._raise(err)
        return out, pre

    def _raise(self, e):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.what} failed during CUDA graph capture: {e}. The library allocates "
                "its buffers on the first call of each size: run the op eagerly with the same "
                "shapes and dtypes before capturing."
            ) from e
        raise e


# Prepared calls: by the registered op's arguments (_plans) and by a public function's
# own arguments on the eager direct path (_fast). Bounded; dropped with the contexts.
_plans: dict = {}
_fast: dict = {}
_MAX_PLANS = 1024


def _remember(cache: dict, key, value) -> None:
    if len(cache) >= _MAX_PLANS:
        cache.clear()
    try:
        cache[key] = value
    except TypeError:  # an unhashable argument: no caching
        pass


def clear_prepared_calls() -> None:
    """Drop every prepared call (they hold the contexts; destroy_contexts calls this)."""
    _plans.clear()
    _fast.clear()


_context.register_destroy_hook(clear_prepared_calls)


def _sig(t):
    return None if t is None else (t.shape, t.dtype, t.get_device())


def _prepared(fn_name: str, key, plan_fn, group_name, comm, transport, x, weight, bias, x_scale_inv, w_scale_inv,
              gelu_pre, algo, comm_sm_count, transa, transb) -> _Prepared:
    try:
        pr = _plans.get(key)
    except TypeError:
        pr = None
    if pr is not None:
        return pr
    p = plan_fn()
    pg = dist.distributed_c10d._resolve_process_group(group_name)
    ctx = get_context(pg, comm=comm, transport=transport or None)
    dev = context_device(ctx)
    if dev is not None and x.device.index != dev:
        raise ValueError(f"te_comm.{fn_name}: x is on {x.device} but the group's context was created on cuda:{dev}")
    pr = _Prepared(fn_name, ctx, p, x, weight, bias, x_scale_inv, w_scale_inv, gelu_pre, algo, comm_sm_count, transa,
                   transb)
    _remember(_plans, key, pr)
    return pr


def _contig(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


# ----------------------------------------------------------------------------- custom ops
#
# Each op is a plain function (``_<op>_impl``) registered as a torch custom op. The public
# functions call the registered op through torch's dispatcher where it matters (inside
# torch.compile / tracing, functorch transforms, under dispatch or function modes such as
# fake tensors, while the profiler records, for meta / CPU tensors and tensor subclasses,
# and where autograd would record the call), and the function itself otherwise: the
# dispatcher's custom-op layers cost about 100 us of host time per call (bench/RESULTS.md,
# 2026-11-24 session 3), which showed in every call whose GPU work is shorter, e.g. the
# autograd modules' backward and their forward under no_grad. A direct call whose
# arguments match an earlier one's (shapes, dtypes, devices, options) reuses its prepared
# call (``_fast``): no validation or planning again, one C call.


def _direct(*tensors) -> bool:
    """Whether a call may run the op's function directly: eager (not compiling or tracing,
    no functorch transform), no dispatch or function mode in effect, the profiler off, and
    plain CUDA ``torch.Tensor`` / ``nn.Parameter`` arguments (None allowed) without
    negative / conjugate bits that autograd would not track. Where this holds, the
    dispatcher would only run the same function."""
    if _is_compiling() or _tracing_state() is not None:
        return False
    if _get_current_dispatch_mode() is not None or _function_mode_enabled():
        return False
    if _profiler_enabled() or _functorch_active():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or not t.is_cuda or (grad and t.requires_grad):
            return False
        if t.is_neg() or t.is_conj() or _functorch_wrapped(t):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Looked up once (every call asks): torch's current dispatch mode, and functorch's
# interpreter stack / wrapped-tensor test where this torch has them.
_PEEK_FUNCTORCH = getattr(torch._C._functorch, "peek_interpreter_stack", None)
_IS_FUNCTORCH_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_profiler_enabled = torch.autograd._profiler_enabled


def _dispatch_mode():
    return _get_current_dispatch_mode()


def _functorch_active() -> bool:
    return _PEEK_FUNCTORCH is not None and _PEEK_FUNCTORCH() is not None


def _functorch_wrapped(t) -> bool:
    return _IS_FUNCTORCH_WRAPPED is not None and bool(_IS_FUNCTORCH_WRAPPED(t))


def _contiguous(x, weight, bias) -> bool:
    return x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous())


def _ag_run(x, weight, bias, x_scale_inv, w_scale_inv, group_name, n_global, m_global, out_dtype, gelu, algo,
            comm_sm_count, comm, transport, transa, transb):
    """(out, pre or None, the prepared call)."""
    x, weight, bias = _contig(x), _contig(weight), _contig(bias)
    key = ("ag", group_name, comm, transport, n_global, m_global, out_dtype, gelu, algo, comm_sm_count, transa, transb,
           _sig(x), _sig(weight), _sig(bias), _sig(x_scale_inv), _sig(w_scale_inv))
    pr = _prepared(
        "all_gather_gemm", key,
        lambda: _plan_ag(x, weight, bias, x_scale_inv, w_scale_inv, group_name, n_global, m_global, out_dtype, gelu,
                         comm_sm_count, transa, transb),
        group_name, comm, transport, x, weight, bias, x_scale_inv, w_scale_inv, gelu, algo, comm_sm_count, transa,
        transb)
    out, pre = pr(x, weight, bias, x_scale_inv, w_scale_inv)
    return out, pre, pr


def _all_gather_gemm_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    x_scale_inv: Optional[torch.Tensor],
    w_scale_inv: Optional[torch.Tensor],
    group_name: str,
    n_global: int,
    m_global: int,
    out_dtype: Optional[torch.dtype],
    gelu: bool,
    algo: int,
    comm_sm_count: int,
    comm: str,
    transport: str,
    transa: bool,
    transb: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    out, pre, _ = _ag_run(x, weight, bias, x_scale_inv, w_scale_inv, group_name, n_global, m_global, out_dtype, gelu,
                          algo, comm_sm_count, comm, transport, transa, transb)
    if pre is None:
        pre = out.new_empty((0,))
    return out, pre


_all_gather_gemm_op = torch.library.custom_op("te_comm::all_gather_gemm", mutates_args=())(_all_gather_gemm_impl)


@_all_gather_gemm_op.register_fake
def _(x, weight, bias, x_scale_inv, w_scale_inv, group_name, n_global, m_global, out_dtype, gelu, algo, comm_sm_count, comm,
      transport, transa, transb):
    p = _plan_ag(x, weight, bias, x_scale_inv, w_scale_inv, group_name, n_global, m_global, out_dtype, gelu, comm_sm_count,
                 transa, transb)
    out = x.new_empty(p.out_shape, dtype=p.out_dtype)
    pre = x.new_empty(p.out_shape if gelu else (0,), dtype=p.out_dtype)
    return out, pre


def _k_split_run(fn_name, x, weight, bias, x_scale_inv, w_scale_inv, group_name, k_global, out_rows, out_dtype, algo,
                 comm_sm_count, comm, transport, transa, transb):
    """(out, the prepared call) of the reduce-scatter (out_rows >= 0) or the all-reduce."""
    x, weight, bias = _contig(x), _contig(weight), _contig(bias)
    scatter = fn_name == "gemm_reduce_scatter"
    key = (fn_name, group_name, comm, transport, k_global, out_rows, out_dtype, algo, comm_sm_count, transa, transb,
           _sig(x), _sig(weight), _sig(bias), _sig(x_scale_inv), _sig(w_scale_inv))
    pr = _prepared(
        fn_name, key,
        lambda: _plan_k_split(f"te_comm.{fn_name}", x, weight, bias, x_scale_inv, w_scale_inv, group_name, k_global,
                              out_dtype, comm_sm_count, scatter=scatter, out_rows=out_rows, transa=transa,
                              transb=transb),
        group_name, comm, transport, x, weight, bias, x_scale_inv, w_scale_inv, False, algo, comm_sm_count, transa,
        transb)
    out, _ = pr(x, weight, bias, x_scale_inv, w_scale_inv)
    return out, pr


def _gemm_reduce_scatter_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    x_scale_inv: Optional[torch.Tensor],
    w_scale_inv: Optional[torch.Tensor],
    group_name: str,
    k_global: int,
    out_rows: int,
    out_dtype: Optional[torch.dtype],
    algo: int,
    comm_sm_count: int,
    comm: str,
    transport: str,
    transa: bool,
    transb: bool,
) -> torch.Tensor:
    return _k_split_run("gemm_reduce_scatter", x, weight, bias, x_scale_inv, w_scale_inv, group_name, k_global, out_rows,
                        out_dtype, algo, comm_sm_count, comm, transport, transa, transb)[0]


_gemm_reduce_scatter_op = torch.library.custom_op("te_comm::gemm_reduce_scatter", mutates_args=())(_gemm_reduce_scatter_impl)


@_gemm_reduce_scatter_op.register_fake
def _(x, weight, bias, x_scale_inv, w_scale_inv, group_name, k_global, out_rows, out_dtype, algo, comm_sm_count, comm,
      transport, transa, transb):
    p = _plan_k_split("te_comm.gemm_reduce_scatter", x, weight, bias, x_scale_inv, w_scale_inv, group_name,
                      k_global, out_dtype, comm_sm_count, scatter=True, out_rows=out_rows, transa=transa, transb=transb)
    return x.new_empty(p.out_shape, dtype=p.out_dtype)


def _gemm_all_reduce_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    x_scale_inv: Optional[torch.Tensor],
    w_scale_inv: Optional[torch.Tensor],
    group_name: str,
    k_global: int,
    out_dtype: Optional[torch.dtype],
    algo: int,
    comm_sm_count: int,
    comm: str,
    transport: str,
    transa: bool,
    transb: bool,
) -> torch.Tensor:
    return _k_split_run("gemm_all_reduce", x, weight, bias, x_scale_inv, w_scale_inv, group_name, k_global, -1,
                        out_dtype, algo, comm_sm_count, comm, transport, transa, transb)[0]


_gemm_all_reduce_op = torch.library.custom_op("te_comm::gemm_all_reduce", mutates_args=())(_gemm_all_reduce_impl)


@_gemm_all_reduce_op.register_fake
def _(x, weight, bias, x_scale_inv, w_scale_inv, group_name, k_global, out_dtype, algo, comm_sm_count, comm, transport,
      transa, transb):
    p = _plan_k_split("te_comm.gemm_all_reduce", x, weight, bias, x_scale_inv, w_scale_inv, group_name,
                      k_global, out_dtype, comm_sm_count, scatter=False, transa=transa, transb=transb)
    return x.new_empty(p.out_shape, dtype=p.out_dtype)


# ----------------------------------------------------------------------------- public API


_opt_int = _core.opt_size


def _check_layout(op: str, x, weight, bias, transa, transb) -> None:
    # The custom ops make inputs contiguous (compiled graphs may hand them other strides);
    # a caller passing a transposed view gets an error here instead of a silent copy.
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must have 2 dimensions, got shape {tuple(t.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            hint = ""
            if name in ("x", "weight") and t.t().is_contiguous():
                flag = "transb" if name == "x" else "transa"
                hint = f" (a transposed view: pass the contiguous tensor and flip {flag} instead of copying)"
            raise ValueError(
                f"{op}: {name} must be contiguous (row-major), got shape {tuple(t.shape)} strides {t.stride()}{hint}"
            )
    for name, v in (("transa", transa), ("transb", transb)):
        if not isinstance(v, (bool, int)):
            raise TypeError(f"{op}: {name} must be a bool, got {type(v).__name__}")
    fp8 = x.dtype in FP8_DTYPES or weight.dtype in FP8_DTYPES
    _check_trans(op, transa, transb, fp8)


def _size_rank(group, op: str = "te_comm") -> Tuple[int, int]:
    # ProcessGroup.size() / .rank() are constants to dynamo (no graph break).
    pg = _context.check_group_arg(group, op)  # None: the world group, or an error saying it is missing
    if isinstance(pg, str):
        pg = dist.distributed_c10d._resolve_process_group(pg)
    return pg.size(), pg.rank()


def _out_dtype_arg(op: str, out_dtype):
    """``out_dtype`` as a torch.dtype (None kept): names ("bf16", "float32", ...) and
    numpy / JAX dtypes are converted (TypeError naming it otherwise)."""
    if out_dtype is None or type(out_dtype) is torch.dtype:
        return out_dtype
    return _context.torch_dtype(out_dtype, f"{op}: out_dtype")


_kind_args = _core.check_op_kind


def _fast_get(key):
    try:
        return _fast.get(key)
    except TypeError:  # an unhashable argument
        return None


def all_gather_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    gelu: bool = False,
    n_global: Optional[int] = None,
    m_global: Optional[int] = None,
    x_scale_inv: Optional[torch.Tensor] = None,
    w_scale_inv: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    algo: Union[str, int] = "default",
    comm_sm_count: int = 0,
    comm: str = "pg",
    transport: Optional[str] = None,
    transa: bool = True,
    transb: bool = False,
):
    """``AG(x) @ weight.T (+ bias)``: x [n_local, k] = this rank's rows (n split),
    weight [m_local, k] = this rank's rows of the weight (m split) -> [n_global, m_local].

    transa=False: weight is [k, m_local] (``AG(x) @ weight``, NN); transb=True (with
    transa=False): x is [k, n_local], gathered along its columns (``AG(x).T @ weight``,
    NT). n_global / m_global: the global sizes; required when the shares are uneven (block
    distribution, see numroc), else n_local * tp / m_local * tp. gelu=True returns
    ``(gelu(y), y)``. group: a ProcessGroup (None = world). comm: "pg" (the group's NCCL
    communicator) or "own"; transport: None, "auto", "ipc" or "nccl" (see get_context).
    """
    if out_dtype is not None and type(out_dtype) is not torch.dtype:
        out_dtype = _out_dtype_arg("te_comm.all_gather_gemm", out_dtype)
    direct = _direct(x, weight, bias, x_scale_inv, w_scale_inv)
    if direct:
        key = ("ag", group, gelu, n_global, m_global, out_dtype, algo, comm_sm_count, comm, transport, transa, transb,
               _sig(x), _sig(weight), _sig(bias), _sig(x_scale_inv), _sig(w_scale_inv))
        pr = _fast_get(key)
        if pr is not None and _contiguous(x, weight, bias):
            out, pre = pr(x, weight, bias, x_scale_inv, w_scale_inv)
            return (out, pre) if gelu else out
    op = "te_comm.all_gather_gemm"
    _check_layout(op, x, weight, bias, transa, transb)
    comm_, transport_ = _kind_args(comm, transport)
    _core.check_int(op, "comm_sm_count", comm_sm_count)  # its range: with the other rules
    # Concrete global sizes: the op's output shape must follow from its arguments alone
    # (compiled-graph caches are shared by ranks and by runs with other group sizes).
    n = _opt_int(n_global, "n_global")
    m = _opt_int(m_global, "m_global")
    size, _ = _size_rank(group, op)
    nl, _, ml, _ = _core.operand_dims(x.shape, weight.shape, transa, transb)
    args = (
        x, weight, bias, x_scale_inv, w_scale_inv, group_name_of(group),
        nl * size if n < 0 else n, ml * size if m < 0 else m, out_dtype, bool(gelu),
        _algo_id(algo), int(comm_sm_count), comm_, transport_, bool(transa), bool(transb),
    )
    if direct:
        out, pre, pr = _ag_run(*args)
        _remember(_fast, key, pr)
    else:
        out, pre = torch.ops.te_comm.all_gather_gemm(*args)
    return (out, pre) if gelu else out


def gemm_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    gelu: bool = False,
    k_global: Optional[int] = None,
    x_scale_inv: Optional[torch.Tensor] = None,
    w_scale_inv: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    algo: Union[str, int] = "default",
    comm_sm_count: int = 0,
    comm: str = "pg",
    transport: Optional[str] = None,
    transa: bool = True,
    transb: bool = False,
):
    """``RS_rows(x @ weight.T) (+ bias once)``: x [n, k_local], weight [m, k_local] (k split)
    -> this rank's rows [numroc(n), m] of the sum over ranks. transa=False: weight is
    [k_local, m] (``x @ weight``, NN, e.g. dgrad ``dY @ W``); transb=True (with
    transa=False): x is [k_local, n] (NT). k_global: the global k, required when the k
    shares are uneven. gelu=True returns ``(gelu(y), y)`` (applied after the reduction)."""
    if out_dtype is not None and type(out_dtype) is not torch.dtype:
        out_dtype = _out_dtype_arg("te_comm.gemm_reduce_scatter", out_dtype)
    direct = _direct(x, weight, bias, x_scale_inv, w_scale_inv)
    if direct:
        key = ("rs", group, k_global, out_dtype, algo, comm_sm_count, comm, transport, transa, transb,
               _sig(x), _sig(weight), _sig(bias), _sig(x_scale_inv), _sig(w_scale_inv))
        pr = _fast_get(key)
        if pr is not None and _contiguous(x, weight, bias):
            y = pr(x, weight, bias, x_scale_inv, w_scale_inv)[0]
            return (F.gelu(y, approximate="tanh"), y) if gelu else y
    op = "te_comm.gemm_reduce_scatter"
    _check_layout(op, x, weight, bias, transa, transb)
    comm_, transport_ = _kind_args(comm, transport)
    _core.check_int(op, "comm_sm_count", comm_sm_count)  # its range: with the other rules
    k = _opt_int(k_global, "k_global")
    size, rank = _size_rank(group, op)
    n, kl, _, _ = _core.operand_dims(x.shape, weight.shape, transa, transb)
    args = (
        x, weight, bias, x_scale_inv, w_scale_inv, group_name_of(group), kl * size if k < 0 else k,
        numroc(n, size, rank), out_dtype, _algo_id(algo), int(comm_sm_count), comm_, transport_, bool(transa),
        bool(transb),
    )
    if direct:
        y, pr = _k_split_run("gemm_reduce_scatter", *args)
        _remember(_fast, key, pr)
    else:
        y = torch.ops.te_comm.gemm_reduce_scatter(*args)
    return (F.gelu(y, approximate="tanh"), y) if gelu else y


def gemm_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group=None,
    gelu: bool = False,
    k_global: Optional[int] = None,
    x_scale_inv: Optional[torch.Tensor] = None,
    w_scale_inv: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    algo: Union[str, int] = "default",
    comm_sm_count: int = 0,
    comm: str = "pg",
    transport: Optional[str] = None,
    transa: bool = True,
    transb: bool = False,
):
    """``AR(x @ weight.T) (+ bias once)``: x [n, k_local], weight [m, k_local] (k split) ->
    [n, m] on every rank. transa / transb as in gemm_reduce_scatter; k_global as there;
    gelu=True returns ``(gelu(y), y)`` (applied after the reduction)."""
    if out_dtype is not None and type(out_dtype) is not torch.dtype:
        out_dtype = _out_dtype_arg("te_comm.gemm_all_reduce", out_dtype)
    direct = _direct(x, weight, bias, x_scale_inv, w_scale_inv)
    if direct:
        key = ("ar", group, k_global, out_dtype, algo, comm_sm_count, comm, transport, transa, transb,
               _sig(x), _sig(weight), _sig(bias), _sig(x_scale_inv), _sig(w_scale_inv))
        pr = _fast_get(key)
        if pr is not None and _contiguous(x, weight, bias):
            y = pr(x, weight, bias, x_scale_inv, w_scale_inv)[0]
            return (F.gelu(y, approximate="tanh"), y) if gelu else y
    op = "te_comm.gemm_all_reduce"
    _check_layout(op, x, weight, bias, transa, transb)
    comm_, transport_ = _kind_args(comm, transport)
    _core.check_int(op, "comm_sm_count", comm_sm_count)  # its range: with the other rules
    k = _opt_int(k_global, "k_global")
    size, _ = _size_rank(group, op)
    _, kl, _, _ = _core.operand_dims(x.shape, weight.shape, transa, transb)
    args = (
        x, weight, bias, x_scale_inv, w_scale_inv, group_name_of(group), kl * size if k < 0 else k,
        out_dtype, _algo_id(algo), int(comm_sm_count), comm_, transport_, bool(transa), bool(transb),
    )
    if direct:
        y, pr = _k_split_run("gemm_all_reduce", *args[:7], -1, *args[7:])
        _remember(_fast, key, pr)
    else:
        y = torch.ops.te_comm.gemm_all_reduce(*args)
    return (F.gelu(y, approximate="tanh"), y) if gelu else y
