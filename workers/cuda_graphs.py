"""A short prompt's prefill replayed from CUDA graphs captured when the worker starts.

For a prompt of a few hundred tokens the GPU runs a layer's kernels faster than Python issues them:
on one H200 the DeepSeek-V3 5-layer FP8 slice spent 11.7 ms on a 16-token prompt inside its worker
(``benchmarks/results/2026-11-26-h200-probe-compiled-graph.json``), almost all of it launching
kernels one at a time, while vLLM replays its model as captured graphs. So a worker of a one-GPU
replica captures its whole forward (embedding to logits, every layer's latent rows into static
buffers) once per token count of ``PoolConfig.cuda_graph_tokens``, and a batch of one prompt with
no cached context that fits one of those counts runs by replay:

    ids[:n] = prompt, ids[n:] = 0; last = n - 1         (the graph's static inputs)
    graph.replay()                                       one launch for every layer's kernels
    latents[l][:n], logits of token n - 1                (views of the static outputs)

Padding at the end leaves every real row as it is: attention is causal, and the rest of a layer
works token by token (norms, projections, the FP8 per-token activation scales, routing, experts).
What the capture needs from the forward, :meth:`DeepseekPrefillModel.run_layers` has: no host sync
(the attention plan is made once, here, and the MoE's pair order has a size known on the host), and
shapes that depend only on the token count.

Everything else runs eagerly, as before: batches of several requests, chunks over cached context,
replicas of several workers (their collectives are not captured), prompts longer than the largest
count, MoE layers with ``moe_rounding="vllm"`` (its down GEMM syncs), and any batch while a fault is
armed (the chaos harness's hook must run).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attention.backends.base import RaggedPlan
from attention.mla import PrefillBatch, plan_prefill_batch
from workers.model import DeepseekPrefillModel, PrefillOutput

logger = logging.getLogger(__name__)


def graph_reasons(model: DeepseekPrefillModel, device: torch.device, world_size: int) -> list[str]:
    """Why this worker's forward is not captured (empty when it is)."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"the worker runs on {device}, not a GPU")
    if world_size > 1:
        reasons.append(f"the replica has {world_size} workers (collectives are not captured)")
    if any(moe.rounding == "vllm" for _, moe in model.moe_layers()):
        reasons.append("moe_rounding 'vllm' syncs with the host in its down GEMM")
    return reasons


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [size] int64: the prompt, padded with id 0
    last: torch.Tensor  # [1] int64: the prompt's last token
    out: PrefillOutput  # the static outputs the replay writes
    batch: PrefillBatch  # the padded batch: its positions and offsets are read by the replay
    plan: RaggedPlan  # its attention plan: the workspaces the kernels read stay alive with the graph


class PrefillGraphs:
    """The forward of ``model`` captured for one prompt of each of ``sizes`` tokens (:meth:`capture`)."""

    def __init__(self, model: DeepseekPrefillModel, graphs: dict[int, _Graph], pool_bytes: int) -> None:
        self.model, self._graphs = model, graphs
        self.sizes = sorted(graphs)
        self.pool_bytes = pool_bytes  # device memory the graphs hold (their private pool)
        self._moe_layers = [moe for _, moe in model.moe_layers()]

    @classmethod
    def capture(cls, model: DeepseekPrefillModel, sizes: Sequence[int], device: torch.device) -> PrefillGraphs:
        """Capture the forward for each token count of ``sizes``, the largest first, into one memory pool
        (a replay's intermediates are dead by the next replay, so the graphs may share them)."""
        # torch.cuda.graph empties the allocator's cache as a capture starts; emptied here first, blocks freed
        # before the capture (weight loading's temporaries) no longer leave the count during it (they made
        # the graphs' figure negative: -11 GB on an H200, 2026-11-29)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        pool, stream, graphs = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device), {}
        for size in sorted(set(sizes), reverse=True):
            ids = torch.zeros(size, dtype=torch.int64, device=device)
            last = torch.full((1,), size - 1, dtype=torch.int64, device=device)
            batch = plan_prefill_batch([size], device=device)
            plan = model.backend.plan(batch.cu_seqlens, causal=True)
            # once outside the capture, on its stream: kernels are compiled, tuned and their lazy state built.
            # Its own batch: a cache keyed by the batch's tensors (the rotary cos/sin of its positions) must
            # miss in the capture, else the graph reads this run's tensors, freed once the cache moves on
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                model.run_layers(ids, plan_prefill_batch([size], device=device), last_index=last)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of the worker's other threads (the KV server) do not break the capture
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                out = model.run_layers(ids, batch, last_index=last)
            graphs[size] = _Graph(graph, ids, last, out, batch, plan)
        torch.cuda.synchronize(device)
        return cls(model, graphs, torch.cuda.memory_reserved(device) - reserved)

    def size_for(self, tokens: int) -> int | None:
        """The smallest captured count that holds ``tokens`` (None: longer than every graph)."""
        i = bisect.bisect_left(self.sizes, tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, token_ids: np.ndarray) -> PrefillOutput:
        """Prefill one prompt with no cached context by replay. The latents and logits returned are views
        of the graph's buffers: read or copy them before the next :meth:`run`."""
        n = len(token_ids)
        size = self.size_for(n)
        if n == 0 or size is None:
            raise ValueError(f"a prompt of {n} tokens: the captured graphs take 1 to {self.sizes[-1]}")
        host = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
        self.model.check_tokens(host, plan_prefill_batch([n]))
        g = self._graphs[size]
        g.ids.copy_(torch.nn.functional.pad(host, (0, size - n)))
        g.last.fill_(n - 1)
        g.graph.replay()
        for moe in self._moe_layers:  # what MoE._compute counts eagerly (one rank holds every expert)
            moe.pairs += n * moe.config.num_experts_per_tok
        return PrefillOutput(g.out.last_hidden, g.out.logits, [latent[:n] for latent in g.out.latents])


def capture_forward(
    model: DeepseekPrefillModel, sizes: Sequence[int], limit: int, device: torch.device, world_size: int, rank: int
) -> PrefillGraphs | None:
    """A worker's graphs: its forward captured at ``sizes`` up to ``limit`` tokens (its chunk, the model's
    positions), or None where it is not captured (why said once at start, by rank 0)."""
    sizes = [n for n in sizes if n <= limit]
    if not sizes:
        return None
    reasons = graph_reasons(model, device, world_size)
    if reasons:
        if rank == 0 and device.type == "cuda":
            logger.info("%s: every batch runs eagerly: %s", model.config.name, "; ".join(reasons))
        return None
    start = time.perf_counter()
    try:
        graphs = PrefillGraphs.capture(model, sizes, device)
    except RuntimeError as error:  # a kernel that cannot be captured (a host sync in a backend's library)
        torch.cuda.empty_cache()
        logger.warning("rank %d: capturing the forward failed, every batch runs eagerly: %s", rank, error)
        return None
    logger.info(
        "rank %d: forward captured as CUDA graphs for prompts of %s tokens in %.1f s, %.0f MiB",
        rank, "/".join(map(str, graphs.sizes)), time.perf_counter() - start, graphs.pool_bytes / 2**20,
    )  # fmt: skip
    return graphs
