#!/usr/bin/env bash
# The one prepared GPU run, and the steps around it. A GPU is lent rarely and briefly, to a bare machine: its own
# python3 with torch, torchvision and timm, featurehooks not installed, lpips and piq missing, no network, and at
# most 8 files come back from its $OUT. So the run takes the checkout from its own folder, installs the peers from
# wheels carried in .whl/, packs its results into one archive, and is rehearsed here first, step for step, on the
# CPU with the quick settings (tests/benchmarks/test_run_gpu.py). The device call: docs/performance.md.
#
#   bash benchmarks/run_gpu.sh prepare [NAME ...]   # here, with the network: the peers' wheels into .whl/ (plus
#                                                   # NAME..., e.g. scipy for an interpreter that lacks lpips' needs)
#   bash benchmarks/run_gpu.sh run                  # on the GPU: extraction, losses, compile, hook overhead (~6 min)
#   bash benchmarks/run_gpu.sh rehearse             # the same steps on the CPU with the quick settings (~1 min)
#   bash benchmarks/run_gpu.sh unpack ARCHIVE       # here: the archive's results into benchmarks/results, charts drawn
#
# Environment: PYTHON (default .venv/bin/python if present, else python3); RESULTS (the folder for the .json/.md;
# run: benchmarks/results, rehearse: a temporary one); OUT (when set, the results and the log leave as two files:
# $OUT/gpu_results.tar.gz and $OUT/run_gpu.log; otherwise the charts are drawn beside the results);
# BENCH_TORCH_HOME (a folder for the seeded weights; default a temporary one).
#
# run: each script has its own time limit (they add up to 7:25 on one H200; the machine started in about 30 s on
# 2026-12-04, so the run fits a 15-minute lease); extraction and losses save after every group, so a script cut
# short keeps what it measured.
# extraction's headline (VGG16 relu3_3: hooks vs the hand-written loop vs torchvision FX) runs first.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's featurehooks, not an installed one
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
BENCHMARKS=(extraction losses compile hook_overhead)
PEERS=(lpips==0.1.4 piq==0.8.0)  # what the scripts import beyond the GPU machine's image (torch, timm, scipy, ...)

prepare() {
  # wheels for the GPU machine's interpreter (CPython 3.12, manylinux x86-64); pure-Python ones fit any
  rm -rf .whl && mkdir .whl
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${PEERS[@]}" "$@"
  ls -l .whl
}

unpack() {  # ARCHIVE: its .json and .md into RESULTS (default benchmarks/results), a chart drawn for each .json
  local archive=$1 results=${RESULTS:-benchmarks/results} names charts=()
  names=$(tar -tzf "$archive" | grep -E '^[A-Za-z0-9_]+[.](json|md)$')
  mkdir -p "$results"
  tar -xzf "$archive" -C "$results" $names
  for name in $names; do
    case $name in *.json) charts+=("$results/$name") ;; esac
  done
  "$PYTHON" benchmarks/_report.py "${charts[@]}"  # one process draws them all
  printf '%s\n' "${charts[@]}"
}

benchmark() {  # NAME LIMIT_S ARGS...: one script under its own limit (times LIMIT_SCALE, 1 unless set: a rehearsal
  # on a busy machine), its output to its own log
  local name=$1 limit=$(($2 * ${LIMIT_SCALE:-1})) started=$SECONDS status=0
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$PYTHON" "benchmarks/$name.py" "${COMMON[@]}" "$@" >"$LOGS/$name.log" 2>&1 || status=$?
  echo "$name: exit $status after $((SECONDS - started)) s"
  if [ "$status" -ne 0 ]; then tail -n 15 "$LOGS/$name.log"; fi
}

run() {  # run | rehearse
  local mode=$1
  SITE=$(mktemp -d)
  HUB=${BENCH_TORCH_HOME:-$(mktemp -d)}  # seeded weights live here, never in ~/.cache/torch
  [ "$mode" = rehearse ] && RESULTS=${RESULTS:-$SITE/results}
  RESULTS=${RESULTS:-benchmarks/results}
  mkdir -p "$RESULTS"
  LOGS=$SITE/logs
  mkdir -p "$LOGS"
  trap 'rm -rf "$SITE"; [ -n "${BENCH_TORCH_HOME:-}" ] || rm -rf "$HUB"' EXIT

  # the carried peers, right after the checkout on the path
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/peers" .whl/*.whl
  fi
  export PYTHONPATH="$ROOT:$SITE/peers:$PYTHONPATH"
  "$PYTHON" - "$ROOT" <<'EOF'
import importlib, sys
from importlib.metadata import version
from pathlib import Path
import torch, torchvision, featurehooks
assert Path(featurehooks.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), featurehooks.__file__
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"featurehooks {featurehooks.__version__} from {Path(featurehooks.__file__).parent}")
for peer in ("timm", "lpips", "piq"):
    try:
        importlib.import_module(peer)
        print(f"{peer} {version(peer)}")
    except ImportError as error:  # the losses benchmark needs lpips and piq: say what to carry, then go on
        print(f"MISSING {peer}: {error} (bash benchmarks/run_gpu.sh prepare [NAME ...] here, then carry .whl)")
EOF

  if [ "$mode" = run ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
    TAG=_cuda
    COMMON=(--device cuda --tag $TAG --out "$RESULTS" --torch-home "$HUB" --no-plot)
    # extraction: 5 cases (the ViT one included) x {no-grad, grad} x {1x224, 32x224} x {fp32, bf16 autocast} = 40
    # groups of 10-12 contenders, 4 of them FeatureExtractor (auto, contiguous) x precision {bf16, fp16}; the first
    # run (2026-12-04, 64x224) took 270 s, most of it in the fp32 groups at batch 64 (TF32 off)
    benchmark extraction 200 --budget 0.6
    # loss step: 3 groups x {8x224, 16x224} x {fp32, bf16 autocast}, time and peak memory (content group first); at
    # 32x224 the first run's fp32 groups took 28 s each
    benchmark losses 150 --budget 0.8
    # torch.compile (inductor), bf16 + channels_last, 32x224 (saves only at the end; the first run took 42 s)
    benchmark compile 75 --budget 2.5
    # per-call hook overhead on a tiny model (launch-bound on a GPU)
    benchmark hook_overhead 20
  else
    TAG=_rehearsal  # the quick sizes, one group or case per script that has several (~40 s on 2 cores)
    COMMON=(--device cpu --quick --tag $TAG --out "$RESULTS" --torch-home "$HUB" --no-plot)
    benchmark extraction 60 --cases vgg16-relu3_3 --shapes 1x32
    benchmark losses 60 --groups content
    benchmark compile 60
    benchmark hook_overhead 30
  fi

  local missing=() results=()
  for name in "${BENCHMARKS[@]}"; do
    if [ -f "$RESULTS/$name$TAG.json" ] && [ -f "$RESULTS/$name$TAG.md" ]; then
      results+=("$RESULTS/$name$TAG.json")
    else
      missing+=("$name")
    fi
  done
  "$PYTHON" - "${results[@]}" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    data = json.load(open(path))
    print(f"{data['benchmark']}: {len(data['groups'])} groups" + (" (cut short)" if data["partial"] else ""))
EOF
  if [ -n "${OUT:-}" ]; then  # two files come back: the archive and the log
    mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
    for name in "${BENCHMARKS[@]}"; do echo "==== $name" && cat "$LOGS/$name.log"; done >"$OUT/run_gpu.log"
    (cd "$RESULTS" && shopt -s nullglob && tar -czf "$OUT/gpu_results.tar.gz" -- *"$TAG".json *"$TAG".md)
    echo "packed: $(tar -tzf "$OUT/gpu_results.tar.gz" | tr '\n' ' ')"
  else
    if [ ${#results[@]} -gt 0 ]; then "$PYTHON" benchmarks/_report.py "${results[@]}"; fi
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "no results from: ${missing[*]}" >&2
    exit 1
  fi
  echo "every benchmark wrote its results: ${BENCHMARKS[*]}"
}

case "${1:-run}" in
  prepare) shift; prepare "$@" ;;
  unpack) unpack "${2:?usage: bash benchmarks/run_gpu.sh unpack ARCHIVE}" ;;
  run | rehearse) run "$1" ;;
  *) echo "usage: bash benchmarks/run_gpu.sh [prepare [NAME ...] | run | rehearse | unpack ARCHIVE]" >&2; exit 2 ;;
esac
