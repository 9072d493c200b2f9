#!/usr/bin/env python3
"""Grammar libraries for constrained decoding, compared on this CPU with SmolLM2's vocabulary
(issue 25, item 1): xgrammar, llguidance and outlines-core, whichever are importable.

For each library and each schema: the time to compile it (tokenizer info built once, not
counted), and the time per decode step to fill the token masks of 16 sequences (batch 16)
and advance each by its next token, over a reply that fits the schema, tokenized as our
tokenizer does. The mask is what sampling must wait for at every step.

    PYTHONPATH=/path/with/the/libraries python benchmarks/grammar_bench.py [--steps 64]

With `--engine`, also what guidance costs disagg's own decode engine (llguidance, as served):
the mean step time of 16 sequences decoding with and without a JSON-schema guide, rounds
interleaved (masks, replay and the per-row sampling they force, all included).

Prints a table; writes results/grammar_bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engines/smollm2-135m-instruct"
BATCH = 16

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
            },
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    ),
    "tool_args": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        {"city": "Paris", "unit": "celsius", "days": 3, "tags": ["rain", "wind", "sun"]},
    ),
    "any_json": ({"type": "object"}, {"a": [1, 2, {"b": "c"}], "d": None, "e": 1.5}),
}


def hf_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(ENGINE / "tokenizer.json"), eos_token="<|im_end|>"
    )


class Lib:
    name = ""

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matchers(self, compiled: Any, n: int) -> list[Any]: ...
    def step(self, matchers: list[Any], tokens: list[int]) -> bool: ...


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(BATCH, vocab)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def step(self, matchers: list[Any], tokens: list[int]) -> bool:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(self.mask, i)
        return all(m.accept_token(t) for m, t in zip(matchers, tokens, strict=True))


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.mask = llguidance.torch.allocate_token_bitmask(BATCH, vocab)
        self.fill = llguidance.torch.fill_next_token_bitmask

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        self.ll.LLMatcher(self.lltok, grammar)  # the first matcher pays the compile
        return grammar

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.ll.LLMatcher(self.lltok, compiled) for _ in range(n)]

    def step(self, matchers: list[Any], tokens: list[int]) -> bool:
        for i, m in enumerate(matchers):
            self.fill(m, self.mask, i)
        return all(m.consume_token(t) for m, t in zip(matchers, tokens, strict=True))


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, tok: Any, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        by_token: dict[str, list[int]] = {}
        for token, i in tok.get_vocab().items():
            if i != eos and i < vocab:
                by_token.setdefault(token, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_token)

    def compile(self, schema: dict[str, Any]) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.oc.Guide(compiled) for _ in range(n)]

    def step(self, matchers: list[Any], tokens: list[int]) -> bool:
        ok = True
        for m, t in zip(matchers, tokens, strict=True):
            allowed = m.get_tokens()
            ok = ok and t in allowed
            m.advance(t)
        return ok


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def engine_overhead(rounds: int) -> dict[str, float]:
    """Mean decode step (ms) of BATCH sequences, guided by a JSON schema or not, best round."""
    from disagg.engine.llm_engine import DecodeEngine
    from disagg.engine.sequence import SamplingParams
    from disagg.llm import LLM

    torch.set_num_threads(2)
    llm = LLM(str(ENGINE))
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}]
    ))  # fmt: skip
    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "bio": {"type": "string"}}})  # fmt: skip
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, guide in (("plain", {}), ("json_schema", {"guide_type": "json_schema",
                                                            "guide": schema})):  # fmt: skip
            engine = DecodeEngine(llm.model, llm.config, {llm.tokenizer.eos_token_id})
            params = SamplingParams(max_tokens=48, ignore_eos=True, **guide)  # type: ignore[arg-type]
            for i in range(BATCH):
                engine.add_request(f"r{i}", params, prompt_ids=ids)
            while any(s.prefilling or not s.output_ids for s in engine.scheduler.running) or (
                engine.scheduler.waiting
            ):
                engine.step()
            t0, steps = time.perf_counter(), 0
            while len(engine.scheduler.running) == BATCH and steps < 32:
                engine.step()
                steps += 1
            ms = (time.perf_counter() - t0) / steps * 1e3
            best[name] = min(best.get(name, ms), ms)
            print(f"engine {name}: {ms:.1f} ms/step at batch {BATCH}", flush=True)
    best["overhead_pct"] = round((best["json_schema"] / best["plain"] - 1) * 100, 1)
    print(f"guided decoding costs {best['overhead_pct']}% per step at batch {BATCH}")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per schema")
    ap.add_argument("--out", default=str(ROOT / "results/grammar_bench.json"))
    ap.add_argument("--engine", action="store_true", help="also time our decode engine")
    ap.add_argument("--rounds", type=int, default=3, help="engine rounds per variant")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = hf_tokenizer()
    vocab = len(tok)
    rows = []
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        try:
            setup_s, lib = timed(lambda cls=cls: cls(tok, vocab))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
            continue
        for sname, (schema, instance) in SCHEMAS.items():
            text = json.dumps(instance, separators=(",", ":"))
            reply = tok.encode(text, add_special_tokens=False)
            try:
                compile_s, compiled = timed(lambda lib=lib, schema=schema: lib.compile(schema))
            except Exception as e:  # noqa: BLE001 - a library refusing a schema is a result
                rows.append({"library": lib.name, "schema": sname, "error": str(e)[:200]})
                continue
            matchers = lib.matchers(compiled, BATCH)
            times, accepted = [], True
            for i in range(min(args.steps, len(reply))):
                dt, ok = timed(lambda lib=lib, m=matchers, t=reply[i]: lib.step(m, [t] * BATCH))
                times.append(dt)
                accepted = accepted and ok
            rows.append(
                {
                    "library": lib.name,
                    "schema": sname,
                    "setup_s": round(setup_s, 3),
                    "compile_ms": round(compile_s * 1e3, 2),
                    "steps": len(times),
                    "mask_ms_p50": round(statistics.median(times) * 1e3, 3),
                    "mask_ms_max": round(max(times) * 1e3, 3),
                    "reply_accepted": accepted,
                }
            )
            print(rows[-1], flush=True)
    print(
        f"\n{'library':<14}{'schema':<11}{'compile ms':>11}{'batch-16 step p50 ms':>22}"
        f"{'max ms':>9}{'accepted':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['library']:<14}{r['schema']:<11}  refused: {r['error']}")
            continue
        print(
            f"{r['library']:<14}{r['schema']:<11}{r['compile_ms']:>11}{r['mask_ms_p50']:>22}"
            f"{r['mask_ms_max']:>9}{r['reply_accepted']!s:>9}"
        )
    engine = engine_overhead(args.rounds) if args.engine else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": platform.processor() or platform.machine(), "threads": 1}
    result = {"machine": machine, "batch": BATCH, "rows": rows, "engine": engine}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
