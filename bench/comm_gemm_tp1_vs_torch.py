"""The comm-GEMM calls at tp 1 against torch.mm on the six GEMMs of the training step.

One process, one GPU, a comm-GEMM context of one rank (nvte_comm_gemm_ctx_create_bootstrap
with trivial callbacks, the IPC transport): at tp 1 nothing is communicated, so each call
must be as fast as torch's GEMM of the same operands. The six GEMMs of a LayerNormMLP step
(bf16, tokens T, hidden H, ffn F; defaults 8192, 4096, 16384), in nvte_cublas_gemm's terms
(D [n, m] = op(B) op(A)):

  fc1 fwd    TN  x [T, H] . W1 [F, H]^T   -> [T, F]   nvte_all_gather_gemm
  fc2 fwd    TN  h [T, F] . W2 [H, F]^T   -> [T, H]   nvte_gemm_reduce_scatter, nvte_gemm_all_reduce
  fc2 dgrad  NN  dy [T, H] . W2 [H, F]    -> [T, F]   nvte_all_gather_gemm (NN)
  fc1 dgrad  NN  dh [T, F] . W1 [F, H]    -> [T, H]   nvte_gemm_reduce_scatter, nvte_gemm_all_reduce (NN)
  fc2 wgrad  NT  dy^T [H, T] . h [T, F]   -> [H, F]   nvte_all_gather_gemm (NT)
  fc1 wgrad  NT  dh^T [F, T] . x [T, H]   -> [F, H]   nvte_all_gather_gemm (NT)

and nvte_cublas_gemm beside them. Per GEMM: a warm-up of every candidate (the library's
first call of a shape picks its algorithm, NVTE_COMM_GEMM_TUNE), then rounds in which each
candidate runs `iters` times back to back on one stream, each timed with CUDA events; the
median per candidate. Results are checked against torch's (relative Frobenius error).
PASS when every comm-GEMM call's median is within `--bar` (default 1.02) of torch.mm's;
exit status 1 otherwise.
"""
import argparse
import ctypes
import statistics
import sys

import torch

# The ctypes binding, tensor descriptions and event timer of the nvte_cublas_gemm benchmark
# beside this script (bench/ is on sys.path when a script of it runs).
from gemm_vs_torch import K_BF16, K_BYTE, Lib as GemmLib, timed

ALLGATHER = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                             ctypes.c_size_t)
BARRIER = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)


class Bootstrap(ctypes.Structure):
    _fields_ = [("world_rank", ctypes.c_int32), ("world_size", ctypes.c_int32), ("nccl_comm", ctypes.c_void_p),
                ("allgather", ALLGATHER), ("barrier", BARRIER), ("user_data", ctypes.c_void_p)]


@ALLGATHER
def _allgather(_user, dst, _dst_bytes, src, n):  # one rank: the gathered data is its own
    ctypes.memmove(dst, src, n)
    return 0


@BARRIER
def _barrier(_user):
    return 0


class Lib(GemmLib):
    """gemm_vs_torch's binding plus the comm-GEMM API (a one-rank callback context)."""

    def __init__(self, path):
        super().__init__(path)
        l = self.l
        l.nvte_comm_gemm_ctx_create_bootstrap.argtypes = [ctypes.POINTER(Bootstrap), ctypes.POINTER(ctypes.c_void_p)]
        l.nvte_comm_gemm_ctx_create_bootstrap.restype = ctypes.c_int
        l.nvte_comm_gemm_ctx_destroy.argtypes = [ctypes.c_void_p]
        for f in ("nvte_all_gather_gemm", "nvte_gemm_reduce_scatter", "nvte_gemm_all_reduce"):
            getattr(l, f).argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 5 + \
                [ctypes.c_bool] * 4 + [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int]
            getattr(l, f).restype = None

    def ctx(self):
        bs = Bootstrap(0, 1, None, _allgather, _barrier, None)
        out = ctypes.c_void_p()
        if self.l.nvte_comm_gemm_ctx_create_bootstrap(ctypes.byref(bs), ctypes.byref(out)) != 0:
            raise RuntimeError(self.l.nvte_comm_last_error().decode())
        self._bs = bs  # the callbacks must outlive the context
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bar", type=float, default=1.02)
    ap.add_argument("--out")
    args = ap.parse_args()
    T, H, F = args.tokens, args.hidden, args.ffn
    lib = Lib(args.lib)
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    stream = torch.cuda.Stream(dev)
    sp = ctypes.c_void_p(stream.cuda_stream)
    ws_t = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    ws = lib.tensor(ws_t, K_BYTE)
    ctx = lib.ctx()
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, device=dev, dtype=bf) / 8  # noqa: E731
    x, h, dy, dh = r(T, H), r(T, F), r(T, H), r(T, F)
    w1, w2 = r(F, H), r(H, F)
    L = lib.l
    # name, layout, A, transa, B, transb, m, n, k, torch.mm's operands, comm-GEMM calls
    gemms = [
        ("fc1 fwd", "TN", w1, True, x, False, F, T, H, (x, w1.t()), ["ag"]),
        ("fc2 fwd", "TN", w2, True, h, False, H, T, F, (h, w2.t()), ["rs", "ar"]),
        ("fc2 dgrad", "NN", w2, False, dy, False, F, T, H, (dy, w2), ["ag"]),
        ("fc1 dgrad", "NN", w1, False, dh, False, H, T, F, (dh, w1), ["rs", "ar"]),
        ("fc2 wgrad", "NT", h, False, dy, True, F, H, T, (dy.t(), h), ["ag"]),
        ("fc1 wgrad", "NT", x, False, dh, True, H, F, T, (dh.t(), x), ["ag"]),
    ]
    fns = {"ag": L.nvte_all_gather_gemm, "rs": L.nvte_gemm_reduce_scatter, "ar": L.nvte_gemm_all_reduce}
    names = {"ag": "nvte_all_gather_gemm", "rs": "nvte_gemm_reduce_scatter", "ar": "nvte_gemm_all_reduce"}
    rows, ok = [], True
    for (name, layout, A, ta, B, tb, m, n, k, (lhs, rhs), ops) in gemms:
        out_ref = torch.empty(n, m, device=dev, dtype=bf)
        torch.cuda.synchronize()
        ha, hb = lib.tensor(A, K_BF16), lib.tensor(B, K_BF16)
        cands = {"torch.mm": lambda lhs=lhs, rhs=rhs, o=out_ref: torch.mm(lhs, rhs, out=o)}
        outs = {}
        d_gemm = torch.empty(n, m, device=dev, dtype=bf)
        hd_gemm = lib.tensor(d_gemm, K_BF16)
        cands["nvte_cublas_gemm"] = (lambda ha=ha, hb=hb, hd=hd_gemm, ta=ta, tb=tb:
                                     L.nvte_cublas_gemm(ha, hb, hd, None, None, ta, tb, False, ws, False, True, 0, sp))
        outs["nvte_cublas_gemm"] = d_gemm
        for op in ops:
            d = torch.empty(n, m, device=dev, dtype=bf)
            hd = lib.tensor(d, K_BF16)
            cands[names[op]] = (lambda f=fns[op], ha=ha, hb=hb, hd=hd, ta=ta, tb=tb, m=m, n=n, k=k:
                                f(ctx, m, n, k, ha, hb, hd, None, None, ta, tb, False, False, 0, sp, 1))
            outs[names[op]] = d
        for c, fn in cands.items():  # warm-up (the library picks its algorithm here)
            with torch.cuda.stream(stream):
                fn()
            if c != "torch.mm":
                lib.check(c)
            stream.synchronize()
        times = {c: [] for c in cands}
        for _ in range(args.rounds):
            for c, fn in cands.items():
                times[c] += timed(fn, stream, args.iters)
                if c != "torch.mm":
                    lib.check(c)
        med = {c: statistics.median(t) for c, t in times.items()}
        ref = out_ref.float()
        for c in cands:
            if c == "torch.mm":
                continue
            err = ((outs[c].float() - ref).norm() / ref.norm()).item()
            ratio = med[c] / med["torch.mm"]
            bar_ok = c == "nvte_cublas_gemm" or ratio <= args.bar
            verdict = ("PASS" if ratio <= args.bar else "FAIL") if c != "nvte_cublas_gemm" else "-"
            if not err < 1e-2:
                verdict += " (result mismatch)"
                bar_ok = False
            ok = ok and bar_ok
            tf = 2.0 * m * n * k / med[c] / 1e9
            rows.append(f"| {name} | {layout} | {m}x{n}x{k} | {c} | {med[c]:.3f} | {med['torch.mm']:.3f} | {ratio:.3f} | "
                        f"{tf:.0f} | {err:.1e} | {verdict} |")
    L.nvte_comm_gemm_ctx_destroy(ctx)
    for hnd in lib.handles:
        L.nvte_destroy_tensor(hnd)
    table = "\n".join([f"| GEMM | layout | m x n x k | call | ms (median) | torch.mm ms | / torch | TFLOP/s | rel. diff | "
                       f"<= {args.bar} |", "|---|---|---|---|---|---|---|---|---|---|"] + rows)
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; tp 1, T={T} H={H} F={F}, bf16")
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    failed = sum(("FAIL" in r_) or ("mismatch" in r_) for r_ in rows)
    print(f"comm_gemm_tp1_vs_torch: {len(rows) - failed} passed, {failed} failed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
