"""Argument checks of the public entries (the issue's newcomer findings), on the host:

- sizes and shapes: dims >= 2**63 (which size_t would wrap: 2**64 + 5 became 5), negative
  dims and non-integers are refused with the argument named (core, Tensor, Overlap);
- dtypes: the string aliases ("bf16", "e4m3", "byte", ...) and torch / numpy / JAX dtypes
  map onto NVTEDType in one place (the core); an unknown one is a TypeError naming it;
- ``group=None`` without torch.distributed says what is missing (torch, when installed);
- ``library_info()``: the documented report, on a machine without a GPU;
- the ``[torch]`` / ``[jax]`` extras; the CPU example's small defaults (torch, when
  installed: it must finish well inside 30 s).

Without torch / jax (CI) the framework parts skip; the core's checks run everywhere.
"""
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from transformer_engine_comm import _core as core

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYTHON_DIR)


# ----------------------------------------------------------------------------- sizes, shapes (core)


@pytest.mark.parametrize("bad, words", [
    (2**64 + 5, "shape[1] = 18446744073709551621 is out of range (dims must be < 2**63)"),
    (2**63, "shape[1] = 9223372036854775808 is out of range (dims must be < 2**63)"),
    (-1, "shape[1] = -1 is negative"),
    (2.5, "shape[1] must be an integer, got 2.5"),
    ("3", "shape[1] must be an integer, got '3'"),
    (True, "shape[1] must be an integer, got True"),
    (None, "shape[1] must be an integer, got None"),
])
def test_core_check_shape_names_the_dimension(bad, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        core.check_shape((4, bad))


def test_core_check_shape_accepts_integers_up_to_the_limit():
    class Index:  # numpy / torch integers: __index__
        def __index__(self):
            return 7

    assert core.check_shape((0, 2**63 - 1, Index())) == (0, 2**63 - 1, 7)
    assert core.check_shape([]) == ()
    for bad in (None, "12", 5):
        with pytest.raises(ValueError, match="x must be a sequence of integers"):
            core.check_shape(bad, "x")


def test_core_sizes_and_global_sizes():
    assert core.check_size(5, "rows") == 5
    with pytest.raises(ValueError, match=re.escape("rows = 18446744073709551616 is out of range")):
        core.check_size(2**64, "rows")
    with pytest.raises(ValueError, match="cols must be an integer, got 1.0"):
        core.check_size(1.0, "cols")
    # opt_size: the ops' n_global / m_global / k_global
    assert core.opt_size(None, "n_global") == -1 and core.opt_size(2**63 - 1, "n_global") == 2**63 - 1
    with pytest.raises(ValueError, match=re.escape("n_global = 9223372036854775808 is out of range")):
        core.opt_size(2**63, "n_global")
    for bad in (2.5, "3", True):
        with pytest.raises(ValueError, match=re.escape(f"k_global must be an integer or None, got {bad!r}")):
            core.opt_size(bad, "k_global")
    with pytest.raises(ValueError, match="op: comm_sm_count must be an integer, got 2.5"):
        core.check_comm_sm_count("op", 2.5)


# ----------------------------------------------------------------------------- dtypes (core)

ALIASES = {
    "bf16": core.DType.kNVTEBFloat16, "bfloat16": core.DType.kNVTEBFloat16, "BF16": core.DType.kNVTEBFloat16,
    "fp16": core.DType.kNVTEFloat16, "float16": core.DType.kNVTEFloat16, "half": core.DType.kNVTEFloat16,
    "fp32": core.DType.kNVTEFloat32, "float32": core.DType.kNVTEFloat32,
    "e4m3": core.DType.kNVTEFloat8E4M3, "float8_e4m3fn": core.DType.kNVTEFloat8E4M3,
    "e5m2": core.DType.kNVTEFloat8E5M2, "float8_e5m2": core.DType.kNVTEFloat8E5M2,
    "int32": core.DType.kNVTEInt32, "int64": core.DType.kNVTEInt64, "int16": core.DType.kNVTEInt16,
    "byte": core.DType.kNVTEByte, "uint8": core.DType.kNVTEByte,
    "torch.bfloat16": core.DType.kNVTEBFloat16, "kNVTEFloat8E5M2": core.DType.kNVTEFloat8E5M2,
}


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_dtype_aliases(alias):
    want = ALIASES[alias]
    assert core.nvte_dtype(alias) is want
    assert core.NVTE_DTYPES[core.dtype_name(alias)] is want


def test_integer_dtype_codes_pass_through():
    """An NVTEDType value as a plain int, or as any integer (numpy's np.int32(6) & co),
    goes to the library as is, as before the names were added; a bool is refused."""
    IntLike = type("int32", (), {"__index__": lambda self: 6})  # np.int32(6): an integer, not an int
    assert core.nvte_dtype(6) == 6 and core.nvte_dtype(IntLike()) == 6
    with pytest.raises(TypeError, match="must be a dtype"):
        core.nvte_dtype(True)


def test_every_alias_maps_onto_a_known_name():
    assert set(core.DTYPE_ALIASES.values()) <= set(core.NVTE_DTYPES)


def test_framework_dtype_objects_are_named_without_importing_them():
    """torch.dtype (str 'torch.bfloat16'), numpy dtypes (``name``) and JAX's scalar types
    (classes carrying a numpy dtype) are recognised by what they are, not by importing
    torch or jax: stand-ins of each here."""
    TorchDtype = type("dtype", (), {"__module__": "torch", "__str__": lambda self: "torch.float8_e4m3fn"})
    assert core.nvte_dtype(TorchDtype()) is core.DType.kNVTEFloat8E4M3
    NumpyDtype = type("dtype", (), {"name": "float16", "kind": "f", "itemsize": 2})
    assert core.dtype_name(NumpyDtype()) == "float16"
    JaxScalar = type("bfloat16", (), {"dtype": NumpyDtype()})  # jnp.bfloat16: .dtype names it
    assert core.dtype_name(JaxScalar) == "float16"
    NpScalar = type("uint8", (), {})  # np.uint8: named by its class
    assert core.nvte_dtype(NpScalar) is core.DType.kNVTEByte
    src = open(core.__file__, encoding="utf-8").read()
    assert not re.search(r"^\s*(import|from)\s+(torch|jax|numpy)\b", src, re.M)


def test_unknown_dtypes_name_the_dtype():
    with pytest.raises(TypeError, match=r"dtype 'bf17' is not a known dtype; expected one of 'bf16', "):
        core.nvte_dtype("bf17")
    TorchDtype = type("dtype", (), {"__module__": "torch", "__str__": lambda self: "torch.float64"})
    with pytest.raises(TypeError, match=r"out_dtype 'float64' is not a known dtype"):
        core.dtype_name(TorchDtype(), "out_dtype")
    for bad in (None, 3.5, [1], object()):
        with pytest.raises(TypeError, match="params_dtype must be a dtype"):
            core.dtype_name(bad, "params_dtype")
    with pytest.raises(TypeError, match="dtype must be a dtype, got True"):
        core.nvte_dtype(True)
    assert core.nvte_dtype(6) == 6  # ints pass (the library checks the value)


def test_numpy_dtypes_when_available():
    np = pytest.importorskip("numpy")
    assert core.nvte_dtype(np.float32) is core.DType.kNVTEFloat32
    assert core.nvte_dtype(np.dtype("uint8")) is core.DType.kNVTEByte
    with pytest.raises(TypeError, match="'float64' is not a known dtype"):
        core.nvte_dtype(np.float64)
    assert core.check_shape((np.int64(3), np.uint32(4))) == (3, 4)


# ----------------------------------------------------------------------------- the ctypes binding


def test_tensor_refuses_wrapping_dims_and_takes_dtype_names(capi):
    """The issue's repro: Tensor(0, bf16, [2**64 + 5]) had shape (5,); Tensor(0, "bf16", ...)
    raised 'invalid literal for int()'."""
    with pytest.raises(ValueError, match=re.escape(
            "shape[0] = 18446744073709551621 is out of range (dims must be < 2**63)")):
        capi.Tensor(0, capi.DType.kNVTEBFloat16, [2**64 + 5])
    with pytest.raises(ValueError, match=re.escape("shape[1] = -4 is negative")):
        capi.Tensor(0, "bf16", [2, -4])
    for name, want in (("bf16", capi.DType.kNVTEBFloat16), ("e4m3", capi.DType.kNVTEFloat8E4M3),
                       ("fp32", capi.DType.kNVTEFloat32), ("byte", capi.DType.kNVTEByte)):
        with capi.Tensor(0, name, [4, 8]) as t:
            assert t.dtype == want and t.shape == (4, 8)
    with pytest.raises(TypeError, match="dtype 'bf17' is not a known dtype"):
        capi.Tensor(0, "bf17", [4])
    with capi.Tensor(0, capi.DType.kNVTEFloat8E4M3, [16, 16]) as t:
        t.set_param(capi.TensorParam.kNVTERowwiseScaleInv, 0x1000, "fp32", (1,))
        assert t.get_param(capi.TensorParam.kNVTERowwiseScaleInv).dtype == capi.DType.kNVTEFloat32
        with pytest.raises(ValueError, match=re.escape("shape[0] = 36893488147419103232 is out of range")):
            t.set_param(capi.TensorParam.kNVTEScale, 0x1000, "fp32", (2**65,))


def test_overlap_checks_rows_cols_dtype_before_the_library(capi):
    calls = []
    ag, bar = (lambda b: b), (lambda: calls.append("barrier"))
    with pytest.raises(ValueError, match=re.escape("rows = 18446744073709551624 is out of range")):
        capi.Overlap.from_callbacks(0, 1, ag, bar, None, 2**64 + 8, 8, capi.DType.kNVTEBFloat16)
    with pytest.raises(ValueError, match="cols must be an integer, got 8.5"):
        capi.Overlap.from_callbacks(0, 1, ag, bar, None, 8, 8.5, "bf16")
    with pytest.raises(TypeError, match="dtype 'fp12' is not a known dtype"):
        capi.Overlap.from_callbacks(0, 1, ag, bar, None, 8, 8, "fp12")
    assert calls == []


# ----------------------------------------------------------------------------- library_info


def test_library_info_is_the_documented_report(capi):
    import transformer_engine_comm as tec

    info = tec.library_info()
    # As a mapping: the four CUDA libraries, exactly as _capi.library_info() (its older form)
    old = capi.library_info()
    assert set(info) == set(old) == {"nccl", "cublaslt", "cuda_driver", "nvrtc"}
    assert dict(info) == dict(old) and set(info.errors) == set(old.errors)
    for key, entry in info.items():
        if entry.get("path"):
            assert info[key] == entry == tec.library_info(key)
        else:
            with pytest.raises(capi.CommError):
                info[key]  # noqa: B018 - raises that library's error, as before
    with pytest.raises(KeyError):
        info["no such key"]  # noqa: B018
    # .details: runtime_info()'s report
    d = info.details
    for key in ("package_version", "library_version", "library_path", "abi", "libraries", "cuda_driver_version",
                "device_count", "gpu_visible", "runtime_ok", "runtime_error"):
        assert key in d, key
    assert d["library_version"] == tec.version() and d["library_path"] == capi.library_path()
    assert d["abi"]["header"] == "transformer_engine_comm.h" and d["abi"]["missing_functions"] == []
    assert d["gpu_visible"] == (d["device_count"] > 0)
    assert type(d["libraries"]) is dict and d["libraries"] == dict(old)
    assert tec.runtime_info() == d
    text = str(info)
    assert text.startswith(f"transformer_engine_comm {tec.__version__}") and "GPU visible: " in text


def test_library_info_without_the_library_or_a_gpu(tmp_path):
    """The quick start's command works on a machine with nothing: no library (reported,
    and indexing a CUDA library raises the load error, as before), and (with the library)
    no GPU."""
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, TE_COMM_LIB="/nonexistent/libtransformer_engine_comm.so")
    code = ("import transformer_engine_comm as tec; i = tec.library_info(); print(i); print(i.details['gpu_visible'])\n"
            "try:\n    i['nccl']\nexcept tec.CommError as e:\n    print(e.status_name)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "library: not loaded" in r.stdout and "nonexistent" in r.stdout
    assert r.stdout.split()[-2:] == ["False", "NVTE_COMM_ERROR_LIBRARY_NOT_FOUND"]


# ----------------------------------------------------------------------------- extras


def test_torch_and_jax_extras():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert set(extras) >= {"torch", "jax", "test"}
    assert any(re.match(r"torch\s*>=\s*2\.4", d) for d in extras["torch"]), extras["torch"]
    assert any(re.match(r"jax\s*>=\s*0\.4\.38", d) for d in extras["jax"]), extras["jax"]


# ----------------------------------------------------------------------------- torch (when installed)


def _torch():
    return pytest.importorskip("torch")


def test_torch_ops_without_a_process_group_say_what_is_missing(capi):
    torch = _torch()
    import torch.distributed as dist
    from transformer_engine_comm.torch import ops

    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    x, w = torch.zeros(4, 8), torch.zeros(4, 8)
    for f in (ops.all_gather_gemm, ops.gemm_reduce_scatter, ops.gemm_all_reduce):
        with pytest.raises(RuntimeError) as ei:
            f(x, w)
        msg = str(ei.value)
        assert msg.startswith(f"te_comm.{f.__name__}: no process group") and "group=" in msg, msg
        assert "torch.distributed.init_process_group" in msg and "world_size=1" in msg, msg
        with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup, a group name"):
            f(x, w, group=3)
    with pytest.raises(TypeError, match="te_comm.all_gather_gemm: out_dtype 'bf17' is not a known dtype"):
        ops.all_gather_gemm(x, w, out_dtype="bf17")
    with pytest.raises(ValueError, match="n_global must be an integer or None, got 2.5"):
        ops.all_gather_gemm(x, w, n_global=2.5)
    with pytest.raises(ValueError, match=re.escape("k_global = 18446744073709551616 is out of range")):
        ops.gemm_reduce_scatter(x, w, k_global=2**64)
    with pytest.raises(ValueError, match="comm_sm_count must be an integer"):
        ops.gemm_all_reduce(x, w, comm_sm_count="4")
    from transformer_engine_comm.torch import _context

    with pytest.raises(RuntimeError, match="no process group"):
        _context.group_name_of(None)
    with pytest.raises(RuntimeError, match="no process group"):
        _context.resolve_group(None)


def test_torch_dtype_names():
    torch = _torch()
    from transformer_engine_comm.torch._context import torch_dtype

    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("e5m2") is torch.float8_e5m2
    assert torch_dtype(torch.float16) is torch.float16 and torch_dtype(None) is None
    assert core.nvte_dtype(torch.bfloat16) is core.DType.kNVTEBFloat16  # a real torch.dtype
    with pytest.raises(TypeError, match="dtype 'float64' is not a known dtype"):
        core.nvte_dtype(torch.float64)


def test_torch_modules_check_their_sizes_and_dtype():
    torch = _torch()
    from transformer_engine_comm.torch import modules as tm

    kw = dict(comm_overlap=False, device="meta")
    for cls, args, words in (
        (tm.ColumnParallelLinear, (2.5, 8), "in_features must be an integer, got 2.5"),
        (tm.ColumnParallelLinear, (8, -8), "out_features = -8 is negative"),
        (tm.RowParallelLinear, (8, "16"), "out_features must be an integer, got '16'"),
        (tm.RowParallelLinear, (2**64, 8), "in_features = 18446744073709551616 is out of range"),
        (tm.LayerNormMLP, (2**63, 8), "hidden_size = 9223372036854775808 is out of range"),
        (tm.LayerNormMLP, (8, 1.5), "ffn_hidden_size must be an integer, got 1.5"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            cls(*args, **kw)
    m = tm.LayerNormMLP(16, 32, params_dtype="bf16", **kw)
    assert m.fc1.weight.dtype is torch.bfloat16 and m.layer_norm_weight.dtype is torch.bfloat16
    assert tm.ColumnParallelLinear(8, 8, params_dtype="fp32", **kw).weight.dtype is torch.float32
    with pytest.raises(TypeError, match="params_dtype 'bf17' is not a known dtype"):
        tm.RowParallelLinear(8, 8, params_dtype="bf17", **kw)


def test_cpu_example_picks_small_sizes_and_finishes_quickly(tmp_path):
    """``python examples/pytorch/layer_with_overlap.py --device cpu``, the README's command:
    no torchrun, no environment, no other flag; small sizes said, well under 30 s."""
    _torch()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "pytorch", "layer_with_overlap.py"),
                        "--device", "cpu"], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "--device cpu: small default sizes (--seq-length 128, --batch-size 2" in r.stdout, r.stdout[:2000]
    assert "--no-comm-overlap implied" in r.stdout
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(line) == 1 and "mode=no-overlap" in line[0] and "tp=1" in line[0], r.stdout[-2000:]
    assert took < 30, f"the CPU example took {took:.1f} s"


# ----------------------------------------------------------------------------- JAX (when installed)


def test_jax_ops_take_dtype_names_and_check_sizes():
    pytest.importorskip("jax")
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh
        import transformer_engine_comm.jax as tj
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        ctx = tj.tp_context(mesh, "tp")
        x, w = jax.ShapeDtypeStruct((16, 32), jnp.bfloat16), jax.ShapeDtypeStruct((8, 32), jnp.bfloat16)
        for od, want in (("fp32", jnp.float32), ("bf16", jnp.bfloat16), (jnp.float32, jnp.float32), (None, jnp.bfloat16)):
            out = jax.eval_shape(lambda a, b: tj.all_gather_gemm(a, b, ctx=ctx, out_dtype=od), x, w)
            assert out.dtype == jnp.dtype(want), (od, out.dtype)
        def refused(exc, words, **kw):
            try:
                jax.eval_shape(lambda a, b: tj.all_gather_gemm(a, b, ctx=ctx, **kw), x, w)
            except exc as e:
                assert words in str(e), e
            else:
                raise AssertionError(kw)
        refused(TypeError, "out_dtype 'bf17' is not a known dtype", out_dtype="bf17")
        refused(TypeError, "out_dtype 'float64' is not a known dtype", out_dtype=jnp.float64)
        refused(ValueError, "n_tokens must be an integer, got 32.0", n_tokens=32.0)
        refused(ValueError, "n_tokens = 18446744073709551616 is out of range", n_tokens=2**64)
        refused(ValueError, "comm_sms = -1 is negative", comm_sms=-1)
        ctx.close()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
