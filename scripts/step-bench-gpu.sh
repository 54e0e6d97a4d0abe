#!/usr/bin/env bash
# The training step measured on one GPU, in one call, from the repository root
# (PYTHONPATH=python is set here):
#   1. bench/step_parts.py: the six GEMMs of a LayerNormMLP step and the example's optimizer
#      step alone (the bf16 bar), and the GEMMs in FP8 for reference;
#   2. examples/pytorch/layer_with_overlap.py at tp 1 (a world of one), default size (8192
#      tokens, hidden 4096, ffn 16384, bf16 parameters): bf16 overlap build and no-overlap
#      reference, FP8 delayed and current in both builds, bf16 and FP8 with --cuda-graph,
#      bf16 and FP8 with --force-library-path, and the tp-4 per-rank shape (--ffn-mult 1:
#      ffn 4096) forced and reference, eager and with --cuda-graph; --profile (a separate
#      profiled pass) on the main rows;
#   3. a summary table and the acceptance lines, each "met" or "missed" with its figures:
#      FP8 / bf16 step (<= 0.75), FP8 loss within 2 % of bf16, bf16 step within 1.10x of its
#      GEMMs + optimizer, the library path forced within 3 % of the reference, host time
#      under half the GPU-busy time at the tp-4 shape; CUDA graph vs eager reported.
# The tp-4-shape rows run TE_COMM_STEP_TP4_ITERS steps (20 of them warm-up; a step is about
# 3 ms) whatever --iters / --warmup say, TE_COMM_STEP_TP4_RUNS times each, in alternation:
# their host-time bar is taken on each run's median step and the median run.
#
# Usage: scripts/step-bench-gpu.sh [--iters N] [--warmup N] [--profile-steps N]
#   --iters N          timed steps per row (default 30)
#   --warmup N         warm-up steps per row (default 5)
#   --profile-steps N  steps of the profiled pass where --profile (default 5)
#   -h, --help         this text
# Environment:
#   TE_COMM_LIB             the library (else target/release, built by cargo when present)
#   OUT                     output folder (default gpu-out/); everything goes to $OUT/step
#   PYTHON                  the interpreter (default python3)
#   TE_COMM_STEP_TIMEOUT    seconds per run (default 150)
#   TE_COMM_STEP_ROWS       space-separated row names to run (default all)
#   TE_COMM_STEP_TP4_ITERS  steps of the tp-4-shape rows (default 120)
#   TE_COMM_STEP_TP4_RUNS   runs of each tp-4-shape row (default 3)
#   CUDA_VISIBLE_DEVICES    the GPU (default 0)
# Needs: one GPU (Hopper, H100 / H200, for the FP8 rows); PyTorch with CUDA; cargo only
# without TE_COMM_LIB.
# Takes: about 5 minutes with every row (each run at most TE_COMM_STEP_TIMEOUT s).
# Output: the logs packed into results.tgz beside summary.md (printed); exit non-zero only on
# errors (a run that fails or prints no RESULT line); a missed bar is reported, not an error.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
iters=30 warmup=5 psteps=5
while [ $# -gt 0 ]; do
  case $1 in
    --iters) iters=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --profile-steps) psteps=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out=${OUT:-$root/gpu-out}/step
mkdir -p "$out"
rm -f "$out"/*.log "$out"/*.rc "$out"/*.md
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
export TE_COMM_LIB=${TE_COMM_LIB:-$(te_comm_library)} || exit 1
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
py=${PYTHON:-python3}
tmo=${TE_COMM_STEP_TIMEOUT:-150}
ngpu=$(gpu_count)
[ "$ngpu" -ge 1 ] || { echo "step-bench-gpu: no GPU" >&2; exit 1; }
{
  echo "step-bench-gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1); GPUs: $ngpu (using 1)"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown); library: $TE_COMM_LIB"
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1
  echo "rows: $iters iterations, $warmup warm-up (the tp-4-shape rows: ${TE_COMM_STEP_TP4_ITERS:-120}, 20), profiled pass of $psteps steps where --profile"
} | tee "$out/env.log"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}

errors=0
t_start=$(date +%s)
# (a repeat NAME_rN of a row runs where NAME is wanted)
want() {
  [ -z "${TE_COMM_STEP_ROWS:-}" ] || [[ " $TE_COMM_STEP_ROWS " == *" $1 "* ]] ||
    [[ " $TE_COMM_STEP_ROWS " == *" ${1%_r[0-9]*} "* ]]
}

# 1. The parts of a step alone.
if want parts; then
  timeout -k 10 "$tmo" "$py" "$root/bench/step_parts.py" --out "$out/step_parts.md" >"$out/parts.log" 2>&1
  rc=$?; echo $rc >"$out/parts.rc"
  echo "parts: rc $rc ($(( $(date +%s) - t_start )) s)"
  [ $rc -eq 0 ] || { errors=1; tail -n 20 "$out/parts.log"; }
fi

# 2. The example's rows: NAME ARGS...
port=29600
row() {
  local name=$1; shift
  want "$name" || return 0
  port=$((port + 1))
  local t0=$(date +%s)
  MASTER_PORT=$port timeout -k 10 "$tmo" "$py" "$root/examples/pytorch/layer_with_overlap.py" \
    --iters "$iters" --warmup "$warmup" --log-every 10 --profile-steps "$psteps" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo $rc >"$out/$name.rc"
  echo "$name: rc $rc ($(( $(date +%s) - t0 )) s): $(grep -o 'step_ms=[0-9.]*' "$out/$name.log" | tail -n 1)"
  if [ $rc -ne 0 ] || ! grep -q '^RESULT ' "$out/$name.log"; then errors=1; tail -n 15 "$out/$name.log"; fi
}
row bf16_ovl --profile
row bf16_ref --no-comm-overlap --profile
row fp8d_ovl --fp8 --fp8-recipe delayed --profile
row fp8d_ref --fp8 --fp8-recipe delayed --no-comm-overlap
row fp8c_ovl --fp8 --fp8-recipe current --profile
row fp8c_ref --fp8 --fp8-recipe current --no-comm-overlap
row bf16_graph --cuda-graph --profile
row fp8d_graph --fp8 --fp8-recipe delayed --cuda-graph --profile
row bf16_forced --force-library-path --profile
row fp8d_forced --fp8 --fp8-recipe delayed --force-library-path
tp4=(--iters "${TE_COMM_STEP_TP4_ITERS:-120}" --warmup 20)
row tp4_forced --ffn-mult 1 --force-library-path --profile "${tp4[@]}"
row tp4_ref --ffn-mult 1 --no-comm-overlap --profile "${tp4[@]}"
# The host's speed differs between processes by up to a fifth (bench/RESULTS.md): the two
# tp-4-shape rows run TE_COMM_STEP_TP4_RUNS times (default 3) in alternation, and the host
# bar is read on the median run.
for ((i = 2; i <= ${TE_COMM_STEP_TP4_RUNS:-3}; i++)); do
  row "tp4_forced_r$i" --ffn-mult 1 --force-library-path --profile "${tp4[@]}"
  row "tp4_ref_r$i" --ffn-mult 1 --no-comm-overlap --profile "${tp4[@]}"
done
row tp4_forced_graph --ffn-mult 1 --force-library-path --cuda-graph --profile
row tp4_ref_graph --ffn-mult 1 --no-comm-overlap --cuda-graph --profile
echo "runs: $(( $(date +%s) - t_start )) s"

# 3. Summary and acceptance.
"$py" - "$out" <<'PY' | tee "$out/summary.md"
import os, statistics, sys

out = sys.argv[1]

def fields(path, tag):
    """The last `tag` line of a log as a dict (None without one)."""
    try:
        lines = [l for l in open(path, encoding="utf-8", errors="replace") if l.startswith(tag + " ")]
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:]) if lines else None

ROWS = [  # name, description
    ("bf16_ovl", "bf16, overlap build"), ("bf16_ref", "bf16, no-overlap (reference)"),
    ("fp8d_ovl", "FP8 delayed, overlap build"), ("fp8d_ref", "FP8 delayed, no-overlap"),
    ("fp8c_ovl", "FP8 current, overlap build"), ("fp8c_ref", "FP8 current, no-overlap"),
    ("bf16_graph", "bf16, overlap build, CUDA graph"), ("fp8d_graph", "FP8 delayed, overlap build, CUDA graph"),
    ("bf16_forced", "bf16, library path forced"), ("fp8d_forced", "FP8 delayed, library path forced"),
    ("tp4_forced", "tp-4 shape (ffn 4096), bf16, library path forced"), ("tp4_ref", "tp-4 shape (ffn 4096), bf16, no-overlap"),
    *[(f"tp4_{b}_r{i}", f"tp-4 shape, {d}, run {i}")
      for i in range(2, 2 + sum(1 for f in os.listdir(out) if f.startswith("tp4_forced_r") and f.endswith(".rc")))
      for b, d in (("forced", "library path forced"), ("ref", "no-overlap"))],
    ("tp4_forced_graph", "tp-4 shape, bf16, library path forced, CUDA graph"),
    ("tp4_ref_graph", "tp-4 shape, bf16, no-overlap, CUDA graph"),
]
R, P = {}, {}
print("| row | build | step ms | host ms | GPU busy ms | GEMM ms | comm ms (exposed / hidden) | kernels / step | final loss | status |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name, desc in ROWS:
    log = os.path.join(out, name + ".log")
    if not os.path.exists(log):
        continue
    rc = open(os.path.join(out, name + ".rc")).read().strip()
    r, p = fields(log, "RESULT"), fields(log, "PROFILE")
    if r:
        R[name] = r
    if p:
        P[name] = p
    st = "ok" if rc == "0" and r else f"ERROR (rc {rc}{', no RESULT line' if not r else ''})"
    g = lambda d, k, f="{:.3f}": f.format(float(d[k])) if d and k in d else "-"
    comm = f"{g(p, 'comm_ms')} ({g(p, 'comm_exposed_ms')} / {g(p, 'comm_hidden_ms')})" if p else "-"
    print(f"| {name} | {desc} | {g(r, 'step_ms')} | {g(r, 'host_ms')} | {g(p, 'gpu_busy_ms')} | {g(p, 'gemm_ms')} | "
          f"{comm} | {g(p, 'kernels', '{:.0f}')} | {g(r, 'final_loss', '{:.6f}')} | {st} |")
parts = fields(os.path.join(out, "parts.log"), "STEP_PARTS")
if parts:
    print()
    print(f"Parts alone (bench/step_parts.py, medians): six bf16 GEMMs {float(parts['gemm_bf16_ms']):.3f} ms "
          f"(back to back {float(parts['gemm_bf16_seq_ms']):.3f}), optimizer step {float(parts['adam_ms']):.3f} ms, "
          f"bar {float(parts['bar_ms']):.3f} ms; six FP8 GEMMs {float(parts['gemm_fp8_ms']):.3f} ms; "
          f"fastest Adam: {parts['adam_fastest']}")

print()
print("Acceptance (tp 1, one GPU):")
lines = []

def acc(what, num, den, bar, fmt_fig, ok_if=lambda v, b: v <= b, note=""):
    if num is None or den is None:
        lines.append(f"- {what}: NOT MEASURED (a row it needs failed or was not run)")
        return
    v = num / den
    lines.append(f"- {what}: {'met' if ok_if(v, bar) else 'MISSED'}: {fmt_fig(v)}{note}")

step = lambda n: float(R[n]["step_ms"]) if n in R else None
loss = lambda n: float(R[n]["final_loss"]) if n in R else None
for build, sfx in (("overlap build", "ovl"), ("no-overlap build", "ref")):
    for rec, tag in (("delayed", "fp8d"), ("current", "fp8c")):
        a, b = step(f"{tag}_{sfx}"), step(f"bf16_{sfx}")
        acc(f"FP8 {rec} step / bf16 step, {build} (<= 0.75)", a, b, 0.75,
            lambda v, a=a, b=b: f"{a:.3f} / {b:.3f} ms = {v:.3f}")
for build, sfx in (("overlap build", "ovl"), ("no-overlap build", "ref")):
    for rec, tag in (("delayed", "fp8d"), ("current", "fp8c")):
        a, b = loss(f"{tag}_{sfx}"), loss(f"bf16_{sfx}")
        acc(f"FP8 {rec} final loss vs bf16, {build} (within 2 %)", a, b, 0.02,
            lambda v, a=a, b=b: f"{a:.6f} vs {b:.6f}: {100 * (v - 1):+.2f} %", ok_if=lambda v, bar: abs(v - 1) <= bar)
bar = float(parts["bar_ms"]) if parts else None
for build, n in (("overlap build", "bf16_ovl"), ("no-overlap build", "bf16_ref")):
    a = step(n)
    acc(f"bf16 step / (six GEMMs + optimizer), {build} (<= 1.10)", a, bar, 1.10,
        lambda v, a=a: f"{a:.3f} / {bar:.3f} ms = {v:.3f}")
def runs_of(base):
    """The measured runs of row `base`: base, then its repeats base_rN, in run order."""
    rep = [n for n in R if n.startswith(base + "_r") and n.rsplit("_r", 1)[1].isdigit()]
    return ([base] if base in R else []) + sorted(rep, key=lambda n: int(n.rsplit("_r", 1)[1]))


def step_runs(base):
    """The median step ms over the runs of row `base`, and their count; (None, 0) without one."""
    v = [step(n) for n in runs_of(base)]
    return (statistics.median(v), len(v)) if v else (None, 0)


for what, fn, rn in (("bf16", "bf16_forced", "bf16_ref"), ("FP8 delayed", "fp8d_forced", "fp8d_ref"),
                     ("tp-4 shape bf16", "tp4_forced", "tp4_ref")):
    (a, na), (b, nb) = step_runs(fn), step_runs(rn)
    runs = f" (medians of {na} / {nb} runs)" if max(na, nb) > 1 else ""
    acc(f"library path forced / reference step, {what} (within 3 %: <= 1.03)", a, b, 1.03,
        lambda v, a=a, b=b, runs=runs: f"{a:.3f} / {b:.3f} ms = {v:.3f}{runs}")
# Host time per step at the tp-4 shape: each run's median step (METHOD: median of many; the
# mean carries the host's rare stalls of several ms) over its GPU-busy time, the bar on the
# median run (the host's speed differs between processes); every run, the means and the
# reference beside.
med = lambda n: float(R[n]["host_ms_median"]) if n in R and "host_ms_median" in R[n] else None


def host_runs(base):
    """[(name, host median ms, GPU busy ms)] of the runs of row `base` that measured both."""
    return [(n, med(n), float(P[n]["gpu_busy_ms"])) for n in runs_of(base) if med(n) is not None and P.get(n)]


fr = host_runs("tp4_forced")
mid = statistics.median(h / b for _, h, b in fr) if fr else None
acc(f"host ms / GPU-busy ms at the tp-4 shape, library path forced, median step, median of {len(fr)} runs (<= 0.5)",
    mid, 1.0 if fr else None, 0.5,
    lambda v: f"{v:.3f} (runs: " + ", ".join(f"{h:.3f} / {b:.3f} ms = {h / b:.3f}" for _, h, b in fr) + ")")
reports = []
for base in ("tp4_forced", "tp4_ref"):
    for n, h, busy in host_runs(base):
        reports.append(f"- host ms / GPU-busy ms at the tp-4 shape, {n} (reported): median {h:.3f} ms = {h / busy:.3f}, "
                       f"mean {float(R[n]['host_ms']):.3f} ms = {float(R[n]['host_ms']) / busy:.3f} (GPU busy {busy:.3f} ms)")
for what, gn, en in (("bf16", "bf16_graph", "bf16_ovl"), ("FP8 delayed", "fp8d_graph", "fp8d_ovl"),
                     ("tp-4 shape bf16, library path forced", "tp4_forced_graph", "tp4_forced"),
                     ("tp-4 shape bf16, reference", "tp4_ref_graph", "tp4_ref")):
    a, b = step(gn), step(en)
    if a is not None and b is not None:
        # A comparison, not a bar: reported, not counted.
        gp = P.get(gn)
        busy = f"; host / GPU-busy with the graph {float(R[gn]['host_ms']) / float(gp['gpu_busy_ms']):.3f}" if gp else ""
        reports.append(f"- CUDA graph / eager step, {what} (compared, no bar): {a:.3f} / {b:.3f} ms = "
                       f"{a / b:.3f}; host ms {float(R[gn]['host_ms']):.3f} vs {float(R[en]['host_ms']):.3f}{busy}")
print("\n".join(lines + reports))
met = sum(" met:" in l for l in lines)
print(f"\nstep-bench-gpu: {met} of {len(lines)} bars met")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || errors=1
[ -f "$out/step_parts.md" ] && { echo; cat "$out/step_parts.md"; } | tee -a "$out/summary.md"
echo "step-bench-gpu: $(( $(date +%s) - t_start )) s; errors: $errors"
# Few files come back from the device machine: the logs in one archive beside the summary.
if tar czf "$root/.step-results.tgz" -C "$out" --exclude summary.md . 2>/dev/null; then
  find "$out" -mindepth 1 -maxdepth 1 ! -name summary.md -exec rm -rf {} +
  mv "$root/.step-results.tgz" "$out/results.tgz"
fi
exit $errors
