#!/usr/bin/env bash
# Device side of an A/B of two bench binaries on one machine: A = bench_prev.xz (before), B = bench.xz (after), in the
# order A B A B, UNet components only; weights written once.
set -uo pipefail
dev=${1:?carried folder (bench.xz, bench_prev.xz, run_bench.py, site.tar.xz)}
mkdir -p /tmp/prevb && cp $dev/run_bench.py $dev/site.tar.xz /tmp/prevb/ && cp $dev/bench_prev.xz /tmp/prevb/bench.xz
final=$OUT
i=0
for side in A B A B; do
  i=$((i+1))
  d=$([ $side = A ] && echo /tmp/prevb || echo $dev)
  cv=$([ $side = A ] && echo c_unet || echo c_unet_prof)
  skip=$([ $i = 1 ] && echo "" || echo --skip-write)
  mkdir -p /tmp/ab/$i && OUT=/tmp/ab/$i bash worker/models/bench/run_kernels_bench.sh $d --component-variants $cv --skip-pipeline --iters 5 $skip > /dev/null 2>&1
  echo "run $i side $side rc=$?"
  cp /tmp/ab/$i/results.json $final/results_${i}_$side.json
  cp /tmp/o/trace_c_unet.json /tmp/ab/trace_$i.json 2>/dev/null && rm -f /tmp/o/trace_c_unet.json
  grep -h '"unet_b8_1024"\|"unet_cfg_1024"\|"unet_graph_b8_1024"\|"unet_graph_cfg_1024"' /tmp/ab/$i/run.log | grep -v "^|" | cut -c1-110
done
for t in /tmp/ab/trace_*.json; do python3 worker/models/bench/trace_breakdown.py $t; done > $final/breakdowns.json
python3 - <<'E'
import json, os, re
txt = open(os.environ['OUT'] + '/breakdowns.json').read()
dec = json.JSONDecoder(); i = 0
while True:
    t = txt[i:].lstrip()
    if not t: break
    o, n = dec.raw_decode(t); i = len(txt) - len(t) + n
    print(o['trace'], o['total_ms'], o['ms'])
    for k, v in o['top_kernels_ms'].items():
        if 'add' in k or 'Binary' in k: print('   ', v, k[:100])
E
