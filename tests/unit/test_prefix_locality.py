"""The orchestrator's estimate of which pool holds a prompt's K/V, from plain numbers."""

from __future__ import annotations

import pytest

from disagg.pipeline.prefix_locality import DECODE, PREFILL, PrefixLocality

pytestmark = pytest.mark.unit


def test_records_per_pool_and_matches_leading_whole_blocks():
    loc = PrefixLocality(max_tokens=1024, block_size=4)
    loc.record(DECODE, list(range(10)), "")
    assert loc.cached(list(range(12)), "") == {PREFILL: 0, DECODE: 8}
    assert loc.cached([99] + list(range(11)), "") == {PREFILL: 0, DECODE: 0}
    assert loc.cached(list(range(12)), "other") == {PREFILL: 0, DECODE: 0}  # salt apart
    loc.record(PREFILL, list(range(4)), "")
    assert loc.cached(list(range(12)), "") == {PREFILL: 4, DECODE: 8}


def test_bounded_like_the_pools_least_recently_used_first():
    loc = PrefixLocality(max_tokens=16, block_size=4)  # 4 blocks
    loc.record(DECODE, list(range(16)), "")
    loc.record(DECODE, [7] * 8, "")  # 2 new blocks: the old chain's tail goes first
    assert loc.cached(list(range(16)), "") == {PREFILL: 0, DECODE: 8}
    off = PrefixLocality(max_tokens=0)
    off.record(DECODE, list(range(64)), "")
    assert off.cached(list(range(64)), "") == {PREFILL: 0, DECODE: 0}


def test_several_decode_instances_are_assumed_to_hold_nothing():
    loc = PrefixLocality(max_tokens=1024, block_size=16, track_decode=False)
    ids = list(range(100))
    loc.record(DECODE, ids, "")
    loc.record(PREFILL, ids, "")
    assert loc.cached(ids, "") == {PREFILL: 96, DECODE: 0}
