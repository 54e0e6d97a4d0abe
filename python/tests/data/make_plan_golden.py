"""Records what the torch and JAX adapters computed for a fixed set of arguments, so that
python/tests/test_core.py can check that the framework-neutral core (and the adapters
rebuilt on it) give the same results: plans (global m, n, k, output shape and dtype, FP8
or not), or the error (type and message).

It was run on the adapters as they were before the core existed (commit 01fe077, torch
2.15 and jax 0.10 on the CPU), and its output, gzipped, is
python/tests/data/plan_golden.json.gz:

    PYTHONPATH=python python3 python/tests/data/make_plan_golden.py | gzip -9 -n > plan_golden.json.gz

test_core.py replays the cases through the core, and (where torch / jax are installed)
runs torch_results / jax_results on the current adapters and compares: torch's must be
identical, JAX's too except for the wording of its layout errors (now the core's).

No GPU, no process group and no library call: the group's size and rank come from patched
helpers, tensors are meta tensors (torch) and the XLA custom call is recorded instead of
made (JAX).
"""
import json
import os
import random
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int32", "float64"]
# (x dtype, weight dtype, out_dtype)
DTYPE_CASES = [
    ("bfloat16", "bfloat16", None), ("float16", "float16", None), ("float32", "float32", None),
    ("bfloat16", "float16", None), ("float8_e4m3fn", "float8_e4m3fn", None),
    ("float8_e4m3fn", "float8_e5m2", None), ("float8_e5m2", "float8_e4m3fn", None),
    ("float8_e5m2", "float8_e5m2", None), ("float8_e4m3fn", "bfloat16", None), ("bfloat16", "float8_e4m3fn", None),
    ("bfloat16", "bfloat16", "float32"), ("bfloat16", "bfloat16", "float16"), ("float16", "float16", "bfloat16"),
    ("float8_e4m3fn", "float8_e4m3fn", "float16"), ("float8_e4m3fn", "float8_e4m3fn", "float32"),
    ("float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn"), ("int32", "int32", None), ("float64", "float64", None),
]
LAYOUTS = [(True, False), (False, False), (False, True), (True, True)]
GROUPS = [(1, 0), (2, 0), (2, 1), (3, 2), (4, 0), (4, 3), (8, 5)]
SIZES = [(256, 128, 64), (250, 126, 64), (64, 3, 48), (48, 32, 40), (96, 64, 33), (128, 256, 32), (32, 1, 16)]


def numroc(g, tp, r):  # the distribution the adapters use (independent copy)
    if g <= 0:
        return 0
    b = -(-g // tp)
    return max(0, min(b, g - r * b))


def cases(seed=23, count=1500):
    rnd = random.Random(seed)
    out = []
    for i in range(count):
        op = ("ag", "rs", "ar")[i % 3]
        tp, rank = rnd.choice(GROUPS)
        # Mostly valid arguments (each error kind still comes up), so most cases plan.
        xd, wd, od = rnd.choice(DTYPE_CASES[:5] * 3 + DTYPE_CASES)
        m, n, k = rnd.choice(SIZES)
        fp8 = xd.startswith("float8") or wd.startswith("float8")
        transa, transb = rnd.choices(LAYOUTS, weights=[5, 3, 3, 1])[0]
        if fp8 and rnd.random() < 0.8:
            transa, transb = True, False
        c = dict(op=op, tp=tp, rank=rank, transa=transa, transb=transb, x_dtype=xd, w_dtype=wd, out_dtype=od,
                 gelu=False, comm_sm_count=0 if rnd.random() > 0.03 else -1)
        if op == "ag":
            nl, ml, kl = numroc(n, tp, rank), numroc(m, tp, rank), k
            c["n_global"] = rnd.choice([n] * 7 + [-1] * 2 + [n + tp])
            c["m_global"] = rnd.choice([m] * 7 + [-1] * 2 + [m + 2 * tp])
            c["gelu"] = rnd.random() < 0.3
            bias_m = ml
        else:
            nl, ml, kl = n, m, numroc(k, tp, rank)
            c["k_global"] = rnd.choice([k] * 7 + [-1] * 2 + [k + 3 * tp])
            rows = numroc(n, tp, rank)
            c["out_rows"] = -1 if op == "ar" else rnd.choice([rows] * 9 + [rows + 1])
            bias_m = ml
        c["x_shape"] = [kl, nl] if transb else [nl, kl]
        kw = kl if rnd.random() > 0.05 else kl + 8  # a k mismatch now and then
        c["w_shape"] = [ml, kw] if transa else [kw, ml]
        b = rnd.random()
        if b < 0.5:
            c["bias"] = None
        else:
            want = od or ("bfloat16" if fp8 else xd)
            if fp8:
                want = "float16" if od == "float16" else "bfloat16"
            if b < 0.85:
                c["bias"] = [want, bias_m]
            elif b < 0.93:
                c["bias"] = ["float32" if want != "float32" else "bfloat16", bias_m]
            else:
                c["bias"] = [want, bias_m + 1]
        c["scales"] = fp8 or rnd.random() < 0.04  # FP8 inputs always get valid scales here
        out.append(c)
    return out


# ----------------------------------------------------------------------------- torch


def torch_results(cs):
    import torch

    import transformer_engine_comm.torch as te
    from transformer_engine_comm.torch import ops

    state = {}
    saved = (ops._group_size_rank, ops._size_rank, ops.group_name_of)
    ops._group_size_rank = lambda name: state["g"]
    ops._size_rank = lambda group, op="": state["g"]
    ops.group_name_of = lambda group=None: "golden"
    try:
        return _torch_results(cs, state, torch, te, ops)
    finally:
        ops._group_size_rank, ops._size_rank, ops.group_name_of = saved


def _torch_results(cs, state, torch, te, ops):

    def t(shape, dt):
        return torch.empty(shape, dtype=getattr(torch, dt), device="meta")

    def err(e):
        return {"error": type(e).__name__, "message": str(e)}

    plan_out, public_out = [], []
    for c in cs:
        state["g"] = (c["tp"], c["rank"])
        x, w = t(c["x_shape"], c["x_dtype"]), t(c["w_shape"], c["w_dtype"])
        bias = t([c["bias"][1]], c["bias"][0]) if c["bias"] else None
        s = t([1], "float32") if c["scales"] else None
        od = getattr(torch, c["out_dtype"]) if c["out_dtype"] else None
        try:
            if c["op"] == "ag":
                p = ops._plan_ag(x, w, bias, s, s, "golden", c["n_global"], c["m_global"], od, c["gelu"],
                                 c["comm_sm_count"], c["transa"], c["transb"])
            else:
                fn = "gemm_reduce_scatter" if c["op"] == "rs" else "gemm_all_reduce"
                p = ops._plan_k_split(f"te_comm.{fn}", x, w, bias, s, s, "golden", c["k_global"], od,
                                      c["comm_sm_count"], scatter=c["op"] == "rs", out_rows=c["out_rows"],
                                      transa=c["transa"], transb=c["transb"])
            r = {"m": p.m, "n": p.n, "k": p.k, "out_shape": list(p.out_shape), "out_dtype": str(p.out_dtype),
                 "fp8": p.fp8}
        except Exception as e:  # noqa: BLE001
            r = err(e)
        plan_out.append(r)
        # The public function (meta tensors: the dispatcher and the fake implementation).
        kw = dict(transa=c["transa"], transb=c["transb"], out_dtype=od, gelu=c["gelu"],
                  comm_sm_count=c["comm_sm_count"], x_scale_inv=s, w_scale_inv=s)
        try:
            if c["op"] == "ag":
                res = te.all_gather_gemm(x, w, bias, n_global=None if c["n_global"] < 0 else c["n_global"],
                                         m_global=None if c["m_global"] < 0 else c["m_global"], **kw)
            else:
                fn = te.gemm_reduce_scatter if c["op"] == "rs" else te.gemm_all_reduce
                res = fn(x, w, bias, k_global=None if c["k_global"] < 0 else c["k_global"], **kw)
            res = res if isinstance(res, tuple) else (res,)
            r = {"outs": [[list(o.shape), str(o.dtype)] for o in res]}
        except Exception as e:  # noqa: BLE001
            r = err(e)
        public_out.append(r)

    # Option arguments of the public functions, and the tensor-level checks.
    misc = []
    state["g"] = (4, 3)
    bf = lambda *s: t(list(s), "bfloat16")  # noqa: E731
    opts = [dict(algo=a) for a in ("default", "split_p2p", "SPLIT_P2P", "atomic_multicast", 0, 1, 4, 5, -1,
                                   "multicast_please")]
    opts += [dict(comm=c_) for c_ in ("pg", "own", "mine")]
    opts += [dict(transport=tr) for tr in (None, "auto", "ipc", "nccl", "", "tcp", "IPC")]
    opts += [dict(transa="yes"), dict(transb=1.5), dict(n_global=-4), dict(k_global=-1), dict(m_global=-2)]
    for op in ("ag", "rs", "ar"):
        for o in opts:
            if op != "ag" and ("n_global" in o or "m_global" in o):
                continue
            if op == "ag" and "k_global" in o:
                continue
            fn = {"ag": te.all_gather_gemm, "rs": te.gemm_reduce_scatter, "ar": te.gemm_all_reduce}[op]
            try:
                res = fn(bf(32, 16), bf(48, 16), **o)
                r = {"outs": [[list(res.shape), str(res.dtype)]]}
            except Exception as e:  # noqa: BLE001
                r = err(e)
            misc.append({"op": op, "kwargs": {k: v for k, v in o.items()}, "result": r})
        for name, args in (("x transposed view", (bf(16, 32).t(), bf(48, 16))),
                           ("weight transposed view", (bf(32, 16), bf(16, 48).t())),
                           ("x 3-D", (bf(2, 32, 16), bf(48, 16))), ("x not a tensor", ([[1.0]], bf(48, 16))),
                           ("bias view", (bf(32, 16), bf(48, 16), bf(96)[::2]))):
            fn = {"ag": te.all_gather_gemm, "rs": te.gemm_reduce_scatter, "ar": te.gemm_all_reduce}[op]
            try:
                res = fn(*args)
                r = {"outs": [[list(res.shape), str(res.dtype)]]}
            except Exception as e:  # noqa: BLE001
                r = err(e)
            misc.append({"op": op, "kwargs": {"case": name}, "result": r})

    from transformer_engine_comm.torch import _context

    kinds = []
    for comm in ("pg", "own", "x"):
        for tr in (None, "", "auto", "ipc", "nccl", "tcp"):
            try:
                r = {"key": _context._check_kind(comm, tr)}
            except Exception as e:  # noqa: BLE001
                r = err(e)
            kinds.append({"comm": comm, "transport": tr, "result": r})
    dts = []
    for name in ("uint8", "int8", "int16", "int32", "int64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                 "float8_e5m2", "float64", "bool", "complex64"):
        try:
            r = {"nvte": _context.nvte_dtype(getattr(torch, name)).name}
        except Exception as e:  # noqa: BLE001
            r = err(e)
        dts.append({"dtype": name, "result": r})
    algo = {a.name: int(a) for a in te.GemmAlgo}
    return {"plan": plan_out, "public": public_out, "options": misc, "context_kind": kinds, "nvte_dtype": dts,
            "GemmAlgo": algo, "TRANSPORTS": list(_context.TRANSPORTS), "COMM_KINDS": list(_context.COMM_KINDS),
            "FP8_MAX": {str(k).replace("torch.", ""): v for k, v in __import__(
                "transformer_engine_comm.torch.fp8", fromlist=["FP8_MAX"]).FP8_MAX.items()}}


# ----------------------------------------------------------------------------- JAX


def jax_results(cs):
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from transformer_engine_comm.jax import ops as jops

    calls = []

    def fake_ffi_call(target, outs):
        def run(*args, **attrs):
            calls.append({"target": target, "outs": [[list(o.shape), jnp.dtype(o.dtype).name] for o in outs],
                          "args": [[list(a.shape), jnp.dtype(a.dtype).name] for a in args],
                          "attrs": {k: (bool(v) if isinstance(v, bool) else int(v)) for k, v in attrs.items()}})
            return [np.empty(o.shape, o.dtype) for o in outs]
        return run

    saved = (jops.register, jax.ffi.ffi_call)
    jops.register = lambda: None
    jax.ffi.ffi_call = fake_ffi_call
    try:
        return _jax_results(cs, calls, types, jnp, np, jops)
    finally:
        jops.register, jax.ffi.ffi_call = saved


def _jax_results(cs, calls, types, jnp, np, jops):
    out = []
    one = jnp.ones((1,), jnp.float32)
    # numpy arrays of jax's dtypes stand for the operands (only shapes and dtypes are read;
    # a jax array per case would take 40 s)
    def dt(name):  # jax's dtype for a name (float64 -> float32 without x64, as jax warns)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return jnp.dtype(jnp.zeros((), name).dtype)

    for c in cs:
        ctx = types.SimpleNamespace(size=c["tp"], rank=c["rank"], closed=False, key=7, axis="tp")
        x = np.empty(c["x_shape"], dt(c["x_dtype"]))
        w = np.empty(c["w_shape"], dt(c["w_dtype"]))
        bias = np.empty([c["bias"][1]], dt(c["bias"][0])) if c["bias"] else None
        s = one if c["scales"] else None
        kw = dict(ctx=ctx, x_scale_inv=s, w_scale_inv=s, out_dtype=c["out_dtype"], transa=c["transa"],
                  transb=c["transb"])
        del calls[:]
        try:
            if c["op"] == "ag":
                n_tokens = None if c["n_global"] < 0 else c["n_global"]
                gathered = c["gelu"] and not c["transb"]
                res = jops.all_gather_gemm(x, w, bias, n_tokens=n_tokens, gelu=c["gelu"], return_gathered=gathered,
                                           **kw)
            elif c["op"] == "rs":
                res = jops.gemm_reduce_scatter(x, w, bias, **kw)
            else:
                res = jops.gemm_all_reduce(x, w, bias, **kw)
            res = res if isinstance(res, tuple) else (res,)
            r = {"call": calls[0], "outs": [[list(o.shape), jnp.dtype(o.dtype).name] for o in res]}
        except Exception as e:  # noqa: BLE001
            r = {"error": type(e).__name__, "message": str(e)}
        out.append(r)
    rows = []
    for n in (1, 2, 3, 7, 8, 126, 128, 250, 256):
        for tp, rank in GROUPS:
            ctx = types.SimpleNamespace(size=tp, rank=rank)
            rows.append([n, tp, rank, jops._scattered_rows(n, ctx), jops.numroc(n, tp, rank)])
    return {"calls": out, "scattered_rows": rows}


def main():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    cs = cases()
    golden = {"cases": cs, "torch": torch_results(cs), "jax": jax_results(cs)}
    json.dump(golden, sys.stdout, indent=None, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
