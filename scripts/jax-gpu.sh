#!/usr/bin/env bash
# The JAX package's GPU checks on one GPU, from a prebuilt library (no cargo), in one call
# (STAGES picks):
#   tests     the JAX GPU tests (python/tests/jax/test_jax_gpu.py): one process with command
#             buffers off and on, two processes sharing the GPU with them on, the shard_map
#             checks with one and two processes (the autotuner-candidate sweep is left to
#             scripts/gpu-test.sh); then the block-scaled FP8 tests
#             (python/tests/jax/test_jax_block_fp8_gpu.py, one process, one GPU);
#   examples  examples/jax/mlp_with_overlap.py in every mode with --profile (bf16: XLA's
#             build, the layers, the library forced; FP8 delayed, current and block: the
#             layers and the library forced; block: the layers against bf16);
# then the acceptance checks at tp 1: the layers within 1.03x of XLA's build, FP8's final
# loss within 2 % of bf16's, the FP8 builds' GEMMs in FP8 and the FP8 step faster than
# bf16's; block FP8's step at most 0.80x the bf16 step of its run, its loss within 2 %.
#
# Usage: TE_COMM_LIB=/path/libtransformer_engine_comm.so OUT=/tmp/out scripts/jax-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB     the prebuilt library (required)
#   OUT             output folder for the logs (default gpu-out/)
#   STAGES          "tests examples" (default), or either alone
#   TE_COMM_JAX_NP  process counts of the tests (default 1,2)
#   JAX_TESTS_K     the tests' pytest -k expression (TE_COMM_JAX_NP=1,2,4 with
#                   -k "test_ops_grads_training or test_shard_map" runs them all)
# Needs: one GPU (Hopper for FP8); JAX with CUDA, pytest.
# Takes: about 2.5 minutes for the tests on an H100 and 2 for the block tests on an H200;
# the four example runs at most 300 s each (XLA's FP8 autotuning makes the FP8 ones the
# longest): about 7-12 minutes in all.
# Output: a table and the PASS / FAIL checks last; exit non-zero when anything failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
: "${TE_COMM_LIB:?set TE_COMM_LIB to the prebuilt libtransformer_engine_comm.so}"
fail=0
step() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then echo "ok    $name ($((SECONDS - t0)) s)"; else echo "FAIL  $name ($((SECONDS - t0)) s): $out/$name.log"; tail -20 "$out/$name.log"; fail=1; fi
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/device.txt" 2>&1
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' >> "$out/device.txt" 2>&1
cat "$out/device.txt"

stages=" ${STAGES:-tests examples} "
if [[ $stages == *" tests "* ]]; then
  # ~2.5 minutes on one H100: one process with command buffers off and on, two processes
  # sharing the GPU with them on, the shard_map checks with one and two processes.
  # TE_COMM_JAX_NP=1,2,4 and -k "test_ops_grads_training or test_shard_map" run them all.
  TE_COMM_JAX_NP=${TE_COMM_JAX_NP:-1,2} step jax-tests timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
    "$root/python/tests/jax/test_jax_gpu.py" -k "${JAX_TESTS_K:-test_ops_grads_training and (np1 or np2-cmdbuf-on) or test_shard_map_multi_process or test_shard_map_single_process and cmdbuf-on}"
  # ~2 minutes on one H200 (54 tests, 2026-12-02).
  step jax-block-tests timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
    "$root/python/tests/jax/test_jax_block_fp8_gpu.py"
fi
if [[ $stages == *" examples "* ]]; then
  ex="$root/examples/jax/mlp_with_overlap.py"
  step example-bf16 timeout 300 python3 "$ex" --builds xla,layers,library --profile --profile-dir "$out/traces"
  step example-fp8-delayed timeout 300 python3 "$ex" --fp8-recipe delayed --builds layers,library --profile --profile-dir "$out/traces"
  step example-fp8-current timeout 300 python3 "$ex" --fp8-recipe current --builds layers,library --profile --profile-dir "$out/traces"
  step example-fp8-block timeout 300 python3 "$ex" --fp8-recipe block --compare-bf16 --profile --profile-dir "$out/traces"
fi

python3 - "$out" <<'PY' || fail=1
import json, sys, os
out = sys.argv[1]
rows = []
for name in ("example-bf16", "example-fp8-delayed", "example-fp8-current"):
    p = os.path.join(out, name + ".log")
    if os.path.exists(p):
        rows += [json.loads(l[7:]) for l in open(p) if l.startswith("RESULT ")]
by = {(r["build"], r["precision"]): r for r in rows}
checks = []
xla, lay = by.get(("xla", "bf16")), by.get(("layers", "bf16"))
if xla and lay:
    checks.append(("tp-1 layers / XLA step <= 1.03", lay["step_ms"] / xla["step_ms"], lay["step_ms"] / xla["step_ms"] <= 1.03))
for rec in ("delayed", "current"):
    f = by.get(("layers", f"fp8 {rec}"))
    if f and lay:
        d = abs(f["final_loss"] - lay["final_loss"]) / abs(lay["final_loss"])
        checks.append((f"fp8 {rec} final loss within 2 % of bf16", d, d <= 0.02))
    if f and "xla_fp8_gemms" in f:
        # 5 GEMMs: the step differentiates the parameters only, so the first layer's dgrad is dead code
        checks.append((f"fp8 {rec} (tp 1): XLA FP8 GEMMs (5) + other GEMMs (0)",
                       f"{f['xla_fp8_gemms']} + {f['xla_gemms']}", f["xla_fp8_gemms"] == 5 and f["xla_gemms"] == 0))
    if f and lay:
        checks.append((f"fp8 {rec} (tp 1): step / bf16 step < 1", f["step_ms"] / lay["step_ms"], f["step_ms"] < lay["step_ms"]))
    g = by.get(("library", f"fp8 {rec}"))
    if g and "library_calls" in g:
        checks.append((f"fp8 {rec}, library forced: comm-GEMM calls (3) + XLA FP8 wgrads (2) + other GEMMs (0)",
                       f"{g['library_calls']} + {g['xla_fp8_gemms']} + {g['xla_gemms']}",
                       g["library_calls"] == 3 and g["xla_fp8_gemms"] == 2 and g["xla_gemms"] == 0))
# Block FP8 against the bf16 step of the same run (--compare-bf16): the issue's bars.
p = os.path.join(out, "example-fp8-block.log")
if os.path.exists(p):
    b = {}
    for l in open(p):
        if l.startswith("RESULT "):
            try:
                r = json.loads(l[7:])
                b[r["precision"]] = r
            except (ValueError, KeyError):  # a truncated line: the check below fails
                pass
    rows += [dict(r, build=r["build"] + " (block run)") for r in b.values()]
    if "bf16" in b and "fp8 block" in b:
        ratio = b["fp8 block"]["step_ms"] / b["bf16"]["step_ms"]
        checks.append(("fp8 block (tp 1): step / bf16 step <= 0.80", ratio, ratio <= 0.80))
        d = abs(b["fp8 block"]["final_loss"] - b["bf16"]["final_loss"]) / abs(b["bf16"]["final_loss"])
        checks.append(("fp8 block final loss within 2 % of bf16", d, d <= 0.02))
    else:
        checks.append(("fp8 block example: RESULT lines of bf16 and fp8 block", len(b), False))
cols = ["build", "precision", "step_ms", "host_enqueue_ms", "profiled_step_ms", "gpu_busy", "gemm", "comm_exposed", "comm_hidden", "host",
        "kernels", "xla_fp8_gemms", "xla_gemms", "library_calls", "final_loss"]
print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
for r in rows:
    print("| " + " | ".join((f"{r[c]:.6f}" if c == "final_loss" else f"{r[c]:.3f}") if isinstance(r.get(c), float)
                            else str(r.get(c, "-")) for c in cols) + " |")
print()
bad = 0
for what, v, ok in checks:
    print(f"{'PASS' if ok else 'FAIL'}  {what}: {v if not isinstance(v, float) else round(v, 4)}")
    bad += not ok
if not rows:
    print("FAIL  no RESULT lines"); bad += 1
sys.exit(1 if bad else 0)
PY
exit $fail
