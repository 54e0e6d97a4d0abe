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
