"""A fault-injecting OpenAI-compatible chat-completions server on loopback.

It stands for a paid external API (Groq's LPU endpoint) that cannot be called from tests:
real HTTP and SSE over a real socket, with scripted faults. Each request takes the next
scripted behaviour (then "ok"):

    "ok"            stream the reply (canned words, or a real model's text with `generate`)
    ("status", code, headers, body)    answer with that status, e.g. 429 + retry-after
    "hang"          send the response headers, then nothing (a first-token timeout)
    "cut"           stream two chunks, then drop the connection (no finish, no [DONE])
    "malformed"     one chunk, then a `data:` line that is not JSON
    "echo_key_401"  a 401 whose body repeats the Authorization header (redaction test)

A request with `tools` (and tool_choice other than "none") is answered as OpenAI streams a
call: the named function, or the first, with TOOL_ARGS as its arguments in three deltas,
and finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CANNED = "The quick brown fox jumps over the lazy dog and keeps on running far away"
TOOL_ARGS = '{"city": "Paris", "unit": "celsius"}'


def canned(body: dict) -> Iterator[str]:
    words = CANNED.split()[: int(body.get("max_tokens", 16))]
    for i, w in enumerate(words):
        yield w if i == 0 else " " + w


class FakeOpenAI:
    def __init__(
        self,
        key: str,
        generate: Callable[[dict], Iterator[str]] = canned,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.key = key
        self.generate = generate
        self.ok_headers = dict(headers or {})  # e.g. x-ratelimit-* on successful answers
        self.script: deque = deque()
        self.requests: list[dict] = []  # bodies received, in order
        self.auth_headers: list[str] = []
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def push(self, *behaviours) -> None:
        self.script.extend(behaviours)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                auth = self.headers.get("Authorization", "")
                fake.requests.append(body)
                fake.auth_headers.append(auth)
                behaviour = fake.script.popleft() if fake.script else "ok"
                if behaviour == "echo_key_401":
                    return self._status(401, {}, {"error": {"message": f"bad key in {auth}"}})
                if auth != f"Bearer {fake.key}":
                    return self._status(401, {}, {"error": {"message": "invalid api key"}})
                if isinstance(behaviour, tuple):
                    _, code, headers, err = behaviour
                    return self._status(code, headers, err)
                self._stream(body, behaviour)

            def _status(self, code: int, headers: dict, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _event(self, obj) -> None:
                data = obj if isinstance(obj, str) else json.dumps(obj)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()

            def _chunk(self, text: str | None, finish: str | None = None) -> dict:
                delta = {} if text is None else {"content": text}
                return {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion.chunk",
                    "model": "fake",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }

            def _stream(self, body: dict, behaviour: str) -> None:
                self.send_response(200)
                for k, v in fake.ok_headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                if behaviour == "hang":
                    fake.stopping.wait(30)
                    return
                self._event(
                    {
                        **self._chunk(None),
                        "choices": [
                            {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
                        ],
                    }
                )  # noqa: E501
                if body.get("tools") and body.get("tool_choice") != "none":
                    return self._tool_call(body)
                pieces = list(fake.generate(body))
                for i, piece in enumerate(pieces):
                    if behaviour == "cut" and i == 2:
                        self.connection.shutdown(2)  # both directions: a reset mid-stream
                        return
                    if behaviour == "malformed" and i == 1:
                        self._event("{not json")
                        return
                    self._event(self._chunk(piece))
                    time.sleep(0.005)
                finish = "length" if len(pieces) >= int(body.get("max_tokens", 16)) else "stop"
                self._event(self._chunk(None, finish))
                usage = {
                    "prompt_tokens": sum(
                        len((m.get("content") or "").split()) for m in body["messages"]
                    ),  # fmt: skip
                    "completion_tokens": len(pieces),
                    "total_tokens": 0,
                }
                self._event({**self._chunk(None), "choices": [], "usage": usage})
                self._event("[DONE]")

            def _tool_call(self, body: dict) -> None:
                choice = body.get("tool_choice")
                named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
                name = named or body["tools"][0]["function"]["name"]
                cut = [0, 10, 25, len(TOOL_ARGS)]
                for i in range(3):
                    fn = {"arguments": TOOL_ARGS[cut[i] : cut[i + 1]]}
                    delta: dict = {"index": 0, "function": fn}
                    if i == 0:  # the first delta names the call
                        delta.update(
                            id="call_fake0", type="function", function={"name": name, **fn}
                        )
                    chunk = self._chunk(None)
                    chunk["choices"][0]["delta"] = {"tool_calls": [delta]}
                    self._event(chunk)
                    time.sleep(0.005)
                self._event(self._chunk(None, "tool_calls"))
                usage = {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
                self._event({**self._chunk(None), "choices": [], "usage": usage})
                self._event("[DONE]")

        return Handler
