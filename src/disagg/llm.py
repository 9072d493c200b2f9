"""In-process facade: prefill and decode engines on one model, with text in and text out.

Used by `disagg generate`, the tests and the benchmarks. `disaggregated=True` sends every
prompt through PrefillEngine and imports its KV payload into the DecodeEngine (the same
hand-off the Triton models make across processes); False lets decode prefill by itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from disagg.config import EngineConfig
from disagg.engine import DecodeEngine, PrefillEngine, TokenOutput
from disagg.model import Llama
from disagg.sequence import FinishReason, SamplingParams
from disagg.tokenizer import Message, TextStream, Tokenizer

Prompt = str | list[Message] | list[int]  # plain text, chat messages, or token ids


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


class LLM:
    def __init__(
        self,
        engine_dir: str | Path,
        config: EngineConfig | None = None,
        disaggregated: bool = True,
        compute_dtype: str = "float32",
    ) -> None:
        self.model = Llama.load(engine_dir, compute_dtype)
        self.tokenizer = Tokenizer(engine_dir)
        self.config = config or EngineConfig(max_model_len=self.model.args.max_context)
        self.prefill_engine = PrefillEngine(self.model, self.config)
        eos = {self.tokenizer.eos_token_id} - {None}
        self.decode_engine = DecodeEngine(self.model, self.config, eos)
        self.disaggregated = disaggregated
        self._ids = itertools.count()

    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Messages and (with `chat`) plain text go through the chat template."""
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return self.tokenizer.encode_chat(prompt)  # type: ignore[arg-type]

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Queue one request; `step()` advances it."""
        rid = f"req-{next(self._ids)}"
        comp = Completion(rid, prompt_ids)
        if self.disaggregated:
            result = self.prefill_engine.prefill(rid, prompt_ids, params)
            self.decode_engine.add_request(rid, params, prefill=result)
            comp.token_ids.append(result.first_token)
        else:
            self.decode_engine.add_request(rid, params, prompt_ids=prompt_ids)
        return comp

    def _start(
        self, prompt: Prompt, params: SamplingParams, chat: bool
    ) -> tuple[Completion, TextStream, str]:
        """Submit one request; returns it, its text stream and the first token's text (when
        prefill already produced that token)."""
        comp = self.submit(self.encode(prompt, chat), params)
        text = TextStream(self.tokenizer, params.stop)
        first = "".join(text.push(t) for t in comp.token_ids)
        comp.text += first
        return comp, text, first

    def generate(
        self, prompts: list[Prompt], params: SamplingParams, chat: bool = True
    ) -> list[Completion]:
        started = [self._start(p, params, chat) for p in prompts]
        by_id = {comp.request_id: (comp, text) for comp, text, _ in started}
        while self.decode_engine.has_unfinished:
            for out in self.decode_engine.step():
                self._apply(*by_id[out.request_id], out)
        return [comp for comp, _, _ in started]

    def stream(self, prompt: Prompt, params: SamplingParams, chat: bool = True) -> Iterator[str]:
        """Text deltas of one request as they are produced."""
        comp, text, first = self._start(prompt, params, chat)
        if first:
            yield first
        while comp.finish_reason is None:
            for out in self.decode_engine.step():
                if out.request_id == comp.request_id and (delta := self._apply(comp, text, out)):
                    yield delta

    def _apply(self, comp: Completion, text: TextStream, out: TokenOutput) -> str:
        delta = ""
        if out.token_id is not None and comp.finish_reason is None:
            comp.token_ids.append(out.token_id)
            if out.token_id not in self.decode_engine.eos_token_ids:
                delta = text.push(out.token_id)
            if text.stopped:  # a stop string: end the sequence in the engine too
                self.decode_engine.finish_request(comp.request_id, FinishReason.STOP)
                comp.finish_reason = FinishReason.STOP
        if out.finish_reason is not None and comp.finish_reason is None:
            comp.finish_reason = out.finish_reason
            delta += text.flush()
        comp.text += delta
        return delta
