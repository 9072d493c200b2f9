"""Each phase of a sweep (calibration, then every rate) sends texts of its own: the rates draw
the same seeded requests, and with the same texts a later rate would find an earlier one's
prompts in the server's prefix cache and measure cache hits, not load."""

from __future__ import annotations

import pytest

from disagg.bench import workloads as W
from disagg.bench.sweep import calibration_specs, phase_prompts

pytestmark = pytest.mark.unit


class WordTokenizer:
    """A tokenizer stand-in (no model here): one id per distinct word."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        for w in text.split():
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
        return [self.ids[w] for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def test_every_phase_sends_texts_no_other_phase_began_with():
    prompts = W.PromptMaker(WordTokenizer())  # type: ignore[arg-type]
    workload = W.WORKLOADS["mixed"]
    phases = [calibration_specs(workload, 3, seed=0)]
    phases += [W.build(workload, rate, 20, seed=0) for rate in (0.5, 1.0, 2.0)]
    assert [s.index for s in phases[1]] == [s.index for s in phases[2]]  # why it matters
    first, heads = 0, []
    for specs in phases:
        text_of, first = phase_prompts(prompts, specs, first)
        texts = [text_of(s) for s in specs]
        assert [len(t.split()) for t in texts] == [s.prompt_tokens for s in specs]
        heads.append({" ".join(t.split()[:16]) for t in texts})  # a prefix-cache block
    for i, a in enumerate(heads):
        for b in heads[i + 1 :]:
            assert not a & b
