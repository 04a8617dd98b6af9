"""Run the workers of one replica as plain processes (gloo, no Ray), prefill prompts chunk by chunk on
all of them, and collect what each returns: rank 0's logits and batch reports, every rank's KV shards
and MoE load.

The processes are forked from multiprocessing's fork server, which imported torch and the worker once
(its preload): on 2 cores four spawned processes took 7-8 s to start, importing them each, and four
forked from the server 0.07 s. Like spawned ones they start from a clean state, not from a copy of the
test process; they inherit the server's environment, taken when the suite first uses it.
"""

import multiprocessing
import pickle
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
    ep_schedules: set  # the schedules of this rank's MoE layers
    fp8_gemm: str | None = None  # what ran its FP8 GEMMs (WorkerInfo.fp8_gemm)


def chunk_batches(prompts: list[np.ndarray], chunk: int, prefix: str = "r"):
    """The batches a worker runs for ``prompts`` all in flight: each batch takes the next chunk (at most
    ``chunk`` tokens) of every unfinished prompt, as request ``f"{prefix}{i}"``."""
    from workers.batch_io import ChunkPiece

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
            logits.update({r.request_id: out.logits(r) for r in out.results})
    kv = {f"r{i}": worker.fetch_kv(f"r{i}").tensor().float().numpy() for i in range(len(prompts))}
    schedules = {moe.schedule for _, moe in worker.model.moe_layers()}
    _put(results, RankResult(rank, logits, kv, strategies, worker.moe_load(), info.experts, schedules, info.fp8_gemm))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "workers.worker"])  # before the server starts; later calls do nothing
    return context


def run_workers(config, prompts: list[np.ndarray], chunk: int, *, prepare=None, timeout: float = 180) -> list[RankResult]:
    """``config.workers_per_replica`` processes; ``prepare`` (a module-level function) runs first in each."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_run_rank, args=(rank, config, port, prompts, chunk, results, prepare))
        for rank in range(config.workers_per_replica)
    ]
    for proc in procs:
        proc.start()
    try:
        got = sorted(_results_while_alive(results, procs, timeout), key=lambda r: r.rank)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return got


# ---- things a child process does before its worker starts (module-level: they are pickled by name) --
def emulated_fp8() -> None:
    """FP8 GEMMs on the CPU (``fp8_emulation``'s stand-ins), and a worker that believes it has them."""
    import fp8_emulation
    import workers.fp8_choice

    fp8_emulation.install()
    workers.fp8_choice.fp8_gemm_supported = lambda device: True


# ---- one MoE layer on every rank of an EP group -------------------------------------------------------
def moe_layer_ranks(config, hidden: int, tokens: list[int], *, timeout: float = 120) -> list[dict]:
    """One process per entry of ``tokens`` (gloo): each builds ``MoE(config)`` holding its share of the
    experts (``moe_layer_state(config, hidden)`` sliced) and runs every EP schedule on its own
    ``moe_layer_input(rank, n, hidden)``; returns each rank's ``{schedule: (routed, layer, pairs)}``
(:meth:`MoE.routed`, the whole layer, and the pairs its experts computed in both calls)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_moe_rank, args=(rank, tokens, config, hidden, port, results)) for rank in range(len(tokens))]
    for proc in procs:
        proc.start()
    try:
        got = dict(_results_while_alive(results, procs, timeout))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [got[rank] for rank in range(len(tokens))]


def moe_layer_state(config, hidden: int) -> dict:
    """Seeded weights of a whole MoE layer: the router with a correction bias, all routed experts and the
    shared experts (``config`` needs ``n_shared_experts``)."""
    gen = torch.Generator().manual_seed(11)
    e, width = config.n_routed_experts, config.moe_intermediate_size
    state = {
        "gate.weight": torch.randn(e, hidden, generator=gen) / hidden**0.5,
        "gate.e_score_correction_bias": torch.randn(e, generator=gen) * 0.5,
        "experts.gate_up_proj": torch.randn(e, 2 * width, hidden, generator=gen) / hidden**0.5,
        "experts.down_proj": torch.randn(e, hidden, width, generator=gen) / width**0.5,
    }
    shared = config.shared_intermediate_size
    for name, shape in (("gate_proj", (shared, hidden)), ("up_proj", (shared, hidden)), ("down_proj", (hidden, shared))):
        state[f"shared_experts.{name}.weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    return state


def moe_layer_input(rank: int, tokens: int, hidden: int) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(100 + rank))


def build_moe_layer(config, hidden: int, ep, schedule: str = "all-to-all"):
    """``workers.moe.MoE`` with float32 weights from :func:`moe_layer_state` (this EP rank's experts)."""
    from workers.model import DenseMLP
    from workers.moe import MoE

    kw = {"dtype": torch.float32, "device": "cpu"}
    moe = MoE(config, hidden, ep=ep, shared_experts=DenseMLP(hidden, config.shared_intermediate_size, **kw), schedule=schedule, **kw)
    local = ep.experts(config.n_routed_experts)
    state = moe_layer_state(config, hidden)
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        state[name] = state[name][local.start : local.stop]
    moe.load_state_dict(state)
    return moe


def _moe_rank(rank, tokens, config, hidden, port, results):
    import torch.distributed as dist

    from configs.model import EP_SCHEDULES
    from workers.expert_parallel import EPGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(tokens))
    ep = EPGroup(rank, len(tokens), dist.group.WORLD)
    x = moe_layer_input(rank, tokens[rank], hidden)
    out = {}
    with torch.no_grad():
        for schedule in EP_SCHEDULES:
            moe = build_moe_layer(config, hidden, ep, schedule)
            out[schedule] = (moe.routed(x), moe(x), moe.pairs)
    _put(results, (rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _put(results, value) -> None:
    """Send ``value`` by value. A tensor put on a multiprocessing queue as is travels as a file
    descriptor that the parent must fetch from this process's resource sharer, and that is gone once
    this process exits: a rank that finishes first would fail its parent's ``get``."""
    results.put(pickle.dumps(value))


def _results_while_alive(results, procs, timeout: float):
    """Each process's result; raises as soon as one exits without one (its traceback is on stderr)."""
    import queue
    import time

    deadline = time.monotonic() + timeout
    for _ in procs:
        while True:
            try:
                yield pickle.loads(results.get(timeout=1))
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]}) or timed out") from None
