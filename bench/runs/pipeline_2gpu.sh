#!/usr/bin/env bash
# The 2-GPU pipeline run that issue 12's speed targets need (2 x H200). Run from the
# repository root after `pip install --no-build-isolation --no-deps .`:
#
#     OUT=/some/dir bash bench/runs/pipeline_2gpu.sh peers   # about 5 minutes
#     OUT=/some/dir bash bench/runs/pipeline_2gpu.sh defer   # about 4 minutes
#
# (or `all`, both in turn; two calls keep each under a 10-minute device command). Writes each
# part's log and its RESULT lines to $OUT; bench/README.md says how to read them.
# NCCL_NVLS_ENABLE=0: NVLink multicast off (see docs/gpu.md).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
part=${1:-all}
case "$part" in
    peers | defer | all) ;;
    *) echo "pipeline_2gpu.sh: unknown part '$part' (peers, defer or all)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
run() { torchrun --nproc_per_node 2 bench/pipeline_bench.py "$@"; }

if [ "$part" = peers ] || [ "$part" = all ]; then
    # One GPU, torch's GPipe and 1F1B, smp interleaved eager and graphed, and with 2 active
    # microbatches (suffix _a2: as many in flight on the first stage as 1F1B, the like-for-like
    # memory figure): step time, samples/s, the bubble, peak memory per rank.
    run --micro 4,8,16 --steps 10 --warmup 3 --pipelines interleaved --graphs --active 2 \
        --only single,torch,smp 2>&1 | tee "$OUT/peers.log"
    grep -h "^RESULT" "$OUT/peers.log" > "$OUT/peers_result.txt"
fi

if [ "$part" = defer ] || [ "$part" = all ]; then
    # Deferred weight passes (SMDDP_SMP_DEFER_WEIGHT_GRADS) against the default, graphed,
    # alternating 1 0 0 1 so that drift of the machine falls on both.
    for k in 1 0 0 1; do
        echo "== SMDDP_SMP_DEFER_WEIGHT_GRADS=$k"
        SMDDP_SMP_DEFER_WEIGHT_GRADS=$k run --micro 4,8,16 --steps 20 --warmup 3 --pipelines interleaved \
            --graphs --no-eager --only smp
    done 2>&1 | tee "$OUT/defer_ab.log"
    grep -h "^RESULT\|^== " "$OUT/defer_ab.log" > "$OUT/defer_ab_result.txt"
fi
