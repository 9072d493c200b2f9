"""Public model names -> versions -> Triton models, with canary traffic and rollback.

    [models."smollm2-135m-instruct"]
    versions = [
      { name = "v1", triton_model = "router", state = "stable" },
      { name = "v2", triton_model = "router", state = "canary", weight = 0.1 },
    ]

    tool_format = "hermes"                 # how it writes tool calls (gateway/tools.py FORMATS)

    [models."smollm2-old"]
    deprecated = "smollm2-135m-instruct"   # answered with an error naming the replacement

A request for a model gets its canary versions with their weights and the stable version
otherwise; `<model>:<version>` pins a version. Weights change, and a canary rolls back, through
the admin endpoint or an edit of the file (reloaded when it changes), without a restart;
requests already running keep the version they were given.
"""

from __future__ import annotations

import random
import threading
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from disagg.errors import ConfigError
from disagg.filewatch import FileWatch
from disagg.gateway.errors import APIError
from disagg.gateway.tools import FORMATS, ToolFormat

STABLE, CANARY, DEPRECATED = "stable", "canary", "deprecated"
STATES = (STABLE, CANARY, DEPRECATED)


@dataclass(frozen=True)
class Version:
    name: str
    triton_model: str
    triton_version: str = ""  # "" = the latest Triton version of that model
    state: str = STABLE
    weight: float = 0.0  # canary share of traffic, 0..1


@dataclass(frozen=True)
class PublicModel:
    name: str
    versions: tuple[Version, ...] = ()
    deprecated: str = ""  # replacement model name
    tool_format: str = "hermes"  # gateway/tools.py FORMATS: how its chat template takes tools


def _version(model: str, raw: object) -> Version:
    where = f"model {model!r}"
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ConfigError(f"{where}: every version needs a name")
    where += f" version {raw['name']!r}"
    unknown = set(raw) - {"name", "triton_model", "triton_version", "state", "weight"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    v = Version(
        name=raw["name"],
        triton_model=str(raw.get("triton_model", "router")),
        triton_version=str(raw.get("triton_version", "")),
        state=raw.get("state", STABLE),
        weight=float(raw.get("weight", 0.0)),
    )
    _check_version(where, v)
    return v


def _check_version(where: str, v: Version) -> None:
    if not isinstance(v.state, str) or v.state not in STATES:
        raise ConfigError(f"{where}: state must be one of {STATES}, got {v.state!r}")
    if isinstance(v.weight, bool) or not isinstance(v.weight, int | float):
        raise ConfigError(f"{where}: weight must be a number within 0..1, got {v.weight!r}")
    if not 0.0 <= v.weight <= 1.0:  # NaN fails this too
        raise ConfigError(f"{where}: weight must be within 0..1, got {v.weight}")


def _check_model(m: PublicModel) -> None:
    if m.deprecated:
        return
    if sum(v.weight for v in m.versions if v.state == CANARY) > 1.0:
        raise ConfigError(f"model {m.name!r}: canary weights add up to more than 1")
    if not any(v.state == STABLE for v in m.versions):
        raise ConfigError(f"model {m.name!r}: needs a stable version")


def parse_registry(data: dict[str, Any], source: str) -> dict[str, PublicModel]:
    models = {}
    try:
        for name, raw in data.get("models", {}).items():
            if not isinstance(raw, dict):
                raise ConfigError(f"model {name!r}: expected a table")
            if raw.get("deprecated"):
                models[name] = PublicModel(name, deprecated=str(raw["deprecated"]))
                continue
            unknown = set(raw) - {"versions", "tool_format", "deprecated"}
            if unknown:
                raise ConfigError(f"model {name!r}: unknown keys {sorted(unknown)}")
            fmt = raw.get("tool_format", "hermes")
            if fmt not in FORMATS:
                raise ConfigError(
                    f"model {name!r}: tool_format must be one of {sorted(FORMATS)}, got {fmt!r}"
                )
            versions = tuple(_version(name, v) for v in raw.get("versions", []))
            m = PublicModel(name, versions, tool_format=fmt)
            _check_model(m)
            models[name] = m
        if not models:
            raise ConfigError("no models defined")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return models


def load_registry(path: Path) -> dict[str, PublicModel]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"model registry {path}: {e}") from e
    return parse_registry(data, f"model registry {path}")


class Registry:
    def __init__(self, path: Path, rng: random.Random | None = None) -> None:
        self.path = path
        self.models = load_registry(path)
        self.watch = FileWatch(path)
        self.rng = rng or random.Random()
        self.lock = threading.Lock()
        self.last_error: str | None = None

    def maybe_reload(self) -> None:
        """The file, when it changed (checked at most once a second); a bad file is refused."""
        if not self.watch.changed():
            return
        try:
            models = load_registry(self.path)
        except ConfigError as e:
            self.last_error = str(e)
            return
        with self.lock:
            self.models, self.last_error = models, None

    def listed(self) -> list[PublicModel]:
        return [m for m in self.models.values() if not m.deprecated]

    def tool_format(self, requested: object) -> ToolFormat:
        """How the model a request names writes tools (Hermes for a name not served: the
        request is refused by resolve() then)."""
        name = requested.partition(":")[0] if isinstance(requested, str) else ""
        with self.lock:
            model = self.models.get(name)
        return FORMATS[model.tool_format if model is not None else "hermes"]

    def resolve(self, requested: str) -> tuple[PublicModel, Version]:
        """The version serving a request for `requested` (`name` or `name:version`)."""
        self.maybe_reload()
        name, _, pinned = requested.partition(":")
        with self.lock:
            model = self.models.get(name)
            if model is None:
                raise APIError(
                    404, f"The model '{name}' does not exist", param="model", code="model_not_found"
                )
            if model.deprecated:
                raise _deprecated(f"model '{name}'", model.deprecated)
            if pinned:
                v = next((v for v in model.versions if v.name == pinned), None)
                if v is None:
                    raise APIError(
                        404,
                        f"The model '{name}' has no version '{pinned}'",
                        param="model",
                        code="model_not_found",
                    )
                if v.state == DEPRECATED:
                    raise _deprecated(f"version '{requested}'", f"{name}:{_stable(model).name}")
                return model, v
            return model, self._pick(model)

    def _pick(self, model: PublicModel) -> Version:
        x = self.rng.random()
        for v in model.versions:
            if v.state == CANARY:
                if x < v.weight:
                    return v
                x -= v.weight
        return _stable(model)

    def update(self, name: str, version: str, state: str | None, weight: float | None) -> Version:
        """Admin change of one version (state and/or canary weight), validated as a whole."""
        with self.lock:
            model = self.models.get(name)
            if model is None or model.deprecated:
                raise APIError(404, f"no model '{name}'", code="model_not_found")
            versions = list(model.versions)
            i = next((i for i, v in enumerate(versions) if v.name == version), None)
            if i is None:
                raise APIError(404, f"model '{name}' has no version '{version}'")
            old = versions[i]
            versions[i] = replace(
                old,
                state=old.state if state is None else state,
                weight=old.weight if weight is None else weight,
            )
            updated = replace(model, versions=tuple(versions))
            try:
                _check_version(f"version {version!r}", versions[i])
                _check_model(updated)
            except ConfigError as e:
                raise APIError(400, str(e)) from None
            self.models = {**self.models, name: updated}
            return versions[i]

    def rollback(self, name: str) -> list[str]:
        """Every canary of `name` to weight 0: new requests go to the stable version."""
        with self.lock:
            model = self.models.get(name)
            if model is None or model.deprecated:
                raise APIError(404, f"no model '{name}'", code="model_not_found")
            rolled = [v.name for v in model.versions if v.state == CANARY and v.weight > 0]
            versions = tuple(
                replace(v, weight=0.0) if v.state == CANARY else v for v in model.versions
            )
            self.models = {**self.models, name: replace(model, versions=versions)}
            return rolled

    def state(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {
                m.name: {"deprecated": m.deprecated}
                if m.deprecated
                else {"versions": [v.__dict__ for v in m.versions]}
                for m in self.models.values()
            }


def _stable(model: PublicModel) -> Version:
    return next(v for v in model.versions if v.state == STABLE)


def _deprecated(what: str, replacement: str) -> APIError:
    return APIError(
        410,
        f"The {what} is deprecated; use '{replacement}' instead",
        param="model",
        code="model_deprecated",
    )
