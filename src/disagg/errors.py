"""Error layers: a request error ends one request, an engine error ends the engine.

Adapters map `RequestError` to a client error (HTTP 4xx / Triton error for that request
alone), `CapacityError` to a retryable "busy" answer, and `EngineDeadError` to a fatal,
visible failure.
"""

from __future__ import annotations


class DisaggError(Exception):
    """Base class of every error disagg raises on purpose."""


class RequestError(DisaggError, ValueError):
    """The request itself is wrong (bad input); retrying it unchanged cannot succeed."""


class CapacityError(DisaggError):
    """The engine is full right now; the same request may succeed later."""


class EngineDeadError(DisaggError):
    """The engine hit an unrecoverable failure; no further request will be served."""


class PoolError(DisaggError):
    """A pool or pipeline failed, timed out or is unavailable; the request itself may be fine."""


class KVPayloadError(PoolError):
    """A KV hand-off failed: its payload could not be pulled (the lease expired, the prefill
    server is gone or refused), arrived corrupted (CRC), or is for another model or layout.
    Never the client's error (clients cannot send payloads): the orchestrator lets decode
    prefill the prompt itself instead."""


class KVPrefixMissError(PoolError):
    """Decode no longer holds the prompt prefix a partial KV hand-off left out (evicted,
    restarted, or another orchestrator's guess): hand the whole prompt's K/V off again."""


class RequestCancelledError(PoolError):
    """Work for a request was stopped because its client went away (or it was cancelled).
    A PoolError so that a caller that knows no better routes around it; the orchestrator
    asks the request itself whether it was cancelled and falls back to nothing."""


class ConfigError(DisaggError):
    """A setting or an engine directory is invalid; raised at start, never per request."""
