"""Host tests of transformer_engine_comm._core, the framework-neutral core (no GPU, no
library, no torch or jax needed; the adapter checks at the end run where those are
installed):

- its C enums against src/ffi/c_enums.in and src/transport/table.in (the tables the header
  and the Rust types come from; a mismatch prints the Python classes to paste) and against
  the header; the packed
  op codes against the header's defines; transport names and GemmAlgo's short names as
  derived from the enums;
- block distribution (numroc, block_offset, scattered_rows);
- the dtype and layout rules and the shape planning of the three ops, the context key and
  the op options, replayed on the golden data: what the torch and JAX adapters computed
  before the core existed (python/tests/data/make_plan_golden.py, 1500 argument sets);
- the torch and JAX adapters, rebuilt on the core, against the same golden data.
"""
import gzip
import json
import os
import re
import sys

import pytest

from transformer_engine_comm import _core as core

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(HERE, "data")
if DATA not in sys.path:
    sys.path.insert(0, DATA)

import make_plan_golden as mpg  # noqa: E402


@pytest.fixture(scope="module")
def golden():
    with gzip.open(os.path.join(DATA, "plan_golden.json.gz"), "rt", encoding="utf-8") as f:
        return json.load(f)


# ----------------------------------------------------------------------------- enums


def transport_table():
    """(the enum it follows, [(enumerator, value), ...]) of src/transport/table.in, the
    source of NVTECommTransport (its unit-test rows left out)."""
    with open(os.path.join(REPO, "src", "transport", "table.in"), encoding="utf-8") as f:
        text = re.sub(r"//[^\n]*", "", f.read())
    text = re.sub(r"#\[cfg\(test\)\]\s*\w+\s*=\s*\d+[^;]*;", "", text)
    after = re.search(r"after\s+(\w+);", text).group(1)
    return after, [(k, int(v)) for k, v in re.findall(r"(NVTE_COMM_TRANSPORT_\w+)\s*=\s*(\d+)", text)]


def c_enums_in():
    """{C typedef: [(enumerator, value), ...]} of src/ffi/c_enums.in, in its order, with
    NVTECommTransport from the transport table where build.rs places it."""
    with open(os.path.join(REPO, "src", "ffi", "c_enums.in"), encoding="utf-8") as f:
        text = re.sub(r"//[^\n]*", "", f.read())
    body = text[text.index("c_enums!") :]
    after, transports = transport_table()
    out = {}
    for name, members in re.findall(r"(\w+)\s*\{([^{}]*)\}", body):
        out[name] = [(k, int(v)) for k, v in re.findall(r"(\w+)\s*=\s*(-?\d+)", members)]
        if name == after:
            out["NVTECommTransport"] = transports
    return out


def python_source(table) -> str:
    """The classes _core.py should have for ``table`` (printed when they differ)."""
    lines = []
    for cname, members in table.items():
        py = core.C_ENUMS.get(cname)
        lines += ["", f"class {py.__name__ if py else cname}(enum.IntEnum):", f'    """{cname}."""', ""]
        lines += [f"    {k} = {v}" for k, v in members]
    return "\n".join(lines)


def test_enums_match_c_enums_in():
    table = c_enums_in()
    assert len(table) >= 9 and "NVTECommGemmAlgoType" in table
    got = {cname: [(m.name, m.value) for m in cls] for cname, cls in core.C_ENUMS.items()}
    assert list(got) == list(table) and got == table, (
        "python/transformer_engine_comm/_core.py's C enums differ from src/ffi/c_enums.in; they should read:\n"
        + python_source(table)
    )


def test_c_enums_in_is_the_header(header_text):
    from test_capi import header_enums

    assert header_enums(header_text) == {k: dict(v) for k, v in c_enums_in().items()}


def test_capi_reexports_the_core_enums():
    from transformer_engine_comm import _capi

    for cls in core.C_ENUMS.values():
        assert getattr(_capi, cls.__name__) is cls
    assert _capi.C_ENUMS is core.C_ENUMS


def test_packed_op_codes_match_the_header(header_text):
    defines = dict(re.findall(r"#define NVTE_COMM_GEMM_PACKED_(\w+) (\d+)", header_text))
    assert {k: int(v) for k, v in defines.items()} == {
        "ALL_GATHER": core.PACKED_ALL_GATHER, "REDUCE_SCATTER": core.PACKED_REDUCE_SCATTER,
        "ALL_REDUCE": core.PACKED_ALL_REDUCE, "GEMM": core.PACKED_GEMM}
    assert core.PACKED_OPS == {"all_gather_gemm": 0, "gemm_reduce_scatter": 1, "gemm_all_reduce": 2}
    steps = dict(re.findall(r"#define NVTE_COMM_CAST_(\w+) (\d+)", header_text))
    assert {k: int(v) for k, v in steps.items()} == {
        "AMAX": core.CAST_AMAX, "SCALE": core.CAST_SCALE, "QUANTIZE": core.CAST_QUANTIZE, "UPDATE": core.CAST_UPDATE}
    assert core.OPS == ("all_gather_gemm", "gemm_reduce_scatter", "gemm_all_reduce")


def test_transport_names_come_from_the_enum(golden):
    members = [k for k, _ in c_enums_in()["NVTECommTransport"]]
    assert core.TRANSPORTS == tuple(m[len("NVTE_COMM_TRANSPORT_"):].lower() for m in members)
    assert core.TRANSPORTS == tuple(golden["torch"]["TRANSPORTS"]) == ("auto", "ipc", "nccl")
    assert core.TRANSPORT_IDS == {"auto": 0, "ipc": 1, "nccl": 2}
    assert [core.transport_name(i) for i in (0, 1, 2, 3)] == ["auto", "ipc", "nccl", "auto"]
    assert core.COMM_KINDS == tuple(golden["torch"]["COMM_KINDS"])


def test_short_algo_names(golden):
    assert {a.name: int(a) for a in core.Algo} == golden["torch"]["GemmAlgo"]
    assert [int(a) for a in core.Algo] == [int(a) for a in core.GemmAlgo]
    assert core.Algo.__name__ == "GemmAlgo" and repr(core.Algo.SPLIT_P2P) == "<GemmAlgo.SPLIT_P2P: 1>"
    import pickle

    assert pickle.loads(pickle.dumps(core.Algo.ATOMIC_P2P)) is core.Algo.ATOMIC_P2P
    assert core.algo_id("Split_P2P") == 1 and core.algo_id(core.GemmAlgo.kNVTECommGemmAlgoAtomicP2P) == 3
    for bad in ("multicast_please", 5, -1):
        with pytest.raises(ValueError, match=r"algo must be one of \['atomic_multicast'"):
            core.algo_id(bad)


def test_dtype_tables(golden):
    assert {n: d.name for n, d in core.NVTE_DTYPES.items()} == {
        r["dtype"]: r["result"]["nvte"] for r in golden["torch"]["nvte_dtype"] if "nvte" in r["result"]}
    assert core.FP8_MAX == golden["torch"]["FP8_MAX"]
    assert set(core.FP8_MAX) == set(core.FP8) and all(f in core.FP8 for fmt in core.FP8_FORMATS.values() for f in fmt)


# ----------------------------------------------------------------------------- block distribution


@pytest.mark.parametrize("tp", range(1, 10))
def test_block_distribution_partitions(tp):
    for g in range(0, 80):
        shares = [core.numroc(g, tp, r) for r in range(tp)]
        offsets = [core.block_offset(g, tp, r) for r in range(tp)]
        assert sum(shares) == g
        block = -(-g // tp) if g else 0
        assert all(s in (block, 0) or s == g - (tp - 1) * block or 0 < s < block for s in shares)
        assert shares == sorted(shares, reverse=True)  # the last ranks get fewer
        pos = 0
        for s, o in zip(shares, offsets):
            assert o == pos or s == 0
            pos += s
        if g % tp == 0:
            assert shares == [g // tp] * tp
            assert [core.scattered_rows(g, tp, lambda: pytest.fail("rank asked")) for _ in range(tp)] == shares
        assert [core.scattered_rows(g, tp, r) for r in range(tp)] == shares


def test_scattered_rows_as_before(golden):
    for n, tp, rank, rows, share in golden["jax"]["scattered_rows"]:
        assert core.scattered_rows(n, tp, rank) == rows
        assert core.numroc(n, tp, rank) == share


def test_global_sizes():
    assert core.opt_size(None, "n_global") == -1 and core.opt_size(7, "n_global") == 7
    with pytest.raises(ValueError, match="n_global must be >= 0, got -3"):
        core.opt_size(-3, "n_global")
    assert core.split_global("op", "n_global", 5, None, 4, 3, "x") == 20
    assert core.split_global("op", "n_global", 5, 17, 4, 2, "x") == 17  # shares 5 5 5 2
    with pytest.raises(ValueError, match=r"op: x has 5 along the split dimension but this rank's share of n_global=17 "
                                         r"over 4 ranks is 2"):
        core.split_global("op", "n_global", 5, 17, 4, 3, "x")
    assert core.split_global("op", "n_global", 5, 17, 4, None, "x") == 17  # no rank: not checked


# ----------------------------------------------------------------------------- rules and plans (golden)

NAMES = core.Dtypes({n: n for n in core.NVTE_DTYPES})  # dtype "objects" that are their names


_TORCH_DTYPE = re.compile(r"(?<![\w.])torch\.(?=(?:u?int\d+|b?float\w*)\b)")


def _strip(v):
    """The golden data's torch spelling of a dtype ("torch.bfloat16") as the core's name."""
    return _TORCH_DTYPE.sub("", v) if isinstance(v, str) else v


def core_plan(c):
    """One golden case through the core's rules and planning, as the torch ops call them."""
    op = {"ag": "te_comm.all_gather_gemm", "rs": "te_comm.gemm_reduce_scatter", "ar": "te_comm.gemm_all_reduce"}[c["op"]]
    try:
        fp8, od = core.check_operands(
            op, NAMES, c["x_shape"], c["x_dtype"], c["w_shape"], c["w_dtype"], transa=c["transa"],
            transb=c["transb"], out_dtype=c["out_dtype"], has_scales=c["scales"],
            b_dtype=c["bias"][0] if c["bias"] else None, comm_sm_count=c["comm_sm_count"])
        bias_numel = c["bias"][1] if c["bias"] else None
        given = lambda v: None if v < 0 else v  # noqa: E731 (the ops' -1: not given)
        if c["op"] == "ag":
            p = core.plan_all_gather(op, c["x_shape"], c["w_shape"], nranks=c["tp"], rank=c["rank"],
                                     transa=c["transa"], transb=c["transb"], n_global=given(c["n_global"]),
                                     m_global=given(c["m_global"]), out_dtype=od, fp8=fp8, bias_numel=bias_numel,
                                     gelu=c["gelu"])
        else:
            p = core.plan_k_split(op, c["x_shape"], c["w_shape"], nranks=c["tp"], rank=c["rank"],
                                  scatter=c["op"] == "rs", transa=c["transa"], transb=c["transb"],
                                  k_global=given(c["k_global"]), out_rows=c["out_rows"], out_dtype=od, fp8=fp8,
                                  bias_numel=bias_numel)
        return {"m": p.m, "n": p.n, "k": p.k, "out_shape": list(p.out_shape), "out_dtype": p.out_dtype, "fp8": p.fp8}
    except (TypeError, ValueError) as e:
        return {"error": type(e).__name__, "message": str(e)}


def test_golden_cases_are_the_generators(golden):
    assert golden["cases"] == mpg.cases()


def test_rules_and_plans_as_the_torch_ops_had_them(golden):
    """Every golden case: the same plan (global m, n, k, output shape and dtype, FP8), or
    the same error type and message (torch's dtype spelling aside)."""
    kinds = set()
    for i, (c, want) in enumerate(zip(golden["cases"], golden["torch"]["plan"])):
        want = {k: _strip(v) for k, v in want.items()}
        got = core_plan(c)
        assert got == want, (i, c)
        kinds.add(want.get("message", "ok").split(": ")[1][:25] if "error" in want else "ok")
    assert len(kinds) > 20, kinds  # the data exercises most rules


def test_plans_as_the_jax_ops_had_them(golden):
    """The JAX ops' shapes (no validation: m and n global, k global, D) from the same
    planning functions, unvalidated."""
    planned = 0
    for c, r in zip(golden["cases"], golden["jax"]["calls"]):
        if "error" in r:
            continue
        a = r["call"]["attrs"]
        if c["op"] == "ag":
            p = core.plan_all_gather("ag", c["x_shape"], c["w_shape"], nranks=c["tp"], rank=None,
                                     transa=c["transa"], transb=c["transb"],
                                     n_global=None if c["n_global"] < 0 else c["n_global"], validate=False)
        else:
            p = core.plan_k_split("rs", c["x_shape"], c["w_shape"], nranks=c["tp"], rank=lambda: c["rank"],
                                  scatter=c["op"] == "rs", transa=c["transa"], transb=c["transb"], validate=False)
        assert (a["m"], a["n"], a["k"]) == (p.m, p.n, p.k), c
        assert r["call"]["outs"][0][0] == list(p.out_shape), c
        x_dt = "float32" if c["x_dtype"] == "float64" else c["x_dtype"]  # jax without x64
        want_dt = c["out_dtype"] or core.default_out_dtype(x_dt, NAMES)
        assert r["call"]["outs"][0][1] == want_dt, c
        planned += 1
    assert planned > 1000


def test_context_key_as_before(golden):
    for r in golden["torch"]["context_kind"]:
        try:
            got = {"key": core.context_key("g", r["comm"], r["transport"])[2]}
        except ValueError as e:
            got = {"error": "ValueError", "message": str(e)}
        assert got == r["result"], r
    assert core.context_key("tp0", "own", "ipc") == ("tp0", "own", "ipc")
    assert core.context_key("tp0", "pg", None) == core.context_key("tp0", "pg", "") == ("tp0", "pg", "")


def test_op_options_as_before(golden):
    """comm / transport of the public ops (check_op_kind: "" refused, unlike a context key)."""
    seen = 0
    for r in golden["torch"]["options"]:
        kw = r["kwargs"]
        if set(kw) & {"comm", "transport"}:
            try:
                core.check_op_kind(kw.get("comm", "pg"), kw.get("transport"))
                ok = True
            except ValueError as e:
                ok = False
                assert r["result"]["message"] == str(e), r
            assert ok == ("error" not in r["result"]), r
            seen += 1
    assert seen == 3 * 10


@pytest.mark.parametrize("key,env,want", [
    ("ipc", {"NVTE_COMM_TRANSPORT": "nccl"}, "ipc"), ("", {"NVTE_COMM_TRANSPORT": " NCCL "}, "nccl"),
    ("", {}, "auto"), ("", {"NVTE_COMM_TRANSPORT": ""}, "auto"), ("nccl", {}, "nccl")])
def test_effective_transport(key, env, want):
    assert core.effective_transport(key, env) == want


def test_dtype_rules_directly():
    f = core.check_input_dtypes
    assert f("op", "float8_e4m3fn", "float8_e5m2", NAMES) and not f("op", "bfloat16", "bfloat16", NAMES)
    with pytest.raises(TypeError, match="cannot both be float8_e5m2"):
        f("op", "float8_e5m2", "float8_e5m2", NAMES)
    assert core.output_dtype("op", "float8_e4m3fn", True, None, NAMES) == "bfloat16"
    assert core.output_dtype("op", "float16", False, "float32", NAMES) == "float32"
    assert core.bias_dtype(True, "float16", NAMES) == "float16" and core.bias_dtype(True, "float32", NAMES) == "bfloat16"
    assert core.bias_dtype(False, "float32", NAMES) == "float32"
    assert core.default_out_dtype("float8_e5m2", NAMES) == "bfloat16" and core.default_out_dtype("float16", NAMES) == "float16"
    assert NAMES.name([1]) is None  # unhashable: no name


# ----------------------------------------------------------------------------- the adapters (golden)


def _real(name):
    mod = sys.modules.get(name, False)
    if mod is None:
        return False
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def test_torch_adapter_as_before(golden):
    """The torch ops on meta tensors, plan functions and public functions: identical
    results, errors and messages."""
    if not _real("torch") or not hasattr(sys.modules["torch"], "library"):
        pytest.skip("torch is not installed")
    got = mpg.torch_results(golden["cases"])
    for key, want in golden["torch"].items():
        if isinstance(want, list):
            for i, (g, w) in enumerate(zip(got[key], want)):
                assert g == w, (key, i, golden["cases"][i] if key in ("plan", "public") else None)
        assert got[key] == want, key


def test_jax_adapter_as_before(golden):
    """The JAX ops with the custom call recorded: the same calls (target, operands,
    attributes, results), and the same errors; the layout errors now carry the core's
    wording (the words the JAX tests look for: TT, TN layout)."""
    if not _real("jax"):
        pytest.skip("jax is not installed")
    got = mpg.jax_results(golden["cases"])
    assert got["scattered_rows"] == golden["jax"]["scattered_rows"]
    reworded = 0
    for i, (c, g, w) in enumerate(zip(golden["cases"], got["calls"], golden["jax"]["calls"])):
        if g == w:
            continue
        assert "error" in g and g["error"] == w["error"] == "ValueError", (i, c, g, w)
        assert ("TT" in w["message"] and "TT" in g["message"]) or ("TN layout" in w["message"] and "TN layout" in g["message"]), (i, g, w)
        target = {"ag": "te_comm_all_gather_gemm", "rs": "te_comm_gemm_reduce_scatter", "ar": "te_comm_gemm_all_reduce"}
        fp8 = core.is_fp8(c["x_dtype"]) or core.is_fp8(c["w_dtype"])
        with pytest.raises(ValueError) as ei:
            core.check_trans(target[c["op"]], c["transa"], c["transb"], fp8)
        assert g["message"] == str(ei.value)
        reworded += 1
    assert reworded < 200
