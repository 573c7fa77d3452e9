#!/usr/bin/env bash
# The GPU-only checks, for one H200 (no network, jax 0.11.2 preinstalled); under 8 minutes.
# Results go to $OUT/gpu_check.json. On CPU: MODEL=tiny BATCH=4 SEQ=64 bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
export OUT
PYTHONPATH=. timeout 450 python benchmarks/gpu_check.py --model "${MODEL:-1b}" --batch "${BATCH:-8}" \
    --seq "${SEQ:-2048}" --steps "${STEPS:-5}" --out "$OUT"
