#!/usr/bin/env bash
# The whole worker on the GPU machine against the studio's Python session (issue 26), one run:
#   1. random weights of the real configurations: SDXL base as a diffusers folder (run_bench.py),
#      Qwen-Image-Edit-2509 as its ComfyUI files (run_qwen_bench.py), a Lightning-shaped LoRA and
#      Real-ESRGAN x4plus (run_session_bench.py write);
#   2. the time to read the model files once (`cat > /dev/null`, after dropping the page cache where
#      the machine lets us, then again from the page cache);
#   3. with CHECK=1, `vnfarm-worker check` on the same models and configuration: the settings file
#      it writes is the bench workers' (`engine.settings_file`), so every engine runs what the box
#      check chose, with no hand-set flags; without, the CUDA presets;
#   4. `vnfarm-worker bench` with `prefetch = 1` (one message at a time), then `prefetch = 2` (the
#      next message's inputs fetched and the last one's outputs stored while the engine runs), each a
#      fresh process (cold start from the page cache), on the studio workload, the second also on the mix;
#   5. the Python session (run_session_bench.py run) on the same work files;
#   NVML's memory.used sampled every 100 ms beside each process (nvidia-smi).
# Outputs: $OUT/results.tar.xz (reports, logs, samples; the images are left out).
#
#   bash run_worker_bench.sh PAYLOAD MODE...  # MODE: tiny (fixtures on the GPU, a smoke test) | full;
#                                             # each runs whatever failed before
#   PIPELINES=6 ROUNDS=3 bash ...             # the workload sizes (full)
#   CHECK=1 PF1=0 bash ...                    # the box check's settings; no prefetch-1 process
#   CHECK_ARGS="--repeats 3" ...              # more arguments of the check
#   CHECK=reuse ...                           # the settings file an earlier call's check wrote
#   RUNS="pf2 base pf2 base" BASE_ENV="VAR=1" # the prefetch-2 process once per word, in order (default
#                                             # "pf2"); the other words run with BASE_ENV set, and
#                                             # PAYLOAD/vnfarm-worker-base.xz where there is one
#   PYTHON=0 ...                              # no Python session
set -uo pipefail
P=$1; shift
B=worker/models/bench
ALL=/tmp/wbr
cp "$P"/run_session_bench.py "$B"/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$P"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
xz -dc "$P"/vnfarm-worker.xz > /tmp/vnfarm-worker && chmod +x /tmp/vnfarm-worker
L=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
W="env LD_LIBRARY_PATH=$L /tmp/vnfarm-worker"
WB=$W
if [ -f "$P"/vnfarm-worker-base.xz ]; then
  xz -dc "$P"/vnfarm-worker-base.xz > /tmp/vnfarm-worker-base && chmod +x /tmp/vnfarm-worker-base
  WB="env LD_LIBRARY_PATH=$L /tmp/vnfarm-worker-base"
fi
mkdir -p $ALL
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$ALL/gpu.txt"
finish() {  # the reports of out_*/, not the outputs
  for d in "$ALL"/*/out_*/; do [ -d "$d" ] && for f in "$d"bench-report-*.json; do [ -f "$f" ] && cp "$f" "${d%/}-${f##*/}"; done; done
  tar cJf "$OUT/results.tar.xz" --exclude='./*/out_*/*' -C "$ALL" .
}
trap finish EXIT

sample() { nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$R/mem_$1.csv" & echo $!; }

one_mode() {
MODE=$1
local NP=${PIPELINES:-6} NR=${ROUNDS:-3}
R=$ALL/$MODE; M=/tmp/wbm/$MODE
mkdir -p "$R" "$M"
t0=$(date +%s.%N)
if [ "$MODE" = tiny ]; then
  FX=worker/models/fixtures
  python3 $B/run_bench.py --diffusers-side write --work $M/sdxl --tiny > "$R/write.log" 2>&1
  python3 $B/run_qwen_bench.py --side write --tiny --work $M/qwen >> "$R/write.log" 2>&1
  python3 $B/run_session_bench.py write --models $M --tiny >> "$R/write.log" 2>&1 || { tail -20 "$R/write.log"; return 1; }
  SIDE=64; STEPS=3; ESTEPS=2; QCFG="config_dir = \"$FX/qwen/qwen_tiny\"
condition_image_area = 3136
vae_image_area = 4096"
  ESR=$M/esrgan.pth; TINY=--tiny; NP=2; NR=1; WARM=256
else
  [ -e $M/sdxl/unet ] || python3 $B/run_bench.py --diffusers-side write --work $M/sdxl > "$R/write.log" 2>&1
  [ -e $M/qwen/vae_bf16.safetensors ] || python3 $B/run_qwen_bench.py --side write --work $M/qwen >> "$R/write.log" 2>&1
  [ -e $M/qwen_lightning_random.safetensors ] || python3 $B/run_session_bench.py write --models $M >> "$R/write.log" 2>&1 \
    || { tail -20 "$R/write.log"; return 1; }
  SIDE=1024; STEPS=20; ESTEPS=4; QCFG=""; ESR=$M/esrgan_x4plus_random.safetensors; TINY=; WARM=1024
fi
echo "models written in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee "$R/times.txt"
du -sb $M/sdxl $M/qwen/*.safetensors $M/*.safetensors $M/*.pth 2>/dev/null | tee -a "$R/times.txt"

FILES=$(find $M/sdxl -name '*.safetensors'; ls $M/qwen/*.safetensors $M/qwen_lightning_random.safetensors $ESR)
readonce() { local t=$(date +%s.%N); cat $FILES > /dev/null; python3 -c "import time; print(round(time.time() - $t, 3))"; }
dropped=no
if sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then dropped=yes; fi
echo "read once, page cache dropped=$dropped: $(readonce) s" | tee -a "$R/times.txt"
echo "read once, from the page cache: $(readonce) s" | tee -a "$R/times.txt"
echo "read once, from the page cache: $(readonce) s" | tee -a "$R/times.txt"

$W bench workload --kind studio --count $NP --side $SIDE --steps $STEPS --edit-steps $ESTEPS --out $R/studio.jsonl
$W bench workload --kind mix --count $NR --side $SIDE --steps $STEPS --edit-steps $ESTEPS --out $R/mix.jsonl

config() {  # prefetch [settings-file]: with a settings file, no per-engine settings keys
  local dev=cuda dt=bf16 vdt=bf16 edt=fp16
  local preset='settings = "cuda"' engine=""
  if [ -n "${2:-}" ]; then preset=""; engine="settings_file = \"$2\""; fi
  cat <<TOML
worker_id = "bench"
prefetch = $1
hash_cache_dir = "$M/hashes"
[model_cache]
dir = "$M/model-cache"
[engine]
$engine
[engine.sdxl]
checkpoint = "$M/sdxl"
device = "$dev"
dtype = "$dt"
vae_dtype = "$vdt"
warm_up = [[$WARM, $WARM]]
$preset
[engine.qwen_edit]
transformer = "$M/qwen/transformer_fp8_e4m3fn.safetensors"
text_encoder = "$M/qwen/text_encoder_fp8_scaled.safetensors"
vae = "$M/qwen/vae_bf16.safetensors"
loras = [{ path = "$M/qwen_lightning_random.safetensors", strength = 1.0 }]
device = "$dev"
dtype = "$dt"
vae_dtype = "$vdt"
warm_up = [[$WARM, $WARM]]
$preset
$QCFG
[engine.esrgan]
model = "$ESR"
device = "$dev"
dtype = "$edt"
$preset
TOML
}

SETTINGS=
if [ "${CHECK:-0}" = 1 ]; then
  config 1 none | grep -v '^settings_file\|^settings = ' > "$R/check.toml"
  local c0=$(date +%s.%N)
  local q=; [ "$MODE" = tiny ] && q=--quick
  timeout 300 $W check --config "$R/check.toml" --out "$R/check" $q ${CHECK_ARGS:-} > "$R/check.txt" 2> "$R/check.log"
  echo "check rc=$? in $(python3 -c "import time; print(round(time.time() - $c0, 1))") s" | tee -a "$R/times.txt"
  grep -i 'chosen\|FAIL\|settings file' "$R/check.txt" | cut -c1-400
  rm -rf "$R/check/work"
  [ -f "$R/check/settings.json" ] && SETTINGS=$R/check/settings.json
  [ -n "$SETTINGS" ] || echo "no settings file: the bench runs the CUDA presets"
elif [ "${CHECK:-0}" = reuse ] && [ -f "$R/check/settings.json" ]; then
  SETTINGS=$R/check/settings.json; echo "the settings file of an earlier check: $SETTINGS"
fi

bench() {  # name prefetch work-files... (BENCH_ENV: variables for this process)
  local name=$1 pf=$2; shift 2
  config "$pf" "$SETTINGS" > "$R/worker_$name.toml"
  local s; s=$(sample "$name")
  local start=$(date +%s.%N)
  local args=(); for w in "$@"; do args+=(--work "$w"); done
  timeout 240 env ${BENCH_ENV:-} ${BENCH_BIN:-$W} bench --config "$R/worker_$name.toml" "${args[@]}" --out $R/out_$name > "$R/bench_$name.txt" 2> "$R/bench_$name.log"
  local rc=$?
  echo "bench $name rc=$rc process start $start" | tee -a "$R/times.txt"
  kill $s; cat "$R/bench_$name.txt"; [ $rc = 0 ] || tail -5 "$R/bench_$name.log"
  find $R/out_$name -name '*.png' -delete 2>/dev/null
  return $rc
}

local failed=0
[ "${PF1:-1}" = 1 ] && { bench pf1 1 $R/studio.jsonl || failed=1; }
local n=0
for run in ${RUNS:-pf2}; do
  n=$((n + 1)); local name=$run; [ $n -gt 1 ] && name=${run}_$n
  if [ "$run" = pf2 ]; then
    bench "$name" 2 $R/studio.jsonl $R/mix.jsonl || failed=1
  else
    BENCH_ENV="${BASE_ENV:-}" BENCH_BIN="$WB" bench "$name" 2 $R/studio.jsonl $R/mix.jsonl || failed=1
  fi
done

[ "${PYTHON:-1}" = 1 ] || { echo "$MODE total $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a "$R/times.txt"; return $failed; }
s=$(sample python)
timeout 300 python3 $B/run_session_bench.py run --models $M $TINY --device cuda --work $R/studio.jsonl --work $R/mix.jsonl \
  --out $R/python > "$R/python.log" 2>&1
local rc=$?
echo "python rc=$rc" | tee -a "$R/times.txt"
kill $s
grep '"name": "summary"\|"name": "load"\|lora' "$R/python.log" | cut -c1-1500; [ $rc = 0 ] || { tail -8 "$R/python.log"; failed=1; }
find $R/python -name '*.png' -delete
echo "$MODE total $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a "$R/times.txt"
return $failed
}

for mode in "$@"; do
  one_mode "$mode" || echo "the $mode run had failures"
done
