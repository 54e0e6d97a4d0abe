#!/usr/bin/env bash
# A/B of the cast + transpose kernels on one GPU (NVTE_COMM_CAST_TRANSPOSE: v3 = the
# default, v2 = the one before, v1 = the previous kernel, v2-* and v3-* = bench variants), in
# ONE device call, from a prebuilt library (no cargo):
#   1. python/tests/test_quantize.py: every quantization test, including the bit-exact
#      cast + transpose tests of every kernel (odd sizes, edges, unaligned, noop, 8192^2);
#   2. bench/quantize_bench.py --ct-variants: the usual table (barred rows with the default
#      kernel) and every cast + transpose kernel at 64M elements, interleaved rounds (less
#      any kernel whose test in step 1 failed).
#
# Usage: TE_COMM_LIB=<libtransformer_engine_comm.so> scripts/quant-ab-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB      the prebuilt library (required)
#   OUT              output folder for logs and tables (default quant-ab-out/)
#   QUANT_AB_ITERS   the bench's --iters (default 50)
#   QUANT_AB_ROUNDS  the bench's --ct-rounds (default 5)
# Needs: one Hopper GPU (H100 / H200: FP8); PyTorch with CUDA, pytest.
# Takes: several minutes (each step at most 540 s).
# Output: a short table last; exit non-zero when a step fails (the bench fails when a barred
# row misses its bar).
set -u
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/quant-ab-out}
mkdir -p "$out"
: "${TE_COMM_LIB:?set TE_COMM_LIB to the prebuilt libtransformer_engine_comm.so}"
export TE_COMM_LIB
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
unset NVTE_COMM_CAST_TRANSPOSE  # the default kernel, except where the test / bench sets it
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv; } \
  >"$out/device.txt" 2>&1
git -C "$root" log -1 --format='%H %s' >"$out/commit.txt" 2>/dev/null || true
rows=()
fail=0
step() {  # step NAME CMD...
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*"
  timeout -k 10 540 "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local res=PASS
  [ $rc -ne 0 ] && { res="FAIL (rc $rc)"; fail=1; tail -n 40 "$out/$name.log"; }
  rows+=("| $name | $res | $(( $(date +%s) - t0 )) s |")
}

step test_quantize python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/test_quantize.xml" \
  "$root/python/tests/test_quantize.py"
# The sweep times every kernel whose own test (test_cast_transpose_variants[<name>]) did
# not fail: a kernel that faults leaves the process's CUDA context unusable, so one broken
# variant must not cost the whole table ('all' when the test report is missing).
ct=$(python3 - "$out/test_quantize.xml" "$root/bench/quantize_bench.py" <<'PY'
import ast, os, sys
import xml.etree.ElementTree as ET
xml, bench = sys.argv[1], sys.argv[2]
if not os.path.exists(xml):
    print("all")
    sys.exit()
tree = ast.parse(open(bench).read())
names = next(ast.literal_eval(n.value) for n in tree.body
             if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CT_ALL")
bad = set()
for tc in ET.parse(xml).iter("testcase"):
    name = tc.get("name", "")
    if name.startswith("test_cast_transpose_variants[") and \
            (tc.find("failure") is not None or tc.find("error") is not None):
        bad.add(name[len("test_cast_transpose_variants["):-1])
if bad:
    print("kernels left out of the sweep (their test failed): " + ", ".join(sorted(bad)), file=sys.stderr)
print(",".join(v for v in names if v not in bad) or "v3")
PY
)
step quantize_bench python3 "$root/bench/quantize_bench.py" --ct-variants "$ct" \
  --iters "${QUANT_AB_ITERS:-50}" --ct-rounds "${QUANT_AB_ROUNDS:-5}" --out "$out/quantize_bench.md"

echo
cat "$out/device.txt" | head -n 1
echo "commit: $(cut -c1-12 "$out/commit.txt" 2>/dev/null)"
echo
echo "| step | result | time |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
grep -E "passed|failed|error" "$out/test_quantize.log" | tail -n 1
if [ -f "$out/quantize_bench.md" ]; then
  echo
  grep -E "^\|( (operation|quantize|compute_amax|D2D)|---)" "$out/quantize_bench.md" | head -n 6
  echo
  awk '/^cast \+ transpose bf16->e4m3 by kernel/ { on = 1 } /^\| host cost/ { on = 0 } on' \
    "$out/quantize_bench.md"
  tail -n 1 "$out/quantize_bench.md"
fi
exit $fail
