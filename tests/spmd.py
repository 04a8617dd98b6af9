"""Run the workers of one replica as plain processes (gloo, no Ray), prefill prompts chunk by chunk on
all of them, and collect what each returns: rank 0's logits and batch reports, every rank's KV shards
and MoE load."""

import multiprocessing
import socket
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RankResult:
    rank: int
    logits: dict  # request id -> logits (rank 0 only)
    kv: dict  # request id -> this rank's KV rows [layers, rows, latent]
    strategies: list  # rank 0: the PCP strategy of each batch
    moe_load: dict  # MoE layer -> (token, expert) pairs computed here
    experts: tuple | None  # the routed experts this rank holds


def chunk_batches(prompts: list[np.ndarray], chunk: int, prefix: str = "r"):
    """The batches a worker runs for ``prompts`` all in flight: each batch takes the next chunk (at most
    ``chunk`` tokens) of every unfinished prompt, as request ``f"{prefix}{i}"``."""
    from workers.worker import ChunkPiece

    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        pieces = []
        for i, prompt in enumerate(prompts):
            if done[i] < len(prompt):
                n = min(chunk, len(prompt) - done[i])
                pieces.append(ChunkPiece(f"{prefix}{i}", prompt[done[i] : done[i] + n], done[i], len(prompt)))
                done[i] += n
        yield pieces


def _run_rank(rank, config, port, prompts, chunk, results, prepare):
    if prepare is not None:
        prepare()
    from workers.worker import PrefillWorker

    worker = PrefillWorker(config, rank)
    info = worker.setup("127.0.0.1", port)
    logits, strategies = {}, []
    for pieces in chunk_batches(prompts, chunk):
        out = worker.prefill(pieces)
        if out is not None:
            strategies.append(out.pcp_strategy)
            logits.update({r.request_id: r.logits.numpy() for r in out.results})
    kv = {f"r{i}": worker.fetch_kv(f"r{i}").tensor().float().numpy() for i in range(len(prompts))}
    results.put(RankResult(rank, logits, kv, strategies, worker.moe_load(), info.experts))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(config, prompts: list[np.ndarray], chunk: int, *, prepare=None, timeout: float = 180) -> list[RankResult]:
    """``config.workers_per_replica`` processes; ``prepare`` (a module-level function) runs first in each."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_run_rank, args=(rank, config, port, prompts, chunk, results, prepare))
        for rank in range(config.workers_per_replica)
    ]
    for proc in procs:
        proc.start()
    try:
        got = sorted((results.get(timeout=timeout) for _ in procs), key=lambda r: r.rank)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return got


# ---- things a child process does before its worker starts (module-level: they are pickled by name) --
def small_micro_batches() -> None:
    """Let every MoE layer split its tokens in two micro-batches, however few (to test the overlap path)."""
    import workers.moe

    workers.moe.MIN_MICRO_BATCH_TOKENS = 1


def emulated_fp8() -> None:
    """FP8 GEMMs on the CPU (``fp8_emulation``'s stand-ins), and a worker that believes it has them."""
    import fp8_emulation
    import workers.worker

    fp8_emulation.install()
    workers.worker.fp8_gemm_supported = lambda device: True
    small_micro_batches()
