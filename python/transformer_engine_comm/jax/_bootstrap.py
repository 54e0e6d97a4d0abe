"""Setup exchanges (allgather, barrier) for the contexts of a TP group, without files.

- :class:`KVExchange`: one group member per process; the bytes go through JAX's
  distributed key-value store (the coordinator that ``jax.distributed.initialize`` set up).
- :class:`LocalExchange`: all members are devices of this process (single-process
  multi-GPU JAX); the members' calls meet in shared memory.

Both are called by the library from whichever thread runs a context's first call of an
operation (XLA's initialize stage), so they are thread-safe and bounded: a member that
never arrives makes the call fail with the group and the missing ranks named, after
``timeout_ms`` (default: ``NVTE_COMM_TIMEOUT_MS``, else 60 s), never hang.
"""
from __future__ import annotations

import base64
import os
import threading
from typing import List, Optional


def default_timeout_ms() -> int:
    v = os.environ.get("NVTE_COMM_TIMEOUT_MS", "").strip()
    if not v:
        return 60_000
    try:
        ms = int(v)
    except ValueError:
        raise ValueError(f"NVTE_COMM_TIMEOUT_MS={v!r} is not an integer number of milliseconds") from None
    if ms <= 0:
        raise ValueError(f"NVTE_COMM_TIMEOUT_MS={v!r} must be > 0")
    return ms


class ExchangeTimeout(TimeoutError):
    pass


def kv_client():
    """JAX's distributed runtime client, or None when ``jax.distributed.initialize`` was
    not called (single process)."""
    from jax._src import distributed

    return distributed.global_state.client


class KVExchange:
    """Allgather among ``size`` processes (this one is ``rank``) through a key-value store
    with ``set(key, bytes)`` and ``get(key, timeout_ms) -> bytes`` (JAX's by default).
    Keys are ``{prefix}/{seq}/{rank}``; each exchange has its own ``seq``, so an exchange
    never reads an earlier one's value. ``prefix`` must be the same on every member and
    unique per group."""

    def __init__(self, prefix: str, rank: int, size: int, *, client=None, timeout_ms: Optional[int] = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        self.prefix, self.rank, self.size = prefix, int(rank), int(size)
        self.timeout_ms = int(timeout_ms) if timeout_ms is not None else default_timeout_ms()
        self._client = client if client is not None else kv_client()
        if self._client is None:
            raise RuntimeError(
                "the TP group spans processes but jax.distributed.initialize() was not called: "
                "JAX's key-value store carries the setup exchange"
            )
        self._seq = 0
        self._lock = threading.Lock()

    def _set(self, key: str, value: bytes) -> None:
        c = self._client
        if hasattr(c, "key_value_set_bytes"):
            c.key_value_set_bytes(key, value)
        else:
            c.key_value_set(key, base64.b64encode(value).decode("ascii"))

    def _get(self, key: str, timeout_ms: int) -> bytes:
        c = self._client
        if hasattr(c, "blocking_key_value_get_bytes"):
            return bytes(c.blocking_key_value_get_bytes(key, timeout_ms))
        return base64.b64decode(c.blocking_key_value_get(key, timeout_ms))

    def allgather(self, local: bytes) -> bytes:
        import time

        with self._lock:
            seq = self._seq
            self._seq += 1
        base = f"{self.prefix}/{seq}"
        self._set(f"{base}/{self.rank}", bytes(local))
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        out: List[bytes] = []
        missing = []
        for r in range(self.size):
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                v = self._get(f"{base}/{r}", left)
            except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by version
                missing.append(r)
                err = e
                continue
            if len(v) != len(local):
                raise ValueError(
                    f"{self.prefix}: rank {r} sent {len(v)} bytes in exchange {seq}, this rank {len(local)}: "
                    "the group's members are out of step (different calls?)"
                )
            out.append(v)
        if seq > 0 and hasattr(self._client, "key_value_delete"):
            # Every rank wrote this exchange's key, so every rank has read the previous
            # one: this rank's earlier key can go (the store does not grow with exchanges).
            try:
                self._client.key_value_delete(f"{self.prefix}/{seq - 1}/{self.rank}")
            except Exception:  # noqa: BLE001 - only housekeeping
                pass
        if missing:
            raise ExchangeTimeout(
                f"{self.prefix}: exchange {seq} timed out after {self.timeout_ms} ms waiting for rank(s) "
                f"{missing} of {self.size} (this is rank {self.rank}): {err}"
            )
        return b"".join(out)

    def barrier(self) -> None:
        self.allgather(b"\x01")


class LocalExchange:
    """Allgather among ``size`` members that are threads of this process: each member
    calls :meth:`member` ``(rank)`` to get its own callables."""

    def __init__(self, name: str, size: int, *, timeout_ms: Optional[int] = None):
        self.name, self.size = name, int(size)
        self.timeout_ms = int(timeout_ms) if timeout_ms is not None else default_timeout_ms()
        self._cond = threading.Condition()
        self._rounds = {}  # seq -> {rank: bytes}
        self._reads = {}  # seq -> ranks that have read the round
        self._seq = [0] * self.size

    def _allgather(self, rank: int, local: bytes) -> bytes:
        with self._cond:
            seq = self._seq[rank]
            self._seq[rank] += 1
            got = self._rounds.setdefault(seq, {})
            got[rank] = bytes(local)
            self._cond.notify_all()
            ok = self._cond.wait_for(lambda: len(self._rounds[seq]) == self.size, self.timeout_ms / 1000.0)
            if not ok:
                missing = sorted(set(range(self.size)) - set(got))
                raise ExchangeTimeout(
                    f"{self.name}: exchange {seq} timed out after {self.timeout_ms} ms waiting for "
                    f"member(s) {missing} of {self.size} (this is member {rank})"
                )
            vals = [got[r] for r in range(self.size)]
            reads = self._reads.setdefault(seq, set())
            reads.add(rank)
            if len(reads) == self.size:  # the last member to read drops the round
                del self._rounds[seq], self._reads[seq]
            if any(len(v) != len(local) for v in vals):
                raise ValueError(f"{self.name}: members sent different sizes in exchange {seq}")
            return b"".join(vals)

    def member(self, rank: int):
        if not 0 <= rank < self.size:
            raise ValueError(f"member {rank} is not in [0, {self.size})")

        def allgather(local: bytes) -> bytes:
            return self._allgather(rank, local)

        def barrier() -> None:
            self._allgather(rank, b"\x01")

        return allgather, barrier

