"""Render model_repository/ and ensembles/ into a servable repository under the build dir.

Each config.pbtxt is a template; its ${...} keys come from ServeSettings. Version folders are
linked, not copied, so the rendered repository always runs the code in the checkout. A key
left unfilled, or a key no setting provides, fails here, before Triton starts.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from disagg.errors import ConfigError
from disagg.serve.settings import ROOT

SOURCES = ("model_repository", "ensembles")
_KEY = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def render_config(text: str, values: dict[str, str], where: str) -> str:
    missing = sorted({k for k in _KEY.findall(text) if k not in values})
    if missing:
        raise ConfigError(f"{where}: no setting fills template keys {missing}")
    rendered = _KEY.sub(lambda m: values[m.group(1)], text)
    if "${" in rendered:
        raise ConfigError(f"{where}: a template key is left unfilled")
    return rendered


def render_repositories(values: dict[str, str], out_dir: Path, root: Path = ROOT) -> list[Path]:
    """Returns the rendered repository folders, one per source folder, for --model-repository."""
    repos = []
    for source in SOURCES:
        src_repo, dst_repo = root / source, out_dir / source
        if dst_repo.exists():
            shutil.rmtree(dst_repo)
        dst_repo.mkdir(parents=True)
        for model in sorted(p for p in src_repo.iterdir() if (p / "config.pbtxt").is_file()):
            dst = dst_repo / model.name
            dst.mkdir()
            cfg = model / "config.pbtxt"
            (dst / "config.pbtxt").write_text(
                render_config(cfg.read_text(), values, str(cfg.relative_to(root)))
            )
            for version in (p for p in model.iterdir() if p.is_dir() and p.name.isdigit()):
                (dst / version.name).symlink_to(version.resolve(), target_is_directory=True)
        repos.append(dst_repo)
    return repos
