"""The pool's requests and the queue that every replica's scheduler admits them from.

One queue for the whole pool, in arrival order. A replica's scheduler takes, oldest first, the
requests whose KV fits in *its* free blocks now, so a request that does not fit on one replica
runs on another that has room instead of waiting for the first. Younger requests may pass one
that fits nowhere yet, but only for ``STARVATION_S``: after that no replica admits anything
younger until it has run (its KV fits once enough is released), so a long prompt is never
starved by a stream of short ones. A request that has waited ``KV_WAIT_WARN_S`` for room is
logged once: room that never comes is usually KV kept for a receiver (``keep_kv``) and never released.

Prompts are checked here (:func:`validate_tokens`) before they join the queue, so a bad one fails
alone.

A request that failed with its replica comes back to the front and runs *alone* (a batch of its
own): a request that breaks its batch then cannot break another request's retry.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from configs.model import ModelConfig

STARVATION_S = 2.0  # how long younger requests may pass one whose KV fits no replica yet
KV_WAIT_WARN_S = 30.0  # a request waiting this long for KV room is logged (once)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    id: str
    tokens: np.ndarray
    future: Future
    keep_kv: bool
    on_progress: Callable[[int, int], None] | None
    names: list[bytes] = field(default_factory=list)  # its full blocks' chained hashes (cluster.prefix_cache); [] without the cache
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when its first chunk went to the workers (time.perf_counter)
    done: int = 0  # tokens prefilled so far (from cached_tokens on)
    cached_tokens: int = 0  # of its prompt, taken from the prefix cache of the replica that admitted it
    block_table: tuple[tuple[int, ...], ...] | None = None  # per PCP rank, from its admission
    attempts: int = 0  # batches of it that failed with their replica
    alone: bool = False  # runs in a batch of its own (a retry)
    blocked_since: float | None = None  # when a replica first found it did not fit
    blocked_s: float = 0.0  # how long it waited for KV room before a replica admitted it
    wait_logged: bool = False  # its wait for room passed KV_WAIT_WARN_S and was logged
    return_logits: bool = True  # its result carries its logits and last hidden row (else its first token only)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()


class RequestQueue:
    """Requests waiting for a replica, shared by every replica's scheduler (thread-safe)."""

    def __init__(self) -> None:
        self._items: deque[Request] = deque()
        self._changed = threading.Condition()
        self.closed = False

    def put(self, request: Request, *, front: bool = False) -> bool:
        """Queue a request (``front``: ahead of all); False once the queue is closed."""
        return self.put_many([request], front=front)

    def put_many(self, requests: Sequence[Request], *, front: bool = False) -> bool:
        """Queue requests together, in order (``front``: ahead of all): a scheduler sees all of them or
        none (it would start an idle replica's batch on the first alone when they came one by one);
        False once the queue is closed."""
        with self._changed:
            if self.closed:
                return False
            if front:
                self._items.extendleft(reversed(requests))
            else:
                self._items.extend(requests)
            self._changed.notify_all()
        return True

    def notify(self) -> None:
        """Wake the schedulers: KV was released, a request was cancelled, or the pool is stopping."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> list[Request]:
        """Stop admitting; returns the requests still waiting."""
        with self._changed:
            self.closed = True
            left = list(self._items)
            self._items.clear()
            self._changed.notify_all()
        return left

    def __len__(self) -> int:
        with self._changed:
            return len(self._items)

    def take(
        self, reserve: Callable[[Request], bool], budget: int, chunk_tokens: int, *, alone_ok: bool, timeout_s: float
    ) -> tuple[list[tuple[Request, int]], list[Request]]:
        """Admit requests into one replica's batch: ``(admitted, cancelled)``, ``admitted`` as
        ``(request, tokens of its first chunk)``.

        Scans in arrival order while the batch has ``budget`` tokens left; ``reserve(request)``
        reserves its KV blocks on the replica and says whether they fit. Stops at a retry (taken
        only when ``alone_ok``, and then by itself) and at a request that fits nowhere and has
        waited ``STARVATION_S``. Waits up to ``timeout_s`` for something to admit. Cancelled
        requests are dropped from the queue and returned for accounting."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                admitted, cancelled = self._scan(reserve, budget, chunk_tokens, alone_ok)
                remaining = deadline - time.monotonic()
                if admitted or cancelled or self.closed or remaining <= 0:
                    return admitted, cancelled
                self._changed.wait(remaining)

    def _scan(self, reserve, budget: int, chunk_tokens: int, alone_ok: bool):
        admitted, cancelled, now = [], [], time.monotonic()
        for request in list(self._items):
            if budget <= 0:
                break
            if request.cancelled:
                self._items.remove(request)
                cancelled.append(request)
                continue
            if request.alone:
                if alone_ok and not admitted and reserve(request):
                    self._items.remove(request)
                    admitted.append((request, min(chunk_tokens, request.remaining)))
                break  # nothing passes a retry: it runs next, by itself
            if reserve(request):
                self._items.remove(request)
                if request.blocked_since is not None:
                    request.blocked_s, request.blocked_since = now - request.blocked_since, None
                count = min(chunk_tokens, request.remaining, budget)
                admitted.append((request, count))
                budget -= count
                continue
            if request.blocked_since is None:
                request.blocked_since = now
                continue
            waited = now - request.blocked_since
            if waited > KV_WAIT_WARN_S and not request.wait_logged:
                request.wait_logged = True
                logger.warning(
                    "request %r (%d tokens) has waited %.0f s for room in a replica's KV cache: KV kept with keep_kv "
                    "stays until PrefillPool.release frees it (a KV server frees what no receiver claims within "
                    "its unclaimed_ttl_s)", request.id, len(request.tokens), waited,
                )  # fmt: skip
            if waited > STARVATION_S:
                break  # it has waited long enough: nothing younger passes it
        return admitted, cancelled


def _int_list(tokens) -> np.ndarray | None:
    """A list of Python ints as an int32 array, packed by ``struct`` in one C call without numpy's type
    inference: part of every submission's time, half that of reading them into an int64 ``array`` and
    narrowing it (16 prompts of 4K on the CPU machine: 0.78 against 1.56 ms; ``np.asarray``: 4.1 ms,
    ``2026-11-29-cpu-pool-parts-token-list-admission.json``). Read-only, over bytes of its own. None for
    anything else (not a list, floats, nested lists, bools first, outside int32), which ``np.asarray``
    then takes, so that its checks name what is wrong."""
    if type(tokens) is not list or (tokens and type(tokens[0]) is bool):
        return None
    try:
        return np.frombuffer(struct.pack(f"={len(tokens)}i", *tokens), dtype=np.int32)
    except struct.error:
        return None


def check_flag(name: str, value) -> None:
    """A request option that must be a bool (``TypeError`` naming it and the value otherwise)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def validate_tokens(token_ids, model: ModelConfig) -> np.ndarray:
    """A prompt as the int32 array a request carries; ``TypeError``/``ValueError`` naming what is wrong
    (empty, not integers, not flat, longer than the model's positions, an id outside its vocabulary)."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.cpu().numpy()
    packed = _int_list(token_ids)
    array = np.asarray(token_ids) if packed is None else packed
    if array.size == 0:
        raise ValueError("empty prompt: a request needs at least one token id")
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {array.shape}")
    if array.size > model.max_position_embeddings:
        raise ValueError(f"prompt of {array.size} tokens exceeds {model.name}'s maximum of {model.max_position_embeddings} positions")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= model.vocab_size:
        raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {model.vocab_size})")
    return array.astype(np.int32) if packed is None else packed  # a copy of what the caller may still change
