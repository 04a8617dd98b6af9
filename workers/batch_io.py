"""What a worker's batch takes and gives back, between the driver (``cluster.scheduler``) and
``workers.worker.PrefillWorker.prefill``: the chunk pieces it runs, and rank 0's results for the
requests it finished (their greedy next tokens, and the rows of those that ask, on the host)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ChunkPiece:
    """The next chunk of one request in a batch. ``total_len`` sizes the request's KV buffer. A
    request's first chunk carries its ``block_table``: per PCP rank, the blocks its rows go to
    (``cluster.prefix_cache``), the first ``context_len`` tokens' rows already there (a cached prefix).
    ``return_logits`` (read on a request's last chunk): its result carries its logits and last hidden
    row, not only its greedy next token."""

    request_id: str
    token_ids: np.ndarray  # int32 [n]
    context_len: int
    total_len: int
    block_table: tuple[tuple[int, ...], ...] | None = None
    return_logits: bool = True

    @property
    def is_last(self) -> bool:
        return self.context_len + len(self.token_ids) == self.total_len


@dataclass
class PieceResult:
    """A finished request of a batch: its greedy next token (the argmax of its float32 logits, the
    first maximal one) and, where its piece asked for them, its row of :attr:`BatchOutput.rows`."""

    request_id: str
    first_token: int
    row: int | None = None


@dataclass
class BatchOutput:
    """What rank 0 returns for a batch: its finished requests, in batch order; ``rows``, one array for
    all those that asked for their logits and last hidden row (``[k, vocab + hidden]`` float32, numpy
    rather than torch: Ray stores and fetches arrays as raw buffers), one buffer rather than two views
    per request (Ray stores and maps each buffer of a result on its own: 16 prompts' rows of V3's
    vocabulary took 8.8 against 6.8 ms through a Ray call on 2 CPU cores); the seconds rank 0 spent
    in the call (its forward and the results' copy to the host); and under PCP the context strategy
    used and the bytes one rank received for it (all layers)."""

    results: list[PieceResult]
    rows: np.ndarray
    vocab: int
    worker_s: float = 0.0
    pcp_strategy: str | None = None
    pcp_bytes: int = 0

    def logits(self, result: PieceResult) -> np.ndarray | None:
        """``result``'s ``[vocab]`` float32 logits, a view of :attr:`rows` (None: not asked for)."""
        return None if result.row is None else self.rows[result.row, : self.vocab]

    def last_hidden(self, result: PieceResult) -> np.ndarray | None:
        """``result``'s ``[hidden]`` float32 last hidden row, a view of :attr:`rows` (None: not asked for)."""
        return None if result.row is None else self.rows[result.row, self.vocab :]


def results_to_host(rows: torch.Tensor) -> np.ndarray:
    """A batch's result rows as a host array; from a GPU through pinned memory. 16 prompts' rows (their
    logits and last hidden rows, 8.7 MB) take 0.18 ms pinned on H200, against 0.76 ms into pageable
    pages met before and 8.1 ms into fresh ones (``2026-11-29-h200-results-to-host.json``); the layer
    profile of a 16x4K batch saw 5.2 ms of copies to pageable memory. The pinned buffer comes from
    torch's caching host allocator and is reused only once the arrays viewing it are gone (after Ray
    stored them), so a later batch never writes into an earlier batch's results."""
    if rows.device.type != "cuda":
        return rows.numpy()
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows)  # synchronous: the values are there on return
    return host.numpy()


def finished_results(
    pieces: Sequence[ChunkPiece], last: torch.Tensor, vocab: int, to_host: Callable[[torch.Tensor], np.ndarray] = results_to_host
) -> tuple[list[PieceResult], np.ndarray]:
    """The batch's finished requests: each one's greedy token, taken on ``last``'s device (a few
    bytes come back), and the rows of those whose piece asks, moved to the host by ``to_host`` in
    one copy. ``last``: ``[pieces, vocab + hidden]`` float32, each piece's logits then last hidden row."""
    finished = [i for i, piece in enumerate(pieces) if piece.is_last]
    wanted = [i for i in finished if pieces[i].return_logits]
    tokens = last[finished, :vocab].argmax(dim=1).tolist() if finished else []
    if not wanted:
        host = np.empty((0, last.shape[1]), dtype=np.float32)
    else:
        host = to_host(last if len(wanted) == len(pieces) else last[wanted])
    row = {i: j for j, i in enumerate(wanted)}
    return [PieceResult(pieces[i].request_id, token, row.get(i)) for i, token in zip(finished, tokens)], host
