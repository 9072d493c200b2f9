"""Orchestration without Triton: the orchestrator over two pool interfaces, the conditional
cost model, decode's engine loop, and in-process pools (local.py). The Triton models
(triton/pools.py) and the in-process facade (llm.py) are two implementations of its pools."""
