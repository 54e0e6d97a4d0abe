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
    library_info,
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


def runtime_info() -> dict:
    """Everything about the native side, without raising for a missing GPU or CUDA
    library: package and library versions, the library file, the bound CUDA libraries
    (or why each could not be bound), the device count and the check_runtime() verdict."""
    info = {"package_version": __version__}
    try:
        _capi.lib()
    except CommError as e:
        info["library_error"] = str(e)
        return info
    info["library_version"] = version()
    info["library_path"] = library_path()
    try:
        info["libraries"] = dict(library_info())
    except CommError as e:
        info["libraries"] = {"error": str(e)}
    info["device_count"] = device_count()
    try:
        check_runtime()
        info["runtime_ok"], info["runtime_error"] = True, None
    except CommError as e:
        info["runtime_ok"], info["runtime_error"] = False, str(e)
    return info


__all__ = [
    "__version__",
    "CommError",
    "DType",
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
    "library_path",
    "live_tensor_count",
    "load",
    "runtime_info",
    "version",
]
