"""bench/acceptance.py on tables in the benchmarks' formats (host only)."""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("te_comm_acceptance", os.path.join(REPO, "bench", "acceptance.py"))
acc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(acc)

COMM_GEMM = """| tp | transport | op | dtype | M x K x N | GEMM ms | NCCL ms | NCCL+GEMM ms | ours ms | ours/bound | ours/(NCCL+GEMM) |
|---|---|---|---|---|---|---|---|---|---|---|
| 2 | ipc | AG | bf16 | 8192x8192x28672 | 2.000 | 0.300 | 2.300 | 2.020 | 1.010 | 0.878 |
| 2 | ipc | AG | bf16 | 8192x4096x16384 | 1.000 | 0.200 | 1.200 | 1.120 | 1.120 | 0.933 |
| 2 | ipc | AR | bf16 | 8192x28672x8192 | 3.000 | 0.500 | 3.500 | 3.150 | 1.050 | 0.900 |
| 2 | ipc | AR | bf16 | 8192x16384x4096 | 1.000 | 0.300 | 1.300 | 1.100 | 1.100 | 0.846 |
"""

JAX = """tp = 2 (NVIDIA H200), bf16, jax 0.11.2; ms = median of 9 rounds

| op | tokens x K x N | ours ms | XLA ms | XLA windowed ms | GEMM ms | coll ms | ours/bound | XLA/bound | windowed/bound | rel err vs XLA |
|---|---|---|---|---|---|---|---|---|---|---|
| AG | 8192x8192x14336 | 2.948 | 3.118 | 3.512 | 2.804 | 0.380 | 1.051 | 1.112 | 1.252 | 0.0e+00 |
| RS | 8192x14336x8192 | - | 3.072 | 3.283 | 2.804 | 0.355 | - | 1.095 | 1.171 | 0.0e+00 |
"""

OVERLAP = """| tp | dtype | op | M x K x N | algorithm | GEMM ms | GEMM in tp chunks ms | NCCL ms | NCCL+GEMM ms | ours ms | ours/bound | ours/(NCCL+GEMM) |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 4 | bf16 | RS | 8192x28672x8192 | ring RS (CE) | 1.000 | 1.000 | 0.400 | 1.400 | 1.200 | 1.200 | 0.857 |
| 4 | bf16 | RS | 8192x28672x8192 | ring RS accumulate (CE) | 1.000 | 1.000 | 0.400 | 1.400 | 1.030 | 1.030 | 0.736 |

| dtype op algorithm | geomean ours/bound |
|---|---|
| bf16 RS ring RS (CE) | 1.200 |
"""

TORCH = """| op | M x K x N | ours ms | nccl+mm ms | symm-mem ms | gemm ms | coll ms | bound ms | ours/bound | nccl+mm/bound | symm/bound | ours err | symm err |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
| AG | 8192x8192x(28672/2) | 2.731 | 2.862 | 2.839 | 2.462 | 0.328 | 2.462 | 1.109 | 1.162 | 1.153 | 1e-3 | 1e-3 |
| AG | 8192x4096x(16384/2) | error: CommError: timeout | 0.915 | 0.919 | 0.826 | 0.184 | 0.826 | - | 1.108 | 1.112 | - | 1e-3 |
| RS | 8192x(28672/2)x8192 | 3.038 | 2.977 | 3.003 | 2.812 | 0.362 | 2.812 | 1.080 | 1.059 | 1.068 | 1e-3 | 1e-3 |
| AG geomean | | | | | | | | 1.109 | | | | |
"""


def test_groups_verdicts_and_the_torch_comparison(tmp_path):
    paths = []
    for name, text in [("bench_comm_gemm_tp2.md", COMM_GEMM), ("bench_overlap_tp4.md", OVERLAP),
                       ("torch_ops_tp2.md", TORCH), ("jax_ops.md", JAX)]:
        p = tmp_path / name
        p.write_text(text)
        paths.append(str(p))
    out = acc.report(paths)
    lines = out.splitlines()

    def row(*cells):
        hits = [ln for ln in lines if all(f"| {c} |" in ln for c in cells)]
        assert len(hits) == 1, (cells, out)
        return hits[0]

    # AG: geomean sqrt(1.01 * 1.12) = 1.064 > 1.05 and worst 1.12 > 1.10: not met.
    assert "| 2 | 0 | 1.064 | 1.120 | NOT met |" in row("bench_comm_gemm", "2", "ipc", "AG")
    # AR: geomean sqrt(1.05 * 1.10) = 1.075 <= 1.10: met (no worst bound for AR).
    assert "| 2 | 0 | 1.075 | 1.100 | met |" in row("bench_comm_gemm", "2", "ipc", "AR")
    # bench_overlap: per algorithm, and the best algorithm per shape (tp from the rows).
    assert "NOT met" in row("bench_overlap", "4", "ring RS (CE)")
    assert "| 1 | 0 | 1.030 | 1.030 | met |" in row("bench_overlap", "4", "best algorithm")
    # torch_ops: tp from the file name, the writer's ratio column, geomean rows skipped; a
    # failed shape counts against its group; slower than symm-mem on RS.
    assert "| 2 | 1 | 1.109 | 1.109 | NOT met |" in row("torch_ops", "2", "AG")
    assert "ours faster on 1 of 3" in out and "RS 8192x(28672/2)x8192 (3.038 vs 3.003 ms)" in out
    # jax_ops: tp from the caption; its RS shape failed ("-").
    assert "| 1 | 0 | 1.051 | 1.051 | NOT met |" in row("jax_ops", "2", "AG")
    assert "| 1 | 1 | nan | nan | NOT met |" in row("jax_ops", "2", "RS")
    assert "groups meeting the bar: 3 of 9" in out
    # The default against NCCL then GEMM: every bench_comm_gemm row and torch_ops' rows
    # (bench_overlap's rows name their algorithm: not the default); torch's failed AG and
    # slower RS count against it.
    assert "no slower than the collective then the GEMM (NCCL+GEMM): on 5 of 7 rows" in out
    assert "torch_ops tp 2 - bf16 RS 8192x(28672/2)x8192 (3.038 vs 2.977 ms)" in out
    assert "torch_ops tp 2 - bf16 AG 8192x4096x(16384/2) (nan vs 0.915 ms)" in out
    assert "best algorithm" in lines[-1]


def test_no_rows(tmp_path):
    p = tmp_path / "empty.md"
    p.write_text("nothing here\n")
    assert "no benchmark rows found" in acc.report([str(p)])
