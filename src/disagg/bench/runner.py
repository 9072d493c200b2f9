"""Send a workload to a server, open loop, and record each request's timeline.

Two targets: Triton over gRPC streaming (any client-facing model: `router`, `ensemble`;
tokens per chunk from the cumulative num_output_tokens) and the OpenAI gateway
(/v1/completions, streamed, so the prompt is sent as is; tokens per chunk are not reported,
so each chunk counts one and the final usage gives the total).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from disagg import contracts as C
from disagg.bench.stats import Timeline
from disagg.bench.workloads import RequestSpec

ROUTER_HINTS = (C.LATENCY_SLA_MS, C.TASK_TYPE, C.PRIORITY)


class Target(Protocol):
    async def send(self, spec: RequestSpec, prompt: str, t: Timeline) -> None:
        """Fill `t` (chunks, end, token counts) or raise."""
        ...

    async def close(self) -> None: ...


class TritonTarget:
    def __init__(self, url: str, model: str = "router", timeout_s: float = 600.0) -> None:
        from disagg.gateway.backend import TritonBackend

        self.model = model
        self.backend = TritonBackend(url, timeout_s)

    async def send(self, spec: RequestSpec, prompt: str, t: Timeline) -> None:
        inputs = {C.TEXT_INPUT: prompt, C.MAX_TOKENS: spec.max_tokens, C.IGNORE_EOS: True}
        if self.model.startswith("router"):
            inputs.update({k: v for k, v in spec.hints.items() if k in ROUTER_HINTS})
        seen = 0
        pieces = self.backend.generate(self.model, "", f"bench-{spec.index}", inputs)
        async for piece in pieces:
            now = time.perf_counter()
            if piece.text:
                t.chunk_s.append(now)
                t.chunk_tokens.append(max(piece.num_output_tokens - seen, 1))
            seen = max(seen, piece.num_output_tokens)
            t.prompt_tokens = piece.num_input_tokens or t.prompt_tokens
            if piece.finish_reason == "error":
                raise RuntimeError(piece.extra.get("error", "the model failed"))
        t.output_tokens = seen

    async def close(self) -> None:
        await self.backend.close()


class GatewayTarget:
    def __init__(self, url: str, model: str, api_key: str, timeout_s: float = 600.0) -> None:
        import openai

        self.model = model
        self.client = openai.AsyncOpenAI(
            base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s
        )

    async def send(self, spec: RequestSpec, prompt: str, t: Timeline) -> None:
        stream = await self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=spec.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **spec.hints},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                t.chunk_s.append(now)
                t.chunk_tokens.append(1)
            if chunk.usage is not None:
                t.prompt_tokens = chunk.usage.prompt_tokens
                t.output_tokens = chunk.usage.completion_tokens
        if not t.output_tokens:
            t.output_tokens = len(t.chunk_s)

    async def close(self) -> None:
        await self.client.close()


@dataclass
class Progress:
    """What a progress bar needs: called once per finished request."""

    update: Callable[[Timeline], None] = lambda t: None


async def run_one(
    target: Target, spec: RequestSpec, prompt: str, progress: Progress | None = None
) -> Timeline:
    """One request's timeline; an error is recorded in it, not raised."""
    t = Timeline(cls=spec.cls, send_s=time.perf_counter(), prompt_tokens=spec.prompt_tokens)
    try:
        await target.send(spec, prompt, t)
    except Exception as e:  # recorded: an error is a request that missed its SLO
        t.error = f"{type(e).__name__}: {e}"[:300]
    t.end_s = time.perf_counter()
    if progress is not None:
        progress.update(t)
    return t


async def run_open_loop(
    target: Target,
    specs: list[RequestSpec],
    prompt_for: Callable[[RequestSpec], str],
    progress: Progress | None = None,
) -> list[Timeline]:
    """Send each request at its arrival time, whether or not earlier ones have finished."""
    progress = progress or Progress()
    prompts = [prompt_for(s) for s in specs]  # made before the clock starts
    loop = asyncio.get_running_loop()
    start, tasks = loop.time(), []
    for spec, prompt in zip(specs, prompts, strict=True):
        delay = start + spec.arrival_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_one(target, spec, prompt, progress)))
    return list(await asyncio.gather(*tasks))


async def run_one_at_a_time(
    target: Target,
    specs: list[RequestSpec],
    prompt_for: Callable[[RequestSpec], str],
    progress: Progress | None = None,
) -> list[Timeline]:
    """Unloaded latency: each request alone (SLO calibration)."""
    progress = progress or Progress()
    return [await run_one(target, s, prompt_for(s), progress) for s in specs]
