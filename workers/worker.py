"""One prefill worker: a model shard on one device, run SPMD with the rest of its replica.

The driver (``cluster.pool``) wraps :class:`PrefillWorker` in a Ray actor, one
per GPU (or per CPU slot), and calls every worker of a replica with the same
batch. Each worker:

* joins its replica's process group (NCCL on CUDA, gloo on CPU), split into its
  TP group (same ``pcp_rank``: the heads are split) and its PCP group (same
  ``tp_rank``: the tokens are split; ``rank = pcp_rank * tp + tp_rank``); the
  whole group is the expert-parallel group of the MoE layers (a communicator of
  its own with ``ep_comm_sms``: ``workers.collectives``);
* holds its TP shard of the model and its share of the routed experts (FP8
  weights run as FP8 GEMMs on SM90 in bf16, and are dequantized at load
  elsewhere), refusing at setup a shard that does not fit the GPU, and, in a
  paged cache, its PCP stripes of the latent KV of the requests it prefilled
  (sized at setup: see ``_allocate_kv_cache``);
* runs a batch of chunk pieces: request ``r``'s next ``len(tokens)`` tokens after
  ``context_len`` cached ones. Later chunks attend to the cached rows through the
  MLA layer's chunked-context path (under PCP: ``workers.pcp``, each worker its
  zigzag share of the tokens), so long prompts never need all their activations
  at once;
* returns, from rank 0 only, for every request whose final chunk was in the
  batch its greedy next token and, where its piece asks, its logits and last
  hidden state, and the batch's PCP strategy and bytes;
* hands its kept KV to decode actors and decode servers, beside running batches
  (``workers.kv_holder``).

Nothing here imports Ray: the worker is plain Python and testable in-process.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
from torch.distributed.distributed_c10d import _set_pg_timeout

from attention.backends.base import DeviceCapability, MLAPrefillSelectorConfig
from attention.backends.selector import get_mla_prefill_backend
from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import PrefillBatch, plan_prefill_batch
from configs.model import ModelConfig
from configs.pool import PoolConfig
from kv.laps import Laps
from kv.mapped import host_identity
from workers.collectives import expert_parallel_group, grid_groups
from workers.batch_io import BatchOutput, ChunkPiece, finished_results
from workers.fp8_choice import fp8_gemm_for, use_fp8
from workers.kv_cache import PagedKVCache, blocks_for
from workers.kv_holder import KVHolder
from workers.cuda_graphs import PrefillGraphs, capture_forward
from workers.model import DeepseekPrefillModel, PrefillOutput, TPShard
from workers.expert_parallel import EPGroup
from workers.pcp import PCPCostModel, PCPGroup, PCPPlan, measure_cost_model
from workers.pcp_layout import shard_rows
from workers.placement import check_kv_sizing, check_weights_fit, gpu_bytes_allowed, resolve_device, resolve_dtype
from workers.weights import load_weights

logger = logging.getLogger(__name__)

# NVLink multicast off everywhere (shared hosts: see the project's GPU notes).
WARMUP_REQUEST = "__mlapool_warmup__"
# tokens per warm-up chunk: FA4 compiles other kernel variants for chunks and cached contexts longer than
# its tiles than for 16-token ones, and a node's first requests paid 1.9-2.4 s for each on H200
# (benchmarks/results/2026-11-23-h200-first-batches-*.json)
WARMUP_TOKENS = 1024
CPU_KV_CACHE_TOKENS = 262144
SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FAULTS = ("raise", "exit", "hang")


class InjectedFault(RuntimeError):
    """The failure :meth:`PrefillWorker.inject_fault` was asked for."""


@dataclass
class WorkerInfo:
    rank: int
    world_size: int
    backend: str
    device: str
    dtype: str
    host: str
    pid: int
    warmup_s: float  # the warm-up prefill, including any kernel JIT compilation
    kv_blocks: int  # capacity of the paged latent KV cache
    block_size: int
    pcp_link_gbps: float | None  # measured PCP all-gather bandwidth per rank (None without PCP)
    weights: str  # "fp8" (FP8 GEMMs), or the dtype the weights are held in
    weight_bytes: int  # this rank's parameters
    experts: tuple[int, int] | None  # the routed experts [first, last] this rank holds (None: no MoE layers)
    load_s: float  # reading (or drawing) this rank's weights
    peak_host_mib: float  # the worker process's peak resident host memory after loading (ru_maxrss)
    peak_host_mib_before_load: float  # the same before loading: what loading added is the difference
    read_bytes: int  # read from the checkpoint (0 when the weights are drawn)
    device_uuid: str | None = None  # the GPU's UUID (None on the CPU): who else uses this GPU
    host_id: str = ""  # kv.mapped.host_identity(): the host name and its kernel's boot id
    kv_transports: tuple[str, ...] = ()  # how it serves its KV shards to decode servers (workers.kv_export)
    cuda_graph_tokens: tuple[int, ...] = ()  # the token counts its forward is captured at (workers.cuda_graphs)
    start_phases_s: dict | None = None  # seconds of each step of setup(), in order
    fp8_gemm: str | None = None  # what runs the FP8 GEMMs (PoolConfig.fp8_gemm resolved; None: none here, the weights dequantized)


def rendezvous_address() -> tuple[str, int]:
    """This host's address and a port free now, for a server started next (tests, benchmarks; the port
    can be taken in between: a replica's process group uses :meth:`PrefillWorker.rendezvous_address`)."""
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket() as sock:
        sock.bind(("", 0))
        return host, sock.getsockname()[1]


class PrefillWorker(KVHolder):
    def __init__(self, config: PoolConfig, rank: int | None, env: dict[str, str] | None = None) -> None:
        """``env``: variables for this process (NCCL's, OMP_NUM_THREADS), set before anything reads them.
        ``rank`` None: a spare, for a replica's next replacement (:meth:`preload`, :meth:`promote`)."""
        os.environ.update(env or {})
        if env and "OMP_NUM_THREADS" in env:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        self.config, self.world_size = config, config.workers_per_replica
        self.model: DeepseekPrefillModel | None = None
        self.pcp = PCPGroup()
        self.cost_model: PCPCostModel | None = None
        self.graphs: PrefillGraphs | None = None  # the captured forward of short prompts (workers.cuda_graphs)
        self._groups: list = []  # every process group of the replica this rank is in
        self._rendezvous: torch.distributed.TCPStore | None = None  # rank 0's, hosted by rendezvous_address
        self._batches = 0
        self._fault = None  # the hook of an armed inject_fault, removed when it fires
        self._device_index: int | None = None  # the GPU a promoted spare takes (it sees all of the node's)
        if rank is not None:
            self._take_rank(rank)

    def _take_rank(self, rank: int) -> None:
        self.rank = rank
        self.pcp_rank, self.tp_rank = divmod(rank, self.config.tp)
        self._init_kv_holder(self.config, rank, self.tp_rank)

    def preload(self) -> str:
        """A spare: import now what :meth:`setup` would import first (the kernel library of the
        backend this config selects on this node: FA4's CuTe DSL takes 5 s on H200), touching no
        GPU memory. Returns the backend's name."""
        model_config = self.config.model_config()
        device = resolve_device(self.config.device, 0)
        return self._backend_class(model_config, device, resolve_dtype(self.config.dtype, device, model_config.dtype)).name

    def _backend_class(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> type:
        return get_mla_prefill_backend(
            MLAPrefillSelectorConfig(dtype, model_config.attention.dims),
            DeviceCapability.of(device),
            None if self.config.backend.upper() == "AUTO" else self.config.backend,
        )

    def promote(self, rank: int, device_uuid: str | None) -> None:
        """A spare becomes rank ``rank`` of a replacement replica, on the GPU ``device_uuid`` (the
        failed rank's; None on the CPU); :meth:`setup` follows."""
        if device_uuid is not None:
            uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
            if device_uuid not in uuids:
                raise RuntimeError(f"spare worker: GPU {device_uuid} is not on this node; it sees {uuids}")
            self._device_index = uuids.index(device_uuid)
        self._take_rank(rank)

    def rendezvous_address(self, timeout_s: float = 600.0) -> tuple[str, int]:
        """Rank 0: host the replica's rendezvous for :meth:`setup`, a ``TCPStore`` on a port the kernel
        gives as it binds, and return its address. (A port seen free here and bound later by ``setup``
        can be taken in between by any process of the node: EADDRINUSE, a replica that fails to start.)"""
        host = socket.gethostbyname(socket.gethostname())
        if self.world_size == 1:
            return host, 0
        self._rendezvous = torch.distributed.TCPStore(host, 0, self.world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return host, self._rendezvous.port

    def setup(self, master_addr: str, master_port: int, timeout_s: float = 600.0) -> WorkerInfo:
        """Join the process group (its store at ``master_addr:master_port``: rank 0's from
        :meth:`rendezvous_address`, or else bound by rank 0 here), build this rank's shard, load (or
        draw) its weights, size the paged KV cache and run the warm-up prefill (kernel JIT happens
        here, not in a request). ``WorkerInfo.start_phases_s`` says how long each step took."""
        config, laps = self.config, Laps(digits=3)
        model_config = config.model_config()
        index = self._device_index if self._device_index is not None else (self.rank if config.worker_gpus < 1 else None)
        device = resolve_device(config.device, index)
        dtype = resolve_dtype(config.dtype, device, model_config.dtype)
        check_kv_sizing(device, config)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp_group, ep = None, EPGroup()
        if self.world_size > 1:  # rank 0's store hosted by rendezvous_address, or bound here on master_port
            store = self._rendezvous
            if store is None:
                store = torch.distributed.TCPStore(master_addr, master_port, self.world_size, self.rank == 0, timeout=timedelta(seconds=timeout_s))
            torch.distributed.init_process_group(
                "nccl" if device.type == "cuda" else "gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s)
            )
            tp_group, pcp_group = grid_groups(self.rank, config.tp, config.pcp)
            ep_group = expert_parallel_group(self.world_size, device, config.ep_comm_sms if model_config.moe is not None else 0)
            self._groups = [torch.distributed.group.WORLD, *{g for g in (tp_group, pcp_group, ep_group) if g is not None}]
            if config.pcp > 1:
                self.pcp = PCPGroup(self.pcp_rank, config.pcp, pcp_group)
            ep = EPGroup(self.rank, self.world_size, ep_group)
        laps.lap("process_group")
        backend_cls = self._backend_class(model_config, device, dtype)
        laps.lap("backend")  # importing its library (FA4's CuTe DSL: seconds)
        tp = TPShard(self.tp_rank, config.tp, tp_group)
        fp8 = use_fp8(config, model_config, device, dtype, announce=self.rank == 0)
        fp8_gemm = fp8_gemm_for(config, model_config, fp8, announce=self.rank == 0)
        shard = {"tp": tp, "ep": ep, "fp8": fp8, "ep_schedule": config.ep_schedule, "ep_comm_sms": config.ep_comm_sms,
                 "moe_rounding": config.moe_rounding, "fp8_gemm": fp8_gemm or "torch", "dtype": dtype}  # fmt: skip
        weight_bytes = DeepseekPrefillModel.create(model_config, TorchSDPAPrefillBackend, device="meta", **shard).weight_bytes()
        check_weights_fit(weight_bytes, device, config, model_config)
        self.model = DeepseekPrefillModel.create(model_config, backend_cls, device=device, **shard)
        laps.lap("model")
        report = load_weights(self.model, config.checkpoint, config.seed)
        laps.lap("load")
        self.graphs = capture_forward(  # before the KV cache: it is sized around them
            self.model, config.cuda_graph_tokens, min(config.chunk_tokens, model_config.max_position_embeddings), device, self.world_size, self.rank
        )  # fmt: skip
        laps.lap("cuda_graphs")
        if self.pcp.size > 1:
            attn = self.model.model.layers[0].self_attn
            self.cost_model = measure_cost_model(self.pcp, torch.distributed.group.WORLD, attn)
        self.kv = self._allocate_kv_cache(model_config, dtype, device)
        laps.lap("kv_cache")
        if self.tp_rank == 0:  # TP ranks hold the same latent rows: one exporter per PCP rank
            self.export = self._start_export()
        laps.lap("kv_export")
        self._warm_up()
        for _, moe in self.model.moe_layers():
            moe.pairs = 0  # the warm-up and profile prefills are not load
        for group in self._groups:  # up and warm: from now on a peer that long silent is stuck
            _set_pg_timeout(timedelta(seconds=config.collective_timeout_s), group)
        laps.lap("warmup")
        return WorkerInfo(
            rank=self.rank,
            world_size=self.world_size,
            backend=backend_cls.name,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            host=socket.gethostname(),
            pid=os.getpid(),
            warmup_s=laps.phases["warmup"],
            kv_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            pcp_link_gbps=round(self.cost_model.link_bytes_per_s / 1e9, 2) if self.cost_model else None,
            weights="fp8" if fp8 else str(dtype).removeprefix("torch."),
            weight_bytes=weight_bytes,
            experts=self._experts(),
            fp8_gemm=fp8_gemm,
            load_s=report.seconds,
            peak_host_mib=report.peak_host_mib,
            peak_host_mib_before_load=report.peak_host_mib_before,
            read_bytes=report.bytes_read,
            device_uuid=str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None,
            host_id=host_identity(),
            kv_transports=self.export.transports if self.export is not None else (),
            cuda_graph_tokens=tuple(self.graphs.sizes) if self.graphs is not None else (),
            start_phases_s=laps.phases,
        )

    def inject_fault(self, kind: str, layer: int = 0, after_batches: int = 0) -> None:
        """Chaos testing: fail inside the model, at the start of ``layer``, in the batch after the
        next ``after_batches`` ones: ``raise`` an :class:`InjectedFault`, ``exit`` the process, or
        ``hang`` (sleep for an hour). The other ranks of the replica are then inside the layer's
        collectives, which is what the pool must recover from."""
        if kind not in FAULTS:
            raise ValueError(f"fault kind {kind!r} is not one of {', '.join(FAULTS)}")
        layers = self._model().config.num_hidden_layers
        if not 0 <= layer < layers:
            raise ValueError(f"fault layer {layer} is outside [0, {layers})")
        if self._fault is not None:
            self._fault.remove()  # a later fault replaces one not yet fired
        # a hook on that one layer while armed: nothing is added to the layers of a pool without faults
        at_batch = self._batches + after_batches + 1
        hook = functools.partial(self._maybe_fail, kind, layer, at_batch)
        self._fault = self._model().model.layers[layer].input_layernorm.register_forward_pre_hook(hook)

    def _maybe_fail(self, kind: str, layer: int, batch: int, module, args) -> None:
        if self._batches != batch:
            return
        self._fault.remove()
        self._fault = None
        logger.warning("rank %d: injected fault %r at layer %d of batch %d", self.rank, kind, layer, batch)
        if kind == "exit":
            os._exit(1)
        if kind == "hang":
            time.sleep(3600)
        raise InjectedFault(f"rank {self.rank}: injected fault at layer {layer} (t={time.time():.3f})")

    def _experts(self) -> tuple[int, int] | None:
        moe_layers = self._model().moe_layers()
        if not moe_layers:
            return None
        first, count = moe_layers[0][1].first_expert, moe_layers[0][1].experts.num_local
        return first, first + count - 1

    def moe_load(self) -> dict[int, int]:
        """(token, expert) pairs this rank's experts computed per MoE layer since the warm-up (the
        expert-parallel load: compare the ranks of a replica)."""
        return {index: moe.pairs for index, moe in self._model().moe_layers()}

    @torch.no_grad()
    def prefill(self, pieces: Sequence[ChunkPiece]) -> BatchOutput | None:
        """Run one batch of chunk pieces. Every rank of the replica gets the same call;
        global rank 0 returns the finished requests' results and the batch's PCP report."""
        began = time.perf_counter()
        model = self._model()
        device = model.lm_head.weight.device
        self._batches += 1
        for piece in pieces:  # identical on every rank, so all ranks fail together
            self._check_piece(piece)
        with self._kv_lock:
            for piece in pieces:
                if piece.block_table is not None:
                    table = piece.block_table[self.pcp.rank]
                    self.kv.reserve(piece.request_id, self._rows(piece.total_len), table, self._rows(piece.context_len))
                elif piece.context_len == 0:  # the worker's own warm-up and profile runs
                    self.kv.reserve(piece.request_id, self._rows(piece.total_len))
        if self._replays(pieces):
            batch, out = None, self.graphs.run(pieces[0].token_ids)
        else:
            batch, out = self._run_eagerly(model, pieces, device)
        if isinstance(batch, PCPPlan):
            self.kv.append_many(out.latents, [(piece.request_id, batch.store_index[i]) for i, piece in enumerate(pieces)])
        else:
            ends = np.cumsum([len(piece.token_ids) for piece in pieces]).tolist()
            self.kv.append_many(out.latents, [(piece.request_id, slice(end - len(piece.token_ids), end)) for piece, end in zip(pieces, ends)])
        for piece in pieces:
            if piece.is_last and device.type == "cuda":
                self._kv_ready[piece.request_id] = torch.cuda.Event()
                self._kv_ready[piece.request_id].record()
        # float32 from the device (the model upcasts its logits there): a vocab-sized cast in the driver
        # runs on torch's intra-op thread pool, whose wake-up cost a cached turn 3-10 ms of TTFT on
        # H200; float32 numpy arrays store in Ray's object store in 0.9-1.5 ms, as bf16 tensors did
        vocab = out.logits.shape[1]
        last = torch.cat([out.logits, out.last_hidden.float()], dim=1)  # [pieces, vocab + hidden]: one copy to the host
        if isinstance(batch, PCPPlan):  # last tokens of whole requests are on their owners (workers.pcp)
            last = batch.gather_last(last)
        if self.rank != 0:
            return None
        results, host = finished_results(pieces, last, vocab)
        report = BatchOutput(results, host, vocab, time.perf_counter() - began)
        if isinstance(batch, PCPPlan):
            report.pcp_strategy, report.pcp_bytes = batch.strategy, int(batch.comm_bytes_per_layer * model.config.num_hidden_layers)
        return report

    def _replays(self, pieces: Sequence[ChunkPiece]) -> bool:
        """Whether this batch runs from the captured graphs: one prompt with no cached context that fits
        one, and no fault armed (its hook runs in the eager forward only)."""
        return (
            self.graphs is not None and self._fault is None and len(pieces) == 1 and pieces[0].context_len == 0
            and self.graphs.size_for(len(pieces[0].token_ids)) is not None
        )  # fmt: skip

    def _run_eagerly(
        self, model: DeepseekPrefillModel, pieces: Sequence[ChunkPiece], device: torch.device
    ) -> tuple[PrefillBatch | PCPPlan, PrefillOutput]:
        """The batch's plan and its forward, launched kernel by kernel."""
        seq_lens, context_lens = [len(p.token_ids) for p in pieces], [p.context_len for p in pieces]
        token_ids = torch.from_numpy(np.concatenate([p.token_ids for p in pieces]).astype(np.int64)).to(device)
        if self.pcp.size > 1:
            batch = PCPPlan(
                seq_lens,
                context_lens,
                pcp=self.pcp,
                block_size=self.kv.block_size,
                num_heads=model.backend.num_heads,
                dims=model.backend.dims,
                latent_width=model.config.attention.latent_dim,
                element_size=model.dtype.itemsize,
                workspace_tokens=self.config.workspace_tokens,
                device=device,
                strategy=self.config.pcp_strategy,
                cost_model=self.cost_model,
                backend=model.backend,
            )
            token_ids = token_ids[batch.local_index]
        else:
            batch = plan_prefill_batch(
                seq_lens, context_lens, workspace_tokens=self.config.workspace_tokens, device=device, backend=model.backend
            )
        context = _PackedContext(self.kv, [(p.request_id, self._rows(p.context_len)) for p in pieces if p.context_len])
        return batch, model(token_ids, batch, context if any(context_lens) else None)

    def _rows(self, tokens: int) -> int:
        """KV rows of a request's first ``tokens`` tokens that this worker stores (its PCP stripes)."""
        return shard_rows(tokens, self.pcp.rank, self.pcp.size, self.config.block_size)

    def _allocate_kv_cache(self, model_config, dtype: torch.dtype, device: torch.device) -> PagedKVCache:
        """The paged cache, sized by ``kv_cache_tokens`` or, on a GPU, by what ``gpu_memory_utilization``
        of the GPU leaves once everything in use on it is counted (other processes, CUDA contexts,
        this worker's weights and graphs) and the activations of the largest batch, measured by a
        profile prefill of ``max_batch_tokens`` of new requests, one full chunk each."""
        config, layers, width = self.config, model_config.num_hidden_layers, model_config.attention.latent_dim
        per_block = PagedKVCache.bytes_per_block(layers, config.block_size, width, dtype)
        if config.kv_cache_tokens is not None:
            num_blocks = blocks_for(config.kv_cache_tokens, config.block_size)
        elif device.type == "cuda":
            chunk = min(config.chunk_tokens, model_config.max_position_embeddings)
            full, rest = divmod(config.max_batch_tokens, chunk)
            lens = [chunk] * full + ([rest] if rest else [])
            profile_blocks = sum(blocks_for(self._rows(n), config.block_size) for n in lens)
            self.kv = PagedKVCache(layers, profile_blocks, config.block_size, width, dtype, device)
            torch.cuda.reset_peak_memory_stats(device)
            names = [f"{WARMUP_REQUEST}{i}" for i in range(len(lens))]
            ids = np.arange(chunk, dtype=np.int32) % model_config.vocab_size
            self.prefill([ChunkPiece(name, ids[:n], 0, n) for name, n in zip(names, lens)])
            self.release(names)
            del self.kv
            # the batch's activations: its peak over what stays allocated (the profile's own KV cache aside)
            activations = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device) - profile_blocks * per_block
            torch.cuda.empty_cache()
            # less every byte in use on the GPU: a vLLM server's beside the pool, this worker's weights and graphs
            left, free, total = gpu_bytes_allowed(device, config.gpu_memory_utilization)
            num_blocks = int((left - activations) // per_block)
            if num_blocks < 1:
                raise ValueError(
                    f"no GPU memory left for the KV cache: gpu_memory_utilization={config.gpu_memory_utilization} allows "
                    f"{total * config.gpu_memory_utilization / 2**30:.1f} GiB in use on this {total / 2**30:.1f} GiB GPU; {(total - free) / 2**30:.1f} GiB are in use "
                    f"(this worker's weights and graphs, CUDA contexts, other processes) and a {config.max_batch_tokens}-token "
                    f"batch takes {activations / 2**30:.1f} GiB more; raise gpu_memory_utilization, lower chunk_tokens or "
                    "max_batch_tokens, use more TP, or free the GPU"
                )
        else:
            num_blocks = blocks_for(CPU_KV_CACHE_TOKENS, config.block_size)
        # the holders' caches (TP rank 0 of each PCP rank) are mapped by receivers on this host (kv.mapped)
        return PagedKVCache(layers, num_blocks, config.block_size, width, dtype, device, shared=self.tp_rank == 0)

    def _warm_up(self) -> None:
        """Prefill a dummy prompt in two chunks (new tokens, then new tokens over cached context) of
        ``WARMUP_TOKENS`` each (fewer where chunks, positions or a set ``kv_cache_tokens`` are
        smaller), so kernels are JIT-compiled and planned before the first request, not during it.
        Every rank computes the same size from the config alone (the warm-up is SPMD)."""
        config, positions = self.config, self.model.config.max_position_embeddings
        n = min(WARMUP_TOKENS, config.chunk_tokens, positions // 2)
        if config.kv_cache_tokens is not None:
            n = min(n, max(1, config.kv_cache_tokens // 4))
        ids = np.arange(2 * n, dtype=np.int32) % self.model.config.vocab_size
        for start in (0, n):
            self.prefill([ChunkPiece(WARMUP_REQUEST, ids[start : start + n], start, 2 * n)])
        self.release([WARMUP_REQUEST])

    def health(self) -> dict:
        info = {"rank": self.rank, "ready": self.model is not None, "kv_requests": 0, "kv_free_blocks": 0}
        if self.model is not None:
            info.update(kv_requests=self.kv.num_requests, kv_free_blocks=self.kv.free_blocks)
        return info

    def _model(self) -> DeepseekPrefillModel:
        if self.model is None:
            raise RuntimeError("worker is not set up: call setup() first")
        return self.model

    def _check_piece(self, piece: ChunkPiece) -> None:
        if piece.block_table is not None:
            if len(piece.block_table) != self.pcp.size:
                raise ValueError(f"request {piece.request_id!r}: a block table for {len(piece.block_table)} PCP ranks, the replica has {self.pcp.size}")
            return
        if piece.context_len == 0:
            return
        held, expected = self.kv.length(piece.request_id), self._rows(piece.context_len)
        if held != expected:
            raise ValueError(
                f"request {piece.request_id!r}: chunk expects {piece.context_len} cached tokens "
                f"({expected} rows on this worker), the worker holds {held}"
            )


class _PackedContext(Sequence):
    """Per layer, the batch's cached rows held here, packed in batch order (gathered one layer at a time).

    ``parts`` lists ``(request_id, rows)`` for the requests with context."""

    def __init__(self, kv: PagedKVCache, parts: list[tuple[str, int]]) -> None:
        self.kv, self.parts = kv, parts
        self.num_layers = kv.blocks.shape[0]

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer: int) -> torch.Tensor:
        views = [self.kv.rows(request_id, layer, n) for request_id, n in self.parts]
        return views[0] if len(views) == 1 else torch.cat(views)
