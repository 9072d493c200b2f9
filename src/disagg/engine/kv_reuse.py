"""Prefix caching for an engine: the index (`prefix_cache.PrefixCache`) over the bytes
(`KVBlockStore`), copying cached blocks into a sequence's K/V and finished blocks out, and
in front of a partial hand-off's payload (`complete_handoff`). Why copies and not shared
pages: `prefix_cache.py`'s design note."""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from disagg.engine.config import EngineConfig, ModelArgs
from disagg.engine.kernels import CPU
from disagg.engine.kv_payload import KVPayload, check_start
from disagg.engine.model import KVCacheSlots
from disagg.engine.prefault import prefault_kv, zeros_kv
from disagg.engine.prefix_cache import (
    BlockHash,
    CacheEvent,
    PrefixCache,
    block_hashes,
    root_hash,
)
from disagg.errors import KVPayloadError, KVPrefixMissError

if TYPE_CHECKING:
    from disagg.engine.model import Llama
    from disagg.engine.sequence import SamplingParams, Sequence


class KVBlockStore:
    """Row b holds one cached block's K/V. k, v: [num_blocks, L, H_kv, block_size, D],
    calloc'd like the decode slots (a row costs memory once written), and like them given
    its pages in the background when `prefault` (engine/prefault.py): a decode step that
    keeps a finished 1,600-token sequence wrote 74 MB of fresh pages, and their faults
    took that step from ~40 to 120-260 ms on a busy 2-core box (docs/benchmarks.md)."""

    def __init__(
        self, args: ModelArgs, num_blocks: int, block_size: int, device: torch.device = CPU,
        prefault: bool = False,
    ) -> None:  # fmt: skip
        shape = (num_blocks, args.n_layers, args.n_kv_heads, block_size, args.head_dim)
        self.k, self.v = zeros_kv(shape, device)
        self.block_size = block_size
        self.prefaulted = prefault_kv(self.k, self.v, prefault)

    def load(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks one after another: k, v [L, H_kv, n * block_size, D]."""
        ids = torch.tensor(block_ids, device=self.k.device)
        _, layers, heads, bs, d = self.k.shape
        k, v = (
            t.index_select(0, ids).permute(1, 2, 0, 3, 4).reshape(layers, heads, -1, d)
            for t in (self.k, self.v)
        )
        return k, v

    def save(
        self, block_ids: list[int], positions: list[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store block positions[i] (tokens positions[i] * bs onwards) of k, v ([L, H_kv, S, D],
        a slot of the decode cache or a prefill's output) as row block_ids[i]."""
        bs = self.block_size
        for dst, src in ((self.k, k), (self.v, v)):
            same = dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
            d, s = (_host_view(dst), _host_view(src)) if same else (dst, src)  # else converts
            for block, pos in zip(block_ids, positions, strict=True):
                d[block] = s[:, :, pos * bs : (pos + 1) * bs]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _host_view(t: torch.Tensor) -> Any:
    """`t`'s memory as a numpy array of same-size integers (bf16 has no numpy dtype). Why:
    each torch copy of a block is a parallel region of torch's thread pool, and where the
    engine shares its cores with another process (a prefill beside decode) every region
    waits for a thread the scheduler has preempted: a 100-block save measured 17-40 ms
    through numpy (one thread, no barrier) against up to 1.6 s as 200 torch copies
    (benchmarks/store_save_bench.py)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


@dataclass(frozen=True)
class CacheHit:
    hashes: list[BlockHash]  # of the prompt's full blocks
    num_cached_tokens: int  # leading prompt tokens whose K/V came from the cache


class KVReuse:
    """One engine's prefix cache. Thread-safe: the engine's loop reads and writes it, and a
    decode engine's add_request (another thread) completes partial hand-offs from it."""

    def __init__(
        self, args: ModelArgs, compute_dtype: str, num_blocks: int, block_size: int,
        device: torch.device = CPU, prefault: bool = False,
    ) -> None:  # fmt: skip
        self.index = PrefixCache(num_blocks, block_size)
        self.store = KVBlockStore(args, num_blocks, block_size, device, prefault)
        self.block_size = block_size
        self._root = root_hash(args.fingerprint, compute_dtype, block_size)
        self._lock = threading.Lock()  # the index and the rows it names change together

    def hashes(self, token_ids: Seq[int], salt: str) -> list[BlockHash]:
        return block_hashes(self._root, token_ids, self.block_size, salt)

    @property
    def root(self) -> BlockHash:
        """What this cache's chains start from (a frontend hashes prompts from it)."""
        return self._root

    def publish(self, on_event: CacheEvent) -> None:
        """From now on every block stored or evicted goes to `on_event`, in order, called
        under this cache's lock (kvevents.py)."""
        with self._lock:
            self.index.on_event = on_event

    def snapshot(self, seq: Callable[[], int]) -> tuple[int, list[BlockHash]]:
        """(`seq()`, every block held) at one instant: no event falls between the two."""
        with self._lock:
            return seq(), self.index.hashes()

    def load_prompt(
        self, prompt_ids: Seq[int], salt: str, cache: KVCacheSlots, slot: int
    ) -> CacheHit:
        """Copy the prompt's longest cached prefix into positions 0.. of `slot`."""
        with self._lock:
            hashes, found = self._match(prompt_ids, salt, count=True)
            try:
                if found:
                    k, v = self.store.load(found)
                    cache.write(slot, k, v)
            finally:
                self.index.release(found)
        return CacheHit(hashes, len(found) * self.block_size)

    def load_prefix(self, kv: KVPayload, prompt_ids: Seq[int], salt: str) -> KVPayload:
        """`kv` (prompt positions start.. of `prompt_ids`) as the whole prompt's payload, its
        first `kv.start` positions copied from this cache now: whatever the cache evicts
        later, the result stays whole. Raises KVPrefixMissError if any block is missing."""
        check_start(kv.start, len(prompt_ids), self.block_size)
        with self._lock:
            hashes = self.hashes(prompt_ids[: kv.start], salt)
            found = self.index.match(hashes)
            try:
                if len(found) < len(hashes):
                    raise KVPrefixMissError(
                        f"decode's prefix cache holds {len(found) * self.block_size} of the "
                        f"{kv.start} leading prompt tokens the KV hand-off left out"
                    )
                k, v = self.store.load(found)  # copies: the rows may be reused after release
            finally:
                self.index.release(found)
        return kv.with_prefix(k.cpu().numpy(), v.cpu().numpy())

    def peek(self, seq: Sequence) -> int:
        """How many prompt tokens `load_prompt` would copy now (counted in no statistic)."""
        with self._lock:
            _, found = self._match(seq.prompt_ids, seq.params.cache_salt, count=False)
            self.index.release(found)
        return len(found) * self.block_size

    def _match(
        self, prompt_ids: Seq[int], salt: str, count: bool
    ) -> tuple[list[BlockHash], list[int]]:
        """(the prompt's block hashes, the cached blocks of its longest prefix, pinned). At
        least the last prompt token is left to compute: its logits give the first token."""
        hashes = self.hashes(prompt_ids, salt)
        usable = (len(prompt_ids) - 1) // self.block_size
        return hashes, self.index.match(hashes[:usable], count=count)

    def keep(self, seq: Sequence, cache: KVCacheSlots) -> None:
        """Keep the full blocks of a running sequence decode prefilled (prompt and output
        tokens whose K/V are in its slot)."""
        if seq.prompt_ids:  # [] for a sequence whose K/V came from the prefill pool
            tokens = (seq.prompt_ids + seq.output_ids)[: seq.num_cached_tokens]
            self.save(tokens, seq.params.cache_salt, cache.k[:, seq.slot], cache.v[:, seq.slot])

    def save(
        self, token_ids: Seq[int], salt: str, k: torch.Tensor, v: torch.Tensor,
        hashes: list[BlockHash] | None = None,
    ) -> int:  # fmt: skip
        """Keep the full blocks of `token_ids`, whose K/V are k, v[:, :, :len(token_ids)]
        ([L, H_kv, >= S, D]); returns how many blocks were new."""
        if hashes is None:
            hashes = self.hashes(token_ids, salt)
        with self._lock:
            placed = self.index.allocate(hashes)
            if placed:
                self.store.save([b for _, b in placed], [i for i, _ in placed], k, v)
        return len(placed)


def complete_handoff(
    reuse: KVReuse | None, kv: KVPayload, prompt_ids: Seq[int] | None, params: SamplingParams
) -> KVPayload:
    """A hand-off's payload as the whole prompt's: a partial one (kv.start > 0) gets its
    first positions from decode's prefix cache `reuse` (None: it keeps none), in the
    request's namespace, found by the prompt ids the decode call carries."""
    if not kv.start:
        return kv
    if prompt_ids is None or len(prompt_ids) != kv.num_prompt_tokens:
        given = "none" if prompt_ids is None else len(prompt_ids)
        raise KVPayloadError(
            f"a KV payload from position {kv.start} needs the {kv.num_prompt_tokens} prompt "
            f"ids it continues, got {given}"
        )
    if reuse is None or not params.use_cache:
        raise KVPrefixMissError("this decode engine keeps no prefix cache for the request")
    return reuse.load_prefix(kv, prompt_ids, params.cache_salt)


def kv_reuse_for(model: Llama, config: EngineConfig) -> KVReuse | None:
    """The prefix cache `config` asks for (None: off)."""
    if config.num_prefix_cache_blocks == 0:
        return None
    # K/V differ with what the matmuls read and how they multiply ("q4_1+q8_0/bfloat16")
    acts = "" if model.activations == "float32" else "/" + model.activations
    return KVReuse(
        model.args, model.weights + acts, config.num_prefix_cache_blocks, config.block_size,
        model.device, config.prefault_kv,
    )  # fmt: skip
