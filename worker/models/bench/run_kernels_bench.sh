#!/usr/bin/env bash
# Device side of the SDXL kernels campaign and the VAE tiling measurement (docs/performance.md,
# "SDXL kernels campaign and VAE tiling by memory (H200), 2026-12-01"). Run in the repository root
# on the GPU machine; the first argument is the carried folder, which holds
#   bench.xz     examples/bench.rs built here (release, stripped), xz-compressed;
#   site.tar.xz  diffusers 0.42.1 + importlib_metadata 10.2.0 as installed by pip, without the
#                pipelines other than stable_diffusion{,_xl} and without modular_pipelines;
#   run_bench.py this branch's driver (the device copies the main checkout).
# When the checkout leaves too little of the transfer limit (it did on 2026-12-01), a previous call on the same warm
# machine may have left the site already unpacked in /tmp/site and the first part of bench.xz in
# /tmp/kb/bpart.0 (the carried folder then holds bench.part1, the rest).
# The other arguments go to run_bench.py. Results land in $OUT.
set -uo pipefail
dev=${1:?carried folder}
shift
mkdir -p /tmp/site /tmp/kb
if [ -f "$dev/site.tar.xz" ]; then tar xJf "$dev/site.tar.xz" -C /tmp/site || exit 1; fi
[ -d /tmp/site/diffusers ] || { echo "no diffusers in /tmp/site"; exit 1; }
if [ -f "$dev/bench.xz" ]; then
    xz -dc "$dev/bench.xz" > /tmp/kb/bench || exit 1
else
    cat /tmp/kb/bpart.0 "$dev/bench.part1" | xz -dc > /tmp/kb/bench || exit 1
fi
chmod +x /tmp/kb/bench
cp "$dev/run_bench.py" worker/models/bench/run_bench.py
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 worker/models/bench/run_bench.py --bin /tmp/kb/bench --work /tmp/w --out /tmp/o "$@" 2>&1 | tee "$OUT/run.log"
cp /tmp/o/results.json /tmp/o/table.md "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C /tmp/o .
