#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/*-vllm-decode-*.json, step by step (each fits one 10-minute call):
#   bash benchmarks/run_vllm_gpu.sh OUT_DIR STEP...
# Steps: install (the two offline bundles staged in /tmp/stage/{gpu,vllm}-NN: deploy/offline_bundle.py build
# --sets ray,serve,flash-attn-4 and --sets vllm, into /tmp/gpu-site and /tmp/vllm-site, NIXL shared by both; FlashInfer
# modules built ahead by deploy/flashinfer_aot.py, staged as /tmp/stage/fi-aot/NAME/NAME.so or as its pack's parts /tmp/stage/fi-aot-NN/,
# into vLLM's site's FlashInfer),
# probe-moe (one bf16 MoE layer through vLLM's kernels and ours: benchmarks/probes/probe_vllm_moe.py),
# parity-bf16, parity-fp8 (32 prompts of 1-8K tokens through the tier's OpenAI endpoint against vLLM alone,
# DeepSeek-width tiny MoE checkpoints), speed (the DeepSeek-V3 5-layer FP8 slice in $CKPT, default
# /tmp/v3-5layers, written first when missing: prompts of $LENGTHS, TTFT and the second token both ways, the
# steps between them, both caches scattered first by $SCATTER requests), speed-kv (the same on DeepSeek-V3's 61
# layers at its MLA widths, everything else small: write_checkpoint.py --kv-shaped, in /tmp/v3-kv-shaped),
# kv-load (benchmarks/bench_kv_load.py: the mapped transport against NIXL READs, no vLLM), truth (benchmarks/
# bench_vllm_truth.py: vLLM alone and the tier + vLLM against float32, tokens and KV rows; CHECKPOINTS picks the
# seeds, default all three; TRUTH_PROMPTS prompts per checkpoint, default 24 (the first 24 of a larger draw are those 24); FP8=1: the checkpoints in FP8, both engines on their FP8 GEMMs, the pool's on FP8_GEMM, default auto;
# WIDE=1: checkpoints whose every linear the pool runs in FP8 too), probe-cg (benchmarks/probes/probe_compiled_graph.py on the slice: the pool's per-batch
# call as Ray tasks against a Ray Compiled Graph), probe-graphs (benchmarks/probes/probe_cuda_graphs.py on the slice: one prompt's prefill in the worker, eager
# against replayed from its CUDA graphs), probe-attn (benchmarks/probes/probe_prefill_attention.py: MLA prefill attention on FA4, vLLM's FA3
# and vLLM's FA3 on FP8 inputs, speed and distance from float32), probe-ingress (benchmarks/probes/probe_ingress.py on the slice: the
# tier's fixed cost through Serve's proxy and at the replica's own port; INGRESS=replica gives speed, serving, pd and soak that way too;
# DECODE_ENDPOINT=completions has speed and speed-kv ask vLLM's /v1/completions after the tier's first token, not its generate endpoint; DECODE_FORWARD=after_first_token has them send vLLM the request after that token, not as the prefill is submitted), serving and soak (benchmarks/bench_serving.py: vLLM's serving
# benchmark against the tier and vLLM alone at RATES on the slice, then vLLM alone on the whole GPU (STACKS: some of them; ADD=1
# keeps the other stacks of OUT_DIR/serving.json, a sweep finished in a second lease); 10 minutes of
# the tier at SOAK_RATE, memory sampled; both need an H200 and more than one 10-minute call: run them detached),
# resume (benchmarks/bench_resume.py: a 4K stream whose decode server is killed once it has generated 20 tokens, from the break to
# the next token; the pool and two servers on one H200). vLLM runs as it deploys
# (compiled, CUDA graphs for decode batches up to VLLM_GRAPH_BATCH: 8 for speed and speed-kv, one request at a time; 64 for
# serving and soak; vLLM's default of 512 spent minutes in nvcc compiling DeepGEMM kernels for the FP8 slice as it captured
# the graphs on 2026-11-26); VLLM_EAGER=1 gives it --enforce-eager; TP=2 / DP=2 give speed, speed-kv and truth (TP)
# a vLLM decode instance of two GPUs (the two-GPU kinds); VLLM_GPUS=1,0 puts a TP1 vLLM on the second GPU (speed, speed-kv:
# the KV read from the pool's GPU over NVLink); multi-gpu runs the suite's multi_gpu tests with the pool's site; pd (two GPUs:
# bench_serving.py --pd, the pool on GPU 0 and vLLM on GPU 1 against vLLM DP 2 on both, or with PD_BASELINE=servers a vLLM
# server per GPU behind a round robin, PD_BASELINE=none against nothing; PREFILL_GPUS=2 the pool on GPUs 0-1 and vLLM on GPU 2; prompts of 2-32K, answers of 30-482 tokens; WARMUP
# (pd and serving) prompts of each input sent to each stack first one at a time, then as many at once, not kept, default 2: on
# a node with empty kernel caches use 64 (2 left both stacks compiling inside the points on 2026-11-28, and 64 sent only at once
# still the tier at its low rates); vLLM's servers there and in soak run vLLM's own DeepGEMM warm-up at start
# (VLLM_DG_WARMUP=skip|full to change it), POOL_FP8_GEMM=torch|deep_gemm sets the pool's FP8 GEMMs there (default auto), VLLM_START_S how long vLLM may
# take to start (default 600 s); chaos (two
# GPUs: benchmarks/chaos.py, 2 replicas x TP 2, spare workers on as they are with GPUs: the pool's faults and fault-to-serving).
# prefill (the slice's prefill through the pool, and through vLLM with each of its MoE backends MOE_BACKENDS (flashinfer_cutlass
# too once FlashInfer's SM90 CUTLASS MoE is built: by the flashinfer-moe step, 182 sources, 27 of them in 9 minutes beside other
# steps on 2026-11-29 (alone, about half an hour), or ahead by deploy/flashinfer_aot.py and placed by install), on CASES, with
# bench_moe.py's workers' own times and MoE layer, its KV cache sized by the prompts (--share-gpus), as measured on 2026-11-28:
# benchmarks/bench_vllm_prefill.py; FP8_GEMMS: a pool side per PoolConfig.fp8_gemm, default auto; WORKER_GEMMS: bench_moe.py's, default the same but auto; ADD=1 keeps the sides already in OUT_DIR); gemms (benchmarks/bench_grouped_gemm.py with DeepGEMM as vLLM's wheel carries it, linked by install:
# the experts' grouped GEMMs and the dense FP8 linears by torch's kernels and by DeepGEMM's, on V3's shapes, at GEMM_TOKENS tokens, default 16384: at 65536 the script ran out of memory on an H200);
# flashinfer-fp8-gemm (FlashInfer's SM90 FP8 block-scale GEMM, which vLLM 0.26 runs its FP8 linears with on Hopper, built into
# its JIT cache, a build of minutes that vLLM's first FP8 step runs otherwise: run it detached beside other steps, finished before
# truth with FP8=1, prefill and speed; on 2026-11-28 truth died when that build's nvcc processes were stopped inside vLLM; both
# flashinfer steps only load a module that install placed); first-batches (benchmarks/probes/probe_first_batches.py on the slice with fp8_gemm deep_gemm: a fresh worker's start and batches
# and the kernels they compile; RANDOM_BATCHES batches of random sizes after the fixed ones). VLLM_ARGS: more arguments for vLLM's server (speed, speed-kv, pd), e.g. "--disable-custom-all-reduce". speed needs an H200: the slice's 26.5 GiB of
# weights twice, and vLLM's 32K prefill, do not fit an H100 (vLLM held 57 GiB there at VLLM_MEMORY=0.45).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/gpu-site:$PWD VLLM_PYTHONPATH=/tmp/vllm-site
out=$1; shift
mkdir -p "$out"
# PROFILE=1 (speed, speed-kv): py-spy (its wheel carried in .bundle/tools) records the vLLM server's API process and engine
# core for the whole step, into $out/pyspy-api.txt and $out/pyspy-core.txt (py-spy's raw collapsed stacks)
profile_vllm() {
  [ -n "${PROFILE:-}" ] || return 0
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools .bundle/tools/py_spy-*.whl || return 0
  ( for i in $(seq 1 900); do
      api=$(pgrep -f "[v]llm.entrypoints.openai.api_server" | head -1); core=$(pgrep -f "[V]LLM::EngineCore" | head -1)
      [ -n "$api" ] && [ -n "$core" ] && break; sleep 1
    done
    for p in "api $api" "core $core"; do set -- $p
      /tmp/tools/bin/py-spy record -p $2 -r 200 -d 3600 -f raw -o "$out/pyspy-$1.txt" --nonblocking > "$out/pyspy-$1.log" 2>&1 &
    done; wait ) &
}
# the DeepSeek-V3 5-layer FP8 slice the steps below run on ($CKPT), written first where it is missing
slice_ckpt() {
  ckpt=${CKPT:-/tmp/v3-5layers}
  [ -f "$ckpt/model.safetensors.index.json" ] || python3 benchmarks/write_checkpoint.py --model deepseek-v3 --num-layers 5 --out "$ckpt" | tail -1
}
# what the serving, pd and soak steps take from the environment (see above), as bench_serving.py options
serving_opts="${VLLM_DG_WARMUP:+--vllm-deep-gemm-warmup $VLLM_DG_WARMUP} ${POOL_FP8_GEMM:+--pool-fp8-gemm $POOL_FP8_GEMM} ${VLLM_START_S:+--start-timeout $VLLM_START_S}"
for step in "$@"; do
  case $step in
    install) for set in gpu vllm; do
               mkdir -p /tmp/bundle-$set && cp /tmp/stage/$set-*/* /tmp/bundle-$set/
               python3 deploy/offline_bundle.py install --bundle /tmp/bundle-$set --target /tmp/$set-site | tail -1
             done
             if [ -d /tmp/stage/fi-aot-00 ]; then  # modules too large for one copy: flashinfer_aot.py pack's parts, one per copy
               python3 deploy/flashinfer_aot.py unpack --parts-dir /tmp/stage --out /tmp/stage/fi-aot | tail -1; fi
             if [ -d /tmp/stage/fi-aot ]; then  # FlashInfer modules built ahead (deploy/flashinfer_aot.py): loaded, not compiled
               python3 deploy/flashinfer_aot.py install --modules-dir /tmp/stage/fi-aot --site /tmp/vllm-site | tail -2; fi
             ln -sf /tmp/vllm-site/nixl* /tmp/gpu-site/  # the pool's holders serve NIXL with the same wheel
             ln -sfn /tmp/vllm-site/vllm/third_party/deep_gemm /tmp/gpu-site/deep_gemm  # DeepGEMM for fp8_gemm deep_gemm: vLLM's build of it
             python3 -m compileall -q -j 16 /tmp/vllm-site /tmp/gpu-site > /dev/null  # else every process of a first start compiles vLLM
             python3 -c "import ray, flash_attn.cute, nixl_cu13; print('gpu site ok', ray.__version__)"
             PYTHONPATH=/tmp/vllm-site:$PWD python3 -c "import vllm, kv.vllm_connector; print('vllm site ok', vllm.__version__)" ;;
    probe-moe) PYTHONPATH=/tmp/vllm-site:$PWD python3 benchmarks/probes/probe_vllm_moe.py --out "$out/vllm-moe-rounding.json" ;;
    parity-bf16|parity-fp8) python3 benchmarks/bench_vllm_decode.py parity --weights ${step#parity-} --out "$out/vllm-decode-parity-${step#parity-}.json" ;;
    speed) slice_ckpt; profile_vllm
           python3 benchmarks/bench_vllm_decode.py speed --checkpoint "$ckpt" --lengths ${LENGTHS:-32768x16 8192x16 4096x32 2048x32 512x32} \
             --scatter ${SCATTER:-200} --kv-cache-tokens 131072 --vllm-kv-cache-gib 2 --vllm-memory ${VLLM_MEMORY:-0.4} ${VLLM_EAGER:+--vllm-eager} --vllm-max-graph-batch ${VLLM_GRAPH_BATCH:-8} --ingress ${INGRESS:-proxy} --decode-endpoint ${DECODE_ENDPOINT:-generate} --decode-forward ${DECODE_FORWARD:-early} --vllm-tp ${TP:-1} --vllm-dp ${DP:-1} ${VLLM_GPUS:+--vllm-gpus $VLLM_GPUS} --vllm-args="${VLLM_ARGS:-}" --out "$out/vllm-decode-speed.json" ;;
    speed-kv) ckpt=/tmp/v3-kv-shaped; profile_vllm
           [ -f "$ckpt/model.safetensors.index.json" ] || python3 benchmarks/write_checkpoint.py --model deepseek-v3 --kv-shaped --out "$ckpt" | tail -1
           python3 benchmarks/bench_vllm_decode.py speed --checkpoint "$ckpt" --lengths ${LENGTHS_KV:-32768x8 4096x8} \
             --scatter ${SCATTER:-200} --kv-cache-tokens 131072 --vllm-kv-cache-gib 8 --vllm-memory ${VLLM_MEMORY:-0.4} ${VLLM_EAGER:+--vllm-eager} --vllm-max-graph-batch ${VLLM_GRAPH_BATCH:-8} --ingress ${INGRESS:-proxy} --decode-endpoint ${DECODE_ENDPOINT:-generate} --decode-forward ${DECODE_FORWARD:-early} --vllm-tp ${TP:-1} --vllm-dp ${DP:-1} ${VLLM_GPUS:+--vllm-gpus $VLLM_GPUS} --vllm-args="${VLLM_ARGS:-}" --out "$out/vllm-decode-speed-kv-shaped.json" ;;
    truth) python3 benchmarks/bench_vllm_truth.py --checkpoints ${CHECKPOINTS:-1 2:one-scale 3:one-scale} --vllm-tp ${TP:-1} \
             --max-len ${TRUTH_MAX_LEN:-4096} ${TRUTH_PROMPTS:+--prompts $TRUTH_PROMPTS} ${FP8:+--fp8 --fp8-gemm ${FP8_GEMM:-auto}} ${WIDE:+--wide} --out "$out/vllm-decode-truth${FP8:+-fp8-${FP8_GEMM:-auto}}${WIDE:+-wide}.json" ;;
    probe-attn) PYTHONPATH=/tmp/gpu-site:/tmp/vllm-site:$PWD python3 benchmarks/probes/probe_prefill_attention.py --out "$out/probe-prefill-attention.json" ;;
    probe-graphs) slice_ckpt; python3 benchmarks/probes/probe_cuda_graphs.py --checkpoint "$ckpt" --tokens ${PROBE_TOKENS:-16 512 1024 2048 4096} \
                   --out "$out/probe-cuda-graphs.json" ;;
    probe-cg) slice_ckpt; python3 benchmarks/probes/probe_compiled_graph.py --device cuda --tp 1 --checkpoint "$ckpt" --tokens 16 512 4096 \
               --out "$out/probe-compiled-graph.json" ;;
    serving) slice_ckpt; python3 benchmarks/bench_serving.py sweep --checkpoint "$ckpt" --inputs ${INPUTS:-4096 32768} --output-len 128 ${STACKS:+--stacks $STACKS} ${ADD:+--add} \
               --rates ${RATES:-0.5 1 2 4 inf} --point-s ${POINT_S:-30} --warmup ${WARMUP:-2} --vllm-max-graph-batch ${VLLM_GRAPH_BATCH:-64} --vllm-memory ${VLLM_MEMORY:-0.4} --kv-cache-tokens 131072 \
               --ingress ${INGRESS:-proxy} $serving_opts --out "$out/serving.json" ;;
    pd) slice_ckpt; python3 benchmarks/bench_serving.py sweep --pd --pd-baseline ${PD_BASELINE:-dp} --pd-prefill-gpus ${PREFILL_GPUS:-1} --checkpoint "$ckpt" --inputs ${INPUTS:-17408} --input-range-ratio ${RANGE:-0.88} \
          --output-len 256 --rates ${RATES:-0.5 1 2 4 8 inf} --point-s ${POINT_S:-30} --warmup ${WARMUP:-2} --vllm-max-graph-batch ${VLLM_GRAPH_BATCH:-64} ${VLLM_EAGER:+--vllm-eager} \
          --kv-cache-tokens 131072 --vllm-args="${VLLM_ARGS:-}" --ingress ${INGRESS:-proxy} $serving_opts \
          --out "$out/serving-pd.json" ;;
    soak) slice_ckpt; python3 benchmarks/bench_serving.py soak --checkpoint "$ckpt" --inputs 4096 --output-len 128 --rates ${SOAK_RATE:-2} \
            --duration-s 600 --vllm-max-graph-batch ${VLLM_GRAPH_BATCH:-64} --vllm-memory ${VLLM_MEMORY:-0.4} --kv-cache-tokens 131072 --ingress ${INGRESS:-proxy} \
            $serving_opts --out "$out/serving-soak.json" ;;
    resume) slice_ckpt; python3 benchmarks/bench_resume.py --checkpoint "$ckpt" --prompt-len 4096 --probes ${PROBES:-5} \
              --out "$out/decode-resume.json" ;;
    probe-ingress) slice_ckpt; python3 benchmarks/probes/probe_ingress.py --device cuda --checkpoint "$ckpt" --tokens ${PROBE_TOKENS:-2048} \
                     --out "$out/probe-ingress.json" ;;
    chaos) python3 benchmarks/chaos.py --device cuda --worker-gpus 0.5 --out "$out/chaos.json" 2>&1 | tail -30 ;;
    multi-gpu) python3 -m pytest -q -m multi_gpu tests 2>&1 | tee "$out/pytest-multi-gpu.txt" | tail -5 ;;
    prefill) slice_ckpt; cases=${CASES:-16x4096 1x32768}; gemms=${FP8_GEMMS:-auto}
             layouts=$(for gemm in ${WORKER_GEMMS:-$gemms}; do [ $gemm = auto ] || echo fp8:1:$gemm; done)
             python3 benchmarks/bench_moe.py --model deepseek-v3 --num-layers 5 --layouts $layouts --prompts $cases --moe-tokens ${MOE_TOKENS:-32768} \
               --share-gpus --repeats 3 --out "$out/prefill-workers.json" 2>&1 | tail -3
             python3 benchmarks/bench_vllm_prefill.py --checkpoint "$ckpt" --cases $cases --workers "$out/prefill-workers.json" --moe-tokens ${MOE_TOKENS:-32768} \
               --fp8-gemms $gemms --backends ${MOE_BACKENDS:-triton deep_gemm triton-tuned} --vllm-timeout ${VLLM_TIMEOUT:-900} ${ADD:+--add} --out "$out/vllm-prefill.json" ;;
    flashinfer-moe) PYTHONPATH=/tmp/vllm-site MAX_JOBS=16 python3 -c "from flashinfer.fused_moe.core import get_cutlass_fused_moe_module as m; m('90')" \
                      2>&1 | tail -3 ;;
    flashinfer-fp8-gemm) PYTHONPATH=/tmp/vllm-site MAX_JOBS=16 python3 -c "from flashinfer.gemm.gemm_base import get_fp8_blockscale_gemm_runner_sm90 as m; m()" \
                           2>&1 | tail -3 ;;
    first-batches) slice_ckpt; python3 benchmarks/probes/probe_first_batches.py --checkpoint "$ckpt" --fp8-gemm deep_gemm --max-batch-tokens 65536 \
                     --random-batches ${RANDOM_BATCHES:-24} --out "$out/first-batches-deep-gemm.json" 2>&1 | tail -2 ;;
    gemms) python3 benchmarks/bench_grouped_gemm.py --tokens ${GEMM_TOKENS:-16384} --experts 256 \
             --out "$out/grouped-gemm-candidates.json" ;;
    kv-load) python3 benchmarks/bench_kv_load.py --layers 61 5 --tokens 32768 4096 --chunk-rows 16384 65536 --out "$out/kv-load.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
