#!/usr/bin/env bash
# The GPU checks of issue 54, as one command on the device machine (no internet there;
# ../shared/FACTS.md). Run from the repository root with the wheels carried:
#     make gpu-wheels                     # here, once: .cache/gpu-wheels (~48 MB)
#     device run, carry [".cache/gpu-wheels"], command "bash bench/gpu_check.sh 1.2B"
# Arguments: the bench's shapes (default 1.2B; 7.4B takes ~2 min more to build and load).
# What it prints goes to $OUT/gpu_check.txt too, with bench/results/gpu.json.
set -u
SHAPES="${1:-1.2B}"
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('image: torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .cache/gpu-wheels/*.whl
SRC="packages/common/src:packages/node/src:packages/tracker/src"
export PYTHONPATH="/tmp/site:$SRC"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "== gpu-marked tests"
PYTHONPATH="$PYTHONPATH:tests:packages/tracker/tests" timeout 120 \
    python3 -m pytest -q -m gpu -p no:cacheprovider packages/node/tests 2>&1 | tail -25
echo "== GPU bench ($SHAPES)"
# the HF baseline on the image's own transformers (5.25's generate asks the hub for kernels)
timeout 420 python3 bench/gpu_bench.py --shapes "$SHAPES" --int4 "$SHAPES" --runs 2 \
    --hf-pythonpath "$SRC"
cp bench/results/gpu.json "$OUT/" 2>/dev/null || true
