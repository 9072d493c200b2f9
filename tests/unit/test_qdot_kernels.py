"""The int8-activation block kernels (engine/qdot.c through quant.qlinear(activations="int8")) from
plain numbers: rows quantized exactly as the scheme says, products equal to the integer
arithmetic they stand for, close to fp32, batch invariant bit for bit, and the portable C
fallback giving the SIMD path's bits. No weights, no model."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.quant_blocks import FORMATS, blocks

from disagg.engine import quant

pytestmark = pytest.mark.unit


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero group: scale 0, every q 0
    return x


def reference_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scheme in numpy, float32 throughout: d = max|x| / 127, q = rint(x * (1 / d))."""
    g = x.numpy().reshape(x.shape[0], -1, 32)
    d = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(g * inv[..., None]).astype(np.int32)
    return q.astype(np.int8).reshape(x.shape), d, (d * q.sum(-1).astype(np.float32))


def test_rows_are_quantized_exactly_as_the_scheme_says():
    x = rows(5, 192, seed=3)
    x[1, 40] = 2.5 * x[1, 32:64].abs().max()  # a group's maximum maps to 127
    qx, dx, sx = quant.quantize_rows(x)
    want_q, want_d, want_s = reference_quantize(x)
    assert np.array_equal(qx.numpy(), want_q)
    assert np.array_equal(dx.numpy(), want_d)
    assert np.array_equal(sx.numpy(), want_s)
    assert int(qx[1, 40]) == 127 and not qx[0, :32].any()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_product_is_the_integer_arithmetic_it_stands_for(fmt):
    w, ref = blocks(fmt, 75, 192, seed=5)  # odd n: the last column pair is half
    x = rows(6, 192, seed=5)
    qx, dx, sx = quant.quantize_rows(x)
    # weights as integers q with w = d q + a: a = m (Q4_1), -8 d (Q4_0), 0 (Q8_0)
    d, m = w.d.double(), w.m.double()
    if fmt == "q8_0":
        q, a = w.qs.double(), torch.zeros_like(d)
    else:
        b = w.qs.to(torch.int32)
        q = torch.cat([b & 0x0F, b >> 4], -1).double()  # [n, groups, 32], weight order
        a = m if fmt == "q4_1" else -8.0 * d
    xq = qx.double().view(6, -1, 32)
    isum = torch.einsum("ngj,rgj->rng", q, xq)  # exact: integers well inside 2^53
    want = (isum * d[None] * dx.double()[:, None]).sum(-1) + (a[None] * sx.double()[:, None]).sum(
        -1
    )
    got = quant.qlinear(x, w, "int8")
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    # and what it approximates: the fp32 product, within the activations' 8 bits
    exact = x @ ref.T
    assert ((got - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_int8_rows_get_the_same_bits_alone_and_in_any_batch(fmt):
    w, _ = blocks(fmt, 130, 224, seed=9)
    x = rows(70, 224, seed=2)
    full = quant.qlinear(x, w, "int8")
    for b in (1, 2, 3, 4, 5, 8, 17, 64, 70):
        assert torch.equal(quant.qlinear(x[:b], w, "int8"), full[:b]), b
    assert torch.equal(quant.qlinear(x[3:4], w, "int8"), full[3:4])


def test_portable_fallback_gives_the_simd_bits(tmp_path: Path):
    if not quant.simd():
        pytest.skip("this CPU runs the portable kernels already (no AVX2+FMA): nothing to compare")
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "the kernels built, so a compiler is on PATH"
    src = Path(quant.__file__).with_name("qdot.c")
    out = tmp_path / "qdot_portable.so"
    flags = [f for f in quant.FLAGS if f != "-fopenmp"] + ["-mno-avx2", "-mno-fma"]
    subprocess.run([cc, *flags, str(src), "-o", str(out)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.disagg_qdot_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int, i64, ptr]
    lib.disagg_qdot_matmul.argtypes += [ctypes.c_int]
    for fmt in sorted(FORMATS):
        w, _ = blocks(fmt, 33, 288, seed=11)  # 9 groups: the scale sums' tail too
        x = rows(5, 288, seed=4)
        y = torch.empty(5, 33)
        args = (x.data_ptr(), 5, 288, w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr())
        assert lib.disagg_qdot_matmul(*args, quant.FORMATS.index(fmt), 33, y.data_ptr(), 1) == 0
        assert torch.equal(y, quant.qlinear(x, w, "int8")), fmt
