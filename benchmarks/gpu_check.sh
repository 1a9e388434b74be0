#!/usr/bin/env bash
# GPU checks of the invariants package, for a machine with one CUDA device (< 8 minutes):
#   1. the tests marked gpu in tests/test_invariants_gpu.py: the engine, the Monitor (fast,
#      strict, deep) and guard_model on CUDA tensors; fast mode must not synchronise the
#      stream inside a hook (CUDA's sync debug mode is "error" around every check), strict
#      mode synchronises once per engine step (sync debug mode "warn", counted per step);
#   2. benchmarks/monitor_overhead.py, both settings side by side: the cheap model (tiny
#      Llama on the GPU: a step the checker's kernel launches weigh on) and $MODEL (default
#      llama-1b-random: the Llama-3.2-1B shape, random weights, bf16), each under no hooks,
#      a null hook, the Monitor (fast, strict, strict with per-phase reads) and guard_model
#      (fast, strict), EQSPEC and holes, plus the per-step op and transfer counts.
#
# Usage: bash benchmarks/gpu_check.sh
# Environment: PYTHON (default .venv/bin/python when it sees CUDA or ALLOW_CPU=1, else
#   python3), MODEL,
#   REPEATS (default 5), OUT (where logs and JSON go; default benchmarks/out),
#   ALLOW_CPU=1 (no GPU: run the same steps on the CPU, smaller, to check this script).
# Time limits: the tests get TEST_LIMIT seconds (default 150), the benchmark BENCH_LIMIT
# (default 270); with the environment check that stays under 8 minutes.
#
# transformers must be 5.24.x for the engine (it refuses other releases at run time).
# A machine with another version needs the wheel carried in .whl/ at the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 \
#       regex==2026.11.19
# (transformers is a pure-Python wheel; it checks regex >= 2025.10.22 at import, and the
# image's may be older); with `echo /.whl/ >> .git/info/exclude` git ignores them. This
# script installs .whl/*.whl into /tmp/site first, where its interpreter lacks 5.24.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && { [ "${ALLOW_CPU:-0}" = 1 ] || .venv/bin/python -c \
      'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }; then
    PY=.venv/bin/python
  fi
fi
source benchmarks/gpu_env.sh

DEVICE=cuda
BENCH=(--model "${MODEL:-llama-1b-random}" --repeats "${REPEATS:-5}" --guard)
if [ "${ALLOW_CPU:-0}" = 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  DEVICE=cpu
  export INVARIANTS_TEST_DEVICE=cpu
  # the 1B shape is far too slow for a CPU dry run: the tiny model in both settings
  BENCH=(--model "${MODEL:-tiny:llama}" --repeats "${REPEATS:-1}" --guard --max-new-tokens 8)
fi
"$PY" - "$DEVICE" <<'EOF'
import sys

import torch
import transformers

cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, cuda {cuda}"
      + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""))
if sys.argv[1] == "cuda" and not cuda:
    sys.exit("no CUDA device: every gpu test would be skipped (ALLOW_CPU=1 runs them on the CPU)")
if not transformers.__version__.startswith("5.24."):
    sys.exit(f"transformers {transformers.__version__} found, 5.24.x needed: carry the wheel "
             "in .whl/ (see the header of this script)")
EOF

OUT_DIR=${OUT:-benchmarks/out}
mkdir -p "$OUT_DIR"
status=0
start=$(date +%s)
timeout "${TEST_LIMIT:-150}" "$PY" -m pytest tests/test_invariants_gpu.py tests/test_sampling_gpu.py tests/test_graphs.py -m gpu -q \
  -p no:cacheprovider -rs 2>&1 | tee "$OUT_DIR/gpu_tests.log" || status=1
echo "gpu tests took $(( $(date +%s) - start ))s"
start=$(date +%s)
timeout "${BENCH_LIMIT:-270}" "$PY" benchmarks/monitor_overhead.py --device "$DEVICE" \
  "${BENCH[@]}" --json "$OUT_DIR/monitor_overhead.json" \
  2>&1 | tee "$OUT_DIR/monitor_overhead.log" || status=1
echo "benchmark took $(( $(date +%s) - start ))s"
exit $status
