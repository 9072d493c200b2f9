"""TensorRT-LLM behind the same prefill/decode contract as the PyTorch engine.

TensorRT-LLM's LLM API (its PyTorch backend) runs disaggregated
serving itself: a `context_only` request computes the prompt's KV cache and returns
`DisaggregatedParams`; a `generation_only` request with those parameters continues on another
executor, its KV cache pulled through TensorRT-LLM's cache transceiver (UCX or NIXL), never
through Triton. So here the "KV payload" the orchestrator forwards is the serialised
parameters (and the prompt), a few hundred bytes, and the orchestrator, router, gateway and
clients do not change.

Imports of `tensorrt_llm` happen only when an engine is built (it needs an NVIDIA GPU).
"""
