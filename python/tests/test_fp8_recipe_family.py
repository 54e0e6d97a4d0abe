"""One FP8 recipe family (transformer_engine_comm.recipe), shared by torch and JAX: TE's
names, fields, types and defaults; validation naming the field; the compatibility names
(jax's CurrentScaling); the dtype names per format and each framework's mapping of them.
Host only: the core tests need neither torch nor JAX; the framework tests skip without them."""
import dataclasses
import os
import subprocess
import sys

import pytest

from transformer_engine_comm import recipe as R

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ the core family


def test_te_names_fields_and_defaults():
    assert [m.name for m in R.Format] == ["E4M3", "E5M2", "HYBRID"]
    ds = [(f.name, f.default) for f in dataclasses.fields(R.DelayedScaling)]
    assert ds == [("margin", 0), ("fp8_format", R.Format.HYBRID), ("amax_history_len", 1024),
                  ("amax_compute_algo", "max"), ("reduce_amax", True)]
    cs = [(f.name, f.default) for f in dataclasses.fields(R.Float8CurrentScaling)]
    assert cs == [("fp8_format", R.Format.HYBRID), ("amax_epsilon", 0.0), ("force_pow_2_scales", False)]
    r = R.DelayedScaling()
    assert type(r.margin) is int and type(r.amax_history_len) is int and type(r.reduce_amax) is bool
    assert r.delayed and not R.Float8CurrentScaling().delayed


def test_format_dtype_names():
    F = R.Format
    assert (F.HYBRID.fwd, F.HYBRID.bwd) == ("float8_e4m3fn", "float8_e5m2")
    assert (F.E4M3.fwd, F.E4M3.bwd) == ("float8_e4m3fn", "float8_e4m3fn")
    assert (F.E5M2.fwd, F.E5M2.bwd) == ("float8_e5m2", "float8_e5m2")
    assert (F.HYBRID.max_fwd, F.HYBRID.max_bwd) == (448.0, 57344.0)  # TE's Format.HYBRID.value
    assert F("hybrid") is F.HYBRID and F("E4M3") is F.E4M3
    # (input, weight, output gradient): forward, forward, backward
    assert R.DelayedScaling().dtypes == ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")
    assert R.Float8CurrentScaling(R.Format.E4M3).dtypes == ("float8_e4m3fn",) * 3


def test_conversions_to_te_types():
    r = R.DelayedScaling(margin=1.0, amax_history_len=8.0, fp8_format="e4m3", reduce_amax=0)
    assert r.margin == 1 and type(r.margin) is int
    assert r.amax_history_len == 8 and type(r.amax_history_len) is int
    assert r.fp8_format is R.Format.E4M3 and r.reduce_amax is False
    assert R.DelayedScaling(margin=-2).margin == -2  # TE takes any int
    c = R.Float8CurrentScaling(amax_epsilon=1, force_pow_2_scales=1)
    assert c.amax_epsilon == 1.0 and type(c.amax_epsilon) is float and c.force_pow_2_scales is True
    # converted values compare and hash like the TE-typed ones
    assert R.DelayedScaling(margin=0.0) == R.DelayedScaling() and hash(R.DelayedScaling(margin=0.0)) == hash(R.DelayedScaling())


@pytest.mark.parametrize("kwargs, exc, field", [
    (dict(margin=0.5), ValueError, "margin"),  # TE's margin is an int: a fraction is refused
    (dict(margin=float("inf")), ValueError, "margin"),
    (dict(margin="1"), TypeError, "margin"),
    (dict(margin=True), TypeError, "margin"),
    (dict(amax_history_len=0), ValueError, "amax_history_len"),
    (dict(amax_history_len=2.5), ValueError, "amax_history_len"),
    (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
    (dict(amax_compute_algo=max), ValueError, "amax_compute_algo"),  # TE's callable: not run here
    (dict(fp8_format=R.Format.E5M2), ValueError, "fp8_format"),  # TE: no pure E5M2 training
    (dict(fp8_format="E5M2"), ValueError, "fp8_format"),
    (dict(fp8_format="e3m4"), ValueError, "fp8_format"),
    (dict(fp8_format=3), ValueError, "fp8_format"),
    (dict(reduce_amax="yes"), TypeError, "reduce_amax"),
    (dict(reduce_amax=2), TypeError, "reduce_amax"),
])
def test_delayed_validation_names_the_field(kwargs, exc, field):
    with pytest.raises(exc, match=f"DelayedScaling: {field}"):
        R.DelayedScaling(**kwargs)


@pytest.mark.parametrize("kwargs, exc, field", [
    (dict(amax_epsilon=-1.0), ValueError, "amax_epsilon"),
    (dict(amax_epsilon=float("nan")), ValueError, "amax_epsilon"),
    (dict(amax_epsilon="0"), TypeError, "amax_epsilon"),
    (dict(force_pow_2_scales="no"), TypeError, "force_pow_2_scales"),
    (dict(fp8_format="E5M2"), ValueError, "fp8_format"),
])
def test_current_validation_names_the_field(kwargs, exc, field):
    with pytest.raises(exc, match=f"Float8CurrentScaling: {field}"):
        R.Float8CurrentScaling(**kwargs)


def test_te_fields_not_run_here_are_refused():
    # TE keywords the library does not implement are unknown keywords, never ignored.
    for kw in ("scaling_factor_compute_algo", "fp8_dpa", "fp8_mha", "backward_override"):
        with pytest.raises(TypeError, match=kw):
            R.DelayedScaling(**{kw: None})


def test_recipe_from_name_and_frozen():
    assert R.recipe_from_name("delayed", amax_history_len=4) == R.DelayedScaling(amax_history_len=4)
    assert isinstance(R.recipe_from_name("current"), R.Float8CurrentScaling)
    with pytest.raises(ValueError, match="blockwise"):
        R.recipe_from_name("blockwise")
    with pytest.raises(dataclasses.FrozenInstanceError):
        R.DelayedScaling().margin = 3


def test_core_imports_no_framework():
    code = ("import sys, transformer_engine_comm.recipe; "
            "print([m for m in ('torch', 'jax', 'numpy') if m in sys.modules])")
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------ the frameworks


def _jax():
    pytest.importorskip("jax")
    from transformer_engine_comm.jax import fp8 as jf

    return jf


def _torch():
    torch = pytest.importorskip("torch")
    from transformer_engine_comm.torch import fp8 as tf

    return torch, tf


def test_jax_exports_the_core_classes():
    jf = _jax()
    import transformer_engine_comm.jax as tj

    assert jf.DelayedScaling is R.DelayedScaling and tj.DelayedScaling is R.DelayedScaling
    assert jf.Float8CurrentScaling is R.Float8CurrentScaling and tj.Float8CurrentScaling is R.Float8CurrentScaling
    assert jf.CurrentScaling is R.Float8CurrentScaling and tj.CurrentScaling is R.Float8CurrentScaling  # old name
    assert jf.Format is R.Format and tj.Format is R.Format and jf.recipe_from_name is R.recipe_from_name
    # JAX's earlier float margin: integral values still work (as TE's int), the field is an int now
    r = tj.DelayedScaling(amax_history_len=3, margin=0.0, fp8_format="hybrid")
    assert r.margin == 0 and type(r.margin) is int and r.reduce_amax is True


def test_jax_dtypes_and_state():
    jf = _jax()
    import jax.numpy as jnp

    r = jf.DelayedScaling(amax_history_len=4, margin=1)
    assert jf.jax_dtypes(r) == (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2)
    assert [jnp.dtype(d).name for d in r.dtypes] == ["float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"]
    assert jf.jax_dtype(jf.Format.E4M3.bwd) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="FP8"):
        jf.jax_dtype("bfloat16")
    assert list(jf.fp8_max_of(r)) == [448.0, 448.0, 57344.0]
    assert jf.quantize(jnp.array([1000.0, -1.0]), 1.0, r.dtypes[0]).dtype == jnp.float8_e4m3fn
    m = jf.fp8_meta_init(r)
    m = jf.FP8Meta(m.amax_history.at[0].set(jnp.array([2.0, 4.0, 8.0])), m.scale)
    new = jf.fp8_meta_update(m, r)
    # (fp8_max / amax) / 2**margin with the int margin
    assert [float(s) for s in new.scale] == [448.0 / 2 / 2, 448.0 / 4 / 2, 57344.0 / 8 / 2]


def test_jax_layers_refuse_what_they_cannot_honour():
    jf = _jax()
    assert jf.as_recipe(True) == jf.Float8CurrentScaling() and jf.as_recipe(False) is None
    r = jf.DelayedScaling()
    assert jf.as_recipe(r) is r
    with pytest.raises(ValueError, match="reduce_amax=False"):
        jf.as_recipe(jf.DelayedScaling(reduce_amax=False))
    with pytest.raises(ValueError, match="amax_epsilon"):
        jf.as_recipe(jf.Float8CurrentScaling(amax_epsilon=1e-6))
    with pytest.raises(ValueError, match="force_pow_2_scales"):
        jf.as_recipe(jf.CurrentScaling(force_pow_2_scales=True))
    with pytest.raises(TypeError):
        jf.as_recipe("delayed")


def test_torch_exports_the_core_classes_and_dtypes():
    torch, tf = _torch()
    assert tf.DelayedScaling is R.DelayedScaling and tf.Float8CurrentScaling is R.Float8CurrentScaling
    assert tf.Format is R.Format and tf.recipe_from_name is R.recipe_from_name
    assert tf.fwd_dtype(tf.Format.HYBRID) == torch.float8_e4m3fn
    assert tf.bwd_dtype(tf.DelayedScaling()) == torch.float8_e5m2
    assert tf.dtypes(tf.Float8CurrentScaling(tf.Format.E4M3)) == (torch.float8_e4m3fn,) * 3
    assert tf.torch_dtype("e4m3") == torch.float8_e4m3fn and tf.torch_dtype(torch.float8_e5m2) == torch.float8_e5m2
    for bad in ("bfloat16", torch.bfloat16, "nope", None):
        with pytest.raises(ValueError, match="fp8_dtype"):
            tf.torch_dtype(bad)


def test_torch_takes_dtype_names():
    torch, tf = _torch()
    m = tf.Fp8Meta(tf.DelayedScaling(amax_history_len=2), tf.Format.HYBRID.bwd, "cpu")
    assert m.fp8_dtype == torch.float8_e5m2
    t = m.cast(torch.tensor([[1.0, -2.0]]))
    assert t.dtype == torch.float8_e5m2 and t.data.dtype == torch.float8_e5m2
    q, _ = tf.quantize(torch.tensor([1.0]), "float8_e4m3fn", torch.tensor([2.0]))
    assert q.dtype == torch.float8_e4m3fn and q.float().item() == 2.0


def test_one_family_for_both_frameworks():
    _, tf = _torch()
    jf = _jax()
    assert tf.DelayedScaling is jf.DelayedScaling
    assert tf.Float8CurrentScaling is jf.Float8CurrentScaling is jf.CurrentScaling
    assert tf.Format is jf.Format
    assert tf.recipe_from_name("delayed", margin=1.0) == jf.DelayedScaling(margin=1)
