#!/usr/bin/env bash
# The one prepared GPU run: the benchmarks with --device cuda (fp32, plus bf16 autocast), results written
# next to the CPU ones with the suffix _cuda. extraction and losses time every memory format side by side
# in every group (hand-written NCHW and channels_last loops, featurehooks "auto" and "contiguous", and
# for extraction "channels_last"), so the first GPU run says whether memory_format="auto" chooses well on
# CUDA too; and featurehooks' precision="bf16" and "fp16" (the frozen backbone stored in that dtype; bf16 on
# compute capability 8.0+), each in "auto" and "contiguous", beside the float32 rows of the same group. The
# time limits add up to 7:40 on one H200, under 8 minutes with start-up (each script has its own, so one slow
# script cannot eat the others' time; extraction and losses save after every group, so a cut-short run keeps
# what it measured).
#
#   bash benchmarks/run_gpu.sh                 # uses .venv/bin/python if present, else python3
#   PYTHON=/path/to/python bash benchmarks/run_gpu.sh
#   OUT=/some/dir bash benchmarks/run_gpu.sh   # where the .json/.md/.png go (default benchmarks/results)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-benchmarks/results}
HUB=$(mktemp -d)               # seeded weights live here, never in ~/.cache/torch
trap 'rm -rf "$HUB"' EXIT
COMMON=(--device cuda --tag _cuda --out "$OUT" --torch-home "$HUB")

start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"

# extraction: 5 cases (the ViT one included) x {no-grad, grad} x {1x224, 64x224} x {fp32, bf16 autocast} = 40
# groups of 10-12 contenders, 4 of them FeatureExtractor (auto, contiguous) x precision {bf16, fp16} (the
# headline VGG16 relu3_3 case first, with twice the budget)
timeout 215 "$PYTHON" benchmarks/extraction.py "${COMMON[@]}" --budget 1 > /dev/null || echo "extraction: exit $?"
echo "extraction done after $(( $(date +%s) - start )) s"
# loss step: 3 groups x {8x224, 32x224} x {fp32, bf16 autocast}, time and peak memory (content group first);
# featurehooks' losses also in precision bf16 and fp16 (auto, contiguous) in every group
timeout 100 "$PYTHON" benchmarks/losses.py "${COMMON[@]}" --budget 1.5 > /dev/null || echo "losses: exit $?"
echo "losses done after $(( $(date +%s) - start )) s"
# torch.compile (inductor), bf16 + channels_last, 32x224 (saves only at the end: keep its limit)
timeout 120 "$PYTHON" benchmarks/compile.py "${COMMON[@]}" --budget 3 > /dev/null || echo "compile: exit $?"
echo "compile done after $(( $(date +%s) - start )) s"

# per-call hook overhead on a tiny model (launch-bound on a GPU)
timeout 25 "$PYTHON" benchmarks/hook_overhead.py "${COMMON[@]}" > /dev/null || echo "hook_overhead: exit $?"
echo "hook_overhead done after $(( $(date +%s) - start )) s"

for name in extraction losses compile hook_overhead; do
  # a script cut short wrote no chart; draw it from what it saved
  [ -f "$OUT/${name}_cuda.png" ] || "$PYTHON" benchmarks/_harness.py "$OUT/${name}_cuda.json" || true
  cat "$OUT/${name}_cuda.md" || true
done
