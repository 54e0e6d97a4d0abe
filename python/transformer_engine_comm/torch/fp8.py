"""FP8 with per-tensor scaling for torch: Transformer Engine's recipes and the quantization
primitives they run on.

Recipes (TE's names, fields and defaults, ``transformer_engine.common.recipe``): the
framework-neutral classes of :mod:`transformer_engine_comm.recipe`, the same ones
``transformer_engine_comm.jax.fp8`` exports; this module adds their torch dtypes
(:func:`torch_dtype`, :func:`fwd_dtype`, :func:`bwd_dtype`, :func:`dtypes`):

- :class:`DelayedScaling` -- the scale of step t comes from an amax history of the steps
  before it: ``scale = (fp8_max / amax) / 2**margin`` with amax the maximum
  (``amax_compute_algo="max"``) or the newest entry (``"most_recent"``) of the history.
  One pass over the data per cast: the cast writes the tensor's amax into the history.
- :class:`Float8CurrentScaling` -- the scale comes from the tensor itself: an amax pass,
  a one-thread scale kernel, then the cast (two passes over the data).

``fp8_format``: :attr:`Format.HYBRID` (TE's default: e4m3 for forward tensors -- inputs
and weights --, e5m2 for gradients), :attr:`Format.E4M3` (e4m3 everywhere).
``Format.X.fwd`` / ``.bwd`` are dtype names (``"float8_e4m3fn"``); ``fwd_dtype(fmt)`` /
``bwd_dtype(fmt)`` the torch dtypes. The primitives and :class:`Fp8Meta` take an FP8
dtype as a torch dtype or by name.

Primitives (functional, on torch tensors; CUDA tensors run the library's kernels
``nvte_quantize`` (rowwise and transposed columnwise output from one kernel),
``nvte_compute_amax``, ``nvte_compute_scale_from_amax``,
``nvte_delayed_scaling_recipe_amax_and_scale_update``, ``nvte_transpose``,
``nvte_dequantize`` on torch's current stream; other tensors, and
``reference=True``, run the same arithmetic as plain torch ops -- the reference the
library's kernels are tested against bit for bit):

- :func:`quantize` ``q = fp8(clamp(x * scale, -fp8_max, fp8_max))`` (saturating; NaN stays
  NaN), optionally its transpose in the same pass, the amax folded into a given amax
  tensor (a running maximum: not reset) and ``scale_inv = 1 / scale`` written;
- :func:`compute_amax`, :func:`compute_scale_from_amax`, :func:`delayed_scaling_update`,
  :func:`transpose`, :func:`dequantize`.

State: :class:`Fp8Meta` keeps one tensor role's scaling state (amax history, scale) on the
device and casts with its recipe; :class:`Fp8Tensor` is a cast result (rowwise data,
optional columnwise = transposed data, and its own ``scale_inv``). Nothing here reads a
value back to the host, so every cast can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _core
from ._context import raw_stream
from ..recipe import AMAX_COMPUTE_ALGOS as _AMAX_ALGOS
from ..recipe import BLOCK_LEN, block_scale_shape
from ..recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams, QParams
from ..recipe import Recipe, recipe_from_name

__all__ = [
    "BLOCK_LEN",
    "BlockFp8Tensor",
    "BlockOperand",
    "DelayedScaling",
    "Float8BlockScaling",
    "MMParams",
    "QParams",
    "block_gemm",
    "block_scale_shape",
    "dequantize_block",
    "quantize_block",
    "Float8CurrentScaling",
    "Format",
    "Fp8Meta",
    "Fp8Tensor",
    "FP8_MAX",
    "Recipe",
    "bwd_dtype",
    "compute_amax",
    "compute_scale_from_amax",
    "delayed_scaling_update",
    "dequantize",
    "dtypes",
    "fwd_dtype",
    "delayed_states",
    "keep_delayed_states",
    "quantize",
    "recipe_from_name",
    "torch_dtype",
    "transpose",
]

_HIGH = (torch.float32, torch.bfloat16, torch.float16)  # the casts' input dtypes
_CAST_AMAX, _CAST_SCALE, _CAST_QUANTIZE, _CAST_UPDATE = (_core.CAST_AMAX, _core.CAST_SCALE, _core.CAST_QUANTIZE,
                                                         _core.CAST_UPDATE)
E4M3 = getattr(torch, _core.E4M3)
E5M2 = getattr(torch, _core.E5M2)
FP8_DTYPES = (E4M3, E5M2)
FP8_MAX = {getattr(torch, n): v for n, v in _core.FP8_MAX.items()}
_FLOAT_MAX = torch.finfo(torch.float32).max


# ------------------------------------------------------------------- recipes' dtypes


def torch_dtype(dtype) -> torch.dtype:
    """The torch FP8 dtype of ``dtype``: a torch FP8 dtype, or a name (the core's canonical
    names -- ``Format.X.fwd`` / ``.bwd``, ``recipe.dtypes`` -- or an alias such as ``"e4m3"``)."""
    if isinstance(dtype, torch.dtype):
        if dtype in FP8_MAX:
            return dtype
    elif isinstance(dtype, str):
        try:
            name = _core.dtype_name(dtype)
        except (TypeError, ValueError):
            name = None
        if name in _core.FP8_MAX:
            return getattr(torch, name)
    raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2 (or their names), got {dtype!r}")


def _format_of(what) -> Format:
    fmt = getattr(what, "fp8_format", what)
    if not isinstance(fmt, Format):
        raise TypeError(f"expected a Format or a recipe, got {what!r}")
    return fmt


def fwd_dtype(fmt) -> torch.dtype:
    """The forward (inputs, weights) torch dtype of a :class:`Format` or a recipe."""
    return getattr(torch, _format_of(fmt).fwd)


def bwd_dtype(fmt) -> torch.dtype:
    """The backward (gradients) torch dtype of a :class:`Format` or a recipe."""
    return getattr(torch, _format_of(fmt).bwd)


def dtypes(recipe: Recipe) -> Tuple[torch.dtype, torch.dtype, torch.dtype]:
    """The torch dtypes of (input, weight, output gradient) under ``recipe``."""
    return tuple(getattr(torch, n) for n in recipe.dtypes)


# ------------------------------------------------------------------------------ checks


def _check_fp8_dtype(fp8_dtype) -> Tuple[torch.dtype, float]:
    dt = torch_dtype(fp8_dtype)
    return dt, FP8_MAX[dt]


def _check_scalar(t, what: str, like: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(f"{what} must be a one-element float32 tensor, got "
                         f"{getattr(t, 'dtype', type(t))} with {getattr(t, 'numel', lambda: '?')()} elements")
    if t.device != like.device:
        raise ValueError(f"{what} is on {t.device} but the data is on {like.device}")


def _as_2d_shape(x: torch.Tensor) -> Tuple[int, int]:
    if x.dim() == 0:
        return 1, 1
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


# ---------------------------------------------------------------- library dispatch point
#
# CUDA tensors go to the library's kernels through `_library()` (the ctypes binding of
# nvte_quantize & co.); a None backend (a library without these functions) or
# reference=True runs the torch arithmetic below, which is also the bit-exact reference.


def _library():
    """The library backend for CUDA tensors, or None (loaded on first use from
    ``transformer_engine_comm.torch._fp8_lib``)."""
    global _BACKEND, _BACKEND_LOADED
    if not _BACKEND_LOADED:
        _BACKEND_LOADED = True
        from . import _fp8_lib

        _BACKEND = _fp8_lib.backend()
    return _BACKEND


_BACKEND = None
_BACKEND_LOADED = False


def _use_library(x: torch.Tensor, reference: bool) -> bool:
    return not reference and x.is_cuda and _library() is not None


# ------------------------------------------------------------------------- primitives


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    # max|x| as the kernels compute it (fmaxf): NaN elements are ignored, inf counts.
    return x.abs().float().nan_to_num(nan=0.0, posinf=float("inf")).amax()


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    *,
    amax: Optional[torch.Tensor] = None,
    scale_inv: Optional[torch.Tensor] = None,
    rowwise: bool = True,
    columnwise: bool = False,
    reference: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Cast ``x`` (float32 / bfloat16 / float16) to ``fp8_dtype`` with ``scale``.

    Returns ``(q, q_t)``: ``q = fp8(clamp(x * scale, -max, max))`` in ``x``'s shape when
    ``rowwise``, and when ``columnwise`` the transpose of the 2-D view (``x`` flattened to
    ``[rows, x.shape[-1]]``): ``q_t`` is ``[x.shape[-1], rows]``; the other is None.
    ``amax`` (one-element float32): ``amax = max(amax, max|x|)`` (a running maximum, as
    TE's cast; it is not reset). ``scale_inv`` (one-element float32): set to ``1 / scale``.
    """
    fp8_dtype, fmax = _check_fp8_dtype(fp8_dtype)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize: x must be float32, bfloat16 or float16, got {x.dtype}")
    if not (rowwise or columnwise):
        raise ValueError("quantize: ask for rowwise and/or columnwise output")
    _check_scalar(scale, "scale", x)
    if amax is not None:
        _check_scalar(amax, "amax", x)
    if scale_inv is not None:
        _check_scalar(scale_inv, "scale_inv", x)
    x = x.contiguous()
    if _use_library(x, reference):
        return _library().quantize(x, fp8_dtype, scale, amax, scale_inv, rowwise, columnwise)
    if amax is not None and x.numel():
        amax.copy_(torch.maximum(amax.reshape(()), _abs_max(x)).reshape(amax.shape))
    if scale_inv is not None:
        scale_inv.copy_(scale.reciprocal())
    q = (x.float() * scale.reshape(())).clamp_(-fmax, fmax).to(fp8_dtype)
    q_t = None
    if columnwise:
        rows, cols = _as_2d_shape(x)
        q_t = q.reshape(rows, cols).t().contiguous()
    return (q if rowwise else None), q_t


def compute_amax(x: torch.Tensor, amax: Optional[torch.Tensor] = None, *, reference: bool = False) -> torch.Tensor:
    """``amax = max|x|`` (overwritten; 0 for an empty tensor), a one-element float32 tensor
    (allocated when not given). TE's ``nvte_compute_amax``."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute_amax: x must be float32, bfloat16 or float16, got {x.dtype}")
    if amax is None:
        amax = torch.empty(1, dtype=torch.float32, device=x.device)
    _check_scalar(amax, "amax", x)
    x = x.contiguous()
    if _use_library(x, reference):
        return _library().compute_amax(x, amax)
    if x.numel():
        amax.copy_(_abs_max(x).reshape(amax.shape))
    else:
        amax.zero_()
    return amax


def compute_scale_from_amax(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    *,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = False,
    reference: bool = False,
) -> torch.Tensor:
    """TE's ``nvte_compute_scale_from_amax``: ``a = max(amax, epsilon)``;
    ``scale = fp8_max / a`` (1 when ``a`` is 0, inf or NaN; float32's max when the quotient
    is inf),
    rounded down to a power of 2 with ``force_pow_2_scales``. Returns ``scale``
    (one-element float32, allocated when not given)."""
    fp8_dtype, fmax = _check_fp8_dtype(fp8_dtype)
    if scale is None:
        scale = torch.empty(1, dtype=torch.float32, device=amax.device)
    _check_scalar(amax, "amax", amax)
    _check_scalar(scale, "scale", amax)
    if _use_library(amax, reference):
        return _library().compute_scale_from_amax(amax, fp8_dtype, scale, float(epsilon), bool(force_pow_2_scales))
    a = torch.clamp_min(amax.reshape(()), float(epsilon))
    # tensor / tensor: one correctly rounded division (float / tensor would be
    # reciprocal-then-multiply, rounded twice).
    s = torch.full_like(a, fmax) / a
    s = torch.where(torch.isinf(s), torch.full_like(s, _FLOAT_MAX), s)
    s = torch.where((a > 0) & torch.isfinite(a), s, torch.ones_like(s))  # 0, inf, NaN: scale 1
    if force_pow_2_scales:
        # Round down to a power of 2: keep the exponent bits (scale is positive and finite).
        s = (s.view(torch.int32) & 0x7F800000).view(torch.float32)
    scale.copy_(s.reshape(scale.shape))
    return scale


def delayed_scaling_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    reference: bool = False,
) -> None:
    """TE's ``nvte_delayed_scaling_recipe_amax_and_scale_update``, in place.

    ``amax_history``: ``[history_len]`` or ``[history_len, num_scales]`` float32, entry 0 the
    newest; ``scale``: ``[num_scales]`` float32 (``[1]`` for a 1-D history). Per scale:
    ``amax`` = max over the history (``"max"``) or entry 0 (``"most_recent"``); the new
    scale is ``(fp8_max / amax) / 2**margin`` when amax is finite and > 0 (float32's max
    if that overflows), else the old scale is kept; the history is rolled by -1 (entry 0
    moves to the end, entry i to i-1) and entry 0 is zeroed, ready for the next cast.
    """
    fp8_dtype, fmax = _check_fp8_dtype(fp8_dtype)
    if amax_compute_algo not in _AMAX_ALGOS:
        raise ValueError(f"amax_compute_algo must be one of {_AMAX_ALGOS}, got {amax_compute_algo!r}")
    if amax_history.dtype != torch.float32 or amax_history.dim() not in (1, 2) or amax_history.shape[0] < 1:
        raise ValueError(
            f"amax_history must be float32 [history_len] or [history_len, num_scales], got "
            f"{amax_history.dtype} {tuple(amax_history.shape)}"
        )
    num = 1 if amax_history.dim() == 1 else amax_history.shape[1]
    if scale.dtype != torch.float32 or scale.numel() != num or scale.device != amax_history.device:
        raise ValueError(
            f"scale must be float32 with {num} elements on {amax_history.device}, got "
            f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
        )
    if not amax_history.is_contiguous() or not scale.is_contiguous():
        raise ValueError("amax_history and scale must be contiguous")
    if _use_library(amax_history, reference):
        _library().delayed_scaling_update(amax_history, scale, fp8_dtype, float(margin), amax_compute_algo)
        return
    h = amax_history.reshape(amax_history.shape[0], num)
    # "max" skips NaN entries (fmaxf, as TE's kernel); "most_recent" takes entry 0 as it is.
    amax = torch.where(torch.isnan(h), torch.zeros_like(h), h).amax(0) if amax_compute_algo == "max" else h[0]
    scaled_max = torch.tensor(fmax, dtype=torch.float32, device=h.device) * torch.pow(
        torch.tensor(2.0, dtype=torch.float32, device=h.device), -float(margin)
    )
    new = scaled_max / amax
    new = torch.where(torch.isinf(new), torch.full_like(new, _FLOAT_MAX), new)
    ok = torch.isfinite(amax) & (amax > 0)
    s = scale.view(num)
    s.copy_(torch.where(ok, new, s))
    rolled = torch.roll(h, -1, 0)
    rolled[0].zero_()
    h.copy_(rolled)


def transpose(x: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
    """The transpose of the 2-D view of ``x`` (``[rows, x.shape[-1]]`` -> ``[x.shape[-1], rows]``),
    contiguous; FP8 and 16-bit tensors on CUDA run the library's ``nvte_transpose``."""
    rows, cols = _as_2d_shape(x)
    x = x.contiguous()
    if _use_library(x, reference) and x.element_size() in (1, 2):
        return _library().transpose(x.reshape(rows, cols))
    return x.reshape(rows, cols).t().contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
               reference: bool = False) -> torch.Tensor:
    """``dtype(q * scale_inv)`` for an FP8 tensor ``q``."""
    _check_fp8_dtype(q.dtype)
    _check_scalar(scale_inv, "scale_inv", q)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    q = q.contiguous()
    if _use_library(q, reference):
        return _library().dequantize(q, scale_inv, dtype)
    return (q.float() * scale_inv.reshape(())).to(dtype)


# ------------------------------------------------------------------------- state


class Fp8Tensor(NamedTuple):
    """A cast result: ``data`` (rowwise, ``x``'s shape) and/or ``data_t`` (the transposed
    2-D view), their common ``scale_inv`` (one-element float32, this cast's own: later
    casts with the same :class:`Fp8Meta` do not change it) and the FP8 dtype."""

    data: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_inv: torch.Tensor
    dtype: torch.dtype


class Fp8Meta:
    """Scaling state of one FP8 tensor role (e.g. "fc1's input") under a recipe.

    :meth:`cast` quantizes a tensor and advances the state:

    - delayed scaling: casts with the current scale, writing the tensor's amax into entry 0
      of the history; then (``reduce_amax`` and a group of more than one rank) max-reduces
      that entry over ``group``, and runs :func:`delayed_scaling_update` (new scale for the
      next cast, history rolled). The first cast of a role, which has no history yet, takes
      its scale from the tensor itself (an amax pass, reduced over ``group``, then TE's
      update rule with the recipe's margin): TE starts from scale 1, which flushes
      small-magnitude tensors (weights of std 0.02, gradients of 1e-5) towards zero in the
      first step and costs measurable loss (bench/RESULTS.md, 2026-11-24). The first cast is
      the only one with an extra pass; a host flag (no device read) marks it, so the first
      cast must run eagerly, on real data, before any CUDA-graph capture: run one forward
      and backward on a real batch first, then capture inside :func:`keep_delayed_states`
      (torch's make_graphed_callables warm-up backward passes take uninitialised
      gradients).
    - current scaling: amax of the tensor (max-reduced over ``group`` when given, so that
      shards gathered afterwards share one scale), the scale from it, then the cast.

    ``group`` is the process group whose ranks must agree on the scale (None: no reduction).
    """

    # Defaults for states made before these attributes existed (unpickled ones).
    _plan = None
    _group_size = None

    def __init__(self, recipe: Recipe, fp8_dtype: torch.dtype, device, group=None):
        self.recipe = recipe
        self.fp8_dtype = torch_dtype(fp8_dtype)
        self.group = group
        self.device = torch.device(device)
        self.scale = torch.ones(1, dtype=torch.float32, device=self.device)
        self.primed = False  # delayed scaling: whether a cast has recorded an amax yet
        self._plan = None  # (its tensors' pointers, the library's packed cast of this state), made on first use
        self._group_size = None  # the group's size, once torch.distributed is initialized
        if isinstance(recipe, DelayedScaling):
            self.amax_history = torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=self.device)
        elif isinstance(recipe, Float8CurrentScaling):
            self.amax_history = None
            self._amax = torch.zeros(1, dtype=torch.float32, device=self.device)
        else:
            raise ValueError(f"unknown FP8 recipe {recipe!r}")

    def _state_ok(self, x: torch.Tensor) -> bool:
        """Whether the scaling state is what the packed cast reads: one-element float32
        scale (and amax) on x's device (the primitives' checks), a 1-D contiguous float32
        history there."""
        try:
            _check_scalar(self.scale, "scale", x)
            if self.amax_history is None:
                _check_scalar(self._amax, "amax", x)
        except ValueError:
            return False
        h = self.amax_history
        return h is None or (h.dtype == torch.float32 and h.dim() == 1 and h.numel() >= 1 and h.device == x.device
                             and h.is_contiguous())

    def __getstate__(self):
        # A copy (copy.deepcopy, pickle) makes its own packed cast: the plan holds this
        # state's device pointers.
        state = self.__dict__.copy()
        state["_plan"] = None
        return state

    def _reduces(self) -> bool:
        """Whether the amax is max-reduced over ``group`` (a group of more than one rank)."""
        n = self._group_size
        if n is None:
            g = self.group
            if g is None:
                n = self._group_size = 1
            elif not (dist.is_available() and dist.is_initialized()):
                return False  # not cached: the group may come up later
            else:
                n = self._group_size = dist.get_world_size(g)
        return n > 1

    def _reduce(self, amax: torch.Tensor) -> None:
        if self._reduces():
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)

    def _packed_cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Optional[Fp8Tensor]:
        """:meth:`cast` in one or two library calls (nvte_comm_cast_packed: the amax, scale,
        cast and update steps of the recipe, the same kernels as the primitives), or None
        where it does not apply: not CUDA, not a float input, empty, the first delayed
        cast, or a library without it."""
        r = self.recipe
        delayed = isinstance(r, DelayedScaling)
        if not (x.is_cuda and x.dtype in _HIGH and x.numel() and (rowwise or columnwise)
                and (self.primed or not delayed) and x.get_device() == self.scale.get_device()):
            return None
        amax = self.amax_history if delayed else self._amax
        # What the plan copies: the state's tensors (pointers, history length), the FP8
        # dtype and the recipe (a state whose attributes were replaced gets a new plan).
        key = (self.scale.data_ptr(), amax.data_ptr(), amax.numel(), self.fp8_dtype, id(r))
        plan = self._plan
        if plan is None or plan[0] != key:
            lib = _library()
            if lib is None or not self._state_ok(x):
                return None  # (the primitives' path then names what is wrong)
            if delayed:
                p = lib.cast_plan(self.fp8_dtype, self.scale, amax[0:1], amax, r.amax_compute_algo, float(r.margin))
            else:
                p = lib.cast_plan(self.fp8_dtype, self.scale, amax, epsilon=r.amax_epsilon,
                                  pow2=r.force_pow_2_scales)
            if p is None:
                return None
            plan = self._plan = (key, p)
        plan = plan[1]
        x = x.contiguous()
        rows, cols = _as_2d_shape(x)
        dev = x.device
        q = torch.empty(x.shape, dtype=self.fp8_dtype, device=dev) if rowwise else None
        q_t = torch.empty((cols, rows), dtype=self.fp8_dtype, device=dev) if columnwise else None
        scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
        stream = raw_stream(dev.index)
        reduce = self._reduces() and (r.reduce_amax if delayed else True)
        if delayed:
            if reduce:  # the cast's amax reduced before the update reads the history
                plan(_CAST_QUANTIZE, x, rows, cols, q, q_t, scale_inv, stream)
                self._reduce(self.amax_history[0:1])
                plan(_CAST_UPDATE, x, rows, cols, None, None, scale_inv, stream)
            else:
                plan(_CAST_QUANTIZE | _CAST_UPDATE, x, rows, cols, q, q_t, scale_inv, stream)
        elif reduce:  # the amax reduced before the scale is taken from it
            plan(_CAST_AMAX, x, rows, cols, None, None, scale_inv, stream)
            self._reduce(self._amax)
            plan(_CAST_SCALE | _CAST_QUANTIZE, x, rows, cols, q, q_t, scale_inv, stream)
        else:
            plan(_CAST_AMAX | _CAST_SCALE | _CAST_QUANTIZE, x, rows, cols, q, q_t, scale_inv, stream)
        return Fp8Tensor(q, q_t, scale_inv, self.fp8_dtype)

    def cast(self, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False) -> Fp8Tensor:
        fast = self._packed_cast(x, rowwise, columnwise)
        if fast is not None:
            return fast
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        r = self.recipe
        if isinstance(r, DelayedScaling):
            amax = self.amax_history[0:1]
            if not self.primed:
                # No history yet: the scale from this tensor's own amax (see the docstring).
                compute_amax(x, amax)
                if r.reduce_amax:
                    self._reduce(amax)
                delayed_scaling_update(self.amax_history, self.scale, self.fp8_dtype,
                                       margin=float(r.margin), amax_compute_algo="most_recent")
                self.amax_history.zero_()
                self.primed = True
            q, q_t = quantize(x, self.fp8_dtype, self.scale, amax=amax, scale_inv=scale_inv,
                              rowwise=rowwise, columnwise=columnwise)
            if r.reduce_amax:
                self._reduce(amax)
            delayed_scaling_update(self.amax_history, self.scale, self.fp8_dtype, margin=float(r.margin),
                                   amax_compute_algo=r.amax_compute_algo)
        else:
            amax = compute_amax(x, self._amax)
            self._reduce(amax)
            compute_scale_from_amax(amax, self.fp8_dtype, self.scale, epsilon=r.amax_epsilon,
                                    force_pow_2_scales=r.force_pow_2_scales)
            q, q_t = quantize(x, self.fp8_dtype, self.scale, scale_inv=scale_inv,
                              rowwise=rowwise, columnwise=columnwise)
        return Fp8Tensor(q, q_t, scale_inv, self.fp8_dtype)


def delayed_states(module: torch.nn.Module) -> List[Fp8Meta]:
    """Every delayed-scaling :class:`Fp8Meta` (one with an amax history) of ``module`` and
    its submodules (their ``fp8_meta`` roles), each once."""
    states: List[Fp8Meta] = []
    for m in module.modules():
        meta = getattr(m, "fp8_meta", None)
        for s in (meta or {}).values():
            if getattr(s, "amax_history", None) is not None and all(s is not t for t in states):
                states.append(s)
    return states


@contextlib.contextmanager
def keep_delayed_states(module: torch.nn.Module) -> Iterator[List[Fp8Meta]]:
    """Puts every delayed-scaling state of ``module`` (:func:`delayed_states`: scale, amax
    history and the primed flag) back as it was on entry, in place (a captured graph holds
    the tensors' pointers), when the block ends, also on an exception.

    For a capture with ``torch.cuda.make_graphed_callables``, whose warm-up backward passes
    feed uninitialised gradients into the grad-output histories: run one eager forward and
    backward on a real batch first (each role's first cast takes its scale from that
    tensor), drop its gradients, then capture inside this block. Without it, the first
    replays cast gradients with scales from garbage (or from 1, flushing them towards
    zero)."""
    states = delayed_states(module)
    saved = [(s, s.scale.clone(), s.amax_history.clone(), s.primed) for s in states]
    try:
        yield states
    finally:
        for s, scale, history, primed in saved:
            s.scale.copy_(scale)
            s.amax_history.copy_(history)
            s.primed = primed


# ------------------------------------------------------------------- block scaling
#
# Float8BlockScaling (TE's, DeepSeek-V3's): one float32 scale per 1 x 128 block of a row
# (1D) or per 128 x 128 tile (2D), each from its own block's amax. A cast writes the
# rowwise form (data [rows, cols], blocks along the rows) and/or the columnwise form
# (data [cols, rows] = the transposed tensor, quantized along the columns -- not the
# transpose of the rowwise bytes: for 1D blocks the two differ), each with its scale_inv
# in TE's GEMM-ready layout (``block_scale_shape``). The columnwise form of a tensor is the
# rowwise form of its transpose, so every block GEMM is TN on rowwise forms.


class BlockOperand(NamedTuple):
    """One block-scaled GEMM operand in rowwise form: ``data`` ``[rows, cols]`` FP8 with
    blocks along its rows, ``scale_inv`` in the GEMM-ready layout of
    :func:`block_scale_shape` for ``block_dim``."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block_dim: int


class BlockFp8Tensor(NamedTuple):
    """A block-scaled cast of a ``[rows, cols]`` view: ``data`` / ``scale_inv`` (rowwise)
    and ``data_t`` / ``scale_inv_t`` (columnwise: the transposed tensor ``[cols, rows]``
    quantized along its rows), either pair None when not asked for."""

    data: Optional[torch.Tensor]
    scale_inv: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_inv_t: Optional[torch.Tensor]
    block_dim: int
    dtype: torch.dtype

    def rowwise(self) -> BlockOperand:
        if self.data is None:
            raise ValueError("this block cast has no rowwise data")
        return BlockOperand(self.data, self.scale_inv, self.block_dim)

    def columnwise(self) -> BlockOperand:
        """The transposed tensor's rowwise form (what the dgrad and wgrad GEMMs take)."""
        if self.data_t is None:
            raise ValueError("this block cast has no columnwise data")
        return BlockOperand(self.data_t, self.scale_inv_t, self.block_dim)


def _block_scales(amax: torch.Tensor, fmax: float, eps: float, pow2: bool, value_for_inf: float) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` per block (recipe_common.cuh): amax floored at eps;
    scale 1 for an amax of 0, inf or NaN; fp8_max / amax (the input dtype's max where that
    overflows), its mantissa cleared with ``pow2``."""
    a = torch.clamp_min(amax, float(eps)) if eps > 0 else amax
    s = torch.full_like(a, fmax) / a
    s = torch.where(torch.isinf(s), torch.full_like(s, value_for_inf), s)
    s = torch.where((a > 0) & torch.isfinite(a), s, torch.ones_like(s))
    if pow2:
        s = (s.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000: sign + exponent
    return s


def _block_amax(t: torch.Tensor, dims, shape) -> torch.Tensor:
    # max|x| per block as the kernels compute it (fmaxf): NaN ignored, inf kept.
    if not t.numel():
        return torch.zeros(shape, dtype=torch.float32, device=t.device)
    return t.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(dim=dims)


def _quantize_rows_1d(x2: torch.Tensor, fp8_dtype, fmax, eps, pow2, vinf):
    """1 x 128 blocks along the rows of fp32 ``x2`` -> (q [r, c], scale_inv GEMM-ready)."""
    r, c = x2.shape
    b = BLOCK_LEN
    nb = -(-c // b)
    xp = F.pad(x2, (0, nb * b - c)) if nb * b != c else x2
    t = xp.reshape(r, nb, b)
    amax = _block_amax(t, (-1,), (r, nb))
    s = _block_scales(amax, fmax, eps, pow2, vinf)
    q = (t * s.unsqueeze(-1)).clamp_(-fmax, fmax).to(fp8_dtype).reshape(r, nb * b)[:, :c].contiguous()
    si = torch.zeros(block_scale_shape(r, c, 1), dtype=torch.float32, device=x2.device)
    si[:, :r] = s.reciprocal().t()
    return q, si


def _quantize_tiles_2d(x2: torch.Tensor, fp8_dtype, fmax, eps, pow2, vinf):
    """128 x 128 tiles of fp32 ``x2`` -> (q [r, c], scale_inv [ceil(r/128), round4(ceil(c/128))],
    the scales per tile [mb, nb])."""
    r, c = x2.shape
    b = BLOCK_LEN
    mb, nb = -(-r // b), -(-c // b)
    xp = F.pad(x2, (0, nb * b - c, 0, mb * b - r)) if (mb * b, nb * b) != (r, c) else x2
    t = xp.reshape(mb, b, nb, b)
    amax = _block_amax(t, (1, 3), (mb, nb))
    s = _block_scales(amax, fmax, eps, pow2, vinf)
    q = (t * s[:, None, :, None]).clamp_(-fmax, fmax).to(fp8_dtype).reshape(mb * b, nb * b)[:r, :c].contiguous()
    return q, s.reciprocal()


def quantize_block(
    x: torch.Tensor,
    block_dim: int,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    fp8_dtype=None,
    reference: bool = False,
) -> BlockFp8Tensor:
    """Block-scaled cast of ``x`` (float32 / bfloat16 / float16; its 2-D view ``[rows,
    x.shape[-1]]``) with ``block_dim`` 1 (1 x 128 blocks) or 2 (128 x 128 tiles), e4m3 by
    default: each block's ``scale`` from its amax (TE's ``compute_scale_from_amax`` with
    ``amax_epsilon`` and ``power_2_scale``), ``q = fp8(clamp(x * scale))``, ``scale_inv =
    1 / scale`` in TE's GEMM-ready layout (:func:`block_scale_shape`; the padding entries
    are unspecified). ``columnwise``: the transposed tensor quantized along its rows
    (``data_t [cols, rows]``). CUDA tensors whose rows and columns are multiples of 128
    (TE's ``Float8BlockQuantizer.is_quantizable``) run the library's ``nvte_quantize_v2``
    into an ``NVTE_BLOCK_SCALING_1D/2D`` tensor; other shapes, other tensors and
    ``reference=True`` the same arithmetic in torch (the same bytes: the emulation the
    tests compare against)."""
    fp8_dtype, fmax = _check_fp8_dtype(E4M3 if fp8_dtype is None else fp8_dtype)
    if block_dim not in (1, 2):
        raise ValueError(f"quantize_block: block_dim must be 1 or 2, got {block_dim!r}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_block: x must be float32, bfloat16 or float16, got {x.dtype}")
    if not (rowwise or columnwise):
        raise ValueError("quantize_block: ask for rowwise and/or columnwise output")
    rows, cols = _as_2d_shape(x)
    x2 = x.contiguous().reshape(rows, cols)
    lib = _library() if _use_library(x2, reference) and _block_quantizable(x2) else None
    if lib is not None and lib.has_block and lib.block_quantize is not False:
        try:
            q, si, qt, sit = lib.quantize_block(x2, fp8_dtype, block_dim, rowwise, columnwise,
                                                bool(power_2_scale), float(amax_epsilon))
            lib.block_quantize = True
            return BlockFp8Tensor(q, si, qt, sit, block_dim, fp8_dtype)
        except RuntimeError as e:  # the library's CommError
            if lib.block_quantize is not None or getattr(e, "status", None) != _core.Status.NVTE_COMM_ERROR_UNSUPPORTED:
                raise
            # A library with block tensors but no block cast kernel: the torch arithmetic
            # below writes the same bytes (slower); said once.
            lib.block_quantize = False
            warnings.warn(f"transformer_engine_comm: the library has no block-scaled cast ({e.message}); block "
                          "casts run as torch ops (the same bytes, slower)", RuntimeWarning, stacklevel=2)
    vinf = torch.finfo(x.dtype).max
    xf = x2.float()
    args = (fp8_dtype, fmax, float(amax_epsilon), bool(power_2_scale), vinf)
    q = si = qt = sit = None
    if block_dim == 1:
        if rowwise:
            q, si = _quantize_rows_1d(xf, *args)
        if columnwise:
            qt, sit = _quantize_rows_1d(xf.t(), *args)
    else:
        q2, s_inv = _quantize_tiles_2d(xf, *args)
        mb, nb = s_inv.shape
        if rowwise:
            q = q2
            si = torch.zeros(block_scale_shape(rows, cols, 2), dtype=torch.float32, device=x.device)
            si[:, :nb] = s_inv
        if columnwise:
            # A 128 x 128 tile is the same tile of the transpose: the transposed bytes.
            qt = q2.t().contiguous()
            sit = torch.zeros(block_scale_shape(rows, cols, 2, columnwise=True), dtype=torch.float32,
                              device=x.device)
            sit[:, :mb] = s_inv.t()
    return BlockFp8Tensor(q, si, qt, sit, block_dim, fp8_dtype)


def _block_quantizable(x2: torch.Tensor) -> bool:
    # The library's block cast (as TE's is_quantizable): rows and columns multiples of 128,
    # a 16-byte aligned input.
    r, c = x2.shape
    return r % BLOCK_LEN == 0 and c % BLOCK_LEN == 0 and r * c > 0 and x2.data_ptr() % 16 == 0


def _block_scale_grid(op: BlockOperand) -> torch.Tensor:
    """An operand's scale_inv per element block, unpadded: ``[rows, nb]`` (1D) or
    ``[mb, nb]`` (2D)."""
    r, c = op.data.shape
    nb = -(-c // BLOCK_LEN)
    if op.block_dim == 1:
        return op.scale_inv[:nb, :r].t()
    return op.scale_inv[:, :nb]


def dequantize_block(op: BlockOperand, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dtype(q * scale_inv)`` of a block operand (its rowwise form), in torch."""
    q = op.data.float()
    r, c = q.shape
    b = BLOCK_LEN
    g = _block_scale_grid(op)
    if op.block_dim == 1:
        s = g.repeat_interleave(b, dim=1)[:, :c]
    else:
        s = g.repeat_interleave(b, dim=0)[:r].repeat_interleave(b, dim=1)[:, :c]
    return (q * s).to(dtype)


def block_gemm(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype = torch.bfloat16, *,
               bias: Optional[torch.Tensor] = None, dgelu_pre: Optional[torch.Tensor] = None,
               reference: bool = False, fuse_dgelu: bool = False) -> torch.Tensor:
    """``a @ b^T`` -> ``[M, N]`` ``out_dtype`` of two block-scaled operands in rowwise form,
    ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (not both 2D): TE's TN ``nvte_cublas_gemm`` with
    ``NVTE_BLOCK_SCALING_1D/2D`` operands (A = b, B = a) and split accumulation, on CUDA
    where the library has it and K, M and N are multiples of 16; otherwise (and
    with ``reference=True``) the fp32 matmul of the dequantized operands. ``bias`` (``[N]``):
    added in the GEMM's epilogue (cuBLASLt's BIAS, when its dtype is ``out_dtype``), else
    after it. ``dgelu_pre`` (``[M, N]``, a GELU's pre-activation): the product times the
    tanh-GELU's derivative at it; not with ``bias``. With block-scaled operands cuBLASLt
    does not fuse DGELU into its main loop: it adds a separate epilogue pass over D, which
    took 0.95 ms at [8192, 16384] on an H200 where torch's gelu_backward takes 0.2 ms, so
    the GELU backward runs after the GEMM unless ``fuse_dgelu=True`` asks for the
    library's epilogue."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"block_gemm: a {tuple(a.data.shape)} and b {tuple(b.data.shape)} disagree on K")
    if a.block_dim == 2 and b.block_dim == 2:
        raise ValueError("block_gemm: a 2D by 2D block GEMM is not supported (as in TE)")
    m, k = a.data.shape
    n = b.data.shape[0]
    lib = _library() if (not reference and a.data.is_cuda) else None
    if bias is not None and dgelu_pre is not None:
        raise ValueError("block_gemm: bias and dgelu_pre exclude each other")
    if lib is not None and lib.has_block_gemm and k % 16 == 0 and m % 16 == 0 and n % 16 == 0:
        fuse = bias is not None and bias.dtype == out_dtype and bias.is_contiguous()
        pre_ok = dgelu_pre is None or (fuse_dgelu and dgelu_pre.dtype == out_dtype
                                       and dgelu_pre.is_contiguous()
                                       and tuple(dgelu_pre.shape) == (m, n) and n % 8 == 0)
        y = lib.block_gemm(a, b, out_dtype, bias if fuse else None, dgelu_pre if pre_ok else None)
        if bias is not None and not fuse:
            y.add_(bias)
        if dgelu_pre is not None and not pre_ok:
            y = torch.ops.aten.gelu_backward(y, dgelu_pre, approximate="tanh")
        return y
    y = dequantize_block(a) @ dequantize_block(b).t()
    if bias is not None:
        y = y + bias.float()
    if dgelu_pre is not None:
        y = torch.ops.aten.gelu_backward(y, dgelu_pre.float(), approximate="tanh")
    return y.to(out_dtype)
