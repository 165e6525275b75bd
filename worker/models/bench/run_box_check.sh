#!/usr/bin/env bash
# The box check on the GPU machine (step 9): random-weight models of the real configurations (SDXL
# base as one ldm single file, Real-ESRGAN x4plus; make_random_models.py, torch and safetensors
# only), a worker configuration for them, then `vnfarm-worker check --compare`: the report, the
# settings it chose, and whole 20-step 1024² generates under the portable preset, the CUDA preset
# (the best hand-set flags) and the measured settings, in one run. Outputs under $OUT/check.
# With wheels in .whl (diffusers 0.42.1, importlib_metadata), Qwen-Image-Edit-2509 too: its ComfyUI
# files of random weights (fp8 transformer, scaled-fp8 text encoder) from run_qwen_bench.py's writer.
#
#   bash worker/models/bench/run_box_check.sh BINARY [extra check arguments]
set -euo pipefail
BIN=$1; shift
W=/tmp/box
mkdir -p "$W"
t0=$(date +%s)
python3 worker/models/bench/make_random_models.py "$W"
QWEN=
if ls .whl/diffusers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site python3 worker/models/bench/run_qwen_bench.py --side write --work /tmp/qw > "$OUT/qwen_write.log" 2>&1 \
    || { tail -20 "$OUT/qwen_write.log"; exit 1; }
  QWEN=1
fi
echo "models written in $(( $(date +%s) - t0 )) s"; du -sh "$W"/* /tmp/qw 2>/dev/null || true
cat > "$W/worker.toml" <<TOML
[engine.sdxl]
checkpoint = "$W/sdxl_random.safetensors"
device = "cuda"
dtype = "bf16"
vae_dtype = "bf16"
warm_up = [[1024, 1024]]

[engine.esrgan]
model = "$W/esrgan_x4plus_random.safetensors"
device = "cuda"
dtype = "fp16"
TOML
if [ -n "$QWEN" ]; then cat >> "$W/worker.toml" <<TOML

[engine.qwen_edit]
transformer = "/tmp/qw/transformer_fp8_e4m3fn.safetensors"
text_encoder = "/tmp/qw/text_encoder_fp8_scaled.safetensors"
vae = "/tmp/qw/vae_bf16.safetensors"
device = "cuda"
warm_up = [[1024, 1024]]
TOML
fi
# The binary's RUNPATH names the build machine's libtorch; this machine's torch 2.11 is used.
L=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
t0=$(date +%s)
LD_LIBRARY_PATH=$L "$BIN" check --config "$W/worker.toml" --out "$OUT/check" --compare \
  --fixtures worker/models/fixtures "$@"
echo "check took $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
tar czf "$OUT/work.tgz" -C "$OUT/check" work && rm -rf "$OUT/check/work"
