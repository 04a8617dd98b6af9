"""A vLLM logits processor: a decode server's first token of a request is the one the tier sampled.

    vllm serve /ckpt/DeepSeek-V3 --kv-transfer-config '...MlapoolConnector...' \\
        --logits-processors kv.vllm_first_token:TierFirstToken

The tier's OpenAI endpoint sends a streamed request to vLLM as soon as its prefill is submitted (with
a ticket issued ahead, ``cluster.kv_server``), not once the first token is sampled: vLLM's API server
and engine take the request in (parsing 32K token ids, hashing its blocks, allocating them: 19-26 ms
of the second token's wait at 32K on an H200 host when they followed the first token) while the pool
prefills. vLLM then loads the prompt's rows and computes its last token itself, so it samples a first
token of its own; the tier has already sent its own to the client, sampled from the prefill's logits
(``cluster.first_token``), and the answer must go on from that one. The KV server sends the tier's
token with the load's ``done`` frame; the connector's worker half (``kv.vllm_connector``) files it
here under the ticket's request, and this processor, which sees the request's ``kv_transfer_params``
among its sampling parameters, makes that token the only one possible at the request's first sampled
position (every other logit -inf), so that greedy and seeded sampling alike give it. The token's row and
the next ones are then vLLM's own computation over the loaded KV, as with any first token.

vLLM's connector API has no way to hand a token to the sampler, and its per-request ``logit_bias`` or
``allowed_token_ids`` are fixed when the request arrives (before the token exists) and hold for every
position, hence a processor. The cost: vLLM keeps every request's output ids current for custom
processors, which under async scheduling waits for the previous step's sampled ids before sampling.

A request whose ticket does not ask for it, or whose token never came (the load failed before ``done``:
vLLM recomputes the prompt and samples its own), is sampled as vLLM would. The tier checks the token
vLLM generates first against its own and, if they differ (this processor not loaded, or no token),
sends the prompt followed by its token to a decode server instead (``cluster.decode_answer``).
Not available with speculative decoding: vLLM refuses custom logits processors there (the tier is
then run with ``ServeConfig.decode_forward: after_first_token``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

TICKET_FLAG = "first_token"  # a ticket (kv_transfer_params["mlapool"]) whose request takes the tier's first token
KEEP_S = 600.0  # a filed token whose request never sampled (aborted first) is dropped after this long


class FiledTokens:
    """The tier's first tokens as the loads bring them, by the tier's request id, in one vLLM worker
    process: the connector's worker half files them, the processor reads them and drops each once its
    request has sampled (a token never used goes after ``KEEP_S``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[int, float]] = {}

    def file(self, request_id: str, token: int) -> None:
        now = time.monotonic()
        with self._lock:
            for stale in [key for key, (_, at) in self._tokens.items() if now - at > KEEP_S]:
                del self._tokens[stale]
            self._tokens[request_id] = (token, now)

    def get(self, request_id: str) -> int | None:
        with self._lock:
            entry = self._tokens.get(request_id)
        return None if entry is None else entry[0]

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._tokens.pop(request_id, None)


FILED = FiledTokens()


def tier_request(extra_args: dict[str, Any] | None) -> str | None:
    """The tier's request id of a request whose first token is the tier's (its ticket says so), or None."""
    params = (extra_args or {}).get("kv_transfer_params")
    ticket = params.get("mlapool") if isinstance(params, dict) else None
    if isinstance(ticket, dict) and ticket.get(TICKET_FLAG) is True and isinstance(ticket.get("request_id"), str):
        return ticket["request_id"]
    return None


class TierFirstToken(LogitsProcessor):
    """Sets the batch rows of requests at their first sampled position to the tier's token (when filed)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.waiting: dict[int, tuple[str, list[int]]] = {}  # batch row -> (tier's request id, the request's output ids)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy requests' tokens too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.waiting.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            request_id = tier_request(params.extra_args)
            if request_id is not None and not output_ids:
                self.waiting[index] = (request_id, output_ids)
            else:
                self.waiting.pop(index, None)
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = self.waiting.pop(a, None), self.waiting.pop(b, None)
            if entry_a is not None:
                self.waiting[b] = entry_a
            if direction == MoveDirectionality.SWAP and entry_b is not None:
                self.waiting[a] = entry_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.waiting:
            return logits
        for index, (request_id, output_ids) in list(self.waiting.items()):
            if output_ids:  # sampled already (a chunked prefill's discarded samples leave it empty)
                del self.waiting[index]
                FILED.drop(request_id)
                continue
            token = FILED.get(request_id)  # kept until the request has sampled: a recomputed prompt's chunks sample and discard
            if token is None:
                continue  # no token (yet): vLLM samples; a recomputed prompt's last chunk may still find it
            logits[index].fill_(float("-inf"))
            logits[index, token] = 0.0
        return logits
