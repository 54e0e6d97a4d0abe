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

FP8 (``fp8=`` a recipe of :mod:`transformer_engine_comm.jax.fp8`: ``DelayedScaling`` with
``fp8_meta``, or ``CurrentScaling``; ``fp8=True`` is ``CurrentScaling()``): every GEMM of
forward and backward runs in FP8 with bf16 output, as TE's recipes do. The input and the
weight are quantized once in the forward (e4m3) and reused by the backward (the weight's
transposed FP8 copy for the dgrad, the FP8 input for the wgrad); the output gradient is
quantized to e5m2 (HYBRID) or e4m3 (E4M3). Hopper's FP8 GEMMs are TN: the library's
comm-GEMMs and XLA's dgrad get the weight's transposed FP8 copy; XLA's local GEMMs are
dots of the FP8 arrays themselves with the output dequantized (:func:`fp8_dot
<transformer_engine_comm.jax.fp8.fp8_dot>`), which XLA runs as FP8 GEMMs (the wgrad's
operands it transposes into TN itself). The all-gathers carry FP8: the column layer gathers the FP8
input inside its GEMM and keeps it for the wgrad, the row layer's backward gathers the
FP8 gradient and keeps it likewise. A gathered tensor's scale is the same on every
device (its amax max-reduced over the axis; with delayed scaling every recorded amax is,
so the replicated state stays identical).

Block scaling (``fp8=Float8BlockScaling()``; TE-JAX lacks it): the input, weight and
output gradient are quantized per block (1D / 2D by the recipe's dims: rowwise for one
GEMM, the transposed tensor quantized along its rows for the other, as TE's casts), on a
GPU by the library's kernel (the ``te_comm_block_quantize`` custom call: both forms from
one read of the tensor, the scales GEMM-ready) where the GEMMs run on the library and the
tensor is whole 128 x 128 tiles, else in jnp (``fp8.BLOCK_CASTS`` picks; the same bits);
the GEMMs (:func:`block_dot <transformer_engine_comm.jax.fp8.block_dot>`) run on the
library's block-scaled FP8 GEMM (the ``te_comm_block_gemm`` custom call) when JAX runs on
a GPU, else (CPU) as the dots of the dequantized block operands, the same products at bf16
GEMM speed (``fp8.BLOCK_GEMM`` picks). At tp > 1 (inside
``shard_map``) the communication is XLA's own collectives in the activations' dtype
(all-gather of the input / output gradient before their casts, reduce-scatter or
all-reduce of the f32 partial sums after the GEMMs), not the library's comm-GEMMs (their
C entries take block-scaled operands, with the all-gather carrying the scales, but the
JAX custom calls do not yet); ``library`` does not apply to it.

Routing: where nothing is communicated (tp = 1) the layers lower to XLA's own dot and
fusions (bf16: the plain jnp expression; FP8: the same FP8 GEMMs through XLA), since the
library would add only overhead there. ``library=True`` (or the environment variable
``TE_COMM_JAX_LIBRARY=1``) forces the library's custom calls at tp = 1 too, so that
their cost stays measurable; ``library=False`` is refused at tp > 1 in the layers that
communicate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import jax
import jax.numpy as jnp

from . import fp8 as _f8
from ._context import TPContext
from .fp8 import FP8Meta
from .ops import _comm_sms_arg, ag_gemm, rs_gemm


def tp_shard_map(f, mesh, in_specs, out_specs, *, ctx: Optional[TPContext] = None):
    """``shard_map(f, ...)`` as the layers need it: without replication checking
    (``check_vma=False``, ``check_rep=False`` on older JAX), so that the gradient of a
    replicated input is the sum of the devices' shares (see the module docs). With
    ``ctx`` (the layers' TP context), first checks that ``mesh`` places the devices at
    the ranks of the context (:meth:`TPContext.check_mesh`: ValueError otherwise)."""
    if ctx is not None:
        ctx.check_mesh(mesh)
    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map
    try:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:  # older JAX: check_rep
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# kinds: "col_sp" (AG + GEMM), "row_sp" (GEMM + RS), "row_ar" (GEMM + AR), "local" (no
# communication: XLA's dot)
@dataclass(frozen=True)
class _Cfg:
    ctx: TPContext
    kind: str
    recipe: Optional[object]
    comm_sms: int
    library: bool
    # fp8.BLOCK_GEMM and fp8.BLOCK_CASTS when the layer is called: the forward and the
    # backward (traced later, under jax.grad) run their block GEMMs and casts the same way.
    block_gemm: str = field(default_factory=lambda: _f8.BLOCK_GEMM)
    block_casts: str = field(default_factory=lambda: _f8.BLOCK_CASTS)


def _axis_bound(axis: str) -> bool:
    try:
        jax.lax.axis_index(axis)
        return True
    except NameError:
        return False


def _use_library(ctx: TPContext, library: Optional[bool]) -> bool:
    if library is None:
        return ctx.size > 1 or os.environ.get("TE_COMM_JAX_LIBRARY", "0") == "1"
    if not library and ctx.size > 1:
        raise ValueError(f"library=False at tp = {ctx.size}: the layers communicate through the library")
    return bool(library)


def _bias_share(bias, dy):
    """This device's share of a bias gradient: its rows of dy summed (None without bias)."""
    return None if bias is None else dy.sum(0).astype(bias.dtype)


def _wgrad(dy, x, dtype):
    return jnp.dot(dy.T, x, preferred_element_type=jnp.float32).astype(dtype)


def _pmax(v, cfg: _Cfg):
    """max over the TP axis (a no-op at tp = 1); FP8 with tp > 1 runs inside shard_map."""
    if cfg.ctx.size == 1:
        return v
    if not _axis_bound(cfg.ctx.axis):
        raise ValueError(f"FP8 layers at tp = {cfg.ctx.size} run inside shard_map over {cfg.ctx.axis!r} "
                         "(a gathered tensor's amax is max-reduced over the axis)")
    return jax.lax.pmax(v, cfg.ctx.axis)


def _first_device_share(tree, cfg: _Cfg):
    """``tree`` on the axis' first device, zeros elsewhere: shard_map sums the devices'
    cotangents of a replicated input, so the sum is ``tree`` exactly."""
    if cfg.ctx.size == 1 or not _axis_bound(cfg.ctx.axis):
        return tree
    first = jax.lax.axis_index(cfg.ctx.axis) == 0
    return jax.tree_util.tree_map(lambda v: jnp.where(first, v, jnp.zeros_like(v)), tree)


def _scale(cfg: _Cfg, meta, role: int, amax_value):
    """The scale of ``role``: the state's (delayed) or from ``amax_value`` (current)."""
    r = cfg.recipe
    fmax = _f8.FP8_MAX[jnp.dtype(r.dtypes[role]).name]
    if r.delayed:
        # A role's first cast (no amax recorded yet: a fresh state) takes its scale from
        # the tensor itself, as the torch side's Fp8Meta: TE's initial scale 1 flushes
        # small tensors (output gradients of 1e-5 and below underflow e5m2) in step one.
        fresh = jnp.all(meta.amax_history[:, role] == 0)
        own = _f8.scale_from_amax(amax_value, fmax, r.margin, meta.scale[role])
        return jnp.where(fresh, own, meta.scale[role])
    return _f8.scale_from_amax(amax_value, fmax)


# ------------------------------------------------------------------------------ bf16


def _bf16_fwd(x, w, bias, cfg: _Cfg):
    k, ctx, sms = cfg.kind, cfg.ctx, cfg.comm_sms
    if k == "col_sp":
        if ctx.size == 1:  # the gathered input is x itself: no copy
            y = ag_gemm(w, x, bias, ctx=ctx, comm_sms=sms)[0]
            return y, (x, w, bias)
        y, xt = ag_gemm(w, x, bias, ctx=ctx, gather_b=True, comm_sms=sms)
        return y, (xt, w, bias)
    y = rs_gemm(w, x, bias, ctx=ctx, all_reduce=(k == "row_ar"), comm_sms=sms)[0]
    return y, (x, w, bias)


def _bf16_bwd(cfg: _Cfg, res, dy):
    x, w, bias = res
    ctx, sms = cfg.ctx, cfg.comm_sms
    if cfg.kind == "col_sp":
        # dx = RS(dy @ w), NN: A = w [N/tp, K] as [k_local, m] (transa = false), B = dy [T, N/tp].
        dx = rs_gemm(w, dy.astype(w.dtype), ctx=ctx, transa=False, comm_sms=sms)[0]
        # dw = dy^T @ AG(x) [N/tp, K] (NT; XLA's dot reads both untransposed).
        return dx.astype(dy.dtype), _wgrad(dy, x.astype(dy.dtype), w.dtype), _bias_share(bias, dy)
    if cfg.kind == "row_sp":
        # dx = AG(dy) @ w, NN: A = w [N, K/tp] as [k, m_local] (transa = false), B = dy [T/tp, N].
        if ctx.size == 1:
            dx = ag_gemm(w, dy.astype(w.dtype), ctx=ctx, transa=False, comm_sms=sms)[0]
            dyt = dy
        else:
            dx, dyt = ag_gemm(w, dy.astype(w.dtype), ctx=ctx, transa=False, gather_b=True, comm_sms=sms)
        # The bias is replicated: this device's share (its tokens); shard_map sums the shares.
        return dx.astype(dy.dtype), _wgrad(dyt, x.astype(dyt.dtype), w.dtype), _bias_share(bias, dy)
    # row_ar: the output is replicated (out_specs P()): shard_map hands each device 1/tp of
    # its cotangent, and sums what the devices return for the replicated bias.
    dy_full = dy * ctx.size
    dx = jnp.dot(dy_full, w.astype(dy.dtype), preferred_element_type=jnp.float32).astype(dy.dtype)
    return dx, _wgrad(dy_full, x.astype(dy.dtype), w.dtype), _bias_share(bias, dy)


def _bf16_layer():
    f = jax.custom_vjp(lambda x, w, bias, cfg: _bf16_fwd(x, w, bias, cfg)[0], nondiff_argnums=(3,))
    f.defvjp(_bf16_fwd, _bf16_bwd)
    return f


_bf16 = _bf16_layer()


def _xla_dense(x, w, bias):
    """The layer as XLA's own build writes it (nothing communicated)."""
    y = x @ w.T
    return y if bias is None else y + bias.astype(y.dtype)


# ------------------------------------------------------------------------------- FP8


def _fp8_fwd(x, w, bias, meta, cfg: _Cfg):
    r, ctx, sms, k = cfg.recipe, cfg.ctx, cfg.comm_sms, cfg.kind
    dx_t, dw_t, _ = r.dtypes
    out_dt = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.bfloat16
    ax, aw = _f8.amax(x), _f8.amax(w)
    # Current scaling: a gathered input has one scale on every device (amax over the axis).
    sx = _scale(cfg, meta, _f8.INPUT, _pmax(ax, cfg) if k == "col_sp" else ax)
    sw = _scale(cfg, meta, _f8.WEIGHT, aw)
    xq, wq = _f8.quantize(x, sx, dx_t), _f8.quantize(w, sw, dw_t)
    sxi, swi = (1.0 / sx).reshape(1), (1.0 / sw).reshape(1)
    lib = cfg.library
    if k == "col_sp" and lib:
        if ctx.size > 1:
            y, xg = ag_gemm(wq, xq, bias, ctx=ctx, gather_b=True, a_scale_inv=swi, b_scale_inv=sxi,
                            out_dtype=out_dt, comm_sms=sms)
        else:
            y, xg = ag_gemm(wq, xq, bias, ctx=ctx, a_scale_inv=swi, b_scale_inv=sxi, out_dtype=out_dt,
                            comm_sms=sms)[0], xq
    elif k in ("row_sp", "row_ar") and lib:
        y, xg = rs_gemm(wq, xq, bias, ctx=ctx, all_reduce=(k == "row_ar"), a_scale_inv=swi, b_scale_inv=sxi,
                        out_dtype=out_dt, comm_sms=sms)[0], xq
    else:  # local: XLA's FP8 GEMM
        y = _f8.fp8_dot(xq, sxi, wq, swi, ((1,), (1,)), out_dt)
        if bias is not None:
            y = y + bias.astype(out_dt)
        xg = xq
    # The weight's transposed FP8 copy for the dgrad (TN, as Hopper's FP8 GEMMs take their
    # operands; XLA fuses the transpose into the weight's cast).
    wres = wq.T
    # (zero-size arrays carry the dtypes of x and w: residuals are arrays)
    return y, (xg, sxi, wres, swi, jnp.stack([ax, aw]), bias, meta, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_bwd(cfg: _Cfg, res, dy):
    xg, sxi, wres, swi, amax_xw, bias, meta, x_dt, w_dt = res
    x_dt, w_dt = x_dt.dtype, w_dt.dtype
    r, ctx, sms, k = cfg.recipe, cfg.ctx, cfg.comm_sms, cfg.kind
    g_t = r.dtypes[_f8.GRAD]
    out_dt = x_dt if x_dt in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.bfloat16
    if k == "row_ar" and cfg.library:
        g = dy * ctx.size  # see _bf16_bwd
    else:
        g = dy
    ag = _f8.amax(g)
    # The row layer's gradient is gathered: one scale on every device.
    sg = _scale(cfg, meta, _f8.GRAD, _pmax(ag, cfg) if k == "row_sp" else ag)
    gq = _f8.quantize(g, sg, g_t)
    sgi = (1.0 / sg).reshape(1)
    lib = cfg.library
    if k == "col_sp" and lib:
        # dx = RS(dy @ w), TN: A = w^T (FP8) [K, N/tp], B = dy (FP8) [T, N/tp].
        dx = rs_gemm(wres, gq, ctx=ctx, a_scale_inv=swi, b_scale_inv=sgi, out_dtype=out_dt, comm_sms=sms)[0]
        gg = gq
    elif k == "row_sp" and lib:
        # dx = AG(dy) @ w, TN: A = w^T (FP8) [K/tp, N], B = dy (FP8) [T/tp, N] gathered (kept).
        if ctx.size > 1:
            dx, gg = ag_gemm(wres, gq, ctx=ctx, gather_b=True, a_scale_inv=swi, b_scale_inv=sgi, out_dtype=out_dt,
                             comm_sms=sms)
        else:
            dx, gg = ag_gemm(wres, gq, ctx=ctx, a_scale_inv=swi, b_scale_inv=sgi, out_dtype=out_dt,
                             comm_sms=sms)[0], gq
    else:  # local dgrad: dx = dy @ w = dy @ (w^T)^T, TN
        dx = _f8.fp8_dot(gq, sgi, wres, swi, ((1,), (1,)), out_dt, split_accumulator=True)
        gg = gq
    # wgrad: dw = dy^T @ x over all tokens (the gathered FP8 tensors), XLA's FP8 GEMM (it
    # transposes the operands into TN itself). dgrad and wgrad accumulate in full f32, as
    # TE's recipes (use_split_accumulator); the forward GEMM with fast accumulation.
    dw = _f8.fp8_dot(gg, sgi, xg, sxi, ((0,), (0,)), w_dt, split_accumulator=True)
    db = _bias_share(bias, dy)
    if meta is None:
        dmeta = None
    else:
        amaxes = _pmax(jnp.concatenate([amax_xw, ag.reshape(1)]), cfg)
        hist = meta.amax_history.at[0].max(amaxes)
        dmeta = _first_device_share(FP8Meta(hist, meta.scale), cfg)
    return dx.astype(x_dt), dw, db, dmeta


def _fp8_layer():
    f = jax.custom_vjp(lambda x, w, bias, meta, cfg: _fp8_fwd(x, w, bias, meta, cfg)[0], nondiff_argnums=(4,))
    f.defvjp(_fp8_fwd, _fp8_bwd)
    return f


_fp8 = _fp8_layer()


# ---------------------------------------------------------------- block-scaled FP8


def _block_casts(t, role: int, cfg: _Cfg, columnwise: bool, gelu: bool = False, dbias: bool = False,
                 dgelu_pre=None):
    """(rowwise, columnwise or None, dbias or None) block casts of ``t`` (``gelu(t)`` with
    ``gelu``, tanh approximation; ``t * gelu'(dgelu_pre)``, its backward, with
    ``dgelu_pre``) for ``role`` under the layer's recipe, and with ``dbias`` the float32
    column sums of what was cast (a bias gradient): on the library's kernel (everything
    from one read, GEMM-ready scales: ``fp8.BlockQReady``) where
    ``fp8.block_casts_on_library`` says so, else in jnp (``fp8.BlockQ``, the activation by
    ``fp8.act_in_f32``); the same bits either way (with an activation: up to the last
    float bits of its exp)."""
    r = cfg.recipe
    d, q = r.block_dims[role], r.qparams[role]
    kw = dict(power_2_scale=q.power_2_scale, amax_epsilon=q.amax_epsilon)
    if _f8.block_casts_on_library(t.shape, t.dtype, cfg.block_gemm, cfg.block_casts):
        res = _f8.quantize_block_library(t, d, columnwise=columnwise, gelu=gelu, dbias=dbias, dgelu_pre=dgelu_pre,
                                         **kw)
        return res if dbias else res + (None,)
    t = _f8.act_in_f32(t, gelu, dgelu_pre)
    db = t.astype(jnp.float32).sum(0) if dbias else None
    return _f8.quantize_block(t, d, **kw), (_f8.block_columnwise(t, d, **kw) if columnwise else None), db


def _block_exact_bf16(r) -> bool:
    return all(q.power_2_scale for q in r.qparams)


def _block_kind(cfg: _Cfg) -> str:
    """The block path's communication: the layer's kind at tp > 1 (XLA's collectives over
    the axis), "local" at tp = 1 (nothing to communicate, whatever ``library`` says)."""
    if cfg.ctx.size == 1:
        return "local"
    if cfg.kind != "local" and not _axis_bound(cfg.ctx.axis):
        raise ValueError(f"Float8BlockScaling at tp = {cfg.ctx.size} runs inside shard_map over {cfg.ctx.axis!r}")
    return cfg.kind


def _block_fwd(x, w, bias, cfg: _Cfg, gelu_input: bool = False):
    """The block layer's forward; with ``gelu_input`` of ``gelu(x)`` (tanh approximation),
    the GELU fused into x's casts (never stored)."""
    r = cfg.recipe
    xd, wd, _ = r.block_dims
    kind, ax = _block_kind(cfg), cfg.ctx.axis
    out_dt = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.bfloat16
    if kind == "col_sp":  # the input gathered over the tokens before its casts
        x = jax.lax.all_gather(x, ax, axis=0, tiled=True)
    xr, xc, _ = _block_casts(x, _f8.INPUT, cfg, True, gelu=gelu_input)
    wr, wc, _ = _block_casts(w, _f8.WEIGHT, cfg, True)
    exact = _block_exact_bf16(r)
    if kind in ("row_sp", "row_ar"):  # partial sums reduced in f32 over the axis
        y = _f8.block_dot(xr, xd, wr, wd, jnp.float32, exact, cfg.block_gemm)
        y = (jax.lax.psum_scatter(y, ax, scatter_dimension=0, tiled=True) if kind == "row_sp"
             else jax.lax.psum(y, ax)).astype(out_dt)
        if bias is not None:
            y = y + bias.astype(out_dt)
    else:  # the bias in the GEMM's epilogue on the library (bf16 / f16 outputs)
        y = _f8.block_dot(xr, xd, wr, wd, out_dt, exact, cfg.block_gemm, bias=bias)
    # Saved: the columnwise casts (x^T -- of the gathered input -- for the wgrad, w^T for
    # the dgrad), FP8.
    return y, (xc, wc, bias, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _block_bwd(cfg: _Cfg, res, dy, act_pre=None):
    """The block layer's backward; with ``act_pre`` (the layer's output ``y`` feeds
    ``gelu(y)``, ``act_pre`` = y, and ``dy`` is the gradient at the GELU's output: the MLP's
    first layer, :func:`_block_mlp`) the GELU's backward is fused into dy's casts."""
    xc, wc, bias, x_dt, w_dt = res
    r = cfg.recipe
    xd, wd, gd = r.block_dims
    kind, ax = _block_kind(cfg), cfg.ctx.axis
    exact = _block_exact_bf16(r)
    out_dt = x_dt.dtype if x_dt.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) else jnp.bfloat16
    g = dy
    if kind == "row_sp":  # dY gathered over the tokens before its casts
        g = jax.lax.all_gather(dy, ax, axis=0, tiled=True)
    elif kind == "row_ar":  # replicated output: each device holds 1/tp of its cotangent (see _bf16_bwd)
        g = dy * cfg.ctx.size
    if act_pre is not None and kind not in ("local", "col_sp"):
        raise ValueError("the GELU's backward fuses into a column-parallel (first) layer's casts")
    # The bias gradient from the casts' read where g is this device's dy (its share).
    fuse_db = bias is not None and kind in ("local", "col_sp")
    gr, gc, db = _block_casts(g, _f8.GRAD, cfg, True, dbias=fuse_db, dgelu_pre=act_pre)
    if kind == "col_sp":  # dx = RS(dy . w), reduced in f32
        dx = _f8.block_dot(gr, gd, wc, wd, jnp.float32, exact, cfg.block_gemm)  # dy [T, N/tp] . (w^T [K, N/tp])^T
        dx = jax.lax.psum_scatter(dx, ax, scatter_dimension=0, tiled=True).astype(out_dt)
    else:
        dx = _f8.block_dot(gr, gd, wc, wd, out_dt, exact, cfg.block_gemm)
    dw = _f8.block_dot(gc, gd, xc, xd, w_dt.dtype, exact, cfg.block_gemm)  # dy^T [N, T] . (x^T [K, T])^T
    return dx, dw, (db.astype(bias.dtype) if fuse_db else _bias_share(bias, dy))


def _block_layer():
    f = jax.custom_vjp(lambda x, w, bias, cfg: _block_fwd(x, w, bias, cfg)[0], nondiff_argnums=(3,))
    f.defvjp(_block_fwd, _block_bwd)
    return f


_block = _block_layer()


def _block_mlp_fwd(x, w1, b1, w2, b2, cfg1: _Cfg, cfg2: _Cfg):
    h, res1 = _block_fwd(x, w1, b1, cfg1)
    y, res2 = _block_fwd(h, w2, b2, cfg2, gelu_input=True)
    return y, (res1, res2, h)


def _block_mlp_bwd(cfg1: _Cfg, cfg2: _Cfg, res, dy):
    res1, res2, h = res
    dg, dw2, db2 = _block_bwd(cfg2, res2, dy)  # dg: the gradient at gelu(h)
    dx, dw1, db1 = _block_bwd(cfg1, res1, dg, act_pre=h)
    return dx, dw1, db1, dw2, db2


def _block_mlp_layer():
    """``row(gelu(column(x)))`` under block scaling as one differentiable function: the
    GELU rides in the second layer's input casts (forward) and in the first layer's
    output-gradient casts (backward, with that layer's bias gradient), neither a pass of
    its own; the GEMMs run without epilogue activations (cuBLASLt's DGELU epilogue for
    block-scaled GEMMs runs as a separate kernel)."""
    f = jax.custom_vjp(lambda x, w1, b1, w2, b2, c1, c2: _block_mlp_fwd(x, w1, b1, w2, b2, c1, c2)[0],
                       nondiff_argnums=(5, 6))
    f.defvjp(_block_mlp_fwd, _block_mlp_bwd)
    return f


_block_mlp = _block_mlp_layer()


def _dense(x, w, bias, cfg: _Cfg, meta):
    r = cfg.recipe
    if r is None:
        if cfg.kind == "local" or not cfg.library:
            return _xla_dense(x, w, bias)
        return _bf16(x, w, bias, cfg)
    if r.block:
        if meta is not None:
            raise ValueError("Float8BlockScaling has no state: pass fp8_meta=None")
        return _block(x, w, bias, cfg)
    if r.delayed:
        if not isinstance(meta, FP8Meta):
            raise TypeError("DelayedScaling needs fp8_meta (tj.fp8_meta_init(recipe)); got "
                            f"{type(meta).__name__}")
        if meta.amax_history.shape != (r.amax_history_len, 3) or meta.scale.shape != (3,):
            raise ValueError(f"fp8_meta has history {meta.amax_history.shape} and scale {meta.scale.shape}: "
                             f"the recipe needs ({r.amax_history_len}, 3) and (3,)")
    elif meta is not None:
        raise ValueError("CurrentScaling has no state: pass fp8_meta=None")
    return _fp8(x, w, bias, meta, cfg)


def column_parallel_dense(x, w, bias=None, *, ctx: TPContext, sequence_parallel: bool = True, fp8=False,
                          fp8_meta: Optional[FP8Meta] = None, comm_sms: int = 0, library: Optional[bool] = None):
    """y = x @ w.T + bias with w split by rows (output features) over ``ctx.axis``:
    x ``[T/tp, K]`` (sequence parallel; gathered inside the GEMM) or ``[T, K]``, w
    ``[N/tp, K]``, bias ``[N/tp]`` -> y ``[T, N/tp]``. ``fp8``: False, True
    (``CurrentScaling()``) or a recipe; ``fp8_meta``: this layer's state under
    ``DelayedScaling`` (its gradient is the state with this step's amaxes recorded: see
    :mod:`transformer_engine_comm.jax.fp8`)."""
    return _dense(x, w, bias, _col_cfg(ctx, sequence_parallel, fp8, comm_sms, library), fp8_meta)


def _col_cfg(ctx: TPContext, sequence_parallel: bool, fp8, comm_sms: int, library: Optional[bool]) -> _Cfg:
    recipe = _f8.as_recipe(fp8)
    if sequence_parallel:
        lib = _use_library(ctx, library)
        return _Cfg(ctx, "col_sp" if lib else "local", recipe, _comm_sms_arg(comm_sms), lib)
    return _Cfg(ctx, "local", recipe, _comm_sms_arg(comm_sms), False)  # x replicated: nothing to communicate


def row_parallel_dense(x, w, bias=None, *, ctx: TPContext, sequence_parallel: bool = True, fp8=False,
                       fp8_meta: Optional[FP8Meta] = None, comm_sms: int = 0, library: Optional[bool] = None):
    """y = x @ w.T + bias with w split by columns (input features) over ``ctx.axis``:
    x ``[T, K/tp]``, w ``[N, K/tp]``, bias ``[N]`` (replicated) -> y ``[T/tp, N]``
    (sequence parallel: reduce-scattered along tokens) or ``[T, N]`` (all-reduced).
    ``fp8`` / ``fp8_meta`` as :func:`column_parallel_dense`."""
    return _dense(x, w, bias, _row_cfg(ctx, sequence_parallel, fp8, comm_sms, library), fp8_meta)


def _row_cfg(ctx: TPContext, sequence_parallel: bool, fp8, comm_sms: int, library: Optional[bool]) -> _Cfg:
    recipe = _f8.as_recipe(fp8)
    lib = _use_library(ctx, library)
    kind = ("row_sp" if sequence_parallel else "row_ar") if lib else "local"
    return _Cfg(ctx, kind, recipe, _comm_sms_arg(comm_sms), lib)


def mlp(x, w1, b1, w2, b2, *, ctx: TPContext, sequence_parallel: bool = True, fp8=False, fp8_meta=None,
        comm_sms: int = 0, library: Optional[bool] = None):
    """The TP MLP block: ``row(gelu(column(x)))`` (w1 ``[F/tp, H]``, w2 ``[H, F/tp]``).
    ``fp8_meta``: the two layers' states (``tj.fp8_meta_init(recipe, 2)``) under
    ``DelayedScaling``."""
    m1 = m2 = None
    if fp8_meta is not None:
        if isinstance(fp8_meta, FP8Meta) or len(fp8_meta) != 2:
            raise ValueError("mlp's fp8_meta is a pair of FP8Meta (tj.fp8_meta_init(recipe, 2))")
        m1, m2 = fp8_meta
    kw = dict(ctx=ctx, sequence_parallel=sequence_parallel, fp8=fp8, comm_sms=comm_sms, library=library)
    cfg = _row_cfg(ctx, sequence_parallel, fp8, comm_sms, library)
    if cfg.recipe is not None and cfg.recipe.block:  # the GELU in the casts, both ways
        if m1 is not None or m2 is not None:
            raise ValueError("Float8BlockScaling has no state: pass fp8_meta=None")
        return _block_mlp(x, w1, b1, w2, b2, _col_cfg(ctx, sequence_parallel, fp8, comm_sms, library), cfg)
    h = column_parallel_dense(x, w1, b1, fp8_meta=m1, **kw)
    h = jax.nn.gelu(h, approximate=True)
    return row_parallel_dense(h, w2, b2, fp8_meta=m2, **kw)
