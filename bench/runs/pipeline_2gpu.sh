#!/usr/bin/env bash
# The 2-GPU pipeline run that issue 12's speed targets need, in one command (about 8 minutes
# on 2 x H200): the peers in one run, then the deferred weight passes alternated with the
# default. Run from the repository root after `pip install --no-build-isolation --no-deps .`:
#
#     OUT=/some/dir bash bench/runs/pipeline_2gpu.sh
#
# Writes peers.log, defer_ab.log and their RESULT lines to $OUT; bench/README.md says how to
# read them. NCCL_NVLS_ENABLE=0: NVLink multicast off (see docs/gpu.md).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
run() { torchrun --nproc_per_node 2 bench/pipeline_bench.py "$@"; }

# 1. One GPU, torch's GPipe and 1F1B, smp interleaved eager and graphed: step time, samples/s,
#    the bubble, peak memory per rank (the table).
run --micro 4,8,16 --steps 10 --warmup 3 --pipelines interleaved --graphs --only single,torch,smp \
    2>&1 | tee "$OUT/peers.log"

# 2. Deferred weight passes (SMDDP_SMP_DEFER_WEIGHT_GRADS) against the default, graphed,
#    alternating 1 0 0 1 so that drift of the machine falls on both.
for k in 1 0 0 1; do
    echo "== SMDDP_SMP_DEFER_WEIGHT_GRADS=$k"
    SMDDP_SMP_DEFER_WEIGHT_GRADS=$k run --micro 4,8,16 --steps 20 --warmup 3 --pipelines interleaved \
        --graphs --no-eager --only smp
done 2>&1 | tee "$OUT/defer_ab.log"
grep -h "^RESULT\|^== " "$OUT/peers.log" "$OUT/defer_ab.log" > "$OUT/results.txt"
