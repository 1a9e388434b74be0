#!/usr/bin/env bash
# Issue #19's side-by-side GPU comparison, for one CUDA device (< 8 minutes on an H200):
#   1. Vicuna-7B shape (llama-7b-random), bf16, batch 8, 8 prompts of 64-256 random tokens,
#      32 new tokens: the project's plain loop (standard) next to Hugging Face generate
#      (hf-generate), and EQSPEC and holes with scripted drafts at 90% acceptance built from
#      the batched reference (--script-from batched; fixed draft length k=4);
#   2. Llama-3.2-1B shape (llama-1b-random), fp32 (exact), batch 8, 16 prompts: the same
#      plus EXSPEC;
#   3. (COMPILE=cuda-graphs, or inductor) step 1 again with the compiled fast path twins,
#      each also with static shapes (+static: few forward shapes, so few graphs to capture;
#      cuda-graphs captures the target's whole decode and verify forwards per bucket,
#      specdec/graphs.py, and always runs with static shapes: the table's
#      "captured forwards" lines say how many forwards each graph served).
# Each prints the throughput tables: "vs hf" is each configuration's tokens/s over Hugging
# Face generate's at the same batch size (median over interleaved repeats); the acceptance
# targets are standard >= 1.00 (7B bf16) and the speculative rows >= 2.00 (1B fp32, 7B bf16).
#
# Usage: bash benchmarks/gpu_throughput.sh
# Environment: PYTHON (as in gpu_check.sh), OUT (default benchmarks/out), REPEATS (default 3),
#   COMPILE (default none: skip step 3), SMOKE=1 (no GPU: the same steps on the CPU with the
#   tiny Llama and a few tokens, to check this script; no figure from it means anything).
# Time limits per step: STEP_LIMIT seconds (default 210): steps 1 and 2 stay under 8 minutes
# together (an estimate: this script has not run on a GPU yet); step 3 adds up to one more.
# transformers must be 5.24.x; carry the wheel in .whl/ as gpu_check.sh's header says.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
fi
source benchmarks/gpu_env.sh
OUT_DIR=${OUT:-benchmarks/out}
mkdir -p "$OUT_DIR"
LIMIT=${STEP_LIMIT:-210}
REP=${REPEATS:-3}

if [ "${SMOKE:-0}" = 1 ]; then
  BIG=(--model tiny:llama --device cpu --prompts 4 --prompt-tokens 4 12 --max-new-tokens 6)
  SMALL=("${BIG[@]}")
  BIG_DTYPE=float32
  REP=1
else
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else
    "no CUDA device: SMOKE=1 runs these steps on the CPU")'
  BIG=(--model llama-7b-random --device cuda --prompts 8 --prompt-tokens 64 256 --max-new-tokens 32)
  SMALL=(--model llama-1b-random --device cuda --prompts 16 --prompt-tokens 64 256 --max-new-tokens 32)
  BIG_DTYPE=bfloat16
fi
COMMON=(--batch-sizes 8 --drafters scripted:0.9 --script-from batched --policies fixed --k 4
        --repeats "$REP")

status=0
run() {  # name, then the benchmark's arguments
  local name=$1; shift
  local start; start=$(date +%s)
  echo "== $name: benchmarks/throughput.py $*"
  timeout "$LIMIT" "$PY" benchmarks/throughput.py "$@" --out "$OUT_DIR/$name" \
    2>"$OUT_DIR/$name.err" | tee "$OUT_DIR/$name.log" || { status=1; tail -5 "$OUT_DIR/$name.err"; }
  echo "== $name took $(( $(date +%s) - start ))s"
}

run throughput-7b-bf16 "${BIG[@]}" --dtype "$BIG_DTYPE" --strategies eqspec holes "${COMMON[@]}"
run throughput-1b-fp32 "${SMALL[@]}" --dtype float32 --strategies eqspec holes exspec "${COMMON[@]}"
if [ -n "${COMPILE:-}" ]; then
  PROXY=()  # no GPU: cuda-graphs runs with its CPU stand-in (specdec.graphs.cpu_proxy)
  if [ "${SMOKE:-0}" = 1 ] && [ "$COMPILE" = cuda-graphs ]; then PROXY=(--graphs-cpu-proxy); fi
  run throughput-7b-bf16-"$COMPILE" "${BIG[@]}" --dtype "$BIG_DTYPE" --strategies eqspec \
    --compile "$COMPILE" --static-shapes "${PROXY[@]}" "${COMMON[@]}"
fi
exit $status
