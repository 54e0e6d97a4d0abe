"""Userbuffers-style overlap objects on torch tensors (TE's CommOverlap / CommOverlapP2P).

:class:`CommOverlap` owns a buffer of ``[rows, cols]`` registered across the ranks of a
tensor-parallel group (``_capi.Overlap``: CUDA IPC inside a node, or NCCL) and runs the
library's overlap algorithms on ``torch.cuda.current_stream()``:

- :meth:`CommOverlap.split_overlap_ag`: ``out = AG(x) @ weight.T`` by ring exchange, each
  chunk's GEMM overlapping the next chunk's transfer (TE SPLIT_PIPELINED_AG_P2P);
- :meth:`CommOverlap.split_overlap_rs`: ``out = RS_rows(x @ weight.T)``, GEMM chunks
  reduce-scattered while the next computes (TE SPLIT_PIPELINED_RS);
- :meth:`CommOverlap.split_overlap_rs_p2p`: the same by ring exchange (TE
  SPLIT_PIPELINED_RS_P2P);
- :meth:`CommOverlap.bulk_overlap`: an all-gather or reduce-scatter of the buffer beside an
  unrelated GEMM (TE BULK_OVERLAP_AG / BULK_OVERLAP_RS).

GEMMs follow nvte_cublas_gemm (A = weight, B = x, D = [n, m]); by default TE's TN form,
weight [m, k], x [n, k], D = ``x @ weight.T``. Every method takes ``transa`` / ``transb``
with nvte_cublas_gemm's meaning: weight is [m, k] when transa (default) else [k, m]; x is
[n, k] unless transb, then [k, n]. Layouts TN, NN (``transa=False``: ``x @ weight``, e.g.
dgrad) and NT (``transa=False, transb=True``: ``x.T @ weight``, e.g. wgrad ``dY.T @ X`` with
weight = X, x = dY); TT is refused, FP8 inputs take TN only. Tensor handles are cached by
description (``_context.handle_cache``), so a call on tensors seen before creates none.
Creation is collective over the group. :meth:`CommOverlap.get_buffer` returns a torch
view of the registered buffer (valid until :meth:`CommOverlap.close`).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import threading
import weakref
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.utils.dlpack

from .. import _capi, _core
from . import _context
from ._context import (
    FP8_DTYPES,
    _scalar_ptr,
    handle_cache,
    nvte_dtype,
    nvte_tensor,
    process_group_nccl_comm,
    raw_stream,
    register_exit_hook,
    resolve_group,
)

__all__ = ["CommOverlap", "CommOverlapType", "destroy_userbuffers"]

DEFAULT_WORKSPACE_BYTES = 32 << 20

_TRANSPORT_IDS = _core.TRANSPORT_IDS


class CommOverlapType(enum.IntEnum):
    """Which collective a bulk overlap performs (NVTECommOverlapType / TE's values)."""

    RS = 0
    AG = 1


# ----------------------------------------------------------------------------- _capi adapters


def _handle_ptr(t) -> int:
    """Data pointer of a ``_capi.Tensor`` (a handle the library created, e.g. a buffer view)."""
    for attr in ("ptr", "data_ptr"):
        v = getattr(t, attr, None)
        if v is not None:
            v = v() if callable(v) else v
            if v:
                return int(v)
    lib = _capi.lib()
    p = lib.nvte_tensor_data(t.handle)
    p = p.value if hasattr(p, "value") else p
    if not p:
        _capi.check_last("nvte_tensor_data")
        raise RuntimeError("te_comm: the overlap buffer view has no data pointer")
    return int(p)


# A torch tensor over memory torch did not allocate (the registered buffer): a DLPack
# capsule built with ctypes (no numpy needed), else a __cuda_array_interface__ object.
# Either way the tensor holds ``owner`` (the ``_capi.Overlap``) until it is freed.

_KDL_CPU, _KDL_CUDA = 1, 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DL_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DL_DELETER)]

_dl_alive = {}  # address of a DLManagedTensor -> (the struct, its shape array, owner)
_dl_lock = threading.Lock()


def _dl_delete(p) -> None:
    addr = ctypes.cast(p, ctypes.c_void_p).value
    with _dl_lock:
        _dl_alive.pop(addr, None)


_dl_deleter = _DL_DELETER(_dl_delete)  # module lifetime: torch may call it at any time


def _bytes_tensor_dlpack(ptr: int, nbytes: int, device: torch.device, owner) -> torch.Tensor:
    shape = (ctypes.c_int64 * 1)(nbytes)
    m = _DLManagedTensor()
    m.dl_tensor.data = ptr
    m.dl_tensor.device = _DLDevice(_KDL_CUDA if device.type == "cuda" else _KDL_CPU, device.index or 0)
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _dl_deleter
    addr = ctypes.addressof(m)
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    with _dl_lock:
        _dl_alive[addr] = (m, shape, owner)
    try:
        t = torch.utils.dlpack.from_dlpack(capsule_new(addr, b"dltensor", None))
    except BaseException:
        with _dl_lock:
            _dl_alive.pop(addr, None)
        raise
    return t


class _DeviceMemory:
    """``__cuda_array_interface__`` over the registered buffer's bytes; holds ``owner``."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


def bytes_tensor(ptr: int, nbytes: int, device: torch.device, owner) -> torch.Tensor:
    """A uint8 torch tensor of ``nbytes`` at device address ``ptr`` (not owned: ``owner`` is
    kept alive while the tensor, or any view of it, exists)."""
    try:
        t = _bytes_tensor_dlpack(ptr, nbytes, device, owner)
    except Exception as e:
        if device.type != "cuda":
            raise
        try:
            t = torch.as_tensor(_DeviceMemory(ptr, nbytes, owner), device=device)
        except Exception as e2:
            raise RuntimeError(f"te_comm: cannot view device memory as a torch tensor: DLPack: {e}; "
                               f"__cuda_array_interface__: {e2}") from e2
    if t.data_ptr() != ptr or t.numel() != nbytes or t.device != device:
        raise RuntimeError(
            f"te_comm: the torch view of the buffer is {t.numel()} bytes at {t.data_ptr():#x} on {t.device}, "
            f"expected {nbytes} at {ptr:#x} on {device}"
        )
    return t


def _sig(t):
    """What the checks of a call look at in a tensor argument (None: absent): calls with
    the same signatures reuse the validation of the first (``CommOverlap._plans``)."""
    return None if t is None else (t.shape, t.dtype, t.get_device())


def _contiguous(*tensors) -> None:
    # Checked on every call (the signature does not cover strides).
    for t in tensors:
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"CommOverlap: every tensor argument must be contiguous (row-major), got shape {tuple(t.shape)} "
                f"strides {t.stride()}"
            )


_MAX_PLANS = 256


def _check_cuda(what: str, t, device: torch.device, ndim: Optional[int] = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"CommOverlap: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"CommOverlap: {what} must be on {device} (the object's device), got {t.device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"CommOverlap: {what} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"CommOverlap: {what} must be contiguous (row-major)")


_live: "weakref.WeakSet[CommOverlap]" = weakref.WeakSet()
_live_lock = threading.Lock()


def destroy_userbuffers() -> None:
    """Close every live :class:`CommOverlap` (runs at exit too, before the contexts)."""
    with _live_lock:
        objs = list(_live)
    for o in objs:
        try:
            o.close()
        except Exception:
            pass


register_exit_hook(destroy_userbuffers)


# ----------------------------------------------------------------------------- the object


class CommOverlap:
    """A registered ``[rows, cols]`` buffer of ``dtype`` shared by the ranks of a
    tensor-parallel group, and the overlap algorithms on it.

    shape: (rows, cols); rows must be divisible by the tensor-parallel size. For
    split_overlap_ag the buffer must hold the gathered ``x`` ([n, k] of x's dtype); for
    split_overlap_rs[_p2p] the GEMM output ([n, m] of the buffer dtype: the output dtype, or
    FP8 with ``buffer_scale``); for bulk_overlap the tensor being gathered / reduced.

    group: the process group whose ranks share the buffer (None = world). tp_size: ranks
    per tensor-parallel group inside ``group`` (consecutive blocks of the group's ranks);
    None = the whole group. bootstrap: "nccl" (setup through the group's NCCL communicator)
    or "callbacks" (setup through torch.distributed collectives on the group, TE's
    ExtAllgatherOp / ExtBarrierOp way). The remaining keywords override the library's
    defaults (``_capi.overlap_config_default()``: TE's defaults plus NVTE_COMM_* variables).
    """

    def __init__(
        self,
        shape: Tuple[int, int],
        dtype: torch.dtype,
        group=None,
        *,
        tp_size: Optional[int] = None,
        bootstrap: str = "nccl",
        num_splits: Optional[int] = None,
        num_max_streams: Optional[int] = None,
        comm_cga_size: Optional[int] = None,
        num_comm_sm: Optional[int] = None,
        set_sm_margin: Optional[bool] = None,
        use_ce: Optional[bool] = None,
        aggregate: Optional[bool] = None,
        gemm_priority: Optional[int] = None,
        comm_priority: Optional[int] = None,
        timeout_ms: Optional[int] = None,
        transport: Optional[str] = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ):
        self._ov = None
        self._ovh = None
        self._plans = {}
        dims = _core.check_shape(shape, "CommOverlap: shape")
        if len(dims) != 2 or dims[0] <= 0 or dims[1] <= 0:
            raise ValueError(f"CommOverlap: shape must be (rows, cols) with positive sizes, got {shape}")
        rows, cols = dims
        dtype = _context.torch_dtype(dtype, "CommOverlap: dtype")
        nvte_dt = nvte_dtype(dtype)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES:
            raise TypeError(f"CommOverlap: buffer dtype must be float32, float16, bfloat16 or FP8, got {dtype}")
        pg = resolve_group(group)
        gsize, grank = pg.size(), pg.rank()
        tp = gsize if tp_size is None else _core.check_size(tp_size, "CommOverlap: tp_size")
        if tp <= 0 or gsize % tp:
            raise ValueError(f"CommOverlap: tp_size={tp_size} must divide the group size {gsize}")
        if rows % tp:
            raise ValueError(f"CommOverlap: rows={rows} must be divisible by the tensor-parallel size {tp}")
        if bootstrap not in ("nccl", "callbacks"):
            raise ValueError(f"CommOverlap: bootstrap must be 'nccl' or 'callbacks', got {bootstrap!r}")
        if transport is not None and transport not in _TRANSPORT_IDS:
            raise ValueError(f"CommOverlap: transport must be None or one of {sorted(_TRANSPORT_IDS)}, got {transport!r}")
        workspace_bytes = _core.check_size(workspace_bytes, "CommOverlap: workspace_bytes")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("CommOverlap: cannot be created during CUDA graph capture")

        cfg = _capi.overlap_config_default()
        cfg.tp_size = tp
        for name, value in (
            ("num_splits", num_splits),
            ("num_max_streams", num_max_streams),
            ("comm_cga_size", comm_cga_size),
            ("num_comm_sm", num_comm_sm),
            ("set_sm_margin", set_sm_margin),
            ("use_ce", use_ce),
            ("aggregate", aggregate),
            ("gemm_priority", gemm_priority),
            ("comm_priority", comm_priority),
            ("timeout_ms", timeout_ms),
        ):
            if value is not None:
                setattr(cfg, name, value)
        if transport is not None:
            cfg.transport = _TRANSPORT_IDS[transport]
        self._transport = _core.transport_name(int(cfg.transport))

        self.device = _context._current_device()
        self.group = pg
        self.dtype = dtype
        self.shape = (rows, cols)
        if bootstrap == "nccl":
            self._ov = _capi.Overlap(process_group_nccl_comm(pg), cfg, rows, cols, nvte_dt)
        else:
            self._ov = _capi.Overlap.from_callbacks(
                grank, gsize, self._make_allgather(pg), self._make_barrier(pg), cfg, rows, cols, nvte_dt
            )
        self.tp_size, self.tp_rank = (int(v) for v in self._ov.tp)
        view = self._ov.get_buffer(False)
        try:
            self._buffer_ptr = _handle_ptr(view)
        finally:
            view.close()
        nbytes = rows * cols * torch.tensor([], dtype=dtype).element_size()
        self._buffer = bytes_tensor(self._buffer_ptr, nbytes, self.device, self._ov).view(dtype).view(rows, cols)
        self._workspace = torch.empty(int(workspace_bytes), dtype=torch.uint8, device=self.device)
        self._dev = self.device.index
        lib = _capi.lib()
        self._c_copy = lib.nvte_comm_overlap_copy_into_buffer
        self._c_split_ag = lib.nvte_comm_overlap_split_ag
        self._c_split_rs = lib.nvte_comm_overlap_split_rs
        self._c_split_rs_p2p = lib.nvte_comm_overlap_split_rs_p2p
        self._c_bulk = lib.nvte_comm_overlap_bulk
        self._ovh = int(self._ov._ov)  # the raw object handle the C calls take
        with _live_lock:
            _live.add(self)

    # ------------------------------------------------------------------ bootstrap callbacks

    @staticmethod
    def _make_allgather(pg):
        def allgather(local: bytes) -> bytes:
            out = [None] * pg.size()
            dist.all_gather_object(out, bytes(local), group=pg)
            return b"".join(out)

        return allgather

    @staticmethod
    def _make_barrier(pg):
        def barrier() -> None:
            out = [None] * pg.size()
            dist.all_gather_object(out, None, group=pg)

        return barrier

    # ------------------------------------------------------------------ basics

    def _check_open(self) -> None:
        if self._ov is None:
            raise RuntimeError("CommOverlap: the object is closed")

    def _stream(self) -> int:
        return raw_stream(self.device.index)

    def is_fp8_ubuf(self) -> bool:
        return self.dtype in FP8_DTYPES

    def get_buffer(self, local_chunk: bool = False, shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
        """A torch view of the registered buffer: the whole [rows, cols], or this rank's
        chunk [rows / tp, cols] (optionally reshaped to ``shape``). Valid until close();
        reads / writes are ordinary CUDA tensor work on the caller's streams."""
        self._check_open()
        t = self._buffer
        if local_chunk:
            rc = self.shape[0] // self.tp_size
            t = t[self.tp_rank * rc:(self.tp_rank + 1) * rc]
        return t if shape is None else t.view(shape)

    def _buffer_tensor(self, *, scale=None, scale_inv=None, shape=None):
        return nvte_tensor(self._buffer, scale=scale, scale_inv=scale_inv, shape=shape)

    # ------------------------------------------------------------------ per-call plumbing
    #
    # Every method validates its arguments once per *signature* (each tensor's shape, dtype
    # and device, every flag): the result is kept in ``self._plans``, and a later call with
    # the same signature only checks what the signature does not cover (contiguity, that
    # the object is open), looks the tensor handles up by pointer in the shared handle
    # cache and makes the C call through ctypes directly.

    def _plan(self, key, make):
        try:
            p = self._plans.get(key)
        except TypeError:  # an unhashable argument: validate every time
            return make()
        if p is None:
            p = make()
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = p
        return p

    def _handle(self) -> int:
        h = self._ovh
        if h is None:
            raise RuntimeError("CommOverlap: the object is closed")
        return h

    @staticmethod
    def _failed(status: int, what: str):
        return _capi.CommError(status, _capi.last_error(), what)

    def copy_into_buffer(self, input: torch.Tensor, local_chunk: bool = False) -> None:
        """Copy ``input`` into this rank's chunk (local_chunk) or the whole buffer, on the
        current stream, once the peers are done with the previous call."""
        key = ("copy", _sig(input), local_chunk)
        self._plan(key, lambda: self._check_copy(input, local_chunk))
        ovh = self._handle()
        if not input.is_contiguous():
            raise ValueError("CommOverlap: input must be contiguous (row-major)")
        st = self._c_copy(ovh, handle_cache.raw(input), bool(local_chunk), raw_stream(self._dev))
        if st:
            raise self._failed(st, "Overlap.copy_into_buffer")

    def _check_copy(self, input, local_chunk):
        self._check_open()
        _check_cuda("input", input, self.device, ndim=None)
        if input.dtype != self.dtype:
            raise TypeError(f"CommOverlap.copy_into_buffer: input dtype {input.dtype} differs from the buffer's {self.dtype}")
        want = self.shape[0] * self.shape[1] // (self.tp_size if local_chunk else 1)
        if input.numel() != want:
            raise ValueError(
                f"CommOverlap.copy_into_buffer: input has {input.numel()} elements but the "
                f"{'local chunk' if local_chunk else 'buffer'} has {want}"
            )
        return True

    # ------------------------------------------------------------------ argument plumbing

    def _gemm_inputs(self, what: str, weight, x, x_scale_inv, w_scale_inv, use_split_accumulator, transa=True,
                     transb=False):
        _check_cuda("weight", weight, self.device)
        fp8 = weight.dtype in FP8_DTYPES or (x is not None and x.dtype in FP8_DTYPES)
        _core.check_trans(f"CommOverlap.{what}", transa, transb, fp8)
        if x is not None:
            _, xk, _, wk = _core.operand_dims(x.shape, weight.shape, transa, transb)
            if xk != wk:
                raise ValueError(
                    f"CommOverlap.{what}: x {tuple(x.shape)} (transb={bool(transb)}) and weight {tuple(weight.shape)} "
                    f"(transa={bool(transa)}) must agree on k: {xk} vs {wk}"
                )
        if fp8:
            for name, s in (("x_scale_inv", x_scale_inv), ("w_scale_inv", w_scale_inv)):
                if s is None:
                    raise ValueError(f"CommOverlap.{what}: FP8 inputs need {name}")
                _scalar_ptr(s, f"CommOverlap.{what}: {name}")
        usa = (not fp8) if use_split_accumulator is None else bool(use_split_accumulator)
        return fp8, usa

    def _check_opt(self, t, what: str, ndim=None) -> None:
        if t is not None:
            _check_cuda(what, t, self.device, ndim=ndim)

    # ------------------------------------------------------------------ algorithms

    def split_overlap_ag(
        self,
        weight: torch.Tensor,
        x_local: Optional[torch.Tensor],
        out: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        pre_gelu_out: Optional[torch.Tensor] = None,
        x_copy: Optional[torch.Tensor] = None,
        x_scale_inv: Optional[torch.Tensor] = None,
        w_scale_inv: Optional[torch.Tensor] = None,
        accumulate: bool = False,
        use_split_accumulator: Optional[bool] = None,
        transa: bool = True,
        transb: bool = False,
        grad: bool = False,
    ) -> torch.Tensor:
        """``out [n, m] = AG(x) @ weight.T (+ bias)`` by ring exchange through the buffer.

        x_local: this rank's rows [n / tp, k] (copied into the buffer first), or None when
        the local chunk was filled with :meth:`copy_into_buffer` (then n, k = rows, cols).
        pre_gelu_out [n, m]: GELU epilogue (out = gelu(pre)); with grad=True it is read
        instead: the DGELU epilogue, out = (the GEMM's product) * gelu'(pre_gelu_out), e.g.
        ``(AG(dY) @ weight) * gelu'(pre)`` for TE's fc2 dgrad (NN) with GELU's backward
        fused (no bias then). x_copy [n, k]: receives the
        gathered x. FP8 buffer: x_scale_inv / w_scale_inv (float32 one-element tensors).
        transa=False: weight [k, m] (NN); transb=True (NT): x_local is this rank's [k, n / tp]
        shard, gathered along its columns (x_local required; no x_copy).
        """
        key = ("ag", _sig(weight), _sig(x_local), _sig(out), _sig(bias), _sig(pre_gelu_out), _sig(x_copy),
               _sig(x_scale_inv), _sig(w_scale_inv), accumulate, use_split_accumulator, transa, transb, grad)
        fp8, usa, ta, tb, acc, gr = self._plan(key, lambda: self._check_split_ag(
            weight, x_local, out, bias, pre_gelu_out, x_copy, x_scale_inv, w_scale_inv, accumulate,
            use_split_accumulator, transa, transb, grad))
        ovh = self._handle()
        _contiguous(weight, x_local, out, bias, pre_gelu_out, x_copy)
        hr = handle_cache.raw
        a = hr(weight, w_scale_inv.data_ptr() if fp8 else 0)
        b = hr(self._buffer if x_local is None else x_local, x_scale_inv.data_ptr() if fp8 else 0)
        st = self._c_split_ag(
            ovh, a, ta, b, tb, hr(out), None if bias is None else hr(bias),
            None if pre_gelu_out is None else hr(pre_gelu_out), gr, self._ws_handle(), acc, usa,
            None if x_copy is None else hr(x_copy), raw_stream(self._dev))
        if st:
            raise self._failed(st, "Overlap.split_ag")
        return out

    def _check_split_ag(self, weight, x_local, out, bias, pre_gelu_out, x_copy, x_scale_inv, w_scale_inv, accumulate,
                        use_split_accumulator, transa, transb, grad=False):
        self._check_open()
        if grad and pre_gelu_out is None:
            raise ValueError("CommOverlap.split_overlap_ag: grad=True (DGELU) reads pre_gelu_out: pass it")
        if grad and bias is not None:
            raise ValueError("CommOverlap.split_overlap_ag: grad=True (DGELU) takes no bias (its bias gradient "
                             "reduces over every token: not split into the ring's chunks)")
        _check_cuda("weight", weight, self.device)
        _check_cuda("out", out, self.device)
        if transb and x_local is None:
            raise ValueError(
                "CommOverlap.split_overlap_ag: transb=True needs x_local (this rank's [k, n / tp] shard): "
                "the pre-filled buffer holds x as [n, k] rows"
            )
        if transb and x_copy is not None:
            raise ValueError("CommOverlap.split_overlap_ag: x_copy (the gathered x as [n, k]) needs transb=False")
        if x_local is None:
            n, k = self.shape
            wk = weight.shape[1] if transa else weight.shape[0]
            if out.shape[0] != n or wk != k:
                raise ValueError(
                    f"CommOverlap.split_overlap_ag: with x_local=None the gathered x is the whole buffer "
                    f"{self.shape}: out must have {n} rows and weight {k} columns, got out {tuple(out.shape)}, "
                    f"weight {tuple(weight.shape)}"
                )
        else:
            _check_cuda("x_local", x_local, self.device)
            if x_local.dtype != self.dtype:
                raise TypeError(f"CommOverlap.split_overlap_ag: x_local dtype {x_local.dtype} differs from the buffer's {self.dtype}")
        fp8, usa = self._gemm_inputs("split_overlap_ag", weight, x_local, x_scale_inv, w_scale_inv, use_split_accumulator,
                                     transa, transb)
        self._check_opt(bias, "bias")
        self._check_opt(pre_gelu_out, "pre_gelu_out")
        self._check_opt(x_copy, "x_copy")
        return fp8, usa, bool(transa), bool(transb), bool(accumulate), bool(grad)

    def _ws_handle(self) -> int:
        return handle_cache.raw(self._workspace)

    def _split_rs(self, p2p, weight, x, out, bias, x_scale_inv, w_scale_inv, buffer_scale, buffer_scale_inv,
                  accumulate, use_split_accumulator, transa=True, transb=False):
        what = "split_overlap_rs_p2p" if p2p else "split_overlap_rs"
        key = (what, _sig(weight), _sig(x), _sig(out), _sig(bias), _sig(x_scale_inv), _sig(w_scale_inv),
               _sig(buffer_scale), _sig(buffer_scale_inv), accumulate, use_split_accumulator, transa, transb)
        fp8, usa, ta, tb, acc = self._plan(key, lambda: self._check_split_rs(
            what, weight, x, out, bias, x_scale_inv, w_scale_inv, buffer_scale, buffer_scale_inv, accumulate,
            use_split_accumulator, transa, transb))
        ovh = self._handle()
        _contiguous(weight, x, out, bias)
        hr = handle_cache.raw
        with contextlib.ExitStack() as es:
            if buffer_scale is None:
                d = hr(self._buffer, 0 if buffer_scale_inv is None else buffer_scale_inv.data_ptr())
            else:  # an FP8 buffer written with a scale: a handle of its own (rare)
                d = es.enter_context(self._buffer_tensor(scale=buffer_scale, scale_inv=buffer_scale_inv))._handle
            fn = self._c_split_rs_p2p if p2p else self._c_split_rs
            st = fn(ovh, hr(weight, w_scale_inv.data_ptr() if fp8 else 0), ta, hr(x, x_scale_inv.data_ptr() if fp8 else 0),
                    tb, d, None if bias is None else hr(bias), None, False, self._ws_handle(), acc, usa, hr(out),
                    raw_stream(self._dev))
        if st:
            raise self._failed(st, "Overlap.split_rs_p2p" if p2p else "Overlap.split_rs")
        return out

    def _check_split_rs(self, what, weight, x, out, bias, x_scale_inv, w_scale_inv, buffer_scale, buffer_scale_inv,
                        accumulate, use_split_accumulator, transa, transb):
        self._check_open()
        _check_cuda("x", x, self.device)
        _check_cuda("out", out, self.device)
        fp8, usa = self._gemm_inputs(what, weight, x, x_scale_inv, w_scale_inv, use_split_accumulator, transa, transb)
        if self.is_fp8_ubuf() and (buffer_scale is None or buffer_scale_inv is None):
            raise ValueError(
                f"CommOverlap.{what}: an FP8 buffer holds the partial products quantized: pass "
                "buffer_scale and buffer_scale_inv (float32 one-element tensors, scale_inv = 1/scale)"
            )
        for name, s in (("buffer_scale", buffer_scale), ("buffer_scale_inv", buffer_scale_inv)):
            _scalar_ptr(s, f"CommOverlap.{what}: {name}")
        self._check_opt(bias, "bias")
        return fp8, usa, bool(transa), bool(transb), bool(accumulate)

    def split_overlap_rs(
        self,
        weight: torch.Tensor,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        x_scale_inv: Optional[torch.Tensor] = None,
        w_scale_inv: Optional[torch.Tensor] = None,
        buffer_scale: Optional[torch.Tensor] = None,
        buffer_scale_inv: Optional[torch.Tensor] = None,
        accumulate: bool = False,
        use_split_accumulator: Optional[bool] = None,
        transa: bool = True,
        transb: bool = False,
    ) -> torch.Tensor:
        """``out [n / tp, m] = this rank's rows of sum_ranks(x @ weight.T) (+ bias on every
        rank's partial, TE's convention)``, pipelined: GEMM column chunks into the buffer
        ([n, m]), each reduce-scattered while the next computes. x [n, k_local], weight
        [m, k_local]. FP8 buffer: buffer_scale / buffer_scale_inv (partials quantized).
        transa=False: weight [k_local, m] (NN, e.g. dgrad); transb=True: x [k_local, n] (NT)."""
        return self._split_rs(False, weight, x, out, bias, x_scale_inv, w_scale_inv, buffer_scale,
                              buffer_scale_inv, accumulate, use_split_accumulator, transa, transb)

    def split_overlap_rs_p2p(
        self,
        weight: torch.Tensor,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        x_scale_inv: Optional[torch.Tensor] = None,
        w_scale_inv: Optional[torch.Tensor] = None,
        buffer_scale: Optional[torch.Tensor] = None,
        buffer_scale_inv: Optional[torch.Tensor] = None,
        accumulate: bool = False,
        use_split_accumulator: Optional[bool] = None,
        transa: bool = True,
        transb: bool = False,
    ) -> torch.Tensor:
        """As :meth:`split_overlap_rs`, by ring exchange: step i computes the rows owned by
        rank (r+i+1) % tp and puts them there while the next step computes."""
        return self._split_rs(True, weight, x, out, bias, x_scale_inv, w_scale_inv, buffer_scale,
                              buffer_scale_inv, accumulate, use_split_accumulator, transa, transb)

    def bulk_overlap(
        self,
        comm_type: Union[CommOverlapType, str, int],
        weight: torch.Tensor,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        rs_output: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
        pre_gelu_out: Optional[torch.Tensor] = None,
        x_scale_inv: Optional[torch.Tensor] = None,
        w_scale_inv: Optional[torch.Tensor] = None,
        buffer_scale_inv: Optional[torch.Tensor] = None,
        accumulate: bool = False,
        use_split_accumulator: Optional[bool] = None,
        transa: bool = True,
        transb: bool = False,
    ) -> torch.Tensor:
        """The collective ``comm_type`` on the pre-filled buffer beside the unrelated GEMM
        ``out = x @ weight.T (+ bias)``; with transa=False ``x @ weight`` (NN), with
        transa=False, transb=True ``x.T @ weight`` (NT: the wgrad ``dW = dY.T @ X`` is
        ``bulk_overlap(kind, X, dY, dW, transa=False, transb=True)``, dW [m, k] from X
        [tokens, k] and dY [tokens, m]). ``accumulate=True`` adds to ``out`` (gradient
        accumulation).

        AG ("ag"): every rank's chunk (filled with copy_into_buffer(..., local_chunk=True))
        is gathered into every rank's buffer (read it with get_buffer()). RS ("rs"): the
        buffers (filled whole) are summed, this rank's rows into ``rs_output``
        [rows / tp, cols]; an FP8 buffer needs buffer_scale_inv. Returns ``out``."""
        key = ("bulk", comm_type, _sig(weight), _sig(x), _sig(out), _sig(rs_output), _sig(bias), _sig(pre_gelu_out),
               _sig(x_scale_inv), _sig(w_scale_inv), _sig(buffer_scale_inv), accumulate, use_split_accumulator, transa,
               transb)
        ct, fp8, usa, ta, tb, acc = self._plan(key, lambda: self._check_bulk(
            comm_type, weight, x, out, rs_output, bias, pre_gelu_out, x_scale_inv, w_scale_inv, buffer_scale_inv,
            accumulate, use_split_accumulator, transa, transb))
        ovh = self._handle()
        _contiguous(weight, x, out, rs_output, bias, pre_gelu_out)
        hr = handle_cache.raw
        st = self._c_bulk(
            ovh, ct, hr(weight, w_scale_inv.data_ptr() if fp8 else 0), ta, hr(x, x_scale_inv.data_ptr() if fp8 else 0),
            tb, hr(out), None if bias is None else hr(bias), None if pre_gelu_out is None else hr(pre_gelu_out), False,
            self._ws_handle(), acc, usa, hr(self._buffer, 0 if buffer_scale_inv is None else buffer_scale_inv.data_ptr()),
            None if rs_output is None else hr(rs_output), raw_stream(self._dev))
        if st:
            raise self._failed(st, "Overlap.bulk")
        return out

    def _check_bulk(self, comm_type, weight, x, out, rs_output, bias, pre_gelu_out, x_scale_inv, w_scale_inv,
                    buffer_scale_inv, accumulate, use_split_accumulator, transa, transb):
        self._check_open()
        if isinstance(comm_type, str):
            key = comm_type.upper()
            if key not in CommOverlapType.__members__:
                raise ValueError(f"CommOverlap.bulk_overlap: comm_type must be 'ag' or 'rs', got {comm_type!r}")
            ct = CommOverlapType[key]
        else:
            ct = CommOverlapType(int(comm_type))
        _check_cuda("x", x, self.device)
        _check_cuda("out", out, self.device)
        fp8, usa = self._gemm_inputs("bulk_overlap", weight, x, x_scale_inv, w_scale_inv, use_split_accumulator, transa,
                                     transb)
        if ct == CommOverlapType.RS:
            if rs_output is None:
                raise ValueError("CommOverlap.bulk_overlap: a reduce-scatter needs rs_output [rows / tp, cols]")
            if self.is_fp8_ubuf() and buffer_scale_inv is None:
                raise ValueError("CommOverlap.bulk_overlap: an FP8 buffer's reduce-scatter needs buffer_scale_inv")
        elif rs_output is not None:
            raise ValueError("CommOverlap.bulk_overlap: rs_output is for comm_type RS only")
        _scalar_ptr(buffer_scale_inv, "CommOverlap.bulk_overlap: buffer_scale_inv")
        self._check_opt(bias, "bias")
        self._check_opt(pre_gelu_out, "pre_gelu_out")
        self._check_opt(rs_output, "rs_output")
        return int(ct), fp8, usa, bool(transa), bool(transb), bool(accumulate)

    # ------------------------------------------------------------------ lifetime

    def synchronize(self) -> None:
        """Host-wait until the object's last call finished on the GPU (raises CommError,
        naming rank, peer and step, when a wait for a peer timed out)."""
        self._check_open()
        self._ov.synchronize()

    def close(self) -> None:
        """Destroy the object (waits, bounded, until the peers are done with this rank's
        buffer). Views from get_buffer() must not be used afterwards. Idempotent. Raises
        CommError, the object left open, while a CUDA-graph capture holding its calls is
        still open (the graph being captured uses its memory)."""
        ov = self._ov
        if ov is None:
            return
        # The library object first: a refused destroy (a capture holding this object's
        # calls still open) raises and leaves this object open.
        ov.close()
        self._ov = None
        self._ovh = None
        self._plans.clear()
        with _live_lock:
            _live.discard(self)
        self._buffer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._ov is None else f"tp {self.tp_size} rank {self.tp_rank}"
        return f"CommOverlap(shape={self.shape}, dtype={self.dtype}, {state})"
