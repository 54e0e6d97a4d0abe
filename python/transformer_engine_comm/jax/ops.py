"""Comm-GEMM ops for JAX: XLA FFI custom calls into the library's handlers.

Layouts follow ``jnp`` (row-major) and ``Linear``: ``x`` is ``[tokens, in]``, ``w`` is
``[out, in]``. Per device (inside ``shard_map`` over the TP axis, or on a process's local
arrays with one device per process):

- :func:`all_gather_gemm`: ``x`` ``[tokens/tp, K]`` gathered along tokens, ``w``
  ``[N/tp, K]`` -> ``y = AG(x) @ w.T (+ bias)`` ``[tokens, N/tp]``; optional GELU (``y``
  activated, pre-activation returned too) and the gathered ``x`` (for a weight gradient).
- :func:`gemm_reduce_scatter`: ``x`` ``[tokens, K/tp]``, ``w`` ``[N, K/tp]`` ->
  ``RS(x @ w.T) (+ bias)`` ``[tokens/tp, N]``.
- :func:`gemm_all_reduce`: as above, every device gets ``[tokens, N]``.
- :func:`block_gemm`: no communication: ``a @ b.T`` of block-scaled FP8 operands
  (Float8BlockScaling) on the library's GEMM, the scales in TE's GEMM-ready layout
  (:func:`gemm_ready_scales`); what the block layers' GEMMs run on a GPU.
- :func:`block_quantize`: the block-scaled FP8 cast (rowwise and / or columnwise, one read
  of the input) on the library's kernel, the scales GEMM-ready for :func:`block_gemm`;
  what the block layers' casts run on a GPU.

Layouts of TE's ``nvte_cublas_gemm`` (A = ``w``, B = ``x``): ``transa`` (default True: ``w``
is ``[N, K]``; False: ``[K, N]``) and ``transb`` (default False: ``x`` is ``[tokens, K]``;
True: ``[K, tokens]``, e.g. a gradient stored transposed); the output is always
``[tokens, N]`` (per device as above). TN, NN and NT are supported; TT is not; FP8
operands need TN (Hopper's FP8 GEMMs: pass the transposed FP8 copy instead), and the
gathered input (``return_gathered``) needs ``transb = False``.

FP8: ``x`` and ``w`` as ``jnp.float8_e4m3fn`` / ``float8_e5m2`` with ``x_scale_inv`` /
``w_scale_inv`` (f32, one element; dequantized = stored x scale_inv); the output is bf16
unless ``out_dtype`` says otherwise. Tokens need not divide by tp outside ``shard_map``
(``n_tokens`` = the global count; each rank holds ``numroc`` of them, the last ranks
fewer), as the C API.

The ops are collective: every device of the group must execute them in the same order.
They work under ``jax.jit``, inside XLA command buffers (CUDA graphs), and are
differentiable through the layers in :mod:`transformer_engine_comm.jax.layers`.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from .. import _capi, _core
from ._context import TPContext

# op -> (XLA custom-call target, library symbol)
TARGETS = {
    "ag": ("te_comm_all_gather_gemm", "nvte_comm_xla_all_gather_gemm"),
    "rs": ("te_comm_gemm_reduce_scatter", "nvte_comm_xla_gemm_reduce_scatter"),
    "ar": ("te_comm_gemm_all_reduce", "nvte_comm_xla_gemm_all_reduce"),
}

_registered = False
_reg_lock = threading.Lock()


def register() -> None:
    """Register the three handlers with XLA for platform CUDA (idempotent). Each is
    registered for the initialize stage (creates engines and buffers outside any capture)
    and the execute stage."""
    global _registered
    with _reg_lock:
        if _registered:
            return
        import jax

        lib = _capi.lib()
        for target, symbol in TARGETS.values():
            cap = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(target, {"initialize": cap, "execute": cap}, platform="CUDA", api_version=1)
        _registered = True


# The library's block distribution (block ceil(global / nranks)), from the core.
numroc = _core.numroc
# op kind -> the core's op name
_OPS = {"ag": "all_gather_gemm", "rs": "gemm_reduce_scatter", "ar": "gemm_all_reduce"}


def _dtype_name(dtype) -> str:
    import jax.numpy as jnp

    return jnp.dtype(dtype).name


def _is_fp8(dtype) -> bool:
    return _core.is_fp8(_dtype_name(dtype))


def _out_dtype(x, out_dtype):
    """``out_dtype``, else the core's default (bfloat16 for FP8 inputs, else x's)."""
    import jax.numpy as jnp

    if out_dtype is not None:
        # Names ("bf16", "float32", ...), jnp / numpy / torch dtypes: the core's table
        return jnp.dtype(_core.dtype_name(out_dtype, "out_dtype"))
    return jnp.dtype(jnp.bfloat16) if _is_fp8(x.dtype) else x.dtype


def _scales(a, b, a_scale_inv, b_scale_inv):
    import jax.numpy as jnp

    fp8 = _is_fp8(a.dtype) or _is_fp8(b.dtype)
    if not fp8:
        if a_scale_inv is not None or b_scale_inv is not None:
            raise ValueError("scale_inv is only for FP8 operands")
        return []
    if a_scale_inv is None or b_scale_inv is None:
        raise ValueError("FP8 operands need both x_scale_inv and w_scale_inv (f32, one element)")
    return [jnp.asarray(a_scale_inv, jnp.float32).reshape(1), jnp.asarray(b_scale_inv, jnp.float32).reshape(1)]


def ffi_gemm(kind: str, a, b, bias=None, a_scale_inv=None, b_scale_inv=None, *, ctx: TPContext, m: int, n: int,
             k: int, transa: bool, d_shape, d_dtype, gelu: bool = False, gather_b: bool = False, comm_sms: int = 0,
             algo: int = 0, transb: bool = False):
    """The custom call in TE's terms (``a`` = A, ``b`` = B, global m, n, k as in
    ``nvte_all_gather_gemm``). Returns a list: d, [pre_act], [b gathered]."""
    import jax

    if ctx.closed:
        raise ValueError(f"{ctx!r} is closed")
    _check_layout(a, b, transa, transb, gather_b, TARGETS[kind][0])
    comm_sms = _comm_sms_arg(comm_sms)
    register()
    target = TARGETS[kind][0]
    outs = [jax.ShapeDtypeStruct(tuple(d_shape), d_dtype)]
    if gelu:
        outs.append(jax.ShapeDtypeStruct(tuple(d_shape), d_dtype))
    if gather_b:
        outs.append(jax.ShapeDtypeStruct((n, k), b.dtype))
    scales = _scales(a, b, a_scale_inv, b_scale_inv)
    args = [a, b] + ([bias] if bias is not None else []) + scales
    res = jax.ffi.ffi_call(target, outs)(
        *args,
        context=np.uint64(ctx.key),
        m=np.int64(m),
        n=np.int64(n),
        k=np.int64(k),
        transa=bool(transa),
        transb=bool(transb),
        comm_sms=np.int32(comm_sms),
        algo=np.int32(algo),
        has_bias=bias is not None,
        has_scales=bool(scales),
        gelu=bool(gelu),
        gather_b=bool(gather_b),
    )
    return list(res)


def _comm_sms_arg(comm_sms) -> int:
    """``comm_sms``: an integer in [0, 2**31) (ValueError naming it otherwise)."""
    v = _core.check_size(comm_sms, "comm_sms")
    if v >= 1 << 31:
        raise ValueError(f"comm_sms = {v} is out of range (an SM count: < 2**31)")
    return v


def _check_layout(a, b, transa: bool, transb: bool, gather_b: bool, op: str = "te_comm") -> None:
    """The layouts the library runs (the core's rule: TN, NN, NT; FP8 TN only), checked at
    trace time."""
    _core.check_trans(op, transa, transb, _is_fp8(a.dtype) or _is_fp8(b.dtype))
    if gather_b and transb:
        raise ValueError("the gathered input (return_gathered / gather_b) needs transb = False "
                         "(B stored [tokens, K], gathered along its rows)")


def _check2(x, what):
    if x.ndim != 2:
        raise ValueError(f"{what} must be 2-D (reshape [batch, seq, hidden] to [batch*seq, hidden]), got {x.shape}")


def ag_gemm(a, b, bias=None, *, ctx: TPContext, transa: bool = True, transb: bool = False,
            n_tokens: Optional[int] = None, gelu: bool = False, gather_b: bool = False, a_scale_inv=None,
            b_scale_inv=None, out_dtype=None, comm_sms: int = 0, algo: int = 0):
    """All-gather GEMM in TE's terms: B ``[n_local, k]`` (``[k, n_local]`` with transb)
    gathered along n; A is ``[m_local, k]`` (transa) or ``[k, m_local]``; D ``[n, m_local]``."""
    _check2(a, "A")
    _check2(b, "B")
    # The core's plan, unvalidated (inside shard_map there is no one rank to check shares
    # against; the library checks the call): m and n global, D [n, m_local].
    p = _core.plan_all_gather("te_comm_all_gather_gemm", b.shape, a.shape, nranks=ctx.size, rank=None,
                              transa=transa, transb=transb,
                              n_global=None if n_tokens is None else _core.check_size(n_tokens, "n_tokens"),
                              validate=False)
    return ffi_gemm("ag", a, b, bias, a_scale_inv, b_scale_inv, ctx=ctx, m=p.m, n=p.n, k=p.k, transa=transa,
                    d_shape=p.out_shape, d_dtype=_out_dtype(b, out_dtype), gelu=gelu, gather_b=gather_b,
                    comm_sms=comm_sms, algo=algo, transb=transb)


def _scattered_rows(n: int, ctx: TPContext) -> int:
    # n / tp when even; else this process's rank's share (one device per process)
    return _core.scattered_rows(n, ctx.size, lambda: ctx.rank)


def rs_gemm(a, b, bias=None, *, ctx: TPContext, transa: bool = True, transb: bool = False,
            all_reduce: bool = False, a_scale_inv=None, b_scale_inv=None, out_dtype=None, comm_sms: int = 0,
            algo: int = 0):
    """GEMM + reduce-scatter (or all-reduce) in TE's terms: k split; B ``[n, k_local]``
    (``[k_local, n]`` with transb); A ``[m, k_local]`` (transa) or ``[k_local, m]``; D
    ``[n/tp, m]`` (all-reduce: ``[n, m]``)."""
    _check2(a, "A")
    _check2(b, "B")
    kind = "ar" if all_reduce else "rs"
    p = _core.plan_k_split(TARGETS[kind][0], b.shape, a.shape, nranks=ctx.size, rank=lambda: ctx.rank,
                           scatter=not all_reduce, transa=transa, transb=transb, validate=False)
    return ffi_gemm(kind, a, b, bias, a_scale_inv, b_scale_inv, ctx=ctx, m=p.m, n=p.n, k=p.k, transa=transa,
                    d_shape=p.out_shape, d_dtype=_out_dtype(b, out_dtype), comm_sms=comm_sms, algo=algo,
                    transb=transb)


def all_gather_gemm(x, w, bias=None, *, ctx: TPContext, n_tokens: Optional[int] = None, gelu: bool = False,
                    return_gathered: bool = False, x_scale_inv=None, w_scale_inv=None, out_dtype=None,
                    comm_sms: int = 0, algo: int = 0, transa: bool = True, transb: bool = False):
    """``y = AG(x) @ w.T (+ bias)``: x ``[tokens/tp, K]``, w ``[N/tp, K]`` -> y ``[tokens, N/tp]``
    (``transa=False``: w ``[K, N/tp]``; ``transb=True``: x ``[K, tokens/tp]``).
    With ``gelu``: returns ``(gelu(y), y)``; with ``return_gathered``: also ``AG(x)``."""
    out = ag_gemm(w, x, bias, ctx=ctx, transa=transa, transb=transb, n_tokens=n_tokens, gelu=gelu,
                  gather_b=return_gathered,
                  a_scale_inv=w_scale_inv, b_scale_inv=x_scale_inv, out_dtype=out_dtype, comm_sms=comm_sms,
                  algo=algo)
    return out[0] if len(out) == 1 else tuple(out)


def gemm_reduce_scatter(x, w, bias=None, *, ctx: TPContext, x_scale_inv=None, w_scale_inv=None, out_dtype=None,
                        comm_sms: int = 0, algo: int = 0, transa: bool = True, transb: bool = False):
    """``RS(x @ w.T) (+ bias)``: x ``[tokens, K/tp]``, w ``[N, K/tp]`` -> ``[tokens/tp, N]``
    (``transa=False``: w ``[K/tp, N]``; ``transb=True``: x ``[K/tp, tokens]``)."""
    return rs_gemm(w, x, bias, ctx=ctx, transa=transa, transb=transb, a_scale_inv=w_scale_inv, b_scale_inv=x_scale_inv,
                   out_dtype=out_dtype, comm_sms=comm_sms, algo=algo)[0]


def gemm_all_reduce(x, w, bias=None, *, ctx: TPContext, x_scale_inv=None, w_scale_inv=None, out_dtype=None,
                    comm_sms: int = 0, algo: int = 0, transa: bool = True, transb: bool = False):
    """``AR(x @ w.T) (+ bias)``: x ``[tokens, K/tp]``, w ``[N, K/tp]`` -> ``[tokens, N]``
    (layouts as :func:`gemm_reduce_scatter`)."""
    return rs_gemm(w, x, bias, ctx=ctx, transa=transa, transb=transb, all_reduce=True, a_scale_inv=w_scale_inv,
                   b_scale_inv=x_scale_inv, out_dtype=out_dtype, comm_sms=comm_sms, algo=algo)[0]


# ---- block-scaled FP8 GEMM (Float8BlockScaling): no communication, no context ----------

BLOCK_TARGET = ("te_comm_block_gemm", "nvte_comm_xla_block_gemm")
BLOCK_LEN = 128
# cuBLASLt's workspace for the block-scaled GEMM (TE's size on Hopper), an XLA temporary
BLOCK_WORKSPACE_BYTES = 32 << 20
_block_registered = False


def register_block() -> None:
    """Register the block-scaled GEMM handler with XLA for platform CUDA (idempotent; it
    has no initialize stage: nothing is created per context)."""
    global _block_registered
    with _reg_lock:
        if _block_registered:
            return
        import jax

        cap = jax.ffi.pycapsule(getattr(_capi.lib(), BLOCK_TARGET[1]))
        jax.ffi.register_ffi_target(BLOCK_TARGET[0], cap, platform="CUDA", api_version=1)
        _block_registered = True


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def gemm_ready_scale_shape(rows: int, cols: int, block_dim: int):
    """TE's GEMM-ready scale_inv shape of FP8 data ``[rows, cols]`` with blocks along its
    rows (src/tensor.rs ``scale_shape``): 1D ``[ceil(cols/128), roundup(rows, 4)]`` (entry
    (column block, row)), 2D ``[ceil(rows/128), roundup(ceil(cols/128), 4)]``."""
    nb = -(-cols // BLOCK_LEN)
    if block_dim == 1:
        return (nb, _roundup(rows, 4))
    if block_dim == 2:
        return (-(-rows // BLOCK_LEN), _roundup(nb, 4))
    raise ValueError(f"block_dim must be 1 or 2, got {block_dim!r}")


def gemm_ready_scales(scale_inv, rows: int, cols: int, block_dim: int):
    """The GEMM-ready scale_inv (f32) of a rowwise block cast of ``[rows, cols]`` from its
    compact scales (:class:`~transformer_engine_comm.jax.fp8.BlockQ`'s: 1D ``[rows,
    ceil(cols/128)]``, 2D ``[ceil(rows/128), ceil(cols/128)]``): 1D transposed, both padded
    (with ones, never read) to TE's multiple of 4."""
    import jax.numpy as jnp

    s = jnp.asarray(scale_inv, jnp.float32)
    nb = -(-cols // BLOCK_LEN)
    want_compact = (rows, nb) if block_dim == 1 else (-(-rows // BLOCK_LEN), nb)
    if tuple(s.shape) != want_compact:
        raise ValueError(f"{block_dim}D block scale_inv of [{rows}, {cols}] data must be {want_compact}, got {s.shape}")
    if block_dim == 1:
        s = s.T
    r, c = gemm_ready_scale_shape(rows, cols, block_dim)
    return jnp.pad(s, ((0, r - s.shape[0]), (0, c - s.shape[1])), constant_values=1.0)


def block_gemm_fits(m: int, n: int, k: int, a_dtype, b_dtype, a_block_dim: int, b_block_dim: int) -> bool:
    """Whether the library's block GEMM takes ``a`` ``[m, k]`` . ``b`` ``[n, k]``^T (cuBLASLt's
    rules, src/gemm/block.rs): k a multiple of 16, n of 8, m of 8 when ``a`` is 1D; not
    2D x 2D; FP8, not both e5m2."""
    names = (_dtype_name(a_dtype), _dtype_name(b_dtype))
    if not all(x in ("float8_e4m3fn", "float8_e5m2") for x in names) or names == ("float8_e5m2",) * 2:
        return False
    if a_block_dim == 2 and b_block_dim == 2:
        return False
    return k % 16 == 0 and n % 8 == 0 and (a_block_dim == 2 or m % 8 == 0) and min(m, n, k) > 0


def block_gemm(a, a_scale_inv, b, b_scale_inv, *, a_block_dim: int, b_block_dim: int, out_dtype="bfloat16",
               bias=None, dgelu_pre=None, split_accumulator: bool = True):
    """``d = a @ b.T`` of block-scaled FP8 operands on the library's GEMM (cuBLASLt's block
    scale modes, Hopper): ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (f8e4m3fn / f8e5m2, rowwise
    forms), their scale_inv in TE's GEMM-ready layout (:func:`gemm_ready_scales`);
    ``a_block_dim`` / ``b_block_dim`` 1 (1 x 128 blocks) or 2 (128 x 128; not both). With
    ``bias`` (``[N]``): ``d + bias``; with ``dgelu_pre`` (``[M, N]``, the GELU input):
    ``d * gelu'(dgelu_pre)`` (not both). Output ``[M, N]`` bf16 / f16 / f32. An XLA custom
    call (``te_comm_block_gemm``), command-buffer compatible; GPU only."""
    import jax
    import jax.numpy as jnp

    for x, w in ((a, "a"), (b, "b")):
        _check2(x, w)
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"block_gemm: a {a.shape} and b {b.shape} differ in K")
    if bias is not None and dgelu_pre is not None:
        raise ValueError("block_gemm: bias or dgelu_pre, not both (cuBLASLt's block scale modes)")
    for s, rows, d, w in ((a_scale_inv, m, a_block_dim, "a"), (b_scale_inv, n, b_block_dim, "b")):
        if tuple(s.shape) != gemm_ready_scale_shape(rows, k, d):
            raise ValueError(f"block_gemm: {w}_scale_inv must be the GEMM-ready {gemm_ready_scale_shape(rows, k, d)} "
                             f"for {d}D blocks of [{rows}, {k}], got {s.shape} (see gemm_ready_scales)")
    out = jnp.dtype(_core.dtype_name(out_dtype, "out_dtype"))
    register_block()
    args = [a, jnp.asarray(a_scale_inv, jnp.float32), b, jnp.asarray(b_scale_inv, jnp.float32)]
    if bias is not None:
        args.append(bias)
    if dgelu_pre is not None:
        args.append(dgelu_pre)
    outs = [jax.ShapeDtypeStruct((m, n), out), jax.ShapeDtypeStruct((BLOCK_WORKSPACE_BYTES,), jnp.uint8)]
    d, _ = jax.ffi.ffi_call(BLOCK_TARGET[0], outs)(
        *args,
        a_block_dim=np.int32(a_block_dim),
        b_block_dim=np.int32(b_block_dim),
        has_bias=bias is not None,
        dgelu=dgelu_pre is not None,
        split_accumulator=bool(split_accumulator),
    )
    return d


def block_gemm_available() -> bool:
    """Whether :func:`block_gemm` can run here: JAX's default backend is a Hopper GPU
    (compute capability 9.0: cuBLASLt's block scale modes, which the library requires) and
    the library loads (the block layers' GEMMs use it then; else the dequantized dot)."""
    import jax

    try:
        if jax.default_backend() not in ("gpu", "cuda"):
            return False
        if str(getattr(jax.devices()[0], "compute_capability", "")) != "9.0":
            return False
        _capi.lib()
    except Exception:  # no backend, no library: the reference path
        return False
    return True


# ---- block quantization (Float8BlockScaling): the library's kernel as an XLA custom call -

QUANTIZE_TARGET = ("te_comm_block_quantize", "nvte_comm_xla_block_quantize")
_quantize_registered = False


def register_block_quantize() -> None:
    """Register the block quantization handler with XLA for platform CUDA (idempotent),
    for its initialize stage (the kernel compiled and loaded, outside any command-buffer
    capture) and its execute stage (the launch)."""
    global _quantize_registered
    with _reg_lock:
        if _quantize_registered:
            return
        import jax

        cap = jax.ffi.pycapsule(getattr(_capi.lib(), QUANTIZE_TARGET[1]))
        jax.ffi.register_ffi_target(QUANTIZE_TARGET[0], {"initialize": cap, "execute": cap}, platform="CUDA",
                                    api_version=1)
        _quantize_registered = True


def block_quantize_fits(shape, dtype) -> bool:
    """Whether :func:`block_quantize` takes an input of ``shape`` and ``dtype``: 2-D, both
    dimensions positive multiples of 128 (whole 128 x 128 tiles: the kernel's rule, and
    TE's ``Float8BlockQuantizer.is_quantizable``), float32 / bfloat16 / float16."""
    shape = tuple(shape)
    return (len(shape) == 2 and all(d > 0 and d % BLOCK_LEN == 0 for d in shape)
            and _dtype_name(dtype) in ("float32", "bfloat16", "float16"))


def block_quantize(x, block_dim: int, *, power_2_scale: bool = True, amax_epsilon: float = 0.0,
                   rowwise: bool = True, columnwise: bool = False, dtype="float8_e4m3fn", gelu: bool = False,
                   dbias: bool = False, dgelu_pre=None):
    """Block-scaled FP8 cast of ``x`` ``[R, C]`` (TE's Float8BlockScaling: one scale per 1 x
    128 values, ``block_dim`` 1, or per 128 x 128 tile, 2) on the library's kernel, one read
    of each tile for both forms. Returns ``(rowwise, columnwise)``, each ``(q, scale_inv)``
    or None where not asked for: rowwise ``q`` ``[R, C]``; columnwise ``q`` ``[C, R]``, the
    transpose quantized along its rows (1D: 128 x 1 blocks of ``x``; 2D: the rowwise tiles
    transposed). The scale inverses (f32) are in TE's GEMM-ready layout, what
    :func:`block_gemm` takes for the data as stored (:func:`gemm_ready_scale_shape` of
    ``[R, C]`` and ``[C, R]``; 2D padding entries are zeroed, and never read). The
    same bits as :func:`~transformer_engine_comm.jax.fp8.quantize_block` /
    :func:`~transformer_engine_comm.jax.fp8.block_columnwise` (whose scales are compact).
    ``R`` and ``C`` multiples of 128 (:func:`block_quantize_fits`). ``gelu``: the cast of
    ``gelu(x)`` (tanh approximation, computed in float32 and rounded once to ``x``'s dtype,
    as :func:`fp8.act_in_f32 <transformer_engine_comm.jax.fp8.act_in_f32>` does up to the last
    float bits of its exp; XLA's GELU of a bf16 array rounds its intermediates) instead of ``x``,
    without writing it: the activation fused into its cast. ``dbias``: a third result, the
    column sums of the values cast (``x.sum(0)`` in float32, over each 128-row tile in the
    kernel, then over the tiles): a bias gradient from the same read. ``dgelu_pre`` (``x``'s
    shape and dtype; not with ``gelu``): the cast of ``x * gelu'(dgelu_pre)`` (the tanh GELU's
    backward, ``x`` the gradient at its output), rounded to ``x``'s dtype, without writing
    it (with ``dbias``, its column sums). An XLA custom call
    (``te_comm_block_quantize``), command-buffer compatible; GPU only."""
    import jax
    import jax.numpy as jnp

    _check2(x, "x")
    if block_dim not in (1, 2):
        raise ValueError(f"block_dim must be 1 or 2, got {block_dim!r}")
    if not (rowwise or columnwise):
        raise ValueError("block_quantize: ask for rowwise and / or columnwise")
    if not block_quantize_fits(x.shape, x.dtype):
        raise ValueError(f"block_quantize: x {tuple(x.shape)} {_dtype_name(x.dtype)} must be [R, C] with R and C "
                         "positive multiples of 128, float32 / bfloat16 / float16")
    if dgelu_pre is not None:
        if gelu:
            raise ValueError("block_quantize: gelu or dgelu_pre, not both")
        if tuple(dgelu_pre.shape) != tuple(x.shape) or dgelu_pre.dtype != x.dtype:
            raise ValueError(f"block_quantize: dgelu_pre {tuple(dgelu_pre.shape)} {_dtype_name(dgelu_pre.dtype)} "
                             f"must be x's shape and dtype {tuple(x.shape)} {_dtype_name(x.dtype)}")
    amax_epsilon = float(amax_epsilon)
    if not (0.0 <= amax_epsilon < float("inf")):
        raise ValueError(f"block_quantize: amax_epsilon must be finite and >= 0, got {amax_epsilon}")
    out = jnp.dtype(dtype)
    if not _is_fp8(out.name):
        raise ValueError(f"block_quantize: dtype {out.name} is not an FP8 type (float8_e4m3fn, float8_e5m2)")
    r, c = x.shape
    outs = []
    if rowwise:
        outs += [jax.ShapeDtypeStruct((r, c), out),
                 jax.ShapeDtypeStruct(gemm_ready_scale_shape(r, c, block_dim), jnp.float32)]
    if columnwise:
        outs += [jax.ShapeDtypeStruct((c, r), out),
                 jax.ShapeDtypeStruct(gemm_ready_scale_shape(c, r, block_dim), jnp.float32)]
    if dbias:
        outs.append(jax.ShapeDtypeStruct((r // BLOCK_LEN, c), jnp.float32))
    register_block_quantize()
    res = list(jax.ffi.ffi_call(QUANTIZE_TARGET[0], outs)(
        *((x,) if dgelu_pre is None else (x, dgelu_pre)),
        block_dim=np.int32(block_dim),
        power_2_scale=bool(power_2_scale),
        amax_epsilon=np.float32(amax_epsilon),
        rowwise=bool(rowwise),
        columnwise=bool(columnwise),
        gelu=bool(gelu),
        dbias=bool(dbias),
        dgelu=dgelu_pre is not None,
    ))
    row = (res.pop(0), res.pop(0)) if rowwise else None
    col = (res.pop(0), res.pop(0)) if columnwise else None
    if dbias:
        return row, col, res.pop(0).sum(axis=0)
    return row, col
