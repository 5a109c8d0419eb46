#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, install what is needed, run the gpu-marked
# tests, then the GPU stages of the benchmark recipes, and print the figures.
#
#   tools/gpu_check.sh                  # from the repository root
#   WHEELS=.whl tools/gpu_check.sh      # offline: install the project's wheels from a folder
#
# Prints: nvidia-smi, fastload doctor, the gpu-marked tests, then ResNet-50 (bf16,
# channels_last) on the generated default data with the fast and dali-gpu stages (GPU idle
# from CUDA events), the quickstart recipe on the GPU, fastload profile on a plain training
# script, serving before/after, and the loader benchmark. Results land in runs/gpu-check/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/fastload-site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/fastload-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
elif ! "$PY" -c "import fastload, nvidia.dali" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[test,dali,fast,nvml]"
fi
FASTLOAD=("$PY" -m fastload.cli)

echo "== GPU"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
echo "== doctor"; "${FASTLOAD[@]}" doctor
echo "== gpu-marked tests"; "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests
echo "== ResNet-50 bf16 channels_last, generated default data"
"${FASTLOAD[@]}" recipe run recipes/resnet50-imagenet.toml --folder default --store "" --batch-size 128 \
  --steps 40 --warmup 10 --stage baseline --stage fast --stage dali-gpu --out runs/gpu-check/resnet50 --quiet
echo "== quickstart on the GPU (simulated step replaced by ResNet-18)"
"${FASTLOAD[@]}" recipe run recipes/quickstart.toml --device cuda --model resnet18 --out runs/gpu-check/quickstart --quiet
echo "== fastload profile on a plain torchvision training script, on the GPU (Kineto idle)"
"${FASTLOAD[@]}" profile --steps 60 --warmup 10 --out runs/gpu-check/profile -- \
  "$PY" examples/train_torchvision.py "$("${FASTLOAD[@]}" dataset -q | tail -1)" --model resnet18 --batch-size 64
echo "== serving before/after on the GPU"
"${FASTLOAD[@]}" bench serve --model resnet50 --device cuda --rounds 2 --duration 5
echo "== loader benchmark"
"${FASTLOAD[@]}" bench loader --workers 8 --json runs/gpu-check/bench-loader.json
