set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
L=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
[ -f /tmp/w/unet/diffusion_pytorch_model.safetensors ] || { t0=$(date +%s); python3 worker/models/bench/run_bench.py --diffusers-side write --work /tmp/w > $OUT/write.log 2>&1 || { tail -20 $OUT/write.log; exit 1; }; echo "weights written in $(( $(date +%s) - t0 )) s"; }; du -sh /tmp/w
for tag in default plain; do
  if [ $tag = plain ]; then A="PYTORCH_CUDA_ALLOC_CONF="; else A="NOTHING=1"; fi
  (while sleep 0.1; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done) > $OUT/mem_$tag.txt & S=$!
  env $A LD_LIBRARY_PATH=$L RUST_BACKTRACE=0 VNFARM_WORKER_ID=gpu-check VNFARM_LISTEN=127.0.0.1:0 VNFARM_AMQP__URL=amqp://127.0.0.1:1/%2f VNFARM_STORAGE__BACKEND=local VNFARM_STORAGE__ROOT=/tmp/out VNFARM_ENGINE__SDXL__CHECKPOINT=/tmp/w "VNFARM_ENGINE__SDXL__WARM_UP=[[1024,1024],[1280,720],[1920,1080]]" .dev/vnfarm-worker > $OUT/worker_$tag.log 2>&1 & W=$!
  for i in $(seq 1 600); do grep -q "engine loaded\|Error" $OUT/worker_$tag.log && break; kill -0 $W 2>/dev/null || break; sleep 0.2; done
  sleep 2; kill $W; wait $W; kill $S
  echo "== $tag: peak $(sort -n $OUT/mem_$tag.txt | tail -1) MiB (idle $(head -1 $OUT/mem_$tag.txt))"
  grep -E "SDXL|engine loaded|Error|error|amqp" $OUT/worker_$tag.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-260 | head -12
done
