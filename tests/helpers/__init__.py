"""Test helpers shared by the layers (tests/ is on sys.path: `from helpers.x import ...`).

    scripted.py       stub tokenizer, scripted prefill/decode pools and local pipeline
    fake_openai.py    a fault-injecting OpenAI-compatible server (stands for a paid API)
    triton_server.py  a real tritonserver on loopback, and reading its metrics

Stand-ins for libraries that cannot run here (triton_python_backend_utils, tensorrt_llm)
are in tests/fakes/, imported under the libraries' own names.
"""
