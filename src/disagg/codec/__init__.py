"""One codec per boundary message: which tensors make up each call and each answer between
disagg's models, with their dtypes and shapes, declared once and used by both sides, as
vLLM encodes `EngineCoreRequest` in one place. Tensor names come from contracts.py; the
config.pbtxt templates declare exactly these tensors (tests/unit/test_codec.py).

    tensors.py   TensorSpec / Tensors, reading inputs into values, failures as outputs
    generate.py  the client-facing messages: router, orchestrator, tokenizer, ensemble
    pools.py     the orchestrator's calls of its pools: prefill and decode

Each message encodes to a dict of numpy arrays (name -> array) and decodes from one; the
adapters (triton/, remote/, the gateway, the client) only move those arrays. numpy only: no
Triton, no torch.
"""
