"""One-GPU probe of what a GEMM + reduce-scatter / all-reduce pays besides its GEMM.

For the reduce-scatter anchor shapes at tp 2 and 4 (per-rank K = K / tp), bf16, on one
GPU, CUDA events, median of rounds after warm-up, random data:
- gemm:    the rank's whole GEMM [n, k] x [k, m]
- chunks:  the same as tp GEMMs of n / tp rows (the ring's per-destination GEMMs)
- acc:     the tp row GEMMs where all but the first add a partial already in memory
           (beta = 1, in place: the accumulating ring's extra read of C)
- reduce:  the ring's closing reduction: tp partials [n / tp, m] summed into one
- contend: the tp row GEMMs while a second stream copies the bytes a rank pushes and
           receives ((tp - 1) / tp of the partials), i.e. the HBM traffic of the pushes
The ring reduce-scatter as built pays about chunks (+ contention) + reduce; an
accumulating ring pays about acc (+ contention) and one piece's transfer.
"""
import argparse
import statistics

import torch

RS = [(8192, 28672, 8192), (8192, 16384, 4096), (16384, 8192, 8192)]


def timed(fn, stream, rounds, reps=3):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(reps):
            fn()
        b.record(stream)
        b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device("cuda")
    s = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    print(f"device: {torch.cuda.get_device_name()}")
    print("| tp | tokens x K x N | gemm ms | chunks ms | acc ms | reduce ms | contend ms | ring est. | acc-ring est. |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp in (2, 4):
        for n, kfull, m in RS:
            k = kfull // tp
            nc = n // tp
            g = torch.Generator(device=dev).manual_seed(7)
            b = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g)
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            d = torch.empty(n, m, device=dev, dtype=torch.bfloat16)
            parts = torch.randn(tp, nc, m, device=dev, dtype=torch.bfloat16, generator=g)
            out = torch.empty(nc, m, device=dev, dtype=torch.bfloat16)
            push_elems = (tp - 1) * nc * m
            src = torch.randn(push_elems, device=dev, dtype=torch.bfloat16, generator=g)
            dst = torch.empty_like(src)
            rows = [(i * nc, (i + 1) * nc) for i in range(tp)]

            def full():
                torch.matmul(b, a.t(), out=d)

            def chunks():
                for lo, hi in rows:
                    torch.matmul(b[lo:hi], a.t(), out=d[lo:hi])

            acc_c = d.view(tp, nc, m)

            def acc():
                torch.matmul(b[0:nc], a.t(), out=acc_c[0])
                for i in range(1, tp):
                    acc_c[i].addmm_(b[i * nc:(i + 1) * nc], a.t())

            def reduce():
                torch.sum(parts, dim=0, out=out)

            def contend():
                side.wait_stream(s)
                with torch.cuda.stream(side):
                    dst.copy_(src)
                chunks()
                s.wait_stream(side)

            t = {f.__name__: timed(f, s, args.rounds) for f in (full, chunks, acc, reduce, contend)}
            ring = t["contend"] + t["reduce"]
            acc_ring = t["contend"] - t["chunks"] + t["acc"]
            print(
                f"| {tp} | {n}x{kfull}x{m} | {t['full']:.3f} | {t['chunks']:.3f} | {t['acc']:.3f} | "
                f"{t['reduce']:.3f} | {t['contend']:.3f} | {ring / t['full']:.3f} | {acc_ring / t['full']:.3f} |"
            )


if __name__ == "__main__":
    main()
