"""`disagg doctor`: the checks to run before filing a bug, each with what to do when it fails.

    disagg doctor [--config serve.toml] [--json] [--remove-stale-shm]

It checks what applies to this machine and these settings (a CPU deployment skips the GPU
checks), from the troubleshooting table of the article this project grew from: the NVIDIA
driver, Docker's GPU access, TensorRT-LLM against what the build wrote, GPU memory against
the pools' KV fractions, free ports, /dev/shm for the Python backend (its free room, and
regions killed servers left behind: `--remove-stale-shm` removes them), the stub's interpreter
against the venv, and, when a server is up, every model ready and a warm-up request's time to
first token. Exit status 1 when a check fails (warnings do not fail).

Every probe of the machine goes through `System`, so each failure is simulated in the tests.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from disagg.doctor.checks import CHECKS, FAIL, OK, SKIP, WARN, WHERE_TO_LOOK, Result
from disagg.doctor.system import System
from disagg.settings import ServeSettings


def run_checks(s: ServeSettings, sys_: System | None = None) -> list[Result]:
    sys_ = sys_ or System()
    out = []
    for check in CHECKS:
        try:
            out.append(check(s, sys_))
        except Exception as e:  # a broken probe is a finding, not a crash of the doctor
            out.append(Result(check.__name__.removeprefix("check_"), FAIL, f"check crashed: {e}"))
    return out


def render(results: list[Result]) -> str:
    mark = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL", SKIP: "skip"}
    lines = []
    for r in results:
        lines.append(f"[{mark[r.status]}] {r.name}: {r.detail}")
        if r.fix and r.status in (FAIL, WARN):
            lines.append(f"       fix: {r.fix}")
    lines.append("\nwhere to look when:")
    lines += [f"  {symptom}: {where}" for symptom, where in WHERE_TO_LOOK]
    return "\n".join(lines)


def remove_stale_shm(sys_: System) -> int:
    stale = sys_.stale_stub_regions()
    for name, size in stale:
        sys_.remove_shm(name)
        print(f"removed /dev/shm/{name} ({size >> 20} MiB)")
    print(f"{len(stale)} stale regions removed, {sum(s for _, s in stale) >> 20} MiB freed")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disagg doctor", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="the serve.toml the server runs with")
    p.add_argument("--json", action="store_true", help="results as JSON")
    p.add_argument(
        "--remove-stale-shm",
        action="store_true",
        help="remove this user's Python backend regions in /dev/shm that no process uses",
    )
    a = p.parse_args(argv)
    if a.remove_stale_shm:
        return remove_stale_shm(System())
    settings = ServeSettings.load(Path(a.config) if a.config else None)
    results = run_checks(settings)
    if a.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(render(results))
    return 1 if any(r.status == FAIL for r in results) else 0
