"""Render model_repository/ and ensembles/ into a servable repository under the build dir.

Each config.pbtxt is a template; its ${...} keys come from ServeSettings. Version folders are
linked, not copied, so the rendered repository always runs the code in the checkout. A key
left unfilled, or a key no setting provides, fails here, before Triton starts.

The `_sync` twins (router_sync, orchestrator_sync, ensemble_sync) are generated here from
their streaming models: same code, same tensors, one response per request (Triton's HTTP
/infer refuses decoupled models), so the two can never drift apart.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from disagg.errors import ConfigError
from disagg.settings import ROOT

SOURCES = ("model_repository", "ensembles")
_KEY = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SYNC_SUFFIX = "_sync"
SYNC_TWINS = ("router", "orchestrator", "ensemble")  # streaming models with a one-response twin
_DECOUPLED = "model_transaction_policy { decoupled: true }"
# the twin batches concurrent requests into one execute(), which serves them in parallel;
# a variable-length input must then allow ragged batches
_SYNC_POLICY = (
    "model_transaction_policy { decoupled: false }\n"
    "dynamic_batching { max_queue_delay_microseconds: 1000 }"
)


def sync_twin(text: str, name: str) -> str:
    """The config of `name`'s one-response twin, from the streaming model's config."""
    twin = name + SYNC_SUFFIX
    header = (
        f"# Generated from {name}'s config by `disagg serve` (serve/render.py): the same model\n"
        "# answering each request in one response, for KServe v2 /infer over HTTP."
    )
    lines = text.splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    batched = any(line.strip() == _DECOUPLED for line in lines)  # not an ensemble
    out, in_inputs = [header], False
    for line in lines:
        if line == f'name: "{name}"':
            line = f'name: "{twin}"'
        elif line.strip() == _DECOUPLED:
            line = _SYNC_POLICY
        elif line.strip().startswith("model_name: ") and line.strip()[12:].strip('"') in SYNC_TWINS:
            line = line.rstrip()[:-1] + SYNC_SUFFIX + '"'  # an ensemble step: the twin's twin
        elif line.startswith("input ["):
            in_inputs = True
        elif line.startswith("]"):
            in_inputs = False
        elif in_inputs and batched and "dims: [ -1 ]" in line:
            line = line.replace("dims: [ -1 ]", "dims: [ -1 ], allow_ragged_batch: true")
        out.append(line)
    rendered = "\n".join(out) + "\n"
    if f'name: "{twin}"' not in rendered:
        raise ConfigError(f"{name}: cannot make its sync twin (no 'name: \"{name}\"' line)")
    return rendered


def render_config(text: str, values: dict[str, str], where: str) -> str:
    missing = sorted({k for k in _KEY.findall(text) if k not in values})
    if missing:
        raise ConfigError(f"{where}: no setting fills template keys {missing}")
    rendered = _KEY.sub(lambda m: values[m.group(1)], text)
    if "${" in rendered:
        raise ConfigError(f"{where}: a template key is left unfilled")
    return rendered


FRONTEND_MODELS = frozenset({"tokenizer", "router", "orchestrator", "ensemble"})


def role_models(role: str, prefill_replicas: str = "", decode_replicas: str = "") -> frozenset[str]:
    """The models a server of `role` runs (their sync twins go with them). A frontend runs a
    pool itself unless that pool is given as replicas on other servers."""
    if role == "prefill":
        return frozenset({"prefill"})
    if role == "decode":
        return frozenset({"decode"})
    local = {
        pool
        for pool, replicas in (("prefill", prefill_replicas), ("decode", decode_replicas))
        if role == "all" or not replicas
    }
    return FRONTEND_MODELS | local


def render_repositories(
    values: dict[str, str],
    out_dir: Path,
    root: Path = ROOT,
    models: frozenset[str] | None = None,
) -> list[Path]:
    """Returns the rendered repository folders, one per source folder, for --model-repository;
    with `models`, only those models (and their sync twins)."""
    repos = []
    for source in SOURCES:
        src_repo, dst_repo = root / source, out_dir / source
        if dst_repo.exists():
            shutil.rmtree(dst_repo)
        dst_repo.mkdir(parents=True)
        for model in sorted(p for p in src_repo.iterdir() if (p / "config.pbtxt").is_file()):
            if models is not None and model.name not in models:
                continue
            cfg = model / "config.pbtxt"
            text = render_config(cfg.read_text(), values, str(cfg.relative_to(root)))
            names = [model.name]
            if model.name in SYNC_TWINS:
                names.append(model.name + SYNC_SUFFIX)
            for name in names:
                dst = dst_repo / name
                dst.mkdir()
                twin = name != model.name
                (dst / "config.pbtxt").write_text(sync_twin(text, model.name) if twin else text)
                for version in (p for p in model.iterdir() if p.is_dir() and p.name.isdigit()):
                    (dst / version.name).symlink_to(version.resolve(), target_is_directory=True)
        repos.append(dst_repo)
    return repos
