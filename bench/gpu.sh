#!/usr/bin/env bash
# One prepared run on a GPU host (nothing downloaded): full-size Wan2.2 VAE and a UMT5-XXL-sized encoder from
# their configs with random weights, 33x832x832, bf16. Prints one summary line (seconds per sample, busy fraction),
# after the 8-bit Gemma line of bench/gpu_ltx2_8bit.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# the 8-bit Gemma path (bitsandbytes): a tiny LTX-2.5 snapshot built and encoded with --load-text-encoder-in-8bit
"$PY" bench/gpu_ltx2_8bit.py --device cuda --ltx-version 2.5
exec "$PY" bench/gpu_bench.py --size full --device cuda --dtype bf16 --samples "${SAMPLES:-8}" "$@"
