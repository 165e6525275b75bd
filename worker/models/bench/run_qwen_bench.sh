#!/usr/bin/env bash
# The Qwen-Image-Edit-2509 benchmark as one device command (repository root of the device's copy).
#
# Here, before the call (repository root; .whl and .bench are ignored through .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl diffusers==0.42.1 importlib_metadata
#   cargo build --release -p vnfarm-models --example qwen_bench
#   mkdir -p .bench && cp $CARGO_TARGET_DIR/release/examples/qwen_bench .bench/qwen_bench
# Device call: `run` with carry [".whl", ".bench"], timeout_s 600, command
#   worker/models/bench/run_qwen_bench.sh
# Extra arguments go to run_qwen_bench.py (e.g. `--modes resident`, `--skip-components`;
# `--profile --modes upcast`: the transformer step's kernel profile, ours and diffusers', profile_qwen.py).
#
# $OUT receives 4 files: qwen_results.json, qwen_table.md, qwen_run.log (everything every process
# printed) and qwen_logs.tgz (the per-process logs); with --profile qwen_profile.md and the gzipped
# traces (trace_*.json.gz) instead of qwen_table.md. Weights and images stay in /tmp/qw (64 GiB disk:
# the weights take about 29 GB).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/qwen_out}
mkdir -p "$out" /tmp/qo
python3 worker/models/bench/run_qwen_bench.py --bin .bench/qwen_bench --work /tmp/qw --out /tmp/qo "$@" 2>&1 \
  | tee "$out/qwen_run.log"
rc=$?
cp /tmp/qo/qwen_results.json /tmp/qo/qwen_table.md /tmp/qo/qwen_profile.md /tmp/qo/trace_*.json.gz "$out/" 2>/dev/null
tar czf "$out/qwen_logs.tgz" --exclude 'trace_*' -C /tmp qo
exit $rc
