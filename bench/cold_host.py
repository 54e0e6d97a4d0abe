"""Host cost of one GEMM launch when the CPU's caches are cold (as inside a training step,
where Python and torch run between the library's calls) and warm (back to back): torch.mm,
the library's gemm (cuBLASLt; a repeated call replays its CUDA graph unless
NVTE_COMM_GEMM_GRAPHS=0), our own kernel's path (a small GEMM), and torch's CUDA graph replay
of the same GEMM. Each call is timed alone (perf_counter around it), after a synchronisation;
"cold": 32 MiB of host memory copied and 40 small torch ops run before it; "light": only the
40 torch ops. Median of --reps. Prints a table."""
import argparse
import os
import statistics
import time

import torch

from transformer_engine_comm.torch.gemm import gemm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    x = torch.randn(8192, 4096, device=dev, dtype=bf)
    w = torch.randn(4096, 4096, device=dev, dtype=bf)
    xs = torch.randn(2048, 512, device=dev, dtype=bf)
    ws = torch.randn(512, 512, device=dev, dtype=bf)
    out = torch.empty(8192, 4096, device=dev, dtype=bf)
    src, dst = bytearray(32 << 20), bytearray(32 << 20)
    small = [torch.empty(16) for _ in range(4)]

    def light():
        for _ in range(10):
            for t in small:
                t.add_(1.0)

    def cold():
        dst[:] = src
        light()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.mm(x, w.t(), out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.mm(x, w.t(), out=out)
    torch.cuda.synchronize()

    graphs = os.environ.get("NVTE_COMM_GEMM_GRAPHS", "on")
    cases = [
        ("torch.mm 8192x4096x4096", lambda: torch.mm(x, w.t(), out=out)),
        (f"library gemm TN 8192x4096x4096 (graphs {graphs})", lambda: gemm(w, x, transa=True, transb=False, out=out)),
        ("CUDA graph replay of the torch.mm", lambda: g.replay()),
        ("torch.mm 2048x512x512", lambda: torch.mm(xs, ws.t())),
        ("library gemm TN 2048x512x512 (own kernel)", lambda: gemm(ws, xs, transa=True, transb=False)),
    ]
    rows = []
    for name, fn in cases:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        res = {}
        for mode, prep in (("warm", None), ("light", light), ("cold", cold)):
            ts = []
            for _ in range(a.reps):
                torch.cuda.synchronize()
                if prep:
                    prep()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            res[mode] = statistics.median(ts) * 1e6
        rows.append((name, res))
    print(f"device {torch.cuda.get_device_name()}; host us per call, median of {a.reps}")
    print("| call | warm | light (40 torch ops before) | cold (+32 MiB copied) |")
    print("|---|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['warm']:.1f} | {r['light']:.1f} | {r['cold']:.1f} |")


if __name__ == "__main__":
    main()
