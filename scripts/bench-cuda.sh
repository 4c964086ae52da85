#!/usr/bin/env bash
# carpool bench on a CUDA machine, in under five minutes: offline limit, carpool (fp32 and bf16
# autocast), plain Celery and celery-batches on MiniLM, bursts plus a light-load probe.
#   scripts/bench-cuda.sh [OUT_DIR]      (default: reports/cuda-<host>-<date>)
# Needs the project installed with a CUDA torch (`pip install torch` then `pip install -e .[dev]`);
# PY=/path/to/python for another interpreter than .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-reports/cuda-$(hostname)-$(date +%Y%m%d-%H%M)}
mkdir -p "$OUT"
"$PY" - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: this script measures the GPU path")
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY
"$PY" -c "import torch; print(torch.cuda.get_device_name(0))" > "$OUT/device.txt"
export CARPOOL_DEVICE=cuda CARPOOL_MAX_BATCH=${CARPOOL_MAX_BATCH:-64} CARPOOL_MAX_TOKENS=${CARPOOL_MAX_TOKENS:-16384}
timeout 170 "$PY" -m carpool.tools.bench --model minilm --requests 2000 --rates none --light 20 \
    --systems offline,carpool,celery,celery-batches --max-batch "$CARPOOL_MAX_BATCH" --out "$OUT/fp32"
CARPOOL_AUTOCAST_BF16=true timeout 100 "$PY" -m carpool.tools.bench --model minilm --requests 2000 --rates none \
    --light 20 --systems offline,carpool --max-batch "$CARPOOL_MAX_BATCH" --out "$OUT/bf16"
echo "reports: $OUT/fp32/report.json $OUT/bf16/report.json"
