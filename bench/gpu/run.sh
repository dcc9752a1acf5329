#!/usr/bin/env bash
# The GPU shot on a bare host (no network): install the wheelhouse the host lacks (.whl, made here by
# `python bench/gpu/wheels.py .whl --media .gpu/media`), check `latentforge build --help`, then run
# bench/gpu/shot.py with its budget (BUDGET seconds, default 450), its line per leg unbuffered, its JSON and log in
# $OUT. The clips come from .gpu/media (the test-media cache's clips, carried). Extra arguments go to shot.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE="${SITE:-/tmp/site}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
export LATENTFORGE_MEDIA_CACHE="$PWD/.gpu/media" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/gpu-shot-out}"; mkdir -p "$OUT"; export OUT
started=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    2>&1 | grep -v "as the 'root' user" || true
echo "gpu-shot install: $(( $(date +%s) - started )) s, $(ls .whl/*.whl | wc -l) wheels"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('gpu-shot host: torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
if python3 -m flows.cli build --help > "$OUT/build-help.txt" 2>&1; then echo "gpu-shot build --help: ok"
else echo "gpu-shot build --help: FAILED"; tail -20 "$OUT/build-help.txt"; fi
python3 -u bench/gpu/shot.py --budget-s "${BUDGET:-450}" "$@" 2>&1 | tee "$OUT/shot.log" | grep --line-buffered -E "^gpu-shot|Error|error:|Traceback" 
