#!/usr/bin/env bash
# The GPU-only checks, for one H200 (no network, jax 0.11.2 preinstalled); under 10 minutes.
# Results go to $OUT/gpu_check.json, $OUT/host_time.md and $OUT/memory_1b.json.
# On CPU: MODEL=tiny BATCH=4 SEQ=64 HOST_SETS="--set model.d_model=64 --set model.num_layers=2 --set model.num_heads=2
#   --set model.d_ff=128 --set model.vocab_size=512 --set seq_len=64 --set batch_size=8 --set diloco.num_fragments=3" \
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
export OUT
# benchmarks/common.py defaults JAX_PLATFORMS to cpu when it is unset; empty lets JAX pick the GPU
export JAX_PLATFORMS="${JAX_PLATFORMS-}"
mkdir -p "$OUT"
PYTHONPATH=. timeout 400 python benchmarks/gpu_check.py --model "${MODEL:-1b}" --batch "${BATCH:-8}" \
    --seq "${SEQ:-2048}" --steps "${STEPS:-5}" --out "$OUT"
# Host time against device time per step of the real loop: the 1B recipe as data parallel on one device,
# synthetic token shards (no network, no corpus), logging only at the last step.
# shellcheck disable=SC2086
PYTHONPATH=. timeout 200 python benchmarks/host_time.py --config configs/diloco_1b.py --set mesh.replicas=1 \
    --set diloco.enabled=false --set batch_size="${BATCH:-8}" --set keep_checkpoints=1 ${HOST_SETS:-} \
    --steps "${HOST_STEPS:-12}" --skip 4 --repeats 1 --no-before --synthetic-shards "$OUT/shards" --no-write \
    | tee "$OUT/host_time.md"
rm -rf "$OUT/shards"
# The GPU compiler's memory estimate for the 1B step on one device, to set beside the CPU compiler's
# (benchmarks/memory.py on CPU with the same --set); replicated state, the quiet program only.
# shellcheck disable=SC2086
PYTHONPATH=. timeout 200 python benchmarks/memory.py --config configs/diloco_1b.py --devices 1 --layout replicated \
    --quiet-only --set batch_size="$((2 * ${BATCH:-8}))" ${HOST_SETS:-} --json --no-write | tee "$OUT/memory_1b.json"
