"""The linear kernels and precision choices the model runs on: oneDNN's packed linear on a
CPU that has it (plain `F.linear` elsewhere), batch invariant; fp32 or bf16 matmuls; devices.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.cpuinfo import cpu_flags
from disagg.engine.quant import DIRECT_ROWS, QuantLinear, qlinear
from disagg.errors import ConfigError

AMX_CAP = "AVX512_CORE_BF16"


def onednn_isa_cap(flags: str, environ: Mapping[str, str]) -> str | None:
    """The instruction set to cap oneDNN at, or None. On a CPU with AMX, oneDNN's bf16 GEMM
    takes AMX kernels for some row counts (seen on an H200 host's Xeon: 18 and more, even
    counts) and AVX512-BF16 ones for others, which round differently: a sequence's logits
    then depend on its batch. Capped at AVX512-BF16, every row count gives the same bits.
    DISAGG_ONEDNN_AMX=1 keeps AMX (faster bf16 prefill, no batch invariance); a cap the
    user set stays."""
    if "amx_bf16" not in flags.split():
        return None
    if "ONEDNN_MAX_CPU_ISA" in environ or "DNNL_MAX_CPU_ISA" in environ:  # (its older name)
        return None
    return None if environ.get("DISAGG_ONEDNN_AMX") == "1" else AMX_CAP


def cap_onednn_isa(environ: MutableMapping[str, str] = os.environ) -> None:
    """Apply onednn_isa_cap. oneDNN reads the cap once, at its first bf16 check or
    primitive: this module runs it on import, before any of ours (checked on that Xeon:
    set after `import torch` it holds, set after the first oneDNN call it is ignored)."""
    cap = onednn_isa_cap(cpu_flags(), environ)
    if cap is not None:
        environ["ONEDNN_MAX_CPU_ISA"] = cap


cap_onednn_isa()

HAS_ONEDNN = (
    torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch: unannotated
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


@dataclass(frozen=True)
class Linear:
    """A weight [out, in] in the layout `linear` reads fastest (oneDNN blocked on a CPU that
    has it, else as it is)."""

    weight: torch.Tensor
    pad_one_row: bool = False  # compute a single row as two rows (see `linear`)
    onednn: bool = False


@dataclass(frozen=True)
class BlockLinear:
    """A weight kept twice: in the checkpoint's quantized blocks, which decode steps read (a
    quarter of the bytes: those steps are bound by bytes), and as the fp32 weights those
    blocks stand for, packed, which prefill multiplies (compute bound: oneDNN's GEMM is about
    twice as fast as the fp32 block kernel there). Both give the same weights, so prefill's
    results equal the dense engine's; a decode row's summation order differs from it.
    With bf16 activations only the blocks are kept: the bf16 block kernel serves every row
    count (dense None)."""

    blocks: QuantLinear
    dense: Linear | None  # None with bf16 activations: the blocks serve every row count
    # "bfloat16": every product in qbf16.c's bf16 arithmetic, at any row count (prefill's
    # too: one arithmetic, so a cached prefix and a cold prompt get the same K/V)
    activations: str = "float32"

    @property
    def fmt(self) -> str:
        return self.blocks.fmt


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return out  # (torch.ops are untyped)


@functools.cache
def _one_row_differs(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Does oneDNN give one row another result alone than beside a second row? It takes
    another kernel for M=1 at some shapes (seen here for in=1536): probe once per shape."""
    g = torch.Generator().manual_seed(0)
    w = _onednn_pack(torch.randn(shape, generator=g).to(dtype))
    x = torch.randn(2, shape[1], generator=g).to(dtype)
    return not torch.equal(_onednn(x[:1], w)[0], _onednn(x, w)[0])


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
    return packed


COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
CPU = torch.device("cpu")


def bf16_supported() -> bool:
    return HAS_ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_compute_dtype(compute_dtype: str, device: torch.device = CPU) -> str:
    """ "auto" is bfloat16 on a CPU that multiplies bf16 natively (AVX512-BF16, or AMX
    with oneDNN capped at AVX512-BF16: faster and still batch invariant, docs/benchmarks.md,
    docs/gpu.md), else float32. On a GPU it stays float32: on an H200 bf16 was slower than
    fp32 for this engine and changed 5-7 of 16 greedy replies (docs/gpu.md). The other
    names stand for themselves."""
    if compute_dtype != "auto":
        return compute_dtype
    return "bfloat16" if device.type == "cpu" and bf16_supported() else "float32"


def resolve_device(name: str) -> torch.device:
    """ "cpu", "cuda" or "cuda:N", refused clearly where it is not there."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {name!r}: {e}") from e
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda[:N], got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r}: this torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} CUDA devices")
    return device


def matmul_dtype(compute_dtype: str, device: torch.device = CPU) -> torch.dtype:
    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    compute_dtype = resolve_compute_dtype(compute_dtype, device)
    if compute_dtype == "bfloat16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("compute_dtype bfloat16 needs a GPU with bf16 (sm80 or newer)")
        if device.type == "cpu" and not bf16_supported():
            raise ConfigError(
                "compute_dtype bfloat16 needs a CPU with native bf16 matmul "
                "(AVX512-BF16 or AMX); this one has none: use float32"
            )
    return torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32


def pack(w: torch.Tensor, dtype: torch.dtype = torch.float32, onednn: bool = HAS_ONEDNN) -> Linear:
    w = w.to(dtype)
    if not onednn:
        return Linear(w.contiguous())
    # bf16: oneDNN's single-row kernel rounds differently on some inputs only (random probes
    # pass, real activations do not), so one row always runs as two
    pad = dtype == torch.bfloat16 or _one_row_differs(tuple(w.shape), dtype)
    return Linear(_onednn_pack(w), pad, onednn=True)


def linear(x: torch.Tensor, lin: Linear | BlockLinear, rows: int = DIRECT_ROWS) -> torch.Tensor:
    """x @ w.T for x: [M, in].

    Batch invariant: a row's result does not depend on the other rows, so a sequence decodes
    to the same tokens alone or in any batch. Where oneDNN's single-row kernel sums in
    another order, one row is computed as two (the weights are still read once). Quantized
    weights go to engine/quant.py (invariant by construction) for up to `rows` rows (the
    model's: quant.PROMPT_ROWS where decode is fused, else DIRECT_ROWS); more rows (prefill)
    multiply the dense copy, so a row of a short chunk and of a long one differ by rounding:
    decode batches never cross that line (engine/fused_decode.py multiplies blocks at any
    size; the torch decode path caps max_num_seqs at DIRECT_ROWS). With bf16
    activations there is no dense copy: prompt rows (this function's) and decode rows
    (fused_decode.py calls qlinear) take AMX tiles where the CPU has them, at every count."""
    if isinstance(lin, BlockLinear):
        if lin.activations == "bfloat16":
            return qlinear(x, lin.blocks, "bfloat16", tiles=True)
        if x.shape[0] > rows and lin.dense is not None:
            return linear(x, lin.dense)
        return qlinear(x, lin.blocks)
    if lin.weight.dtype != x.dtype:  # bf16 weights: bf16 in, fp32 residual stream out
        return linear(x.to(lin.weight.dtype), lin).float()
    if not lin.onednn:
        return F.linear(x, lin.weight)
    if lin.pad_one_row and x.shape[0] == 1:
        return _onednn(x.expand(2, -1), lin.weight)[:1]
    return _onednn(x, lin.weight)
