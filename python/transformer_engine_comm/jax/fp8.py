"""FP8 recipes for the JAX layers, as Transformer Engine defines them.

- :class:`DelayedScaling` (TE's ``DelayedScaling``): each FP8 tensor of a layer has an
  amax history (``amax_history_len`` steps) and a scale; a step quantizes with the scale
  computed from the history of the earlier steps and records its own amax. A tensor's
  first cast (its history column still all zero) takes its scale from its own amax
  instead of TE's initial 1, as the torch side does. ``margin``,
  ``amax_compute_algo`` (``"max"`` over the history or ``"most_recent"``) and the format
  (:attr:`Format.HYBRID`: e4m3 for the forward tensors, e5m2 for the gradients;
  :attr:`Format.E4M3`: e4m3 everywhere) as TE's.
- :class:`CurrentScaling` (TE's ``Float8CurrentScaling``): each tensor's scale from its own
  amax, computed before it is quantized (no state).

Delayed scaling is functional: the state is a pytree of :class:`FP8Meta` (one per layer:
the amax history ``[amax_history_len, 3]`` and the scale ``[3]`` of its three FP8 tensors,
in TE's order: input, weight, output gradient), passed into the step and returned updated.
The output gradient's amax is only known in the backward pass, so every amax leaves the
layer the way Flax's and TE-JAX's FP8 metas do: as the **gradient of the meta** (the
layer's custom VJP returns, as the cotangent of its ``FP8Meta`` input, the meta with this
step's amaxes recorded in history row 0). A step::

    meta = tj.fp8_meta_init(recipe, 2)                       # the MLP's two layers
    def loss(params, meta, x, y):
        out = model(x, *params, meta)                        # tj.mlp(..., fp8=recipe, fp8_meta=meta)
        return jnp.mean((out - y) ** 2)
    (l, (g, meta_g)) = jax.value_and_grad(loss, argnums=(0, 1))(params, meta, x, y)
    meta = tj.fp8_meta_update(meta_g, recipe)                # TE's amax-and-scale update
    params = optimizer(params, g)

:func:`fp8_meta_update` is TE's ``nvte_delayed_scaling_recipe_amax_and_scale_update``:
amax = max over the history (``"max"``) or its row 0 (``"most_recent"``); scale =
(fp8_max / amax) / 2^margin, the previous scale where amax is 0 or not finite (FLT_MAX
where the quotient overflows); the history rolled up by one row (row i takes row i + 1,
the last row takes row 0) and row 0 zeroed for the next step's amax. Inside ``shard_map``
the recorded amaxes are max-reduced over the TP axis, so the state (``P()``, replicated)
is identical on every device and the gathered input has one scale everywhere; the
cotangent is handed out by the axis' first device only (``shard_map`` sums the devices'
cotangents of a replicated input), so the sum is exact. Each meta must be used by exactly
one layer call per differentiated step (a second use would add to its cotangent).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import numpy as np

from .. import _core

INPUT, WEIGHT, GRAD = 0, 1, 2
ROLES = ("input", "weight", "grad_output")
FLT_MAX = float(np.finfo(np.float32).max)
FP8_MAX = _core.FP8_MAX  # by dtype name


class Format(enum.Enum):
    """TE's ``recipe.Format``: E4M3 everywhere, or HYBRID (e4m3 forward, e5m2 gradients)."""

    E4M3 = "E4M3"
    HYBRID = "HYBRID"


def _dtypes(fmt: Format):
    import jax.numpy as jnp

    if isinstance(fmt, Format):  # (input, weight, output gradient): forward, forward, backward
        fwd, bwd = (getattr(jnp, n) for n in _core.FP8_FORMATS[fmt.value])
        return (fwd, fwd, bwd)
    raise ValueError(f"fp8_format {fmt!r}: Format.E4M3 or Format.HYBRID")


def _fmt(f) -> Format:
    if isinstance(f, Format):
        return f
    try:
        return Format(str(f).upper())
    except ValueError:
        raise ValueError(f"fp8_format {f!r}: Format.E4M3 or Format.HYBRID") from None


@dataclass(frozen=True)
class DelayedScaling:
    """TE's ``DelayedScaling`` (defaults as TE's): scales from an amax history."""

    margin: float = 0.0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _fmt(self.fp8_format))
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo {self.amax_compute_algo!r}: 'max' or 'most_recent'")
        if int(self.amax_history_len) < 1:
            raise ValueError(f"amax_history_len {self.amax_history_len} must be >= 1")
        object.__setattr__(self, "amax_history_len", int(self.amax_history_len))
        object.__setattr__(self, "margin", float(self.margin))

    @property
    def dtypes(self):
        """FP8 dtypes of (input, weight, output gradient)."""
        return _dtypes(self.fp8_format)

    @property
    def delayed(self) -> bool:
        return True


@dataclass(frozen=True)
class CurrentScaling:
    """TE's ``Float8CurrentScaling``: scale = fp8_max / amax of the tensor itself (1 where
    the amax is 0 or not finite)."""

    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _fmt(self.fp8_format))

    @property
    def dtypes(self):
        return _dtypes(self.fp8_format)

    @property
    def delayed(self) -> bool:
        return False


Recipe = Union[DelayedScaling, CurrentScaling]


def as_recipe(fp8) -> Optional[Recipe]:
    """The layers' ``fp8`` argument: False / None (bf16), True (:class:`CurrentScaling`,
    HYBRID), or a recipe."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return CurrentScaling()
    if isinstance(fp8, (DelayedScaling, CurrentScaling)):
        return fp8
    raise TypeError(f"fp8={fp8!r}: a bool, DelayedScaling or CurrentScaling")


class FP8Meta(NamedTuple):
    """One layer's delayed-scaling state (a pytree): ``amax_history`` f32
    ``[amax_history_len, 3]`` and ``scale`` f32 ``[3]`` (columns: input, weight, output
    gradient). Fresh: zeros and ones (TE's initial state)."""

    amax_history: object
    scale: object


def fp8_meta_init(recipe: DelayedScaling, n: Optional[int] = None):
    """A fresh :class:`FP8Meta` for ``recipe`` (or a tuple of ``n``: e.g. 2 for :func:`mlp`)."""
    import jax.numpy as jnp

    if not isinstance(recipe, DelayedScaling):
        raise TypeError("only DelayedScaling has state (CurrentScaling needs none)")

    def one():
        return FP8Meta(jnp.zeros((recipe.amax_history_len, 3), jnp.float32), jnp.ones((3,), jnp.float32))

    return one() if n is None else tuple(one() for _ in range(n))


def fp8_max_of(recipe) -> np.ndarray:
    """fp8_max of each role's dtype (f32 [3])."""
    import jax.numpy as jnp

    return np.array([FP8_MAX[jnp.dtype(d).name] for d in recipe.dtypes], np.float32)


def scale_from_amax(amax, fp8_max, margin: float = 0.0, prev_scale=1.0):
    """TE's scale rule: (fp8_max / amax) / 2^margin where amax is finite and > 0, else
    ``prev_scale``; FLT_MAX where the quotient overflows (f32)."""
    import jax.numpy as jnp

    amax = jnp.asarray(amax, jnp.float32)
    scaled_max = jnp.float32(fp8_max) * jnp.float32(2.0 ** -float(margin))
    ok = jnp.isfinite(amax) & (amax > 0)
    s = jnp.where(ok, scaled_max / jnp.where(ok, amax, 1.0), jnp.asarray(prev_scale, jnp.float32))
    return jnp.where(jnp.isinf(s), jnp.float32(FLT_MAX), s)


def amax_and_scale_update(amax_history, scale, fp8_max, margin: float = 0.0, amax_compute_algo: str = "max"):
    """TE's ``nvte_delayed_scaling_recipe_amax_and_scale_update`` on ``amax_history``
    ``[L, n]`` and ``scale`` ``[n]`` (``fp8_max``: per column). Returns ``(history, scale)``."""
    import jax.numpy as jnp

    h = jnp.asarray(amax_history, jnp.float32)
    last = h[0]
    if amax_compute_algo == "max":
        # fmaxf over the values from 0: NaN is ignored, inf kept (then the scale is kept).
        amax = jnp.max(jnp.where(jnp.isnan(h), 0.0, h), axis=0, initial=0.0)
    elif amax_compute_algo == "most_recent":
        amax = last
    else:
        raise ValueError(f"amax_compute_algo {amax_compute_algo!r}: 'max' or 'most_recent'")
    new_scale = scale_from_amax(amax, jnp.asarray(fp8_max, jnp.float32), margin, scale)
    rolled = jnp.roll(h, -1, axis=0).at[0].set(0.0)  # row i <- row i+1, last <- row 0
    return rolled, new_scale


def fp8_meta_update(meta_grads, recipe: DelayedScaling):
    """The next step's metas from the metas' gradients (every :class:`FP8Meta` in the
    pytree ``meta_grads``: history row 0 holds this step's amaxes)."""
    import jax

    fmax = fp8_max_of(recipe)

    def upd(m):
        h, s = amax_and_scale_update(m.amax_history, m.scale, fmax, recipe.margin, recipe.amax_compute_algo)
        return FP8Meta(h, s)

    return jax.tree_util.tree_map(upd, meta_grads, is_leaf=lambda m: isinstance(m, FP8Meta))


# ---- quantization (jnp: XLA fuses the cast with its producer and the amax reduction) ----


def amax(x):
    import jax.numpy as jnp

    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def quantize(x, scale, dtype):
    """Saturating cast of ``x * scale`` to ``dtype`` (TE's cast: satfinite)."""
    import jax.numpy as jnp

    fmax = FP8_MAX[jnp.dtype(dtype).name]
    return jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


# How fp8_dot writes its GEMM (tests and probes may switch it): "direct" (the default) or
# "dequant" (XLA's older pattern, kept to compare: see fp8_dot).
_DOT_FORM = "direct"


def fp8_dot(a, a_scale_inv, b, b_scale_inv, dims, out_dtype, split_accumulator: bool = False):
    """A GEMM of two FP8 operands (``a`` and ``b`` quantized with the scales whose inverses
    are given), contracting ``dims`` = ``((a's,), (b's,))``, dequantized to ``out_dtype``.

    XLA's dot on the FP8 arrays themselves (``preferred_element_type`` the output type),
    then the output times ``a_scale_inv * b_scale_inv``, as TE-JAX's and Flax's direct FP8
    GEMMs: XLA lowers an FP8 x FP8 dot on Hopper to one cuBLASLt FP8 GEMM
    (``__cublas$lt$matmul$f8``; it transposes an operand itself where the contraction is
    not TN) and fuses the output scaling into the GEMM's consumer. The older form, a dot of the dequantized
    operands (``convert(q) * s``) that XLA's GEMM rewriter was to match, is unreliable: in
    a step that quantizes and dequantizes inside one program XLA folds the
    ``f32 -> f8 -> f32`` conversions away (``SimplifyFPConversions``, on by default) and
    runs the GEMM in f32 on unquantized data. ``split_accumulator``: Hopper's FP8 GEMMs
    accumulate in full f32 (``Precision.HIGHEST``; TE's ``use_split_accumulator``, which
    its recipes set for the dgrad and wgrad) rather than with fast accumulation."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    s = jnp.asarray(a_scale_inv, f32).reshape(()) * jnp.asarray(b_scale_inv, f32).reshape(())
    prec = jax.lax.Precision.HIGHEST if split_accumulator else None
    if _DOT_FORM == "dequant":
        da = a.astype(f32) * jnp.asarray(a_scale_inv, f32).reshape(())
        db = b.astype(f32) * jnp.asarray(b_scale_inv, f32).reshape(())
        return jax.lax.dot_general(da, db, (dims, ((), ())), precision=prec,
                                   preferred_element_type=f32).astype(out_dtype)
    acc = out_dtype if jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else f32
    # The barriers keep the dot a bare FP8 x FP8 dot: XLA's Triton GEMM pass leaves a bare
    # dot (a "pure matmul") to cuBLASLt, where it would otherwise fuse the cast producing
    # an operand, or the output scaling, into a Triton GEMM and leave the choice between
    # Triton and cuBLASLt to its autotuner.
    a, b = jax.lax.optimization_barrier((a, b))
    y = jax.lax.optimization_barrier(jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec,
                                                         preferred_element_type=acc))
    return (y.astype(f32) * s).astype(out_dtype)
