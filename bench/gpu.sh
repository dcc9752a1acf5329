#!/usr/bin/env bash
# One prepared run on a GPU host (nothing downloaded): full-size Wan2.2 VAE and a UMT5-XXL-sized encoder from
# their configs with random weights, 33x832x832, bf16. Prints one summary line (seconds per sample, busy fraction).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec "$PY" bench/gpu_bench.py --size full --device cuda --dtype bf16 --samples "${SAMPLES:-8}" "$@"
