"""Host-side tests of the JAX integration (no GPU): the XLA FFI struct layouts against
jaxlib's c_api.h, the handlers' metadata and error paths driven through a fake XLA API,
the setup exchanges (in memory, and through JAX's distributed key-value store between
two real processes), and the ops' lowering to the custom calls (CPU devices, lowered for
CUDA). Without jax they skip, unless TE_COMM_REQUIRE_JAX=1 (scripts/test.sh sets it)."""
import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

try:
    import jax  # noqa: F401

    HAVE_JAX = True
except ImportError:
    HAVE_JAX = False

if not HAVE_JAX and os.environ.get("TE_COMM_REQUIRE_JAX") == "1":
    raise RuntimeError("TE_COMM_REQUIRE_JAX=1 but jax cannot be imported")
needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="SKIPPED: jax is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)


def _layout(capi):
    lib = capi.lib()
    n = lib.nvte_comm_xla_layout(None, 0)
    buf = ctypes.create_string_buffer(n)
    assert lib.nvte_comm_xla_layout(buf, n) == n
    out = {}
    for line in buf.value.decode().splitlines():
        name, v = line.rsplit(" ", 1)
        out[name] = int(v)
    return out


@needs_jax
def test_xla_ffi_layout_matches_c_api_header(capi, tmp_path):
    import jax.ffi

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc) to compile the layout probe")
    inc = jax.ffi.include_dir()
    assert os.path.isfile(os.path.join(inc, "xla", "ffi", "api", "c_api.h")), inc
    ours = _layout(capi)
    assert len(ours) > 40, ours
    lines = []
    for name in ours:
        if name.startswith("sizeof "):
            t = name.split(" ", 1)[1]
            # The C API's own size convention for versioned structs: up to the last field.
            lines.append(f'  printf("{name} %zu\\n", (size_t)sizeof({t}));')
        else:
            t, f = name.split(".")
            lines.append(f'  printf("{name} %zu\\n", (size_t)offsetof({t}, {f}));')
    src = tmp_path / "probe.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "xla/ffi/api/c_api.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\n  return 0;\n}\n")
    exe = tmp_path / "probe"
    subprocess.run([cc, "-std=c11", "-I", inc, "-o", str(exe), str(src)], check=True)
    theirs = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        name, v = line.rsplit(" ", 1)
        theirs[name] = int(v)
    diff = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    # Our structs stop at the last field the handlers use; the header's may be longer.
    allowed = {"sizeof XLA_FFI_Api", "sizeof XLA_FFI_CallFrame", "sizeof XLA_FFI_Metadata"}
    for k in list(diff):
        if k in allowed and ours[k] <= theirs[k]:
            del diff[k]
    assert not diff, f"layout differs from c_api.h (ours, header): {diff}"


# ---- the handlers through a fake XLA API (ctypes mirrors of the structs) ----


class ExtBase(ctypes.Structure):
    pass


ExtBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.POINTER(ExtBase))]


class ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(ErrorCreateArgs))
ANY_FN = ctypes.c_void_p


class Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("api_version", ApiVersion),
                ("internal_api", ctypes.c_void_p), ("error_create", ERROR_CREATE)] + \
               [(f"f{i}", ANY_FN) for i in range(17)]


class Span(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("size", ctypes.c_int64),
                ("types", ctypes.c_void_p), ("ptrs", ctypes.c_void_p)]


class Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p), ("size", ctypes.c_int64),
                ("types", ctypes.c_void_p), ("names", ctypes.c_void_p), ("attrs", ctypes.c_void_p)]


class CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api", ctypes.POINTER(Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", Span), ("rets", Span), ("attrs", Attrs)]


class Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", ApiVersion), ("traits", ctypes.c_uint32),
                ("state_type_id", ctypes.c_int64)]


class MetadataExt(ctypes.Structure):
    _fields_ = [("base", ExtBase), ("metadata", ctypes.POINTER(Metadata))]


def _fake_api(errors):
    def create(args):
        errors.append((args.contents.errc, args.contents.message.decode()))
        return 0x1234  # a non-NULL "error"

    cb = ERROR_CREATE(create)
    api = Api()
    api.struct_size = ctypes.sizeof(Api)
    api.error_create = cb
    return api, cb


HANDLERS = ["nvte_comm_xla_all_gather_gemm", "nvte_comm_xla_gemm_reduce_scatter", "nvte_comm_xla_gemm_all_reduce"]


@pytest.mark.parametrize("name", HANDLERS)
def test_handler_reports_metadata(capi, name):
    errors = []
    api, _keep = _fake_api(errors)
    md = Metadata(struct_size=ctypes.sizeof(Metadata))
    ext = MetadataExt()
    ext.base.struct_size = ctypes.sizeof(MetadataExt)
    ext.base.type = 1
    ext.metadata = ctypes.pointer(md)
    frame = CallFrame(struct_size=ctypes.sizeof(CallFrame), api=ctypes.pointer(api))
    frame.extension_start = ctypes.addressof(ext)
    err = getattr(capi.lib(), name)(ctypes.addressof(frame))
    assert not err and not errors, errors
    assert (md.api_version.major_version, md.api_version.minor_version) == (0, 3)
    assert md.traits == 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
    # XLA may ask without an API table: answered all the same.
    md2 = Metadata(struct_size=ctypes.sizeof(Metadata))
    ext.metadata = ctypes.pointer(md2)
    frame2 = CallFrame(struct_size=ctypes.sizeof(CallFrame))
    frame2.extension_start = ctypes.addressof(ext)
    assert not getattr(capi.lib(), name)(ctypes.addressof(frame2))
    assert (md2.api_version.major_version, md2.api_version.minor_version, md2.traits) == (0, 3, 1)


def _scalar_attrs(items):
    """XLA_FFI_Attrs with int64 scalar attributes (name -> value); returns (attrs, keepalive)."""
    n = len(items)

    class Scalar(ctypes.Structure):
        _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]

    class ByteSpan(ctypes.Structure):
        _fields_ = [("ptr", ctypes.c_char_p), ("len", ctypes.c_size_t)]

    keep = []
    types = (ctypes.c_int * n)(*([3] * n))
    names = (ctypes.c_void_p * n)()
    ptrs = (ctypes.c_void_p * n)()
    for i, (k, v) in enumerate(items.items()):
        val = ctypes.c_int64(v)
        sc = Scalar(5, ctypes.addressof(val))  # S64
        nm = ByteSpan(k.encode(), len(k))
        keep += [val, sc, nm]
        names[i] = ctypes.addressof(nm)
        ptrs[i] = ctypes.addressof(sc)
    a = Attrs(struct_size=ctypes.sizeof(Attrs), size=n, types=ctypes.addressof(types), names=ctypes.addressof(names),
              attrs=ctypes.addressof(ptrs))
    return a, keep + [types, names, ptrs]


def test_handler_errors_become_xla_errors(capi):
    """Wrong operand counts and unbound contexts come back as XLA errors naming the cause
    (never a crash); the instantiate / prepare stages are no-ops."""
    lib = capi.lib()
    errors = []
    api, _keep = _fake_api(errors)
    attrs, keep = _scalar_attrs({"context": 987654, "m": 8, "n": 8, "k": 8, "has_bias": 1})
    frame = CallFrame(struct_size=ctypes.sizeof(CallFrame), api=ctypes.pointer(api), stage=3, attrs=attrs)
    frame.args.struct_size = frame.rets.struct_size = ctypes.sizeof(Span)
    assert lib.nvte_comm_xla_all_gather_gemm(ctypes.addressof(frame)) == 0x1234
    code, msg = errors[-1]
    assert code == 3 and "0 operands and 0 results given" in msg and "has_bias = true" in msg, msg
    for stage in (0, 1):  # instantiate, prepare: nothing to do
        frame.stage = stage
        assert not lib.nvte_comm_xla_gemm_reduce_scatter(ctypes.addressof(frame))
    # A short call frame (an XLA older than the structs) is refused, not read past its end.
    frame.stage = 3
    frame.struct_size = 16
    assert lib.nvte_comm_xla_gemm_all_reduce(ctypes.addressof(frame)) == 0x1234
    assert "call frame has 16 bytes" in errors[-1][1], errors[-1]
    del keep


def test_bind_and_unbind(capi):
    lib = capi.lib()
    st = lib.nvte_comm_xla_bind(5, 0, None)
    assert st == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert lib.nvte_comm_xla_unbind(5, 0) == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
    assert "no context is bound to key 5" in capi.last_error()
    ctx = capi.GemmCtx.from_callbacks(0, 1, lambda b: b, lambda: None)  # no CUDA needed
    try:
        assert lib.nvte_comm_xla_bind(5, -1, ctx.handle) == capi.Status.NVTE_COMM_SUCCESS
        assert lib.nvte_comm_xla_bind(5, -2, ctx.handle) == capi.Status.NVTE_COMM_ERROR_INVALID_ARGUMENT
        assert lib.nvte_comm_xla_unbind(5, -1) == capi.Status.NVTE_COMM_SUCCESS
    finally:
        ctx.close()


# ---- setup exchanges ----


def test_local_exchange_threads():
    pytest.importorskip("jax")  # (the package imports jax, though the exchanges need none of it)
    from transformer_engine_comm.jax import ExchangeTimeout, LocalExchange

    ex = LocalExchange("t", 3, timeout_ms=5000)
    out = [None] * 3

    def member(r):
        ag, bar = ex.member(r)
        out[r] = [ag(bytes([r, 10 + r])) for _ in range(4)]
        bar()

    ts = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    assert all(o == [bytes([0, 10, 1, 11, 2, 12])] * 4 for o in out), out
    assert not ex._rounds, ex._rounds  # every round dropped once read
    ex2 = LocalExchange("t2", 2, timeout_ms=200)
    with pytest.raises(ExchangeTimeout, match=r"member\(s\) \[1\] of 2"):
        ex2.member(0)[0](b"x")


class _FakeKV:
    def __init__(self):
        self.d = {}
        self.cv = threading.Condition()

    def key_value_set_bytes(self, k, v):
        with self.cv:
            assert k not in self.d, f"key {k} written twice"
            self.d[k] = v
            self.cv.notify_all()

    def blocking_key_value_get_bytes(self, k, ms):
        with self.cv:
            if not self.cv.wait_for(lambda: k in self.d, ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {k}")
            return self.d[k]


def test_kv_exchange_fake_store():
    pytest.importorskip("jax")  # (the package imports jax, though the exchanges need none of it)
    from transformer_engine_comm.jax import ExchangeTimeout, KVExchange

    kv = _FakeKV()
    exs = [KVExchange("g", r, 2, client=kv, timeout_ms=5000) for r in range(2)]
    res = [None, None]

    def run(r):
        res[r] = (exs[r].allgather(b"a%d" % r), exs[r].allgather(b"b%d" % r))
        exs[r].barrier()

    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    assert res == [(b"a0a1", b"b0b1")] * 2, res
    lone = KVExchange("h", 0, 3, client=_FakeKV(), timeout_ms=200)
    with pytest.raises(ExchangeTimeout, match=r"rank\(s\) \[1, 2\] of 3"):
        lone.allgather(b"z")


@needs_jax
def test_kv_exchange_through_jax_distributed(tmp_path):
    """Two real processes: jax.distributed.initialize on CPU, then KVExchange allgathers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        r = int(sys.argv[1])
        jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id=r)
        from transformer_engine_comm.jax import KVExchange
        ex = KVExchange("te_comm/test", r, 2, timeout_ms=20000)
        a = ex.allgather(bytes([r]) * 5)
        b = ex.allgather(b"%03d" % (r * 7))
        ex.barrier()
        assert a == bytes([0]) * 5 + bytes([1]) * 5, a
        assert b == b"000007", b
        print("OK", r, flush=True)
        jax.distributed.shutdown()
    """)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ps = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in ps]
    for r, (p, o) in enumerate(zip(ps, outs)):
        assert p.returncode == 0 and f"OK {r}" in o, o


@needs_jax
def test_ops_lower_to_custom_calls(tmp_path):
    """tp_context over 2 CPU devices (in-memory exchange), the MLP's gradient lowered for
    CUDA: the forward and backward GEMMs are our custom calls with the right attributes."""
    code = textwrap.dedent("""
        import os, re
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import transformer_engine_comm.jax as tj
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        ctx = tj.tp_context(mesh, "tp")
        assert ctx.size == 2 and sorted(ctx.ranks.values()) == [0, 1], ctx
        specs = (P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P())
        sm = tj.tp_shard_map(lambda *a: tj.mlp(*a, ctx=ctx), mesh, specs, P("tp", None))
        loss = lambda *a: jnp.sum(sm(*a).astype(jnp.float32) ** 2)
        T, H, F = 64, 32, 128
        shapes = [(T, H), (F, H), (F,), (H, F), (H,)]
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
        txt = jax.jit(jax.grad(loss, argnums=range(5))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"custom_call @(te_comm_\\w+)\\(.*?mhlo.backend_config = \\{([^}]*)\\}", txt)
        names = [c[0] for c in calls]
        assert sorted(names) == sorted(["te_comm_all_gather_gemm"] * 2 + ["te_comm_gemm_reduce_scatter"] * 2), names
        attrs = [dict(kv.split(" = ") for kv in a.split(", ")) for _, a in calls]
        for (n, _), a in zip(calls, attrs):
            assert a["context"].startswith(str(ctx.key)), a
        fwd_ag = [a for (n, _), a in zip(calls, attrs) if n.endswith("all_gather_gemm") and a["transa"] == "true"][0]
        assert fwd_ag["m"].startswith(str(F)) and fwd_ag["n"].startswith(str(T)) and fwd_ag["k"].startswith(str(H)), fwd_ag
        assert fwd_ag["gather_b"] == "true" and fwd_ag["has_bias"] == "true", fwd_ag
        bwd_rs = [a for (n, _), a in zip(calls, attrs) if n.endswith("reduce_scatter") and a["transa"] == "false"][0]
        assert bwd_rs["m"].startswith(str(H)) and bwd_rs["k"].startswith(str(F)), bwd_rs
        ctx.close()
        try:
            tj.all_gather_gemm(jnp.zeros((4, 4)), jnp.zeros((4, 4)), ctx=ctx)
        except ValueError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("a closed context was usable")
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


def test_shard_map_mesh_must_match_the_context():
    """tp_shard_map(..., ctx=) refuses a mesh that places the devices at other TP ranks
    than the context's (each device's context would gather as another rank's shard: a
    silently wrong result), names the devices, and takes the context's own mesh, a
    mesh of the same order with another axis, and a 2-D mesh whose TP groups match."""
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import transformer_engine_comm.jax as tj
        d = np.array(jax.devices())
        f = lambda x: x
        def refused(mesh, ctx, what):
            try:
                tj.tp_shard_map(f, mesh, P("tp"), P("tp"), ctx=ctx)
            except ValueError as e:
                assert what in str(e), str(e)
            else:
                raise AssertionError(f"mesh {mesh} accepted for {ctx}")
        mesh = Mesh(d, ("tp",))
        ctx = tj.tp_context(mesh, "tp")
        tj.tp_shard_map(f, mesh, P("tp"), P("tp"), ctx=ctx)
        tj.tp_shard_map(f, Mesh(d.reshape(1, 4), ("dp", "tp")), P("tp"), P("tp"), ctx=ctx)
        refused(Mesh(d[::-1], ("tp",)), ctx, "device 3: rank 0 on the mesh, 3 in the context")
        refused(Mesh(d.reshape(2, 2), ("dp", "tp")), ctx, "has 2 devices, this context's TP size is 4")
        refused(Mesh(d, ("x",)), ctx, "not this context's TP axis 'tp'")
        tj.tp_shard_map(f, Mesh(d[::-1], ("tp",)), P("tp"), P("tp"))  # (no ctx: no check)
        # 2 x 2: TP groups along the second axis; the transposed device grid swaps them.
        grid = Mesh(d.reshape(2, 2), ("dp", "tp"))
        ctx2 = tj.tp_context(grid, "tp")
        tj.tp_shard_map(f, grid, P("tp"), P("tp"), ctx=ctx2)
        refused(Mesh(d.reshape(2, 2)[:, ::-1], ("dp", "tp")), ctx2, "differently")
        ctx.close(); ctx2.close()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


# ---- FP8 recipes (pure jnp on CPU): exact against a numpy transcription of TE's kernel ----


def _te_amax_and_scale_update_ref(hist, scale, fp8_max, margin, algo):
    """TE's amax_and_scale_update kernel (recipe/delayed_scaling.cu), one column per
    block, transcribed element by element in float32."""
    hist = np.asarray(hist, np.float32)
    L, n = hist.shape
    new_h = np.zeros_like(hist)
    new_s = np.zeros(n, np.float32)
    scaled_max = np.float32(fp8_max) * np.float32(2.0) ** np.float32(-margin)
    for c in range(n):
        last = hist[0, c]
        amax = np.float32(0)
        for i in range(L):
            a = hist[i + 1, c] if i < L - 1 else last
            amax = np.fmax(amax, a)  # fmaxf: NaN ignored
            new_h[i, c] = a if i > 0 else 0
        if algo == "most_recent":
            amax = last
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            s = np.float32(scaled_max[c] if np.ndim(scaled_max) else scaled_max) / amax \
                if (np.isfinite(amax) and amax > 0) else np.float32(scale[c])
        s = np.float32(s)
        if np.isinf(s):
            s = np.finfo(np.float32).max
        new_s[c] = s
    return new_h, new_s


np = __import__("numpy")


@needs_jax
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("L", [1, 2, 5, 16])
def test_amax_and_scale_update_matches_te(algo, margin, L):
    from transformer_engine_comm.jax import fp8 as F

    rng = np.random.default_rng(L * 10 + int(margin))
    hist = (np.abs(rng.standard_normal((L, 3))) * 10.0 ** rng.integers(-3, 3, (L, 3))).astype(np.float32)
    # the special cases of TE's rule: a zero amax, a NaN and an inf in the history, a
    # tiny amax whose scale overflows f32
    hist[0, 0] = 0.0
    if L > 1:
        hist[-1, 1] = np.nan
        hist[1, 2] = np.inf
    else:
        hist[0, 1] = 1e-37  # a normal f32 (XLA flushes subnormals)
    scale = np.array([3.0, 5.0, 7.0], np.float32)
    fmax = np.array([448.0, 448.0, 57344.0], np.float32)
    got_h, got_s = F.amax_and_scale_update(hist, scale, fmax, margin, algo)
    want_h, want_s = _te_amax_and_scale_update_ref(hist, scale, fmax, margin, algo)
    np.testing.assert_array_equal(np.asarray(got_h), want_h)
    np.testing.assert_array_equal(np.asarray(got_s), want_s)


@needs_jax
def test_scale_rule_and_quantize():
    import jax.numpy as jnp
    from transformer_engine_comm.jax import fp8 as F

    am = np.array([0.0, np.nan, np.inf, 2.0, 1e-37], np.float32)
    s = np.asarray(F.scale_from_amax(am, 448.0, 2.0, prev_scale=np.float32(9.0)))
    np.testing.assert_array_equal(s, np.array([9, 9, 9, np.float32(448 * 0.25) / np.float32(2), np.finfo(np.float32).max],
                                              np.float32))
    x = np.array([1.0, -1000.0, 0.3, 500.0], np.float32)
    q = F.quantize(jnp.asarray(x), np.float32(2.0), jnp.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn
    # saturating (TE's satfinite) and round-to-nearest of x * scale
    want = np.asarray(jnp.asarray(np.clip(x * 2, -448, 448)).astype(jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), want)
    assert float(F.amax(jnp.asarray(x))) == 1000.0


@needs_jax
def test_recipes_and_meta_shapes():
    import jax.numpy as jnp
    import transformer_engine_comm.jax as tj

    r = tj.DelayedScaling(amax_history_len=8, amax_compute_algo="most_recent", margin=1, fp8_format="hybrid")
    assert r.fp8_format is tj.Format.HYBRID
    assert [jnp.dtype(d).name for d in r.dtypes] == ["float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"]
    assert [jnp.dtype(d).name for d in tj.CurrentScaling(tj.Format.E4M3).dtypes] == ["float8_e4m3fn"] * 3
    m = tj.fp8_meta_init(r)
    assert m.amax_history.shape == (8, 3) and m.scale.shape == (3,)
    assert float(m.amax_history.sum()) == 0 and float(m.scale.sum()) == 3
    pair = tj.fp8_meta_init(r, 2)
    assert len(pair) == 2 and all(isinstance(p, tj.FP8Meta) for p in pair)
    with pytest.raises(ValueError):
        tj.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError):
        tj.DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError):
        tj.CurrentScaling(fp8_format="E5M2")
    with pytest.raises(TypeError):
        tj.fp8_meta_init(tj.CurrentScaling())


_FP8_STATE = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import transformer_engine_comm.jax as tj
    from transformer_engine_comm.jax import fp8 as F

    rng = np.random.default_rng(0)
    T, H, N = 64, 32, 128
    X = rng.standard_normal((T, H)).astype(np.float32) * 3
    W = (rng.standard_normal((N, H)) * H**-0.5).astype(np.float32)
    Bb = (rng.standard_normal(N) * 0.1).astype(np.float32)
    bf = jnp.bfloat16
    x, w, b = (jnp.asarray(a, bf) for a in (X, W, Bb))
    recipe = tj.DelayedScaling(amax_history_len=3, margin=0.0)
    fmax = F.fp8_max_of(recipe)

    # 1. tp 1 (XLA's FP8 GEMMs): the meta's gradient records this step's amaxes (input,
    #    weight, output gradient) in history row 0, exactly; the update is TE's; three
    #    steps of state round trip, each scale the one the numpy reference predicts.
    ctx1 = tj.tp_context(Mesh(np.array(jax.devices()[:1]), ("tp",)), "tp")
    def loss1(x, w, b, meta, y):
        out = tj.column_parallel_dense(x, w, b, ctx=ctx1, fp8=recipe, fp8_meta=meta)
        return jnp.sum((out.astype(jnp.float32) - y) ** 2) / T
    step = jax.jit(jax.value_and_grad(loss1, argnums=(0, 1, 2, 3)))
    meta = tj.fp8_meta_init(recipe)
    hist_ref = np.zeros((3, 3), np.float32); scale_ref = np.ones(3, np.float32)
    Y = jnp.zeros((T, N), jnp.float32)
    for it in range(3):
        _, (gx, gw, gb, gm) = step(x, w, b, meta, Y)
        out = tj.column_parallel_dense(x, w, b, ctx=ctx1, fp8=recipe, fp8_meta=meta)
        dy = (2 * (out.astype(jnp.float32) - Y) / T).astype(bf)  # the layer's output cotangent
        am = np.array([np.abs(np.asarray(x, np.float32)).max(), np.abs(np.asarray(w, np.float32)).max(),
                       np.abs(np.asarray(dy, np.float32)).max()], np.float32)
        h = np.asarray(gm.amax_history)
        np.testing.assert_array_equal(h[0], np.maximum(hist_ref[0], am))
        np.testing.assert_array_equal(h[1:], hist_ref[1:])
        np.testing.assert_array_equal(np.asarray(gm.scale), scale_ref)
        meta = tj.fp8_meta_update(gm, recipe)
        hist_ref[0] = np.maximum(hist_ref[0], am)
        hist_ref = np.concatenate([np.zeros((1, 3), np.float32), hist_ref[2:], hist_ref[:1]])
        scale_ref = np.where(np.fmax.reduce(np.concatenate([hist_ref, h[:1]]), axis=0) > 0,
                             fmax / np.fmax.reduce(np.concatenate([hist_ref, h[:1]]), axis=0), scale_ref).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(meta.amax_history), hist_ref)
        np.testing.assert_array_equal(np.asarray(meta.scale), scale_ref)
        # the gradients are FP8 GEMMs of the quantized operands: close to the float ones
        ref = jax.grad(lambda x, w, b: jnp.sum((x @ w.T + b - Y) ** 2) / T, argnums=(0, 1, 2))(
            *(a.astype(jnp.float32) for a in (x, w, b)))
        for n_, g, r in zip("xwb", (gx, gw, gb), ref):
            e = float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r))
            assert e < (0.15 if it == 0 else 0.08), (it, n_, e)  # step 0 quantizes with scale 1
    assert gx.dtype == bf and gw.dtype == bf and gm.amax_history.dtype == jnp.float32

    # 2. tp 4 inside shard_map (x replicated: column layer without sequence parallelism,
    #    local FP8 GEMMs): the replicated state's gradient is the max over the devices'
    #    amaxes, exactly once (shard_map sums the devices' cotangents; only the first
    #    hands it out).
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    ctx4 = tj.tp_context(mesh, "tp")
    f = tj.tp_shard_map(lambda x, w, b, m: tj.column_parallel_dense(x, w, b, ctx=ctx4, sequence_parallel=False,
                                                                    fp8=recipe, fp8_meta=m),
                        mesh, (P(), P("tp", None), P("tp"), P()), P(None, "tp"))
    gm = jax.jit(jax.grad(lambda x, w, b, m: jnp.sum(f(x, w, b, m).astype(jnp.float32) ** 2), argnums=3))(
        x, w, b, tj.fp8_meta_init(recipe))
    h0 = np.asarray(gm.amax_history[0])
    assert h0[0] == np.abs(np.asarray(x, np.float32)).max(), h0
    assert h0[1] == np.abs(np.asarray(w, np.float32)).max(), h0  # the max over the 4 shards
    assert np.asarray(gm.amax_history[1:]).sum() == 0 and np.all(np.asarray(gm.scale) == 1), gm

    # 3. errors: a delayed recipe without state, state with a current recipe, wrong shapes
    for kw, exc in ((dict(fp8=recipe), TypeError), (dict(fp8=tj.CurrentScaling(), fp8_meta=tj.fp8_meta_init(recipe)), ValueError),
                    (dict(fp8=recipe, fp8_meta=tj.fp8_meta_init(tj.DelayedScaling(amax_history_len=5))), ValueError)):
        try:
            tj.column_parallel_dense(x, w, b, ctx=ctx1, **kw)
        except exc:
            pass
        else:
            raise AssertionError(kw)
    print("OK")
""")


@needs_jax
def test_fp8_state_round_trip_cpu():
    """Delayed scaling's functional state through the layers' custom VJP (CPU, XLA's FP8
    GEMM path): the recorded amaxes, TE's update over 3 steps, the max over a shard_map
    axis, and the errors."""
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _FP8_STATE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


@needs_jax
def test_fp8_layers_and_layouts_lower_to_custom_calls():
    """tp 2 on CPU devices lowered for CUDA: the FP8 MLP (delayed scaling) runs all four
    comm-GEMMs in FP8 TN (forward e4m3 x e4m3, backward with the e5m2 gradient), gathers
    FP8, and passes transa / transb through; the layouts the library cannot run are
    refused at trace time with TE's words; at tp 1 the layers lower to XLA's dot (no
    custom call) unless library=True."""
    code = textwrap.dedent("""
        import os, re
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import transformer_engine_comm.jax as tj
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        ctx = tj.tp_context(mesh, "tp")
        recipe = tj.DelayedScaling(amax_history_len=4)
        specs = (P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P(), P())
        sm = tj.tp_shard_map(lambda x, w1, b1, w2, b2, m: tj.mlp(x, w1, b1, w2, b2, ctx=ctx, fp8=recipe, fp8_meta=m),
                             mesh, specs, P("tp", None))
        loss = lambda *a: jnp.sum(sm(*a).astype(jnp.float32) ** 2)
        T, H, F = 64, 32, 128
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(T, H), (F, H), (F,), (H, F), (H,)]]
        meta = tj.fp8_meta_init(recipe, 2)
        txt = jax.jit(jax.grad(loss, argnums=range(6))).trace(*args, meta).lower(lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"custom_call @(te_comm_\\w+)\\((.*?)\\) \\{.*?mhlo.backend_config = \\{([^}]*)\\}.*?\\}\\s*:\\s*\\(([^)]*)\\)", txt)
        assert len(calls) == 4, [c[0] for c in calls]
        for name, _, attrs, types in calls:
            a = dict(kv.split(" = ") for kv in attrs.split(", "))
            assert a["transa"] == "true" and a["transb"] == "false" and a["has_scales"] == "true", (name, a)
            assert "f8E4M3FN" in types, (name, types)
        bwd = [t for n, _, a, t in calls if "f8E5M2" in t]
        assert len(bwd) == 2, [c[3] for c in calls]  # the two backward comm-GEMMs take the e5m2 gradient
        gathered = [c for c in calls if c[0].endswith("all_gather_gemm") and "gather_b = true" in c[2]]
        assert len(gathered) == 2, gathered  # the FP8 input (forward) and the FP8 gradient (backward)

        x8 = jnp.zeros((32, 16), jnp.float8_e4m3fn); s = jnp.ones((1,), jnp.float32)
        for kw, words in ((dict(transa=False), "TN layout"), (dict(transa=False, transb=True), "TN layout")):
            try:
                jax.jit(lambda x, w: tj.gemm_reduce_scatter(x, w, ctx=ctx, x_scale_inv=s, w_scale_inv=s, **kw)).trace(x8, x8)
            except ValueError as e:
                assert words in str(e), e
            else:
                raise AssertionError(kw)
        xb = jnp.zeros((32, 16), jnp.bfloat16)
        for f in (lambda x, w: tj.gemm_all_reduce(x, w, ctx=ctx, transa=True, transb=True),
                  lambda x, w: tj.all_gather_gemm(x, w, ctx=ctx, transb=True, transa=False, return_gathered=True)):
            try:
                jax.jit(f).trace(xb, xb)
            except ValueError as e:
                assert "TT" in str(e) or "transb = False" in str(e), e
            else:
                raise AssertionError("refused layout accepted")
        # NN and NT lower with their attributes and TE's shapes: w [K, N/tp], x [K, T/tp] -> y [T, N/tp]
        out = jax.eval_shape(lambda x, w: tj.all_gather_gemm(x, w, ctx=ctx, transa=False, transb=False),
                             jax.ShapeDtypeStruct((16, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32, 8), jnp.bfloat16))
        assert out.shape == (32, 8), out
        out = jax.eval_shape(lambda x, w: tj.gemm_reduce_scatter(x, w, ctx=ctx, transa=False, transb=True),
                             jax.ShapeDtypeStruct((16, 64), jnp.bfloat16), jax.ShapeDtypeStruct((16, 24), jnp.bfloat16))
        assert out.shape == (32, 24), out
        ctx.close()

        mesh1 = Mesh(np.array(jax.devices()[:1]), ("tp",))
        c1 = tj.tp_context(mesh1, "tp")
        for lib, want in ((None, 0), (True, 4)):
            sm1 = tj.tp_shard_map(lambda x, w1, b1, w2, b2: tj.mlp(x, w1, b1, w2, b2, ctx=c1, library=lib),
                                  mesh1, specs[:5], P("tp", None))
            t1 = jax.jit(jax.grad(lambda *a: jnp.sum(sm1(*a).astype(jnp.float32) ** 2), argnums=range(5))).trace(
                *args).lower(lowering_platforms=("cuda",)).as_text()
            n = len(re.findall(r"custom_call @te_comm_", t1))
            assert n == want, (lib, n)
        c1.close()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
