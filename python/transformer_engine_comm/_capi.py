"""ctypes binding of libtransformer_engine_comm.so (include/transformer_engine_comm.h).

Pure Python, no compile step. Everything the C header declares has a prototype here
(argtypes / restype set once, when the library is loaded); the classes below wrap the
handles (tensors, comm-GEMM contexts, overlap objects) and turn the library's status codes
and recorded errors into :class:`CommError`.

Library lookup order (first hit wins; the error lists every path tried):
  1. ``$TE_COMM_LIB`` (a file path; when set, nothing else is tried),
  2. ``libtransformer_engine_comm.so`` inside this package folder (the wheel),
  3. ``<repo>/target/release/libtransformer_engine_comm.so`` when running from the source
     tree (``PYTHONPATH=python``),
  4. ``ctypes.CDLL("libtransformer_engine_comm.so")`` (the system search path).

A function the loaded library does not export (a library older than this binding) does
not fail the import: calling it raises :class:`MissingFunctionError`.

Errors: the library records, per calling thread, the status and a message naming the
function, the argument and its value. Functions returning ``NVTECommStatus`` are checked
with :func:`check`; the TE-compatible functions that return ``void`` (or a value) with
:func:`check_last`. ctypes calls the library on the calling thread, so the recorded error
read right after a call is that call's.
"""
from __future__ import annotations

import ctypes
import os
import threading
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    byref,
    c_bool,
    c_char_p,
    c_float,
    c_int32,
    c_int64,
    c_size_t,
    c_uint,
    c_uint8,
    c_uint64,
    c_void_p,
    sizeof,
)
from typing import Callable, Iterable, NamedTuple, Optional, Sequence, Union

# The C enums and the packed op codes: defined in the framework-neutral core (checked
# against src/ffi/c_enums.in and the header by python/tests/test_core.py), re-exported.
from . import _core
from ._core import (
    C_ENUMS,
    CAST_AMAX,
    CAST_QUANTIZE,
    CAST_SCALE,
    CAST_UPDATE,
    PACKED_ALL_GATHER,
    PACKED_ALL_REDUCE,
    PACKED_GEMM,
    PACKED_REDUCE_SCATTER,
    DType,
    GemmAlgo,
    Library,
    MatmulConfigAttribute,
    OverlapType,
    QuantizationConfigAttribute,
    ScalingMode,
    Status,
    TensorParam,
    Transport,
)

LIBRARY_NAME = "libtransformer_engine_comm.so"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------------
# Structures (layouts checked against the header by compiling a C program in the tests)
# --------------------------------------------------------------------------------------

MAX_DIMS = 15
c_enum = c_uint  # C enums of the header: 4 bytes, non-negative values (Rust: u32)


class Shape(Structure):
    """NVTEShape: size_t data[15]; size_t ndim."""

    _fields_ = [("data", c_size_t * MAX_DIMS), ("ndim", c_size_t)]

    @classmethod
    def of(cls, dims: Sequence[int]) -> "Shape":
        dims = _dims_arg(dims, "shape")
        if len(dims) > MAX_DIMS:
            raise CommError(
                Status.NVTE_COMM_ERROR_INVALID_ARGUMENT,
                f"shape {dims} has {len(dims)} dimensions, more than the maximum of {MAX_DIMS}",
            )
        s = cls()
        for i, d in enumerate(dims):
            s.data[i] = d
        s.ndim = len(dims)
        return s

    def to_tuple(self) -> tuple:
        n = min(int(self.ndim), MAX_DIMS)
        return tuple(int(self.data[i]) for i in range(n))


class BasicTensor(Structure):
    """NVTEBasicTensor: void *data_ptr; NVTEDType dtype; NVTEShape shape."""

    _fields_ = [("data_ptr", c_void_p), ("dtype", c_enum), ("shape", Shape)]


class CallReport(Structure):
    """NVTECommCallReport: the figures of one call under NVTE_COMM_REPORT=1."""

    _fields_ = [
        ("call", c_uint64),
        ("op", c_char_p),
        ("m", c_int64),
        ("n", c_int64),
        ("k", c_int64),
        ("call_ms", c_float),
        ("gemm_alone_ms", c_float),
        ("comm_alone_ms", c_float),
        ("bound_ms", c_float),
        ("ratio", c_float),
    ]

    def as_dict(self) -> dict:
        d = {name: getattr(self, name) for name, _ in self._fields_}
        d["op"] = d["op"].decode() if d["op"] else None
        return d


class OverlapConfig(Structure):
    """NVTECommOverlapConfig. Get one filled with TE's defaults (plus the environment
    overrides) from :func:`overlap_config_default`, then change fields."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("tp_size", c_int32),
        ("num_splits", c_int32),
        ("num_max_streams", c_int32),
        ("comm_cga_size", c_int32),
        ("num_comm_sm", c_int32),
        ("set_sm_margin", c_bool),
        ("use_ce", c_bool),
        ("aggregate", c_bool),
        ("atomic_gemm", c_bool),
        ("gemm_priority", c_int32),
        ("comm_priority", c_int32),
        ("timeout_ms", c_int64),
        ("transport", c_enum),
    ]

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, _ in self._fields_}

    def __repr__(self) -> str:
        return "OverlapConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"


# int32_t (*)(void *user_data, void *global, size_t global_bytes, const void *local, size_t local_bytes)
AllgatherFn = CFUNCTYPE(c_int32, c_void_p, c_void_p, c_size_t, c_void_p, c_size_t)
# int32_t (*)(void *user_data)
BarrierFn = CFUNCTYPE(c_int32, c_void_p)


class Bootstrap(Structure):
    """NVTECommBootstrap."""

    _fields_ = [
        ("world_rank", c_int32),
        ("world_size", c_int32),
        ("nccl_comm", c_void_p),
        ("allgather", AllgatherFn),
        ("barrier", BarrierFn),
        ("user_data", c_void_p),
    ]



class GemmOperand(Structure):
    """NVTECommGemmOperand: one operand of nvte_comm_gemm_call_packed (NULL data and no
    elements: absent)."""

    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_enum),
        ("ndim", c_uint),  # uint32_t
        ("shape", c_size_t * 2),
        ("scale_inv", c_void_p),
        ("scale", c_void_p),
        ("amax", c_void_p),
    ]


class GemmPacked(Structure):
    """NVTECommGemmPacked: the arguments of one nvte_comm_gemm_call_packed call (or, with op
    PACKED_GEMM, of one nvte_comm_cublas_gemm_packed call)."""

    _fields_ = [
        ("op", c_int32),
        ("comm_sm_count", c_int32),
        ("m", c_int64),
        ("n", c_int64),
        ("k", c_int64),
        ("a", GemmOperand),
        ("b", GemmOperand),
        ("d", GemmOperand),
        ("bias", GemmOperand),
        ("pre_act_out", GemmOperand),
        ("transa", c_bool),
        ("transb", c_bool),
        ("grad", c_bool),
        ("accumulate", c_bool),
        ("algo", c_enum),
        ("stream", c_void_p),
    ]


class CastPacked(Structure):
    """NVTECommCastPacked: the arguments of one nvte_comm_cast_packed call (steps: the
    CAST_* bits)."""

    _fields_ = [
        ("steps", c_uint),  # uint32_t
        ("input", c_void_p),
        ("input_dtype", c_enum),
        ("rows", c_size_t),
        ("cols", c_size_t),
        ("fp8_dtype", c_enum),
        ("rowwise", c_void_p),
        ("columnwise", c_void_p),
        ("scale", c_void_p),
        ("amax", c_void_p),
        ("scale_inv", c_void_p),
        ("amax_epsilon", c_float),
        ("force_pow_2_scales", c_bool),
        ("amax_history", c_void_p),
        ("history_len", c_size_t),
        ("amax_compute_algo", c_int32),
        ("margin", c_float),
        ("stream", c_void_p),
    ]


# GemmPacked.op values (NVTE_COMM_GEMM_PACKED_*): PACKED_ALL_GATHER, PACKED_REDUCE_SCATTER,
# PACKED_ALL_REDUCE, PACKED_GEMM (from the core, above)

# --------------------------------------------------------------------------------------
# Prototypes: (name, restype, argtypes) of every function of the header
# --------------------------------------------------------------------------------------

_T = c_void_p  # NVTETensor
_CTX = c_void_p  # struct NVTECommGemmCtx *
_OV = c_void_p  # struct NVTECommOverlap *
_COMM = c_void_p  # ncclComm_t
_STREAM = c_void_p  # cudaStream_t
_ST = c_enum  # NVTECommStatus
_QC = c_void_p  # NVTEQuantizationConfig
_MC = c_void_p  # NVTEMatmulConfig

_COMM_GEMM_ARGS = [_CTX, c_int64, c_int64, c_int64, _T, _T, _T, _T, _T, c_bool, c_bool, c_bool, c_bool, c_int32, _STREAM, c_enum]
_SPLIT_ARGS = [_OV, _T, c_bool, _T, c_bool, _T, _T, _T, c_bool, _T, c_bool, c_bool, _T, _STREAM]

PROTOTYPES = [
    # comm_gemm.h
    ("nvte_comm_gemm_ctx_create", _CTX, [_COMM, c_int32, c_int32]),
    ("nvte_comm_gemm_ctx_destroy", None, [_CTX]),
    ("nvte_comm_gemm_numroc", c_int64, [_CTX, c_int64]),
    ("nvte_all_gather_gemm", None, _COMM_GEMM_ARGS),
    ("nvte_gemm_reduce_scatter", None, _COMM_GEMM_ARGS),
    ("nvte_gemm_all_reduce", None, _COMM_GEMM_ARGS),
    ("nvte_comm_gemm_ctx_create_bootstrap", _ST, [POINTER(Bootstrap), POINTER(_CTX)]),
    ("nvte_comm_gemm_call_packed", _ST, [_CTX, POINTER(GemmPacked)]),
    ("nvte_comm_cublas_gemm_packed", _ST, [POINTER(GemmPacked), c_void_p, c_size_t, c_bool, c_int32]),
    ("nvte_comm_cast_packed", _ST, [POINTER(CastPacked)]),
    # XLA FFI handlers (XLA_FFI_Handler: XLA_FFI_Error *(XLA_FFI_CallFrame *)) and their contexts
    ("nvte_comm_xla_bind", _ST, [c_uint64, c_int32, _CTX]),
    ("nvte_comm_xla_unbind", _ST, [c_uint64, c_int32]),
    ("nvte_comm_xla_all_gather_gemm", c_void_p, [c_void_p]),
    ("nvte_comm_xla_gemm_reduce_scatter", c_void_p, [c_void_p]),
    ("nvte_comm_xla_gemm_all_reduce", c_void_p, [c_void_p]),
    ("nvte_comm_xla_block_gemm", c_void_p, [c_void_p]),
    ("nvte_comm_xla_block_quantize", c_void_p, [c_void_p]),
    ("nvte_comm_xla_layout", c_size_t, [c_char_p, c_size_t]),
    ("nvte_comm_overlap_last_report", _ST, [_OV, POINTER(CallReport)]),
    ("nvte_comm_gemm_last_report", _ST, [_CTX, POINTER(CallReport)]),
    ("nvte_comm_xla_counters", _ST, [POINTER(c_uint64), POINTER(c_uint64), POINTER(c_uint64)]),
    # errors, runtime
    ("nvte_comm_last_error", c_char_p, []),
    ("nvte_comm_last_status", _ST, []),
    ("nvte_comm_clear_error", None, []),
    ("nvte_comm_status_string", c_char_p, [_ST]),
    ("nvte_comm_version", c_char_p, []),
    ("nvte_comm_check_runtime", _ST, []),
    ("nvte_comm_device_count", c_int32, []),
    ("nvte_comm_host_counters", _ST, [POINTER(c_uint64), POINTER(c_uint64)]),
    ("nvte_comm_library_info", _ST, [c_enum, POINTER(c_char_p), POINTER(c_int32), POINTER(c_bool)]),
    ("nvte_comm_nccl_get_unique_id", _ST, [POINTER(c_uint8), c_size_t]),
    ("nvte_comm_nccl_comm_init_rank", _ST, [POINTER(c_uint8), c_size_t, c_int32, c_int32, POINTER(_COMM)]),
    ("nvte_comm_nccl_comm_destroy", _ST, [_COMM]),
    # GEMM and kernels
    ("nvte_cublas_gemm", None, [_T, _T, _T, _T, _T, c_bool, c_bool, c_bool, _T, c_bool, c_bool, c_int32, _STREAM]),
    ("nvte_cublas_gemm_scaled", None, [_T, _T, _T, _T, _T, c_bool, c_bool, c_bool, _T, c_float, c_float, c_bool, c_int32, _STREAM]),
    ("nvte_cublas_gemm_v2", None, [c_int32, c_int32, POINTER(c_float), _T, _T, POINTER(c_float), _T, _T, _T, _MC, _STREAM]),
    ("nvte_create_matmul_config", _MC, []),
    ("nvte_get_matmul_config_attribute", None, [_MC, c_enum, c_void_p, c_size_t, POINTER(c_size_t)]),
    ("nvte_set_matmul_config_attribute", None, [_MC, c_enum, c_void_p, c_size_t]),
    ("nvte_destroy_matmul_config", None, [_MC]),
    ("nvte_comm_live_matmul_config_count", c_size_t, []),
    # quantization (TE's cast.h, recipe.h, transpose.h, NVTEQuantizationConfig)
    ("nvte_create_quantization_config", _QC, []),
    ("nvte_get_quantization_config_attribute", None, [_QC, c_enum, c_void_p, c_size_t, POINTER(c_size_t)]),
    ("nvte_set_quantization_config_attribute", None, [_QC, c_enum, c_void_p, c_size_t]),
    ("nvte_destroy_quantization_config", None, [_QC]),
    ("nvte_quantize", None, [_T, _T, _STREAM]),
    ("nvte_quantize_noop", None, [_T, _T, _T, _STREAM]),
    ("nvte_quantize_v2", None, [_T, _T, _QC, _STREAM]),
    ("nvte_dequantize", None, [_T, _T, _STREAM]),
    ("nvte_compute_amax", None, [_T, _T, _STREAM]),
    ("nvte_compute_amax_with_config", None, [_T, _T, _QC, _STREAM]),
    ("nvte_compute_scale_from_amax", None, [_T, _QC, _STREAM]),
    ("nvte_delayed_scaling_recipe_amax_and_scale_update", None, [_T, _T, _T, _T, c_char_p, c_enum, c_float, _STREAM]),
    ("nvte_transpose", None, [_T, _T, _STREAM]),
    ("nvte_comm_live_quantization_config_count", c_size_t, []),
    ("nvte_comm_fill_uniform", _ST, [_T, c_uint64, c_float, c_float, _STREAM]),
    # overlap engine
    ("nvte_comm_overlap_config_default", _ST, [POINTER(OverlapConfig)]),
    ("nvte_comm_overlap_create", _ST, [POINTER(Bootstrap), POINTER(OverlapConfig), c_size_t, c_size_t, c_enum, POINTER(_OV)]),
    ("nvte_comm_overlap_destroy", _ST, [_OV]),
    ("nvte_comm_overlap_tp", _ST, [_OV, POINTER(c_int32), POINTER(c_int32)]),
    ("nvte_comm_overlap_get_buffer", _ST, [_OV, c_bool, POINTER(_T)]),
    ("nvte_comm_overlap_copy_into_buffer", _ST, [_OV, _T, c_bool, _STREAM]),
    ("nvte_comm_overlap_split_ag", _ST, _SPLIT_ARGS),
    ("nvte_comm_overlap_split_rs", _ST, _SPLIT_ARGS),
    ("nvte_comm_overlap_split_rs_p2p", _ST, _SPLIT_ARGS),
    ("nvte_comm_overlap_bulk", _ST, [_OV, c_enum, _T, c_bool, _T, c_bool, _T, _T, _T, c_bool, _T, c_bool, c_bool, _T, _T, _STREAM]),
    ("nvte_comm_overlap_synchronize", _ST, [_OV]),
    # tensors (TE's transformer_engine.h)
    ("nvte_create_tensor", _T, [c_enum]),
    ("nvte_destroy_tensor", None, [_T]),
    ("nvte_make_shape", Shape, [POINTER(c_size_t), c_size_t]),
    ("nvte_set_tensor_param", None, [POINTER(_T), c_enum, POINTER(BasicTensor)]),
    ("nvte_get_tensor_param", BasicTensor, [_T, c_enum]),
    ("nvte_set_tensor_param_v2", None, [_T, c_enum, c_void_p, c_size_t]),
    ("nvte_get_tensor_param_v2", None, [_T, c_enum, c_void_p, c_size_t, POINTER(c_size_t)]),
    ("nvte_tensor_data", c_void_p, [_T]),
    ("nvte_tensor_columnwise_data", c_void_p, [_T]),
    ("nvte_tensor_shape", Shape, [_T]),
    ("nvte_tensor_columnwise_shape", Shape, [_T]),
    ("nvte_tensor_ndims", c_size_t, [_T]),
    ("nvte_tensor_size", c_size_t, [_T, c_size_t]),
    ("nvte_tensor_numel", c_size_t, [_T]),
    ("nvte_tensor_element_size", c_size_t, [_T]),
    ("nvte_tensor_element_size_bits", c_size_t, [_T]),
    ("nvte_tensor_type", c_enum, [_T]),
    ("nvte_tensor_scaling_mode", c_enum, [_T]),
    ("nvte_tensor_amax", c_void_p, [_T]),  # float * (a device address)
    ("nvte_tensor_scale", c_void_p, [_T]),
    ("nvte_tensor_scale_inv", c_void_p, [_T]),
    ("nvte_tensor_scale_inv_shape", Shape, [_T]),
    ("nvte_comm_live_tensor_count", c_size_t, []),
    ("nvte_comm_tensor_create_simple", _ST, [c_void_p, c_enum, POINTER(c_size_t), c_size_t, POINTER(_T)]),
]

# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


def status_name(status: int) -> str:
    """Name of a status value ("NVTE_COMM_ERROR_TIMEOUT", ...) without loading the library."""
    try:
        return Status(int(status)).name
    except ValueError:
        return f"unknown status {int(status)}"


class CommError(RuntimeError):
    """A failed library call.

    ``status``: the NVTECommStatus value (int); ``status_name``: its name;
    ``message``: the library's message (``nvte_comm_last_error()``), which names the C
    function, the offending argument and its value; ``what``: the Python-level operation.
    """

    def __init__(self, status: int, message: str = "", what: str = ""):
        self.status = int(status)
        self.status_name = status_name(self.status)
        self.message = message
        self.what = what
        text = message or "(the library recorded no message)"
        if what and not text.startswith(what):
            text = f"{what}: {text}"
        super().__init__(f"{text} [{self.status_name}]")

    def __reduce__(self):  # picklable (multiprocessing, torch elastic error files)
        return (type(self), (self.status, self.message, self.what))


class MissingFunctionError(CommError):
    """The loaded library does not export a function of this binding (it is older)."""

    def __init__(self, name: str, message: str = "", what: str = ""):
        self.function = name
        super().__init__(Status.NVTE_COMM_ERROR_UNSUPPORTED, message or f"function {name} is missing", what)

    def __reduce__(self):
        return (type(self), (self.function, self.message, self.what))


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


class _Loaded(NamedTuple):
    cdll: ctypes.CDLL
    path: str  # the file actually mapped
    missing: frozenset  # prototype names the library does not export


def _source_tree_library() -> Optional[str]:
    """<repo>/target/release/libtransformer_engine_comm.so when this file is
    <repo>/python/transformer_engine_comm/_capi.py, else None."""
    repo = os.path.dirname(os.path.dirname(_PACKAGE_DIR))
    if not os.path.isfile(os.path.join(repo, "Cargo.toml")):
        return None
    return os.path.join(repo, "target", "release", LIBRARY_NAME)


def candidate_paths(environ=None) -> list:
    """The lookup order as a list of (kind, path) pairs."""
    environ = os.environ if environ is None else environ
    env = environ.get("TE_COMM_LIB")
    if env:
        return [("TE_COMM_LIB", env)]
    out = [("package", os.path.join(_PACKAGE_DIR, LIBRARY_NAME))]
    src = _source_tree_library()
    if src:
        out.append(("source tree", src))
    out.append(("search path", LIBRARY_NAME))
    return out


def _mapped_path(cdll: ctypes.CDLL, symbol: str, fallback: str) -> str:
    """The file a loaded library came from (dladdr on one of its symbols)."""

    class DlInfo(Structure):
        _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p), ("dli_saddr", c_void_p)]

    try:
        try:
            dladdr = ctypes.CDLL(None).dladdr
        except AttributeError:
            dladdr = ctypes.CDLL("libdl.so.2").dladdr
        dladdr.argtypes = [c_void_p, POINTER(DlInfo)]
        dladdr.restype = ctypes.c_int
        info = DlInfo()
        addr = ctypes.cast(getattr(cdll, symbol), c_void_p).value
        if dladdr(addr, byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except Exception:  # noqa: BLE001 - informational only
        pass
    return os.path.realpath(fallback) if os.path.sep in fallback else fallback


def _load_library(environ=None) -> _Loaded:
    """Find, load and prototype the library (uncached; see :func:`lib`)."""
    tried = []
    for kind, path in candidate_paths(environ):
        if kind != "search path" and not os.path.isfile(path):
            tried.append(f"{path} ({kind}): no such file")
            continue
        try:
            cdll = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({kind}): {e}")
            continue
        missing = set()
        for name, restype, argtypes in PROTOTYPES:
            try:
                f = getattr(cdll, name)
            except AttributeError:
                missing.add(name)
                continue
            f.restype = restype
            f.argtypes = argtypes
        if "nvte_comm_version" in missing:
            tried.append(f"{path} ({kind}): loads, but is not libtransformer_engine_comm (no nvte_comm_version)")
            continue
        return _Loaded(cdll, _mapped_path(cdll, "nvte_comm_version", path), frozenset(missing))
    raise CommError(
        Status.NVTE_COMM_ERROR_LIBRARY_NOT_FOUND,
        f"cannot load {LIBRARY_NAME}; tried: " + "; ".join(tried)
        + " (build it with `cargo build --release`, or set TE_COMM_LIB=<path to the .so>)",
        "transformer_engine_comm",
    )


_lock = threading.Lock()
_loaded: Optional[_Loaded] = None


def _state() -> _Loaded:
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load_library()
    return _loaded


def lib() -> ctypes.CDLL:
    """The library (loaded once; every prototype set). Raises CommError
    (NVTE_COMM_ERROR_LIBRARY_NOT_FOUND) listing the paths tried when it cannot be loaded."""
    return _state().cdll


def library_path() -> str:
    """Path of the loaded library file."""
    return _state().path


def has_function(name: str) -> bool:
    """Whether the loaded library exports ``name``."""
    st = _state()
    if name in st.missing:
        return False
    try:
        getattr(st.cdll, name)
        return True
    except AttributeError:
        return False


def _fn(name: str):
    st = _state()
    if name in st.missing:
        raise MissingFunctionError(
            name,
            f"{st.path} does not export {name}: the library is older than this Python "
            "package; rebuild it (cargo build --release) or point TE_COMM_LIB at a current build",
        )
    try:
        return getattr(st.cdll, name)
    except AttributeError:
        raise MissingFunctionError(name, f"{st.path} does not export {name}") from None


# --------------------------------------------------------------------------------------
# Status checking
# --------------------------------------------------------------------------------------


def last_error() -> str:
    """The calling thread's last recorded error message ("" after a success)."""
    msg = lib().nvte_comm_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def last_status() -> int:
    return int(lib().nvte_comm_last_status())


def clear_error() -> None:
    lib().nvte_comm_clear_error()


def status_string(status: int) -> str:
    """The library's name for a status value."""
    return lib().nvte_comm_status_string(int(status)).decode()


def check(status: int, what: str = "") -> None:
    """Raise CommError unless ``status`` (an NVTECommStatus return value) is success."""
    status = int(status)
    if status != Status.NVTE_COMM_SUCCESS:
        raise CommError(status, last_error(), what)


def check_last(what: str = "") -> None:
    """After a TE-style void function: raise CommError if it recorded an error."""
    status = int(lib().nvte_comm_last_status())
    if status != Status.NVTE_COMM_SUCCESS:
        raise CommError(status, last_error(), what)


def _raise_last(what: str) -> None:
    """A call signalled failure by its return value (NULL): raise its recorded error."""
    status = int(lib().nvte_comm_last_status())
    if status == Status.NVTE_COMM_SUCCESS:
        raise CommError(Status.NVTE_COMM_ERROR_INTERNAL, f"{what} failed without recording an error", what)
    raise CommError(status, last_error(), what)


# --------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------


def version() -> str:
    """Library version, "MAJOR.MINOR.PATCH"."""
    return lib().nvte_comm_version().decode()


def device_count() -> int:
    """Visible CUDA devices (0 when the driver is missing or reports none)."""
    return int(lib().nvte_comm_device_count())


def check_runtime() -> None:
    """Raise CommError naming the CUDA library (driver, cuBLASLt, NVRTC, NCCL) that cannot
    be loaded (NVTE_COMM_ERROR_LIBRARY_NOT_FOUND), or NVTE_COMM_ERROR_CUDA when the driver
    reports no usable device."""
    check(lib().nvte_comm_check_runtime(), "check_runtime")


def live_tensor_count() -> int:
    """Live NVTETensor handles in the process (leak checks)."""
    return int(lib().nvte_comm_live_tensor_count())


_LIBRARY_KEYS = {
    Library.NVTE_COMM_LIB_NCCL: "nccl",
    Library.NVTE_COMM_LIB_CUBLASLT: "cublaslt",
    Library.NVTE_COMM_LIB_CUDA_DRIVER: "cuda_driver",
    Library.NVTE_COMM_LIB_NVRTC: "nvrtc",
}


class LibraryInfo(dict):
    """``{"nccl": {"path", "version", "preloaded"}, "cublaslt": ..., "cuda_driver": ...,
    "nvrtc": ...}``. A library that could not be bound has an entry
    ``{"path": None, "version": None, "preloaded": False, "error": str, "status": str}``
    (seen by iteration, ``.items()``, ``.get()``, repr); indexing it (``info["nccl"]``)
    raises that CommError, so ``library_info()["nccl"]["path"]`` either is the bound file
    or raises."""

    def __init__(self):
        super().__init__()
        self.errors = {}

    def __getitem__(self, key):
        if key in self.errors:
            raise self.errors[key]
        return super().__getitem__(key)


def library_info(which: Union[None, str, int] = None):
    """Bind (if not yet) and describe the CUDA libraries this library loads at run time.

    ``library_info()`` -> :class:`LibraryInfo` for all four; ``library_info("nccl")`` (or a
    :class:`Library` value) -> that one's dict, raising CommError if it cannot be bound.
    ``version``: NCCL ncclGetVersion (e.g. 22809), cuBLASLt cublasLtGetVersion, driver
    cuDriverGetVersion, NVRTC major*1000+minor*10; ``preloaded``: the copy was already
    mapped in the process (torch's) rather than found on the search path."""
    fn = _fn("nvte_comm_library_info")

    def one(lib_id):
        path, ver, pre = c_char_p(), c_int32(), c_bool()
        check(fn(int(lib_id), byref(path), byref(ver), byref(pre)), f"library_info({_LIBRARY_KEYS[lib_id]!r})")
        return {"path": path.value.decode() if path.value else None, "version": int(ver.value), "preloaded": bool(pre.value)}

    if which is not None:
        if isinstance(which, str):
            inv = {v: k for k, v in _LIBRARY_KEYS.items()}
            if which not in inv:
                raise ValueError(f"unknown library {which!r}; one of {sorted(inv)}")
            which = inv[which]
        return one(Library(int(which)))
    out = LibraryInfo()
    for lib_id, key in _LIBRARY_KEYS.items():
        try:
            dict.__setitem__(out, key, one(lib_id))
        except CommError as e:
            out.errors[key] = e
            dict.__setitem__(out, key, {"path": None, "version": None, "preloaded": False, "error": str(e), "status": e.status_name})
    return out


# --------------------------------------------------------------------------------------
# NCCL through the library's bound NCCL
# --------------------------------------------------------------------------------------

NCCL_UNIQUE_ID_BYTES = 128


def nccl_get_unique_id() -> bytes:
    """A new NCCL unique id (128 bytes) from the NCCL copy the library bound."""
    buf = (c_uint8 * NCCL_UNIQUE_ID_BYTES)()
    check(_fn("nvte_comm_nccl_get_unique_id")(buf, NCCL_UNIQUE_ID_BYTES), "nccl_get_unique_id")
    return bytes(buf)


def nccl_comm_init_rank(uid: bytes, nranks: int, rank: int) -> int:
    """ncclCommInitRank (collective) on the current CUDA device; returns the ncclComm_t
    as an int. Destroy it with :func:`nccl_comm_destroy` after the contexts using it."""
    uid = bytes(uid)
    buf = (c_uint8 * len(uid)).from_buffer_copy(uid)
    out = c_void_p()
    check(_fn("nvte_comm_nccl_comm_init_rank")(buf, len(uid), int(nranks), int(rank), byref(out)), "nccl_comm_init_rank")
    return int(out.value or 0)


def nccl_comm_destroy(comm: int) -> None:
    check(_fn("nvte_comm_nccl_comm_destroy")(c_void_p(int(comm) or None)), "nccl_comm_destroy")


# --------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------

NULL_TENSOR = None  # pass for an absent optional tensor (bias, pre_act, workspace, ...)


class ParamInfo(NamedTuple):
    ptr: int
    dtype: Union[DType, int]
    shape: tuple


def _dtype(v: int) -> Union[DType, int]:
    try:
        return DType(int(v))
    except ValueError:
        return int(v)


def _ptr(p) -> Optional[int]:
    p = int(p or 0)
    return p or None


def _dims_arg(dims, what: str) -> tuple:
    """A shape argument as a tuple of ints in [0, 2**63): ValueError naming ``what[i]`` for
    a negative size (which size_t would wrap to ~1.8e19), one of 2**63 or more (which would
    wrap or be truncated) or a size that is not an integer (2.5, "3", None; bools too),
    instead of a silent truncation or wrap. The core's :func:`_core.check_shape`."""
    return _core.check_shape(dims, what)


def _dtype_arg(dtype, what: str = "dtype"):
    """A dtype argument: an NVTEDType (:class:`DType` or int), a name ("bf16", "e4m3",
    "float32", ...) or a torch / numpy / JAX dtype; TypeError naming ``what`` otherwise
    (:func:`_core.nvte_dtype`)."""
    return int(_core.nvte_dtype(dtype, what))


class Tensor:
    """Owns one NVTETensor handle (delayed scaling) over memory ``ptr`` (an int device
    address; the library never dereferences it on the host) of ``dtype`` and ``shape``.
    ``scale_inv`` / ``scale`` / ``amax`` are float32 scalar device addresses (FP8).

    ``.handle`` is the c_void_p handle (also usable directly as a ctypes argument);
    ``close()`` destroys it (also on ``with`` exit and garbage collection)."""

    def __init__(self, ptr: int, dtype: int, shape: Iterable[int], *, scale_inv: int = 0, scale: int = 0, amax: int = 0):
        self._handle = None
        self._owned = True
        shape = _dims_arg(shape, "shape")
        dtype = _dtype_arg(dtype, "dtype")
        dims = (c_size_t * max(len(shape), 1))(*shape)
        out = c_void_p()
        check(lib().nvte_comm_tensor_create_simple(_ptr(ptr), dtype, dims, len(shape), byref(out)), "Tensor")
        self._handle = out.value
        try:
            for param, p in (
                (TensorParam.kNVTERowwiseScaleInv, scale_inv),
                (TensorParam.kNVTEScale, scale),
                (TensorParam.kNVTEAmax, amax),
            ):
                if p:
                    self.set_param(param, p, DType.kNVTEFloat32, (1,))
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_handle(cls, handle: int, *, owned: bool = True) -> "Tensor":
        """Wrap an existing NVTETensor handle (``owned``: destroy it on close)."""
        t = cls.__new__(cls)
        t._handle = int(handle) or None
        t._owned = owned
        return t

    @property
    def handle(self) -> c_void_p:
        if self._handle is None:
            raise ValueError("Tensor is closed")
        return c_void_p(self._handle)

    @property
    def _as_parameter_(self):
        return self.handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        h, self._handle = self._handle, None
        if h is not None and self._owned:
            lib().nvte_destroy_tensor(h)
            check_last("Tensor.close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def _get(self, fn: str, what: str):
        v = getattr(lib(), fn)(self.handle)
        check_last(f"Tensor.{what}")
        return v

    @property
    def ptr(self) -> int:
        return int(self._get("nvte_tensor_data", "ptr") or 0)

    data_ptr = ptr

    @property
    def dtype(self) -> Union[DType, int]:
        return _dtype(self._get("nvte_tensor_type", "dtype"))

    @property
    def shape(self) -> tuple:
        return self._get("nvte_tensor_shape", "shape").to_tuple()

    @property
    def numel(self) -> int:
        return int(self._get("nvte_tensor_numel", "numel"))

    @property
    def element_size(self) -> int:
        return int(self._get("nvte_tensor_element_size", "element_size"))

    @property
    def scale_inv(self) -> int:
        return int(self._get("nvte_tensor_scale_inv", "scale_inv") or 0)

    @property
    def scale(self) -> int:
        return int(self._get("nvte_tensor_scale", "scale") or 0)

    @property
    def amax(self) -> int:
        return int(self._get("nvte_tensor_amax", "amax") or 0)

    def set_param(self, param: int, ptr: int, dtype: int, shape: Iterable[int]) -> None:
        """nvte_set_tensor_param_v2: set one component (data, scale, scale_inv, ...)."""
        bt = BasicTensor(_ptr(ptr), _dtype_arg(dtype, "dtype"), Shape.of(shape))
        lib().nvte_set_tensor_param_v2(self.handle, int(param), byref(bt), sizeof(bt))
        check_last("Tensor.set_param")

    def get_param(self, param: int) -> ParamInfo:
        """nvte_get_tensor_param_v2: (ptr, dtype, shape) of one component."""
        bt = BasicTensor()
        written = c_size_t()
        lib().nvte_get_tensor_param_v2(self.handle, int(param), byref(bt), sizeof(bt), byref(written))
        check_last("Tensor.get_param")
        return ParamInfo(int(bt.data_ptr or 0), _dtype(bt.dtype), bt.shape.to_tuple())

    def __repr__(self) -> str:
        if self._handle is None:
            return "Tensor(<closed>)"
        try:
            return f"Tensor(ptr={self.ptr:#x}, dtype={self.dtype!r}, shape={self.shape}, handle={self._handle:#x})"
        except Exception:  # noqa: BLE001
            return f"Tensor(handle={self._handle:#x})"


def _h(t, what: str = "tensor"):
    """A tensor argument: Tensor -> its handle, None -> NULL, int -> a raw handle."""
    if t is None:
        return None
    if isinstance(t, Tensor):
        return t.handle
    if isinstance(t, int):
        return c_void_p(t or None)
    if isinstance(t, c_void_p):
        return t
    raise TypeError(f"{what}: expected a _capi.Tensor, None or an int handle, got {type(t).__name__}")


# --------------------------------------------------------------------------------------
# GEMM and kernels
# --------------------------------------------------------------------------------------


def cublas_gemm(A, B, D, bias=None, pre_gelu_out=None, transa=False, transb=False, grad=False,
                workspace=None, accumulate=False, use_split_accumulator=False, math_sm_count=0, stream=0) -> None:
    """nvte_cublas_gemm (TE semantics: D[n, m] = op(B) . op(A)); asynchronous on ``stream``."""
    lib().nvte_cublas_gemm(_h(A, "A"), _h(B, "B"), _h(D, "D"), _h(bias, "bias"), _h(pre_gelu_out, "pre_gelu_out"),
                           bool(transa), bool(transb), bool(grad), _h(workspace, "workspace"), bool(accumulate),
                           bool(use_split_accumulator), int(math_sm_count), _ptr(stream))
    check_last("cublas_gemm")


def quantize(input, output, stream=0) -> None:
    lib().nvte_quantize(_h(input, "input"), _h(output, "output"), _ptr(stream))
    check_last("quantize")


def dequantize(input, output, stream=0) -> None:
    lib().nvte_dequantize(_h(input, "input"), _h(output, "output"), _ptr(stream))
    check_last("dequantize")


# ---- quantization (TE's cast.h / recipe.h / transpose.h); owned by the quantization work


class QuantizationConfig:
    """Owns an NVTEQuantizationConfig (TE's QuantizationConfigWrapper): force_pow_2_scales,
    amax_epsilon, noop_tensor (a one-float32 :class:`Tensor`: kernels skip when it holds
    1). ``.handle`` is usable as a ctypes argument; ``close()`` destroys it."""

    def __init__(self, *, force_pow_2_scales: bool = False, amax_epsilon: float = 0.0, noop_tensor=None):
        self._handle = lib().nvte_create_quantization_config()
        check_last("QuantizationConfig")
        self._noop = None
        if force_pow_2_scales:
            self.force_pow_2_scales = True
        if amax_epsilon:
            self.amax_epsilon = amax_epsilon
        if noop_tensor is not None:
            self.noop_tensor = noop_tensor

    @property
    def handle(self) -> c_void_p:
        if self._handle is None:
            raise ValueError("QuantizationConfig is closed")
        return c_void_p(self._handle)

    @property
    def _as_parameter_(self):
        return self.handle

    def _set(self, attr: int, value) -> None:
        lib().nvte_set_quantization_config_attribute(self.handle, int(attr), ctypes.cast(byref(value), c_void_p), sizeof(value))
        check_last("QuantizationConfig.set")

    def get_raw(self, attr: int) -> bytes:
        """The attribute's bytes as the library stores them."""
        n = c_size_t()
        lib().nvte_get_quantization_config_attribute(self.handle, int(attr), None, 0, byref(n))
        check_last("QuantizationConfig.get")
        buf = (ctypes.c_char * n.value)()
        lib().nvte_get_quantization_config_attribute(self.handle, int(attr), buf, n.value, byref(n))
        check_last("QuantizationConfig.get")
        return bytes(buf)

    @property
    def force_pow_2_scales(self) -> bool:
        return self.get_raw(QuantizationConfigAttribute.kNVTEQuantizationConfigForcePow2Scales) != b"\x00"

    @force_pow_2_scales.setter
    def force_pow_2_scales(self, v: bool) -> None:
        self._set(QuantizationConfigAttribute.kNVTEQuantizationConfigForcePow2Scales, c_uint8(1 if v else 0))

    @property
    def amax_epsilon(self) -> float:
        return c_float.from_buffer_copy(self.get_raw(QuantizationConfigAttribute.kNVTEQuantizationConfigAmaxEpsilon)).value

    @amax_epsilon.setter
    def amax_epsilon(self, v: float) -> None:
        self._set(QuantizationConfigAttribute.kNVTEQuantizationConfigAmaxEpsilon, c_float(float(v)))

    @property
    def noop_tensor(self):
        return self._noop

    @noop_tensor.setter
    def noop_tensor(self, t) -> None:
        h = _h(t, "noop_tensor")
        self._set(QuantizationConfigAttribute.kNVTEQuantizationConfigNoopTensor, c_void_p(h.value if h is not None else None))
        self._noop = t  # keep the tensor alive while the config refers to it

    def close(self) -> None:
        if self._handle is not None and lib is not None:
            lib().nvte_destroy_quantization_config(c_void_p(self._handle))
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def live_quantization_config_count() -> int:
    return int(lib().nvte_comm_live_quantization_config_count())


def quantize_v2(input, output, config=None, stream=0) -> None:
    """nvte_quantize_v2: per-tensor FP8 cast of ``input`` into ``output``'s rowwise and/or
    columnwise (transposed) data, amax (running max) and scale_inv; ``config`` a
    :class:`QuantizationConfig` or None."""
    lib().nvte_quantize_v2(_h(input, "input"), _h(output, "output"), _qc(config), _ptr(stream))
    check_last("quantize_v2")


def compute_amax(input, output, config=None, stream=0) -> None:
    """nvte_compute_amax(_with_config): ``output``'s amax = max|input|."""
    if config is None:
        lib().nvte_compute_amax(_h(input, "input"), _h(output, "output"), _ptr(stream))
    else:
        lib().nvte_compute_amax_with_config(_h(input, "input"), _h(output, "output"), _qc(config), _ptr(stream))
    check_last("compute_amax")


def compute_scale_from_amax(output, config, stream=0) -> None:
    """nvte_compute_scale_from_amax: ``output``'s scale from its amax (TE's current scaling)."""
    lib().nvte_compute_scale_from_amax(_h(output, "output"), _qc(config), _ptr(stream))
    check_last("compute_scale_from_amax")


def delayed_scaling_update(amax_history, scale, updated_amax_history, updated_scale, amax_compute_algo: str,
                           fp8_dtype: int, margin: float, stream=0) -> None:
    """nvte_delayed_scaling_recipe_amax_and_scale_update (in place when the updated tensors
    are the inputs)."""
    lib().nvte_delayed_scaling_recipe_amax_and_scale_update(
        _h(amax_history, "amax_history"), _h(scale, "scale"), _h(updated_amax_history, "updated_amax_history"),
        _h(updated_scale, "updated_scale"), amax_compute_algo.encode(), int(fp8_dtype), float(margin), _ptr(stream))
    check_last("delayed_scaling_update")


def transpose(input, output, stream=0) -> None:
    """nvte_transpose: ``output`` [cols, rows] = ``input`` [rows, cols]^T."""
    lib().nvte_transpose(_h(input, "input"), _h(output, "transposed_output"), _ptr(stream))
    check_last("transpose")


def _qc(config):
    if config is None:
        return None
    if isinstance(config, QuantizationConfig):
        return config.handle
    if isinstance(config, int):
        return c_void_p(config or None)
    if isinstance(config, c_void_p):
        return config
    raise TypeError(f"config: expected a QuantizationConfig, None or an int handle, got {type(config).__name__}")


# ---- end of the quantization block


def fill_uniform(tensor, seed: int, lo: float, hi: float, stream=0) -> None:
    check(lib().nvte_comm_fill_uniform(_h(tensor), int(seed), float(lo), float(hi), _ptr(stream)), "fill_uniform")


# --------------------------------------------------------------------------------------
# comm-GEMM context (TE's comm_gemm.h)
# --------------------------------------------------------------------------------------


class GemmCtx:
    """nvte_comm_gemm_ctx over the NCCL communicator ``comm_ptr`` (an int ncclComm_t, not
    owned) of the tensor-parallel group. Collective. ``close()`` destroys it."""

    def __init__(self, comm_ptr: int, nranks: int, rank: int):
        self._ctx = None
        self.nranks = int(nranks)
        self.rank = int(rank)
        ctx = lib().nvte_comm_gemm_ctx_create(_ptr(comm_ptr), self.nranks, self.rank)
        if not ctx:
            _raise_last("GemmCtx")
        self._ctx = ctx

    @classmethod
    def from_callbacks(cls, rank: int, nranks: int, allgather_fn: Callable, barrier_fn: Callable) -> "GemmCtx":
        """A context whose setup exchanges go through Python callables (as
        :meth:`Overlap.from_callbacks`; no NCCL needed with the IPC transport). Nothing
        collective happens here: each operation's first call (or XLA initialize stage)
        creates its engine collectively through the callables, possibly on another
        thread, so they must be thread-safe and stay usable for the context's life. An
        exception in either makes that call fail; it is kept in ``callback_errors``."""
        self = cls.__new__(cls)
        self._ctx = None
        self.nranks = int(nranks)
        self.rank = int(rank)
        self.callback_errors = []
        bs, keep = _callback_bootstrap(self.rank, self.nranks, allgather_fn, barrier_fn, self.callback_errors)
        # The C callbacks and the struct must outlive every call the library makes through them.
        self._keepalive = (bs,) + keep
        out = c_void_p()
        status = lib().nvte_comm_gemm_ctx_create_bootstrap(byref(bs), byref(out))
        if status != Status.NVTE_COMM_SUCCESS:
            raise CommError(status, last_error(), "GemmCtx.from_callbacks")
        self._ctx = out.value
        return self

    @property
    def handle(self) -> c_void_p:
        if self._ctx is None:
            raise ValueError("GemmCtx is closed")
        return c_void_p(self._ctx)

    def numroc(self, global_size: int) -> int:
        """This rank's share of ``global_size`` (block ceil(global / nranks))."""
        v = lib().nvte_comm_gemm_numroc(self.handle, _core.check_size(global_size, "global_size"))
        check_last("GemmCtx.numroc")
        return int(v)

    def _call(self, fn, what, m, n, k, a, b, d, bias, pre_act, transa, transb, grad, accumulate, comm_sm_count, stream, algo):
        m, n, k = (_core.check_size(v, f"{what}: {name}") for v, name in ((m, "m"), (n, "n"), (k, "k")))
        getattr(lib(), fn)(self.handle, m, n, k, _h(a, "a"), _h(b, "b"), _h(d, "d"), _h(bias, "bias"),
                           _h(pre_act, "pre_act"), bool(transa), bool(transb), bool(grad), bool(accumulate),
                           int(comm_sm_count), _ptr(stream), int(algo))
        check_last(what)

    def all_gather_gemm(self, m, n, k, a, b, d, bias=None, pre_act=None, transa=True, transb=False, grad=False,
                        accumulate=False, comm_sm_count=0, stream=0, algo=GemmAlgo.kNVTECommGemmAlgoDefault) -> None:
        """A [numroc(m), k], B [numroc(n), k] (gathered along n) -> local D [n, numroc(m)]."""
        self._call("nvte_all_gather_gemm", "GemmCtx.all_gather_gemm", m, n, k, a, b, d, bias, pre_act, transa, transb,
                   grad, accumulate, comm_sm_count, stream, algo)

    def gemm_reduce_scatter(self, m, n, k, a, b, d, bias=None, pre_act=None, transa=True, transb=False, grad=False,
                            accumulate=False, comm_sm_count=0, stream=0, algo=GemmAlgo.kNVTECommGemmAlgoDefault) -> None:
        """k split: A [m, numroc(k)], B [n, numroc(k)] -> local D [numroc(n), m] (sum over ranks)."""
        self._call("nvte_gemm_reduce_scatter", "GemmCtx.gemm_reduce_scatter", m, n, k, a, b, d, bias, pre_act, transa,
                   transb, grad, accumulate, comm_sm_count, stream, algo)

    def gemm_all_reduce(self, m, n, k, a, b, d, bias=None, pre_act=None, transa=True, transb=False, grad=False,
                        accumulate=False, comm_sm_count=0, stream=0, algo=GemmAlgo.kNVTECommGemmAlgoDefault) -> None:
        """k split: D [n, m] on every rank (sum over ranks)."""
        self._call("nvte_gemm_all_reduce", "GemmCtx.gemm_all_reduce", m, n, k, a, b, d, bias, pre_act, transa,
                   transb, grad, accumulate, comm_sm_count, stream, algo)

    def last_report(self) -> dict:
        """The last timed call's figures: call_ms, gemm_alone_ms, comm_alone_ms, bound_ms,
        ratio (NVTE_COMM_REPORT=1 when the context was created; waits for the call)."""
        r = CallReport()
        check(lib().nvte_comm_gemm_last_report(self.handle, byref(r)), "GemmCtx.last_report")
        return r.as_dict()

    def close(self) -> None:
        # Forgotten only once destroyed: a refused destroy (a capture holding the context's
        # calls still open) leaves it usable and closable later.
        ctx = self._ctx
        if ctx is not None:
            lib().nvte_comm_gemm_ctx_destroy(ctx)
            check_last("GemmCtx.close")
            self._ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------------------
# Overlap engine (TE's userbuffers)
# --------------------------------------------------------------------------------------


def overlap_config_default() -> OverlapConfig:
    """TE's defaults plus the NVTE_COMM_* environment overrides."""
    cfg = OverlapConfig()
    check(lib().nvte_comm_overlap_config_default(byref(cfg)), "overlap_config_default")
    return cfg


def _wrap_callbacks(allgather_fn: Callable, barrier_fn: Callable, errors: list):
    """C callbacks around Python callables. An exception is stored in ``errors`` and
    reported to the library as a failure (1), never swallowed as success."""

    def allgather(_user, global_ptr, global_bytes, local_ptr, local_bytes):
        try:
            local = ctypes.string_at(local_ptr, local_bytes) if local_bytes else b""
            data = allgather_fn(local)
            if isinstance(data, (list, tuple)):
                data = b"".join(bytes(x) for x in data)
            data = bytes(data)
            if len(data) != global_bytes:
                raise ValueError(
                    f"allgather_fn returned {len(data)} bytes; expected {global_bytes} "
                    f"(world_size x {local_bytes}, in rank order)"
                )
            if global_bytes:
                ctypes.memmove(global_ptr, data, global_bytes)
            return 0
        except BaseException as e:  # noqa: BLE001 - re-raised after the C call returns
            errors.append(e)
            return 1

    def barrier(_user):
        try:
            barrier_fn()
            return 0
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            return 1

    return AllgatherFn(allgather), BarrierFn(barrier)


def _callback_bootstrap(world_rank: int, world_size: int, allgather_fn: Callable, barrier_fn: Callable,
                        errors: list):
    """An NVTECommBootstrap over Python callables (see _wrap_callbacks), and what must stay
    alive with it (the C callbacks and the callables)."""
    ag, bar = _wrap_callbacks(allgather_fn, barrier_fn, errors)
    bs = Bootstrap()
    bs.world_rank = int(world_rank)
    bs.world_size = int(world_size)
    bs.nccl_comm = None
    bs.allgather = ag
    bs.barrier = bar
    return bs, (ag, bar, allgather_fn, barrier_fn)


class Overlap:
    """nvte_comm_overlap object: a registered [rows, cols] ``dtype`` buffer on every rank
    of the world, grouped in tensor-parallel groups of ``config.tp_size`` (collective).

    ``Overlap(comm, config, rows, cols, dtype)`` bootstraps through the NCCL communicator
    ``comm`` (int ncclComm_t); :meth:`from_callbacks` through Python callables. ``config``
    is an :class:`OverlapConfig` or None (defaults + environment)."""

    def __init__(self, bootstrap_comm_ptr: int, config: Optional[OverlapConfig], rows: int, cols: int, dtype: int):
        self._ov = None
        if not bootstrap_comm_ptr:
            raise CommError(
                Status.NVTE_COMM_ERROR_INVALID_ARGUMENT,
                "bootstrap_comm_ptr is 0 (NULL): pass an ncclComm_t, or use Overlap.from_callbacks",
                "Overlap",
            )
        bs = Bootstrap()
        bs.nccl_comm = int(bootstrap_comm_ptr)
        self._create(bs, config, rows, cols, dtype, ())

    @classmethod
    def from_callbacks(cls, world_rank: int, world_size: int, allgather_fn: Callable, barrier_fn: Callable,
                       config: Optional[OverlapConfig], rows: int, cols: int, dtype: int) -> "Overlap":
        """Bootstrap through Python callables (TE's ExtAllgatherOp / ExtBarrierOp):
        ``allgather_fn(local: bytes) -> bytes`` returns every rank's ``local`` concatenated
        in rank order (or a list of them); ``barrier_fn()`` returns once every rank has
        called it. An exception in either makes the creation fail and is chained to the
        CommError raised."""
        self = cls.__new__(cls)
        self._ov = None
        errors: list = []
        bs, keep = _callback_bootstrap(world_rank, world_size, allgather_fn, barrier_fn, errors)
        # The CFUNCTYPE objects must outlive every call the library makes through them.
        self._create(bs, config, rows, cols, dtype, keep + (errors,), errors)
        return self

    def _create(self, bs, config, rows, cols, dtype, keepalive, errors=None):
        rows, cols = _core.check_size(rows, "rows"), _core.check_size(cols, "cols")
        dtype = _dtype_arg(dtype, "dtype")
        self._keepalive = (bs,) + tuple(keepalive)
        cfg = None
        if config is not None:
            if not isinstance(config, OverlapConfig):
                raise TypeError(f"config: expected _capi.OverlapConfig or None, got {type(config).__name__}")
            if config.struct_size == 0:
                config.struct_size = sizeof(OverlapConfig)
            cfg = byref(config)
        out = c_void_p()
        status = lib().nvte_comm_overlap_create(byref(bs), cfg, rows, cols, dtype, byref(out))
        if status != Status.NVTE_COMM_SUCCESS:
            err = CommError(status, last_error(), "Overlap")
            if errors:
                raise err from errors[0]
            raise err
        self._ov = out.value

    @property
    def handle(self) -> c_void_p:
        if self._ov is None:
            raise ValueError("Overlap is closed")
        return c_void_p(self._ov)

    @property
    def tp(self) -> tuple:
        """(tp_size, tp_rank)."""
        s, r = c_int32(), c_int32()
        check(lib().nvte_comm_overlap_tp(self.handle, byref(s), byref(r)), "Overlap.tp")
        return (int(s.value), int(r.value))

    def get_buffer(self, local_chunk: bool) -> Tensor:
        """A new (owned) tensor handle viewing the whole buffer or this rank's chunk."""
        out = c_void_p()
        check(lib().nvte_comm_overlap_get_buffer(self.handle, bool(local_chunk), byref(out)), "Overlap.get_buffer")
        return Tensor.from_handle(out.value)

    def copy_into_buffer(self, tensor, local_chunk: bool, stream=0) -> None:
        check(lib().nvte_comm_overlap_copy_into_buffer(self.handle, _h(tensor, "input"), bool(local_chunk), _ptr(stream)),
              "Overlap.copy_into_buffer")

    def split_ag(self, A, transa, B, transb, D, bias=None, pre_gelu_out=None, grad=False, workspace=None,
                 accumulate=False, use_split_accumulator=False, B_copy=None, stream=0) -> None:
        """Ring all-gather + GEMM (nvte_comm_overlap_split_ag; C argument order)."""
        check(lib().nvte_comm_overlap_split_ag(
            self.handle, _h(A, "A"), bool(transa), _h(B, "B"), bool(transb), _h(D, "D"), _h(bias, "bias"),
            _h(pre_gelu_out, "pre_gelu_out"), bool(grad), _h(workspace, "workspace"), bool(accumulate),
            bool(use_split_accumulator), _h(B_copy, "B_copy"), _ptr(stream)), "Overlap.split_ag")

    def _rs(self, fn, what, A, transa, B, transb, D, bias, pre_gelu_out, grad, workspace, accumulate,
            use_split_accumulator, rs_output, stream):
        check(getattr(lib(), fn)(
            self.handle, _h(A, "A"), bool(transa), _h(B, "B"), bool(transb), _h(D, "D"), _h(bias, "bias"),
            _h(pre_gelu_out, "pre_gelu_out"), bool(grad), _h(workspace, "workspace"), bool(accumulate),
            bool(use_split_accumulator), _h(rs_output, "rs_output"), _ptr(stream)), what)

    def split_rs(self, A, transa, B, transb, D=None, bias=None, pre_gelu_out=None, grad=False, workspace=None,
                 accumulate=False, use_split_accumulator=False, rs_output=None, stream=0) -> None:
        """Pipelined GEMM + reduce-scatter into ``rs_output`` [n/tp, m] (C argument order)."""
        self._rs("nvte_comm_overlap_split_rs", "Overlap.split_rs", A, transa, B, transb, D, bias, pre_gelu_out, grad,
                 workspace, accumulate, use_split_accumulator, rs_output, stream)

    def split_rs_p2p(self, A, transa, B, transb, D=None, bias=None, pre_gelu_out=None, grad=False, workspace=None,
                     accumulate=False, use_split_accumulator=False, rs_output=None, stream=0) -> None:
        """Ring GEMM + reduce-scatter into ``rs_output`` [n/tp, m] (C argument order)."""
        self._rs("nvte_comm_overlap_split_rs_p2p", "Overlap.split_rs_p2p", A, transa, B, transb, D, bias,
                 pre_gelu_out, grad, workspace, accumulate, use_split_accumulator, rs_output, stream)

    def bulk(self, comm_type, A, transa, B, transb, D, bias=None, pre_gelu_out=None, grad=False, workspace=None,
             accumulate=False, use_split_accumulator=False, buffer=None, rs_output=None, stream=0) -> None:
        """AG or RS (``comm_type``: OverlapType) on the buffer beside an unrelated GEMM."""
        check(lib().nvte_comm_overlap_bulk(
            self.handle, int(comm_type), _h(A, "A"), bool(transa), _h(B, "B"), bool(transb), _h(D, "D"),
            _h(bias, "bias"), _h(pre_gelu_out, "pre_gelu_out"), bool(grad), _h(workspace, "workspace"),
            bool(accumulate), bool(use_split_accumulator), _h(buffer, "buffer"), _h(rs_output, "rs_output"),
            _ptr(stream)), "Overlap.bulk")

    def synchronize(self) -> None:
        """Host-wait for the last call; CommError (TIMEOUT) names the peer that never came."""
        check(lib().nvte_comm_overlap_synchronize(self.handle), "Overlap.synchronize")

    def last_report(self) -> dict:
        """The last timed call's figures (NVTE_COMM_REPORT=1 at creation; waits for it)."""
        r = CallReport()
        check(lib().nvte_comm_overlap_last_report(self.handle, byref(r)), "Overlap.last_report")
        return r.as_dict()

    def close(self) -> None:
        # Forgotten only once destroyed (see GemmCtx.close).
        ov = self._ov
        if ov is not None:
            check(lib().nvte_comm_overlap_destroy(ov), "Overlap.close")
            self._ov = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
