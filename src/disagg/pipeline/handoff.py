"""The KV hand-off as the orchestrator sees it: how much of a prompt's K/V it may leave out,
and which path a payload took. No Triton, no torch.

Decode keeps the prompt and reply blocks of the sequences it ran (engine/prefix_cache.py), so
a conversation's next turn finds its earlier turns there. The orchestrator's record of that
(prefix_locality.py; across servers, the decode replica's own KV events followed by the
frontend: remote/cache_route.py) says how many leading prompt tokens decode probably holds;
the prefill pool still computes the whole prompt (its own prefix cache spares it what it
prefilled before), but packs only the positions after those. Decode copies the rest from its
cache when the hand-off arrives; if it no longer holds them (evicted, restarted, a guess made
by another orchestrator) it says so (KVPrefixMissError) and the orchestrator hands the whole
prompt off again (across servers, to the same replica): the prefill pool finds all of that
prompt's full blocks in its cache by then, so the second prefill computes only the last
partial block.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from disagg import contracts as C
from disagg.errors import KVPayloadError


def skip_tokens(num_cached_on_decode: int, num_prompt_tokens: int, block_size: int) -> int:
    """Leading prompt tokens a hand-off leaves out: whole blocks decode holds, and never the
    last token, which must travel (prefill samples the first token from its logits, and a
    payload holds at least one position)."""
    most = (num_prompt_tokens - 1) // block_size * block_size
    return max(min(num_cached_on_decode // block_size * block_size, most), 0)


def kv_path(payload: npt.NDArray[np.uint8]) -> tuple[str, int]:
    """(path, payload bytes moved) of a hand-off: "network" for a reference a decode server
    pulls from a prefill server (the bytes it names), "trtllm" for TensorRT-LLM's parameters
    (its transceiver moves the cache), "shm" for a payload passed within one server (in a
    shared-memory file it names, kvshm.py, or inline)."""
    from disagg.kvnet import KVRef
    from disagg.kvshm import ShmRef
    from disagg.trtllm.payload import is_trtllm_payload

    data = _bytes_of(payload)
    if (local := ShmRef.parse(data)) is not None:
        return "shm", local.nbytes
    ref = KVRef.parse(data)
    if ref is not None:
        return "network", ref.nbytes
    if is_trtllm_payload(data):
        return "trtllm", data.nbytes
    return "shm", data.nbytes


def release(payload: npt.NDArray[np.uint8]) -> bool:
    """Free a hand-off nobody will decode (its client left): a lease on a prefill server is
    dropped at once rather than after its TTL, and so is a shared-memory file (whether one
    was); a payload passed inline is freed when its last reference goes, which the caller
    lets go of."""
    from disagg.kvnet import release as drop_lease
    from disagg.kvshm import ShmRef, unlink

    try:  # (called where another error is on its way: this must not replace it)
        local = ShmRef.parse(_bytes_of(payload))
    except KVPayloadError:
        return False
    if local is not None:
        return unlink(local)
    return drop_lease(payload, C.internal_token())


def _bytes_of(payload: npt.NDArray[np.uint8]) -> memoryview:
    return np.ascontiguousarray(payload, np.uint8).reshape(-1).data
