"""Tensor-parallel dense layers with communication hidden behind the GEMMs, for use
inside ``shard_map`` over the TP axis (``ctx.axis``), with gradients (``jax.custom_vjp``):

================================  =================================  ==================================
layer (sequence parallel)         forward                            backward
================================  =================================  ==================================
:func:`column_parallel_dense`     y = AG(x) @ w.T  (all_gather_gemm,  dx = RS(dy @ w) (gemm_reduce_scatter);
                                  keeps AG(x) for the wgrad)         dw = dy.T @ AG(x)
:func:`row_parallel_dense`        y = RS(x @ w.T)                    dx = AG(dy) @ w (all_gather_gemm,
                                  (gemm_reduce_scatter)              keeps AG(dy)); dw = AG(dy).T @ x
================================  =================================  ==================================

Without sequence parallelism the column layer's input is replicated (a plain local GEMM:
``shard_map`` sums the input gradient over the axis) and the row layer all-reduces
(gemm_all_reduce; dx = dy @ w locally).

Shardings (``P`` = ``jax.sharding.PartitionSpec``, ``tp`` = ``ctx.axis``): column: x
``P(tp, None)`` (sequence parallel) or ``P()``, w ``P(tp, None)`` ``[N, K]``, bias
``P(tp)``, y ``P(None, tp)``; row: x ``P(None, tp)``, w ``P(None, tp)`` ``[N, K]``, bias
``P()``, y ``P(tp, None)`` (sequence parallel) or ``P()``. Use :func:`tp_shard_map`
(``shard_map(..., check_vma=False)``, ``check_rep`` on older JAX): the gradient of a
replicated input (the row bias) is each device's share, which ``shard_map`` sums over the
axis.

FP8 (``fp8=True``): x and w are quantized to e4m3 with current per-tensor scaling (the
all-gathered input's scale from the amax over the whole axis, ``lax.pmax``), the GEMMs
run in FP8 with bf16 output; the backward GEMMs run in the input precision (the weight
gradient reads the gathered FP8 input, dequantized), as TE's FP8 recipes do for the
forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ._context import TPContext
from .ops import ag_gemm, rs_gemm


def tp_shard_map(f, mesh, in_specs, out_specs):
    """``shard_map(f, ...)`` as the layers need it: without replication checking
    (``check_vma=False``, ``check_rep=False`` on older JAX), so that the gradient of a
    replicated input is the sum of the devices' shares (see the module docs)."""
    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map
    try:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:  # older JAX: check_rep
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


@dataclass(frozen=True)
class _Cfg:
    ctx: TPContext
    fp8: bool
    comm_sms: int


def _quantize(x, amax):
    dt = jnp.float8_e4m3fn
    fmax = float(jnp.finfo(dt).max)
    amax = amax.astype(jnp.float32)
    scale = jnp.where(amax > 0, fmax / amax, 1.0)
    q = jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(dt)
    return q, (1.0 / scale).reshape(1)


def _absmax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _wgrad(dy, x, dtype):
    return jnp.dot(dy.T, x, preferred_element_type=jnp.float32).astype(dtype)


# ---- column parallel, sequence parallel: AG + GEMM forward, GEMM + RS backward ----


def _col_fwd(x, w, bias, cfg: _Cfg):
    if cfg.fp8:
        xq, xsi = _quantize(x, jax.lax.pmax(_absmax(x), cfg.ctx.axis))
        wq, wsi = _quantize(w, _absmax(w))
        y, xt = ag_gemm(wq, xq, bias, ctx=cfg.ctx, gather_b=True, a_scale_inv=wsi, b_scale_inv=xsi,
                        out_dtype=x.dtype, comm_sms=cfg.comm_sms)
        return y, (xt, xsi, w, bias)
    y, xt = ag_gemm(w, x, bias, ctx=cfg.ctx, gather_b=True, comm_sms=cfg.comm_sms)
    return y, (xt, None, w, bias)


def _col_bwd(cfg: _Cfg, res, dy):
    xt, xsi, w, bias = res
    # dx = RS(dy @ w): A = w [N/tp, K] as [k_local, m] (transa = false), B = dy [T, N/tp].
    dx = rs_gemm(w, dy.astype(w.dtype), ctx=cfg.ctx, transa=False, comm_sms=cfg.comm_sms)[0]
    x_full = xt.astype(jnp.float32) * xsi if xsi is not None else xt
    dw = _wgrad(dy, x_full.astype(dy.dtype), w.dtype)
    return dx.astype(dy.dtype), dw, _bias_share(bias, dy)


def _layer(fwd, bwd):
    """f(x, w, bias, cfg) = fwd(...)[0] with fwd / bwd as its custom VJP (cfg static)."""
    f = jax.custom_vjp(lambda x, w, bias, cfg: fwd(x, w, bias, cfg)[0], nondiff_argnums=(3,))
    f.defvjp(fwd, bwd)
    return f


def _bias_share(bias, dy):
    """This device's share of a bias gradient: its rows of dy summed (None without bias)."""
    return None if bias is None else dy.sum(0).astype(bias.dtype)


_col_sp = _layer(_col_fwd, _col_bwd)


def column_parallel_dense(x, w, bias=None, *, ctx: TPContext, sequence_parallel: bool = True, fp8: bool = False,
                          comm_sms: int = 0):
    """y = x @ w.T + bias with w split by rows (output features) over ``ctx.axis``:
    x ``[T/tp, K]`` (sequence parallel; gathered inside the GEMM) or ``[T, K]``, w
    ``[N/tp, K]``, bias ``[N/tp]`` -> y ``[T, N/tp]``."""
    if sequence_parallel:
        return _col_sp(x, w, bias, _Cfg(ctx, bool(fp8), int(comm_sms)))
    y = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


# ---- row parallel: GEMM + RS (or AR) forward, AG + GEMM backward ----


def _row_fwd(x, w, bias, cfg: _Cfg, all_reduce: bool):
    if cfg.fp8:
        xq, xsi = _quantize(x, _absmax(x))
        wq, wsi = _quantize(w, _absmax(w))
        y = rs_gemm(wq, xq, bias, ctx=cfg.ctx, all_reduce=all_reduce, a_scale_inv=wsi, b_scale_inv=xsi,
                    out_dtype=x.dtype, comm_sms=cfg.comm_sms)[0]
    else:
        y = rs_gemm(w, x, bias, ctx=cfg.ctx, all_reduce=all_reduce, comm_sms=cfg.comm_sms)[0]
    return y, (x, w, bias)


def _row_sp_fwd(x, w, bias, cfg):
    return _row_fwd(x, w, bias, cfg, False)


def _row_sp_bwd(cfg: _Cfg, res, dy):
    x, w, bias = res
    # dx = AG(dy) @ w: A = w [N, K/tp] as [k, m_local] (transa = false), B = dy [T/tp, N].
    dx, dyt = ag_gemm(w, dy.astype(w.dtype), ctx=cfg.ctx, transa=False, gather_b=True, comm_sms=cfg.comm_sms)
    dw = _wgrad(dyt, x.astype(dyt.dtype), w.dtype)
    # The bias is replicated: this device's share (its tokens); shard_map sums the shares.
    return dx.astype(dy.dtype), dw, _bias_share(bias, dy)


_row_sp = _layer(_row_sp_fwd, _row_sp_bwd)


def _row_ar_fwd(x, w, bias, cfg):
    return _row_fwd(x, w, bias, cfg, True)


def _row_ar_bwd(cfg: _Cfg, res, dy):
    x, w, bias = res
    # The output is replicated (out_specs P()): shard_map hands each device 1/tp of its
    # cotangent, and sums what the devices return for the replicated bias.
    dy_full = dy * cfg.ctx.size
    dx = jnp.dot(dy_full, w.astype(dy.dtype), preferred_element_type=jnp.float32).astype(dy.dtype)
    dw = _wgrad(dy_full, x.astype(dy.dtype), w.dtype)
    return dx, dw, _bias_share(bias, dy)


_row_ar = _layer(_row_ar_fwd, _row_ar_bwd)


def row_parallel_dense(x, w, bias=None, *, ctx: TPContext, sequence_parallel: bool = True, fp8: bool = False,
                       comm_sms: int = 0):
    """y = x @ w.T + bias with w split by columns (input features) over ``ctx.axis``:
    x ``[T, K/tp]``, w ``[N, K/tp]``, bias ``[N]`` (replicated) -> y ``[T/tp, N]``
    (sequence parallel: reduce-scattered along tokens) or ``[T, N]`` (all-reduced)."""
    cfg = _Cfg(ctx, bool(fp8), int(comm_sms))
    return (_row_sp if sequence_parallel else _row_ar)(x, w, bias, cfg)


def mlp(x, w1, b1, w2, b2, *, ctx: TPContext, sequence_parallel: bool = True, fp8: bool = False,
        comm_sms: int = 0):
    """The TP MLP block: ``row(gelu(column(x)))`` (w1 ``[F/tp, H]``, w2 ``[H, F/tp]``)."""
    h = column_parallel_dense(x, w1, b1, ctx=ctx, sequence_parallel=sequence_parallel, fp8=fp8, comm_sms=comm_sms)
    h = jax.nn.gelu(h, approximate=True)
    return row_parallel_dense(h, w2, b2, ctx=ctx, sequence_parallel=sequence_parallel, fp8=fp8, comm_sms=comm_sms)
