"""A server told to stop (SIGINT/SIGTERM: a pod being drained) refuses new requests and lets
the ones in flight finish within `drain_s` (docs/kubernetes.md, Draining)."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.triton_server import start_server

from disagg import contracts as C
from disagg.client import GenerateError, HttpClient

pytestmark = pytest.mark.integration


def test_a_stopping_server_finishes_the_stream_in_flight_and_refuses_new_ones(engine_dir, tmp_path):
    server = start_server(engine_dir, tmp_path / "triton", drain_s=30.0)
    http = HttpClient(server.endpoints.http, timeout_s=60)
    got, started = {}, threading.Event()

    def stream():
        body = {C.TEXT_INPUT: "Tell me a story.", C.MAX_TOKENS: 64, C.IGNORE_EOS: True}
        try:
            got["r"] = http.generate("router", body, stream=True, on_delta=lambda d: started.set())
        except GenerateError as e:
            got["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    stopping = threading.Thread(target=server.stop)
    try:
        assert started.wait(60), "the stream never started"
        stopping.start()
        time.sleep(1.0)  # Triton has begun its shutdown
        with pytest.raises((GenerateError, OSError)):  # a new request is refused, not queued
            HttpClient(server.endpoints.http, timeout_s=10).generate(
                "router", {C.TEXT_INPUT: "Hi", C.MAX_TOKENS: 2}
            )
        t.join(60)
    finally:
        if stopping.is_alive() or stopping.ident is not None:
            stopping.join(90)
        server.stop()
    assert "error" not in got, got
    r = got["r"]
    assert r.num_output_tokens == 64 and r.finish_reason == "length"
