"""Prefix caching: which KV blocks an engine keeps from finished work, found by content.

A full block of `block_size` tokens is named by a chained hash: its tokens, the hash of the
block before it, and a root that covers everything else that changes K/V (the model's
weights fingerprint, the compute dtype, the block size) and a per-tenant salt, so that one
API key's cached prompt never shortens another key's prefill (no timing side channel). Two
prompts that share their first n blocks share those n hashes, whatever follows.

Design (measured, docs/benchmarks.md "Prefix caching"): the decode engine keeps one
contiguous slot per running sequence, which its batched attention reads as a view with no
gather; a paged layout would add a gather (or a paged kernel) to every decode step. So
cached blocks live in a store of their own and are *copied* into a sequence's slot when it
is admitted (a 1,000-token prefix, 46 MB in fp32, copies in a few ms against ~1 s to prefill
it here), and a finished sequence's full blocks are copied out. Nothing running ever holds a
cached block, so evicting one (least recently used first) never stalls or fails a request;
the index is pinned only for the length of a copy.

This module is the index alone (plain numbers, no torch); `model.KVBlockStore` holds the
bytes, and block ids here are its rows.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

BlockHash = bytes


def root_hash(fingerprint: str, compute_dtype: str, block_size: int) -> BlockHash:
    """What every chain starts from: K/V differ when any of these differ."""
    text = f"disagg-prefix-v1|{fingerprint}|{compute_dtype}|{block_size}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def block_hashes(
    root: BlockHash, token_ids: Seq[int], block_size: int, salt: str = ""
) -> list[BlockHash]:
    """The chained hash of each *full* block of `token_ids` (a partial last block has none:
    its K/V would change as tokens are added)."""
    parent = root
    if salt:
        parent = hashlib.blake2b(parent + b"salt|" + salt.encode(), digest_size=16).digest()
    ids = np.asarray(token_ids, dtype=np.int64)
    out = []
    for i in range(len(ids) // block_size):
        chunk = ids[i * block_size : (i + 1) * block_size].tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass
class PrefixCacheStats:
    num_blocks: int  # capacity
    block_size: int  # tokens per block
    num_used_blocks: int = 0
    num_queried_tokens: int = 0  # prompt tokens looked up (full blocks only)
    num_hit_tokens: int = 0  # of those, found cached
    num_stored_blocks: int = 0
    num_evicted_blocks: int = 0

    @property
    def used_tokens(self) -> int:
        return self.num_used_blocks * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


# what a cache did, in order: ("stored" | "removed", the block hashes), for KV events
CacheEvent = Callable[[str, list[BlockHash]], None]
STORED, REMOVED = "stored", "removed"


class PrefixCache:
    """Block hash -> block id, least recently used first. Not thread-safe: one engine thread
    (or the engine's lock) uses it. `on_event`, when set, hears every block stored and
    evicted, in the order they happened (kvevents.py publishes them to frontends)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self._blocks: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pins: dict[int, int] = {}  # block id -> copies in progress
        self.stats = PrefixCacheStats(num_blocks, block_size)
        self.on_event: CacheEvent | None = None

    def match(self, hashes: Seq[BlockHash], *, count: bool = True) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`, pinned until `release`.
        Touched so the chain's first blocks are the last to go (a chain is useless past its
        first missing block)."""
        found = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            found.append(block)
        for h in reversed(hashes[: len(found)]):
            self._blocks.move_to_end(h)
        for b in found:
            self._pins[b] = self._pins.get(b, 0) + 1
        if count:
            self.stats.num_queried_tokens += len(hashes) * self.block_size
            self.stats.num_hit_tokens += len(found) * self.block_size
        return found

    def release(self, block_ids: Seq[int]) -> None:
        for b in block_ids:
            n = self._pins[b] - 1
            if n:
                self._pins[b] = n
            else:
                del self._pins[b]

    def allocate(self, hashes: Seq[BlockHash]) -> list[tuple[int, int]]:
        """Room for the blocks of `hashes` not cached yet: (index into hashes, block id) for
        each, to be written by the caller now; evicts the least recently used unpinned
        blocks. Blocks that find no room are skipped (and the ones after them: a chain with
        a hole is never matched past it)."""
        out = []
        events: list[tuple[str, BlockHash]] = []  # in order: an eviction may hit this chain
        for i, h in enumerate(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            block = self._take_block(events)
            if block is None:
                break
            self._blocks[h] = block
            out.append((i, block))
            events.append((STORED, h))
        self.stats.num_stored_blocks += len(out)
        self.stats.num_used_blocks = len(self._blocks)
        if self.on_event is not None:
            for kind, run in _runs(events):
                self.on_event(kind, run)
        return out

    def _take_block(self, events: list[tuple[str, BlockHash]]) -> int | None:
        if self._free:
            return self._free.pop()
        for h, block in self._blocks.items():  # oldest first
            if block not in self._pins:
                del self._blocks[h]
                self.stats.num_evicted_blocks += 1
                events.append((REMOVED, h))
                return block
        return None

    def hashes(self) -> list[BlockHash]:
        """Every block held now, least recently used first."""
        return list(self._blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)


def _runs(events: list[tuple[str, BlockHash]]) -> list[tuple[str, list[BlockHash]]]:
    """Consecutive events of one kind together, order kept."""
    out: list[tuple[str, list[BlockHash]]] = []
    for kind, h in events:
        if out and out[-1][0] == kind:
            out[-1][1].append(h)
        else:
            out.append((kind, [h]))
    return out
