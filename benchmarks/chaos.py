"""Chaos run: a prefill pool of two replicas under a steady stream of requests while a seeded
schedule breaks things, and an account of every request at the end.

The same ``--requests`` prompts (mixed lengths, several chunks for most) run twice on one pool:
once without faults (the reference), then as a stream (at most ``--in-flight`` at a time) while
the schedule, drawn from ``--seed``:

- arms worker faults inside a batch (``PrefillWorker.inject_fault``: a rank exits or raises at
  the start of a layer, while its peers are in that layer's collectives),
- cancels requests at random moments after their submission,
- hands kept requests' KV off: to a ``KVReceiver`` outside the cluster (admitted by the
  ``KVServer``, it takes the blocks from the holders into the decode device by TCP pulls, by
  mapping the holders' caches (``mapped``) or, where NIXL is installed, NIXL READs), or to a
  ``DecodeActor`` that pulls it from the holders; some TCP receivers drop
  the connection mid-frame and some decode actors die mid-pull (then a fresh actor pulls the
  KV again, as do other handoffs that were pulling through the dying actor).

At the end every request must be accounted for exactly once: completed (its logits equal to the
reference run's), failed with a reason, or cancelled, and the pool's own counters must agree;
every handed-off KV equals the reference's; once kept KV is released every worker's free blocks
are back to capacity; no thread of the pool, KV server or link, and no actor, is left. The
summary is printed and written as JSON.

    python benchmarks/chaos.py --out benchmarks/results/chaos-cpu.json            # CPU (gloo)
    python benchmarks/chaos.py --device cuda --worker-gpus 0.5 --out ...          # 2 GPUs (NCCL): 2 replicas x TP=2

``tests/ray/test_chaos.py`` runs :func:`run_chaos` on the CPU as part of the suite. The decode
servers behind the OpenAI endpoint have a chaos run of their own: ``benchmarks/chaos_decode.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import ray
import torch

from cluster.handoff import DecodeActor
from cluster.kv_server import KVServer
from cluster.pool import PrefillPool
from configs.pool import PoolConfig
from kv.nixl import nixl_unavailable
from kv.receiver import KVReceiver
from kv.frames import expect, read_frame, send_frame
from workers.worker import SAFE_NCCL_ENV

from machine import machine  # benchmarks/machine.py

# logits and KV agreement with the reference run, relative to the largest magnitude (as mlapool --verify)
RTOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
THREAD_PREFIXES = ("mlapool", "kv-link")


def chaos_config(device: str = "cpu", worker_gpus: float = 1.0, **overrides) -> PoolConfig:
    """Two replicas of TP=2 of the tiny model, small chunks (most prompts take several batches), spare
    workers on: as the default keeps them with GPUs, and on the CPU too, so that the suite's run has them."""
    base = dict(
        model="tiny", num_layers=3, tp=2, replicas=2, chunk_tokens=64, max_batch_tokens=256, block_size=16,
        kv_cache_tokens=8192, collective_timeout_s=5.0, device=device, seed=7, spare_workers="on",
        worker_cpus=0.25 if device == "cpu" else 1.0, worker_gpus=worker_gpus,
    )  # fmt: skip
    return PoolConfig(**{**base, **overrides})


def plan(requests: int, seed: int, max_len: int, vocab: int, nixl: bool = False) -> dict:
    """The seeded workload and fault schedule: of the kept requests, half go to decode actors, the others
to receivers outside the cluster over TCP, mapped (the holders' caches mapped into the receiver) and,
with ``nixl``, NIXL READs."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_len) for _ in range(requests)]
    prompts = [np.array([rng.randrange(vocab) for _ in range(n)], dtype=np.int32) for n in lengths]
    kept = sorted(rng.sample(range(requests), requests * 3 // 10))
    kinds = ("actor", "tcp", "actor", "mapped") + (("actor", "nixl") if nixl else ())
    handoff = {i: kinds[k % len(kinds)] for k, i in enumerate(kept)}
    outside, actor = [i for i in kept if handoff[i] != "actor"], [i for i in kept if handoff[i] == "actor"]
    drops = set(rng.sample(outside, min(3, len(outside))))  # these receivers pull over TCP and drop mid-frame
    decode_kills = set(rng.sample(actor, min(4, len(actor))))  # four: a kill whose KV a worker fault took first has none to pull again
    others = [i for i in range(requests) if i not in drops and i not in decode_kills]
    cancels = {i: rng.uniform(0.0, 0.3) for i in rng.sample(others, requests // 10)}
    faults = []  # (submission index, replica, rank, kind, layer)
    for k, at in enumerate(np.linspace(requests * 0.15, requests * 0.75, 4).astype(int)):
        faults.append((int(at), k % 2, rng.randrange(2), ("exit", "raise", "exit", "raise")[k], rng.randrange(3)))
    return {"prompts": prompts, "handoff": handoff, "drops": drops, "decode_kills": decode_kills, "cancels": cancels, "faults": faults}


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return a.shape == b.shape and float((a.float() - b.float()).abs().max()) <= rtol * max(float(b.float().abs().max()), 1e-6)


def _pool_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIXES))


def _alive_actors() -> int:
    """Actors the GCS lists as alive (works without the dashboard)."""
    return sum(actor["State"] == "ALIVE" for actor in ray._private.state.actors().values())


def _drop_mid_frame(server: KVServer, request_id: str) -> None:
    """A receiver that reads the begin frame and part of the first holder's first frame, then disconnects."""
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        send_frame(sock, "hello", {"request_id": request_id, "transports": ["tcp"]})
        tcp = expect(read_frame(sock, max_payload=0)[0], "begin")["shards"][0]["tcp"]
        with socket.create_connection((tcp["host"], tcp["port"]), timeout=30) as pull:
            send_frame(pull, "pull", {"request_id": request_id, "ticket": tcp["ticket"]})
            pull.recv(64)


def run_chaos(config: PoolConfig, *, requests: int = 200, seed: int = 0, in_flight: int = 16, max_len: int = 300,
              decode_options: dict | None = None, decode_device: str = "cpu", log=print) -> dict:  # fmt: skip
    """Run the reference pass and the chaos pass on one pool (Ray must be initialized); the
    summary (see the module docstring). ``decode_device``: where the decode actors and the outside
    receivers put the KV. Raises nothing for a broken invariant: the summary says
    ``ok`` and lists the ``violations``."""
    model_config = config.model_config()
    work = plan(requests, seed, max_len, model_config.vocab_size, nixl=nixl_unavailable() is None)
    prompts, handoff = work["prompts"], work["handoff"]
    decode_options = decode_options or {"num_cpus": 0.25}
    threads_before, actors_before = _pool_threads(), _alive_actors()
    violations: list[str] = []
    summary: dict = {"requests": requests, "seed": seed, "prompt_tokens": int(sum(len(p) for p in prompts))}
    started = time.perf_counter()
    with PrefillPool(config).start() as pool, KVServer(pool, ack_timeout_s=10.0, io_timeout_s=10.0) as server:
        rtol = RTOL[pool.worker_infos[0][0].dtype]
        # on the CPU: gloo links (auto would use Ray objects); on GPUs: auto (the actor shares GPU 0
        # with holders, so it pulls Ray objects: NCCL cannot link two processes on one GPU)
        transport = "p2p" if config.device == "cpu" else "auto"
        actors = []

        def make_decoder():
            actors.append(ray.remote(DecodeActor).options(**decode_options).remote(config, device=decode_device, transport=transport))
            return actors[-1]

        # ---- the reference: every prompt once, no faults; kept KV fetched and released
        ref_logits, ref_kv = {}, {}
        futures = [pool.submit(p, keep_kv=i in handoff, request_id=f"ref-{i}") for i, p in enumerate(prompts)]
        for i, future in enumerate(futures):
            result = future.result(timeout=600)
            ref_logits[i] = result.logits
            if i in handoff:
                ref_kv[i] = pool.fetch_kv(result)
                pool.release(result)
        summary["reference_s"] = round(time.perf_counter() - started, 2)
        base = pool.counts()

        # ---- the chaos pass
        chaos_started = time.perf_counter()
        outcomes: dict[int, tuple[str, object]] = {}
        handoffs: dict[int, str] = {}
        lock = threading.Lock()
        decoder = [make_decoder()]
        helpers = ThreadPoolExecutor(4, thread_name_prefix="chaos")
        injected = []

        def hand_off(i: int, result) -> None:
            rid = result.request_id
            try:
                if handoff[i] in ("tcp", "mapped", "nixl"):
                    if i in work["drops"]:
                        _drop_mid_frame(server, rid)
                        deadline = time.monotonic() + 30  # the server frees it: the transfer failed
                        while pool.kept_result(rid) is not None and time.monotonic() < deadline:
                            time.sleep(0.05)
                        handoffs[i] = "dropped, freed" if pool.kept_result(rid) is None else "dropped, still held"
                        return
                    # into the decode device, as a decode server's cache: a mapped copy reads GPU holders only into a GPU
                    receiver = KVReceiver(server.host, server.port, model_fingerprint=model_config.fingerprint(), transport=handoff[i],
                                          device=decode_device)  # fmt: skip
                    got = receiver.fetch(rid).rows().cpu()
                    handoffs[i] = handoff[i] if _close(got, ref_kv[i], rtol) else f"{handoff[i]}, KV differs"
                    return
                if i in work["decode_kills"]:
                    with lock:
                        doomed, decoder[0] = decoder[0], make_decoder()
                    ray.get(doomed.inject_fault.remote())
                    try:
                        ray.get(doomed.receive.remote(pool.kv_source(result)), timeout=120)
                        handoffs[i] = "decode actor survived its fault"
                        return
                    except ray.exceptions.RayActorError:
                        pass  # died mid-pull, as planned: the KV is still held; a fresh actor pulls it
                after_kill = i in work["decode_kills"]
                while True:
                    with lock:
                        actor = decoder[0]
                    try:
                        ray.get(actor.receive.remote(pool.kv_source(result)), timeout=120)
                        got = ray.get(actor.pop_kv.remote(rid))
                        break
                    except ray.exceptions.RayActorError:
                        # the actor another handoff's scheduled kill took down, during this pull or before its
                        # KV was popped: the KV is still held (released below, not by the actor)
                        with lock:
                            killed_beside = actor is not decoder[0]
                        if not killed_beside:  # (the schedule replaces the actor twice: this ends)
                            raise
                        after_kill = True
                pool.release(result)
                kind = "actor after a kill" if after_kill else "actor"
                handoffs[i] = kind if _close(got, ref_kv[i], rtol) else f"{kind}, KV differs"
            except Exception as exc:  # noqa: BLE001 -- recorded: a handoff that fails is accounted, then released
                # a worker fault replaced its replica (before or during the handoff): the KV went with it
                handoffs[i] = "lost with its replica" if pool.kv_lost(result) else f"failed: {type(exc).__name__}: {exc}"
                pool.release(result)

        def settle(i: int, future) -> None:
            try:
                result = future.result()
            except CancelledError:
                outcomes[i] = ("cancelled", None)
                return
            except Exception as exc:  # noqa: BLE001 -- a failed request is an outcome
                outcomes[i] = ("failed", str(exc))
                return
            outcomes[i] = ("completed", result)
            if i in handoff:
                helpers.submit(hand_off, i, result)

        faults = list(work["faults"])
        pending, gate = {}, threading.Semaphore(in_flight)
        for i, prompt in enumerate(prompts):
            while faults and faults[0][0] <= i:
                at, replica, rank, kind, layer = faults.pop(0)
                try:
                    pool.inject_fault(replica, rank, kind, layer)
                    injected.append({"at_request": at, "replica": replica, "rank": rank, "kind": kind, "layer": layer})
                except ray.exceptions.RayActorError:  # that replica is being replaced right now: try later
                    faults.insert(0, (at + 5, replica, rank, kind, layer))
                    break
            gate.acquire()
            future = pool.submit(prompt, keep_kv=i in handoff, request_id=f"chaos-{i}")
            future.add_done_callback(lambda f: gate.release())
            future.add_done_callback(lambda f, i=i: settle(i, f))
            pending[i] = future
            if i in work["cancels"]:
                threading.Timer(work["cancels"][i], future.cancel).start()
        for future in pending.values():
            try:
                future.exception(timeout=600)
            except CancelledError:
                pass
        time.sleep(0.5)  # cancellation timers and done callbacks
        helpers.shutdown(wait=True)
        summary["chaos_s"] = round(time.perf_counter() - chaos_started, 2)

        # ---- the account
        counts = {"completed": 0, "failed": 0, "cancelled": 0}
        mismatched, reasons = [], []
        for i in range(requests):
            if i not in outcomes:
                violations.append(f"request {i} has no outcome")
                continue
            kind, value = outcomes[i]
            counts[kind] += 1
            if kind == "completed" and not _close(value.logits, ref_logits[i], rtol):
                mismatched.append(i)
            if kind == "failed":
                reasons.append(value)
                if not value:
                    violations.append(f"request {i} failed without a reason")
        if mismatched:
            violations.append(f"logits differ from the reference for requests {mismatched}")
        pool_counts = pool.counts()
        delta = {k: pool_counts[k] - base[k] for k in ("completed", "failed", "cancelled")}
        if delta != counts:
            violations.append(f"the pool counted {delta}, the clients saw {counts}")
        fine = ("tcp", "mapped", "nixl", "actor", "actor after a kill", "dropped, freed", "lost with its replica")
        bad_handoffs = {i: h for i, h in handoffs.items() if h not in fine}
        expected_handoffs = {i for i in handoff if outcomes.get(i, ("",))[0] == "completed"}
        if set(handoffs) != expected_handoffs:
            violations.append(f"handoffs done for {sorted(set(handoffs))}, expected {sorted(expected_handoffs)}")
        if bad_handoffs:
            violations.append(f"bad handoffs: {bad_handoffs}")
        for result in pool.kept_results():  # nothing should be left; release and report what was
            violations.append(f"KV of {result.request_id} still kept at the end")
            pool.release(result)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # releases are asynchronous actor calls; a replica may still be replaced
            health = pool.health()
            if all(w["ready"] and not w["kv_requests"] for replica in health for w in replica):
                break
            time.sleep(0.2)
        free = [[w["kv_free_blocks"] for w in replica] for replica in health]
        capacity = [[i.kv_blocks for i in replica] for replica in pool.worker_infos]
        leaked_blocks = sum(c - f for fr, cr in zip(free, capacity) for f, c in zip(fr, cr))
        if leaked_blocks:
            violations.append(f"{leaked_blocks} KV blocks leaked: free {free}, capacity {capacity}")
        recoveries = [r.as_dict() for r in pool.stats.recoveries]
        for actor in actors:  # dead ones included: killing them again is harmless
            ray.kill(actor)
    time.sleep(1.0)  # killed actors leave the GCS's ALIVE list asynchronously
    deadline = time.monotonic() + 30
    while (_alive_actors() > actors_before or _pool_threads() != threads_before) and time.monotonic() < deadline:
        time.sleep(0.25)
    leaked_actors, leaked_threads = _alive_actors() - actors_before, sorted(set(_pool_threads()) - set(threads_before))
    if leaked_actors > 0:
        violations.append(f"{leaked_actors} actor(s) still alive after shutdown")
    if leaked_threads:
        violations.append(f"threads left: {leaked_threads}")
    handoff_counts: dict[str, int] = {}
    for h in handoffs.values():
        handoff_counts[h] = handoff_counts.get(h, 0) + 1
    serving = [r["serving_s"] for r in recoveries if r["serving_s"] is not None]
    summary.update({
        "completed": counts["completed"], "failed": counts["failed"], "cancelled": counts["cancelled"],
        "retried": pool_counts["retried"] - base["retried"],
        "faults_injected": {"worker": len(injected), "decode_actor_kills": len(work["decode_kills"]),
                            "receiver_drops": len(work["drops"]), "cancels": len(work["cancels"])},
        "worker_faults": injected,
        "replica_recoveries": recoveries,
        "max_fault_to_serving_s": max(serving) if serving else None,
        "handoffs": handoff_counts,
        "failure_reasons": reasons,
        "leaked_blocks": leaked_blocks, "leaked_actors": max(leaked_actors, 0), "leaked_threads": leaked_threads,
        "violations": violations,
        "ok": not violations,
    })  # fmt: skip
    log(json.dumps({k: v for k, v in summary.items() if k not in ("worker_faults", "replica_recoveries")}, indent=1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--worker-gpus", type=float, default=0.5, help="GPUs per worker on cuda (0.5: 2 replicas x TP=2 on 2 GPUs)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.update(SAFE_NCCL_ENV)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 4
    ray.init(num_cpus=max(os.cpu_count() or 2, 4), num_gpus=gpus, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": dict(SAFE_NCCL_ENV)})  # fmt: skip
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = chaos_config(args.device, args.worker_gpus if args.device == "cuda" else 1.0)
    decode = {"num_cpus": 0.25} if args.device == "cpu" else {"num_cpus": 1, "num_gpus": 0}
    summary = run_chaos(config, requests=args.requests, seed=args.seed, decode_options=decode,
                        decode_device="cpu" if args.device == "cpu" else "cuda:0")  # fmt: skip
    summary.update({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(("ray", "flash_attn")),
        "pool": {"replicas": config.replicas, "tp": config.tp, "device": config.device, "worker_gpus": config.worker_gpus,
                 "model": config.model, "num_layers": config.num_layers, "chunk_tokens": config.chunk_tokens},
    })  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    ray.shutdown()
    raise SystemExit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
