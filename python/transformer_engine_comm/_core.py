"""The framework-neutral core of the Python package: what the ctypes binding, the torch
adapter and the JAX adapter share, with no import of ctypes' library, torch, jax or numpy.

- **C enums** (``NVTEDType``, ``NVTECommStatus``, ``NVTECommGemmAlgoType``, ...), as in
  ``src/ffi/c_enums.in``, the one table the header and the Rust types come from;
  ``python/tests/test_core.py`` checks every class here against that table and the header.
  :class:`Algo` is :class:`GemmAlgo` with short names (``SPLIT_P2P``: the torch ops'
  ``GemmAlgo``), derived from it.
- **Ops**: the three comm-GEMM ops' names and ``nvte_comm_gemm_call_packed`` op codes.
- **Transports and communicators**: the transport names (``NVTECommTransport`` without its
  prefix, lower case: ``"auto"``, ``"ipc"``, ``"nccl"``), the communicator kinds of a
  context, their validation, and the key a context is cached under.
- **Dtypes**: a framework's dtype objects by name (:class:`Dtypes`), the NVTEDType of each
  name, the FP8 dtypes, their largest values and TE's FP8 formats, and the ops' dtype rules
  (which inputs, outputs and biases go together).
- **Block distribution** (:func:`numroc`, :func:`block_offset`: the library's
  ``nvte_comm_gemm_numroc``) and **shape planning** of the three ops in
  ``nvte_cublas_gemm``'s layouts (``transa`` / ``transb``): :func:`plan_all_gather`,
  :func:`plan_k_split` -> :class:`Plan` (the global m, n, k passed to the library, the
  output's shape and dtype).

Errors are raised with the messages the torch ops have always raised (their tests match
them); ``op`` names the operation in each message. Everything here runs once per argument
signature (the adapters cache their plans), not per call.
"""
from __future__ import annotations

import enum
import operator
import os
import re
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

# --------------------------------------------------------------------------------------
# C enums: src/ffi/c_enums.in (python/tests/test_core.py checks them against it and the
# header; its failure message prints the classes to paste after a change there)
# --------------------------------------------------------------------------------------


class DType(enum.IntEnum):
    """NVTEDType."""

    kNVTEByte = 0
    kNVTEInt16 = 1
    kNVTEInt32 = 2
    kNVTEInt64 = 3
    kNVTEFloat32 = 4
    kNVTEFloat16 = 5
    kNVTEBFloat16 = 6
    kNVTEFloat8E4M3 = 7
    kNVTEFloat8E5M2 = 8
    kNVTEFloat8E8M0 = 9
    kNVTEFloat4E2M1 = 10
    kNVTENumTypes = 11


class TensorParam(enum.IntEnum):
    """NVTETensorParam."""

    kNVTERowwiseData = 0
    kNVTEColumnwiseData = 1
    kNVTEScale = 2
    kNVTEAmax = 3
    kNVTERowwiseScaleInv = 4
    kNVTEColumnwiseScaleInv = 5
    kNVTEColumnwiseAmax = 6
    kNVTENumTensorParams = 7


class ScalingMode(enum.IntEnum):
    """NVTEScalingMode (only NVTE_DELAYED_TENSOR_SCALING is implemented)."""

    NVTE_DELAYED_TENSOR_SCALING = 0
    NVTE_MXFP8_1D_SCALING = 1
    NVTE_BLOCK_SCALING_1D = 2
    NVTE_BLOCK_SCALING_2D = 3
    NVTE_NVFP4_1D_SCALING = 4
    NVTE_INVALID_SCALING = 100


class QuantizationConfigAttribute(enum.IntEnum):
    """NVTEQuantizationConfigAttribute (TE's values)."""

    kNVTEQuantizationConfigForcePow2Scales = 0
    kNVTEQuantizationConfigAmaxEpsilon = 1
    kNVTEQuantizationConfigNoopTensor = 2
    kNVTEQuantizationConfigFloat8BlockScaleTensorFormat = 3
    kNVTEQuantizationConfigRNGState = 4
    kNVTEQuantizationConfigNVFP42DQuantization = 5
    kNVTEQuantizationConfigStochasticRounding = 6
    kNVTEQuantizationConfigUseFastMath = 7
    kNVTEQuantizationConfigNVFP44Over6Mode = 8
    kNVTEQuantizationConfigNVFP44Over6ErrUseFastMath = 9
    kNVTEQuantizationConfigMXFP82DQuantization = 10
    kNVTEQuantizationConfigNumAttributes = 11


class Status(enum.IntEnum):
    """NVTECommStatus."""

    NVTE_COMM_SUCCESS = 0
    NVTE_COMM_ERROR_INVALID_ARGUMENT = 1
    NVTE_COMM_ERROR_CUDA = 2
    NVTE_COMM_ERROR_CUBLAS = 3
    NVTE_COMM_ERROR_NCCL = 4
    NVTE_COMM_ERROR_NVRTC = 5
    NVTE_COMM_ERROR_TIMEOUT = 6
    NVTE_COMM_ERROR_UNSUPPORTED = 7
    NVTE_COMM_ERROR_LIBRARY_NOT_FOUND = 8
    NVTE_COMM_ERROR_OUT_OF_MEMORY = 9
    NVTE_COMM_ERROR_INTERNAL = 10


class OverlapType(enum.IntEnum):
    """NVTECommOverlapType."""

    NVTE_COMM_OVERLAP_RS = 0
    NVTE_COMM_OVERLAP_AG = 1


class Transport(enum.IntEnum):
    """NVTECommTransport."""

    NVTE_COMM_TRANSPORT_AUTO = 0
    NVTE_COMM_TRANSPORT_IPC = 1
    NVTE_COMM_TRANSPORT_NCCL = 2


class Library(enum.IntEnum):
    """NVTECommLibrary: the CUDA libraries loaded at run time."""

    NVTE_COMM_LIB_CUDA_DRIVER = 0
    NVTE_COMM_LIB_CUBLASLT = 1
    NVTE_COMM_LIB_NVRTC = 2
    NVTE_COMM_LIB_NCCL = 3


class GemmAlgo(enum.IntEnum):
    """NVTECommGemmAlgoType."""

    kNVTECommGemmAlgoDefault = 0
    kNVTECommGemmAlgoSplitP2P = 1
    kNVTECommGemmAlgoSplitMulticast = 2
    kNVTECommGemmAlgoAtomicP2P = 3
    kNVTECommGemmAlgoAtomicMulticast = 4


class MatmulConfigAttribute(enum.IntEnum):
    """NVTEMatmulConfigAttribute (TE's values; nvte_cublas_gemm_v2's config)."""

    kNVTEMatmulConfigBiasTensor = 0
    kNVTEMatmulConfigDBiasTensor = 1
    kNVTEMatmulConfigWithGELUEpilogue = 2
    kNVTEMatmulConfigWithDGELUEpilogue = 3
    kNVTEMatmulConfigEpilogueAuxTensor = 4
    kNVTEMatmulConfigUseSplitAccumulator = 5
    kNVTEMatmulConfigSMCount = 6
    kNVTEMatmulConfigNumAttributes = 7


# Python enum -> the C typedef it mirrors, in src/ffi/c_enums.in's order.
C_ENUMS = {
    "NVTEDType": DType,
    "NVTETensorParam": TensorParam,
    "NVTEScalingMode": ScalingMode,
    "NVTEQuantizationConfigAttribute": QuantizationConfigAttribute,
    "NVTECommStatus": Status,
    "NVTECommOverlapType": OverlapType,
    "NVTECommTransport": Transport,
    "NVTECommLibrary": Library,
    "NVTECommGemmAlgoType": GemmAlgo,
    "NVTEMatmulConfigAttribute": MatmulConfigAttribute,
}


def _short_name(name: str, prefix: str) -> str:
    """``kNVTECommGemmAlgoSplitP2P`` less ``prefix``, in upper snake case: ``SPLIT_P2P``."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name[len(prefix):]).upper()


# GemmAlgo with short names (the torch ops' ``GemmAlgo``: DEFAULT, SPLIT_P2P, ...; the
# atomic variants run the fused algorithms, the multicast ones never use multicast). Its class is named GemmAlgo, as the
# torch ops have always shown it; it is found (pickled) as _core.Algo.
Algo = enum.IntEnum(
    "GemmAlgo",
    [(_short_name(a.name, "kNVTECommGemmAlgo"), int(a)) for a in GemmAlgo],
    module=__name__,
    qualname="Algo",
)
Algo.__doc__ = (
    "NVTECommGemmAlgoType (ATOMIC_P2P / ATOMIC_MULTICAST: the fused algorithms, our GEMM "
    "in one launch; SPLIT_MULTICAST runs as SPLIT_P2P; multicast is never used)."
)

ALGO_NAMES = {a.name.lower(): int(a) for a in Algo}


def algo_id(algo: Union[str, int]) -> int:
    """The NVTECommGemmAlgoType value of ``algo``: a name of :class:`Algo` (any case), an
    :class:`Algo` / :class:`GemmAlgo` or an int. ValueError for anything else."""
    if isinstance(algo, str):
        a = ALGO_NAMES.get(algo.lower())
        if a is None:
            raise ValueError(f"algo must be one of {sorted(ALGO_NAMES)} (or a GemmAlgo), got {algo!r}")
        return a
    a = int(algo)
    if a not in ALGO_NAMES.values():
        raise ValueError(f"algo must be one of {sorted(ALGO_NAMES)} (or a GemmAlgo), got {algo!r}")
    return a


# --------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------

# NVTECommGemmPacked.op (the header's NVTE_COMM_GEMM_PACKED_* defines)
PACKED_ALL_GATHER, PACKED_REDUCE_SCATTER, PACKED_ALL_REDUCE = 0, 1, 2
PACKED_GEMM = 3  # a local GEMM: nvte_comm_cublas_gemm_packed
PACKED_OPS = {
    "all_gather_gemm": PACKED_ALL_GATHER,
    "gemm_reduce_scatter": PACKED_REDUCE_SCATTER,
    "gemm_all_reduce": PACKED_ALL_REDUCE,
}
OPS = tuple(PACKED_OPS)

# --------------------------------------------------------------------------------------
# Transports, communicators, the context cache key
# --------------------------------------------------------------------------------------

_TRANSPORT_PREFIX = "NVTE_COMM_TRANSPORT_"
# "auto", "ipc", "nccl": NVTECommTransport's names, in its order.
TRANSPORTS = tuple(t.name[len(_TRANSPORT_PREFIX):].lower() for t in Transport)
TRANSPORT_IDS = {name: int(t) for name, t in zip(TRANSPORTS, Transport)}
# The environment variable the library reads a context's transport from at its creation.
TRANSPORT_ENV = "NVTE_COMM_TRANSPORT"
# The communicator a context runs over: the framework's own ("pg": a ProcessGroupNCCL's)
# or one this package creates for the group ("own").
COMM_KINDS = ("pg", "own")


def _or_list(values: Sequence) -> str:
    """``'a', 'b' or 'c'``."""
    r = [repr(v) for v in values]
    return r[0] if len(r) == 1 else ", ".join(r[:-1]) + " or " + r[-1]


def transport_name(transport_id: int) -> str:
    """The name of an NVTECommTransport value ("auto" for one this package does not know)."""
    for name, i in TRANSPORT_IDS.items():
        if i == transport_id:
            return name
    return "auto"


def check_op_kind(comm, transport) -> Tuple[str, str]:
    """The ops' ``comm`` / ``transport`` arguments: (comm, the transport key: "" for None).
    ValueError for another comm kind or transport name ("" included)."""
    if comm not in COMM_KINDS:
        raise ValueError(f"comm must be {_or_list(COMM_KINDS)}, got {comm!r}")
    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(f"transport must be None, {_or_list(TRANSPORTS)}, got {transport!r}")
    return comm, transport or ""


def transport_key(transport) -> str:
    """The transport part of a context's key: "" (None or "": the environment decides when
    the context is created) or a :data:`TRANSPORTS` name."""
    t = transport or ""
    if t and t not in TRANSPORTS:
        raise ValueError(f"transport must be None or one of {TRANSPORTS}, got {transport!r}")
    return t


def context_key(group_name: str, comm: str, transport) -> Tuple[str, str, str]:
    """The key a comm-GEMM context is cached under: (group name, communicator kind,
    transport key). ValueError for a comm kind or transport the package does not have."""
    if comm not in COMM_KINDS:
        raise ValueError(f"comm must be one of {COMM_KINDS}, got {comm!r}")
    return (group_name, comm, transport_key(transport))


def effective_transport(key: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The transport a context created with transport key ``key`` gets: the key, else
    $NVTE_COMM_TRANSPORT (as the library reads it), else "auto"."""
    environ = os.environ if environ is None else environ
    return key or (environ.get(TRANSPORT_ENV, "").strip().lower() or "auto")


# --------------------------------------------------------------------------------------
# Dtypes and the ops' dtype rules
# --------------------------------------------------------------------------------------

# The NVTEDType of each dtype name (numpy / torch / jax spell them alike).
NVTE_DTYPES = {
    "uint8": DType.kNVTEByte,
    "int16": DType.kNVTEInt16,
    "int32": DType.kNVTEInt32,
    "int64": DType.kNVTEInt64,
    "float32": DType.kNVTEFloat32,
    "float16": DType.kNVTEFloat16,
    "bfloat16": DType.kNVTEBFloat16,
    "float8_e4m3fn": DType.kNVTEFloat8E4M3,
    "float8_e5m2": DType.kNVTEFloat8E5M2,
}
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
FP8 = (E4M3, E5M2)
# The largest finite value of each FP8 dtype.
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# TE's recipe.Format: (forward dtype: inputs and weights, backward dtype: gradients). The
# recipes themselves (transformer_engine_comm.recipe) refuse E5M2, as TE's do.
FP8_FORMATS = {"E4M3": (E4M3, E4M3), "E5M2": (E5M2, E5M2), "HYBRID": (E4M3, E5M2)}
# Inputs of the GEMMs that are not FP8, and the outputs FP8 inputs may write.
FLOAT_INPUTS = ("bfloat16", "float16", "float32")
FP8_OUTPUTS = ("bfloat16", "float16", "float32")


def is_fp8(name: Optional[str]) -> bool:
    return name in FP8


# --------------------------------------------------------------------------------------
# Argument checks: sizes, shapes and dtypes as the public entries take them (the ctypes
# binding, the torch and JAX adapters). Every error names the argument.
# --------------------------------------------------------------------------------------

# Sizes travel as size_t / int64_t: a size must be < 2**63 (a larger one would wrap or be
# truncated on its way to the library).
SIZE_LIMIT = 1 << 63

# Dtype spellings accepted wherever a dtype is taken (case-insensitive), -> the canonical
# names of NVTE_DTYPES. torch / numpy / JAX dtype objects are named by what they print.
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
    "e4m3": E4M3,
    "fp8_e4m3": E4M3,
    "float8_e4m3": E4M3,
    "float8_e4m3fn": E4M3,
    "e5m2": E5M2,
    "fp8_e5m2": E5M2,
    "float8_e5m2": E5M2,
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "byte": "uint8",
    "uint8": "uint8",
}
# The NVTEDType enum names (kNVTEBFloat16, ...) are accepted too.
_ENUM_NAMES = {d.name.lower(): d for d in DType if d is not DType.kNVTENumTypes}


def check_size(v, what: str) -> int:
    """One size (a dimension, a global size, a byte count): an integer (``__index__``:
    int, numpy / torch integers; not bool, float or str) in [0, 2**63). ValueError naming
    ``what`` otherwise."""
    i = _integer(v, what, "an integer")
    if i < 0:
        raise ValueError(f"{what} = {i} is negative (sizes must be >= 0)")
    return _below_size_limit(i, what, "dims")


def _integer(v, what: str, expected: str) -> int:
    """``v`` as an int when it is an integer (``__index__``, not bool); ValueError naming
    ``what`` and what was ``expected`` otherwise."""
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise ValueError(f"{what} must be {expected}, got {v!r} ({type(v).__name__})")
    return v.__index__()


def _below_size_limit(i: int, what: str, noun: str) -> int:
    if i >= SIZE_LIMIT:
        raise ValueError(f"{what} = {i} is out of range ({noun} must be < 2**63)")
    return i


def check_shape(dims, what: str = "shape") -> tuple:
    """A shape argument as a tuple of ints, each checked by :func:`check_size` under the
    name ``what[i]`` (``shape[0] = -1 is negative in shape=(-1, 2)``)."""
    if isinstance(dims, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of integers, got {dims!r}")
    try:
        items = tuple(dims)
    except TypeError:
        raise ValueError(f"{what} must be a sequence of integers, got {dims!r}") from None
    out = []
    for i, d in enumerate(items):
        try:
            out.append(check_size(d, f"{what}[{i}]"))
        except ValueError as e:
            raise ValueError(f"{e} in {what}={items!r}") from None
    return tuple(out)


def _known_dtypes() -> str:
    return ", ".join(repr(a) for a in DTYPE_ALIASES)


def _dtype_text(dtype) -> Optional[str]:
    """What a dtype object calls itself (lower case), without importing its framework:
    a str as is; torch.dtype -> 'bfloat16' (str 'torch.bfloat16'); a numpy dtype -> its
    ``name``; a JAX / numpy scalar type (jnp.bfloat16, np.float32) -> its dtype's name or
    its class name. None for anything else."""
    if isinstance(dtype, str):
        return dtype.strip().lower()
    t = type(dtype)
    mod = getattr(t, "__module__", "") or ""
    if mod.split(".")[0] == "torch" and t.__name__ == "dtype":
        return str(dtype).split(".")[-1].lower()
    name = getattr(dtype, "name", None)
    if isinstance(name, str) and hasattr(dtype, "kind") and hasattr(dtype, "itemsize"):  # a numpy dtype
        return name.lower()
    if isinstance(dtype, type):
        # jnp.bfloat16 & co (classes carrying a numpy dtype), else np.float32,
        # ml_dtypes.bfloat16 (scalar types named as their dtype)
        iname = getattr(getattr(dtype, "dtype", None), "name", None)
        return (iname if isinstance(iname, str) else dtype.__name__).lower()
    return None


def dtype_name(dtype, what: str = "dtype") -> str:
    """The canonical name (a key of :data:`NVTE_DTYPES`: 'bfloat16', 'float8_e4m3fn', ...)
    of a dtype given as a string alias (:data:`DTYPE_ALIASES`, any case: 'bf16', 'e4m3',
    'byte', ...; also an NVTEDType name), a :class:`DType`, a torch dtype, a numpy dtype or
    a JAX / numpy scalar type. TypeError naming ``what`` and the dtype otherwise."""
    if isinstance(dtype, DType):
        for n, d in NVTE_DTYPES.items():
            if d == dtype:
                return n
        raise TypeError(f"{what} {dtype.name} has no framework dtype name (expected one of {_known_dtypes()})")
    text = _dtype_text(dtype)
    if text is None:
        raise TypeError(f"{what} must be a dtype (a torch / numpy / JAX dtype or a name such as 'bf16'), "
                        f"got {dtype!r} ({type(dtype).__name__})")
    for prefix in ("torch.", "jnp.", "np.", "numpy.", "jax.numpy."):
        if text.startswith(prefix):
            text = text[len(prefix):]
    name = DTYPE_ALIASES.get(text)
    if name is None and text in _ENUM_NAMES:
        name = dtype_name(_ENUM_NAMES[text], what)
    if name is None:
        shown = dtype if isinstance(dtype, str) else text
        raise TypeError(f"{what} {shown!r} is not a known dtype; expected one of {_known_dtypes()} "
                        "(or a torch / numpy / JAX dtype of those)")
    return name


def nvte_dtype(dtype, what: str = "dtype"):
    """The NVTEDType of ``dtype``: an int (or an integer such as ``np.int32(6)``) or
    :class:`DType` as is (the library checks the value), else through :func:`dtype_name`. TypeError naming ``what`` for a bool or an
    unknown dtype."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, bool):
        raise TypeError(f"{what} must be a dtype, got {dtype!r}")
    if isinstance(dtype, int):
        return dtype
    if getattr(type(dtype), "__index__", None) is not None:  # numpy integers & co
        return operator.index(dtype)
    if isinstance(dtype, str) and dtype.strip().lower() in _ENUM_NAMES:
        return _ENUM_NAMES[dtype.strip().lower()]
    return NVTE_DTYPES[dtype_name(dtype, what)]


class Dtypes:
    """A framework's dtype objects by the names above (those it has): ``of(name)``, and
    ``name(dtype)`` (None for a dtype without one here). The rules below take and return
    the framework's objects and print them in their messages as the framework does."""

    def __init__(self, by_name: Mapping[str, object]):
        self.by_name = dict(by_name)
        self._names = {d: n for n, d in self.by_name.items()}
        self.fp8 = tuple(self.by_name[n] for n in FP8 if n in self.by_name)

    def of(self, name: str):
        return self.by_name[name]

    def name(self, dtype) -> Optional[str]:
        try:
            return self._names.get(dtype)
        except TypeError:  # unhashable
            return None

    def is_fp8(self, dtype) -> bool:
        return self.name(dtype) in FP8


def check_input_dtypes(op: str, x_dtype, w_dtype, dt: Dtypes) -> bool:
    """The inputs' dtypes go together: both FP8 (not both e5m2), or both the same of
    bfloat16 / float16 / float32. Returns whether they are FP8."""
    xn, wn = dt.name(x_dtype), dt.name(w_dtype)
    fp8 = xn in FP8 or wn in FP8
    if fp8:
        if not (xn in FP8 and wn in FP8):
            raise TypeError(f"{op}: FP8 needs both x and weight in FP8, got x {x_dtype} and weight {w_dtype}")
        if xn == E5M2 and wn == E5M2:
            raise TypeError(f"{op}: x and weight cannot both be float8_e5m2 (use float8_e4m3fn for one)")
    else:
        if xn not in FLOAT_INPUTS:
            raise TypeError(f"{op}: x dtype must be bfloat16, float16, float32 or FP8, got {x_dtype}")
        if w_dtype != x_dtype:
            raise TypeError(f"{op}: weight dtype {w_dtype} differs from x dtype {x_dtype}")
    return fp8


def check_no_scales(op: str, x_dtype, has_scales: bool) -> None:
    """Inputs that are not FP8 take no scale_inv."""
    if has_scales:
        raise ValueError(f"{op}: x_scale_inv / w_scale_inv are for FP8 inputs only (x is {x_dtype})")


def default_out_dtype(x_dtype, dt: Dtypes):
    """The output dtype when none is asked for: bfloat16 for FP8 inputs, else x's."""
    return dt.of("bfloat16") if dt.is_fp8(x_dtype) else x_dtype


def output_dtype(op: str, x_dtype, fp8: bool, out_dtype, dt: Dtypes):
    """The output dtype (``out_dtype`` or the default), checked: FP8 inputs write bfloat16,
    float16 or float32; other inputs their own dtype or float32."""
    if fp8:
        od = dt.of("bfloat16") if out_dtype is None else out_dtype
        if dt.name(od) not in FP8_OUTPUTS:
            raise TypeError(f"{op}: out_dtype with FP8 inputs must be bfloat16, float16 or float32, got {od}")
    else:
        od = x_dtype if out_dtype is None else out_dtype
        if od != x_dtype and dt.name(od) != "float32":
            raise TypeError(f"{op}: out_dtype with {x_dtype} inputs must be {x_dtype} or float32, got {od}")
    return od


def bias_dtype(fp8: bool, out_dtype, dt: Dtypes):
    """The bias dtype an output takes: the output's, or with FP8 inputs float16 for a
    float16 output and bfloat16 otherwise."""
    if not fp8:
        return out_dtype
    return dt.of("float16") if dt.name(out_dtype) == "float16" else dt.of("bfloat16")


def check_bias_dtype(op: str, b_dtype, fp8: bool, out_dtype, dt: Dtypes) -> None:
    want = bias_dtype(fp8, out_dtype, dt)
    if b_dtype != want:
        raise TypeError(
            f"{op}: bias dtype must be {want} (output {out_dtype}{', FP8 inputs' if fp8 else ''}), got {b_dtype}"
        )


def check_int(op: str, what: str, v) -> None:
    """An integer argument (``__index__``; not bool, float or str): ValueError naming it."""
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise ValueError(f"{op}: {what} must be an integer, got {v!r}")


def check_comm_sm_count(op: str, comm_sm_count: int) -> None:
    check_int(op, "comm_sm_count", comm_sm_count)
    if comm_sm_count < 0:
        raise ValueError(f"{op}: comm_sm_count must be >= 0 (0 = the library default), got {comm_sm_count}")


# --------------------------------------------------------------------------------------
# Layouts (nvte_cublas_gemm's transa / transb)
# --------------------------------------------------------------------------------------


def check_trans(op: str, transa, transb, fp8: bool) -> None:
    """The layouts the library's GEMMs take: TN, NN, NT (TE's); FP8 inputs TN only."""
    if transa and transb:
        raise ValueError(
            f"{op}: transa=True with transb=True (the TT layout) is not supported: the GEMMs take TN "
            "(transa=True, transb=False), NN (transa=False) and NT (transa=False, transb=True), as TE's do"
        )
    if fp8 and not (transa and not transb):
        raise ValueError(
            f"{op}: FP8 inputs need the TN layout (transa=True, transb=False): Hopper's FP8 GEMMs take "
            f"no other; got transa={bool(transa)}, transb={bool(transb)} (quantize the transposed operand instead)"
        )


def operand_dims(x_shape: Sequence[int], w_shape: Sequence[int], transa, transb) -> Tuple[int, int, int, int]:
    """(n, k) of x and (m, k) of weight as the tensors hold them (nvte_cublas_gemm's
    layouts: x is [n, k], or [k, n] with transb; weight is [m, k] with transa, else [k, m])."""
    xn, xk = (x_shape[1], x_shape[0]) if transb else (x_shape[0], x_shape[1])
    wm, wk = (w_shape[0], w_shape[1]) if transa else (w_shape[1], w_shape[0])
    return int(xn), int(xk), int(wm), int(wk)


def layout_names(transa, transb) -> Tuple[str, str]:
    """How x and weight are read: ("[n, k]" or "[k, n]", "[m, k]" or "[k, m]")."""
    return ("[k, n]" if transb else "[n, k]"), ("[m, k]" if transa else "[k, m]")


def check_k(op: str, x_shape, w_shape, transa, transb) -> None:
    """x and weight agree on the (local) k."""
    _, xk, _, wk = operand_dims(x_shape, w_shape, transa, transb)
    if xk != wk:
        xl, wl = layout_names(transa, transb)
        raise ValueError(
            f"{op}: x {tuple(x_shape)} (read as {xl}, transb={bool(transb)}) and weight {tuple(w_shape)} "
            f"(read as {wl}, transa={bool(transa)}) must agree on the (local) k: {xk} vs {wk}"
        )


def check_operands(
    op: str,
    dt: Dtypes,
    x_shape,
    x_dtype,
    w_shape,
    w_dtype,
    *,
    transa,
    transb,
    out_dtype=None,
    has_scales: bool = False,
    check_fp8_scales: Optional[Callable[[], None]] = None,
    b_dtype=None,
    check_bias: Optional[Callable[[], None]] = None,
    comm_sm_count: int = 0,
):
    """The argument rules of the three ops, in order: the layout, k, the inputs' dtypes,
    the scales (``check_fp8_scales()`` for FP8 inputs: the adapter's checks of its scale
    tensors; else ``has_scales`` must be False), the output dtype, the bias
    (``check_bias()``, the adapter's checks of its tensor, then ``b_dtype``; None: no
    bias) and comm_sm_count. Returns (FP8 inputs, output dtype)."""
    fp8 = dt.name(x_dtype) in FP8 or dt.name(w_dtype) in FP8
    check_trans(op, transa, transb, fp8)
    check_k(op, x_shape, w_shape, transa, transb)
    check_input_dtypes(op, x_dtype, w_dtype, dt)
    if fp8:
        if check_fp8_scales is not None:
            check_fp8_scales()
    else:
        check_no_scales(op, x_dtype, has_scales)
    od = output_dtype(op, x_dtype, fp8, out_dtype, dt)
    if b_dtype is not None:
        if check_bias is not None:
            check_bias()
        check_bias_dtype(op, b_dtype, fp8, od, dt)
    check_comm_sm_count(op, comm_sm_count)
    return fp8, od


# --------------------------------------------------------------------------------------
# Block distribution
# --------------------------------------------------------------------------------------


def numroc(global_size: int, nranks: int, rank: int) -> int:
    """This rank's share of ``global_size`` under block distribution (block =
    ceil(global / nranks); the last ranks may get fewer, possibly 0), as the library."""
    if global_size <= 0:
        return 0
    block = -(-global_size // nranks)
    return max(0, min(block, global_size - rank * block))


def block_offset(global_size: int, nranks: int, rank: int) -> int:
    """First global index of this rank's share under :func:`numroc`'s distribution."""
    if global_size <= 0:
        return 0
    block = -(-global_size // nranks)
    return min(rank * block, global_size)


def scattered_rows(n: int, nranks: int, rank: Union[int, Callable[[], int]]) -> int:
    """This rank's rows of a reduce-scatter's ``n``: n / nranks when that divides (the
    rank is then not needed: ``rank`` may be a callable, asked only otherwise), else
    :func:`numroc`."""
    if n % nranks == 0:
        return n // nranks
    return numroc(n, nranks, rank() if callable(rank) else rank)


def opt_size(v, what: str) -> int:
    """An optional global size argument: -1 for None, else an integer in [0, 2**63)
    (ValueError naming ``what`` for a negative, too large or non-integer value)."""
    if v is None:
        return -1
    v = _integer(v, what, "an integer or None")
    if v < 0:
        raise ValueError(f"{what} must be >= 0, got {v}")
    return _below_size_limit(v, what, "sizes")


def split_global(op: str, what: str, local: int, given: Optional[int], nranks: int, rank: Optional[int],
                 tensor: str) -> int:
    """The global size of a split dimension: ``given`` (None: local * nranks), checked
    against this rank's share when ``rank`` is known."""
    if given is None:
        return local * nranks
    if rank is not None:
        share = numroc(given, nranks, rank)
        if share != local:
            raise ValueError(
                f"{op}: {tensor} has {local} along the split dimension but this rank's share of "
                f"{what}={given} over {nranks} ranks is {share} (block distribution: block = ceil({what}/tp))"
            )
    return given


# --------------------------------------------------------------------------------------
# Shape planning
# --------------------------------------------------------------------------------------


class Plan(NamedTuple):
    """One op call's shapes: the global m, n, k the library is told, and the output."""

    m: int
    n: int
    k: int
    out_shape: Tuple[int, int]
    out_dtype: object = None
    fp8: bool = False


def plan_all_gather(op: str, x_shape, w_shape, *, nranks: int, rank: Optional[int], transa=True, transb=False,
                    n_global: Optional[int] = None, m_global: Optional[int] = None, out_dtype=None, fp8: bool = False,
                    bias_numel: Optional[int] = None, gelu: bool = False, validate: bool = True) -> Plan:
    """AG(x) @ op(weight): x holds this rank's n (gathered), weight this rank's m; k is
    whole. Output [n, m_local]. ``validate``: check the shares against ``n_global`` /
    ``m_global`` (when ``rank`` is known), the bias length, FP8's multiples of 16 and
    GELU's multiple of 8 (the library checks them too, later)."""
    nl, k, ml, _ = operand_dims(x_shape, w_shape, transa, transb)
    r = rank if validate else None
    n = split_global(op, "n_global", nl, n_global, nranks, r, f"x {tuple(x_shape)}")
    m = split_global(op, "m_global", ml, m_global, nranks, r, f"weight {tuple(w_shape)}")
    if validate:
        if bias_numel is not None and bias_numel != ml:
            raise ValueError(
                f"{op}: bias must have {ml} elements (this rank's m: weight's m dimension), got {bias_numel}")
        if fp8 and (k % 16 or ml % 16):
            raise ValueError(f"{op}: FP8 needs k and this rank's m to be multiples of 16, got k={k}, m_local={ml}")
        if gelu and ml % 8:
            raise ValueError(
                f"{op}: gelu=True needs this rank's m (weight's m dimension) to be a multiple of 8, got {ml}")
    return Plan(m, n, k, (n, ml), out_dtype, fp8)


def plan_k_split(op: str, x_shape, w_shape, *, nranks: int, rank, scatter: bool, transa=True, transb=False,
                 k_global: Optional[int] = None, out_rows: Optional[int] = None, out_dtype=None, fp8: bool = False,
                 bias_numel: Optional[int] = None, validate: bool = True) -> Plan:
    """op(x) @ op(weight) with k split (each rank holds its k share), then reduce-scattered
    over n (``scatter``: output [scattered_rows(n), m]) or all-reduced ([n, m]). ``rank``:
    an int, or a callable asked only when the rows do not divide evenly. ``validate``: check
    the k share against ``k_global``, the bias length, FP8's multiples of 16 and
    ``out_rows`` (the reduce-scatter's rows as the caller computed them)."""
    n, kl, m, _ = operand_dims(x_shape, w_shape, transa, transb)
    k = split_global(op, "k_global", kl, k_global, nranks, rank if validate else None,
                     f"x {tuple(x_shape)} / weight {tuple(w_shape)}")
    if validate:
        if bias_numel is not None and bias_numel != m:
            raise ValueError(f"{op}: bias must have m = {m} elements (weight's m dimension), got {bias_numel}")
        if fp8 and (kl % 16 or m % 16):
            raise ValueError(f"{op}: FP8 needs this rank's k and m to be multiples of 16, got k_local={kl}, m={m}")
    rows = scattered_rows(n, nranks, rank) if scatter else n
    if validate and scatter and out_rows != rows:
        # The output's row count is an argument (not derived from the group's rank inside
        # the op) so that compiled-graph caches, shared by the ranks, key on it.
        raise ValueError(
            f"{op}: out_rows={out_rows} but this rank's share of n={n} over {nranks} ranks is {rows} "
            "(call through transformer_engine_comm.torch.gemm_reduce_scatter)"
        )
    return Plan(m, n, k, (rows, m), out_dtype, fp8)
