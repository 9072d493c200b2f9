"""KV memory budget of a decode engine, counted in fixed-size blocks. Pure bookkeeping.

A sequence reserves blocks for all the positions it may ever need (prompt + max_tokens)
when it is admitted, so a running sequence never runs out of KV memory mid-stream and
never has to be preempted; what it does not use comes back when it finishes.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._held: dict[str, int] = {}  # request_id -> blocks reserved
        self.num_free_blocks = num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_ever_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int) -> None:
        assert request_id not in self._held, f"{request_id} already holds blocks"
        n = self.blocks_needed(num_tokens)
        assert n <= self.num_free_blocks, "allocate() without can_allocate()"
        self._held[request_id] = n
        self.num_free_blocks -= n

    def free(self, request_id: str) -> None:
        self.num_free_blocks += self._held.pop(request_id, 0)
