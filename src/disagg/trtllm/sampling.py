"""Our request parameters in TensorRT-LLM's LLM API terms (1.0): sampling, guides,
logprobs, and `TrtllmApi`, the few names of `tensorrt_llm` used (a test double stands in for
them without a GPU). Checked against upstream's tensorrt_llm/sampling_params.py and
_torch/pyexecutor/grammar_matcher.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disagg.engine.sequence import SamplingParams, TokenLogprob
from disagg.errors import RequestError

if TYPE_CHECKING:  # (tensorrt_llm has no types: Any to mypy, names to readers)
    import tensorrt_llm


@dataclass(frozen=True)
class TrtllmApi:
    """The few names of `tensorrt_llm` used here (a test double stands in without a GPU)."""

    LLM: Any
    SamplingParams: Any
    DisaggregatedParams: Any
    GuidedDecodingParams: Any = None

    @classmethod
    def load(cls) -> TrtllmApi:
        import tensorrt_llm
        from tensorrt_llm.llmapi import DisaggregatedParams, GuidedDecodingParams

        return cls(
            tensorrt_llm.LLM, tensorrt_llm.SamplingParams, DisaggregatedParams, GuidedDecodingParams
        )


# our guide types -> GuidedDecodingParams' field (1.0, tensorrt_llm/sampling_params.py):
# json_object -> GuideType.JSON, json -> JSON_SCHEMA, regex -> REGEX, grammar -> EBNF_GRAMMAR
GUIDE_FIELDS = {"json": "json_object", "json_schema": "json", "regex": "regex",
                "ebnf_grammar": "grammar", "lark": "grammar"}  # fmt: skip


def trt_guide(api: TrtllmApi, params: SamplingParams, backend: str | None) -> Any:
    """The request's guide as GuidedDecodingParams, or None. Refused unless the pool's LLM
    was built with a guided_decoding_backend (without one 1.0 would, as far as its source
    shows, build no GuidedDecoder and ignore the guide), and for what 1.0 cannot take: a
    Lark grammar under xgrammar, a continued stream (no way to tell its grammar the tokens
    already sent)."""
    if not params.guide_type:
        return None
    if backend is None:
        raise RequestError(
            "guided decoding needs guided_decoding_backend (xgrammar or llguidance) in this "
            "pool's TensorRT-LLM options"
        )
    name = GUIDE_FIELDS.get(params.guide_type)
    if name is None:
        raise RequestError(
            f"guide type {params.guide_type} is not supported with TensorRT-LLM "
            f"(it takes {', '.join(GUIDE_FIELDS)})"
        )
    if params.guide_tokens:
        raise RequestError("a guided stream cannot be continued on TensorRT-LLM pools")
    if name == "grammar":
        return api.GuidedDecodingParams(grammar=trt_grammar(backend, params))
    value: object = True if name == "json_object" else params.guide
    return api.GuidedDecodingParams(**{name: value})


def trt_grammar(backend: str, params: SamplingParams) -> str:
    """A grammar as the pool's backend reads GuidedDecodingParams.grammar: 1.0's llguidance
    matcher takes it as Lark (_torch/pyexecutor/grammar_matcher.py, LLGuidanceMatcherFactory:
    grammar_from_lark, "LLGuidance expects Lark grammar format, not standard EBNF"), so a
    GBNF grammar is converted as our own engine converts it; xgrammar takes EBNF
    (Grammar.from_ebnf), so a Lark grammar (a required or named tool call, guided_choice)
    has no form there."""
    if backend == "llguidance":
        if params.guide_type == "lark":
            return params.guide
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return str(any_to_lark(params.guide))
        except Exception as e:  # noqa: BLE001 - the converter's errors name what is wrong
            raise RequestError(f"the ebnf_grammar guide does not parse: {e}") from e
    if params.guide_type == "lark":
        raise RequestError(
            "this guide is a Lark grammar (a required or named tool call, a choice): a "
            "TensorRT-LLM pool takes it with guided_decoding_backend llguidance, not "
            f"{backend}"
        )
    return params.guide


def trt_sampling(
    api: TrtllmApi,
    params: SamplingParams,
    seed: int,
    max_tokens: int | None = None,
    perf_metrics: bool = False,
    guided_backend: str | None = None,
) -> tensorrt_llm.SamplingParams:
    """Our sampling parameters in the LLM API's terms.

    Greedy is top_k=1: TensorRT-LLM 1.0 decides greedy from top_k/top_p alone
    (SamplingParams._greedy_decoding), so temperature=0 would sample. Stop strings never go
    down: the orchestrator matches them on the text and ends the request (finish_request).
    Bad words go down as `bad_token_ids`, which bans single tokens only: a longer sequence is
    refused rather than silently dropped. Penalties and min_tokens go down under the same
    names (SamplingParams 1.0), counted by TensorRT-LLM's own kernels; min_tokens is capped at
    this call's max_tokens (prefill's context request asks for one token). logit_bias would
    need `embedding_bias`, a [vocab] tensor: refused until that is wired."""
    kwargs: dict[str, Any] = dict(
        max_tokens=max_tokens or params.max_tokens, seed=seed, ignore_eos=params.ignore_eos
    )
    if params.is_greedy:
        kwargs["top_k"] = 1
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p)
        if params.top_k > 0:
            kwargs["top_k"] = params.top_k
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = list(params.stop_token_ids)
    if params.min_tokens:
        kwargs["min_tokens"] = min(params.min_tokens, kwargs["max_tokens"])
    penalties = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))
    for name, off in penalties:
        if getattr(params, name) != off:
            kwargs[name] = getattr(params, name)
    if params.logit_bias:
        raise RequestError("logit_bias is not supported with TensorRT-LLM yet")
    if (guide := trt_guide(api, params, guided_backend)) is not None:
        kwargs["guided_decoding"] = guide
    if params.bad_words_ids:
        if any(len(words) != 1 for words in params.bad_words_ids):
            raise RequestError(
                "bad words longer than one token are not supported with TensorRT-LLM "
                "(its bad_token_ids bans single tokens)"
            )
        kwargs["bad_token_ids"] = [words[0] for words in params.bad_words_ids]
    if params.logprobs is not None:  # (0 would ask for none: the token's own is top 1)
        kwargs["logprobs"] = max(params.logprobs, 1)
    if perf_metrics:  # where the installed SamplingParams has it: KV reuse per request
        kwargs["return_perf_metrics"] = True
    return api.SamplingParams(**kwargs)


def trt_logprob(entry: Any, token: int, k: int) -> TokenLogprob | None:
    """One token's entry of TensorRT-LLM 1.0's CompletionOutput.logprobs (executor/result.py:
    {token id: Logprob(logprob, rank)}, the top ones and the sampled token; or a bare float)
    as ours: the sampled token's logprob and the `k` best. What 1.0 computes differs by
    backend: the TRT backend's top-k from the raw logits (as ours); the PyTorch backend's
    sampled token alone, from the processed distribution."""
    if isinstance(entry, int | float):
        return TokenLogprob(float(entry))
    if not isinstance(entry, dict) or token not in entry:
        return None
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))
    top = [(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank is None or lp.rank <= k]
    return TokenLogprob(float(entry[token].logprob), tuple(top[:k]))
