"""GPU tests of transformer_engine_comm.jax: each test launches the ranks of python/tests/jax/worker.py
as separate processes (jax.distributed over a local coordinator) and requires every rank
to exit 0 with every check passed. Skipped (with the reason) without jax or a CUDA GPU.

TE_COMM_JAX_NP: comma-separated process counts (default "1,2"). With fewer GPUs than
processes the ranks share GPU 0 (process-local mode; needs TE_COMM_JAX_SHARED=1 or a
single GPU). Each count runs with XLA command buffers off and on (the handlers then run
captured into CUDA graphs and replayed; the library's counters prove they were).
"""
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "worker.py")

CMDBUF_ON = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="


def _gpus():
    try:
        import jax  # noqa: F401
    except ImportError:
        return None, "jax is not installed"
    from transformer_engine_comm import _capi

    try:
        n = _capi.device_count()
    except Exception as e:  # noqa: BLE001
        return None, f"no CUDA driver: {e}"
    if n < 1:
        return None, "no CUDA GPU"
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        try:
            import jax_plugins.xla_cuda12  # noqa: F401
        except ImportError:
            return None, "the jax CUDA plugin (jax-cuda13-plugin) is not installed"
    return n, None


NGPU, WHY = _gpus()
pytestmark = pytest.mark.skipif(NGPU is None, reason=f"SKIPPED (JAX GPU tests): {WHY}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(np_, checks, cmdbuf, timeout=420, extra_env=None):
    shared = NGPU < np_
    if shared and os.environ.get("TE_COMM_JAX_SHARED", "1" if NGPU == 1 else "0") != "1":
        pytest.skip(f"SKIPPED: {np_} processes need {np_} GPUs ({NGPU} visible; TE_COMM_JAX_SHARED=1 shares GPU 0)")
    port = _free_port()
    procs = []
    for r in range(np_):
        env = dict(os.environ)
        env.update(
            TEC_NP=str(np_), TEC_RANK=str(r), TEC_PORT=str(port), TEC_GPU=str(0 if shared else r), TEC_CHECKS=checks,
            XLA_FLAGS=(env.get("XLA_FLAGS", "") + " " + (CMDBUF_ON if cmdbuf else CMDBUF_OFF)).strip(),
            XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            NVSHMEM_DISABLE_NVLS="1", PYTHONPATH=PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", ""),
            TEC_EXPECT_CAPTURE="1" if cmdbuf else "0", TEC_SHARED="1" if shared else "0",
        )
        if shared:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.8 / np_:.2f}"
        env.update(extra_env or {})
        procs.append(subprocess.Popen([sys.executable, WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out = (p.communicate()[0] or "") + f"\n[killed after {timeout} s: a hang]"
        outs.append((p.returncode, out))
    bad = []
    for r, (rc, out) in enumerate(outs):
        print(f"----- rank {r} (exit {rc}) -----\n{out}")
        passes = [ln for ln in out.splitlines() if ln.startswith("PASS ")]
        fails = [ln for ln in out.splitlines() if ln.startswith("FAIL ")]
        if rc != 0 or fails or not passes:
            bad.append(f"rank {r}: exit {rc}, {len(passes)} passed, failed: {fails or '-'}")
    assert not bad, "; ".join(bad)


NPS = [int(v) for v in os.environ.get("TE_COMM_JAX_NP", "1,2").split(",") if v.strip()]


@pytest.mark.parametrize("cmdbuf", [False, True], ids=["cmdbuf-off", "cmdbuf-on"])
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_ops_grads_training(np_, cmdbuf):
    """Ops vs a float32 reference (bf16, fp16, FP8, bias, GELU, gathered input, uneven
    tokens), MLP gradients vs jax.grad of the whole model, training steps, closed contexts."""
    _launch(np_, "local", cmdbuf)


@pytest.mark.parametrize("pick", [1, 2, 3, 5, 6, 7])
@pytest.mark.parametrize("np_", [n for n in NPS if n > 1] or [2], ids=lambda n: f"np{n}")
def test_autotuner_candidates(np_, pick):
    """The autotuner's candidates compute right: re-tune every key (NVTE_COMM_TUNE=force)
    and run candidate `pick` (mod the candidates measured) instead of the fastest. At tp 2
    over IPC these picks together run every kind of candidate (src/tune.rs pins it): no
    overlap (each operation's collective and GEMM one after the other), the all-gather in
    2 and 4 pieces per chunk and with SM puts, the accumulating ring in 2
    and 4 pieces (reduce-scatter and all-reduce), the rings with SM puts, the pipelined
    reduce-scatter and the chunked all-reduce. Checked by the same ops / gradients /
    training checks."""
    _launch(np_, "local", False, extra_env={"NVTE_COMM_TUNE": "force", "NVTE_COMM_TUNE_PICK": str(pick),
                                            "NVTE_COMM_TUNE_VERBOSE": "1"})


@pytest.mark.parametrize("np_", [n for n in NPS if n > 1] or [2], ids=lambda n: f"np{n}")
def test_shard_map_multi_process(np_):
    """One device per process, the layers inside jit(shard_map) over the global mesh
    (global arrays): each process checks its shards (forward; with a GPU per process also
    the gradients and FP8)."""
    _launch(np_, "shard_map", True)


@pytest.mark.parametrize("cmdbuf", [False, True], ids=["cmdbuf-off", "cmdbuf-on"])
def test_shard_map_single_process(cmdbuf):
    """One process, all local GPUs in one TP group (in-process exchange), layers inside
    jit(shard_map) vs the same layers on lax.all_gather / psum_scatter."""
    _launch(1, "shard_map", cmdbuf)
