#!/usr/bin/env bash
# The Real-ESRGAN benchmark as one device command (repository root of the device's copy).
#
# Here, before the call (repository root; .whl and .bench are ignored):
#   cargo build --release -p vnfarm-models --example esrgan_bench
#   mkdir -p .bench && cp $CARGO_TARGET_DIR/release/examples/esrgan_bench .bench/esrgan_bench
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl numpy        # only used when the device's Python has no numpy
# Device call: `run` with carry [".bench", ".whl"], timeout_s 540, command
#   worker/models/bench/run_esrgan_bench.sh
# Extra arguments go to run_esrgan_bench.py (e.g. `--budget 300`, `--models anime_6b`).
#
# $OUT receives esrgan_results.json, esrgan_table.md, esrgan_run.log (everything every process
# printed) and esrgan_logs.tgz (the per-process logs). Weights and images stay in /tmp/es.
set -o pipefail
if ! python3 -c "import numpy" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/numpy-*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/esrgan_out}
mkdir -p "$out" /tmp/eo
python3 worker/models/bench/run_esrgan_bench.py --bin .bench/esrgan_bench --work /tmp/es --out /tmp/eo "$@" 2>&1 \
  | tee "$out/esrgan_run.log"
rc=$?
cp /tmp/eo/esrgan_results.json /tmp/eo/esrgan_table.md "$out/" 2>/dev/null
tar czf "$out/esrgan_logs.tgz" -C /tmp eo
exit $rc
