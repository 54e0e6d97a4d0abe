"""TP contexts for JAX: one library context per TP group and local device, bound to a
key that the ops pass to the XLA handlers as attribute ``context``.

The handlers find the context of a call by (key, the call's device ordinal), so one SPMD
program (``shard_map`` over the mesh) drives every local device's context. The contexts'
setup exchanges go through JAX's key-value store (groups that span processes, one member
per process) or through shared memory (groups whose members are all devices of this
process: single-process multi-GPU). No NCCL communicator and no file is involved: the
transport inside a node is CUDA IPC (or direct peer pointers between devices of one
process).
"""
from __future__ import annotations

import atexit
import itertools
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from .. import _capi
from ._bootstrap import KVExchange, LocalExchange

_keys = itertools.count(1)
_live: Dict[int, "TPContext"] = {}
_lock = threading.Lock()


class TPContext:
    """The contexts of one TP layout on this process's devices.

    ``axis`` names the mesh axis of the TP groups (the ``axis_name`` of ``shard_map``),
    ``size`` is the TP size, and ``ranks`` maps each local device id to its rank in its
    group. Use it with the ops / layers of :mod:`transformer_engine_comm.jax`; close it
    (or let the process exit) when done. Creating one is not collective; the first
    execution of each operation is (every group member must run it)."""

    def __init__(self, key: int, axis: str, size: int):
        self.key = key
        self.axis = axis
        self.size = size
        self.ranks: Dict[int, int] = {}  # jax device id -> TP rank
        self._ordinals: List[int] = []
        self._ctxs: List[_capi.GemmCtx] = []
        self._exchanges = []
        self.closed = False

    @property
    def rank(self) -> int:
        """This process's TP rank when it has one device in the layout (multi-process)."""
        ranks = set(self.ranks.values())
        if len(ranks) != 1:
            raise ValueError(
                f"this process has {len(self.ranks)} devices in the TP layout, with ranks {sorted(ranks)}: "
                "no single rank (inside shard_map every device uses its own)"
            )
        return ranks.pop()

    def _add(self, device, rank: int, allgather, barrier) -> None:
        hw = getattr(device, "local_hardware_id", None)
        ordinal = int(hw) if hw is not None else int(device.id)
        ctx = _capi.GemmCtx.from_callbacks(rank, self.size, allgather, barrier)
        _capi.check(_capi.lib().nvte_comm_xla_bind(self.key, ordinal, ctx.handle), "nvte_comm_xla_bind")
        self._ctxs.append(ctx)
        self._ordinals.append(ordinal)
        self.ranks[device.id] = rank

    def check_mesh(self, mesh) -> None:
        """ValueError unless ``mesh`` (the one ``shard_map`` runs over) places this
        process's devices of the layout at the TP ranks of their contexts, along
        ``self.axis`` and with ``self.size`` devices on it. ``shard_map`` hands each device
        the shard of its place on the mesh, while the library's context on that device
        gathers and scatters as the rank it was created with: a mesh that orders the
        devices differently from the one given to :func:`tp_context` would put every
        shard at another rank's rows, silently."""
        names = list(mesh.axis_names)
        if self.axis not in names:
            raise ValueError(f"mesh has axes {names}, not this context's TP axis {self.axis!r}")
        n = mesh.shape[self.axis]
        if n != self.size:
            raise ValueError(f"mesh axis {self.axis!r} has {n} devices, this context's TP size is {self.size}")
        wrong = []
        for _, members in _groups(mesh, self.axis):
            for r, d in enumerate(members):
                mine = self.ranks.get(d.id)
                if mine is not None and mine != r:
                    wrong.append(f"device {d.id}: rank {r} on the mesh, {mine} in the context")
        if wrong:
            raise ValueError(
                f"the mesh orders the devices along {self.axis!r} differently from the mesh this TP context was "
                f"made for ({'; '.join(wrong)}): use the same mesh for tp_context and shard_map"
            )

    def callback_errors(self) -> list:
        """Exceptions raised by the setup exchanges (e.g. a timeout naming missing ranks)."""
        return [e for c in self._ctxs for e in c.callback_errors]

    def close(self) -> None:
        """Unbind and destroy the contexts (waits, bounded, for peers using the buffers).
        Executables that use this context fail afterwards with a clear error."""
        if self.closed:
            return
        self.closed = True
        lib = _capi.lib()
        for o in set(self._ordinals):
            lib.nvte_comm_xla_unbind(self.key, o)
        if len(self._ordinals) == 1:
            lib.nvte_comm_xla_unbind(self.key, -1)
        for c in self._ctxs:
            c.close()
        self._ctxs.clear()
        with _lock:
            _live.pop(self.key, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"TPContext(key={self.key}, axis={self.axis!r}, size={self.size}, ranks={self.ranks})"


def _groups(mesh, axis: str) -> List[Tuple[Tuple[int, ...], list]]:
    """(coordinates on the other axes, devices along ``axis`` in rank order) of each group."""
    import numpy as np

    names = list(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"mesh has axes {names}, not {axis!r}")
    ax = names.index(axis)
    devs = np.moveaxis(np.asarray(mesh.devices), ax, -1)
    other = devs.shape[:-1]
    out = []
    for idx in np.ndindex(*other) if other else [()]:
        out.append((tuple(int(i) for i in idx), list(devs[idx])))
    return out


def tp_context(mesh=None, axis: str = "tp", *, timeout_ms: Optional[int] = None) -> TPContext:
    """Contexts for the TP groups along ``axis`` of ``mesh`` (a ``jax.sharding.Mesh``;
    default: all devices in one group named ``axis``) on this process's devices.

    Every process must create its TP contexts in the same order (the key is a counter).
    A group is either entirely on this process (its devices exchange in memory) or has
    exactly one device on each of its processes (exchange through JAX's key-value store,
    after ``jax.distributed.initialize``)."""
    import jax

    if mesh is None:
        import numpy as np
        from jax.sharding import Mesh

        mesh = Mesh(np.array(jax.devices()), (axis,))
    me = jax.process_index()
    groups = _groups(mesh, axis)
    size = len(groups[0][1])
    key = next(_keys)
    tc = TPContext(key, axis, size)
    try:
        for coords, members in groups:
            local = [r for r, d in enumerate(members) if d.process_index == me]
            if not local:
                continue
            procs = [d.process_index for d in members]
            name = f"te_comm/jax/{key}/{axis}/{'-'.join(map(str, coords)) or 'all'}"
            if len(local) == len(members):
                ex = LocalExchange(name, size, timeout_ms=timeout_ms)
                tc._exchanges.append(ex)
                for r in local:
                    tc._add(members[r], r, *ex.member(r))
            elif len(local) == 1 and len(set(procs)) == len(procs):
                r = local[0]
                ex = KVExchange(name, r, size, timeout_ms=timeout_ms)
                tc._exchanges.append(ex)
                tc._add(members[r], r, ex.allgather, ex.barrier)
            else:
                raise ValueError(
                    f"TP group {coords} along {axis!r} has devices {[d.id for d in members]} on processes "
                    f"{procs}: a group must be all on one process or have one device per process"
                )
        if len(tc._ordinals) == 1 and jax.local_device_count() == 1:
            # The process's one device: its context also serves a call whose ordinal XLA
            # reports differently (e.g. CUDA_VISIBLE_DEVICES remapping). Not where the
            # process drives several devices: there a call from another device must not
            # reach this device's context and memory.
            _capi.check(_capi.lib().nvte_comm_xla_bind(key, -1, tc._ctxs[0].handle), "nvte_comm_xla_bind")
    except BaseException:
        tc.close()
        raise
    with _lock:
        _live[key] = tc
    return tc


def live_contexts() -> Sequence[TPContext]:
    with _lock:
        return list(_live.values())


def close_all() -> None:
    for tc in live_contexts():
        try:
            tc.close()
        except Exception:  # noqa: BLE001 - at exit
            pass


atexit.register(close_all)
