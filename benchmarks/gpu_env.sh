# Sourced by the GPU scripts (gpu_check.sh, gpu_throughput.sh) after PY is set: install a
# carried transformers wheel (.whl/*.whl, see gpu_check.sh's header) into /tmp/site and
# put it on PYTHONPATH, unless $PY already has transformers 5.24; put the repository there.
if compgen -G ".whl/*.whl" > /dev/null && ! "$PY" -c 'import sys, transformers
sys.exit(not transformers.__version__.startswith("5.24."))' 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
