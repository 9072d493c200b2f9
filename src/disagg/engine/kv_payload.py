"""The portable KV cache payload: what prefill hands to decode, across processes or hosts.

Plain contiguous arrays plus metadata, so any transport can carry it: Triton tensors
(`to_tensors`/`from_tensors`), raw bytes (`to_bytes`/`from_bytes`), shared memory.
Import refuses a payload made for another model, another layout, or one damaged on the way.

A payload may hold a suffix of the prompt: positions [start, start + num_tokens), when decode
already holds the first `start` (whole blocks) in its prefix cache. Such a payload has layout
version 2, which a reader that predates `start` refuses rather than take it for a whole
prompt; a whole prompt's payload keeps version 1.

Byte format (little endian):
  magic b"DKV1" | u32 header length | header JSON (utf-8, space-padded) | K bytes | V bytes
The header carries the metadata below and a CRC32 of the K and V bytes. `pack` writes all
of it into one (reusable) uint8 array with a single copy of K and V.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from disagg.engine.config import ModelArgs
from disagg.errors import KVPayloadError

LAYOUT_VERSION = 1  # the whole prompt
PARTIAL_LAYOUT_VERSION = 2  # positions from `start` > 0 on
LAYOUT = "L,Hkv,S,D"  # axis order of k and v
MAGIC = b"DKV1"
HEADER_SPACE = 1024  # bytes reserved for magic + length + header JSON
_DTYPES = {"float32": np.float32}


@dataclass(frozen=True)
class KVPayload:
    fingerprint: str  # ModelArgs.fingerprint of the model that computed it
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int  # prompt positions held: start .. start + num_tokens - 1
    k: npt.NDArray[np.float32]  # [L, H_kv, S, D]
    v: npt.NDArray[np.float32]  # [L, H_kv, S, D]
    dtype: str = "float32"
    layout_version: int = LAYOUT_VERSION
    start: int = 0  # the first prompt position held (decode's prefix cache has those before)

    @classmethod
    def from_arrays(
        cls,
        args: ModelArgs,
        k: npt.NDArray[np.float32],
        v: npt.NDArray[np.float32],
        start: int = 0,
    ) -> KVPayload:
        """k, v: [L, H_kv, S, D] float32, possibly strided views (`pack` gathers them), of
        prompt positions start .. start + S - 1."""
        return cls(
            fingerprint=args.fingerprint,
            num_layers=args.n_layers,
            num_kv_heads=args.n_kv_heads,
            head_dim=args.head_dim,
            num_tokens=k.shape[2],
            k=k,
            v=v,
            layout_version=PARTIAL_LAYOUT_VERSION if start else LAYOUT_VERSION,
            start=start,
        )

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt this payload belongs to: its positions and those before `start`."""
        return self.start + self.num_tokens

    def with_prefix(self, k: npt.NDArray[np.float32], v: npt.NDArray[np.float32]) -> KVPayload:
        """The whole prompt's payload: k, v ([L, H_kv, start, D]) of positions 0 .. start - 1
        before this payload's (one copy of each into new arrays)."""
        if k.shape[2] != self.start or v.shape != k.shape:
            raise KVPayloadError(
                f"a prefix of {k.shape[2]} positions for a payload from {self.start}"
            )
        whole = []
        for prefix, rest in ((k, self.k), (v, self.v)):
            out = np.empty((*rest.shape[:2], self.num_prompt_tokens, rest.shape[3]), np.float32)
            out[:, :, : self.start], out[:, :, self.start :] = prefix, rest
            whole.append(out)
        return dataclasses.replace(
            self,
            k=whole[0],
            v=whole[1],
            num_tokens=self.num_prompt_tokens,
            start=0,
            layout_version=LAYOUT_VERSION,
        )

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def metadata(self) -> dict[str, str | int]:
        return {
            "layout_version": self.layout_version,
            "layout": LAYOUT,
            "fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_tokens": self.num_tokens,
            "dtype": self.dtype,
            "start": self.start,
        }

    def check_compatible(self, args: ModelArgs) -> None:
        """Raise KVPayloadError unless this payload fits a model with `args`."""
        if self.layout_version not in (LAYOUT_VERSION, PARTIAL_LAYOUT_VERSION):
            raise KVPayloadError(
                f"KV payload layout version {self.layout_version}, expected {LAYOUT_VERSION} "
                f"or {PARTIAL_LAYOUT_VERSION}"
            )
        check_start(self.start)
        if (self.layout_version == PARTIAL_LAYOUT_VERSION) != (self.start > 0):
            raise KVPayloadError(
                f"KV payload layout version {self.layout_version} does not fit its start "
                f"{self.start} (version {PARTIAL_LAYOUT_VERSION} starts past position 0)"
            )
        if self.fingerprint != args.fingerprint:
            raise KVPayloadError(
                f"KV payload is for model {self.fingerprint[:12]!r}, this engine serves "
                f"{args.fingerprint[:12]!r}"
            )
        want = (args.n_layers, args.n_kv_heads, self.num_tokens, args.head_dim)
        for name, arr in (("k", self.k), ("v", self.v)):
            if arr.shape != want or arr.dtype != np.float32:
                raise KVPayloadError(
                    f"KV payload {name} is {arr.dtype}{list(arr.shape)}, "
                    f"expected float32{list(want)}"
                )
        if self.num_tokens < 1:
            raise KVPayloadError("KV payload holds no tokens")

    # ---------------------------------------------------------------- bytes

    def packed_size(self) -> int:
        return HEADER_SPACE + self.nbytes

    def pack(self, out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
        """The payload as a uint8 array, written into `out` (at least `packed_size()` bytes)
        if given. Returns a view of exactly the payload's bytes."""
        total = self.packed_size()
        buf = np.empty(total, np.uint8) if out is None else out[:total]
        n = self.k.nbytes
        body = buf[HEADER_SPACE:]
        body[:n].view(np.float32).reshape(self.k.shape)[...] = self.k
        body[n:].view(np.float32).reshape(self.v.shape)[...] = self.v
        header = json.dumps({**self.metadata(), "crc32": zlib.crc32(body.data)}).encode()
        room = HEADER_SPACE - 8
        if len(header) > room:
            raise KVPayloadError(f"KV payload header too long ({len(header)} bytes)")
        buf[:4] = np.frombuffer(MAGIC, np.uint8)
        buf[4:8] = np.frombuffer(struct.pack("<I", room), np.uint8)
        buf[8:HEADER_SPACE] = np.frombuffer(header.ljust(room), np.uint8)
        return buf

    def to_bytes(self) -> bytes:
        return self.pack().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> KVPayload:
        data = memoryview(data)
        if len(data) < 8 or bytes(data[:4]) != MAGIC:
            raise KVPayloadError("not a KV payload (bad magic)")
        (hlen,) = struct.unpack("<I", data[4:8])
        try:
            header = json.loads(bytes(data[8 : 8 + hlen]))
            shape = (
                header["num_layers"],
                header["num_kv_heads"],
                header["num_tokens"],
                header["head_dim"],
            )
            dtype = _DTYPES[header["dtype"]]
            start = header.get("start", 0)
        except (ValueError, KeyError, TypeError) as e:
            raise KVPayloadError(f"KV payload header unreadable: {e}") from e
        check_start(start)
        if header.get("layout") != LAYOUT:
            raise KVPayloadError(f"KV payload layout {header.get('layout')!r}, expected {LAYOUT}")
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        body = data[8 + hlen :]
        if len(body) != 2 * n:
            raise KVPayloadError(
                f"KV payload truncated: {len(body)} bytes of K/V, expected {2 * n}"
            )
        if zlib.crc32(body) != header.get("crc32"):
            raise KVPayloadError("KV payload corrupted (CRC mismatch)")
        k = np.frombuffer(body[:n], dtype=dtype).reshape(shape)
        v = np.frombuffer(body[n:], dtype=dtype).reshape(shape)
        return cls(
            fingerprint=header["fingerprint"],
            num_layers=shape[0],
            num_kv_heads=shape[1],
            num_tokens=shape[2],
            head_dim=shape[3],
            k=k,
            v=v,
            dtype=header["dtype"],
            layout_version=header["layout_version"],
            start=start,
        )


def check_start(start: object, num_prompt_tokens: int | None = None, block_size: int = 1) -> None:
    """Raise KVPayloadError unless `start` can begin a payload: an int >= 0, a multiple of
    `block_size`, and (given the prompt's length) before its last token, which must travel:
    the first token is sampled from its logits, computed where it is prefilled."""
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise KVPayloadError(f"KV payload start must be an integer >= 0, got {start!r}")
    if start % block_size:
        raise KVPayloadError(
            f"KV payload start {start} is not a multiple of the block size {block_size}"
        )
    if num_prompt_tokens is not None and start >= num_prompt_tokens:
        raise KVPayloadError(
            f"KV payload start {start} leaves none of the prompt's {num_prompt_tokens} tokens"
        )
