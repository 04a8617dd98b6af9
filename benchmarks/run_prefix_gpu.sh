#!/usr/bin/env bash
# The GPU run behind benchmarks/results/*-prefix-cache-*.json (one 10-minute call):
#   bash benchmarks/run_prefix_gpu.sh OUT_DIR STEP...
# Steps: install (the offline bundle deploy/offline_bundle.py build --sets ray,serve,flash-attn-4, staged in
# /tmp/stage/gpu-NN, into /tmp/gpu-site), prefix (benchmarks/bench_prefix_cache.py), isolated (its isolated
# turns alone, in a fresh process), probe (benchmarks/probes/probe_cached_turn.py: where a cached turn's time goes);
# all on the DeepSeek-V3 5-layer FP8 slice in $CKPT, default /tmp/v3-5layers, written first when missing.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/gpu-site:$PWD
out=$1; shift
mkdir -p "$out"
ckpt=${CKPT:-/tmp/v3-5layers}
checkpoint() {
  [ -f "$ckpt/model.safetensors.index.json" ] || python3 benchmarks/write_checkpoint.py --model deepseek-v3 --num-layers 5 --out "$ckpt" | tail -1
}
for step in "$@"; do
  case $step in
    install) mkdir -p /tmp/bundle-gpu && cp /tmp/stage/gpu-*/* /tmp/bundle-gpu/
             python3 deploy/offline_bundle.py install --bundle /tmp/bundle-gpu --target /tmp/gpu-site | tail -1
             python3 -c "import ray, flash_attn.cute; print('gpu site ok', ray.__version__)" ;;
    prefix) checkpoint && python3 benchmarks/bench_prefix_cache.py --checkpoint "$ckpt" --out "$out/prefix-cache.json" ;;
    isolated) checkpoint && python3 benchmarks/bench_prefix_cache.py --checkpoint "$ckpt" --only-isolated --out "$out/isolated-turns.json" ;;
    probe) checkpoint && python3 benchmarks/probes/probe_cached_turn.py --checkpoint "$ckpt" > "$out/probe-cached-turn.log" 2>&1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
