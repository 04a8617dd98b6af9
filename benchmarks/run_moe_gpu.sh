#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/*-moe-*.json, step by step (each fits one 10-minute call):
#   bash benchmarks/run_moe_gpu.sh OUT_DIR STEP...
# Steps: tests (FP8 and MoE kernels, torch's FP8 GEMMs), quantize (the FP8 quantization kernel's tiles), accuracy (tiny MoE models vs the CPU reference),
# profile, profile-ep (one MoE layer on 1 GPU; on $EP_GPUS (default 2), every ep_schedule without and with an SM carveout of
# $COMM_SMS (default 16), the all-to-all's CTAs capped to it), v2lite (the whole DeepSeek-V2-Lite), v3 (a DeepSeek-V3 slice on $LAYOUTS, by
# default FP8 on 1, 2 and 4 GPUs and bf16 on 1; a layout may name its EP schedule and carveout, and :deep_gemm its experts' GEMMs
# (DeepGEMM on the path: run_vllm_gpu.sh's install links vLLM's build into /tmp/gpu-site), bench_moe.py --help; $PROMPTS,
# by default 1x8192 1x32768 1x131072 16x4096/gpu: an 80 GB H100 runs out of memory at 1x131072 on one GPU and with TP 2),
# layouts (the V3 slice's TP x PCP 2x2 and 1x4 outputs against 1x1, in bf16 and FP8, with each format's chunking noise floor,
# on the GPUs at hand: ranks share them, bench_moe.py --share-gpus), load (the V3 slice written as an FP8 checkpoint in $CKPT
# (default /tmp/v3-5layers; 27 GiB), loaded by 1 and by 4 ranks: load time, bytes read, peak host memory, outputs against the
# drawn weights). Assumes flash-attn 4 on PYTHONPATH (deploy/offline_bundle.py).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the repository root: benchmarks import the project
out=$1; shift
mkdir -p "$out"
slice=(--model deepseek-v3 --num-layers 5)  # 3 dense + 2 MoE layers, 256 experts, top-8
for step in "$@"; do
  case $step in
    tests) python3 -m pytest -q -m gpu tests/unit/test_fp8.py tests/unit/test_moe.py 2>&1 | tee "$out/moe-gpu-tests.log" ;;
    quantize) python3 benchmarks/bench_quantize.py --out "$out/fp8-quantize.json" ;;
    accuracy) python3 benchmarks/accuracy_moe.py --out "$out/moe-accuracy.json" ;;
    profile) python3 benchmarks/profile_moe.py --weights fp8 --out "$out/moe-profile-fp8.json" 2>&1 | tail -45 ;;
    profile-ep) for schedule in all-to-all local-first two-micro-batches; do for sms in 0 ${COMM_SMS:-16}; do
                  echo "== $schedule, carveout $sms"
                  python3 benchmarks/profile_moe.py --weights fp8 --gpus ${EP_GPUS:-2} --schedule $schedule \
                    --comm-sms $sms --out "$out/moe-profile-fp8-ep${EP_GPUS:-2}-$schedule-sms$sms.json" 2>&1 | grep "routed experts"
                done; done ;;
    v2lite) python3 benchmarks/bench_moe.py --model deepseek-v2-lite --layouts bf16:1 \
              --prompts 1x4096 1x32768 --repeats 3 --out "$out/v2-lite.json" ;;
    v3) python3 benchmarks/bench_moe.py "${slice[@]}" --layouts ${LAYOUTS:-fp8:1 fp8:2 fp8:4 bf16:1} \
          --prompts ${PROMPTS:-1x8192 1x32768 1x131072 16x4096/gpu} --repeats 2 --out "$out/v3-slice.json" ;;
    layouts) for format in bf16 fp8; do
               python3 benchmarks/bench_moe.py "${slice[@]}" --share-gpus --prompts 1x8192 --repeats 1 --moe-tokens 0 \
                 --layouts $format:1 $format:1:chunk4096 $format:4:tp2 $format:4:tp2:chunk4096 $format:4 \
                 --out "$out/v3-layouts-on-one-gpu-$format.json"
             done ;;
    load) ckpt=${CKPT:-/tmp/v3-5layers}
          [ -f "$ckpt/model.safetensors.index.json" ] || python3 benchmarks/write_checkpoint.py "${slice[@]}" --out "$ckpt"
          python3 benchmarks/bench_moe.py "${slice[@]}" --checkpoint "$ckpt" --share-gpus --prompts 1x8192 --repeats 1 \
            --moe-tokens 0 --layouts fp8:1 fp8:1:ckpt fp8:4:tp2:ckpt bf16:1 bf16:1:ckpt --out "$out/v3-checkpoint-load.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
