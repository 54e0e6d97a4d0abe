#!/usr/bin/env bash
# Diagnostic (4 GPUs): layer_with_overlap.py step time per overlap component at tp 4, then
# bench/torch_ops.py at tp 4 and 2 and the torch op tests at 4 ranks. Logs under $OUT/ablate.
# Usage (from the repository root, library built): OUT=dir bash bench/example_ablate.sh
source "$(dirname "$0")/../scripts/common.sh"
cd "$root"; OUT=${OUT:-$root/gpu-out}
export PYTHONPATH=$root/python TE_COMM_LIB=$root/target/release/libtransformer_engine_comm.so
o=$OUT/ablate; mkdir -p $o
ex() { local tag=$1; shift; timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node=4 examples/pytorch/layer_with_overlap.py --iters 14 "$@" > $o/$tag.log 2>&1; echo "$tag rc=$? $(grep -o 'step_ms=[0-9.]*' $o/$tag.log)"; }
ex bf16_none --no-comm-overlap
ex bf16_all
ex bf16_fwd_only --no-ub-bulk-dgrad --no-ub-bulk-wgrad
ex bf16_no_fwd --no-ub-overlap-ag --no-ub-overlap-rs
ex bf16_no_bulk_wgrad --no-ub-bulk-wgrad
ex fp8_none --fp8 --no-comm-overlap
ex fp8_all --fp8
ex fp8_fwd_only --fp8 --no-ub-bulk-dgrad --no-ub-bulk-wgrad
for np in 4 2; do timeout 80 python3 -m torch.distributed.run --standalone --nproc-per-node=$np bench/torch_ops.py --iters 30 --out $o/torch_ops_tp$np.md > $o/torch_ops_tp$np.log 2>&1; echo "torch_ops $np rc=$?"; done
PYTEST_ADDOPTS="-k ops" TE_COMM_TEST_TIMEOUT=100 scripts/torch-gpu.sh 4 > $o/torch_test.log 2>&1; echo "torch-gpu rc=$?"; tail -3 $o/torch_test.log
cat $o/torch_ops_tp4.md $o/torch_ops_tp2.md
