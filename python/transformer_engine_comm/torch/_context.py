"""Process groups, NCCL communicators and cached comm-GEMM contexts for the torch layer.

- :func:`process_group_nccl_comm` returns the raw ``ncclComm_t`` of a ProcessGroupNCCL
  (torch creates it lazily: a tiny collective on the group forces it into existence).
- :func:`get_context` returns a ``_capi.GemmCtx`` cached per (group name, communicator kind,
  transport): ``comm="pg"`` runs the context over the process group's own communicator,
  ``comm="own"`` over a communicator this package creates for the group (rank 0 of the
  group draws an NCCL unique id, the group broadcasts it, every rank joins).
- :func:`destroy_contexts` destroys them (and the package's own communicators). It runs
  at interpreter exit too; call it yourself before ``dist.destroy_process_group()``.
- Helpers shared by ops.py and userbuffers.py: torch dtype -> NVTEDType, torch tensor ->
  ``_capi.Tensor``; block distribution (:func:`numroc`), transport names, dtype rules and
  the context key come from the framework-neutral core (``transformer_engine_comm._core``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _capi, _core

__all__ = [
    "COMM_KINDS",
    "TRANSPORTS",
    "destroy_contexts",
    "get_context",
    "group_name_of",
    "nvte_dtype",
    "nvte_tensor",
    "numroc",
    "process_group_nccl_comm",
    "resolve_group",
    "torch_dtype",
]

COMM_KINDS = _core.COMM_KINDS
TRANSPORTS = _core.TRANSPORTS

# torch's dtypes by the core's names, for its dtype rules; NVTEDType by torch dtype.
DTYPES = _core.Dtypes({n: getattr(torch, n) for n in _core.NVTE_DTYPES if hasattr(torch, n)})
FP8_DTYPES = DTYPES.fp8
NVTE_DTYPES = {DTYPES.of(n): d for n, d in _core.NVTE_DTYPES.items() if n in DTYPES.by_name}


# ----------------------------------------------------------------------------- helpers

numroc = _core.numroc
block_offset = _core.block_offset


# The raw handle (an int) of torch's current stream on a device: torch's own cheap getter
# (no Stream object), or the Stream object's handle on a torch without it.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
if raw_stream is None:  # older torch

    def raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def nvte_dtype(dtype: torch.dtype):
    """The ``_capi.DType`` of a torch dtype (TypeError for dtypes the library lacks)."""
    d = NVTE_DTYPES.get(dtype)
    if d is None:
        raise TypeError(f"torch dtype {dtype} has no NVTEDType equivalent")
    return d


def torch_dtype(dtype, what: str = "dtype"):
    """A dtype argument as a torch.dtype: a torch.dtype (or None) as is, else a name
    ("bf16", "e4m3", "float32", ...; the core's aliases) or a numpy / JAX dtype mapped
    onto torch's (TypeError naming ``what`` and the dtype otherwise)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return DTYPES.of(_core.dtype_name(dtype, what))


def no_default_group_message(what: str) -> str:
    """The error for ``group=None`` while torch.distributed has no default process group."""
    return (
        f"{what}: no process group: group=None means the default (world) process group, but "
        "torch.distributed is not initialised. Pass group=<a torch.distributed ProcessGroup>, or call "
        "torch.distributed.init_process_group('nccl', ...) first (launched by torchrun; for a single "
        "process, tp 1: init_process_group('nccl', init_method='tcp://127.0.0.1:29500', rank=0, "
        "world_size=1))"
    )


def check_group_arg(group, what: str):
    """``group`` as the ops take it (None = world, a ProcessGroup or a group name): the
    ProcessGroup for None, ``group`` otherwise. RuntimeError saying what is missing when
    group is None without a default process group; TypeError for another kind of value."""
    if group is None:
        pg = dist.group.WORLD if dist.is_available() else None
        if pg is None:
            raise RuntimeError(no_default_group_message(what))
        return pg
    if isinstance(group, (bool, int, float, bytes, tuple, list, dict)):
        raise TypeError(f"{what}: group must be a torch.distributed ProcessGroup, a group name (str) or None "
                        f"(the default group), got {group!r}")
    return group


def set_packed_operand(o, t: Optional[torch.Tensor], shape, dtype: torch.dtype, scale_inv=None) -> None:
    """Fill a packed call's operand (``_capi.GemmOperand``) once per call signature: dtype,
    shape, and the data / scale_inv pointers of ``t`` / ``scale_inv`` (None: NULL; the
    prepared calls set the pointers per call)."""
    o.dtype = int(nvte_dtype(dtype))
    o.ndim = len(shape)
    for i, d in enumerate(shape):
        o.shape[i] = int(d)
    o.data = None if t is None else (t.data_ptr() or None)
    o.scale_inv = None if scale_inv is None else scale_inv.data_ptr()


def _scalar_ptr(t: Optional[torch.Tensor], what: str) -> int:
    if t is None:
        return 0
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1 or t.device.type != "cuda":
        raise ValueError(
            f"{what} must be a CUDA float32 tensor with one element, got {t.dtype} "
            f"shape {tuple(t.shape)} on {t.device}"
        )
    return t.data_ptr()


def nvte_tensor(
    t: torch.Tensor,
    *,
    scale_inv: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    amax: Optional[torch.Tensor] = None,
    shape: Optional[Tuple[int, ...]] = None,
    dtype: Optional[torch.dtype] = None,
):
    """A ``_capi.Tensor`` handle over a contiguous CUDA tensor (the caller keeps ``t``
    alive while the handle is used; close the handle, or use it as a context manager)."""
    if not t.is_contiguous():
        raise ValueError("internal: nvte_tensor needs a contiguous tensor")
    return _capi.Tensor(
        t.data_ptr(),
        nvte_dtype(dtype if dtype is not None else t.dtype),
        tuple(int(s) for s in (shape if shape is not None else t.shape)),
        scale_inv=_scalar_ptr(scale_inv, "scale_inv"),
        scale=_scalar_ptr(scale, "scale"),
        amax=_scalar_ptr(amax, "amax"),
    )


class _HandleCache:
    """NVTETensor handles by their full description (pointer, dtype, shape, scale pointers),
    reused across calls: a handle only describes memory (the library copies that description
    when a call starts), so two tensors with the same description can share one, and the
    per-call cost of creating and destroying handles (~16 us each through ctypes) goes away.
    Bounded (least recently used handles are destroyed); thread-safe (autograd's thread).
    One cache serves the ops, userbuffers, torch.gemm and the FP8 backend (`described`)."""

    def __init__(self, capacity: int = 1024):
        import collections

        self._lock = threading.Lock()
        self._map = collections.OrderedDict()
        self._capacity = capacity

    def _lookup(self, key) -> "Optional[_capi.Tensor]":
        with self._lock:
            h = self._map.get(key)
            if h is not None:
                self._map.move_to_end(key)
            return h

    def get(self, t: torch.Tensor, scale_inv: Optional[torch.Tensor] = None) -> "_capi.Tensor":
        if not t.is_contiguous():
            raise ValueError("internal: nvte_tensor needs a contiguous tensor")
        key = (t.data_ptr(), t.dtype, t.shape, _scalar_ptr(scale_inv, "scale_inv"))
        h = self._lookup(key)
        return h if h is not None else self._add(key, self._new(key, t))

    def raw(self, t: torch.Tensor, scale_inv_ptr: int = 0) -> int:
        """The handle of ``t`` as an int (what the C functions take), with 1/scale at
        ``scale_inv_ptr`` (0: none). The caller has checked that ``t`` is contiguous and
        that the scale_inv tensor is a CUDA float32 scalar (the hot path of the prepared
        calls: one dictionary look-up)."""
        key = (t.data_ptr(), t.dtype, t.shape, scale_inv_ptr)
        h = self._lookup(key)
        return (h if h is not None else self._add(key, self._new(key, t)))._handle

    def described(self, key) -> int:
        """The handle (an int) of a description ``((ptr, nvte dtype, shape), (param, (ptr,
        nvte dtype, shape)), ...)``: the rowwise data, then further tensor parameters (those
        with a NULL pointer are left unset), e.g. an FP8 cast's columnwise data, scale, amax
        and scale_inv."""
        h = self._lookup(key)
        if h is None:
            (ptr, dt, shape), extras = key[0], key[1:]
            h = _capi.Tensor(ptr, dt, shape)
            try:
                for param, (p, pdt, pshape) in extras:
                    if p:
                        h.set_param(param, p, pdt, pshape)
            except BaseException:
                h.close()
                raise
            h = self._add(key, h)
        return h._handle

    @staticmethod
    def _new(key, t: torch.Tensor) -> "_capi.Tensor":
        return _capi.Tensor(key[0], nvte_dtype(t.dtype), tuple(int(s) for s in key[2]), scale_inv=key[3])

    def _add(self, key, h: "_capi.Tensor") -> "_capi.Tensor":
        with self._lock:
            old = self._map.get(key)
            if old is not None:  # another thread added it meanwhile
                h.close()
                return old
            self._map[key] = h
            while len(self._map) > self._capacity:
                self._map.popitem(last=False)[1].close()
        return h

    def clear(self) -> None:
        with self._lock:
            while self._map:
                self._map.popitem(last=False)[1].close()


handle_cache = _HandleCache()


def resolve_group(group=None):
    """``group`` itself, the default (world) group for None, or the group registered
    under a name (str)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is None:
            raise RuntimeError(no_default_group_message("transformer_engine_comm.torch"))
        raise RuntimeError(
            "transformer_engine_comm.torch needs an initialized torch.distributed process "
            "group (dist.init_process_group('nccl', ...))"
        )
    if group is None:
        return dist.group.WORLD
    check_group_arg(group, "transformer_engine_comm.torch")
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group


def group_name_of(group=None) -> str:
    """The name custom ops use for ``group`` (None = world)."""
    if group is None:
        return check_group_arg(None, "transformer_engine_comm.torch").group_name
    if isinstance(group, str):
        return group
    return group.group_name


def _current_device() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("transformer_engine_comm.torch needs CUDA (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def _nccl_backend(pg, name: str):
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError as e:
        raise RuntimeError(
            f"process group {name!r} has no NCCL backend for CUDA tensors "
            f"(backend {pg._get_backend_name() if hasattr(pg, '_get_backend_name') else '?'}): {e}"
        ) from None
    if not hasattr(backend, "_comm_ptr"):
        raise RuntimeError(
            f"process group {name!r}: its CUDA backend {type(backend).__name__} does not expose "
            "the NCCL communicator (_comm_ptr); use comm='own' or a ProcessGroupNCCL"
        )
    return backend


def process_group_nccl_comm(group=None) -> int:
    """The ``ncclComm_t`` (as int) of ``group``'s ProcessGroupNCCL on the current device.

    ProcessGroupNCCL::getCommPtr() looks the communicator up by the *current* CUDA device
    and returns 0 while none exists (torch creates communicators lazily, at the first
    collective, unless init_process_group got ``device_id``). In that case a one-element
    all-reduce on the group creates it. Collective when it has to initialise: every rank
    of the group must call it.
    """
    pg = resolve_group(group)
    name = pg.group_name
    dev = _current_device()
    bound = getattr(pg, "bound_device_id", None)
    if bound is not None and bound.index is not None and bound.index != dev.index:
        raise RuntimeError(
            f"process group {name!r} is bound to {bound} but the current CUDA device is {dev}: "
            "call torch.cuda.set_device() with the group's device first"
        )
    backend = _nccl_backend(pg, name)
    ptr = int(backend._comm_ptr())
    if ptr == 0:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"process group {name!r} has no NCCL communicator yet and one cannot be created "
                "during CUDA graph capture: run the op once eagerly (warm-up) before capturing"
            )
        t = torch.zeros(1, device=dev)
        dist.all_reduce(t, group=pg)
        torch.cuda.synchronize(dev)
        ptr = int(backend._comm_ptr())
    if ptr == 0:
        raise RuntimeError(
            f"process group {name!r}: no NCCL communicator on {dev} after a collective on it "
            "(is this the device the group uses on this rank?)"
        )
    return ptr


@contextlib.contextmanager
def _env(name: str, value: Optional[str]):
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ----------------------------------------------------------------------------- contexts


@dataclass
class _Entry:
    ctx: object  # _capi.GemmCtx
    group_name: str
    comm_kind: str
    transport: str
    size: int
    rank: int
    device: int
    own_comm: int = 0  # ncclComm_t this package created (comm="own"), else 0
    effective_transport: str = "auto"  # what the library was told: "auto", "ipc" or "nccl"


_lock = threading.RLock()
_contexts: Dict[Tuple[str, str, str], _Entry] = {}


def _check_kind(comm: str, transport: Optional[str]) -> str:
    """Validate; the transport key: "" (None: the environment decides) or a TRANSPORTS value."""
    return _core.context_key("", comm, transport)[2]


def _own_comm(pg, dev: torch.device) -> int:
    """A new NCCL communicator over ``pg``'s ranks (collective over the group)."""
    size, rank = pg.size(), pg.rank()
    uid = _capi.nccl_get_unique_id() if rank == 0 else bytes(128)
    if len(uid) != 128:
        raise RuntimeError(f"nccl_get_unique_id returned {len(uid)} bytes, expected 128")
    buf = torch.tensor(list(uid), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=dist.get_global_rank(pg, 0), group=pg)
    uid = bytes(buf.cpu().tolist())
    return int(_capi.nccl_comm_init_rank(uid, size, rank))


def get_context(group=None, comm: str = "pg", transport: Optional[str] = None):
    """The ``_capi.GemmCtx`` of ``group`` (None = world), created on first use and cached
    per (group name, ``comm``, ``transport``).

    comm: "pg" = the ProcessGroupNCCL's own communicator; "own" = a communicator created
    by this package for the group (destroyed with the context).
    transport: None (the library's choice: $NVTE_COMM_TRANSPORT, else auto), "auto" (IPC
    when the group is on one node, else NCCL), "ipc" or "nccl": the transport of the
    context's engines (read by the library when the context is created).

    Creation is collective over the group (every rank must call it, in the same order
    relative to other collectives), and must not happen during CUDA graph capture.
    """
    _check_kind(comm, transport)  # before the group: a bad argument fails without one
    pg = resolve_group(group)
    name = pg.group_name
    key = _core.context_key(name, comm, transport)
    t = key[2]
    with _lock:
        e = _contexts.get(key)
        if e is not None:
            return e.ctx
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"te_comm: the comm-GEMM context of group {name!r} (comm={comm!r}, transport={t or None!r}) "
                "does not exist yet and cannot be created during CUDA graph capture: call the op "
                "once eagerly with the same sizes (warm-up) before capturing"
            )
        dev = _current_device()
        size, rank = pg.size(), pg.rank()
        own = 0
        if comm == "pg":
            ptr = process_group_nccl_comm(pg)
        else:
            own = _own_comm(pg, dev)
            ptr = own
        try:
            with _env(_core.TRANSPORT_ENV, t or None):
                ctx = _capi.GemmCtx(ptr, size, rank)
        except BaseException:
            if own:
                _capi.nccl_comm_destroy(own)
            raise
        eff = _core.effective_transport(t)
        _contexts[key] = _Entry(ctx, name, comm, t, size, rank, dev.index, own, eff)
        return ctx


def _entry_of(ctx) -> Optional[_Entry]:
    with _lock:
        for e in _contexts.values():
            if e.ctx is ctx:
                return e
    return None


def context_device(ctx) -> Optional[int]:
    """The CUDA device index a cached context was created on (None if not cached here)."""
    e = _entry_of(ctx)
    return None if e is None else e.device


def context_transport(ctx) -> Optional[str]:
    """The transport a cached context's engines were created with: "nccl", "ipc", or "auto"
    (IPC when the group is on one node) -- None if the context is not cached here."""
    e = _entry_of(ctx)
    return None if e is None else e.effective_transport


def destroy_contexts(group=None) -> None:
    """Destroy the cached contexts (of ``group`` only, when given) and the communicators
    this package created for them. Call before ``dist.destroy_process_group()``; runs at
    interpreter exit for whatever is left. Work queued on them must be complete or at
    least enqueued (the device is synchronized first)."""
    for fn in list(_destroy_hooks):
        fn()
    with _lock:
        if group is None:
            keys = list(_contexts)
        else:
            name = group_name_of(group)
            keys = [k for k in _contexts if k[0] == name]
        entries = [_contexts.pop(k) for k in keys]
    if not entries:
        return
    errors = []
    try:
        if torch.cuda.is_available():
            for d in sorted({e.device for e in entries}):
                torch.cuda.synchronize(d)
    except Exception as ex:  # a broken device must not keep the handles alive
        errors.append(ex)
    for e in entries:
        try:
            e.ctx.close()
        except Exception as ex:
            errors.append(ex)
        if e.own_comm:
            try:
                _capi.nccl_comm_destroy(e.own_comm)
            except Exception as ex:
                errors.append(ex)
    if errors:
        raise errors[0]


def cached_contexts():
    """(group name, comm kind, transport) of every cached context (diagnostics, tests)."""
    with _lock:
        return sorted(_contexts)


_exit_hooks = []
_destroy_hooks = []


def register_destroy_hook(fn) -> None:
    """Run ``fn()`` whenever contexts are destroyed (ops.py drops its prepared calls, which
    hold contexts)."""
    _destroy_hooks.append(fn)


def register_exit_hook(fn) -> None:
    """Run ``fn()`` at exit before the contexts are destroyed (userbuffers objects)."""
    _exit_hooks.append(fn)


def _at_exit() -> None:
    for fn in reversed(_exit_hooks):
        try:
            fn()
        except Exception:
            pass
    try:
        destroy_contexts()
    except Exception:
        pass
    handle_cache.clear()


# Registered after torch's own atexit handlers (torch is imported above), so it runs
# before them: contexts go before the process groups they were built on.
atexit.register(_at_exit)
