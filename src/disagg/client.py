"""Clients of the served pipeline: Triton's generate extension over HTTP (SSE for streams) and
gRPC bidirectional streaming with tritonclient. Each call returns a `Result` with the text,
its deltas, and the timings a user cares about (TTFT, tokens/s)."""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from disagg import contracts as C
from disagg.codec.generate import CLIENT_OUTPUTS, RouterReply, client_inputs
from disagg.codec.tensors import scalar, triton_dtype

if TYPE_CHECKING:  # (tritonclient has no types: these are Any to mypy, names to readers)
    from tritonclient.grpc import InferInput, InferResult
    from tritonclient.utils import InferenceServerException


class GenerateError(Exception):
    """The server answered the request with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Result:
    text: str = ""
    deltas: list[str] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0  # request sent -> first text
    total_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # other outputs of the final response

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token (over the whole call if it was one response)."""
        if len(self.deltas) <= 1:
            return self.num_output_tokens / self.total_s if self.total_s > 0 else 0.0
        span = self.total_s - self.ttft_s
        return (self.num_output_tokens - 1) / span if span > 0 else 0.0


def _absorb(
    result: Result, out: Mapping[str, Any], start: float, on_delta: Callable[[str], None] | None
) -> None:
    text = out.get(C.TEXT_OUTPUT, "")
    if isinstance(text, list):
        text = text[0] if text else ""
    if text:
        if not result.deltas:
            result.ttft_s = time.perf_counter() - start
        result.deltas.append(text)
        result.text += text
        if on_delta:
            on_delta(text)
    for key in (C.NUM_INPUT_TOKENS, C.NUM_OUTPUT_TOKENS):
        if key in out:
            setattr(result, key, int(np.asarray(out[key]).reshape(-1)[0]))
    reason = out.get(C.FINISH_REASON)
    if reason:
        result.finish_reason = reason[0] if isinstance(reason, list) else reason


class HttpClient:
    """Triton's generate / generate_stream endpoints (JSON in, JSON or SSE out)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def generate(
        self,
        model: str,
        inputs: Mapping[str, Any],
        stream: bool = False,
        on_delta: Callable[[str], None] | None = None,
    ) -> Result:
        endpoint = "generate_stream" if stream else "generate"
        body = json.dumps({**inputs, C.STREAM: stream}).encode()
        req = urllib.request.Request(
            f"{self.url}/v2/models/{model}/{endpoint}",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        result, start = Result(), time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                try:
                    self._read(resp, stream, result, start, on_delta)
                except TimeoutError:  # no answer in time: a hang, not a clear error
                    raise
                except (OSError, http.client.HTTPException) as e:  # broken mid-reply
                    raise GenerateError(f"the server went away mid-reply: {e}") from None
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read()).get("error", str(e))
            except ValueError:
                message = str(e)
            raise GenerateError(message, e.code) from None
        if stream and not result.finish_reason:  # our models' last response always has one
            raise GenerateError(
                "the stream ended without its final response (the server went away)"
            )
        result.total_s = time.perf_counter() - start
        return result

    @staticmethod
    def _read(
        resp: Any,
        stream: bool,
        result: Result,
        start: float,
        on_delta: Callable[[str], None] | None,
    ) -> None:
        if not stream:
            out = json.loads(resp.read())
            _absorb(result, out, start, on_delta)
            result.extra = out
        for line in resp if stream else ():
            if not line.startswith(b"data:"):
                continue
            out = json.loads(line[5:])
            if C.ERROR in out and C.TEXT_OUTPUT not in out:  # Triton's error event
                raise GenerateError(out[C.ERROR])  # (the router's final has `error` too)
            _absorb(result, out, start, on_delta)
            result.extra = out


def grpc_inputs(inputs: Mapping[str, Any]) -> list[InferInput]:
    """Inputs of an entry model (router, ensemble, orchestrator) as tritonclient inputs, each
    with its declared dtype (codec.generate.client_inputs)."""
    import tritonclient.grpc as grpcclient

    out = []
    for name, arr in client_inputs(inputs).items():
        t = grpcclient.InferInput(name, list(arr.shape), triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def output_value(result: InferResult, name: str) -> str | int | None:
    """One scalar output of a tritonclient result (text decoded), or None when absent."""
    return scalar(result.as_numpy(name))


class GrpcClient:
    """Bidirectional gRPC streaming with tritonclient (the decoupled `ensemble`)."""

    OUTPUTS = CLIENT_OUTPUTS.names
    # what the router adds to its final response; kept in Result.extra when present
    EXTRA_OUTPUTS = RouterReply.EXTRAS.names

    def __init__(self, url: str = "127.0.0.1:8001", timeout_s: float = 300.0) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.timeout_s = timeout_s

    def generate(
        self,
        model: str,
        inputs: Mapping[str, Any],
        stream: bool = True,
        on_delta: Callable[[str], None] | None = None,
        cancel_after_deltas: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Result:
        """The stream is cancelled after `cancel_after_deltas` deltas, or at the first response
        after `cancel` is set (a caller stopping a stream it no longer wants)."""
        events: queue.Queue[tuple[InferResult, InferenceServerException | None]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: events.put((result, error)))
        result, start = Result(), time.perf_counter()
        try:
            self.client.async_stream_infer(
                model,
                grpc_inputs({**inputs, C.STREAM: stream}),
                enable_empty_final_response=True,
            )
            while True:
                res, error = events.get(timeout=self.timeout_s)
                if error is not None:
                    raise GenerateError(str(error))
                out = {n: output_value(res, n) for n in self.OUTPUTS}
                _absorb(result, {k: v for k, v in out.items() if v is not None}, start, on_delta)
                for name in self.EXTRA_OUTPUTS:
                    value = output_value(res, name)
                    if value is not None:
                        result.extra[name] = value
                final = res.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
                limit = cancel_after_deltas
                if (limit is not None and len(result.deltas) >= limit) or (
                    cancel is not None and cancel.is_set()
                ):
                    self.client.stop_stream(cancel_requests=True)
                    result.finish_reason = "cancelled"
                    break
        finally:
            self.client.stop_stream()
        result.total_s = time.perf_counter() - start
        return result

    def close(self) -> None:
        self.client.close()
