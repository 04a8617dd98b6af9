"""The KV blocks of one replica, owned by the driver, and the prefix cache over them.

The driver decides which blocks every request's rows go to (as vLLM's scheduler does) and sends the
block tables with a request's first chunk (``workers.batch_io.ChunkPiece.block_table``); the workers
only write and read where they are told. That makes the driver's accounting exact, and lets blocks
be shared.

Prefix cache. A full block of a prompt is named by a hash chained over its parent block's hash and
its token ids, the first block's parent being the pool's identity (model fingerprint, dtype, weight
format, block size): equal names mean equal tokens at equal positions of the same model, so equal
KV rows. A request's full blocks are named once their rows are written, after each of its chunks (a
block still being written is never found; requests in the same batch do not share). A later request takes its longest run of named blocks from its first
(``cached_tokens``) and prefills the rest against them as context, the chunked-context path. Under
PCP, block ``j`` of a request lives on PCP rank ``j % pcp`` (the striping of ``workers.pcp_layout``),
so a prefix cached by one request is where another's attention needs it. A prompt that is cached
whole still computes its last block (at least its last token), for its logits; a partial block is
never named, never shared.

Blocks are reference counted: by each running request that uses them, and by a request whose KV is
kept for a handoff. A named block no request uses stays cached, in LRU order (a request's last block
first, so prefixes outlive their tails), and is evicted only when a request needs a block and no
free one is left. Admission counts what is really there: a request fits a replica when every PCP
rank has, among free and evictable blocks, the ones it needs beyond its cached prefix (which it
takes out of the evictable set).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from workers.kv_cache import blocks_for


def block_hashes(tokens: np.ndarray, block_size: int, identity: bytes) -> list[bytes]:
    """The chained names of a prompt's full blocks (16-byte BLAKE2b)."""
    ids = np.ascontiguousarray(tokens, dtype="<i4")
    names, parent = [], identity
    for j in range(len(ids) // block_size):
        parent = hashlib.blake2b(parent + ids[j * block_size : (j + 1) * block_size].tobytes(), digest_size=16).digest()
        names.append(parent)
    return names


def pool_identity(fingerprint: str, dtype: str, weights: str, block_size: int) -> bytes:
    """What a cached block's rows depend on besides its tokens: the root of every hash chain."""
    return hashlib.blake2b(f"mlapool|{fingerprint}|{dtype}|{weights}|{block_size}".encode(), digest_size=16).digest()


class BlockPool:
    """One PCP rank's blocks of a replica: free, in use (reference counted), or cached (named, unused, LRU)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a min-heap: low blocks first, so tables tend to be runs
        self._refs = [0] * num_blocks
        self._name_of: dict[int, bytes] = {}
        self._by_name: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # named blocks with no reference, least recent first
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks a request can be given: free ones and cached ones nobody uses."""
        return len(self._free) + len(self._lru)

    @property
    def cached(self) -> int:
        return len(self._lru)

    @property
    def in_use(self) -> int:
        return self.num_blocks - self.available

    def find(self, name: bytes) -> int | None:
        return self._by_name.get(name)

    def evictable(self, block: int) -> bool:
        return block in self._lru

    def share(self, block: int) -> None:
        """One more reference to a cached block."""
        self._lru.pop(block, None)
        self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks with one reference each: free ones first, then the least recently used
        cached ones (their names dropped)."""
        if count > self.available:
            raise RuntimeError(f"{count} blocks asked, {self.available} available")  # admission checks first
        blocks = []
        for _ in range(count):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, _ = self._lru.popitem(last=False)
                del self._by_name[self._name_of.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def name(self, block: int, name: bytes) -> None:
        """Name a block whose rows are complete (a no-op when it or another block has the name)."""
        if block not in self._name_of and name not in self._by_name:
            self._name_of[block] = name
            self._by_name[name] = block

    def drop(self, blocks: Sequence[int]) -> None:
        """One reference less to each block, in order: a named block left unused joins the LRU end."""
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, block
            if self._refs[block] == 0:
                if block in self._name_of:
                    self._lru[block] = None
                else:
                    heapq.heappush(self._free, block)


class PrefixCache:
    """A replica's blocks, one :class:`BlockPool` per PCP rank, and every admitted request's tables.
    ``enabled=False`` allocates the same way and never names a block (nothing is cached)."""

    def __init__(self, num_blocks: int, pcp: int, block_size: int, *, enabled: bool = True) -> None:
        self.ranks = [BlockPool(num_blocks) for _ in range(pcp)]
        self.pcp, self.block_size, self.enabled = pcp, block_size, enabled
        self.tables: dict[str, list[list[int]]] = {}  # request id -> its blocks on each PCP rank, in token order
        self.hit_tokens = 0  # prompt tokens taken from the cache, over admissions
        self.query_tokens = 0  # prompt tokens admitted

    def cached_tokens(self, names: Sequence[bytes], num_tokens: int) -> int:
        """The tokens of the longest cached prefix a request of ``num_tokens`` with block names
        ``names`` would take (full blocks, leaving at least its last token to compute)."""
        if not self.enabled:
            return 0
        hit = 0
        for j, name in enumerate(names):
            if self.ranks[j % self.pcp].find(name) is None:
                break
            hit += 1
        hit = min(hit, (num_tokens - 1) // self.block_size)
        return hit * self.block_size

    def admit(self, request_id: str, num_tokens: int, names: Sequence[bytes]) -> int | None:
        """Give a request its blocks: its cached prefix shared, new ones for the rest. Returns the
        cached tokens, or None when some PCP rank lacks the room (nothing is taken then)."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} already holds blocks on this replica")
        plan = self._plan(num_tokens, names)
        if plan is None:
            return None
        tables = []
        for pool, (reused, new) in zip(self.ranks, plan):
            for block in reused:
                pool.share(block)
            tables.append(reused + pool.allocate(new))
        self.tables[request_id] = tables
        hit = sum(len(reused) for reused, _ in plan) * self.block_size
        self.hit_tokens += hit
        self.query_tokens += num_tokens
        return hit

    def fits(self, num_tokens: int, names: Sequence[bytes]) -> bool:
        """Whether :meth:`admit` would take the request now."""
        return self._plan(num_tokens, names) is not None

    def _plan(self, num_tokens: int, names: Sequence[bytes]) -> list[tuple[list[int], int]] | None:
        """Per PCP rank, the cached blocks a request would share and how many new ones it needs; None
        when a rank's free and evictable blocks (less those it would share) are too few."""
        hit = self.cached_tokens(names, num_tokens) // self.block_size
        total = blocks_for(num_tokens, self.block_size)
        plan = []
        for rank, pool in enumerate(self.ranks):
            reused = [pool.find(names[j]) for j in range(rank, hit, self.pcp)]
            new = len(range(rank, total, self.pcp)) - len(reused)
            if new > pool.available - sum(pool.evictable(b) for b in reused):
                return None
            plan.append((reused, new))
        return plan

    def written(self, request_id: str, names: Sequence[bytes], first: int = 0) -> None:
        """A request's blocks ``first`` to ``first + len(names)`` are written (after one of its chunks):
        name them, so later prompts can share them."""
        tables = self.tables.get(request_id)
        if tables is None or not self.enabled:
            return
        for j, name in enumerate(names, start=first):
            rank = j % self.pcp
            self.ranks[rank].name(tables[rank][j // self.pcp], name)

    @property
    def evictions(self) -> int:
        return sum(p.evictions for p in self.ranks)

    def release(self, request_id: str) -> bool:
        """Drop a request's references (its last blocks first into the LRU); False if it held none."""
        tables = self.tables.pop(request_id, None)
        if tables is None:
            return False
        for pool, table in zip(self.ranks, tables):
            pool.drop(table[::-1])
        return True

    def report(self) -> dict:
        """Per PCP rank: blocks in use, cached (evictable) and free; evictions; the hit rate so far."""
        return {
            "blocks_in_use": [p.in_use for p in self.ranks],
            "blocks_cached": [p.cached for p in self.ranks],
            "blocks_free": [p.available - p.cached for p in self.ranks],
            "evictions": self.evictions,
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "hit_rate": round(self.hit_tokens / self.query_tokens, 4) if self.query_tokens else None,
        }
