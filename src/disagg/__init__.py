"""disagg: disaggregated LLM inference on NVIDIA Triton Inference Server.

The package holds the engine (model, KV cache, scheduler, sampling, tokenizer) that the
Triton models in model_repository/ wrap thinly. Nothing here imports Triton.
"""

__version__ = "0.1.0"
