import pytest

from disagg.engine.llm_engine import DecodeEngine, PrefillEngine


@pytest.fixture(scope="module")
def engines(llm):
    """One prefill and one decode engine for a module (building one costs seconds)."""
    eos = {llm.tokenizer.eos_token_id}
    prefill = PrefillEngine(llm.model, llm.config, eos_token_ids=eos)
    return prefill, DecodeEngine(llm.model, llm.config, eos)
