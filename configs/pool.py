"""Pool configuration: parallelism, backend, batching, chunking and KV cache, validated on creation.

:class:`PoolConfig` checks its own values; :meth:`PoolConfig.model_config` loads
the model and checks it against the pool (TP must divide the heads and the
dense and shared-expert MLP widths). ``auto`` values are resolved by each worker for its device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attention.backends.registry import MLAPrefillBackendEnum
from configs.model import DTYPES, EP_SCHEDULES, FP8_GEMMS, MOE_ROUNDINGS, ModelConfig, load_model_config

DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none")
PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
NIXL_MODES = ("auto", "on", "off")
SPARE_MODES = ("auto", "on", "off")
PCP_STRATEGIES = ("auto", "sharded", "gather")  # how PCP attends to cached context: workers.pcp


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """How a prefill pool is laid out and run.

    model            built-in model name or config.json (ignored when a checkpoint is given)
    checkpoint       HF checkpoint directory (config.json + safetensors); None = seeded random weights
    num_layers       run only the first N layers (None: all)
    tp, pcp          tensor- and prefill-context-parallel degrees; a replica has tp * pcp workers
    pcp_strategy     how a chunk attends to context sharded over PCP ranks: "sharded" (merge partial
                     outputs), "gather" (all-gather the latent KV), or "auto" (a cost model, per batch)
    placement        Ray placement strategy of a replica's workers; STRICT_PACK keeps it on one node
    replicas         independent TP x PCP groups serving requests in parallel
    backend          MLA prefill backend name, or "auto"
    dtype            compute dtype, or "auto" (the model's on GPU, float32 on CPU)
    quantization     "auto": an FP8 model's linear layers and experts run as FP8 GEMMs where torch has
                     DeepSeek's block-scaled recipe (SM90) and dtype is bfloat16, and are dequantized to
                     dtype at load elsewhere; "none": always dequantized
    ep_schedule      how a MoE layer's expert-parallel work is ordered (in every schedule the shared
                     experts compute while the combine all-to-all is in flight):
                     "all-to-all": every routed row, a rank's own ones too, goes through one dispatch
                     all-to-all; then the experts; then the combine. Measured on 2 x H200, 16K tokens per
                     GPU: one layer's routed experts 1.32-1.44x their raw grouped GEMMs
                     (benchmarks/results/2026-11-23-2xh200-deepseek-v3-5layers-fp8-tp-pcp.json).
                     "local-first": the pairs of a rank's own tokens and own experts never travel; they
                     are computed while the other rows' dispatch is in flight.
                     "two-micro-batches": DeepSeek's overlap, the tokens in two halves, one half's
                     all-to-all beside the other's experts. Without an SM carveout it measured slower on
                     2 x H200 (one layer 17.6 -> 19.4 ms; benchmarks/results/2026-11-22-2xh200-moe-profile-ep2-mb*.json).
                     local-first and the carveout are not yet measured on GPUs.
    ep_comm_sms      SMs that kernels running beside an expert-parallel all-to-all leave free for it (torch's
                     SM carveout, CUDA only; 0: none), and the most CTAs the all-to-all may use (its own
                     NCCL communicator, maxCTAs). With none, a persistent grouped GEMM beside an NCCL
                     kernel runs in two waves
    moe_rounding     where MoE layers round: "reference" (transformers': float32 router logits and
                     weights, the routing weight applied before the down GEMM, a token's experts added in
                     float32), or "vllm": as vLLM 0.26's CUDA path (workers.moe_vllm: router logits in
                     the model's dtype, routed in float32 without the scaling factor, the weight times the
                     down GEMM's float32 result, the sum scaled after it). With vLLM decode servers, "vllm" hands vLLM rows
                     closer to its own prefill's: 99.999% of a bf16 layer's outputs equal vLLM's kernels'
                     bit for bit (54-56% with "reference"), and on one H200 vLLM's 16 greedy tokens equal
                     vLLM alone's on 30 of 32 prompts, against 28 (docs/vllm-decode.md). Unquantized
                     experts, replicas of one worker, noaux_tc + sigmoid routing only; its down GEMM runs
                     one GEMM per expert after a host sync
    fp8_gemm         what runs the FP8 GEMMs of an FP8 checkpoint (SM90 GPUs; elsewhere the weights are
                     dequantized and this has no effect): "torch" (the linear layers on torch._scaled_mm with
                     DeepSeek's recipe; the routed experts on torch._scaled_grouped_mm, the only FP8 recipe torch's
                     grouped GEMM has on SM90: one scale per token and per output row, the checkpoint's 128x128
                     weight blocks requantized per row at load), "deep_gemm" (DeepGEMM, the package deep_gemm: its
                     dense GEMM for the linear layers whose both sides are whole blocks, as vLLM gives it its
                     linears, and its grouped GEMM for the experts on the checkpoint's own blocks, as vLLM's
                     DEEPGEMM MoE backend; workers.deepgemm), or "auto": deep_gemm where DeepGEMM imports and the
                     experts are whole blocks, torch otherwise (the worker logs its choice). On one H200 the
                     DeepSeek-V3 slice's 16x4K prefill took 0.475 s on DeepGEMM, 0.526 s on torch's GEMMs
                     (benchmarks/results/2026-11-28-h200-deepseek-v3-5layers-fp8-1gpu-prefill-workers-deep-gemm.json).
                     DeepGEMM compiles a kernel when first used (~4 s each, cached in $DG_JIT_CACHE_DIR, default
                     ~/.deep_gemm): on an empty cache a worker's start took 214 s, and a batch of a token count
                     not met before may take seconds more the first time (docs/operations.md)
    device           "cuda", "cpu" or "auto" (cuda when the workers see a GPU)
    chunk_tokens     prompts are prefilled in chunks of at most this many tokens per request (32768:
                     on H200 a 128K prompt of a DeepSeek-V3 layer runs 10% faster than with 8K chunks on
                     1 GPU and 13% on 4; 64K gains 2-6% more for twice the activation memory). Under PCP
                     each GPU computes 1/pcp of a chunk: 32768 * pcp keeps this activation memory per
                     GPU and runs a 128K prompt on 4 GPUs at 92% parallel efficiency, against 86% with 32K
    max_batch_tokens tokens of all requests' chunks in one batch
    batch_wait_ms    how long a batch with room waits for more requests, after a batch of several requests
                     (clients answered together come back together); after a batch of one it runs at once.
                     0: never wait, take what is queued (docs/prefix-cache.md has both measured)
    prefix_caching   reuse the KV of prompts' full blocks cached from earlier requests on the same replica
                     (cluster.prefix_cache), and route a request to the replica holding most of its prefix
    cuda_graph_tokens  token counts at which a GPU worker of a one-worker replica captures its forward as a
                     CUDA graph at start (workers.cuda_graphs): a batch of one prompt with no cached context,
                     up to the largest count, is padded to the next count and replayed, not launched kernel by
                     kernel. () runs every batch eagerly. Counts above chunk_tokens or the model's positions
                     are not captured
    workspace_tokens bound on cached-context rows up-projected at once (see attention.mla)
    block_size       tokens per block of the paged latent KV cache
    kv_cache_tokens  KV cache capacity per worker in tokens (under PCP a prompt's KV is striped over the
                     pcp workers of a TP rank, so a replica holds pcp times more); None = on GPU what gpu_memory_utilization
                     leaves after everything in use on the GPU and a profile prefill of the largest batch (set it
                     where worker_gpus < 1: packed workers would each take what is left), on CPU 262144
    gpu_memory_utilization  fraction of a GPU's memory in use once a worker is up, by every process on it: the
                     worker's weights, graphs, activations and KV cache, and what others hold (a vLLM server
                     on the same GPU counts against it)
    collective_timeout_s  bound on one collective of a batch once the replica is up: a rank waiting this
                     long for a peer (a stuck rank) raises, and the replica is replaced. Not a bound on a
                     batch: work between collectives is not counted (setup uses the start timeout)
    batch_timeout_s  bound on one batch seen from the driver (a rank stuck outside any collective, or a
                     replica of one worker); None: no bound
    worker_cpus      CPUs reserved per worker (fractional on small hosts)
    worker_gpus      GPUs reserved per worker when the pool uses GPUs: 1, or a fraction to pack the
                     workers of several small replicas on the same GPUs (a replica's own workers are
                     always on distinct GPUs: NCCL needs that)
    use_gpus         reserve GPUs for the workers: True, False, or None (= when the cluster has enough)
    nixl             KV handoff to decode servers outside the cluster: "auto" registers each holder's KV
                     cache with NIXL where it is installed (receivers READ it; TCP otherwise), "on"
                     requires it (a worker without NIXL fails to start), "off" serves TCP only
    spare_workers    "on": each replica keeps one spare worker process per rank, started ahead with torch
                     and the kernel library imported and no GPU memory, that replaces a failed rank
                     (fault to serving again on H200 with FA4: 1.4 s with, 15.2 s without: docs/faults.md);
                     "auto": on when the workers compute on the GPUs they hold (not when pinned to the CPU
                     on GPU resources); "off": none
    seed             seed of random weights
    """

    model: str = "tiny"
    checkpoint: str | None = None
    num_layers: int | None = None
    tp: int = 1
    pcp: int = 1
    pcp_strategy: str = "auto"
    placement: str = "STRICT_PACK"
    replicas: int = 1
    backend: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"
    ep_schedule: str = "all-to-all"
    ep_comm_sms: int = 0
    moe_rounding: str = "reference"
    fp8_gemm: str = "auto"
    device: str = "auto"
    chunk_tokens: int = 32768  # measured: benchmarks/results/2026-11-21-4xh200-pcp-chunk-sweep-128k.json
    max_batch_tokens: int = 32768
    batch_wait_ms: float = 2.0
    prefix_caching: bool = True
    cuda_graph_tokens: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    workspace_tokens: int = 16384
    block_size: int = 64
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    collective_timeout_s: float = 60.0
    batch_timeout_s: float | None = 900.0
    worker_cpus: float = 1.0
    worker_gpus: float = 1.0
    use_gpus: bool | None = None
    nixl: str = "auto"
    spare_workers: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("tp", "pcp", "replicas", "chunk_tokens", "max_batch_tokens", "workspace_tokens", "block_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"pool config: {key} must be a positive integer, got {value!r}")
        if self.pcp_strategy not in PCP_STRATEGIES:
            raise ValueError(f"pool config: pcp_strategy {self.pcp_strategy!r} is not one of {', '.join(PCP_STRATEGIES)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"pool config: placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError(f"pool config: num_layers must be a positive integer or None, got {self.num_layers!r}")
        if self.max_batch_tokens < self.chunk_tokens:
            raise ValueError(
                f"pool config: max_batch_tokens ({self.max_batch_tokens}) must be >= chunk_tokens ({self.chunk_tokens})"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"pool config: dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"pool config: quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.ep_schedule not in EP_SCHEDULES:
            raise ValueError(f"pool config: ep_schedule {self.ep_schedule!r} is not one of {', '.join(EP_SCHEDULES)}")
        if not isinstance(self.ep_comm_sms, int) or isinstance(self.ep_comm_sms, bool) or not 0 <= self.ep_comm_sms <= 64:
            raise ValueError(f"pool config: ep_comm_sms must be an integer in 0..64, got {self.ep_comm_sms!r}")
        if self.moe_rounding not in MOE_ROUNDINGS:
            raise ValueError(f"pool config: moe_rounding {self.moe_rounding!r} is not one of {', '.join(MOE_ROUNDINGS)}")
        if self.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"pool config: fp8_gemm {self.fp8_gemm!r} is not one of {', '.join(FP8_GEMMS)}")
        if self.moe_rounding == "vllm" and self.tp * self.pcp > 1:
            raise ValueError(f"pool config: moe_rounding 'vllm' needs replicas of one worker (tp = pcp = 1), got tp={self.tp}, pcp={self.pcp}")
        if self.spare_workers not in SPARE_MODES:
            raise ValueError(f"pool config: spare_workers {self.spare_workers!r} is not one of {', '.join(SPARE_MODES)}")
        if self.device not in DEVICES:
            raise ValueError(f"pool config: device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.backend.upper() != "AUTO":
            MLAPrefillBackendEnum.parse(self.backend)  # raises ValueError listing the valid names
        if self.kv_cache_tokens is not None and (not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < self.block_size):
            raise ValueError(
                f"pool config: kv_cache_tokens must be None or an integer >= block_size ({self.block_size}), "
                f"got {self.kv_cache_tokens!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"pool config: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.worker_cpus > 0:
            raise ValueError(f"pool config: worker_cpus must be positive, got {self.worker_cpus}")
        if not 0 < self.worker_gpus <= 1:
            raise ValueError(f"pool config: worker_gpus must be in (0, 1], got {self.worker_gpus}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"pool config: collective_timeout_s must be positive, got {self.collective_timeout_s}")
        if self.batch_timeout_s is not None and not self.batch_timeout_s > 0:
            raise ValueError(f"pool config: batch_timeout_s must be positive or None, got {self.batch_timeout_s}")
        if self.nixl not in NIXL_MODES:
            raise ValueError(f"pool config: nixl {self.nixl!r} is not one of {', '.join(NIXL_MODES)}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"pool config: prefix_caching must be true or false, got {self.prefix_caching!r}")
        graphs = self.cuda_graph_tokens
        if not isinstance(graphs, (tuple, list)) or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in graphs):
            raise ValueError(f"pool config: cuda_graph_tokens must be a list of positive token counts (empty: none), got {graphs!r}")
        object.__setattr__(self, "cuda_graph_tokens", tuple(sorted(set(graphs))))  # a YAML list, in any order
        if self.batch_wait_ms < 0:
            raise ValueError(f"pool config: batch_wait_ms must be >= 0, got {self.batch_wait_ms}")

    def replace(self, **changes: Any) -> PoolConfig:
        return dataclasses.replace(self, **changes)

    @property
    def workers_per_replica(self) -> int:
        return self.tp * self.pcp

    def model_config(self) -> ModelConfig:
        """The model this pool serves, validated against the pool's degrees."""
        overrides = {"num_hidden_layers": self.num_layers} if self.num_layers else {}
        config = load_model_config(self.checkpoint or self.model, **overrides)
        config.check_tp(self.tp)
        return config
