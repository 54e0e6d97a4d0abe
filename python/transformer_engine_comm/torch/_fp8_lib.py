"""The library backend of :mod:`transformer_engine_comm.torch.fp8` for CUDA tensors: each
primitive is one library call (``nvte_quantize_v2``, ``nvte_compute_amax``,
``nvte_compute_scale_from_amax``, ``nvte_delayed_scaling_recipe_amax_and_scale_update``,
``nvte_transpose``, ``nvte_dequantize``) on torch's current stream.

Cheap to call: the ctypes functions are looked up once, and the NVTETensor handles
(which only hold device addresses, dtypes and shapes) come from the package's one handle
cache, keyed by exactly those values, so a training step that casts the same buffers
again creates none.
"""
from __future__ import annotations

import collections
import ctypes
import threading

import torch

from .. import _capi
from ._context import NVTE_DTYPES as _DT, handle_cache, raw_stream

_P = _capi.TensorParam
_F32 = int(_capi.DType.kNVTEFloat32)


def _buf(t):
    return (t.data_ptr(), int(_DT[t.dtype]), tuple(t.shape)) if t is not None else (0, _F32, (0,))


def _scalar(t):
    return (t.data_ptr() if t is not None else 0, _F32, (1,))


class Backend:
    """What :func:`transformer_engine_comm.torch.fp8._library` returns."""

    def __init__(self):
        lib = _capi.lib()
        self._lib = lib
        self._h = handle_cache.described  # handles by description (pointer, dtype, shape, params)
        self._q = lib.nvte_quantize_v2
        self._amax = lib.nvte_compute_amax
        self._scale = lib.nvte_compute_scale_from_amax
        self._ds = lib.nvte_delayed_scaling_recipe_amax_and_scale_update
        self._tr = lib.nvte_transpose
        self._dq = lib.nvte_dequantize
        self._err = lib.nvte_comm_last_status
        self._configs = {}
        self._gemm = lib.nvte_cublas_gemm
        self._blocks = collections.OrderedDict()  # block-scaled handles by description (LRU)
        self._blocks_lock = threading.Lock()
        self.has_block = _block_tensors_supported(lib)
        # Whether nvte_quantize casts into block tensors: None until the first block cast
        # tells (fp8.quantize_block sets it; False: the torch arithmetic writes them).
        self.block_quantize = None
        # The GEMM cannot be probed without a GPU call: a library whose block tensors exist
        # but whose GEMM refuses them reports that error from the first block GEMM.
        self.has_block_gemm = self.has_block
        # nvte_comm_cast_packed (a module's cast in one foreign call; None: older library)
        self.cast_packed = lib.nvte_comm_cast_packed if _capi.has_function("nvte_comm_cast_packed") else None

    def cast_plan(self, fp8_dtype, scale, amax, history=None, algo="max", margin=0.0, epsilon=0.0, pow2=False):
        """A :class:`CastPlan` of one scaling state (its scale, amax and, for delayed
        scaling, amax history), or None without nvte_comm_cast_packed."""
        if self.cast_packed is None:
            return None
        return CastPlan(self.cast_packed, fp8_dtype, scale, amax, history, algo, margin, epsilon, pow2)

    def _check(self, what):
        if self._err() != 0:
            _capi.check_last(what)

    def _config(self, epsilon: float, pow2: bool):
        key = (float(epsilon), bool(pow2))
        c = self._configs.get(key)
        if c is None:
            c = _capi.QuantizationConfig(force_pow_2_scales=pow2, amax_epsilon=epsilon)
            self._configs[key] = c
        return c.handle

    def _in(self, x):
        return self._h((_buf(x),))

    @staticmethod
    def _stream(x):
        # torch's current stream on x's device (0, the legacy default stream, as None).
        return raw_stream(x.get_device()) or None

    def quantize(self, x, fp8_dtype, scale, amax, scale_inv, rowwise, columnwise):
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else (1 if x.dim() == 0 else 0)
        cols = x.shape[-1] if x.dim() else 1
        q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if rowwise else None
        q_t = torch.empty((cols, rows), dtype=fp8_dtype, device=x.device) if columnwise else None
        dt = int(_DT[fp8_dtype])
        key = (
            (q.data_ptr() if q is not None else 0, dt, tuple(x.shape)),
            (_P.kNVTEColumnwiseData, (q_t.data_ptr() if q_t is not None else 0, dt, (cols, rows))),
            (_P.kNVTEScale, _scalar(scale)),
            (_P.kNVTEAmax, _scalar(amax)),
            (_P.kNVTERowwiseScaleInv, _scalar(scale_inv)),
        )
        self._q(self._in(x), self._h(key), None, self._stream(x))
        self._check("quantize")
        if x.numel() == 0 and scale_inv is not None:
            # An empty input launches nothing in the library (as TE's nvte_quantize); the
            # cast's scale_inv is still 1 / scale, as the reference writes it.
            torch.reciprocal(scale, out=scale_inv)
        return q, q_t

    def compute_amax(self, x, amax):
        key = ((0, int(_capi.DType.kNVTEFloat8E4M3), (0,)), (_P.kNVTEAmax, _scalar(amax)))
        self._amax(self._in(x), self._h(key), self._stream(x))
        self._check("compute_amax")
        return amax

    def compute_scale_from_amax(self, amax, fp8_dtype, scale, epsilon, pow2):
        # The rowwise data only carries the FP8 type (an empty buffer).
        key = ((0, int(_DT[fp8_dtype]), (0,)), (_P.kNVTEAmax, _scalar(amax)), (_P.kNVTEScale, _scalar(scale)))
        self._scale(self._h(key), self._config(epsilon, pow2), self._stream(amax))
        self._check("compute_scale_from_amax")
        return scale

    def delayed_scaling_update(self, amax_history, scale, fp8_dtype, margin, algo):
        h = self._in(amax_history)
        s = self._in(scale.reshape(-1))
        self._ds(h, s, h, s, algo.encode(), int(_DT[fp8_dtype]), float(margin), self._stream(amax_history))
        self._check("delayed_scaling_update")

    def transpose(self, x2d):
        out = torch.empty((x2d.shape[1], x2d.shape[0]), dtype=x2d.dtype, device=x2d.device)
        self._tr(self._in(x2d), self._in(out), self._stream(x2d))
        self._check("transpose")
        return out

    def dequantize(self, q, scale_inv, dtype):
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        key = (_buf(q), (_P.kNVTERowwiseScaleInv, _scalar(scale_inv)))
        self._dq(self._h(key), self._in(out), self._stream(q))
        self._check("dequantize")
        return out


    # ---------------------------------------------------------------- block scaling

    def _block_handle(self, block_dim, fp8_dt, q, si, qt, sit):
        """An NVTE_BLOCK_SCALING_1D/2D handle (TE's layout: rowwise data [rows, cols],
        columnwise data [cols, rows], each with its GEMM-ready float32 scale_inv), cached by
        its description; the least recently used beyond 512 are destroyed."""
        parts = tuple(
            (int(param), t.data_ptr(), dt, tuple(t.shape))
            for param, t, dt in ((_P.kNVTERowwiseData, q, fp8_dt), (_P.kNVTERowwiseScaleInv, si, _F32),
                                 (_P.kNVTEColumnwiseData, qt, fp8_dt), (_P.kNVTEColumnwiseScaleInv, sit, _F32))
            if t is not None)
        key = (block_dim, parts)
        with self._blocks_lock:
            h = self._blocks.get(key)
            if h is not None:
                self._blocks.move_to_end(key)
                return h._handle
        mode = _capi.ScalingMode.NVTE_BLOCK_SCALING_1D if block_dim == 1 else _capi.ScalingMode.NVTE_BLOCK_SCALING_2D
        raw = self._lib.nvte_create_tensor(int(mode))
        if not raw:
            _capi._raise_last("nvte_create_tensor(block scaling)")
        h = _capi.Tensor.from_handle(raw)
        try:
            for param, ptr, dt, shape in parts:
                h.set_param(param, ptr, dt, shape)
        except BaseException:
            h.close()
            raise
        with self._blocks_lock:
            self._blocks[key] = h
            while len(self._blocks) > 512:
                self._blocks.popitem(last=False)[1].close()
        return h._handle

    def quantize_block(self, x2, fp8_dtype, block_dim, rowwise, columnwise, pow2, eps):
        """``nvte_quantize_v2`` of the 2-D ``x2`` into a block-scaled tensor -> (q, scale_inv,
        q_t, scale_inv_t), the forms not asked for None."""
        from .fp8 import block_scale_shape

        rows, cols = x2.shape
        dev = x2.device
        q = torch.empty((rows, cols), dtype=fp8_dtype, device=dev) if rowwise else None
        si = (torch.empty(block_scale_shape(rows, cols, block_dim), dtype=torch.float32, device=dev)
              if rowwise else None)
        qt = torch.empty((cols, rows), dtype=fp8_dtype, device=dev) if columnwise else None
        sit = (torch.empty(block_scale_shape(rows, cols, block_dim, columnwise=True), dtype=torch.float32,
                           device=dev) if columnwise else None)
        if rows and cols:
            out = self._block_handle(block_dim, int(_DT[fp8_dtype]), q, si, qt, sit)
            self._q(self._in(x2), out, self._config(eps, pow2), self._stream(x2))
            self._check("quantize_block")
        return q, si, qt, sit

    def block_gemm(self, a, b, out_dtype, bias=None, dgelu_pre=None):
        """``a @ b^T (+ bias)`` of two block operands (rowwise forms) by TE's TN
        nvte_cublas_gemm (A = b [N, K], B = a [M, K], D [M, N]; the bias [N] or DGELU with
        ``dgelu_pre`` [M, N] in the epilogue), split accumulation, 32 MiB workspace."""
        from .gemm import _WORKSPACE_BYTES, _workspace

        m, n = a.data.shape[0], b.data.shape[0]
        dev = a.data.device
        out = torch.empty((m, n), dtype=out_dtype, device=dev)
        dt = int(_DT[a.data.dtype])
        ha = self._block_handle(b.block_dim, int(_DT[b.data.dtype]), b.data, b.scale_inv, None, None)
        hb = self._block_handle(a.block_dim, dt, a.data, a.scale_inv, None, None)
        hd = self._h(((out.data_ptr(), int(_DT[out_dtype]), (m, n)),))
        stream = self._stream(a.data)
        ws = self._h(((_workspace(dev, stream or 0), int(_capi.DType.kNVTEByte), (_WORKSPACE_BYTES,)),))
        hbias = self._in(bias.reshape(-1)) if bias is not None else None
        hpre = self._in(dgelu_pre) if dgelu_pre is not None else None
        grad = dgelu_pre is not None
        self._gemm(ha, hb, hd, hbias, hpre, True, False, grad, ws, False, True, 0, stream)
        self._check("block_gemm")
        return out


_INT_DT = {t: int(d) for t, d in _DT.items()}  # torch dtype -> NVTEDType value


class CastPlan:
    """The packed struct of one scaling state's casts (nvte_comm_cast_packed): the FP8
    dtype, the scale / amax / history pointers and the recipe's options filled in once;
    a call sets the steps, the input, the outputs, the scale_inv and the stream and makes
    one foreign call. A lock guards the struct (autograd's threads cast too)."""

    __slots__ = ("args", "ptr", "fn", "lock")

    def __init__(self, fn, fp8_dtype, scale, amax, history, algo, margin, epsilon, pow2):
        a = _capi.CastPacked()
        a.fp8_dtype = _INT_DT[fp8_dtype]
        a.scale = scale.data_ptr()
        a.amax = amax.data_ptr()
        if history is not None:
            a.amax_history = history.data_ptr()
            a.history_len = history.numel()
            a.amax_compute_algo = 1 if algo == "max" else 0
            a.margin = float(margin)
        a.amax_epsilon = float(epsilon)
        a.force_pow_2_scales = bool(pow2)
        self.args = a
        self.ptr = ctypes.pointer(a)
        self.fn = fn
        self.lock = threading.Lock()

    def __call__(self, steps, x, rows, cols, q, q_t, scale_inv, stream):
        """Run ``steps`` (the CAST_* bits) on the contiguous CUDA tensor ``x`` ([rows, cols]
        flattened) into ``q`` / ``q_t`` (None: not written) and ``scale_inv``."""
        with self.lock:
            a = self.args
            a.steps = steps
            a.input = x.data_ptr()
            a.input_dtype = _INT_DT[x.dtype]
            a.rows, a.cols = rows, cols
            a.rowwise = q.data_ptr() if q is not None else None
            a.columnwise = q_t.data_ptr() if q_t is not None else None
            a.scale_inv = scale_inv.data_ptr()
            a.stream = stream
            st = self.fn(self.ptr)
            err = _capi.CommError(st, _capi.last_error(), "cast") if st else None  # this thread's message, now
        if err is not None:
            raise err


def _block_tensors_supported(lib) -> bool:
    """Whether the library creates NVTE_BLOCK_SCALING_1D tensors (older builds refuse them:
    a NULL handle and a recorded error, cleared here)."""
    try:
        h = lib.nvte_create_tensor(int(_capi.ScalingMode.NVTE_BLOCK_SCALING_1D))
    except Exception:  # noqa: BLE001
        return False
    ok = bool(h) and lib.nvte_comm_last_status() == 0
    if h:
        lib.nvte_destroy_tensor(h)
    return ok


def backend():
    """A :class:`Backend`, or None when the loaded library lacks the quantization API."""
    try:
        if not all(_capi.has_function(f) for f in (
                "nvte_quantize_v2", "nvte_compute_amax", "nvte_compute_scale_from_amax",
                "nvte_delayed_scaling_recipe_amax_and_scale_update", "nvte_transpose")):
            return None
        return Backend()
    except _capi.CommError:
        return None
