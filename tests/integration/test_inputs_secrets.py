"""Hostile inputs and secrets on a real tritonserver with the gateway in front: a request head
over the limits (431), request fields that are no input of the model (Triton's generate
endpoint and gRPC infer), a client's bad value repeated into the gateway log, and which
process holds which secret (docs/reliability.md, "Hostile input" and "Which door")."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from helpers.triton_server import eventually, start_server
from tritonclient.utils import InferenceServerException

from disagg.contracts import ADMIN_KEY_ENV, TOKEN_ENV
from disagg.gateway.auth import KEYS_ENV
from disagg.serve.gateway_process import GatewayProcess
from disagg.serve.server import free_ports
from disagg.serve.supervisor import stub_processes

pytestmark = pytest.mark.integration
KEYS = ("sk-secrets-test-alpha-0123", "sk-secrets-test-beta-4567")
ADMIN = "test-admin-key"  # what helpers.triton_server.start_server gives tritonserver
TOKEN = "secrets-test-internal-token-0123"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def stack(engine_dir, tmp_path_factory):
    """A server started as `disagg serve` starts one when the operator exported the keys:
    API keys, admin key and internal token all in the environment it runs in."""
    given = {KEYS_ENV: ",".join(KEYS), ADMIN_KEY_ENV: ADMIN, TOKEN_ENV: TOKEN}
    saved = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        server = start_server(engine_dir, tmp_path_factory.mktemp("secrets"))
        (port,) = free_ports(1)
        settings = replace(server.settings, gateway_port=port)
        gateway = GatewayProcess(settings, env={ADMIN_KEY_ENV: server.admin_key}).start()
        try:
            gateway.wait_ready()
            yield server, gateway
        finally:
            gateway.stop()
            server.stop()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def server(stack):
    return stack[0]


@pytest.fixture(scope="module")
def gateway(stack):
    return stack[1]


# ------------------------------------------------------------------ request heads


def _send_head(gateway, head: bytes, piece: int = 0) -> bytes:
    """What the gateway answers a raw request head (all at once, or `piece` bytes at a time,
    as a slow client sends it)."""
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            if piece:
                for i in range(0, len(head), piece):
                    s.sendall(head[i : i + piece])
                    time.sleep(0.002)
            else:
                s.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole head was sent: the answer is still there to read
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def _get(headers: dict[str, str]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"GET /health HTTP/1.1\r\nHost: x\r\n{lines}Connection: close\r\n\r\n".encode()


def test_a_100_kb_header_gets_431_and_a_usual_head_is_served(gateway):
    answer = _send_head(gateway, _get({"X-Big": "a" * 100_000}))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_header_fields_too_large"
    # many lines, each under 8 KiB, together over 16 KiB
    many = {f"X-Part-{i}": "b" * 4000 for i in range(6)}
    assert _send_head(gateway, _get(many)).startswith(b"HTTP/1.1 431 ")
    # a head that trickles in: h11 refuses it while it is still arriving, also as a 431
    trickled = _send_head(gateway, _get({"X-Big": "c" * 60_000}), piece=1024)
    assert trickled.startswith(b"HTTP/1.1 431 "), trickled[:200]
    # a 6 KB cookie is a usual head: served
    assert _send_head(gateway, _get({"Cookie": "d" * 6000})).startswith(b"HTTP/1.1 200 ")


# ------------------------------------------------------------------ inputs that are no input


def _generate(server, model: str, body: dict, stream: bool = False) -> tuple[int, str]:
    url = f"{server.endpoints.http}/v2/models/{model}/generate{'_stream' if stream else ''}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("model", ["router", "router_sync", "ensemble", "orchestrator"])
def test_a_generate_field_that_is_no_input_is_refused_by_name(server, model):
    """Triton passes such a field on as a request parameter (at the top level or under
    "parameters"); before, every model here served the request without it."""
    base = {"text_input": "Hi", "max_tokens": 2}
    if model != "orchestrator":  # its client-facing prompt input is input_ids
        assert _generate(server, model, base)[0] == 200
    for body in ({**base, "max_token": 8}, {**base, "parameters": {"max_token": 8}}):
        status, text = _generate(server, model, body)
        assert status == 400, text
        assert "unknown input 'max_token'" in json.loads(text)["error"], text
    status, text = _generate(server, "router", {**base, "max_token": 8}, stream=True)
    assert "unknown input 'max_token'" in text, (status, text)


def _grpc_inputs(extra: str = "") -> list[grpcclient.InferInput]:
    arrays = {"text_input": np.array([[b"Hi"]], dtype=object), "max_tokens": np.array([[2]])}
    if extra:
        arrays[extra] = np.array([[8]])
    inputs = []
    for name, arr in arrays.items():
        dtype = "BYTES" if arr.dtype == object else "INT32"
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr if dtype == "BYTES" else arr.astype(np.int32))
        inputs.append(t)
    return inputs


@pytest.mark.parametrize("model", ["router_sync", "ensemble_sync"])
def test_a_grpc_input_or_parameter_the_model_lacks_is_refused_by_name(server, model):
    client = grpcclient.InferenceServerClient(server.endpoints.grpc)
    assert client.infer(model, _grpc_inputs()).as_numpy("text_output") is not None
    with pytest.raises(InferenceServerException, match="unexpected inference input 'max_token'"):
        client.infer(model, _grpc_inputs(extra="max_token"))  # Triton's own check
    with pytest.raises(InferenceServerException, match="unknown input 'max_token'"):
        client.infer(model, _grpc_inputs(), parameters={"max_token": 8})  # ours


# ------------------------------------------------------------------ the gateway's log


def _chat(gateway, body: dict, rid: str) -> int:
    req = urllib.request.Request(
        gateway.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEYS[0]}", "x-request-id": rid},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_bad_value_is_logged_bounded_and_on_one_line(gateway):
    messages = [{"role": "user", "content": "Hi"}]
    huge = {"model": MODEL, "messages": messages, "temperature": "x" * 1_000_000}
    assert _chat(gateway, huge, "log-huge-1") == 400
    forged = "nope'\n2030-01-01 00:00:00,000 disagg.gateway: request forged-1: 200 \x1b[2K"
    assert _chat(gateway, {"model": forged, "messages": messages}, "log-forged-1") == 404

    def check():
        lines = Path(gateway.log_path).read_text().splitlines()
        for rid in ("log-huge-1", "log-forged-1"):
            mine = [line for line in lines if rid in line]
            assert len(mine) == 1, mine
            assert len(mine[0]) < 1000, len(mine[0])
        assert not [line for line in lines if "forged-1" in line and "log-forged-1" not in line]
        assert not any("\x1b" in line for line in lines)

    eventually(check)


# ------------------------------------------------------------------ secrets


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_only_the_gateway_holds_the_api_and_admin_keys(server, gateway):
    pid = server.proc.pid
    stubs = stub_processes(pid)
    assert len(stubs) >= 7, stubs  # tokenizer, router(_sync), orchestrator(_sync), prefill, decode
    for p in [pid, *stubs]:
        env = _environ(p)
        for secret in (*KEYS, ADMIN, KEYS_ENV, ADMIN_KEY_ENV):
            assert secret.encode() not in env, (p, stubs.get(p), secret)
        assert f"{TOKEN_ENV}={TOKEN}".encode() in env  # the models' own secret stays
    gw_env = _environ(gateway.proc.pid)
    assert TOKEN.encode() not in gw_env
    assert all(key.encode() in gw_env for key in KEYS) and ADMIN.encode() in gw_env
    # and the gateway still authenticates with them
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS[1], max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content
    wrong = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    admin = urllib.request.Request(gateway.url + "/admin/models", headers={"admin-key": ADMIN})
    with urllib.request.urlopen(admin, timeout=10) as r:
        assert r.status == 200
