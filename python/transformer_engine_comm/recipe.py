"""Transformer Engine's FP8 recipes, framework-neutral: one family for torch and JAX.

``transformer_engine_comm.torch.fp8`` and ``transformer_engine_comm.jax.fp8`` re-export
these same classes (``torch.fp8.DelayedScaling is jax.fp8.DelayedScaling``) and add only
the mapping from the dtype names used here (the core's canonical names,
``"float8_e4m3fn"`` and ``"float8_e5m2"``) to their own dtypes. Nothing here imports
torch, JAX or numpy.

Names, field types and defaults are TE's (``transformer_engine.common.recipe``):

- :class:`Format`: ``E4M3`` (e4m3 everywhere), ``E5M2`` (e5m2 everywhere: TE's name; no
  recipe takes it, "pure E5M2 training is not supported", as in TE), ``HYBRID`` (e4m3 for
  the forward tensors -- inputs and weights --, e5m2 for the gradients).
- :class:`DelayedScaling` ``(margin: int = 0, fp8_format: Format = Format.HYBRID,
  amax_history_len: int = 1024, amax_compute_algo: str = "max", reduce_amax: bool =
  True)``: the scale of step t is ``(fp8_max / amax) / 2**margin`` with amax the maximum
  (``"max"``) or the newest entry (``"most_recent"``) of the amax history of the steps
  before it. ``reduce_amax``: the amaxes are max-reduced over the tensor-parallel group
  before each update, so every rank computes the same scales (torch: the module's TP
  group; JAX: the ``shard_map`` axis, where it must stay True: the state is replicated).
- :class:`Float8CurrentScaling` ``(fp8_format: Format = Format.HYBRID, amax_epsilon: float
  = 0.0, force_pow_2_scales: bool = False)``: each tensor's scale from its own amax (TE's
  ``nvte_compute_scale_from_amax``: amax floored at ``amax_epsilon``, the scale rounded
  down to a power of 2 with ``force_pow_2_scales``).

- :class:`Float8BlockScaling` ``(use_f32_scales: bool = False, fp8_format: Format =
  Format.E4M3, fp8_quant_fwd_inp / fp8_quant_fwd_weight / fp8_quant_bwd_grad: QParams =
  QParams(power_2_scale=True, amax_epsilon=0.0), x_block_scaling_dim: int = 1,
  w_block_scaling_dim: int = 2, grad_block_scaling_dim: int = 1, fp8_gemm_fprop /
  fp8_gemm_dgrad / fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True))``
  (DeepSeek-V3's block scaling): one float32 scale per 128 consecutive values along a row
  (1D blocks, ``NVTE_BLOCK_SCALING_1D``) or per 128x128 tile (2D, ``NVTE_BLOCK_SCALING_2D``),
  each from its own block's amax (no history, nothing to reduce across ranks); by default
  activations and gradients 1D, weights 2D, e4m3 in both passes, scales powers of 2. TE's
  checks: block dims 1 or 2, never two 2D operands in one GEMM (x and w, x and grad, w and
  grad), split accumulation in all three GEMMs, no E5M2. ``use_f32_scales=True`` makes the
  three QParams' default ``power_2_scale=False`` (TE reads that default from
  ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``; this package reads no environment for it).
  ``fp8_format`` must be E4M3 here: TE also accepts HYBRID, but the library's block-scaled
  GEMMs take e4m3 operands only, so HYBRID is refused rather than silently run in e4m3.

Not taken (a keyword TE knows but the library does not run is refused as an unknown
keyword, never ignored): a callable ``amax_compute_algo``, ``scaling_factor_compute_algo``,
``fp8_dpa`` / ``fp8_mha`` (no attention here), ``backward_override``; QParams' NVFP4
options (``random_hadamard_transform``, ``stochastic_rounding``, ``fp4_2d_quantization``)
are refused unless False.

Values are converted to TE's types where nothing is lost: an integral float margin or
history length (``margin=1.0``) becomes an int, as TE's (pydantic) dataclass does; a
fractional one (``margin=0.5``) is refused, naming the field, as TE refuses it; a format
may be given by name (``fp8_format="hybrid"``).
"""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass
from typing import Tuple, Union

from . import _core

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "BLOCK_LEN",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "QParams",
    "Recipe",
    "RECIPE_NAMES",
    "block_scale_shape",
    "recipe_from_name",
]

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# recipe_from_name's names (the examples' --fp8-recipe choices).
RECIPE_NAMES = ("delayed", "current", "block")
# Float8BlockScaling's block length (TE's Float8BlockQuantizer.block_len): 1D blocks are
# 1 x BLOCK_LEN, 2D blocks BLOCK_LEN x BLOCK_LEN.
BLOCK_LEN = 128


class Format(enum.Enum):
    """TE's ``recipe.Format``. ``fwd`` / ``bwd``: the dtype names (the core's canonical
    names) of the forward tensors (inputs, weights) and of the gradients; ``max_fwd`` /
    ``max_bwd``: their largest finite values (TE's ``Format.X.value.max_fwd``).
    ``Format("hybrid")``: by name, any case."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            return cls.__members__.get(value.strip().upper())
        return None

    @property
    def fwd(self) -> str:
        """The forward dtype's name: ``"float8_e4m3fn"`` (E4M3, HYBRID) or ``"float8_e5m2"``."""
        return _core.FP8_FORMATS[self.value][0]

    @property
    def bwd(self) -> str:
        """The backward (gradient) dtype's name: ``"float8_e5m2"`` (E5M2, HYBRID) or
        ``"float8_e4m3fn"``."""
        return _core.FP8_FORMATS[self.value][1]

    @property
    def max_fwd(self) -> float:
        return _core.FP8_MAX[self.fwd]

    @property
    def max_bwd(self) -> float:
        return _core.FP8_MAX[self.bwd]


# ------------------------------------------------------------------------------ checks


def _format(cls: str, value) -> Format:
    if isinstance(value, Format):
        fmt = value
    else:
        try:
            fmt = Format(value)
        except ValueError:
            raise ValueError(f"{cls}: fp8_format must be Format.HYBRID or Format.E4M3 (or their names), "
                             f"got {value!r}") from None
    if fmt is Format.E5M2:
        raise ValueError(f"{cls}: fp8_format=Format.E5M2 is not supported (pure E5M2 training, as in TE): "
                         "use Format.HYBRID (e5m2 for the gradients) or Format.E4M3")
    return fmt


def _int(cls: str, field: str, value) -> int:
    """An int (TE's type): ints and integral floats; bools, fractional floats and
    non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{cls}: {field} must be an int, got {value!r} ({type(value).__name__})")
    if isinstance(value, numbers.Integral):
        return int(value)
    f = float(value)
    if not (math.isfinite(f) and f.is_integer()):
        raise ValueError(f"{cls}: {field} must be an integer (TE's type is int), got {value!r}")
    return int(f)


def _bool(cls: str, field: str, value) -> bool:
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool without numpy
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{cls}: {field} must be a bool, got {value!r} ({type(value).__name__})")


def _set(obj, field: str, value) -> None:
    object.__setattr__(obj, field, value)  # frozen dataclass: converted in __post_init__


# ------------------------------------------------------------------------------ recipes


class _PerTensorRecipe:
    """What both recipes answer, framework-neutral (dtype names)."""

    fp8_format: Format

    @property
    def delayed(self) -> bool:
        """Whether the scales come from an amax history (:class:`DelayedScaling`)."""
        return isinstance(self, DelayedScaling)

    block = False  # per-tensor scales (Float8BlockScaling says True)

    @property
    def dtypes(self) -> Tuple[str, str, str]:
        """The FP8 dtype names of (input, weight, output gradient), TE's order:
        forward, forward, backward."""
        f = self.fp8_format
        return (f.fwd, f.fwd, f.bwd)


@dataclass(frozen=True)
class DelayedScaling(_PerTensorRecipe):
    """TE's delayed scaling recipe: per-tensor scales from an amax history (see the module
    docstring; fields, types and defaults are TE's)."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self):
        cls = "DelayedScaling"
        _set(self, "margin", _int(cls, "margin", self.margin))
        _set(self, "fp8_format", _format(cls, self.fp8_format))
        n = _int(cls, "amax_history_len", self.amax_history_len)
        if n < 1:
            raise ValueError(f"{cls}: amax_history_len must be >= 1, got {self.amax_history_len!r}")
        _set(self, "amax_history_len", n)
        algo = self.amax_compute_algo
        if callable(algo):
            raise ValueError(f"{cls}: amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}; a callable (which TE "
                             "takes) is not supported: the library's update kernel implements those two")
        if algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"{cls}: amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, got {algo!r}")
        _set(self, "reduce_amax", _bool(cls, "reduce_amax", self.reduce_amax))


@dataclass(frozen=True)
class Float8CurrentScaling(_PerTensorRecipe):
    """TE's per-tensor current scaling recipe: each tensor's scale from its own amax (an
    amax pass, then the cast). ``amax_epsilon`` and ``force_pow_2_scales`` are the
    arguments of TE's ``nvte_compute_scale_from_amax``."""

    fp8_format: Format = Format.HYBRID
    amax_epsilon: float = 0.0
    force_pow_2_scales: bool = False

    def __post_init__(self):
        cls = "Float8CurrentScaling"
        _set(self, "fp8_format", _format(cls, self.fp8_format))
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
            raise TypeError(f"{cls}: amax_epsilon must be a float, got {eps!r} ({type(eps).__name__})")
        eps = float(eps)
        if not (eps >= 0.0 and math.isfinite(eps)):
            raise ValueError(f"{cls}: amax_epsilon must be finite and >= 0, got {self.amax_epsilon!r}")
        _set(self, "amax_epsilon", eps)
        _set(self, "force_pow_2_scales", _bool(cls, "force_pow_2_scales", self.force_pow_2_scales))


def _float_eps(cls: str, field: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{cls}: {field} must be a float, got {eps!r} ({type(eps).__name__})")
    f = float(eps)
    if not (f >= 0.0 and math.isfinite(f)):
        raise ValueError(f"{cls}: {field} must be finite and >= 0, got {eps!r}")
    return f


@dataclass(frozen=True)
class QParams:
    """TE's ``recipe.QParams`` (the quantization options of one tensor role):
    ``power_2_scale`` rounds each block's scale down to a power of 2; ``amax_epsilon``
    floors each block's amax. The NVFP4 options are taken only as False."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self):
        cls = "QParams"
        _set(self, "power_2_scale", _bool(cls, "power_2_scale", self.power_2_scale))
        _set(self, "amax_epsilon", _float_eps(cls, "amax_epsilon", self.amax_epsilon))
        for f in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
            if _bool(cls, f, getattr(self, f)):
                raise ValueError(f"{cls}: {f}=True is an NVFP4 option; FP8 block scaling does not take it")
            _set(self, f, False)


@dataclass(frozen=True)
class MMParams:
    """TE's ``recipe.MMParams``: ``use_split_accumulator`` (full-precision accumulation of
    an FP8 GEMM; False is cuBLASLt's fast accumulation)."""

    use_split_accumulator: bool = True

    def __post_init__(self):
        _set(self, "use_split_accumulator", _bool("MMParams", "use_split_accumulator", self.use_split_accumulator))


_ROLES = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
_DIMS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
_GEMMS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


@dataclass(frozen=True)
class Float8BlockScaling:
    """TE's block scaling recipe (see the module docstring; fields, defaults and checks
    are TE's). A QParams left as None takes the default ``QParams(power_2_scale=not
    use_f32_scales)``."""

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = None
    fp8_quant_fwd_weight: QParams = None
    fp8_quant_bwd_grad: QParams = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams()
    fp8_gemm_dgrad: MMParams = MMParams()
    fp8_gemm_wgrad: MMParams = MMParams()

    def __post_init__(self):
        cls = "Float8BlockScaling"
        f32 = _bool(cls, "use_f32_scales", self.use_f32_scales)
        _set(self, "use_f32_scales", f32)
        fmt = _format(cls, self.fp8_format)
        if fmt is not Format.E4M3:
            raise ValueError(f"{cls}: fp8_format must be Format.E4M3 (the library's block-scaled GEMMs take e4m3 "
                             f"operands in both passes), got {fmt}")
        _set(self, "fp8_format", fmt)
        for role in _ROLES:
            q = getattr(self, role)
            if q is None:
                q = QParams(power_2_scale=not f32)
            elif not isinstance(q, QParams):
                raise TypeError(f"{cls}: {role} must be a QParams, got {q!r}")
            _set(self, role, q)
        for d in _DIMS:
            v = _int(cls, d, getattr(self, d))
            if v not in (1, 2):
                raise ValueError(f"{cls}: {d} must be 1 or 2 (1D or 2D blocks), got {getattr(self, d)!r}")
            _set(self, d, v)
        x, w, g = (getattr(self, d) for d in _DIMS)
        for (a, an), (b, bn) in (((x, "x"), (w, "w")), ((x, "x"), (g, "grad")), ((w, "w"), (g, "grad"))):
            if a == 2 and b == 2:
                raise ValueError(f"{cls}: {an}_block_scaling_dim and {bn}_block_scaling_dim are both 2: "
                                 "a 2D by 2D block GEMM is not supported (as in TE)")
        for gm in _GEMMS:
            p = getattr(self, gm)
            if not isinstance(p, MMParams):
                raise TypeError(f"{cls}: {gm} must be an MMParams, got {p!r}")
            if not p.use_split_accumulator:
                raise ValueError(f"{cls}: {gm}.use_split_accumulator must be True: block-scaled FP8 GEMMs need "
                                 "split accumulation (as in TE)")

    delayed = False

    @property
    def block(self) -> bool:
        """True: this recipe scales per block (the per-tensor recipes say False)."""
        return True

    @property
    def dtypes(self) -> Tuple[str, str, str]:
        """The FP8 dtype names of (input, weight, output gradient): e4m3 for all three."""
        f = self.fp8_format
        return (f.fwd, f.fwd, f.bwd)

    @property
    def block_dims(self) -> Tuple[int, int, int]:
        """The block dimensionality (1 or 2) of (input, weight, output gradient)."""
        return (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)

    @property
    def qparams(self) -> Tuple[QParams, QParams, QParams]:
        """The QParams of (input, weight, output gradient)."""
        return (self.fp8_quant_fwd_inp, self.fp8_quant_fwd_weight, self.fp8_quant_bwd_grad)


def block_scale_shape(rows: int, cols: int, block_dim: int, columnwise: bool = False) -> Tuple[int, int]:
    """The scale_inv shape of a block-scaled ``[rows, cols]`` tensor in TE's GEMM-ready
    layout (``Float8BlockQuantizer.get_scale_shape``, padded to multiples of 4): 2D ->
    ``(ceil(rows/128), roundup(ceil(cols/128), 4))`` (columnwise: rows and cols swapped);
    1D -> ``(ceil(cols/128), roundup(rows, 4))``, each row's scales stored as a column
    (columnwise: ``(ceil(rows/128), roundup(cols, 4))``). The columnwise data is the
    transposed tensor ``[cols, rows]``; its scale shape is the rowwise shape of that."""
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 or 2, got {block_dim!r}")
    if columnwise:
        rows, cols = cols, rows
    b = BLOCK_LEN
    if block_dim == 2:
        return -(-rows // b), -(-(-(-cols // b)) // 4) * 4
    return -(-cols // b), -(-rows // 4) * 4


Recipe = Union[DelayedScaling, Float8CurrentScaling, Float8BlockScaling]


def recipe_from_name(name: str, **kwargs) -> Recipe:
    """``"delayed"`` -> :class:`DelayedScaling`, ``"current"`` ->
    :class:`Float8CurrentScaling`, ``"block"`` -> :class:`Float8BlockScaling`
    (``kwargs``: the recipe's fields)."""
    if name == "delayed":
        return DelayedScaling(**kwargs)
    if name == "current":
        return Float8CurrentScaling(**kwargs)
    if name == "block":
        return Float8BlockScaling(**kwargs)
    raise ValueError(f"unknown FP8 recipe {name!r}: expected one of {RECIPE_NAMES}")
