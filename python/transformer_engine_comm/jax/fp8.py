"""FP8 recipes for the JAX layers, as Transformer Engine defines them.

The recipes are the framework-neutral classes of :mod:`transformer_engine_comm.recipe`,
the same ones ``transformer_engine_comm.torch.fp8`` exports (TE's names, fields, types and
defaults); this module adds their JAX dtypes (:func:`jax_dtype`, :func:`jax_dtypes`;
``recipe.dtypes`` and ``Format.X.fwd`` / ``.bwd`` are dtype names, which ``jnp.dtype``
takes) and the delayed-scaling state.

- :class:`DelayedScaling` (TE's ``DelayedScaling``): each FP8 tensor of a layer has an
  amax history (``amax_history_len`` steps) and a scale; a step quantizes with the scale
  computed from the history of the earlier steps and records its own amax. A tensor's
  first cast (its history column still all zero) takes its scale from its own amax
  instead of TE's initial 1, as the torch side does. ``margin`` (an int, TE's type: an
  integral float such as ``0.0`` is taken as that int, a fractional one refused),
  ``amax_compute_algo`` (``"max"`` over the history or ``"most_recent"``) and the format
  (:attr:`Format.HYBRID`: e4m3 for the forward tensors, e5m2 for the gradients;
  :attr:`Format.E4M3`: e4m3 everywhere) as TE's. ``reduce_amax`` (TE's default True):
  the recorded amaxes are max-reduced over the TP axis (below); the layers refuse
  ``reduce_amax=False``, as TE-JAX does: the state is replicated, so it cannot hold
  per-device amaxes.
- :class:`Float8CurrentScaling` (TE's name; :class:`CurrentScaling` is the same class,
  this module's earlier name): each tensor's scale from its own amax, computed before it
  is quantized (no state). The layers take its default ``amax_epsilon=0`` and
  ``force_pow_2_scales=False`` only (others are refused, not ignored).
- :class:`Float8BlockScaling` (TE's; TE-JAX lacks it): one scale per 1 x 128 block (1D:
  inputs and gradients by default) or 128 x 128 tile (2D: weights), e4m3, power-of-2
  scales, no state. Quantized on a GPU by the library's kernel (:func:`quantize_block_library`,
  the XLA custom call :func:`ops.block_quantize <transformer_engine_comm.jax.ops.block_quantize>`:
  rowwise and columnwise from one read, see :data:`BLOCK_CASTS`), else in jnp
  (:func:`quantize_block`, the reference: the same bits); the GEMMs
  (:func:`block_dot`) run on the library's block-scaled FP8 GEMM (an XLA custom call,
  :func:`ops.block_gemm <transformer_engine_comm.jax.ops.block_gemm>`) on a GPU, else
  (CPU, the reference) as dots of the dequantized block operands: the same products. At
  tp > 1 the layers communicate with XLA's collectives around them (no block-scaled
  comm-GEMM in the library yet).

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

from typing import NamedTuple, Optional, Tuple

import numpy as np

from .. import _core
from ..recipe import BLOCK_LEN, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams, QParams
from ..recipe import Recipe, recipe_from_name

INPUT, WEIGHT, GRAD = 0, 1, 2
ROLES = ("input", "weight", "grad_output")
FLT_MAX = float(np.finfo(np.float32).max)
FP8_MAX = _core.FP8_MAX  # by dtype name


# TE's name is Float8CurrentScaling; CurrentScaling, this module's earlier name, is the same class.
CurrentScaling = Float8CurrentScaling

def jax_dtype(name):
    """The JAX dtype (``jnp.float8_e4m3fn`` / ``jnp.float8_e5m2``) of an FP8 dtype name
    (``Format.X.fwd`` / ``.bwd``, an entry of ``recipe.dtypes``) or dtype."""
    import jax.numpy as jnp

    n = jnp.dtype(name).name
    if n not in FP8_MAX:
        raise ValueError(f"{name!r} is not an FP8 dtype (float8_e4m3fn or float8_e5m2)")
    return getattr(jnp, n)


def jax_dtypes(recipe: Recipe) -> Tuple[object, object, object]:
    """The JAX dtypes of (input, weight, output gradient) under ``recipe``."""
    return tuple(jax_dtype(n) for n in recipe.dtypes)


def as_recipe(fp8) -> Optional[Recipe]:
    """The layers' ``fp8`` argument: False / None (bf16), True (:class:`Float8CurrentScaling`,
    HYBRID), or a recipe. Fields the layers cannot honour are refused: ``reduce_amax=False``
    (the replicated state holds the axis' max-reduced amaxes, as TE-JAX requires), and a
    current-scaling ``amax_epsilon`` / ``force_pow_2_scales`` other than the defaults."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return Float8CurrentScaling()
    if isinstance(fp8, DelayedScaling):
        if not fp8.reduce_amax:
            raise ValueError("DelayedScaling(reduce_amax=False) is not supported by the JAX layers: the FP8 state is "
                             "replicated over the TP axis, so its amaxes are max-reduced over it (TE-JAX requires "
                             "reduce_amax=True too)")
        return fp8
    if isinstance(fp8, Float8BlockScaling):
        return fp8
    if isinstance(fp8, Float8CurrentScaling):
        if fp8.amax_epsilon != 0.0 or fp8.force_pow_2_scales:
            raise ValueError("Float8CurrentScaling: the JAX layers take amax_epsilon=0.0 and force_pow_2_scales=False "
                             f"only, got amax_epsilon={fp8.amax_epsilon}, force_pow_2_scales={fp8.force_pow_2_scales}")
        return fp8
    raise TypeError(f"fp8={fp8!r}: a bool, DelayedScaling, Float8CurrentScaling or Float8BlockScaling")


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
        raise TypeError("only DelayedScaling has state (Float8CurrentScaling needs none)")

    def one():
        return FP8Meta(jnp.zeros((recipe.amax_history_len, 3), jnp.float32), jnp.ones((3,), jnp.float32))

    return one() if n is None else tuple(one() for _ in range(n))


def fp8_max_of(recipe) -> np.ndarray:
    """fp8_max of each role's dtype (f32 [3])."""
    return np.array([FP8_MAX[n] for n in recipe.dtypes], np.float32)


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

    dtype = jnp.dtype(dtype)  # a dtype or its name (recipe.dtypes)
    fmax = FP8_MAX[dtype.name]
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


# ---- block scaling (Float8BlockScaling): jnp casts and the block math -------------------
#
# One float32 scale per 1 x 128 block of a row (1D) or 128 x 128 tile (2D), each from its
# own block's amax (TE's compute_scale_from_amax with the role's QParams). On a GPU a block
# GEMM is the library's (ops.block_gemm, see BLOCK_GEMM); the reference path (CPU) is the
# dot of the dequantized operands: with power-of-2 scales every dequantized value (an e4m3 value times
# 2^k) is exact in bf16, so a bf16 dot with f32 accumulation computes exactly the products
# a block-scaled FP8 GEMM sums (at bf16 GEMM speed, not FP8's); other scales dequantize to
# f32 (Precision.HIGHEST). An optimization barrier sits on the FP8 arrays so that XLA
# cannot fold the f32 -> f8 -> f32 conversions away (see fp8_dot).


class BlockQ(NamedTuple):
    """A block-scaled cast in rowwise form: ``q`` ``[rows, cols]`` FP8 and ``scale_inv`` per
    block, ``[rows, ceil(cols/128)]`` (1D) or ``[ceil(rows/128), ceil(cols/128)]`` (2D). The
    block dimensionality is static (the recipe's), not part of the pytree."""

    q: object
    scale_inv: object


def _fixed24(v):
    """``v * 2**24`` as an int32, exact for an f32 ``v`` in [0.5, 2) (24 significant bits)."""
    import jax.numpy as jnp

    return (v * jnp.float32(2.0**24)).astype(jnp.int32)


def _residual24(n, q, d):
    """``(n - q d) * 2**48`` exactly, in int32, for ``n``, ``d`` in [0.5, 1) and ``q`` within a
    few ulps of ``n / d``: integer products of 12-bit halves (no float rounding, no fused
    multiply-add can touch them), carried into two base-2**24 limbs; the result is a few
    multiples of ``d * 2**24`` at most, far inside int32."""
    import jax.numpy as jnp

    nn, qq, dd = _fixed24(n), _fixed24(q), _fixed24(d)
    qh, ql = qq >> 12, qq & 0xFFF
    dh, dl = dd >> 12, dd & 0xFFF
    mid = qh * dl + ql * dh
    low = ql * dl + ((mid & 0xFFF) << 12)
    high = qh * dh + (mid >> 12) + (low >> 24)
    low = low & 0xFFFFFF
    return (nn - high) * jnp.int32(1 << 24) - low


def div_rn(n, d):
    """``n / d`` correctly rounded in f32 (CUDA's ``__fdiv_rn``, what TE's scale kernels
    use), for positive finite operands: XLA's GPU backend divides with an approximate
    instruction, off by an ulp at times, which a bit-exact scale must not be. The quotient
    is corrected to whichever neighbour leaves the smallest residual ``n - q d``."""
    import jax.numpy as jnp

    n = jnp.asarray(n, jnp.float32)
    d = jnp.asarray(d, jnp.float32)
    # Divide the mantissas (in [0.5, 1): the exact products below neither overflow nor
    # underflow), then scale by the exponents' difference (exact for a normal quotient).
    mn, en = jnp.frexp(n)
    md, ed = jnp.frexp(d)
    q = _div_mantissas(mn, md)
    return jnp.where((n > 0) & (d > 0) & jnp.isfinite(n) & jnp.isfinite(d), jnp.ldexp(q, en - ed), n / d)


def _div_mantissas(n, d, q0=None):
    """``n / d`` correctly rounded for ``n``, ``d`` in [0.5, 1), from a first quotient
    ``q0`` within two ulps (the backend's division when not given): each round moves the
    quotient one ulp toward the exact one while its exact residual lies beyond half the gap
    to that neighbour (``2 r > gap * d``, all in integers; a quotient of two 24-bit
    significands is never exactly half-way, so there are no ties)."""
    import jax.numpy as jnp

    q = n / d if q0 is None else q0
    dd = _fixed24(d)
    for _ in range(3):
        up = jnp.nextafter(q, jnp.float32(jnp.inf))
        down = jnp.nextafter(q, jnp.float32(0.0))
        r2 = 2 * _residual24(n, q, d)
        qq = _fixed24(q)
        go_up = r2 > (_fixed24(up) - qq) * dd
        go_down = r2 < -((qq - _fixed24(down)) * dd)
        q = jnp.where(go_up, up, jnp.where(go_down, down, q))
    return q


def block_scales(amax, fp8_max: float, eps: float = 0.0, pow2: bool = True, value_for_inf: float = FLT_MAX):
    """TE's ``compute_scale_from_amax`` per block: amax floored at ``eps``; 1 for an amax of
    0, inf or NaN; ``fp8_max / amax`` (``value_for_inf``, the input dtype's max, where that
    overflows), the mantissa cleared with ``pow2``."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(amax, jnp.float32)
    if eps > 0:
        a = jnp.maximum(a, jnp.float32(eps))
    ok = (a > 0) & jnp.isfinite(a)
    s = jnp.where(ok, div_rn(jnp.float32(fp8_max), jnp.where(ok, a, 1.0)), jnp.float32(1.0))
    s = jnp.where(jnp.isinf(s), jnp.float32(value_for_inf), s)
    if pow2:
        bits = jax.lax.bitcast_convert_type(s, jnp.int32) & jnp.int32(-8388608)  # 0xFF800000
        s = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return s


def quantize_block(x, block_dim: int, *, power_2_scale: bool = True, amax_epsilon: float = 0.0,
                   dtype="float8_e4m3fn") -> BlockQ:
    """Block-scaled cast of ``x``'s 2-D view ``[rows, x.shape[-1]]`` (rowwise: blocks along
    the rows; pass ``x.T`` for the columnwise form of a 1D cast)."""
    import jax.numpy as jnp

    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 or 2, got {block_dim!r}")
    dtype = jnp.dtype(dtype)
    fmax = FP8_MAX[dtype.name]
    vinf = float(jnp.finfo(x.dtype).max) if jnp.issubdtype(x.dtype, jnp.floating) else FLT_MAX
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    r, c = x2.shape
    b = BLOCK_LEN
    nb = -(-c // b)
    mb = -(-r // b) if block_dim == 2 else r
    rp = mb * b if block_dim == 2 else r
    xp = jnp.pad(x2, ((0, rp - r), (0, nb * b - c)))
    if block_dim == 1:
        t = xp.reshape(r, nb, b)
        amax = jnp.max(jnp.where(jnp.isnan(t), 0.0, jnp.abs(t)), axis=-1, initial=0.0)
        s = block_scales(amax, fmax, amax_epsilon, power_2_scale, vinf)
        q = jnp.clip(t * s[:, :, None], -fmax, fmax).astype(dtype).reshape(r, nb * b)[:, :c]
    else:
        t = xp.reshape(mb, b, nb, b)
        amax = jnp.max(jnp.where(jnp.isnan(t), 0.0, jnp.abs(t)), axis=(1, 3), initial=0.0)
        s = block_scales(amax, fmax, amax_epsilon, power_2_scale, vinf)
        q = jnp.clip(t * s[:, None, :, None], -fmax, fmax).astype(dtype).reshape(rp, nb * b)[:r, :c]
    return BlockQ(q, div_rn(jnp.float32(1.0), s))


def block_columnwise(x, block_dim: int, **kw) -> BlockQ:
    """The columnwise form of a block cast: the transposed tensor ``[cols, rows]`` quantized
    along its rows (1D: a cast of ``x.T``, not the transposed rowwise bytes; 2D: a tile is
    the same tile of the transpose)."""
    x2 = x.reshape(-1, x.shape[-1])
    if block_dim == 1:
        return quantize_block(x2.T, 1, **kw)
    r = quantize_block(x2, 2, **kw)
    return BlockQ(r.q.T, r.scale_inv.T)


class BlockQReady(NamedTuple):
    """A block-scaled cast whose ``scale_inv`` is in TE's GEMM-ready layout
    (:func:`ops.gemm_ready_scale_shape <transformer_engine_comm.jax.ops.gemm_ready_scale_shape>`
    of ``q``'s shape: 1D ``[ceil(cols/128), roundup(rows, 4)]``, 2D ``[ceil(rows/128),
    roundup(ceil(cols/128), 4)]``), what the library's block quantization writes
    (:func:`quantize_block_library`) and its block GEMM reads: the same data as the
    :class:`BlockQ` of the same cast, its scales laid out for the GEMM (padding entries
    0). :func:`block_dot` takes either; :func:`compact_scales` converts."""

    q: object
    scale_inv: object


def compact_scales(t: BlockQReady, block_dim: int) -> BlockQ:
    """The :class:`BlockQ` (compact scales) of a GEMM-ready cast: the padding dropped, 1D
    transposed back (entry (row, column block))."""
    rows, cols = t.q.shape
    nb = -(-cols // BLOCK_LEN)
    if block_dim == 1:
        return BlockQ(t.q, t.scale_inv[:, :rows].T)
    return BlockQ(t.q, t.scale_inv[:, :nb])


def quantize_block_library(x, block_dim: int, *, columnwise: bool = False, rowwise: bool = True,
                           power_2_scale: bool = True, amax_epsilon: float = 0.0, dtype="float8_e4m3fn",
                           gelu: bool = False, dbias: bool = False, dgelu_pre=None):
    """The block casts of ``x`` ``[R, C]`` on the library's kernel (:func:`ops.block_quantize
    <transformer_engine_comm.jax.ops.block_quantize>`: one read of the input for both
    forms; R and C multiples of 128): ``(rowwise, columnwise)`` :class:`BlockQReady` (or
    None where not asked for), the same bits as :func:`quantize_block` and
    :func:`block_columnwise`. ``gelu``: the casts of ``gelu(x)`` (tanh approximation) from
    the one read; ``dgelu_pre``: of ``x * gelu'(dgelu_pre)`` (the GELU's backward);
    ``dbias``: a third value, the float32 column sums of what was cast (a bias gradient).
    :func:`act_in_f32` computes the same values in jnp. GPU only."""
    from . import ops

    res = ops.block_quantize(x, block_dim, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon,
                             rowwise=rowwise, columnwise=columnwise, dtype=dtype, gelu=gelu, dbias=dbias,
                             dgelu_pre=dgelu_pre)
    row, col = res[0], res[1]
    casts = (None if row is None else BlockQReady(*row)), (None if col is None else BlockQReady(*col))
    return casts + (res[2],) if dbias else casts


def dequantize_block(t: BlockQ, block_dim: int, dtype="float32"):
    """``dtype(q * scale_inv)`` of a rowwise block cast (:class:`BlockQ` or :class:`BlockQReady`)."""
    import jax.numpy as jnp

    if isinstance(t, BlockQReady):
        t = compact_scales(t, block_dim)

    r, c = t.q.shape
    s = jnp.repeat(t.scale_inv, BLOCK_LEN, axis=1)[:, :c]
    if block_dim == 2:
        s = jnp.repeat(s, BLOCK_LEN, axis=0)[:r]
    return (t.q.astype(jnp.float32) * s).astype(dtype)


def act_in_f32(x, gelu: bool = False, dgelu_pre=None):
    """What the library's fused casts quantize, in jnp: ``gelu(x)`` (tanh approximation) or
    ``x * gelu'(dgelu_pre)``, computed in float32 and rounded once to ``x``'s dtype (``x``
    itself with neither). As the kernel: ``0.5 (1 + tanh(u)) = sigmoid(2 u)``, ``u =
    sqrt(2 / pi) (v + 0.044715 v^3)``, so ``gelu(v) = v s`` and ``gelu'(v) = s + 2 v s (1 - s)
    du/dv`` with ``s = sigmoid(2 u)``: no ``1 + tanh`` cancelling for negative ``v`` (where
    float32 tanh loses the small gradients)."""
    import jax
    import jax.numpy as jnp

    if not gelu and dgelu_pre is None:
        return x
    c = 0.7978845608028654
    v = (x if gelu else dgelu_pre).astype(jnp.float32)
    s = jax.nn.sigmoid(2.0 * c * v * (1.0 + 0.044715 * v * v))
    if gelu:
        return (v * s).astype(x.dtype)
    du = c * (1.0 + 3.0 * 0.044715 * v * v)
    return (x.astype(jnp.float32) * (s + 2.0 * v * du * s * (1.0 - s))).astype(x.dtype)


def _gelu_vjp(pre, g):
    """The tanh-approximate GELU's VJP at ``pre`` of the cotangent ``g`` (JAX's, in ``pre``'s
    dtype, as autodiff computes it)."""
    import jax

    _, vjp = jax.vjp(lambda v: jax.nn.gelu(v, approximate=True), pre)
    return vjp(g.astype(pre.dtype))[0]


# How block_dot runs its GEMM: "auto" (the default: the library's block-scaled FP8 GEMM,
# ops.block_gemm, when JAX's backend is a Hopper GPU, the library loads and the shapes fit
# cuBLASLt's rules; else the dequantized dot), "library" (always: an error where it
# cannot) or "dequant" (the reference path, the only one on CPU). The layers read it when
# they are called (their backward runs the same way as their forward).
BLOCK_GEMM = "auto"


# How the block layers cast (quantize): "auto" (the default: the library's block quantize
# kernel, ops.block_quantize, where the layer's block GEMMs run on the library -- BLOCK_GEMM
# "library", or "auto" on a Hopper GPU -- and the tensor is whole 128 x 128 tiles; else the
# jnp casts), "library" (the library's kernel wherever the tensor is whole tiles) or "jnp"
# (the jnp casts, the reference: quantize_block / block_columnwise). Read when the layers
# are called, as BLOCK_GEMM.
BLOCK_CASTS = "auto"


def block_casts_on_library(shape, dtype, gemm_mode=None, casts_mode=None) -> bool:
    """Whether a block layer casts a tensor of ``shape`` / ``dtype`` on the library's kernel
    under ``casts_mode`` (:data:`BLOCK_CASTS`) and ``gemm_mode`` (:data:`BLOCK_GEMM`)."""
    from . import ops

    casts_mode = BLOCK_CASTS if casts_mode is None else casts_mode
    gemm_mode = BLOCK_GEMM if gemm_mode is None else gemm_mode
    if casts_mode not in ("auto", "library", "jnp"):
        raise ValueError(f"block casts mode must be 'auto', 'library' or 'jnp', got {casts_mode!r}")
    if casts_mode == "jnp" or not ops.block_quantize_fits(shape, dtype):
        return False
    if casts_mode == "library" or gemm_mode == "library":
        return True
    return gemm_mode == "auto" and ops.block_gemm_available()


def _block_gemm_on_library(a: "BlockQ", a_dim: int, b: "BlockQ", b_dim: int, out_dtype, mode) -> bool:
    """Whether :func:`block_dot` runs on the library's GEMM under ``mode``."""
    import jax.numpy as jnp
    from . import ops

    mode = BLOCK_GEMM if mode is None else mode
    if mode not in ("auto", "library", "dequant"):
        raise ValueError(f"block GEMM mode must be 'auto', 'library' or 'dequant', got {mode!r}")
    if mode == "dequant":
        return False
    (m, k), n = a.q.shape, b.q.shape[0]
    fits = (ops.block_gemm_fits(m, n, k, a.q.dtype, b.q.dtype, a_dim, b_dim)
            and jnp.dtype(out_dtype).name in ("bfloat16", "float16", "float32"))
    if mode == "library":
        if not fits:
            raise ValueError(f"the library's block GEMM does not take [{m}, {k}] ({a_dim}D, {a.q.dtype}) x "
                             f"[{n}, {k}]^T ({b_dim}D, {b.q.dtype}) -> {jnp.dtype(out_dtype).name} "
                             "(k % 16, n % 8, m % 8 for a 1D a; not 2D x 2D; bf16 / f16 / f32 out)")
        return True
    return fits and ops.block_gemm_available()


def block_dot(a, a_dim: int, b, b_dim: int, out_dtype, exact_bf16: bool = True, gemm=None,
              bias=None, dgelu_pre=None):
    """``a @ b^T`` (``a`` ``[M, K]``, ``b`` ``[N, K]``, rowwise forms: :class:`BlockQ` or
    :class:`BlockQReady`) of block-scaled FP8 operands. On a GPU with the library (``gemm``
    / :data:`BLOCK_GEMM` "auto" or "library"): the library's block-scaled FP8 GEMM
    (:func:`ops.block_gemm <transformer_engine_comm.jax.ops.block_gemm>`, a
    :class:`BlockQ`'s scales converted to TE's GEMM-ready layout, a :class:`BlockQReady`'s
    taken as they are). Else ("dequant", and on CPU) the dot of the dequantized operands
    with the same products: f32 accumulation (bf16 operands when ``exact_bf16`` --
    power-of-2 scales, where the dequantized values are exact in bf16 --, else f32 operands
    at Precision.HIGHEST). ``bias`` (``[N]``): ``+ bias`` in ``out_dtype``, in the GEMM's
    epilogue on the library (before the output's rounding) where ``out_dtype`` is bf16 or
    f16 (cuBLASLt's bias type), else after the GEMM. ``dgelu_pre`` (``[M, N]``, the input
    of a tanh-approximate GELU; not with ``bias``): the GELU's backward, ``(a @ b^T) *
    gelu'(dgelu_pre)``, in the GEMM's epilogue on the library (bf16 / f16 outputs: one
    rounding), else JAX's GELU VJP of the product rounded to ``out_dtype`` (as autodiff of
    the unfused layers computes it)."""
    import jax
    import jax.numpy as jnp

    if a_dim == 2 and b_dim == 2:
        raise ValueError("block_dot: a 2D by 2D block GEMM is not supported (as in TE)")
    if bias is not None and dgelu_pre is not None:
        raise ValueError("block_dot: bias or dgelu_pre, not both")
    on_lib = _block_gemm_on_library(a, a_dim, b, b_dim, out_dtype, gemm)
    half = jnp.dtype(out_dtype).name in ("bfloat16", "float16")
    if dgelu_pre is not None and not (on_lib and half):
        return _gelu_vjp(dgelu_pre, block_dot(a, a_dim, b, b_dim, out_dtype, exact_bf16, gemm))
    if on_lib:
        from . import ops

        (m, k), n = a.q.shape, b.q.shape[0]
        out = jnp.dtype(out_dtype)
        fuse = bias is not None and half
        sa = a.scale_inv if isinstance(a, BlockQReady) else ops.gemm_ready_scales(a.scale_inv, m, k, a_dim)
        sb = b.scale_inv if isinstance(b, BlockQReady) else ops.gemm_ready_scales(b.scale_inv, n, k, b_dim)
        y = ops.block_gemm(a.q, sa, b.q, sb, a_block_dim=a_dim, b_block_dim=b_dim, out_dtype=out.name,
                           bias=bias.astype(out) if fuse else None,
                           dgelu_pre=None if dgelu_pre is None else dgelu_pre.astype(out))
        return y + bias.astype(out) if bias is not None and not fuse else y
    a = compact_scales(a, a_dim) if isinstance(a, BlockQReady) else a
    b = compact_scales(b, b_dim) if isinstance(b, BlockQReady) else b
    qa, qb = jax.lax.optimization_barrier((a.q, b.q))
    ct = jnp.bfloat16 if exact_bf16 else jnp.float32
    da = dequantize_block(BlockQ(qa, a.scale_inv), a_dim, ct)
    db = dequantize_block(BlockQ(qb, b.scale_inv), b_dim, ct)
    prec = None if exact_bf16 else jax.lax.Precision.HIGHEST
    y = jax.lax.dot_general(da, db, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
    y = y.astype(out_dtype)
    return y if bias is None else y + bias.astype(out_dtype)
