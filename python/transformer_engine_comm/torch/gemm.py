"""``nvte_cublas_gemm`` on torch tensors: TE's GEMM with its cuBLASLt epilogues.

:func:`gemm` computes, with TE's conventions (row-major tensors; ``m = transa ? A.size(0) :
A.size(1)``, ``k = transa ? A.size(1) : A.size(0)``, ``n = transb ? B.size(1) :
B.size(0)``; D is ``[n, m]``; "TN" = ``D = B @ A.T``, a Linear forward with A = weight):

- ``bias`` (``[m]``) added in the epilogue;
- ``gelu=True``: ``D = gelu(B·A (+ bias))`` with the pre-activation written to a second output
  (cuBLASLt's GELU_AUX(_BIAS) epilogue; tanh-approximate GELU, as TE's) -- returns ``(D, pre)``;
- ``dgelu_pre=pre``: ``D = (B·A) * gelu'(pre)`` (DGELU epilogue: the GELU backward fused
  into the dgrad GEMM), and with ``bias_grad`` (a ``[m]`` output) also ``bias_grad =
  D.sum(0)`` (DGELU_BGRAD);
- ``bias_grad`` without ``dgelu_pre``: ``bias_grad = op(B).sum over the tokens`` (``[n]``,
  BGRADB: the bias gradient beside a wgrad GEMM, ``dW = dY.T @ X`` with A = X, B = dY, NT);
- ``accumulate=True``: ``D += B·A`` (``out`` given);
- FP8 operands (TN only, Hopper): ``a_scale_inv`` / ``b_scale_inv`` one-element float32,
  ``use_split_accumulator`` chooses full-precision accumulation.

Runs asynchronously on torch's current stream, with a per-device 32 MiB workspace (TE's
size for Hopper). Used by the autograd modules where a fused epilogue saves passes over the
activations (:mod:`transformer_engine_comm.torch.modules`).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, Optional, Tuple, Union

import torch

from .. import _capi
from ._context import FP8_DTYPES, raw_stream, set_packed_operand

__all__ = ["gemm"]

_WORKSPACE_BYTES = 32 * 1024 * 1024
_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _workspace(device: torch.device, stream: int) -> int:
    """The address of the cuBLASLt workspace (_WORKSPACE_BYTES) of (device, stream): GEMMs
    on different streams may run at once, so each stream has its own (one stream reusing its
    workspace is ordered)."""
    key = (device.index, stream)
    t = _workspaces.get(key)
    if t is None:
        # setdefault: of two threads making one at once, both use the one kept.
        t = _workspaces.setdefault(key, torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device))
    return t.data_ptr()


def _dims(A: torch.Tensor, B: torch.Tensor, transa: bool, transb: bool):
    m = A.shape[0] if transa else A.shape[1]
    k = A.shape[1] if transa else A.shape[0]
    kb = B.shape[0] if transb else B.shape[1]
    n = B.shape[1] if transb else B.shape[0]
    if k != kb:
        raise ValueError(
            f"gemm: A {tuple(A.shape)} (transa={transa}) and B {tuple(B.shape)} (transb={transb}) "
            f"disagree on k: {k} vs {kb}"
        )
    return m, n, k


def _sig(t):
    return None if t is None else (t.shape, t.dtype, t.get_device())


# Prepared calls by their signature (every tensor's shape, dtype and device, every flag):
# validated once, then each call fills the data pointers and the stream into the call's
# packed argument struct and makes one C call (nvte_comm_cublas_gemm_packed: no tensor
# handles). Bounded.
_plans: Dict[tuple, "_Prepared"] = {}
_MAX_PLANS = 1024


class _Prepared:
    """One validated signature: the packed struct with the operands' dtypes and shapes and
    the flags filled in; calling it allocates the output(s), sets the pointers and the
    stream and makes the C call. A lock guards the struct (autograd's threads call too)."""

    __slots__ = ("args", "ptr", "pa", "pb", "pd", "pbias", "paux", "m", "n", "od", "fp8", "gelu", "usa", "fn",
                 "lock")

    def __init__(self, A, B, transa, transb, out, bias, gelu, dgelu_pre, bias_grad, accumulate, use_split_accumulator,
                 m, n, od, fp8, grad):
        a = _capi.GemmPacked()
        a.op = _capi.PACKED_GEMM
        set_packed_operand(a.a, None, A.shape, A.dtype)
        set_packed_operand(a.b, None, B.shape, B.dtype)
        set_packed_operand(a.d, None, (n, m), od)
        bias_t = bias if bias is not None else bias_grad
        if bias_t is not None:  # a vector of its elements, whatever its dimensions (as TE takes it)
            set_packed_operand(a.bias, None, (bias_t.numel(),), bias_t.dtype)
        if gelu:
            set_packed_operand(a.pre_act_out, None, (n, m), od)
        elif dgelu_pre is not None:
            set_packed_operand(a.pre_act_out, None, dgelu_pre.shape, dgelu_pre.dtype)
        a.transa, a.transb, a.grad, a.accumulate = bool(transa), bool(transb), bool(grad), bool(accumulate)
        self.args = a
        self.ptr = ctypes.pointer(a)
        # The embedded operand structs share the struct's memory: set through them per call.
        self.pa, self.pb, self.pd, self.pbias, self.paux = a.a, a.b, a.d, a.bias, a.pre_act_out
        self.m, self.n, self.od, self.fp8, self.gelu = m, n, od, fp8, bool(gelu)
        self.usa = bool(use_split_accumulator)
        self.fn = _capi._fn("nvte_comm_cublas_gemm_packed")
        self.lock = threading.Lock()

    def __call__(self, A, B, out, bias_t, aux_in, a_scale_inv, b_scale_inv):
        dev = A.device
        if out is None:
            out = torch.empty((self.n, self.m), dtype=self.od, device=dev)
        pre = torch.empty((self.n, self.m), dtype=self.od, device=dev) if self.gelu else None
        aux = pre if self.gelu else aux_in
        stream = raw_stream(dev.index)
        ws = _workspace(dev, stream)
        with self.lock:
            self.pa.data = A.data_ptr()
            self.pb.data = B.data_ptr()
            self.pd.data = out.data_ptr()
            if bias_t is not None:
                self.pbias.data = bias_t.data_ptr()
            if aux is not None:
                self.paux.data = aux.data_ptr()
            if self.fp8:
                self.pa.scale_inv = a_scale_inv.data_ptr()
                self.pb.scale_inv = b_scale_inv.data_ptr()
            self.args.stream = stream
            st = self.fn(self.ptr, ws, _WORKSPACE_BYTES, self.usa, 0)
            err = _capi.CommError(st, _capi.last_error(), "gemm") if st else None  # this thread's message, now
        if err is not None:
            raise err
        return (out, pre) if self.gelu else out


def gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    *,
    transa: bool,
    transb: bool,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    gelu: bool = False,
    dgelu_pre: Optional[torch.Tensor] = None,
    bias_grad: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    a_scale_inv: Optional[torch.Tensor] = None,
    b_scale_inv: Optional[torch.Tensor] = None,
    use_split_accumulator: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """TE's ``nvte_cublas_gemm`` (see the module docstring). Returns D, or ``(D, pre)`` with
    ``gelu=True``."""
    try:
        key = (_sig(A), _sig(B), transa, transb, out_dtype, _sig(out), _sig(bias), gelu, _sig(dgelu_pre),
               _sig(bias_grad), accumulate, _sig(a_scale_inv), _sig(b_scale_inv), use_split_accumulator)
        pr = _plans.get(key)
    except (AttributeError, TypeError):  # a non-tensor argument: the checks below name it
        key, pr = None, None
    if pr is None:
        m, n, od, fp8, grad = _check(A, B, transa, transb, out_dtype, out, bias, gelu, dgelu_pre, bias_grad,
                                     accumulate, a_scale_inv, b_scale_inv)
        pr = _Prepared(A, B, transa, transb, out, bias, gelu, dgelu_pre, bias_grad, accumulate, use_split_accumulator,
                       m, n, od, fp8, grad)
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = pr
    if not (A.is_contiguous() and B.is_contiguous() and _contiguous(out) and _contiguous(bias)
            and _contiguous(dgelu_pre) and _contiguous(bias_grad)):
        for name, t in (("A", A), ("B", B), ("out", out), ("bias", bias), ("dgelu_pre", dgelu_pre),
                        ("bias_grad", bias_grad)):
            if not _contiguous(t):
                hint = " (pass the other layout flag instead of a transposed view)" if name in ("A", "B") else ""
                raise ValueError(f"gemm: {name} must be contiguous{hint}")
    return pr(A, B, out, bias if bias is not None else bias_grad, dgelu_pre, a_scale_inv, b_scale_inv)


def _contiguous(t) -> bool:
    return t is None or t.is_contiguous()


def _check(A, B, transa, transb, out_dtype, out, bias, gelu, dgelu_pre, bias_grad, accumulate, a_scale_inv,
           b_scale_inv):
    """Validate a call's signature -> (m, n, the output dtype, fp8, grad)."""
    for name, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_cuda:
            raise ValueError(f"gemm: {name} must be a 2-D CUDA tensor, got {getattr(t, 'shape', type(t))}")
    for name, t in (("B", B), ("out", out), ("bias", bias), ("dgelu_pre", dgelu_pre), ("bias_grad", bias_grad),
                    ("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != A.device):
            raise ValueError(f"gemm: {name} must be a tensor on {A.device} (A's device), got "
                             f"{getattr(t, 'device', type(t))}")
    fp8 = A.dtype in FP8_DTYPES or B.dtype in FP8_DTYPES
    if fp8 and not (transa and not transb):
        raise ValueError("gemm: FP8 operands need the TN layout (transa=True, transb=False) on Hopper")
    if fp8 and (a_scale_inv is None or b_scale_inv is None):
        raise ValueError("gemm: FP8 operands need a_scale_inv and b_scale_inv")
    if fp8:
        for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
            if t.dtype != torch.float32 or t.numel() != 1:
                raise ValueError(f"gemm: {name} must be a float32 tensor with one element, got {t.dtype} "
                                 f"shape {tuple(t.shape)}")
    if gelu and dgelu_pre is not None:
        raise ValueError("gemm: gelu (forward) and dgelu_pre (backward) exclude each other")
    if bias is not None and bias_grad is not None:
        raise ValueError("gemm: bias (forward) and bias_grad (backward) exclude each other")
    if gelu and bias_grad is not None:
        raise ValueError("gemm: gelu (forward) and bias_grad (backward) exclude each other")
    m, n, _ = _dims(A, B, transa, transb)
    if out is None:
        if accumulate:
            raise ValueError("gemm: accumulate=True needs out")
        od = out_dtype or (A.dtype if not fp8 else torch.bfloat16)
        if od not in _OUT_DTYPES:
            raise ValueError(f"gemm: out_dtype must be one of {_OUT_DTYPES}, got {od}")
    elif tuple(out.shape) != (n, m):
        raise ValueError(f"gemm: out must be a contiguous [{n}, {m}] tensor, got {tuple(out.shape)}")
    elif out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"gemm: out is {out.dtype} but out_dtype is {out_dtype}")
    else:
        od = out.dtype
    if dgelu_pre is not None and tuple(dgelu_pre.shape) != (n, m):
        raise ValueError(f"gemm: dgelu_pre must be a contiguous [{n}, {m}] tensor, got {tuple(dgelu_pre.shape)}")
    # TE's lengths: the bias and DGELU's bias gradient have m elements, BGRADB's (a wgrad's
    # bias gradient, over op(B)'s rows) n.
    want = n if (bias_grad is not None and dgelu_pre is None) else m
    for name, t in (("bias", bias), ("bias_grad", bias_grad)):
        if t is not None and t.numel() != want:
            raise ValueError(f"gemm: {name} must be a contiguous tensor of {want} elements, got {tuple(t.shape)}")
    grad = dgelu_pre is not None or bias_grad is not None
    return m, n, od, fp8, grad
