"""`disagg plan --write DIR`: the chosen topology as settings to run it (issue 26 item 4).

    DIR/serve.toml           the mode and engine limits the plan assumed
    DIR/cluster.sh           `disagg cluster` with its prefill and decode servers, on this machine
    DIR/kustomization.yaml   a kustomize overlay on deploy/kubernetes/overlays/<cpu|gpu>: the
                             pools' replicas, their HPAs' floors, the same settings as
                             DISAGG_* variables (`kubectl apply -k DIR`)

Each file's first line says what was chosen, for which workload and SLO, and the predicted
goodput, so a file found later still says where it came from.
"""

from __future__ import annotations

import os
from pathlib import Path

from disagg.contracts import COLOCATED
from disagg.planner.topology import Topology

ROOT = Path(__file__).resolve().parents[3]
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"


def settings(t: Topology) -> dict[str, object]:
    """The serve settings (settings.py names) a topology's replicas run with."""
    return {
        "mode": t.mode,
        "decode_max_num_seqs": t.max_num_seqs,
        "decode_prefill_chunk": t.prefill_chunk,
        "decode_burst_tokens": t.burst_prefill_tokens,
        "decode_stream_interval": t.stream_interval,
        "max_model_len": t.max_model_len,
    }


def write(t: Topology, out: Path, why: str, flavour: str = "cpu") -> list[Path]:
    """The three files for `t` under `out` (made if missing); `why`: one line on the choice."""
    out.mkdir(parents=True, exist_ok=True)
    why = " ".join(why.split())  # one comment line in each file, whatever it quotes
    values = settings(t)
    toml = out / "serve.toml"
    toml.write_text(f"# {why}\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items()))
    sh = out / "cluster.sh"
    sh.write_text(
        f"#!/bin/sh\n# {why}\n"
        f"exec disagg cluster --prefill {t.num_prefill} --decode {t.num_decode} "
        '--config "$(dirname "$0")/serve.toml" "$@"\n'
    )
    sh.chmod(0o755)
    k = out / "kustomization.yaml"
    k.write_text(_kustomization(t, values, why, os.path.relpath(OVERLAYS / flavour, out)))
    return [toml, sh, k]


def _kustomization(t: Topology, values: dict[str, object], why: str, base: str) -> str:
    env = "".join(
        f"      - op: add\n        path: /spec/template/spec/containers/0/env/-\n"
        f"        value: {{name: DISAGG_{k.upper()}, value: {_quoted(v)}}}\n"
        for k, v in values.items()
    )
    lines = [
        f"# {why}",
        "apiVersion: kustomize.config.k8s.io/v1beta1",
        "kind: Kustomization",
        "resources:",
        f"  - {base}",
        "replicas:",
        f"  - {{name: disagg-prefill, count: {t.num_prefill}}}",
        f"  - {{name: disagg-decode, count: {t.num_decode}}}",
        "patches:",
        "  - target: {kind: Deployment, labelSelector: app.kubernetes.io/name=disagg}",
        "    patch: |-",
        env.rstrip("\n"),
    ]
    for pool, count in (("prefill", t.num_prefill), ("decode", t.num_decode)):
        if count == 0:  # colocated: no prefill pool, and no autoscaler to bring one back
            lines += [
                "  - patch: |-",
                "      $patch: delete",
                "      apiVersion: autoscaling/v2",
                "      kind: HorizontalPodAutoscaler",
                f"      metadata: {{name: disagg-{pool}}}",
            ]
            continue
        lines += [  # the autoscaler may add replicas, never go below the plan
            f"  - target: {{kind: HorizontalPodAutoscaler, name: disagg-{pool}}}",
            "    patch: |-",
            "      - op: replace",
            "        path: /spec/minReplicas",
            f"        value: {count}",
        ]
    return "\n".join(lines) + "\n"


def _toml(v: object) -> str:
    return f'"{v}"' if isinstance(v, str) else str(v)


def _quoted(v: object) -> str:
    return f'"{v}"'  # Kubernetes env values are strings


def describe(t: Topology) -> str:
    pools = (
        f"{t.num_decode} decode servers prefilling their own requests"
        if t.mode == COLOCATED
        else f"{t.num_prefill} prefill + {t.num_decode} decode servers, {t.mode}"
    )
    return f"{t.name}: {pools}"
