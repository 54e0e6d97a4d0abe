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


class LibraryInfoReport(dict):
    """What :func:`library_info` returns: a plain dict of the package and library facts.
    For compatibility with the older ``library_info()`` (the CUDA libraries only),
    ``info["nccl"]`` / ``["cublaslt"]`` / ``["cuda_driver"]`` / ``["nvrtc"]`` read
    ``info["libraries"][...]`` (raising that library's CommError when it could not be
    bound); they are not keys of the dict."""

    def __missing__(self, key):
        libs = dict.get(self, "libraries")
        if key in _capi._LIBRARY_KEYS.values() and libs is not None:
            return libs[key]
        raise KeyError(key)

    def __str__(self) -> str:
        """A readable summary (``print(tec.library_info())``); ``repr`` is the dict."""
        g = dict.get
        lines = [f"transformer_engine_comm {g(self, 'package_version')}"]
        if "library_error" in self:
            lines.append(f"  library: not loaded: {self['library_error']}")
            return "\n".join(lines)
        abi = g(self, "abi") or {}
        missing = abi.get("missing_functions") or []
        lines.append(f"  library: {g(self, 'library_path')} (version {g(self, 'library_version')}; C ABI of "
                     f"{abi.get('header')}: " + (f"missing {', '.join(missing)}" if missing else "complete") + ")")
        n = g(self, "device_count", 0)
        lines.append(f"  GPU visible: {'yes' if n else 'no'} ({n} CUDA device{'' if n == 1 else 's'})")
        for key, label in (("cuda_driver", "CUDA driver"), ("cublaslt", "cuBLASLt"), ("nvrtc", "NVRTC"),
                           ("nccl", "NCCL")):
            e = (g(self, "libraries") or {}).get(key) or {}
            if e.get("path"):
                lines.append(f"  {label}: {e['path']} (version {e.get('version')})")
            else:
                lines.append(f"  {label}: not found ({e.get('status', 'unknown')})")
        ok = g(self, "runtime_ok")
        lines.append("  runtime: ready" if ok else f"  runtime: not usable here: {g(self, 'runtime_error')}")
        return "\n".join(lines)


def library_info(which=None):
    """The package and its native library, without raising on a machine with no GPU, no
    CUDA driver or no library (what is missing is reported instead)::

        python -c "import transformer_engine_comm as tec; print(tec.library_info())"

    Keys: ``package_version``; ``library_error`` (only when the library cannot be loaded:
    the paths tried) or ``library_version`` (nvte_comm_version), ``library_path`` (the
    file loaded), ``abi`` (the C header the binding follows, ``{"header", "version",
    "missing_functions"}``: functions of the binding the loaded library lacks, [] when
    they agree), ``libraries`` (the CUDA libraries bound at run time: driver, cuBLASLt,
    NVRTC, NCCL, each its path and version or the error; ``_capi.library_info()``),
    ``cuda_driver_version`` (None when the driver is missing), ``device_count``, ``gpu_visible``
    (device_count > 0), ``runtime_ok`` / ``runtime_error`` (:func:`check_runtime`).

    ``library_info("nccl")`` (or "cublaslt", "cuda_driver", "nvrtc", or a
    :class:`Library` value): that CUDA library's ``{"path", "version", "preloaded"}``,
    raising CommError when it cannot be bound (``_capi.library_info(which)``).
    :func:`runtime_info` is the same report (its older name)."""
    if which is not None:
        return _capi.library_info(which)
    info = LibraryInfoReport(package_version=__version__)
    try:
        st = _capi._state()
    except CommError as e:
        info["library_error"] = str(e)
        info["gpu_visible"] = False
        return info
    info["library_version"] = version()
    info["library_path"] = library_path()
    info["abi"] = {"header": HEADER, "version": info["library_version"],
                   "missing_functions": sorted(st.missing)}
    try:
        info["libraries"] = _capi.library_info()  # a LibraryInfo: indexing a missing one raises its error
    except CommError as e:
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
    return info


def runtime_info() -> dict:
    """:func:`library_info`'s report (the older name, kept)."""
    return library_info()


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
    "LibraryInfoReport",
    "library_path",
    "live_tensor_count",
    "load",
    "runtime_info",
    "version",
]
