"""The OpenAI-compatible gateway: the stable API business code talks to (chat/completions,
models, SSE), with API keys, per-key limits and a model registry with canary versions.
It talks to Triton's `router` over gRPC streaming and never to a model process."""
