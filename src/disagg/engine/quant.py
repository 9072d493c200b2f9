"""Serving a checkpoint's own block-quantized weights (GGUF Q4_0, Q4_1, Q8_0) on the CPU.

A `QuantLinear` keeps the blocks as the file has them (scales widened to fp32) and multiplies
fp32 activations with them through qmatmul.c: a decode step reads 0.75 byte a weight (Q4_1)
instead of 4, which is what bounds it. A row's result never depends on the other rows, at
any batch size. Beyond `DIRECT_ROWS` rows (prefill, long chunks) the work is compute bound
instead, and kernels.BlockLinear multiplies the same weights held dense (oneDNN).
`dequantize` gives the fp32 weights the blocks stand for (exactly gguf-py's: the tests'
reference).

The C file is compiled once per machine with the system's C compiler (cc -O3
-march=native, a second or two) into a cache directory, keyed by the source, the compiler
and the CPU's flags; where no compiler is found, `available()` says why and the engine serves
the dequantized fp32 weights instead (weights "auto").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from disagg.cpuinfo import NO_BF16, cpu_flags
from disagg.engine.config import ACTIVATIONS, QUANT_WEIGHTS_FILE
from disagg.errors import ConfigError

log = logging.getLogger("disagg.engine.quant")

GROUP = 32
DIRECT_ROWS = 64  # beyond: prefill's rows, multiplied by the dense fp32 weights (kernels.py)
# the same where decode never multiplies through kernels.linear (fused_decode: the blocks
# at any batch size): the dense copy is faster from ~8 rows on (a 64-token chunk 41 against
# 74 ms on a Zen 4, 2026-12-06; from 16 rows on an AVX2 EPYC: docs/benchmarks.md)
PROMPT_ROWS = 8
FORMATS = ("q4_0", "q4_1", "q8_0")
# fp32 activations (qmatmul.c), int8-quantized ones (qdot.c), bf16 arithmetic (qbf16.c)
_SOURCES = tuple(Path(__file__).with_name(n) for n in ("qmatmul.c", "qdot.c", "qbf16.c"))
_HEADERS = tuple(Path(__file__).with_name(n) for n in ("qbf16_panel.h", "prompt_keys.h"))
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class QuantLinear:
    """A weight [n, k] in blocks of 32: qs [n, k/32, 16] uint8 (4-bit) or [n, k/32, 32] int8,
    d and m [n, k/32] fp32 (m zeros for the formats without a minimum)."""

    fmt: str
    n: int
    k: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


def cache_dir() -> Path:
    base = os.environ.get("DISAGG_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "disagg", "kernels"
    )
    return Path(base)


# -ffp-contract=off: no fma the source does not write (the expansion matches gguf-py's)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def _compile(cc: list[str]) -> Path:
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
    parts = [
        *(f.read_text() for f in (*_SOURCES, *_HEADERS)),
        *cc,
        version,
        *FLAGS,
        cpu_flags() or os.uname().machine,
    ]
    key = hashlib.sha256("|".join([*parts, torch.__version__]).encode()).hexdigest()[:16]
    out = cache_dir() / f"qmatmul-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = FLAGS
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        run = subprocess.run(
            [*cc, *flags, *map(str, _SOURCES), "-o", str(tmp_out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if run.returncode != 0:
            raise OSError(f"{cc} failed: {run.stderr.strip()[-500:]}")
        os.replace(tmp_out, out)  # atomic: processes compiling at once agree
    return out


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernels, or why there are none."""
    cc = shlex.split(os.environ.get("CC", "")) or [
        c for c in (shutil.which("cc") or shutil.which("gcc"),) if c
    ]
    if not cc or shutil.which(cc[0]) is None:
        return "no C compiler (cc/gcc) on PATH to build engine/qmatmul.c"
    try:
        lib = ctypes.CDLL(str(_compile(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not build engine/qmatmul.c: {e}"
    lib.disagg_q4_matmul.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int]
    lib.disagg_q4_matmul.argtypes += [_i64, _ptr, ctypes.c_int]
    lib.disagg_q8_0_matmul.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_int]
    lib.disagg_q4_dequant.argtypes = [_ptr, _ptr, _ptr, ctypes.c_int, _i64, _i64, _ptr]
    lib.disagg_q4_dequant.argtypes += [ctypes.c_int]
    lib.disagg_q8_0_dequant.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, ctypes.c_int]
    f32 = ctypes.c_float
    lib.disagg_rms_norm.argtypes = [_ptr, _ptr, _i64, _i64, f32, _ptr, ctypes.c_int]
    lib.disagg_rope_store.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr]
    lib.disagg_rope_store.argtypes += [_ptr, _i64]
    lib.disagg_decode_attention.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]
    lib.disagg_decode_attention.argtypes += [_i64, f32, _ptr, _ptr, ctypes.c_int]
    lib.disagg_prompt_attention.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr]
    lib.disagg_prompt_attention.argtypes += [_ptr, _i64, f32, _ptr, _ptr, ctypes.c_int]
    lib.disagg_prompt_attention.argtypes += [ctypes.c_int]
    lib.disagg_prompt_scratch.argtypes = [_i64, _i64, _i64, _i64, ctypes.c_int]
    lib.disagg_prompt_scratch.restype = _i64
    lib.disagg_prompt_key_blocks.argtypes, lib.disagg_prompt_key_blocks.restype = [], ctypes.c_int
    lib.disagg_silu_mul.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int]
    lib.disagg_rope_rows.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, ctypes.c_int]
    lib.disagg_qdot_matmul.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int, _i64]
    lib.disagg_qdot_matmul.argtypes += [_ptr, ctypes.c_int]
    lib.disagg_qdot_quantize.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr]
    lib.disagg_qbf16_matmul.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int, _i64]
    lib.disagg_qbf16_matmul.argtypes += [_ptr, ctypes.c_int, ctypes.c_int]
    for f in _VOID_FUNCTIONS:
        getattr(lib, f).restype = None
    return lib


_VOID_FUNCTIONS = (
    "disagg_q4_matmul",
    "disagg_q8_0_matmul",
    "disagg_q4_dequant",
    "disagg_q8_0_dequant",
    "disagg_rms_norm",
    "disagg_rope_store",
    "disagg_decode_attention",
    "disagg_silu_mul",
    "disagg_rope_rows",
    "disagg_qdot_quantize",
)


def library() -> ctypes.CDLL:
    """The loaded kernels (ConfigError where they cannot be built)."""
    return _lib()


def available() -> str | None:
    """None where the block kernels run here, else why not."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def _lib() -> ctypes.CDLL:
    lib = _library()
    if isinstance(lib, str):
        raise ConfigError(f"quantized weights need the block kernels: {lib}")
    return lib


def simd() -> bool:
    """Whether the kernels were built with AVX2+FMA (else portable C, much slower)."""
    return bool(_lib().disagg_qmatmul_simd())


def bf16_simd() -> bool:
    """Whether bf16 block products run on the CPU's own bf16 instructions (AVX512-BF16); else
    only qbf16.c's portable reference, far too slow to serve with."""
    return bool(_lib().disagg_qbf16_simd())


def bf16_amx() -> bool:
    """Whether bf16 rows run on AMX tiles (qlinear's `tiles`: qbf16.c)."""
    return bool(_lib().disagg_qbf16_amx())


def require_bf16() -> bool:
    """True where bf16 block products can serve, else a ConfigError saying why not."""
    if not bf16_simd():
        raise ConfigError(f"bfloat16 activations {NO_BF16}")
    return True


def from_blocks(
    fmt: str, qs: npt.NDArray[np.uint8], d: npt.NDArray[np.float32], m: npt.NDArray[np.float32]
) -> QuantLinear:
    """qs [n, k/32, 16 or 32] bytes, d/m [n, k/32]: what engine/build.py stores."""
    if fmt not in FORMATS:
        raise ConfigError(f"quantized format must be one of {FORMATS}, got {fmt!r}")
    n, ng = d.shape
    width = 32 if fmt == "q8_0" else 16
    if qs.shape != (n, ng, width) or m.shape != (n, ng):
        raise ConfigError(f"{fmt} blocks of shapes {qs.shape}/{d.shape}/{m.shape} do not agree")
    q = torch.from_numpy(np.ascontiguousarray(qs))
    if fmt == "q8_0":
        q = q.view(torch.int8)
    return QuantLinear(
        fmt,
        n,
        ng * GROUP,
        q,
        torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32)),
    )


def cat_rows(parts: list[QuantLinear]) -> QuantLinear:
    """Weights stacked along n (fused QKV, gate+up), all of one format and k."""
    if len({(p.fmt, p.k) for p in parts}) != 1:
        raise ConfigError("fused weights must share one quantized format and input size")
    p0 = parts[0]
    cat = [torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "m")]
    return QuantLinear(p0.fmt, sum(p.n for p in parts), p0.k, *cat)


def dequantize(w: QuantLinear) -> torch.Tensor:
    """The fp32 weight [n, k] the blocks stand for."""
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    threads = torch.get_num_threads()
    if w.fmt == "q8_0":
        _lib().disagg_q8_0_dequant(
            w.qs.data_ptr(), w.d.data_ptr(), w.n, w.k, out.data_ptr(), threads
        )
    else:
        zero = 8 if w.fmt == "q4_0" else 0
        _lib().disagg_q4_dequant(
            w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), zero, w.n, w.k, out.data_ptr(), threads
        )
    return out


def qlinear(
    x: torch.Tensor,
    w: QuantLinear,
    activations: str = "float32",
    portable: bool = False,
    tiles: bool = False,
    panels: bool = True,
) -> torch.Tensor:
    """x [M, k] fp32 -> x @ W.T [M, n] fp32, any M (a row's result never depends on M).
    `activations` "float32": fp32 activations against the expanded weights (qmatmul.c);
    "int8": each row quantized per group of 32 to int8 first and multiplied in integers
    (qdot.c, llama.cpp's scheme); "bfloat16": rows and weights rounded to bf16, products
    summed in fp32 (qbf16.c; `portable` runs its reference path even where the CPU has
    AVX512-BF16; `tiles`: on AMX tiles where the CPU has them, as the engine multiplies
    every bf16 row; without it the AVX512-BF16 lanes, the tests' and benchmarks' other side;
    `panels` False: prompt rows on the lanes' per-output accumulators instead of weight panels,
    the same bits more slowly, for benchmarks/prompt_panels_bench.py's A/B)."""
    rows = x.shape[0]
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[1] != w.k:
        raise ValueError(f"qlinear: x {tuple(x.shape)} {x.dtype} against weight [{w.n}, {w.k}]")
    y = torch.empty(rows, w.n, dtype=torch.float32)
    threads = torch.get_num_threads()
    lib = _lib()
    if activations in ("int8", "bfloat16"):
        fmt = FORMATS.index(w.fmt)  # qdot.c's and qbf16.c's enum: 0 q4_0, 1 q4_1, 2 q8_0
        args = (x.data_ptr(), rows, w.k, w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), fmt)
        if activations == "int8":
            failed = lib.disagg_qdot_matmul(*args, w.n, y.data_ptr(), threads)
        else:
            flags = int(portable) | 2 * int(tiles) | 4 * int(not panels)  # qbf16.c's flags
            failed = lib.disagg_qbf16_matmul(*args, w.n, y.data_ptr(), threads, flags)
        if failed == -2:
            raise ValueError(f"qlinear: {activations} blocks need k a multiple of {GROUP}")
        if failed:
            raise MemoryError(f"qlinear: no scratch for {rows} x {w.k} {activations} activations")
        return y
    if activations != "float32":
        raise ValueError(f"qlinear: activations must be one of {ACTIVATIONS}, got {activations!r}")
    if w.fmt == "q8_0":
        lib.disagg_q8_0_matmul(
            x.data_ptr(), rows, w.k, w.qs.data_ptr(), w.d.data_ptr(), w.n, y.data_ptr(), threads
        )
        return y
    lib.disagg_q4_matmul(
        x.data_ptr(),
        rows,
        w.k,
        w.qs.data_ptr(),
        w.d.data_ptr(),
        w.m.data_ptr(),
        8 if w.fmt == "q4_0" else 0,
        w.n,
        y.data_ptr(),
        threads,
    )
    return y


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `qlinear(activations="int8")` multiplies: x [M, k] -> qx [M, k] int8, dx and sx
    [M, k/32] (scale, scale * sum of the group's qx)."""
    x = x.contiguous().float()
    rows, k = x.shape
    qx = torch.empty(rows, k, dtype=torch.int8)
    dx, sx = torch.empty(rows, k // GROUP), torch.empty(rows, k // GROUP)
    _lib().disagg_qdot_quantize(x.data_ptr(), rows, k, qx.data_ptr(), dx.data_ptr(), sx.data_ptr())
    return qx, dx, sx


def load_blocks(engine_dir: str | Path) -> dict[str, QuantLinear] | None:
    """The engine's quantized blocks by tensor name, or None (with the reason logged) where
    it has none or the block kernels cannot run here."""
    from safetensors import safe_open

    path = Path(engine_dir) / QUANT_WEIGHTS_FILE
    if not path.is_file():
        log.info("%s: no quantized blocks; serving dense weights", engine_dir)
        return None
    if (why := available()) is not None:
        log.warning("serving dense fp32 weights, not the checkpoint's own blocks: %s", why)
        return None
    with safe_open(str(path), framework="numpy") as f:
        formats: dict[str, str] = json.loads((f.metadata() or {}).get("formats", "{}"))
        return {
            name: from_blocks(
                fmt,
                f.get_tensor(name + ".qs"),
                f.get_tensor(name + ".d"),
                f.get_tensor(name + ".m"),
            )
            for name, fmt in formats.items()
        }
