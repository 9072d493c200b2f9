"""Heterogeneous routing: a declarative policy, external OpenAI-compatible endpoints (the LPU
pool) with rate-limit and circuit-breaker state, and the router that serves each request on
the target the policy and that state choose, falling back to the local pipeline."""
