"""nvte_cublas_gemm against torch in one process, on the same random torch tensors.

bf16: torch.matmul (cuBLAS); FP8 e4m3: torch._scaled_mm with fast accumulation.
Median of CUDA-event timings after warm-up, ours and torch's interleaved in rounds so
that clock and thermal drift hit both. Also checks our result against torch's.
Exit status 1 when bf16 8192^3 reaches less than 95% of torch.matmul's TFLOP/s.
"""
import argparse
import ctypes
import statistics
import sys

import torch

K_BF16, K_E4M3, K_BYTE, K_F32 = 6, 7, 0, 4


class NVTEShape(ctypes.Structure):
    _fields_ = [("data", ctypes.c_size_t * 15), ("ndim", ctypes.c_size_t)]


class NVTEBasicTensor(ctypes.Structure):
    _fields_ = [("data_ptr", ctypes.c_void_p), ("dtype", ctypes.c_int), ("shape", NVTEShape)]


class Lib:
    def __init__(self, path):
        self.l = ctypes.CDLL(path)
        self.l.nvte_create_tensor.restype = ctypes.c_void_p
        self.l.nvte_create_tensor.argtypes = [ctypes.c_int]
        self.l.nvte_destroy_tensor.argtypes = [ctypes.c_void_p]
        self.l.nvte_set_tensor_param_v2.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        self.l.nvte_comm_last_error.restype = ctypes.c_char_p
        self.l.nvte_comm_last_status.restype = ctypes.c_int
        self.l.nvte_cublas_gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_bool] * 3 + [ctypes.c_void_p] + [ctypes.c_bool] * 2 + [ctypes.c_int, ctypes.c_void_p]
        self.handles = []

    def param(self, h, which, ptr, dtype, shape):
        b = NVTEBasicTensor()
        b.data_ptr = ptr
        b.dtype = dtype
        b.shape.ndim = len(shape)
        for i, s in enumerate(shape):
            b.shape.data[i] = s
        self.l.nvte_set_tensor_param_v2(h, which, ctypes.byref(b), ctypes.sizeof(b))
        self.check("nvte_set_tensor_param_v2")

    def tensor(self, t, dtype, scale_inv=None):
        h = self.l.nvte_create_tensor(0)
        self.handles.append(h)
        self.param(h, 0, t.data_ptr(), dtype, list(t.shape))
        if scale_inv is not None:
            self.param(h, 4, scale_inv.data_ptr(), K_F32, [1])
        return h

    def check(self, what):
        if self.l.nvte_comm_last_status() != 0:
            raise RuntimeError(f"{what}: {self.l.nvte_comm_last_error().decode()}")

    def gemm(self, a, b, d, ws, fast_accum, stream):
        self.l.nvte_cublas_gemm(a, b, d, None, None, True, False, False, ws, False, not fast_accum, 0, stream)


def timed(fn, stream, iters):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    with torch.cuda.stream(stream):
        for s, e in ev:
            s.record(stream)
            fn()
            e.record(stream)
    stream.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    lib = Lib(args.lib)
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    sptr = ctypes.c_void_p(stream.cuda_stream)
    ws_t = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    ws = lib.tensor(ws_t, K_BYTE)
    rows = []
    ok = True
    shapes = [(8192, 8192, 8192), (8192, 28672, 8192), (16384, 8192, 8192)]  # tokens M x out N x in K
    for kind in ("bf16", "fp8"):
        for (M, N, K) in shapes:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            if kind == "bf16":
                a, b = lib.tensor(w, K_BF16), lib.tensor(x, K_BF16)
                ref_fn = lambda: torch.matmul(x, w.t(), out=out_ref)  # noqa: E731
                out_ref = torch.empty_like(out)
                fast = False
            else:
                one = torch.ones(1, device=dev, dtype=torch.float32)
                x8, w8 = (x / 4).to(torch.float8_e4m3fn), (w / 4).to(torch.float8_e4m3fn)
                a, b = lib.tensor(w8, K_E4M3, one), lib.tensor(x8, K_E4M3, one)
                out_ref = torch.empty_like(out)
                ref_fn = lambda: out_ref.copy_(torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True))  # noqa: E731
                fast = True
            d = lib.tensor(out, K_BF16)
            torch.cuda.synchronize()  # inputs were made on the default stream
            ours_fn = lambda: lib.gemm(a, b, d, ws, fast, sptr)  # noqa: E731
            ours_fn()
            lib.check("nvte_cublas_gemm")
            with torch.cuda.stream(stream):
                ref_fn()
            stream.synchronize()
            err = ((out.float() - out_ref.float()).norm() / out_ref.float().norm()).item()
            if kind == "fp8":
                # _scaled_mm returns a new tensor each call: time the matmul without the copy
                ref_fn = lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
            for f in (ours_fn, ref_fn):
                timed(f, stream, 10)
            t_ours, t_ref = [], []
            for _ in range(args.rounds):
                t_ours += timed(ours_fn, stream, args.iters)
                t_ref += timed(ref_fn, stream, args.iters)
            mo, mr = statistics.median(t_ours), statistics.median(t_ref)
            flop = 2.0 * M * N * K
            tf_o, tf_r = flop / mo / 1e9, flop / mr / 1e9
            ratio = tf_o / tf_r
            verdict = ""
            if kind == "bf16" and (M, N, K) == (8192, 8192, 8192):
                verdict = "PASS" if ratio >= 0.95 else "FAIL"
                ok = ok and ratio >= 0.95
            if not err < 2e-2:
                verdict += " (result mismatch)"
                ok = False
            ref_name = "torch.matmul" if kind == "bf16" else "torch._scaled_mm"
            rows.append(f"| {kind} | {M}x{N}x{K} | {tf_o:.1f} | {ref_name} {tf_r:.1f} | {ratio:.3f} | {err:.2e} | {verdict} |")
    table = "\n".join(
        ["| dtype | M x N x K | ours TFLOP/s | torch TFLOP/s | ours / torch | rel. diff | >= 95% |", "|---|---|---|---|---|---|---|"] + rows
    )
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    passed = sum("FAIL" not in r and "mismatch" not in r for r in rows)
    print(f"gemm_vs_torch: {passed} passed, {len(rows) - passed} failed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
