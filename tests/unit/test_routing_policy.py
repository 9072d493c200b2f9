"""The routing policy (parsing, validation, first-match rules) and endpoint health state
(circuit breaker, rate-limit budget), from plain values and a hand-driven clock."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from disagg import contracts as C
from disagg.errors import ConfigError
from disagg.routing.health import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    CircuitBreaker,
    RateLimits,
    parse_duration,
)
from disagg.routing.policy import PolicySource, RouteFeatures, load_policy, parse_policy

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def base(**extra) -> dict:
    data = {
        "default": "local",
        "targets": {
            "local": {"kind": "triton", "model": "orchestrator"},
            "lpu": {"kind": "openai", "endpoints": ["groq"], "fallback": "local"},
        },
        "endpoints": {"groq": {"api_key_env": "GROQ_API_KEY"}},
        "rules": [
            {"name": "offline", "when": {"task_type": "batch_offline"}, "target": "local"},
            {
                "name": "interactive",
                "when": {"latency_sla_ms_below": 200, "max_tokens_below": 2048},
                "target": "lpu",
            },
        ],
    }
    data.update(extra)
    return data


def test_first_matching_rule_wins_and_missing_hints_do_not_match():
    p = parse_policy(base())
    assert p.route(RouteFeatures("m", latency_sla_ms=100, max_tokens=64)) == ("lpu", "interactive")
    assert p.route(RouteFeatures("m", latency_sla_ms=100, max_tokens=4096)) == ("local", "default")
    assert p.route(RouteFeatures("m", latency_sla_ms=None, max_tokens=64)) == ("local", "default")
    assert p.route(RouteFeatures("m", latency_sla_ms=200, max_tokens=64)) == ("local", "default")
    offline = RouteFeatures("m", task_type="batch_offline", latency_sla_ms=100, max_tokens=64)
    assert p.route(offline) == ("local", "offline")
    assert p.fallback_for("lpu").name == "local"


def test_the_articles_example_policy_routes_as_the_article_says():
    p = load_policy(ROOT / "model_repository/router/policies/seed_example.toml")
    cases = [
        (RouteFeatures("m", task_type="batch_offline", latency_sla_ms=50), "gpu_batch"),
        (RouteFeatures("m", latency_sla_ms=150, max_tokens=512), "lpu"),
        (RouteFeatures("m", latency_sla_ms=150, max_tokens=4096), "long_context"),
        (RouteFeatures("m", latency_sla_ms=150, max_tokens=2048), "shared"),
        (RouteFeatures("m", task_type="tool_call", latency_sla_ms=50), "long_context"),
        (RouteFeatures("m", task_type="agent"), "long_context"),
        (RouteFeatures("m", messages=11), "long_context"),
        (RouteFeatures("m", messages=10), "shared"),
        (RouteFeatures("m", prompt_tokens=5000), "long_context"),
        (RouteFeatures("m"), "shared"),
    ]
    for features, target in cases:
        assert p.route(features)[0] == target, features


def test_the_shipped_default_policy_loads():
    p = load_policy(ROOT / "model_repository/router/policy.toml")
    assert p.route(RouteFeatures("smollm2-135m-instruct")) == ("local", "default")


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d["rules"][1]["when"].update(max_token_below=5),
            "rule 2 ('interactive'): unknown key 'max_token_below' "
            "(did you mean 'max_tokens_below'?)",
        ),
        (
            lambda d: d["rules"][0].update(target="gpu"),
            "rule 1 ('offline'): target 'gpu' is not defined",
        ),
        (
            lambda d: d["rules"][1]["when"].update(latency_sla_ms_below="fast"),
            "rule 2 ('interactive'): latency_sla_ms_below: expected a number",
        ),
        (lambda d: d["rules"][0].pop("name"), "rule 1: every rule needs a name"),
        (lambda d: d["rules"][0].update(when={}), "rule 1 ('offline'): 'when' must be a table"),
        (lambda d: d["rules"][1].update(name="offline"), "rule name 'offline' is used twice"),
        (lambda d: d.update(default="nowhere"), "default must name a target"),
        (
            lambda d: d["targets"]["lpu"].update(fallback="lpu"),
            "target 'lpu': fallback must name a 'triton' target",
        ),
        (
            lambda d: d["targets"]["lpu"].update(endpoints=["gone"]),
            "endpoint 'gone' is not defined",
        ),
        (
            lambda d: d["endpoints"]["groq"].update(api_key="gsk_123"),
            "'api_key' looks like a secret",
        ),
        (
            lambda d: d["endpoints"]["groq"].update(base_url="ftp://x"),
            "base_url must start with http",
        ),
        (lambda d: d["endpoints"]["groq"].update(cooldown_s=0), "cooldown_s must be > 0"),
        (lambda d: d["targets"].update(x={"kind": "gpu"}), "target 'x': kind must be"),
        (lambda d: d.update(rule=[]), "unknown key 'rule' (did you mean 'rules'?)"),
    ],
)
def test_a_bad_policy_is_refused_with_a_message_naming_what_is_wrong(change, message):
    data = base()
    change(data)
    with pytest.raises(ConfigError) as e:
        parse_policy(data, "policy.toml")
    assert message in str(e.value)
    assert str(e.value).startswith("policy.toml: ")


def test_policy_source_reloads_a_changed_file_and_keeps_the_last_good_policy(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('default = "a"\n[targets.a]\nkind = "triton"\n[targets.b]\nkind = "triton"\n')
    src = PolicySource(path, check_every_s=0)
    assert src.current().default == "a"
    path.write_text('default = "b"\n[targets.a]\nkind = "triton"\n[targets.b]\nkind = "triton"\n')
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime, whatever the fs
    assert src.current().default == "b" and src.num_reloads == 1
    path.write_text('default = "b"\n[targets.b]\nkind = "triton"\n[[rules]]\nname = "x"\n')
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert src.current().default == "b"  # refused: the previous policy stays
    assert "rule 1 ('x')" in src.last_error
    with pytest.raises(ConfigError, match="rule 1"):
        load_policy(path)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_circuit_opens_after_consecutive_failures_then_probes_once_after_cooldown():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    b.record_success()  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.record_failure()
    assert b.state == OPEN and not b.allow()
    clock.t += 9.9
    assert not b.allow()
    clock.t += 0.1
    assert b.allow() and b.state == HALF_OPEN  # the probe
    assert not b.allow()  # only one probe at a time
    b.record_failure()  # the probe failed: open again, for another cooldown
    assert b.state == OPEN and not b.allow()
    clock.t += 10
    assert b.allow()
    b.record_success()
    assert b.state == CLOSED and b.allow() and b.allow()


def test_a_cancelled_probe_gives_the_probe_slot_back():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, cooldown_s=1, clock=clock)
    b.record_failure()
    clock.t += 1
    assert b.allow() and not b.allow()
    b.release()
    assert b.allow()


@pytest.mark.parametrize(
    "text, seconds",
    [("7.66s", 7.66), ("2m59.56s", 179.56), ("120ms", 0.12), ("1h2m", 3720.0), ("12", 12.0)],
)
def test_rate_limit_durations_parse(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "5 s", "1x"])
def test_unparseable_durations_are_ignored(text):
    assert parse_duration(text) is None


def test_rate_limit_budget_from_headers():
    clock = Clock()
    r = RateLimits(clock)
    assert r.can_send(1000)
    r.update({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2.5s"})
    assert not r.can_send(10)
    clock.t += 2.5
    assert r.can_send(10)  # the window has reset
    r.update({"X-RateLimit-Remaining-Tokens": "500", "X-RateLimit-Reset-Tokens": "1m"})
    assert r.can_send(400) and not r.can_send(600)
    clock.t += 60
    assert r.can_send(600)
    r.update({"Retry-After": "3"})
    assert not r.can_send(1)
    clock.t += 3
    assert r.can_send(1)


def test_fields_an_openai_endpoint_cannot_honour_keep_a_request_local():
    from disagg.routing.request import local_only_fields

    chat = [{"role": "user", "content": "hi"}]
    assert local_only_fields({}, chat) == ()
    both = {C.IGNORE_EOS: True, C.TOP_K: 5}
    assert local_only_fields(both, chat) == (C.TOP_K, C.IGNORE_EOS)
    assert local_only_fields({C.IGNORE_EOS: False}, None) == ("raw_prompt",)
