"""JAX integration of transformer_engine_comm: XLA FFI custom calls that overlap the
tensor-parallel all-gather / reduce-scatter / all-reduce with the GEMM.

- :func:`tp_context`: the library contexts of the TP groups along a mesh axis on this
  process's devices (setup through JAX's key-value store or in memory; no files, no
  NCCL communicator).
- Ops (per device, inside ``shard_map`` or on a process's local arrays):
  :func:`all_gather_gemm`, :func:`gemm_reduce_scatter`, :func:`gemm_all_reduce`
  (bf16 / fp16 / FP8 with scales; bias; GELU).
- Layers with gradients: :func:`column_parallel_dense`, :func:`row_parallel_dense`,
  :func:`mlp` (``transformer_engine_comm.jax.layers``), bf16 or FP8 in forward and
  backward with TE's recipes (:class:`DelayedScaling` with its functional state
  :class:`FP8Meta`, :class:`Float8CurrentScaling` -- also named :class:`CurrentScaling`;
  :class:`Float8BlockScaling`, block FP8 numerics in jnp at tp 1;
  the classes of :mod:`transformer_engine_comm.recipe`, shared with the torch side;
  ``transformer_engine_comm.jax.fp8``).

Handlers are registered with XLA (platform CUDA) on first use, or by :func:`register`.
"""
from ._bootstrap import ExchangeTimeout, KVExchange, LocalExchange
from ._context import TPContext, close_all, live_contexts, tp_context
from .fp8 import (
    CurrentScaling,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    FP8Meta,
    Format,
    amax_and_scale_update,
    fp8_meta_init,
    fp8_meta_update,
)
from .layers import column_parallel_dense, mlp, row_parallel_dense, tp_shard_map
from .ops import (
    TARGETS,
    ag_gemm,
    all_gather_gemm,
    ffi_gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
    numroc,
    register,
    rs_gemm,
)

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "FP8Meta",
    "Format",
    "amax_and_scale_update",
    "fp8_meta_init",
    "fp8_meta_update",
    "ExchangeTimeout",
    "KVExchange",
    "LocalExchange",
    "TARGETS",
    "TPContext",
    "ag_gemm",
    "all_gather_gemm",
    "close_all",
    "column_parallel_dense",
    "ffi_gemm",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "live_contexts",
    "mlp",
    "numroc",
    "register",
    "row_parallel_dense",
    "rs_gemm",
    "tp_context",
    "tp_shard_map",
]
