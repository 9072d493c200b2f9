"""Which of this server's pools probably holds a prompt's leading K/V: the orchestrator's own
record of where it left each request's blocks, so the conditional mode sends a prompt to
the pool that would recompute less of it, and a hand-off leaves out the blocks decode holds
(pipeline/handoff.py). No Triton, no torch.

Each pool keeps a prefix cache of its own (engine/prefix_cache.py): the prefill pool keeps
the prompts it prefilled, decode the prompts and replies of the sequences it ran (handed
off or prefilled itself). The orchestrator sees every request, so it records the same
chained block hashes per pool, least recently used first, bounded by the pools' own budget.
It is an estimate: a pool evicts on its own, restarts, or is shared with other
orchestrator instances; a wrong guess costs only a prefill that finds less than expected,
or a partial hand-off that decode refuses and that is sent again whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from disagg.engine.prefix_cache import BlockHash, block_hashes, root_hash

PREFILL, DECODE = "prefill", "decode"


class PrefixLocality:
    def __init__(self, max_tokens: int, block_size: int = 16, track_decode: bool = True) -> None:
        """`track_decode` False: decode is several instances with caches of their own, and
        which one a request lands on is Triton's choice: nothing is assumed held there (a
        hand-off skipping blocks would miss on most of them)."""
        self.block_size = block_size
        self.track_decode = track_decode
        self.max_blocks = max_tokens // block_size
        self._root = root_hash("orchestrator-view", "", block_size)
        self._pools: dict[str, OrderedDict[BlockHash, None]] = {
            PREFILL: OrderedDict(),
            DECODE: OrderedDict(),
        }
        self._lock = threading.Lock()  # requests run on the orchestrator's thread pool

    def cached(self, token_ids: Sequence[int], salt: str) -> dict[str, int]:
        """Leading tokens of `token_ids` each pool probably holds (whole blocks)."""
        if self.max_blocks == 0:
            return {PREFILL: 0, DECODE: 0}
        hashes = block_hashes(self._root, token_ids, self.block_size, salt)
        out = {}
        with self._lock:
            for pool, blocks in self._pools.items():
                n = 0
                while n < len(hashes) and hashes[n] in blocks:
                    n += 1
                out[pool] = n * self.block_size
        return out

    def record(self, pool: str, token_ids: Sequence[int], salt: str) -> None:
        """`pool` now holds the full blocks of `token_ids` (most recently used)."""
        if self.max_blocks == 0 or (pool == DECODE and not self.track_decode):
            return
        hashes = block_hashes(self._root, token_ids, self.block_size, salt)
        with self._lock:
            blocks = self._pools[pool]
            for h in reversed(hashes):  # the chain's head last: the last to be evicted
                blocks[h] = None
                blocks.move_to_end(h)
            while len(blocks) > self.max_blocks:
                blocks.popitem(last=False)
