"""In-process facade: the orchestrator over in-process pools, with text in and text out.

Used by `disagg generate`, the tests and the benchmarks. It runs the same code path as the
Triton models, minus Triton: `Orchestrator.run` (pipeline/orchestrator.py) over
`LocalPrefillPool` and `LocalDecodePool` (pipeline/local.py), so tokens become text in one
place. `disaggregated=True` sends every prompt through the prefill engine and imports its KV
payload into the decode engine (the hand-off the Triton models make across processes);
False lets decode prefill by itself.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from disagg.contracts import COLOCATED, DISAGGREGATED, Reply, new_request_id
from disagg.engine.config import EngineConfig
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine
from disagg.engine.model import Llama
from disagg.engine.sequence import FinishReason, SamplingParams
from disagg.engine.tokenizer import Message, Tokenizer
from disagg.pipeline.decode_service import DecodeService
from disagg.pipeline.local import LocalDecodePool, LocalPrefillPool
from disagg.pipeline.orchestrator import Orchestrator
from disagg.pipeline.request import GenerateRequest

Prompt = str | list[Message] | list[int]  # plain text, chat messages, or token ids
log = logging.getLogger("disagg.llm")


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


def _stuck(seconds: float) -> None:  # a queue put never blocks; say so if one ever did
    log.error("decode delivery was stuck for %.0f s", seconds)


class LLM:
    def __init__(
        self,
        engine_dir: str | Path,
        config: EngineConfig | None = None,
        disaggregated: bool = True,
        compute_dtype: str = "auto",
        device: str = "cpu",
        weights: str = "auto",
        activations: str = "auto",
    ) -> None:
        self.model = Llama.load(engine_dir, compute_dtype, device, weights, activations)
        self.tokenizer = Tokenizer(engine_dir)
        self.config = config or EngineConfig(max_model_len=self.model.args.max_context)
        eos = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        self.prefill_engine = PrefillEngine(self.model, self.config, eos_token_ids=eos)
        self.decode_engine = DecodeEngine(self.model, self.config, eos)
        self.service = DecodeService(self.decode_engine, on_stuck=_stuck).start()
        self.disaggregated = disaggregated
        self.orchestrator = Orchestrator(
            self.tokenizer,
            self.model.args,
            self.config,
            prefill_pool=LocalPrefillPool(self.prefill_engine),
            decode_pool=LocalDecodePool(self.service),
            mode=DISAGGREGATED if disaggregated else COLOCATED,
        )

    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Messages and (with `chat`) plain text go through the chat template."""
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]  # type: ignore[arg-type]  # all ints, checked
        return self.tokenizer.encode_chat(prompt)  # type: ignore[arg-type]  # messages, by elimination

    def _request(
        self, prompt: Prompt, params: SamplingParams, chat: bool, stream: bool
    ) -> GenerateRequest:
        return GenerateRequest(
            request_id=new_request_id(),
            prompt_ids=self.encode(prompt, chat),
            prompt_text="",
            params=params,
            stream=stream,
            exclude_input_in_output=True,
        )

    @staticmethod
    def _completion(req: GenerateRequest, reply: Reply) -> Completion:
        return Completion(
            req.request_id,
            req.prompt_ids,
            token_ids=reply.token_ids,
            text=reply.text,
            finish_reason=FinishReason(reply.finish_reason) if reply.finish_reason else None,
        )

    def generate(
        self, prompts: list[Prompt], params: SamplingParams, chat: bool = True
    ) -> list[Completion]:
        """Every prompt at once: they join decode's continuous batch together."""
        reqs = [self._request(p, params, chat, stream=False) for p in prompts]
        with ThreadPoolExecutor(max(len(reqs), 1)) as pool:
            replies = list(pool.map(lambda r: self.orchestrator.run(r, emit=lambda _: None), reqs))
        return [self._completion(r, reply) for r, reply in zip(reqs, replies, strict=True)]

    def close(self) -> None:
        """Stop the decode loop (requests still running get no more tokens)."""
        self.service.stop()

    def stream(self, prompt: Prompt, params: SamplingParams, chat: bool = True) -> Iterator[str]:
        """Text deltas of one request as they are produced. Closing the iterator early
        cancels the request in decode."""
        req = self._request(prompt, params, chat, stream=True)
        deltas: queue.Queue[str | BaseException | object] = queue.Queue()
        stop = threading.Event()
        done = object()

        def run() -> None:
            try:
                final = self.orchestrator.run(req, lambda r: deltas.put(r.text), stop.is_set)
                deltas.put(final.text)
                deltas.put(done)
            except BaseException as e:
                deltas.put(e)

        threading.Thread(target=run, name=f"llm-{req.request_id}", daemon=True).start()
        try:
            while (item := deltas.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, str) and item:
                    yield item
        finally:
            stop.set()
