"""The bf16 block kernels (engine/qbf16.c through quant.qlinear(activations="bfloat16")) from
plain numbers: the portable path equal bit for bit to the arithmetic written out in numpy,
the AVX512-BF16 path equal bit for bit to the portable one (where the CPU has it), close to
fp32, batch invariant; rows on AMX tiles (where the CPU has them) within fp32 summation error
of the exact sum and batch invariant across both tile layouts. No weights, no model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.quant_blocks import FORMATS, blocks

from disagg.engine import quant

pytestmark = pytest.mark.unit

needs_bf16 = pytest.mark.skipif(
    quant.available() is not None or not quant.bf16_simd(),
    reason="the vector path needs a CPU with AVX512-BF16 (the portable path is tested anywhere)",
)


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero group
    x[1, 5] = 1e-39  # a denormal: flushed to zero, as vcvtneps2bf16 does
    return x


def to_bf16(a: np.ndarray) -> np.ndarray:
    """fp32 -> the fp32 value of its bf16 rounding (nearest even; denormals to zero)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    r = np.where((u & 0x7F800000) == 0, u & 0x80000000, r)
    return r.astype(np.uint32).view(np.float32)


def reference(x: torch.Tensor, w: quant.QuantLinear) -> np.ndarray:
    """The arithmetic qbf16.c's header states: bf16 rows and weights, 16 fp32 lanes per
    group of 32 (lane i: += x[2i+1] w[2i+1], then += x[2i] w[2i]), folded 8-4-2-1."""
    wf = quant.dequantize(w).numpy()  # the fp32 weights qmatmul.c multiplies
    xb = to_bf16(x.numpy()).reshape(x.shape[0], 1, -1, 16, 2)
    wb = to_bf16(wf).reshape(1, w.n, -1, 16, 2)
    acc = np.zeros((x.shape[0], w.n, 16), np.float32)
    for g in range(w.k // 32):  # float32 ops, each rounded; products exact in fp32
        acc = acc + xb[:, :, g, :, 1] * wb[:, :, g, :, 1]
        acc = acc + xb[:, :, g, :, 0] * wb[:, :, g, :, 0]
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_portable_path_is_the_stated_arithmetic(fmt):
    w, _ = blocks(fmt, 13, 160, seed=2)
    x = rows(5, 160, seed=2)
    got = quant.qlinear(x, w, "bfloat16", portable=True).numpy()
    assert np.array_equal(got, reference(x, w))


@needs_bf16
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 4, 7, 16, 33, 128, 130, 257])  # rows: blocks of 128
@pytest.mark.parametrize("panels", [True, False])  # from 64 rows up, panels unless told not to
def test_vector_path_gives_the_portable_bits(fmt, m, panels):
    w, _ = blocks(fmt, 75, 576, seed=m)  # 75 columns: a tile of 6 with a tail of 3
    x = rows(m, 576, seed=m) if m > 1 else rows(2, 576, seed=1)[1:]
    assert torch.equal(
        quant.qlinear(x, w, "bfloat16", panels=panels),
        quant.qlinear(x, w, "bfloat16", portable=True),
    )


@needs_bf16
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(
    "m,k,n",
    [(64, 1536, 75), (66, 1536, 90), (77, 1536, 90), (66, 576, 75), (71, 576, 90), (300, 576, 90)],
)
def test_prompt_rows_on_panels_give_the_lanes_bits(fmt, m, k, n):
    """From qbf16_panel.h's LANES_ROWS rows up, rows multiply against weight panels: the bits
    of the per-output accumulators (row tiles of 12 or 9 with tails of 1, 3, 4, 5, 6, 8 and 11
    rows, a second block of 256; last panels of 11 and 26 columns: part of one register, and
    one and a part)."""
    w, _ = blocks(fmt, n, k, seed=m)
    x = rows(m, k, seed=m)
    got = quant.qlinear(x, w, "bfloat16")
    assert torch.equal(got, quant.qlinear(x, w, "bfloat16", panels=False))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_close_to_fp32(fmt):
    w, ref = blocks(fmt, 64, 576, seed=7)
    x = rows(4, 576, seed=7)
    got, want = quant.qlinear(x, w, "bfloat16"), x @ ref.T
    # two bf16 roundings (2^-9 each) on every product of a 576-long sum
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert not torch.equal(got, quant.qlinear(x, w))  # and it is not the fp32 path


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rows_get_the_same_bits_alone_and_in_any_batch(fmt):
    w, _ = blocks(fmt, 45, 192, seed=4)
    x = rows(11, 192, seed=4)
    full = quant.qlinear(x, w, "bfloat16")
    for b in (1, 2, 4, 5, 9):
        assert torch.equal(quant.qlinear(x[:b], w, "bfloat16"), full[:b]), b
    assert torch.equal(quant.qlinear(x[6:7], w, "bfloat16"), full[6:7])
    many = torch.cat([x] * 30)  # 330 rows: rows 297-307 (third block of 128) as alone
    assert torch.equal(quant.qlinear(many, w, "bfloat16")[297:308], full)


def exact(x: torch.Tensor, w: quant.QuantLinear) -> tuple[np.ndarray, np.ndarray]:
    """The bf16 products summed exactly (float64), and the sum of their magnitudes."""
    xb = to_bf16(x.numpy()).astype(np.float64)
    wb = to_bf16(quant.dequantize(w).numpy()).astype(np.float64)
    return xb @ wb.T, np.abs(xb) @ np.abs(wb).T


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rows_on_tiles_are_within_fp32_summation_error_and_batch_invariant(fmt):
    """Rows on tiles (`tiles`: prompt and decode rows): AMX where the CPU has them. Their
    summation order is the tile unit's
    own (no bit-for-bit reference), so: within the error bound of any fp32 summation order of
    the same bf16 products, and every row's bits the same in any batch (partial tiles of 32
    rows, a partial panel of 75 columns, a second block of 256 rows). Without AMX the flag
    changes nothing, bit for bit."""
    k = 576
    w, _ = blocks(fmt, 75, k, seed=5)
    x = rows(300, k, seed=5)
    got = quant.qlinear(x, w, "bfloat16", tiles=True)
    if not quant.bf16_amx():
        assert torch.equal(got, quant.qlinear(x, w, "bfloat16"))
        return
    ref, magnitude = exact(x, w)
    assert (np.abs(got.numpy() - ref) <= k * 2.0**-24 * magnitude + 1e-30).all()
    # 1-32 rows take the other tile layout (qbf16.c amx_few): the same bits as in the panel's
    for lo, hi in ((0, 65), (17, 99), (5, 6), (200, 300), (255, 258), (40, 56), (40, 57),
                   (100, 132), (100, 133)):  # fmt: skip
        alone = quant.qlinear(x[lo:hi], w, "bfloat16", tiles=True)
        assert torch.equal(alone, got[lo:hi]), (lo, hi)


def test_unknown_activations_are_refused():
    w, _ = blocks("q4_1", 4, 64)
    with pytest.raises(ValueError, match="activations must be one of"):
        quant.qlinear(torch.randn(2, 64), w, "float16")


def test_a_threads_kept_scratch_is_freed_when_the_thread_ends():
    """qbf16.c keeps each calling thread's scratch (rows' bf16 copy, panels) between calls;
    request threads come and go, so a thread's scratch must go with it: 100 short-lived
    threads each multiplying 300 rows leave the process within 25 MB of where it was (kept
    past their end, they would hold ~2 MB each, panels and rows). Measured in a
    fresh interpreter with one malloc arena: inside this suite, glibc's per-thread arenas
    keep up to ~60 MB of freed tensors whatever the kernels do."""
    script = """
import os, threading
from pathlib import Path
from helpers.quant_blocks import blocks
from disagg.engine import quant
import torch

def rss_mb():
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

w, _ = blocks("q4_1", 1536 if quant.bf16_simd() else 32, 576, seed=1)  # (portable: slow)
x = torch.randn(300, 576, generator=torch.Generator().manual_seed(9))
quant.qlinear(x, w, "bfloat16", tiles=True)  # the library loaded, this thread's scratch made
before = rss_mb()
for _ in range(100):
    t = threading.Thread(target=quant.qlinear, args=(x, w, "bfloat16"), kwargs={"tiles": True})
    t.start()
    t.join()
print(rss_mb() - before)
"""
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tests), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    grown = float(run.stdout.split()[-1])
    assert grown < 25, grown
