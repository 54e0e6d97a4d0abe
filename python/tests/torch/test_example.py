"""examples/pytorch/layer_with_overlap.py.

GPU tests (under torchrun, scripts/torch-gpu.sh; they skip themselves elsewhere), run
in-process (the example is itself a torchrun program): train() trains a few iterations with
comm overlap and again without (--no-comm-overlap, the reference build); the loss curves
must agree iteration by iteration (relative difference within tolerance), be finite and
fall. Covers tp = world (bf16, --fp8 with both recipes), the fused dgrad GEMM+RS flag,
--num-replicas 2 (TP groups of world/2 ranks, DistributedDataParallel over the DP groups) on
4+ ranks, --cuda-graph (the graphed overlap build against the eager reference) and
--profile (the step breakdown's figures on a real trace).

Host tests (torch on the CPU, no GPU): the RESULT / PROFILE lines, the flag checks, the
step breakdown's arithmetic on a synthetic profiler trace, and the example's CPU smoke run
(--device cpu --no-comm-overlap, bf16 and --fp8) in a subprocess.
"""

import importlib.util
import math
import os
import re
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch, "cuda"):  # without torch, "torch" is this folder (a namespace package)
    pytest.skip("torch is not installed", allow_module_level=True)

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
EXAMPLE = os.path.join(REPO, "examples", "pytorch", "layer_with_overlap.py")
# Small: hidden 256, ffn 1024, 512 tokens; 8 iterations (lr 1e-3: a clear fall at this size).
ARGS = ["-s", "256", "-b", "2", "-n", "8", "-d", "32", "-i", "8", "--warmup", "2", "--log-every", "4", "--lr", "1e-3"]
TOL = 1e-2
TOL_FP8 = 2e-2


@pytest.fixture(scope="module")
def example():
    if not os.path.isfile(EXAMPLE):
        pytest.skip(f"example not found: {EXAMPLE}")
    spec = importlib.util.spec_from_file_location("te_comm_example_layer_with_overlap", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- GPU (torchrun)


def train_both(example, extra, extra_overlap=()):
    ovl = example.train(example.parse_args(ARGS + extra + list(extra_overlap)))
    ref = example.train(example.parse_args(ARGS + extra + ["--no-comm-overlap"]))
    return ovl, ref


def check_curves(tc, what, ovl, ref, tol):
    a, b = ovl["losses"], ref["losses"]
    msgs = []
    if ovl["mode"] != "overlap" or ref["mode"] != "no-overlap":
        msgs.append(f"modes {ovl['mode']!r} / {ref['mode']!r}")
    if len(a) != len(b) or not a:
        msgs.append(f"curve lengths {len(a)} / {len(b)}")
    else:
        if not all(math.isfinite(v) for v in a + b):
            msgs.append("non-finite loss")
        diff = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b))
        if not diff <= tol:
            msgs.append(f"max relative loss difference {diff:.3g} > {tol:g}")
        for name, c in (("overlap", a), ("reference", b)):
            if not c[-1] < c[0]:
                msgs.append(f"{name} loss does not fall: {c[0]:.6f} -> {c[-1]:.6f}")
    for name, r in (("overlap", ovl), ("reference", ref)):
        if not (r["step_ms"] > 0 and 0 < r["host_ms"]):
            msgs.append(f"{name}: step {r['step_ms']} ms, host {r['host_ms']} ms")
    tc.check_all(not msgs, f"{what}: {'; '.join(msgs)}\n  overlap   {a}\n  reference {b}")


@pytest.mark.parametrize("fp8", [None, "delayed", "current"], ids=["bf16", "fp8-delayed", "fp8-current"])
def test_example_tp_world(tc, example, fp8):
    extra = ["--fp8", "--fp8-recipe", fp8] if fp8 else []
    ovl, ref = train_both(example, extra)
    assert ovl["tp"] == tc.size and ovl["dp"] == 1 and ovl["fp8"] == int(bool(fp8))
    assert ovl["recipe"] == ref["recipe"] == (fp8 or "none")
    check_curves(tc, f"tp={tc.size} fp8={fp8}", ovl, ref, TOL_FP8 if fp8 else TOL)


def test_example_rs_dgrad(tc, example):
    ovl, ref = train_both(example, ["--ub-overlap-rs-dgrad"])
    check_curves(tc, f"tp={tc.size} --ub-overlap-rs-dgrad", ovl, ref, TOL)


def test_example_data_parallel(tc, example):
    if tc.size < 4 or tc.size % 2:
        pytest.skip("needs a world of 4 or more ranks (an even number) for 2 replicas")
    ovl, ref = train_both(example, ["--num-replicas", "2"])
    assert ovl["tp"] == tc.size // 2 and ovl["dp"] == 2
    check_curves(tc, f"tp={tc.size // 2} dp=2", ovl, ref, TOL)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_example_cuda_graph(tc, example, fp8):
    """The overlap build captured with make_graphed_callables trains like the eager
    reference build."""
    extra = ["--fp8"] if fp8 else []  # FP8: delayed scaling (the default recipe)
    ovl, ref = train_both(example, extra, ["--cuda-graph"])
    assert ovl["graph"] == 1 and ref["graph"] == 0
    # TOL for FP8 too: the graph replays the eager casts with the same scales. The first
    # step must move the loss as the eager one does: delayed scaling's states primed by the
    # capture's warm-up (uninitialised gradients), or reset to scale 1, flushed its
    # gradients towards zero (curves 1.6 % apart, within TOL_FP8; the first step's drop 30 %
    # short at this size, nil at the default size).
    a, b = ovl["losses"], ref["losses"]
    first = (a[0] - a[1]) / (b[0] - b[1]) if len(a) > 1 and len(b) > 1 and b[0] != b[1] else float("nan")
    tc.check_all(abs(first - 1) <= 0.05, f"--cuda-graph fp8={fp8}: first step's loss drop {first:.3g}x the eager one's")
    check_curves(tc, f"tp={tc.size} --cuda-graph fp8={fp8}", ovl, ref, TOL)


def test_example_profile(tc, example):
    """--profile on a real trace: the figures are consistent, every device operation of the
    profiled window falls in a step, and at tp > 1 there is communication."""
    r = example.train(example.parse_args(ARGS + ["--profile", "--profile-steps", "3"]))
    p = r["profile"]
    msgs = []
    if p["steps"] != 3 or p["unassigned"] != 0:
        msgs.append(f"steps {p['steps']}, unassigned {p['unassigned']}")
    if not (0 < p["gemm_ms"] <= p["gpu_busy_ms"] + 1e-9 and p["kernels"] >= 6):
        msgs.append(f"GEMM {p['gemm_ms']} ms, busy {p['gpu_busy_ms']} ms, kernels {p['kernels']}")
    if not (p["comm_ms"] > 0 and abs(p["comm_exposed_ms"] + p["comm_hidden_ms"] - p["comm_ms"]) < 1e-3 * p["comm_ms"] + 1e-6):
        msgs.append(f"comm {p['comm_ms']} = exposed {p['comm_exposed_ms']} + hidden {p['comm_hidden_ms']}?")
    tc.check_all(not msgs, "; ".join(msgs))


# ----------------------------------------------------------------------------- host


def test_result_line(example):
    r = {"mode": "overlap", "fp8": 1, "recipe": "delayed", "graph": 0, "forced": 1, "tp": 2, "dp": 1,
         "step_ms": 1.5, "host_ms": 0.75, "host_ms_median": 0.5, "final_loss": 0.25, "losses": [0.5, 0.25]}
    line = example.result_line(r)
    m = re.fullmatch(
        r"RESULT mode=(overlap|no-overlap) fp8=([01]) recipe=(none|delayed|current|block) graph=([01]) forced=([01]) "
        r"tp=(\d+) dp=(\d+) step_ms=([0-9.]+) host_ms=([0-9.]+) host_ms_median=([0-9.]+) final_loss=([0-9.]+) "
        r"losses=([0-9.,]+)",
        line,
    )
    assert m, line
    assert m.group(3) == "delayed" and m.group(5) == "1" and float(m.group(9)) == 0.75
    assert float(m.group(10)) == 0.5
    assert [float(v) for v in m.group(12).split(",")] == [0.5, 0.25]


def test_profile_line(example):
    r = {"mode": "overlap", "fp8": 0, "recipe": "none", "graph": 1, "forced": 0, "tp": 1, "dp": 1,
         "step_ms": 10.0, "host_ms": 2.0, "final_loss": 0.25, "losses": [0.25],
         "profile": {"steps": 5, "gpu_busy_ms": 9.5, "gemm_ms": 8.0, "comm_ms": 0.5, "comm_exposed_ms": 0.125,
                     "comm_hidden_ms": 0.375, "kernels": 37, "copies": 2, "unassigned": 0}}
    line = example.profile_line(r)
    assert line.startswith("PROFILE mode=overlap fp8=0 recipe=none graph=1 forced=0 tp=1 dp=1 steps=5 "), line
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert float(fields["gpu_busy_ms"]) == 9.5 and float(fields["comm_exposed_ms"]) == 0.125
    assert fields["kernels"] == "37" and fields["copies"] == "2" and fields["unassigned"] == "0"


def test_classify(example):
    c = example.classify
    assert c("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "kernel") == "comm"
    for name in ("wait_flags", "signal_flags", "put_bytes", "copy_segments", "begin_call", "nccl_end",
                 "reduce_bf16_bf16_v8", "reduce_f32_bf16_v1"):
        assert c(name, "kernel") == "comm", name
    for name in ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "nvjet_tst_192x192_64x4_h_bz_NNT",
                 "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(...)"):
        assert c(name, "kernel") == "gemm", name
    for name in ("amax_max", "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >(...)",
                 "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>(...)"):
        assert c(name, "kernel") == "compute", name
    assert c("Memcpy PtoP (Device -> Device)", "gpu_memcpy") == "comm"
    assert c("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "copy"
    assert c("Memset (Device)", "gpu_memset") == "copy"


def _ev(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_analyze_trace(example):
    """Two steps with known overlaps (microseconds): the unions, the exposed / hidden split,
    the counts, and events outside every step (the profiler's warm-up step) left out."""
    mark = example.STEP_MARK
    ev = [
        _ev(f"{mark}0", "user_annotation", 1000, 1000),          # step 0: [1000, 2000]
        _ev(f"{mark}0", "gpu_user_annotation", 1000, 1000),      # the GPU mirror: not a step
        _ev(f"{mark}1", "user_annotation", 3000, 1000),          # step 1: [3000, 4000]
        _ev("cudaLaunchKernel", "cuda_runtime", 1010, 5),        # host: ignored
        _ev("nvjet_gemm_a", "kernel", 900, 50),                  # before step 0: unassigned
        # step 0: GEMMs [1100, 1300] and [1250, 1400]: union [1100, 1400] = 300 us
        _ev("sm90_xmma_gemm_x", "kernel", 1100, 200),
        _ev("nvjet_gemm_b", "kernel", 1250, 150),
        # NCCL [1350, 1500]: hidden 50 (under the GEMM to 1400), exposed 100
        _ev("ncclDevKernel_ReduceScatter", "kernel", 1350, 150),
        # the library's put [1450, 1550] (overlaps NCCL; with it comm = [1350, 1550] = 200)
        _ev("put_bytes", "kernel", 1450, 100),
        # elementwise [1500, 1600]: hides the put's [1500, 1550] -> hidden 50 + 50 = 100
        _ev("void at::native::elementwise_kernel<gelu>", "kernel", 1500, 100),
        _ev("Memset (Device)", "gpu_memset", 1700, 10),
        # step 1: one GEMM [3100, 3600], a peer copy [3500, 3700] (hidden 100, exposed 100)
        _ev("nvjet_gemm_c", "kernel", 3100, 500),
        _ev("Memcpy PtoP (Device -> Device)", "gpu_memcpy", 3500, 200),
        _ev("amax_max", "kernel", 3800, 20),
    ]
    r = example.analyze_trace({"traceEvents": ev})
    assert r["unassigned"] == 1
    s0, s1 = r["steps"]
    approx = pytest.approx
    assert s0["gemm_ms"] == approx(0.300)
    assert s0["comm_ms"] == approx(0.200)
    assert s0["comm_hidden_ms"] == approx(0.100) and s0["comm_exposed_ms"] == approx(0.100)
    assert s0["gpu_busy_ms"] == approx(0.500 + 0.010)       # [1100, 1600] + the memset
    assert (s0["kernels"], s0["copies"]) == (5, 1)
    assert s1["gemm_ms"] == approx(0.500) and s1["comm_ms"] == approx(0.200)
    assert s1["comm_hidden_ms"] == approx(0.100) and s1["comm_exposed_ms"] == approx(0.100)
    assert s1["gpu_busy_ms"] == approx(0.600 + 0.020)       # [3100, 3700] + amax_max
    assert (s1["kernels"], s1["copies"]) == (2, 1)
    med = example.median_steps(r["steps"])
    assert med["gemm_ms"] == approx(0.400) and med["kernels"] == approx(3.5)
    with pytest.raises(ValueError):
        example.median_steps([])


def test_interval_helpers(example):
    u = example.union([(5, 7), (1, 3), (2, 4), (7, 8), (9, 9)])
    assert u == [(1, 4), (5, 8)]
    assert example.measure(u) == 6
    assert example.overlap_length(u, example.union([(0, 2), (3.5, 6), (7.5, 20)])) == pytest.approx(1 + 0.5 + 1 + 0.5)
    assert example.overlap_length([], u) == 0


@pytest.mark.parametrize(
    "argv, err",
    [
        (["--fp8-recipe", "current"], "--fp8-recipe needs --fp8"),
        (["--no-comm-overlap", "--force-library-path"], "--force-library-path applies to the overlap build"),
        (["--device", "cpu", "--no-comm-overlap", "--cuda-graph"], "need --device cuda"),
        (["--device", "cpu", "--no-comm-overlap", "--profile"], "need --device cuda"),
        (["--cuda-graph", "--num-replicas", "2"], "one replica only"),
        (["--device", "cpu", "--force-library-path"], "reference build only"),
    ],
)
def test_flag_checks(example, capsys, argv, err):
    with pytest.raises(SystemExit):
        example.parse_args(argv)
    assert err in capsys.readouterr().err


def test_flag_defaults(example):
    o = example.parse_args([])
    assert (o.seq_length, o.batch_size, o.num_heads, o.head_dim, o.iters, o.warmup) == (2048, 4, 32, 128, 20, 3)
    assert not o.no_comm_overlap and o.cpu_notes == []
    # --device cpu: the reference build and small sizes for what was not given
    o = example.parse_args(["--device", "cpu", "-s", "64"])
    assert o.no_comm_overlap and (o.seq_length, o.batch_size, o.num_heads, o.head_dim) == (64, 2, 4, 32)
    assert len(o.cpu_notes) == 2 and "--seq-length" not in o.cpu_notes[0], o.cpu_notes
    o = example.parse_args(["--fp8"])
    assert o.fp8_recipe == "delayed" and not o.cuda_graph and not o.profile and not o.force_library_path
    assert example.parse_args([]).fp8_recipe is None
    assert example.parse_args(["--fp8", "--fp8-recipe", "current"]).fp8_recipe == "current"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("extra", [[], ["--fp8", "--fp8-recipe", "current"]], ids=["bf16", "fp8-current"])
def test_cpu_smoke(extra):
    """The documented CPU smoke run, in a fresh process (a world of one on gloo): a RESULT
    line with the run's flags and a falling, finite loss curve."""
    if int(os.environ.get("RANK", "0")) != 0:
        pytest.skip("the CPU smoke run is rank 0's (a separate process of its own)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    env["MASTER_PORT"] = str(_free_port())
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, EXAMPLE, "--device", "cpu", "--no-comm-overlap", "-s", "64", "-b", "2", "-n", "4",
           "-d", "16", "-i", "6", "--warmup", "2", "--lr", "1e-3"] + extra
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(line) == 1, p.stdout[-2000:]
    f = dict(kv.split("=", 1) for kv in line[0].split()[1:])
    assert f["mode"] == "no-overlap" and f["tp"] == "1" and f["graph"] == "0" and f["forced"] == "0"
    assert f["fp8"] == ("1" if extra else "0") and f["recipe"] == ("current" if extra else "none")
    losses = [float(v) for v in f["losses"].split(",")]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert float(f["step_ms"]) > 0 and float(f["host_ms"]) > 0
