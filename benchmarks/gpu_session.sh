#!/usr/bin/env bash
# Everything a session with a lent GPU should measure, as one command that fits one device
# call (at most 600 s; a session has 15 minutes of device time, a machine's start included):
#   1. benchmarks/gpu_check.sh (issue #12, #13): the GPU tests (fast mode never synchronises
#      inside a hook, strict reads once per step) and the Monitor's overhead, the tiny Llama
#      and the Llama-3.2-1B shape (bf16) side by side;
#   2. benchmarks/gpu_throughput.sh (issue #19): the plain loop and speculation at 90%
#      scripted acceptance against Hugging Face generate, 7B shape bf16 and 1B shape fp32,
#      then the 7B run again with the whole decode and verify forwards captured as CUDA
#      graphs (COMPILE=cuda-graphs, the default here; COMPILE= skips it).
# Every step runs under its own time limit (the defaults below sum to 570 s), so a step that
# overruns costs its own figures only; then everything written goes into one archive,
# $OUT/gpu_session.tar.gz (the device tool brings back at most 8 files), beside the two
# scripts' logs, and the lines that carry the acceptance figures are printed last, where
# the tool's output tail shows them.
#
# From the development machine, with the transformers 5.24 wheel (and regex, which it
# checks at import) in .whl/ as gpu_check.sh's header says, the device tool's call is:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=580)
# then give_back, and the figures go into the README (sections "Cost of checking" and
# "A step a GPU can run at speed").
#
# Environment: OUT (default benchmarks/out), TEST_LIMIT (default 80), BENCH_LIMIT (160),
#   STEP_LIMIT (110, each of the three throughput steps), REPEATS (3, both benchmarks),
#   COMPILE (default cuda-graphs: gpu_throughput.sh's third step),
#   ALLOW_CPU=1 (no GPU: the same steps on the CPU, small, to check this script).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-benchmarks/out}
mkdir -p "$OUT_DIR"
work=$(mktemp -d)
start=$(date +%s)
status=0

if [ "${ALLOW_CPU:-0}" = 1 ]; then
  export SMOKE=1  # gpu_throughput.sh's CPU mode
fi
echo "== gpu_check.sh"
OUT=$work/check TEST_LIMIT=${TEST_LIMIT:-80} BENCH_LIMIT=${BENCH_LIMIT:-160} \
  REPEATS=${REPEATS:-3} bash benchmarks/gpu_check.sh > "$OUT_DIR/gpu_check.log" 2>&1
rc=$?; [ $rc = 0 ] || status=1
echo "gpu_check.sh: exit $rc after $(( $(date +%s) - start ))s"
echo "== gpu_throughput.sh"
OUT=$work/throughput STEP_LIMIT=${STEP_LIMIT:-110} REPEATS=${REPEATS:-3} \
  COMPILE=${COMPILE-cuda-graphs} \
  bash benchmarks/gpu_throughput.sh > "$OUT_DIR/gpu_throughput.log" 2>&1
rc=$?; [ $rc = 0 ] || status=1
echo "gpu_throughput.sh: exit $rc after $(( $(date +%s) - start ))s"

cp "$OUT_DIR/gpu_check.log" "$OUT_DIR/gpu_throughput.log" "$work/"
tar czf "$OUT_DIR/gpu_session.tar.gz" -C "$work" .
echo "== figures (full logs and JSON in $OUT_DIR/gpu_session.tar.gz)"
grep -hE "^(python|[0-9]+ (passed|failed)|FAILED|.*(passed|failed|skipped).* in [0-9.]+s)" \
  "$OUT_DIR/gpu_check.log" || true
grep -hE "^(cheap|real) .*(none|null-hook|fast|strict|guard)" "$OUT_DIR/gpu_check.log" || true
grep -hE "^== |^(standard|hf-generate|eqspec|holes|exspec)[ /+]|^  .*: captured " \
  "$OUT_DIR/gpu_throughput.log" || true
echo "session took $(( $(date +%s) - start ))s, exit $status"
exit $status
