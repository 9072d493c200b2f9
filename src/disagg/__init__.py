"""disagg: disaggregated LLM inference on NVIDIA Triton Inference Server.

The package the Triton models in model_repository/ wrap thinly, in layers (see
docs/architecture.md): contracts and settings, the CPU engine, orchestration without Triton
(pipeline/), routing, the Triton adapter (triton/, the only code that imports
triton_python_backend_utils), the OpenAI-compatible gateway, and `disagg serve`.
"""

__version__ = "0.1.0"
