"""oneDNN's instruction-set cap on AMX CPUs (engine/kernels.py): where it is set, where a
user's choice stays. That the cap restores batch invariance was measured on an AMX Xeon (an
H200 host, docs/gpu.md); this machine has no AMX."""

import pytest

from disagg.engine.kernels import AMX_CAP, cap_onednn_isa, onednn_isa_cap

pytestmark = pytest.mark.unit

AMX = "fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN4 = "fpu sse avx2 avx512f avx512_bf16 avx512_vnni"


def test_an_amx_cpu_is_capped_at_avx512_bf16():
    assert onednn_isa_cap(AMX, {}) == AMX_CAP == "AVX512_CORE_BF16"


def test_a_cpu_without_amx_is_left_alone():
    assert onednn_isa_cap(ZEN4, {}) is None
    assert onednn_isa_cap("", {}) is None
    assert onednn_isa_cap("amx_bf16x", {}) is None  # whole flags only


def test_the_users_cap_and_the_opt_out_stay():
    assert onednn_isa_cap(AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) is None
    assert onednn_isa_cap(AMX, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX"}) is None  # older name
    assert onednn_isa_cap(AMX, {"DISAGG_ONEDNN_AMX": "1"}) is None
    assert onednn_isa_cap(AMX, {"DISAGG_ONEDNN_AMX": "0"}) == AMX_CAP


def test_applied_to_an_environment(monkeypatch):
    import disagg.engine.kernels as kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: AMX)
    env: dict[str, str] = {}
    cap_onednn_isa(env)
    assert env == {"ONEDNN_MAX_CPU_ISA": AMX_CAP}
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ZEN4)
    env = {}
    cap_onednn_isa(env)
    assert env == {}
