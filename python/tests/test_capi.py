"""The ctypes binding (transformer_engine_comm._capi) against the library and its header.

Runs without a GPU and without torch (CI): library lookup, prototypes and structure
layouts checked against include/transformer_engine_comm.h (the layouts by compiling a C
program with the header), tensor handles (the tensor API stores device addresses and never
dereferences them on the host, so fake addresses are fine), the mapping of the library's
recorded errors to CommError, and the no-GPU behaviour of the runtime checks. The tests at
the end need a GPU and are skipped without one.
"""
import ctypes
import gc
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
from ctypes import POINTER, byref, c_bool, c_char_p, c_float, c_int32, c_int64, c_size_t, c_uint, c_uint8, c_uint64, c_void_p, sizeof

import pytest

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PYTHON_DIR)

FAKE_PTR = 0x7F00DEAD0000  # never dereferenced by the tensor API


def _cc():
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


# ----------------------------------------------------------------------------- header parsing


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_enums(text):
    """{typedef name: {enumerator: value}} of the header's `typedef enum X {...} X;`."""
    out = {}
    for name, body in re.findall(r"typedef enum (\w+) \{(.*?)\} \1;", _strip_comments(text), flags=re.S):
        out[name] = {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(-?\d+)", body)}
    return out


def header_structs(text):
    """{struct name: [member names]} of the header's `typedef struct X {...} X;`."""
    out = {}
    for name, body in re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", _strip_comments(text), flags=re.S):
        members = []
        for decl in body.split(";"):
            decl = decl.strip()
            if not decl:
                continue
            fnptr = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)
            m = fnptr or re.search(r"(\w+)\s*(\[[^\]]*\])?\s*$", decl)
            members.append(m.group(1))
        out[name] = members
    return out


def _norm_type(t):
    t = " ".join(t.split())
    stars = t.count("*")
    base = t.replace("*", "").strip()
    return base + (" " + "*" * stars if stars else "")


def header_functions(text):
    """{name: (return type, [parameter types])} of the extern "C" declarations."""
    body = text.split('extern "C" {', 1)[1].rsplit("#ifdef __cplusplus", 1)[0]
    body = "\n".join(l for l in _strip_comments(body).splitlines() if not l.strip().startswith("#"))
    out = {}
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"(?P<ret>.*?)(?P<name>\w+)\s*\((?P<params>.*)\)", decl)
        assert m, f"unparsed declaration: {decl!r}"
        params = []
        if m["params"].strip() not in ("", "void"):
            for p in m["params"].split(","):
                pm = re.fullmatch(r"(.*?)(\w+)", p.strip())
                params.append(_norm_type(pm.group(1)))
        out[m["name"]] = (_norm_type(m["ret"]), params)
    return out


# ----------------------------------------------------------------------------- lookup / load


def test_lookup_order(capi):
    env = {"TE_COMM_LIB": "/opt/x/libtransformer_engine_comm.so"}
    assert capi.candidate_paths(env) == [("TE_COMM_LIB", env["TE_COMM_LIB"])]
    c = capi.candidate_paths({})
    assert [k for k, _ in c] == ["package", "source tree", "search path"]
    assert c[0][1] == os.path.join(os.path.dirname(os.path.abspath(capi.__file__)), "libtransformer_engine_comm.so")
    assert c[1][1] == os.path.join(REPO, "target", "release", "libtransformer_engine_comm.so")
    assert c[2][1] == "libtransformer_engine_comm.so"


def test_missing_library_lists_what_was_tried(capi):
    with pytest.raises(capi.CommError) as ei:
        capi._load_library({"TE_COMM_LIB": "/nonexistent/dir/libtransformer_engine_comm.so"})
    e = ei.value
    assert e.status == capi.Status.NVTE_COMM_ERROR_LIBRARY_NOT_FOUND
    assert "/nonexistent/dir/libtransformer_engine_comm.so (TE_COMM_LIB): no such file" in e.message


def test_loaded_library_is_the_expected_one(capi):
    env = os.environ.get("TE_COMM_LIB")
    expected = env or os.path.join(REPO, "target", "release", "libtransformer_engine_comm.so")
    assert os.path.realpath(capi.library_path()) == os.path.realpath(expected)
    assert capi._state().missing == frozenset(), "the library lacks functions of the header"


def test_source_tree_lookup_without_env(tmp_path):
    lib = os.path.join(REPO, "target", "release", "libtransformer_engine_comm.so")
    if not os.path.isfile(lib):
        pytest.skip(f"{lib} not built (cargo build --release)")
    env = {k: v for k, v in os.environ.items() if k != "TE_COMM_LIB"}
    env["PYTHONPATH"] = PYTHON_DIR
    code = "from transformer_engine_comm import _capi; print(_capi.library_path()); print(_capi.version())"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path, ver = r.stdout.split()
    assert os.path.realpath(path) == os.path.realpath(lib)
    assert re.fullmatch(r"\d+\.\d+\.\d+", ver)


def test_version_is_cargo_version(capi):
    import transformer_engine_comm as pkg

    with open(os.path.join(REPO, "Cargo.toml"), encoding="utf-8") as f:
        cargo = re.search(r'(?m)^version\s*=\s*"([^"]+)"', f.read()).group(1)
    assert capi.version() == cargo
    assert pkg.version() == cargo
    assert pkg.__version__ == cargo


def test_import_does_not_load_the_library(tmp_path):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, TE_COMM_LIB="/nonexistent/libtransformer_engine_comm.so")
    code = (
        "import transformer_engine_comm as t, json\n"
        "print(t._capi._loaded is None)\n"
        "info = t.runtime_info()\n"
        "print('library_error' in info and 'nonexistent' in info['library_error'])\n"
        "try:\n    t.load()\nexcept t.CommError as e:\n    print(e.status_name)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "NVTE_COMM_ERROR_LIBRARY_NOT_FOUND"]


# ----------------------------------------------------------------------------- header agreement


@pytest.fixture(scope="module")
def binding():
    """_capi without loading the library (what the header checks compare)."""
    from transformer_engine_comm import _capi

    return _capi


def test_enums_match_the_header(binding, header_text):
    capi = binding
    enums = header_enums(header_text)
    assert {"NVTEDType", "NVTECommStatus", "NVTECommGemmAlgoType"} <= set(enums)
    assert set(enums) == set(capi.C_ENUMS), "an enum of the header has no Python binding (or vice versa)"
    for cname, py in capi.C_ENUMS.items():
        assert {m.name: m.value for m in py} == enums[cname], cname
    # The values the design names explicitly.
    assert capi.DType.kNVTEFloat32 == 4 and capi.DType.kNVTEBFloat16 == 6 and capi.DType.kNVTEFloat8E5M2 == 8


def _expected_ctypes(capi, ctype, enum_names):
    P = POINTER
    table = {
        "void": None, "bool": c_bool, "int32_t": c_int32, "int64_t": c_int64, "size_t": c_size_t,
        "uint64_t": c_uint64, "float": c_float,
        "NVTETensor": c_void_p, "NVTEQuantizationConfig": c_void_p, "cudaStream_t": c_void_p, "ncclComm_t": c_void_p, "void *": c_void_p,
        "const void *": c_void_p, "float *": c_void_p,  # float*: device addresses, as ints
        "struct NVTECommGemmCtx *": c_void_p, "struct NVTECommOverlap *": c_void_p,
        "const char *": c_char_p, "const char **": P(c_char_p),
        "NVTETensor *": P(c_void_p), "struct NVTECommOverlap **": P(c_void_p), "ncclComm_t *": P(c_void_p),
        "struct NVTECommGemmCtx **": P(c_void_p), "char *": c_char_p, "uint64_t *": P(c_uint64),
        "size_t *": P(c_size_t), "const size_t *": P(c_size_t), "int32_t *": P(c_int32), "bool *": P(c_bool),
        "uint8_t *": P(c_uint8), "const uint8_t *": P(c_uint8),
        "NVTEMatmulConfig": c_void_p, "const float *": P(c_float),  # host floats (alpha, beta)
        "struct NVTEShape": capi.Shape, "struct NVTEBasicTensor": capi.BasicTensor,
        "const struct NVTEBasicTensor *": P(capi.BasicTensor),
        "struct NVTECommOverlapConfig *": P(capi.OverlapConfig),
        "const struct NVTECommOverlapConfig *": P(capi.OverlapConfig),
        "const struct NVTECommBootstrap *": P(capi.Bootstrap),
        "struct NVTECommCallReport *": P(capi.CallReport),
        "const struct NVTECommGemmPacked *": P(capi.GemmPacked),
        "const struct NVTECommCastPacked *": P(capi.CastPacked),
    }
    if ctype in enum_names:
        return c_uint
    assert ctype in table, f"C type {ctype!r} has no mapping in this test: add it"
    return table[ctype]


def test_prototypes_match_the_header(binding, header_text):
    """Every prototype against the header's declarations (no library needed: runs wherever
    the tests do)."""
    capi = binding
    funcs = header_functions(header_text)
    assert len(funcs) > 50
    enum_names = set(header_enums(header_text))
    protos = {name: (res, args) for name, res, args in capi.PROTOTYPES}
    assert len(protos) == len(capi.PROTOTYPES), "duplicate prototype"
    assert set(protos) == set(funcs), (
        f"header only: {sorted(set(funcs) - set(protos))}; binding only: {sorted(set(protos) - set(funcs))}"
    )
    for name, (ret, params) in funcs.items():
        res, args = protos[name]
        assert res is _expected_ctypes(capi, ret, enum_names), f"{name}: return {ret}"
        assert len(args) == len(params), f"{name}: {len(args)} argtypes for {len(params)} parameters"
        for i, (a, p) in enumerate(zip(args, params)):
            assert a is _expected_ctypes(capi, p, enum_names), f"{name} parameter {i}: {p}"


def test_loaded_library_has_the_prototypes(capi):
    """... and the loaded library exports every one, prototyped."""
    for name, res, args in capi.PROTOTYPES:
        f = getattr(capi.lib(), name)
        assert f.restype is res and list(f.argtypes) == list(args), name


STRUCTS = {"NVTEShape": "Shape", "NVTEBasicTensor": "BasicTensor", "NVTECommOverlapConfig": "OverlapConfig", "NVTECommBootstrap": "Bootstrap",
           "NVTECommCallReport": "CallReport", "NVTECommGemmOperand": "GemmOperand", "NVTECommGemmPacked": "GemmPacked",
           "NVTECommCastPacked": "CastPacked"}


def test_struct_members_match_the_header(binding, header_text):
    capi = binding
    structs = header_structs(header_text)
    assert set(structs) == set(STRUCTS)
    for cname, pyname in STRUCTS.items():
        assert [f[0] for f in getattr(capi, pyname)._fields_] == structs[cname], cname


def test_struct_layouts_match_the_c_compiler(capi, header_text, tmp_path):
    cc = _cc()
    if not cc:
        pytest.skip("no C compiler (cc, gcc or clang)")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "transformer_engine_comm.h"', "int main(void) {"]
    expect = {}
    for cname, pyname in STRUCTS.items():
        py = getattr(capi, pyname)
        lines.append(f'  printf("{cname} size %zu align %zu\\n", sizeof({cname}), _Alignof({cname}));')
        expect[f"{cname} size"] = (sizeof(py), ctypes.alignment(py))
        for fname, _ in py._fields_:
            lines.append(
                f'  printf("{cname}.{fname} size %zu align %zu\\n", offsetof({cname}, {fname}), sizeof((({cname} *)0)->{fname}));'
            )
            desc = getattr(py, fname)
            expect[f"{cname}.{fname} size"] = (desc.offset, desc.size)
    for cname in capi.C_ENUMS:
        lines.append(f'  printf("{cname} size %zu align %zu\\n", sizeof({cname}), _Alignof({cname}));')
        expect[f"{cname} size"] = (sizeof(c_uint), ctypes.alignment(c_uint))
    for cname in ("NVTETensor", "cudaStream_t", "ncclComm_t", "NVTECommAllgatherFn", "NVTECommBarrierFn"):
        lines.append(f'  printf("{cname} size %zu align %zu\\n", sizeof({cname}), _Alignof({cname}));')
        expect[f"{cname} size"] = (sizeof(c_void_p), ctypes.alignment(c_void_p))
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    r = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", os.path.join(REPO, "include"), str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        m = re.fullmatch(r"(\S+ size) (\d+) align (\d+)", line)
        got[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    assert got == expect
    # The sizes the design states.
    assert sizeof(capi.Shape) == 16 * 8 and sizeof(capi.BasicTensor) == 144


# ----------------------------------------------------------------------------- errors


def test_status_names(capi):
    for s in capi.Status:
        assert capi.status_string(s) == s.name
        assert capi.status_name(s) == s.name
    assert capi.status_string(1234) == "unknown status"
    assert capi.status_name(1234) == "unknown status 1234"


def test_check_and_comm_error(capi):
    assert capi.check(0) is None
    capi.lib().nvte_comm_gemm_numroc(None, 5)
    with pytest.raises(capi.CommError) as ei:
        capi.check_last("numroc")
    e = ei.value
    assert isinstance(e, RuntimeError)
    assert e.status == 1 and e.status_name == "NVTE_COMM_ERROR_INVALID_ARGUMENT"
    assert e.message == "nvte_comm_gemm_numroc: argument `ctx` is NULL"
    assert e.message == capi.last_error()
    assert str(e) == "numroc: nvte_comm_gemm_numroc: argument `ctx` is NULL [NVTE_COMM_ERROR_INVALID_ARGUMENT]"
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is capi.CommError and (e2.status, e2.message, str(e2)) == (e.status, e.message, str(e))
    # check() reads the same record.
    with pytest.raises(capi.CommError, match="argument `ctx` is NULL") as ei:
        capi.check(capi.last_status(), "again")
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    # A successful call clears it; clear_error() too.
    assert capi.live_tensor_count() >= 0 and capi.version()
    capi.lib().nvte_comm_gemm_numroc(None, 5)
    capi.clear_error()
    assert capi.last_status() == 0 and capi.last_error() == ""
    capi.check_last()


def test_errors_are_per_thread(capi):
    seen = []

    def worker():
        capi.lib().nvte_comm_gemm_numroc(None, 1)
        seen.append((capi.last_status(), capi.last_error()))

    capi.clear_error()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [(1, "nvte_comm_gemm_numroc: argument `ctx` is NULL")]
    assert capi.last_status() == 0 and capi.last_error() == ""


@pytest.mark.parametrize("fn", ["nvte_all_gather_gemm", "nvte_gemm_reduce_scatter", "nvte_gemm_all_reduce"])
def test_comm_gemm_with_null_ctx(capi, fn):
    with capi.Tensor(FAKE_PTR, capi.DType.kNVTEBFloat16, (8, 8)) as a:
        getattr(capi.lib(), fn)(None, 8, 8, 8, a, a, a, None, None, True, False, False, False, 0, None, 0)
        with pytest.raises(capi.CommError) as ei:
            capi.check_last()
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert ei.value.message == f"{fn}: argument `ctx` is NULL"


def test_gemm_ctx_with_null_comm(capi):
    with pytest.raises(capi.CommError) as ei:
        capi.GemmCtx(0, 1, 0)
    e = ei.value
    assert e.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert e.message.startswith("nvte_comm_gemm_ctx_create: ") and "nccl_comm" in e.message
    assert str(e).startswith("GemmCtx: nvte_comm_gemm_ctx_create: ")


def test_missing_functions_fail_when_called_not_at_load(capi, tmp_path, monkeypatch):
    cc = _cc()
    if not cc:
        pytest.skip("no C compiler (cc, gcc or clang)")
    src = tmp_path / "stub.c"
    src.write_text('const char *nvte_comm_version(void) { return "0.0.1-stub"; }\n')
    stub = tmp_path / "libstub.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(stub)], check=True)
    loaded = capi._load_library({"TE_COMM_LIB": str(stub)})
    assert loaded.path == os.path.realpath(str(stub))
    assert loaded.missing == {name for name, _, _ in capi.PROTOTYPES} - {"nvte_comm_version"}
    assert loaded.cdll.nvte_comm_version() == b"0.0.1-stub"  # prototype set: c_char_p
    monkeypatch.setattr(capi, "_loaded", loaded)
    assert capi.version() == "0.0.1-stub"
    assert not capi.has_function("nvte_comm_library_info") and capi.has_function("nvte_comm_version")
    for call in (capi.library_info, capi.nccl_get_unique_id, lambda: capi.nccl_comm_destroy(1)):
        with pytest.raises(capi.MissingFunctionError) as ei:
            call()
        assert isinstance(ei.value, capi.CommError)
        assert ei.value.status == capi.Status.NVTE_COMM_ERROR_UNSUPPORTED
        assert str(stub) in ei.value.message and ei.value.function in ei.value.message


def test_a_library_without_the_api_is_rejected(capi, tmp_path):
    cc = _cc()
    if not cc:
        pytest.skip("no C compiler (cc, gcc or clang)")
    src = tmp_path / "other.c"
    src.write_text("int something_else(void) { return 1; }\n")
    other = tmp_path / "libother.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(other)], check=True)
    with pytest.raises(capi.CommError, match="not libtransformer_engine_comm") as ei:
        capi._load_library({"TE_COMM_LIB": str(other)})
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_LIBRARY_NOT_FOUND


# ----------------------------------------------------------------------------- tensors


def test_tensor_roundtrip(capi):
    base = capi.live_tensor_count()
    t = capi.Tensor(FAKE_PTR, capi.DType.kNVTEBFloat16, (4, 8), scale_inv=FAKE_PTR + 0x100)
    assert capi.live_tensor_count() == base + 1
    assert t.ptr == FAKE_PTR and t.data_ptr == FAKE_PTR
    assert t.dtype is capi.DType.kNVTEBFloat16
    assert t.shape == (4, 8) and t.numel == 32 and t.element_size == 2
    assert t.scale_inv == FAKE_PTR + 0x100 and t.scale == 0 and t.amax == 0
    assert t.get_param(capi.TensorParam.kNVTERowwiseData) == (FAKE_PTR, capi.DType.kNVTEBFloat16, (4, 8))
    assert t.get_param(capi.TensorParam.kNVTERowwiseScaleInv) == (FAKE_PTR + 0x100, capi.DType.kNVTEFloat32, (1,))
    t.set_param(capi.TensorParam.kNVTEColumnwiseData, FAKE_PTR + 0x1000, capi.DType.kNVTEFloat8E4M3, (8, 4))
    assert t.get_param(capi.TensorParam.kNVTEColumnwiseData) == (FAKE_PTR + 0x1000, capi.DType.kNVTEFloat8E4M3, (8, 4))
    assert capi.lib().nvte_tensor_columnwise_data(t) == FAKE_PTR + 0x1000  # Tensor as a ctypes argument
    assert "kNVTEBFloat16" in repr(t)
    t.close()
    assert t.closed and capi.live_tensor_count() == base
    t.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        t.handle


def test_tensor_fp8_scalars_and_null_data(capi):
    base = capi.live_tensor_count()
    with capi.Tensor(FAKE_PTR, capi.DType.kNVTEFloat8E4M3, (16, 32), scale_inv=0x1000, scale=0x2000, amax=0x3000) as t:
        assert (t.scale_inv, t.scale, t.amax) == (0x1000, 0x2000, 0x3000)
        assert t.element_size == 1 and t.numel == 512
        assert capi.live_tensor_count() == base + 1
    assert capi.live_tensor_count() == base
    with capi.Tensor(0, capi.DType.kNVTEFloat32, ()) as e:  # an empty tensor (TE: "none")
        assert e.ptr == 0 and e.shape == () and e.numel == 1
    assert capi.live_tensor_count() == base


def test_tensor_garbage_collection_destroys_the_handle(capi):
    base = capi.live_tensor_count()
    ts = [capi.Tensor(FAKE_PTR + i, capi.DType.kNVTEFloat32, (i + 1,)) for i in range(10)]
    assert capi.live_tensor_count() == base + 10
    del ts
    gc.collect()
    assert capi.live_tensor_count() == base


def test_raw_tensor_api(capi):
    L = capi.lib()
    base = capi.live_tensor_count()
    h = L.nvte_create_tensor(capi.ScalingMode.NVTE_DELAYED_TENSOR_SCALING)
    capi.check_last()
    assert h and capi.live_tensor_count() == base + 1
    dims = (c_size_t * 3)(3, 5, 7)
    shp = L.nvte_make_shape(dims, 3)
    assert shp.to_tuple() == (3, 5, 7)
    bt = capi.BasicTensor(FAKE_PTR, capi.DType.kNVTEFloat16, shp)
    hv = c_void_p(h)
    L.nvte_set_tensor_param(byref(hv), capi.TensorParam.kNVTERowwiseData, byref(bt))
    capi.check_last()
    got = L.nvte_get_tensor_param(h, capi.TensorParam.kNVTERowwiseData)  # struct returned by value
    assert (got.data_ptr, got.dtype, got.shape.to_tuple()) == (FAKE_PTR, 5, (3, 5, 7))
    need = c_size_t()
    L.nvte_get_tensor_param_v2(h, capi.TensorParam.kNVTERowwiseData, None, 0, byref(need))
    capi.check_last()
    assert need.value == sizeof(capi.BasicTensor)
    assert L.nvte_tensor_ndims(h) == 3 and L.nvte_tensor_size(h, 2) == 7 and L.nvte_tensor_numel(h) == 105
    assert L.nvte_tensor_element_size_bits(h) == 16 and L.nvte_tensor_scaling_mode(h) == 0
    assert L.nvte_tensor_shape(h).to_tuple() == (3, 5, 7)
    L.nvte_destroy_tensor(h)
    capi.check_last()
    assert capi.live_tensor_count() == base


def test_destroyed_tensor_handle(capi):
    t = capi.Tensor(FAKE_PTR, capi.DType.kNVTEFloat32, (2, 2))
    h = t.handle.value
    t.close()
    L = capi.lib()
    assert L.nvte_tensor_numel(h) == 0
    with pytest.raises(capi.CommError) as ei:
        capi.check_last()
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert ei.value.message.startswith("nvte_tensor_numel: ") and "not a live tensor" in ei.value.message
    L.nvte_destroy_tensor(h)
    with pytest.raises(capi.CommError, match=r"^nvte_destroy_tensor: .*not a live tensor") as ei:
        capi.check_last()
    # Through the wrappers: a stale handle wrapped as a Tensor.
    stale = capi.Tensor.from_handle(h, owned=False)
    with pytest.raises(capi.CommError, match="nvte_tensor_shape: .*not a live tensor") as ei:
        stale.shape
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT


def test_bad_dtype_and_shape(capi):
    base = capi.live_tensor_count()
    with pytest.raises(capi.CommError) as ei:
        capi.Tensor(FAKE_PTR, 99, (2, 2))
    e = ei.value
    assert e.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert e.message.startswith("nvte_comm_tensor_create_simple: ") and "NVTEDType(99) is not a valid NVTEDType" in e.message
    with pytest.raises(capi.CommError, match="nvte_comm_tensor_create_simple: .*ndim") as ei:
        capi.Tensor(FAKE_PTR, capi.DType.kNVTEFloat32, (1,) * 16)
    with pytest.raises(capi.CommError, match="overflows"):
        capi.Tensor(FAKE_PTR, capi.DType.kNVTEFloat32, (2**40, 2**40))
    assert capi.live_tensor_count() == base
    # Scale components must be float32 scalars; a failed scale setting leaks no handle.
    with pytest.raises(capi.CommError, match="nvte_set_tensor_param_v2: .*must be kNVTEFloat32"):
        with capi.Tensor(FAKE_PTR, capi.DType.kNVTEFloat8E4M3, (4, 4)) as t:
            t.set_param(capi.TensorParam.kNVTEScale, 0x1000, capi.DType.kNVTEBFloat16, (1,))
    assert capi.live_tensor_count() == base
    # Out-of-range dimension, ndim > 15 in make_shape, invalid scaling modes.
    with capi.Tensor(FAKE_PTR, capi.DType.kNVTEFloat32, (2, 3)) as t:
        assert capi.lib().nvte_tensor_size(t, 5) == 0
        with pytest.raises(capi.CommError, match="nvte_tensor_size: argument `dim` = 5 is out of range"):
            capi.check_last()
    dims = (c_size_t * 16)(*([1] * 16))
    assert capi.lib().nvte_make_shape(dims, 16).ndim == 0
    with pytest.raises(capi.CommError, match="nvte_make_shape: argument `ndim` = 16"):
        capi.check_last()
    assert capi.lib().nvte_create_tensor(capi.ScalingMode.NVTE_MXFP8_1D_SCALING) is None
    with pytest.raises(capi.CommError) as ei:
        capi.check_last()
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_UNSUPPORTED
    assert capi.lib().nvte_create_tensor(77) is None
    with pytest.raises(capi.CommError, match="nvte_create_tensor: .*not a valid NVTEScalingMode") as ei:
        capi.check_last()
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert capi.live_tensor_count() == base
    with pytest.raises(TypeError):
        capi.cublas_gemm("not a tensor", None, None)


# ----------------------------------------------------------------------------- overlap engine


def test_overlap_config_default(capi, monkeypatch):
    for v in ("NVTE_COMM_TIMEOUT_MS", "NVTE_COMM_OVERLAP_NUM_SPLITS", "NVTE_COMM_OVERLAP_MAX_STREAMS",
              "NVTE_COMM_OVERLAP_NUM_SM", "NVTE_COMM_OVERLAP_USE_CE", "NVTE_COMM_OVERLAP_AGGREGATE",
              "NVTE_COMM_OVERLAP_SM_MARGIN", "NVTE_COMM_TRANSPORT"):
        monkeypatch.delenv(v, raising=False)
    c = capi.overlap_config_default()
    assert c.struct_size == sizeof(capi.OverlapConfig) == 56
    assert (c.tp_size, c.num_splits, c.num_max_streams, c.comm_cga_size, c.num_comm_sm) == (0, 3, 3, 2, 16)
    assert (c.set_sm_margin, c.use_ce, c.aggregate, c.atomic_gemm) == (True, True, False, False)
    assert c.timeout_ms == 60000 and c.transport == capi.Transport.NVTE_COMM_TRANSPORT_AUTO
    monkeypatch.setenv("NVTE_COMM_OVERLAP_NUM_SPLITS", "5")
    monkeypatch.setenv("NVTE_COMM_TIMEOUT_MS", "1234")
    monkeypatch.setenv("NVTE_COMM_TRANSPORT", "nccl")
    c = capi.overlap_config_default()
    assert (c.num_splits, c.timeout_ms, c.transport) == (5, 1234, capi.Transport.NVTE_COMM_TRANSPORT_NCCL)
    assert c.as_dict()["num_splits"] == 5 and "num_splits=5" in repr(c)


def _noop_callbacks():
    calls = []
    return calls, (lambda local: calls.append("ag") or local), (lambda: calls.append("barrier"))


def test_overlap_argument_errors(capi):
    BF16 = capi.DType.kNVTEBFloat16
    with pytest.raises(capi.CommError, match="bootstrap_comm_ptr is 0") as ei:
        capi.Overlap(0, None, 8, 8, BF16)
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    calls, ag, bar = _noop_callbacks()
    with pytest.raises(capi.CommError, match="nvte_comm_overlap_create: world_rank = 1 and world_size = 1") as ei:
        capi.Overlap.from_callbacks(1, 1, ag, bar, None, 8, 8, BF16)
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    cfg = capi.overlap_config_default()
    cfg.struct_size = 8
    with pytest.raises(capi.CommError, match=r"nvte_comm_overlap_create: config->struct_size = 8 .* 56 bytes"):
        capi.Overlap.from_callbacks(0, 1, ag, bar, cfg, 8, 8, BF16)
    with pytest.raises(capi.CommError, match="nvte_comm_overlap_create: argument `dtype`") as ei:
        capi.Overlap.from_callbacks(0, 1, ag, bar, None, 8, 8, 99)
    with pytest.raises(capi.CommError, match="buffer dtype kNVTEInt32 is not supported") as ei:
        capi.Overlap.from_callbacks(0, 1, ag, bar, None, 8, 8, capi.DType.kNVTEInt32)
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_UNSUPPORTED
    with pytest.raises(capi.CommError, match=r"buffer shape \[0, 8\] is empty"):
        capi.Overlap.from_callbacks(0, 1, ag, bar, None, 0, 8, BF16)
    with pytest.raises(TypeError):
        capi.Overlap.from_callbacks(0, 1, ag, bar, {"tp_size": 1}, 8, 8, BF16)
    assert calls == []


def test_overlap_calls_on_dead_handles(capi):
    L = capi.lib()
    s, r = c_int32(), c_int32()
    with pytest.raises(capi.CommError, match="nvte_comm_overlap_tp: argument `overlap` is NULL"):
        capi.check(L.nvte_comm_overlap_tp(None, byref(s), byref(r)))
    assert L.nvte_comm_overlap_destroy(None) == 0  # NULL is a no-op
    fake = capi.Overlap.__new__(capi.Overlap)
    fake._ov = 0xABC0C
    for call in (lambda: fake.tp, fake.synchronize, lambda: fake.get_buffer(True)):
        with pytest.raises(capi.CommError, match="is not a live overlap object") as ei:
            call()
        assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    with capi.Tensor(FAKE_PTR, capi.DType.kNVTEBFloat16, (8, 8)) as a:
        with pytest.raises(capi.CommError, match="nvte_comm_overlap_split_ag: .*not a live overlap object"):
            fake.split_ag(a, True, a, False, a)
        with pytest.raises(capi.CommError, match="nvte_comm_overlap_bulk: argument `comm_type` = .*7"):
            fake.bulk(7, a, True, a, False, a)
    fake._ov = None
    with pytest.raises(ValueError, match="closed"):
        fake.tp


# ----------------------------------------------------------------------------- runtime without a GPU


@pytest.fixture(scope="module")
def no_gpu(capi):
    n = capi.device_count()
    if n > 0:
        pytest.skip(f"{n} GPU(s) visible: the no-GPU behaviour cannot be observed here")
    return True


def test_device_count_and_check_runtime_without_gpu(capi, no_gpu):
    assert capi.device_count() == 0
    assert capi.last_status() in (capi.Status.NVTE_COMM_ERROR_LIBRARY_NOT_FOUND, capi.Status.NVTE_COMM_ERROR_CUDA)
    assert capi.last_error().startswith("nvte_comm_device_count: ")
    with pytest.raises(capi.CommError) as ei:
        capi.check_runtime()
    e = ei.value
    assert e.status in (capi.Status.NVTE_COMM_ERROR_LIBRARY_NOT_FOUND, capi.Status.NVTE_COMM_ERROR_CUDA)
    assert e.message.startswith("nvte_comm_check_runtime: ")
    import transformer_engine_comm as pkg

    info = pkg.runtime_info()
    assert info["device_count"] == 0 and info["runtime_ok"] is False and info["runtime_error"] == str(e)


def test_overlap_create_without_gpu_fails_cleanly(capi, no_gpu):
    calls, ag, bar = _noop_callbacks()
    with pytest.raises(capi.CommError) as ei:
        capi.Overlap.from_callbacks(0, 1, ag, bar, None, 8, 8, capi.DType.kNVTEBFloat16)
    assert ei.value.status in (capi.Status.NVTE_COMM_ERROR_LIBRARY_NOT_FOUND, capi.Status.NVTE_COMM_ERROR_CUDA)
    assert ei.value.message.startswith("nvte_comm_overlap_create: ")


def test_library_info(capi):
    info = capi.library_info()
    assert isinstance(info, capi.LibraryInfo) and isinstance(info, dict)
    assert set(info) == {"nccl", "cublaslt", "cuda_driver", "nvrtc"}
    for key, entry in dict.items(info):
        if "error" in entry:
            assert entry["path"] is None and entry["status"] != "NVTE_COMM_SUCCESS"
            with pytest.raises(capi.CommError) as ei:
                info[key]
            assert ei.value.status_name == entry["status"] and str(ei.value) == entry["error"]
            assert "nvte_comm_library_info: " in entry["error"]
            with pytest.raises(capi.CommError):
                capi.library_info(key)
        else:
            assert entry["version"] > 0 and isinstance(entry["preloaded"], bool)
            assert info[key] == entry == capi.library_info(key)
            assert os.path.isabs(entry["path"]) and os.path.exists(entry["path"]), entry
    with pytest.raises(ValueError):
        capi.library_info("cudnn")
    # Out-pointers are reset on error.
    p, v, b = c_char_p(b"x"), c_int32(7), c_bool(True)
    assert capi.lib().nvte_comm_library_info(9, byref(p), byref(v), byref(b)) == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert (p.value, v.value, b.value) == (None, 0, False)
    assert capi.last_error() == "nvte_comm_library_info: argument `lib` = NVTECommLibrary(9) is not a valid NVTECommLibrary"


def test_nccl_helpers_argument_errors(capi):
    L = capi.lib()
    buf = (c_uint8 * 128)()
    with pytest.raises(capi.CommError, match="nvte_comm_nccl_get_unique_id: argument `len` = 16 is less than"):
        capi.check(L.nvte_comm_nccl_get_unique_id(buf, 16))
    with pytest.raises(capi.CommError, match="nvte_comm_nccl_get_unique_id: argument `out` is NULL"):
        capi.check(L.nvte_comm_nccl_get_unique_id(None, 128))
    with pytest.raises(capi.CommError, match="nvte_comm_nccl_comm_init_rank: argument `len` = 100"):
        capi.nccl_comm_init_rank(bytes(100), 1, 0)
    with pytest.raises(capi.CommError, match=r"nvte_comm_nccl_comm_init_rank: `nranks` = 2 and `rank` = 5"):
        capi.nccl_comm_init_rank(bytes(128), 2, 5)
    with pytest.raises(capi.CommError, match="nvte_comm_nccl_comm_destroy: argument `comm` is NULL") as ei:
        capi.nccl_comm_destroy(0)
    assert ei.value.status == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT


# ----------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def gpu(capi):
    if capi.device_count() == 0:
        pytest.skip("needs a GPU (nvte_comm_device_count() == 0)")
    capi.check_runtime()
    return True


def test_gpu_single_rank_nccl_and_gemm_ctx(capi, gpu):
    uid = capi.nccl_get_unique_id()
    assert len(uid) == 128 and any(uid)
    comm = capi.nccl_comm_init_rank(uid, 1, 0)
    assert comm
    try:
        with capi.GemmCtx(comm, 1, 0) as ctx:
            assert ctx.numroc(10) == 10 and ctx.numroc(0) == 0
            # The binding names the argument before the library sees it ...
            with pytest.raises(ValueError, match="global_size = -1 is negative"):
                ctx.numroc(-1)
            # ... and the library itself still refuses it through the C entry.
            capi.lib().nvte_comm_gemm_numroc(ctx.handle, -1)
            with pytest.raises(capi.CommError, match="global_size = -1"):
                capi.check_last("nvte_comm_gemm_numroc")
        with pytest.raises(capi.CommError, match="disagree with the communicator"):
            capi.GemmCtx(comm, 2, 1)
    finally:
        capi.nccl_comm_destroy(comm)


def test_gpu_overlap_from_callbacks(capi, gpu):
    base = capi.live_tensor_count()
    calls = []

    def allgather(local):
        calls.append(("ag", len(local)))
        return [local]  # a list of per-rank chunks is accepted too

    with capi.Overlap.from_callbacks(0, 1, allgather, lambda: calls.append(("barrier", 0)), None, 64, 128,
                                     capi.DType.kNVTEBFloat16) as ov:
        assert ov.tp == (1, 0)
        with ov.get_buffer(False) as whole, ov.get_buffer(True) as chunk:
            assert whole.shape == (64, 128) and chunk.shape == (64, 128)
            assert whole.dtype == capi.DType.kNVTEBFloat16 and whole.ptr != 0 and chunk.ptr == whole.ptr
        ov.synchronize()
    assert any(c[0] == "ag" for c in calls)
    assert capi.live_tensor_count() == base


def test_gpu_callback_exceptions_propagate(capi, gpu):
    def bad_allgather(local):
        raise KeyError("from the allgather callback")

    with pytest.raises(capi.CommError) as ei:
        capi.Overlap.from_callbacks(0, 1, bad_allgather, lambda: None, None, 64, 128, capi.DType.kNVTEBFloat16)
    assert isinstance(ei.value.__cause__, KeyError)
    assert ei.value.message.startswith("nvte_comm_overlap_create: ")

    with pytest.raises(capi.CommError) as ei:
        capi.Overlap.from_callbacks(0, 1, lambda local: local + b"x", lambda: None, None, 64, 128, capi.DType.kNVTEBFloat16)
    assert isinstance(ei.value.__cause__, ValueError) and "allgather_fn returned" in str(ei.value.__cause__)


def test_quantization_config_round_trip_and_errors(capi):
    before = capi.live_quantization_config_count()
    with capi.QuantizationConfig(force_pow_2_scales=True, amax_epsilon=0.25) as c:
        assert c.force_pow_2_scales is True and c.amax_epsilon == 0.25
        c.force_pow_2_scales = False
        assert c.force_pow_2_scales is False
        A = capi.QuantizationConfigAttribute
        assert len(c.get_raw(A.kNVTEQuantizationConfigNoopTensor)) == sizeof(c_void_p)
        with pytest.raises(capi.CommError, match="amax_epsilon|AmaxEpsilon"):
            c.amax_epsilon = -1.0
        with pytest.raises(capi.CommError, match="attr"):
            c.get_raw(99)
        # A noop handle that is not a live tensor is reported when the config is used.
        c.noop_tensor = 0x1234
        t = capi.Tensor(FAKE_PTR, capi.DType.kNVTEBFloat16, (4, 4))
        with pytest.raises(capi.CommError, match="noop"):
            capi.quantize_v2(t, t, c)
        t.close()
        assert capi.live_quantization_config_count() == before + 1
    assert capi.live_quantization_config_count() == before


def test_shape_arguments_are_checked_before_the_library_sees_them(capi):
    """A negative size would wrap to ~1.8e19 as size_t and a float would be truncated: both
    are a ValueError naming the argument, raised before any library call."""
    for bad, frag in (((-1, 2), "shape[0] = -1 is negative"), ((4, 2.5), "shape[1] must be an integer"),
                      ((True, 2), "shape[0] must be an integer"), (("3",), "shape[0] must be an integer"),
                      (None, "shape must be a sequence")):
        with pytest.raises(ValueError, match=re.escape(frag)):
            capi.Tensor(0, capi.DType.kNVTEFloat32, bad)
        with pytest.raises(ValueError, match=re.escape(frag)):
            capi.Shape.of(bad)
    class Index:  # integer-like (numpy ints, torch sizes) are accepted through __index__
        def __index__(self):
            return 3

    assert capi.Shape.of((Index(), 4)).to_tuple() == (3, 4)
