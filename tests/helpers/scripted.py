"""Scripted stand-ins for the stages around the orchestrator and the router: a tokenizer
without a vocabulary file, prefill and decode pools that answer from a script, and a local
pipeline for the router. They let orchestration and routing logic be tested without
weights, processes or Triton."""

from __future__ import annotations

import re

import numpy as np

from disagg.contracts import DecodeStep, Handoff, RoutedReply
from disagg.engine.config import ModelArgs

_PIECE = re.compile(r"\s*\S+|\s+")


class StubTokenizer:
    """Word pieces as tokens (a piece keeps its leading space, so decode(encode(t)) == t):
    ids are given out in first-seen order, from 1 (0 is EOS). What the orchestrator and
    TextStream use of a tokenizer: encode, decode and eos_token_id."""

    eos_token_id = 0

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = ["</s>"]

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in _PIECE.findall(text):
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            out.append(self._ids[piece])
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self._pieces[i] for i in ids)


def model_args(vocab_size: int = 49152) -> ModelArgs:
    """SmolLM2-135M's numbers, without loading its engine."""
    return ModelArgs(
        dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=vocab_size
    )


class ScriptedPrefill:
    """Honours a skip as the real one does: its hand-off says where its payload starts."""

    def __init__(self, first_token: int | None = None, error: Exception | None = None):
        self.first_token, self.error, self.calls, self.skips = first_token, error, [], []

    def prefill(self, request_id, prompt_ids, params, skip_tokens=0):
        self.calls.append(prompt_ids)
        self.skips.append(skip_tokens)
        if self.error:
            raise self.error
        payload = np.zeros(16, np.uint8)
        return Handoff(self.first_token, 7, payload, 111, 0.01, kv_start=skip_tokens)


class ScriptedDecode:
    def __init__(self, tokens: list[int], finish: str | None = "length", log=None):
        self.tokens, self.finish, self.calls, self.cancelled = tokens, finish, [], []
        self.log = log if log is not None else []

    def generate(self, request_id, params, *, handoff=None, prompt_ids=None):
        self.calls.append((handoff, prompt_ids))
        self.log.append("decode")
        yield DecodeStep([], None, 222)  # acknowledgement
        if not self.tokens:
            yield DecodeStep([], self.finish, 222)
        for i, t in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            yield DecodeStep([t], self.finish if last else None, 222)

    def cancel(self, request_id):
        self.cancelled.append(request_id)


class ScriptedLocal:
    """Stands for the router's local prefill/decode pipeline (the real one runs in
    tests/integration/test_router.py)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.cancelled: list[str] = []

    def generate(self, model, request_id, fields):
        self.calls.append(request_id)
        if fields.get("stream"):
            yield RoutedReply("local ", 3, 1)
            yield RoutedReply("answer", 3, 2)
            yield RoutedReply("", 3, 2, finish_reason="stop", served_by="disaggregated")
        else:
            yield RoutedReply("local answer", 3, 2, "stop", served_by="disaggregated")

    def cancel(self, request_id):
        self.cancelled.append(request_id)


class ScriptedEndpoint:
    """Stands for an external OpenAI-compatible endpoint (an LPU pool) in the router's unit
    tests: each request takes the next scripted behaviour, "ok" when the script runs out.

        "ok"                 stream `text` word by word, then finish "stop" with usage
        ("fail", kind)       raise EndpointError(kind) before any text
        ("cut", n, kind)     stream n words, then raise EndpointError(kind)
        ("unavailable", why) unavailable_reason() says `why` for this request
    """

    text = "scripted endpoint answer"

    def __init__(self, config) -> None:
        self.config = config
        self.name = config.name
        self.script: list = []
        self.requests: list = []
        self._next = "ok"

    def unavailable_reason(self, public_model: str, est_tokens: int) -> str | None:
        self._next = self.script.pop(0) if self.script else "ok"
        if isinstance(self._next, tuple) and self._next[0] == "unavailable":
            return self._next[1]
        return None

    def stream_chat(self, public_model: str, req):
        from disagg.routing.endpoint import EndpointError, StreamEvent

        self.requests.append((public_model, req))
        words = self.text.split(" ")
        step = self._next
        if isinstance(step, tuple) and step[0] == "fail":
            raise EndpointError(step[1], f"scripted {step[1]}")
        limit = step[1] if isinstance(step, tuple) and step[0] == "cut" else len(words)
        for i, word in enumerate(words[:limit]):
            yield StreamEvent(word if i == 0 else " " + word)
        if limit < len(words):
            raise EndpointError(step[2], f"scripted {step[2]} mid-stream")
        usage = {"prompt_tokens": 3, "completion_tokens": len(words)}
        yield StreamEvent(finish_reason="stop", usage=usage)
