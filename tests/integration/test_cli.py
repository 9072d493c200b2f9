"""`disagg generate` as a user runs it: a real process, the real engine directory."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def run(engine_dir, *args):
    return subprocess.run(
        [sys.executable, "-m", "disagg", "generate", "--engine-dir", str(engine_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_streams_a_chat_reply(engine_dir):
    r = run(engine_dir, "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr


def test_generate_rejects_bad_input_with_a_message(engine_dir):
    r = run(engine_dir, "--prompt", "hi", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens must be in [1," in r.stderr
