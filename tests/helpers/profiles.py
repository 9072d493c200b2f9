"""Hand-made profiles for simulator tests: round numbers, so expected times can be worked
out by hand (no weights, no measuring)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from disagg.planner.costs import ChunkCost, DecodeCost, Linear, PiecewiseLinear
from disagg.planner.profile import NETWORK, SHM, Overheads, Profile

KV_BYTES_PER_TOKEN = 46080  # SmolLM2-135M


def simple_profile(**changes: Any) -> Profile:
    """prefill 1 ms/token, chunk 1 ms/token, decode step 9 ms + 1 ms per row (no context
    cost), pack 2 ms, a slot write 0.5 ms, hand-off 4 ms (shm) / 3 ms (network);
    dispatch 5 ms, return 1 ms, 0.1 ms per response sent."""
    return replace(
        Profile(
            prefill=PiecewiseLinear((1.0, 1000.0), (0.001, 1.0)),
            chunk=ChunkCost(0.0, 0.001, 0.0),
            decode=DecodeCost(
                PiecewiseLinear((1.0, 9.0), (0.010, 0.018)), PiecewiseLinear((1.0,), (0.0,))
            ),
            pack=Linear(0.002, 0.0),
            kv_write=Linear(0.0005, 0.0),
            handoff={SHM: Linear(0.004, 0.0), NETWORK: Linear(0.003, 0.0)},
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            overheads=Overheads(dispatch_s=0.005, return_s=0.001, send_s=0.0001, source="test"),
            machine={"cpu": "hand-made"},
            model={"name": "test"},
        ),
        **changes,
    )


def smollm_like_profile() -> Profile:
    """Roughly SmolLM2-135M on one CPU core: prefill ~1.5 ms/token, attention growing with
    context, decode ~25 ms a step plus a little per row and position."""
    return Profile(
        prefill=PiecewiseLinear((16.0, 128.0, 1024.0, 2000.0), (0.03, 0.18, 1.5, 3.2)),
        chunk=ChunkCost(0.004, 0.0014, 2e-7),
        decode=DecodeCost(
            PiecewiseLinear((1.0, 8.0, 32.0), (0.025, 0.035, 0.08)),
            PiecewiseLinear((1.0, 8.0, 32.0), (2e-6, 1e-5, 4e-5)),
        ),
        pack=Linear(0.0005, 2e-10),
        kv_write=Linear(0.0002, 1.5e-10),
        handoff={SHM: Linear(0.002, 1.2e-9), NETWORK: Linear(0.002, 7e-10)},
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        machine={"cpu": "hand-made"},
        model={"name": "test"},
    )
