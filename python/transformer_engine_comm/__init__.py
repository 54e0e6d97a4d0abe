"""transformer_engine_comm: tensor-parallel communication/GEMM overlap for NVIDIA GPUs.

The native library (libtransformer_engine_comm.so, a Rust cdylib with a C ABI) is loaded
lazily through ctypes by :mod:`transformer_engine_comm._capi` on first use, so importing
this package never fails for want of CUDA or of the library. PyTorch integration lives in
:mod:`transformer_engine_comm.torch` (imported explicitly; needs torch).
"""
from __future__ import annotations

import os as _os
import re as _re

from . import _capi
from ._capi import (
    CommError,
    DType,
    GemmAlgo,
    GemmCtx,
    Library,
    MissingFunctionError,
    Overlap,
    OverlapConfig,
    OverlapType,
    ScalingMode,
    Status,
    Tensor,
    TensorParam,
    Transport,
    check_runtime,
    device_count,
    library_path,
    live_tensor_count,
    version,
)


def _package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version as _dist_version

        here = _os.path.dirname(_os.path.abspath(__file__))
        repo = _os.path.dirname(_os.path.dirname(here))
        cargo = _os.path.join(repo, "Cargo.toml")
        if _os.path.isfile(cargo):  # running from the source tree: Cargo.toml is the truth
            with open(cargo, encoding="utf-8") as f:
                m = _re.search(r'(?m)^version\s*=\s*"([^"]+)"', f.read())
            if m:
                return m.group(1)
        try:
            return _dist_version("transformer_engine_comm")
        except PackageNotFoundError:
            pass
    except Exception:  # noqa: BLE001
        pass
    return "0+unknown"


__version__ = _package_version()


def load():
    """Load the native library now (ctypes.CDLL); raises CommError listing the paths tried."""
    return _capi.lib()


HEADER = "transformer_engine_comm.h"


class LibraryReport(_capi.LibraryInfo):
    """What :func:`library_info` returns. As a mapping it is the same as before:
    ``_capi.library_info()``'s map of the four CUDA libraries (``"nccl"``, ``"cublaslt"``,
    ``"cuda_driver"``, ``"nvrtc"``: path, version, preloaded, or the error; indexing one that
    could not be bound raises its CommError; ``.errors``). ``.details`` is
    :func:`runtime_info`'s dict (package, library, ABI, driver, GPUs, runtime verdict), and
    ``str()`` (``print(tec.library_info())``) a readable summary of both."""

    def __init__(self, details: dict, libs=None, error=None):
        super().__init__()
        self.details = details
        for key in _capi._LIBRARY_KEYS.values():
            if libs is not None:
                dict.__setitem__(self, key, dict.__getitem__(libs, key))
                if key in libs.errors:
                    self.errors[key] = libs.errors[key]
            elif error is not None:  # no library, or one without nvte_comm_library_info
                self.errors[key] = error
                dict.__setitem__(self, key, {"path": None, "version": None, "preloaded": False,
                                             "error": str(error), "status": error.status_name})

    def __str__(self) -> str:
        d = self.details
        lines = [f"transformer_engine_comm {d.get('package_version')}"]
        if "library_error" in d:
            lines.append(f"  library: not loaded: {d['library_error']}")
            return "\n".join(lines)
        abi = d.get("abi") or {}
        missing = abi.get("missing_functions") or []
        lines.append(f"  library: {d.get('library_path')} (version {d.get('library_version')}; C ABI of "
                     f"{abi.get('header')}: " + (f"missing {', '.join(missing)}" if missing else "complete") + ")")
        n = d.get("device_count", 0)
        lines.append(f"  GPU visible: {'yes' if n else 'no'} ({n} CUDA device{'' if n == 1 else 's'})")
        for key, label in (("cuda_driver", "CUDA driver"), ("cublaslt", "cuBLASLt"), ("nvrtc", "NVRTC"),
                           ("nccl", "NCCL")):
            e = dict.get(self, key) or {}
            if e.get("path"):
                lines.append(f"  {label}: {e['path']} (version {e.get('version')})")
            else:
                lines.append(f"  {label}: not found ({e.get('status', 'unknown')})")
        ok = d.get("runtime_ok")
        lines.append("  runtime: ready" if ok else f"  runtime: not usable here: {d.get('runtime_error')}")
        return "\n".join(lines)


def _report():
    """runtime_info()'s dict, with the CUDA libraries' map and the library's load error
    (None when it loaded) for :func:`library_info`."""
    info = {"package_version": __version__}
    try:
        st = _capi._state()
    except CommError as e:
        info["library_error"] = str(e)
        info["gpu_visible"] = False
        return info, None, e
    info["library_version"] = version()
    info["library_path"] = library_path()
    info["abi"] = {"header": HEADER, "version": info["library_version"], "missing_functions": sorted(st.missing)}
    libs, err = None, None
    try:
        libs = _capi.library_info()
        info["libraries"] = dict(libs)
    except CommError as e:
        err = e
        info["libraries"] = {"error": str(e)}
    drv = info["libraries"].get("cuda_driver") or {}
    info["cuda_driver_version"] = drv.get("version") if drv.get("path") else None
    info["device_count"] = device_count()
    info["gpu_visible"] = info["device_count"] > 0
    try:
        check_runtime()
        info["runtime_ok"], info["runtime_error"] = True, None
    except CommError as e:
        info["runtime_ok"], info["runtime_error"] = False, str(e)
    return info, libs, err


def library_info(which=None):
    """The CUDA libraries this library binds at run time, and (``str()``, ``.details``)
    everything about the native side, without raising on a machine with no GPU, no CUDA
    driver or no library (what is missing is reported instead)::

        python -c "import transformer_engine_comm as tec; print(tec.library_info())"

    ``library_info()``: a :class:`LibraryReport`, as a mapping ``_capi.library_info()``'s
    four libraries (``info["nccl"]`` raises that library's CommError when it could not be
    bound, as before). ``library_info("nccl")`` (or "cublaslt", "cuda_driver", "nvrtc", or
    a :class:`Library` value): that library's ``{"path", "version", "preloaded"}``, raising
    CommError when it cannot be bound."""
    if which is not None:
        return _capi.library_info(which)
    details, libs, err = _report()
    return LibraryReport(details, libs, err)


def runtime_info() -> dict:
    """Everything about the native side, without raising for a missing GPU or CUDA
    library: ``package_version``; ``library_error`` (only when the library cannot be
    loaded: the paths tried) or ``library_version``, ``library_path``, ``abi`` (the C header
    the binding follows, ``{"header", "version", "missing_functions"}``: functions of the
    binding the loaded library lacks), ``libraries`` (a plain dict: each CUDA library's
    path and version, or its error), ``cuda_driver_version`` (None without a driver),
    ``device_count``, ``gpu_visible``, ``runtime_ok`` / ``runtime_error``
    (:func:`check_runtime`'s verdict)."""
    return _report()[0]


__all__ = [
    "__version__",
    "CommError",
    "DType",
    "HEADER",
    "GemmAlgo",
    "GemmCtx",
    "Library",
    "MissingFunctionError",
    "Overlap",
    "OverlapConfig",
    "OverlapType",
    "ScalingMode",
    "Status",
    "Tensor",
    "TensorParam",
    "Transport",
    "check_runtime",
    "device_count",
    "library_info",
    "LibraryReport",
    "library_path",
    "live_tensor_count",
    "load",
    "runtime_info",
    "version",
]
