"""The routing policy: ordered rules over request features, read from a TOML file.

    default = "local"                      # target when no rule matches

    [targets.local]                        # the local prefill/decode pipeline
    kind = "triton"
    model = "orchestrator"

    [targets.lpu]                          # external OpenAI-compatible endpoints, in order
    kind = "openai"
    endpoints = ["groq"]
    fallback = "local"                     # a "triton" target: when every endpoint fails

    [endpoints.groq]
    base_url = "https://api.groq.com/openai/v1"
    api_key_env = "GROQ_API_KEY"           # or api_key_file; never the key itself
    models = { "smollm2-135m-instruct" = "llama-3.1-8b-instant" }

    [[rules]]                              # first match wins; conditions are ANDed
    name = "interactive"
    when = { latency_sla_ms_below = 200, max_tokens_below = 2048 }
    target = "lpu"

Numeric conditions are `<feature>_below` / `<feature>_above` (strict); a request without the
feature (no latency SLA given, say) does not match them. String conditions take a value or a
list of values. OR is two rules with the same target. Everything is checked at load, and an
error names the rule (or target, or endpoint) at fault.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.errors import ConfigError
from disagg.filewatch import FileWatch

log = logging.getLogger("disagg.routing")

NUMERIC_FEATURES = ("latency_sla_ms", "max_tokens", "prompt_tokens", "messages", "priority")
STRING_FEATURES = ("task_type", "model")
CONDITIONS = tuple(
    [f"{f}_{op}" for f in NUMERIC_FEATURES for op in ("below", "above")] + list(STRING_FEATURES)
)
TRITON, OPENAI = "triton", "openai"
DEFAULT_REASON = "default"


@dataclass(frozen=True)
class RouteFeatures:
    """What a rule can look at, for one request."""

    model: str  # the public model name asked for
    task_type: str = ""  # client hint: "interactive", "batch_offline", ...
    latency_sla_ms: float | None = None  # client hint; None: no SLA given
    priority: int = 0  # client hint; larger is more urgent
    max_tokens: int = 0
    prompt_tokens: int = 0  # counted with the local tokenizer
    messages: int = 0  # chat turns (0 for a plain text prompt)


@dataclass(frozen=True)
class Rule:
    name: str
    target: str
    when: dict[str, Any]  # condition -> number, or tuple of strings

    def matches(self, f: RouteFeatures) -> bool:
        for cond, want in self.when.items():
            if cond in STRING_FEATURES:
                if getattr(f, cond) not in want:
                    return False
                continue
            feature, op = cond.rsplit("_", 1)
            value = getattr(f, feature)
            if value is None or not (value < want if op == "below" else value > want):
                return False
        return True


@dataclass(frozen=True)
class EndpointConfig:
    """One external OpenAI-compatible endpoint. The key is read from the environment or a
    secret file when the endpoint is used, so rotating it needs no reload."""

    name: str
    base_url: str = "https://api.groq.com/openai/v1"
    api_key_env: str = ""
    api_key_file: str = ""
    models: dict[str, str] = field(default_factory=dict)  # public name -> endpoint model
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 5.0  # request sent -> first content chunk
    idle_timeout_s: float = 10.0  # between two chunks of a stream
    total_timeout_s: float = 120.0
    failure_threshold: int = 3  # consecutive failures that open the circuit
    cooldown_s: float = 30.0  # open -> one half-open probe after this long
    capacity_backoff_s: float = 1.0  # after a 498 without retry-after

    def api_key(self) -> str | None:
        if self.api_key_env and os.environ.get(self.api_key_env):
            return os.environ[self.api_key_env].strip()
        if self.api_key_file:
            try:
                return Path(self.api_key_file).read_text().strip() or None
            except OSError:
                return None
        return None


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # TRITON | OPENAI
    model: str = ""  # TRITON: the orchestrator model to call
    endpoints: tuple[str, ...] = ()  # OPENAI: tried in order
    fallback: str = ""  # OPENAI: the TRITON target that serves what the endpoints cannot


@dataclass(frozen=True)
class Policy:
    default: str
    targets: dict[str, Target]
    endpoints: dict[str, EndpointConfig]
    rules: tuple[Rule, ...]

    def route(self, f: RouteFeatures) -> tuple[str, str]:
        """(target name, reason): the first matching rule's name, or "default"."""
        for rule in self.rules:
            if rule.matches(f):
                return rule.target, rule.name
        return self.default, DEFAULT_REASON

    def fallback_for(self, target: str) -> Target:
        t = self.targets[target]
        return t if t.kind == TRITON else self.targets[t.fallback]


# ------------------------------------------------------------------ loading and validation

_TOP = {"default", "targets", "endpoints", "rules"}
_TARGET_KEYS = {TRITON: {"kind", "model"}, OPENAI: {"kind", "endpoints", "fallback"}}
_ENDPOINT_FIELDS = {
    "base_url": str,
    "api_key_env": str,
    "api_key_file": str,
    "models": dict,
    "connect_timeout_s": float,
    "first_token_timeout_s": float,
    "idle_timeout_s": float,
    "total_timeout_s": float,
    "failure_threshold": int,
    "cooldown_s": float,
    "capacity_backoff_s": float,
}
_SECRET_KEYS = {"api_key", "key", "token", "secret", "password", "authorization"}


def _unknown(keys: Iterable[str], known: Iterable[str], where: str) -> None:
    for k in sorted(set(keys) - set(known)):
        hint = difflib.get_close_matches(k, list(known), n=1)
        raise ConfigError(
            f"{where}: unknown key {k!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )


def _number(value: object, where: str, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    return value


def _strings(value: object, where: str) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"{where}: expected a string or a non-empty list of strings")
    return tuple(values)


def _endpoint(name: str, raw: object) -> EndpointConfig:
    where = f"endpoint {name!r}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    secret = sorted(k for k in raw if k.lower() in _SECRET_KEYS)
    if secret:
        raise ConfigError(
            f"{where}: {secret[0]!r} looks like a secret; policy files hold no secrets: "
            "name an environment variable (api_key_env) or a secret file (api_key_file)"
        )
    _unknown(raw, _ENDPOINT_FIELDS, where)
    values: dict[str, Any] = {}
    for k, v in raw.items():
        kind = _ENDPOINT_FIELDS[k]
        if kind is str and not isinstance(v, str):
            raise ConfigError(f"{where}: {k} must be a string")
        if kind is dict and (
            not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values())
        ):
            raise ConfigError(f"{where}: models must map model names to endpoint models")
        if kind in (int, float) and _number(v, f"{where}: {k}", kind is int) <= 0:
            raise ConfigError(f"{where}: {k} must be > 0")
        values[k] = v
    url = values.get("base_url", EndpointConfig.base_url)
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: base_url must start with http:// or https://, got {url!r}")
    return EndpointConfig(name=name, **values)


def _target(name: str, raw: object, endpoints: dict[str, EndpointConfig]) -> Target:
    where = f"target {name!r}"
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or kind not in _TARGET_KEYS:
        raise ConfigError(f"{where}: kind must be {TRITON!r} or {OPENAI!r}, got {kind!r}")
    _unknown(raw, _TARGET_KEYS[kind], where)
    if kind == TRITON:
        model = raw.get("model", "orchestrator")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}: model must name a Triton model")
        return Target(name, kind, model=model)
    names = _strings(raw.get("endpoints"), f"{where}: endpoints")
    for e in names:
        if e not in endpoints:
            raise ConfigError(f"{where}: endpoint {e!r} is not defined under [endpoints]")
    return Target(name, kind, endpoints=names, fallback=raw.get("fallback", ""))


def _rule(i: int, raw: object, targets: dict[str, Target]) -> Rule:
    label = raw.get("name") if isinstance(raw, dict) else None
    where = f"rule {i + 1}" + (f" ({label!r})" if label else "")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    _unknown(raw, {"name", "when", "target"}, where)
    if not isinstance(label, str) or not label:
        raise ConfigError(f"{where}: every rule needs a name (it is the routing reason)")
    if raw.get("target") not in targets:
        raise ConfigError(f"{where}: target {raw.get('target')!r} is not defined under [targets]")
    when = raw.get("when", {})
    if not isinstance(when, dict) or not when:
        raise ConfigError(f"{where}: 'when' must be a table with at least one condition")
    _unknown(when, CONDITIONS, where)
    conds: dict[str, Any] = {}
    for cond, value in when.items():
        if cond in STRING_FEATURES:
            conds[cond] = _strings(value, f"{where}: {cond}")
        else:
            conds[cond] = _number(value, f"{where}: {cond}")
    return Rule(label, raw["target"], conds)


def parse_policy(data: dict[str, Any], source: str = "policy") -> Policy:
    try:
        _unknown(data, _TOP, source)
        endpoints = {n: _endpoint(n, e) for n, e in data.get("endpoints", {}).items()}
        raw_targets = data.get("targets", {})
        if not isinstance(raw_targets, dict) or not raw_targets:
            raise ConfigError("at least one target is needed under [targets]")
        targets = {n: _target(n, t, endpoints) for n, t in raw_targets.items()}
        for t in targets.values():
            if t.kind == OPENAI and targets.get(t.fallback, Target("", OPENAI)).kind != TRITON:
                raise ConfigError(
                    f"target {t.name!r}: fallback must name a {TRITON!r} target, got {t.fallback!r}"
                )
        default = data.get("default")
        if not isinstance(default, str) or default not in targets:
            raise ConfigError(f"default must name a target, got {default!r}")
        raw_rules = data.get("rules", [])
        if not isinstance(raw_rules, list):
            raise ConfigError("rules must be an array of tables ([[rules]])")
        rules = tuple(_rule(i, r, targets) for i, r in enumerate(raw_rules))
        names = [r.name for r in rules]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ConfigError(f"rule name {dup!r} is used twice (names are routing reasons)")
        if any(r.name == DEFAULT_REASON for r in rules):
            raise ConfigError(f"rule name {DEFAULT_REASON!r} is reserved")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return Policy(default, targets, endpoints, rules)


def load_policy(path: str | Path) -> Policy:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"routing policy {path}: {e}") from e
    return parse_policy(data, f"routing policy {path}")


class PolicySource:
    """The policy in a file, reloaded when the file changes (checked at most once per
    `check_every_s`). A changed file with an error is refused: the last good policy stays
    and `last_error` says why."""

    def __init__(self, path: str | Path, check_every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.policy = load_policy(self.path)  # an error here fails the model load
        self.watch = FileWatch(self.path, check_every_s)
        self.last_error: str | None = None
        self.num_reloads = 0

    def current(self) -> Policy:
        if self.watch.changed():
            try:
                self.policy = load_policy(self.path)
                self.last_error = None
                self.num_reloads += 1
                log.info("routing policy %s reloaded", self.path)
            except ConfigError as e:
                self.last_error = str(e)
                log.error("%s; keeping the previous policy", e)
        return self.policy
