"""deploy/kubernetes, validated offline: each overlay rendered by `kubectl kustomize`, every
resource checked against the Kubernetes API schema by a real validator (kubernetes-validate,
strict: unknown fields fail), then what a schema cannot see: selectors that match pods,
ports and probes that match the settings, references that exist or are documented as the
user's, no secret values in files, pinned images, and HPA metrics the project exports.
Nothing here has run on a cluster (docs/kubernetes.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from disagg import metrics as M
from disagg.settings import ServeSettings

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "cpu-planner")
K8S_VERSION = "1.32.0"  # the kubectl on these machines
USER_PROVIDED = {("Secret", "disagg-secrets"), ("PersistentVolumeClaim", "disagg-engines"),
                 ("PersistentVolumeClaim", "disagg-checkpoints")}  # fmt: skip
TRITON_METRICS = {"nv_inference_pending_request_count"}  # Triton's own, per model


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests were NOT rendered or validated")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def by_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def servers(docs) -> list[dict]:
    """The Deployments that run `disagg serve` (not the live planner's)."""
    return [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] != "disagg-planner"]


def containers(dep: dict) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec["containers"] + spec.get("initContainers", [])


def test_every_resource_passes_the_kubernetes_schema(rendered):
    import kubernetes_validate

    _, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy",
            "HorizontalPodAutoscaler"} <= kinds  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_catches_what_it_should():
    import kubernetes_validate

    dep = by_kind(render("cpu"), "Deployment")[0]
    dep["spec"]["replicaz"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_services_select_pods_and_target_their_ports(rendered):
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    for svc in by_kind(docs, "Service"):
        selector = svc["spec"]["selector"]
        matched = [
            d for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(matched) == 1, svc["metadata"]["name"]
        names = {p["name"] for c in containers(matched[0]) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)
        headless = svc["spec"].get("clusterIP") == "None"
        # pools (and the frontends, for the planner): DNS per pod
        assert headless == (svc["metadata"]["name"] not in ("disagg-frontend", "disagg-planner"))
    for dep in deployments:  # a Deployment's selector picks its own pods
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def _settings(docs, env: dict, tmp_path: Path) -> ServeSettings:
    """What a pod loads: the ConfigMap's serve.toml and its Deployment's variables."""
    (cm,) = by_kind(docs, "ConfigMap")
    path = tmp_path / "serve.toml"
    path.write_text(cm["data"]["serve.toml"])
    return ServeSettings.load(path, env=env)


def test_ports_probes_and_roles_match_the_settings_the_pods_load(rendered, tmp_path):
    overlay, docs = rendered
    for dep in servers(docs):
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", "x" * 32) for e in c["env"]}
        role = c["command"][c["command"].index("--role") + 1]
        assert dep["metadata"]["name"] == f"disagg-{role}"
        s = _settings(docs, {**env, "DISAGG_ROLE": role}, tmp_path)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (ports["http"], ports["grpc"], ports["metrics"]) == (
            s.http_port, s.grpc_port, s.metrics_port,
        )  # fmt: skip
        if role == "frontend":
            assert ports["gateway"] == s.gateway_port
            assert s.prefill_replicas == f"dns:disagg-prefill:{s.grpc_port}"
            assert s.decode_replicas == f"dns:disagg-decode:{s.grpc_port}"
        if role == "prefill":
            assert ports["kv"] == s.kv_port
        if role in ("prefill", "decode") and s.kv_events_port:  # (GPU pools publish none)
            assert ports["kv-events"] == s.kv_events_port
        for probe, path in (("readinessProbe", "/v2/health/ready"),
                            ("livenessProbe", "/v2/health/live")):  # fmt: skip
            assert c[probe]["httpGet"] == {"path": path, "port": "http"}
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert s.drain_s + 5 < grace  # preStop sleep + drain fit in the grace period
        assert c["resources"]["requests"] and c["resources"]["limits"]
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert (gpus == "1") == (overlay == "gpu" and role != "frontend")
        if overlay == "gpu":
            assert s.engine_backend == "tensorrt_llm"


def _ports(rule: dict) -> tuple[int, int]:
    (port,) = rule["ports"]
    return port["port"], port.get("endPort", port["port"])


def test_the_network_policies_open_exactly_the_pools_ports(rendered):
    """The base: gRPC and KV events from the frontend, disagg's KV port from decode, metrics.
    GPU: also prefill <-> decode on every TCP port, for TensorRT-LLM's transceiver, whose
    listener port the kernel picks (and UCX's TCP lanes open more)."""
    overlay, docs = rendered
    allowed: dict[str, set] = {}
    for policy in by_kind(docs, "NetworkPolicy"):
        target = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for r in policy["spec"]["ingress"]:
            source = r["from"][0]["podSelector"]["matchLabels"]
            allowed.setdefault(target, set()).add(
                (source.get("app.kubernetes.io/component", "prometheus"), _ports(r))
            )
    every = (1, 65535)
    transfer = {"prefill": {("decode", every)}, "decode": {("prefill", every)}}
    extra = transfer if overlay == "gpu" else {"prefill": set(), "decode": set()}
    events = ("frontend", (8106, 8106))  # the KV events the frontends follow
    assert allowed["prefill"] == {("frontend", (8001, 8001)), ("decode", (8105, 8105)), events,
                                  ("prometheus", (8002, 8002))} | extra["prefill"]  # fmt: skip
    assert allowed["decode"] == {("frontend", (8001, 8001)), events,
                                 ("prometheus", (8002, 8002))} | extra["decode"]  # fmt: skip


def test_startup_probes_wait_as_long_as_serve_does(rendered, tmp_path):
    """Two TensorRT-LLM pools may load for many minutes: a startupProbe shorter than serve's
    own budget would restart the pod mid-load, over and over."""
    overlay, docs = rendered
    for dep in servers(docs):
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", "x" * 32) for e in c["env"]}
        role = c["command"][c["command"].index("--role") + 1]
        s = _settings(docs, {**env, "DISAGG_ROLE": role}, tmp_path)
        probe = c["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= s.startup_budget_s, role
        if overlay == "gpu" and role != "frontend":
            assert s.startup_budget_s >= 1200  # TensorRT-LLM pools here
            ucx = {k: v for k, v in env.items() if k.startswith("UCX_")}
            assert ucx == {"UCX_MM_ERROR_HANDLING": "y", "UCX_CUDA_IPC_ENABLE_MNNVL": "n",
                           "UCX_RNDV_SCHEME": "put_zcopy"}  # fmt: skip


def test_references_exist_or_are_the_users_and_no_secret_is_written_down(rendered):
    _, docs = rendered
    defined = {(d["kind"], d["metadata"]["name"]) for d in docs}
    refs: set[tuple[str, str]] = set()
    for dep in by_kind(docs, "Deployment"):
        for vol in dep["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in vol:
                refs.add(("ConfigMap", vol["configMap"]["name"]))
            if "persistentVolumeClaim" in vol:
                refs.add(("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]))
        for c in containers(dep):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add(("Secret", ref["name"]))
                if re.search(r"KEY|TOKEN|SECRET|PASSWORD", e["name"]):
                    assert "value" not in e, f"{e['name']} must come from a Secret"
    assert ("Secret", "disagg-secrets") in refs
    missing = refs - defined - USER_PROVIDED
    assert not missing, missing
    assert not by_kind(docs, "Secret")  # never a Secret with values in the repository
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for kind, name in refs - defined:
        assert name in doc, f"{kind} {name} is the user's: docs/kubernetes.md must say so"


def test_images_are_pinned(rendered):
    overlay, docs = rendered
    flavour = "-trtllm" if overlay == "gpu" else "-cpu"  # deploy/Dockerfile's two bases
    for dep in by_kind(docs, "Deployment"):
        for c in containers(dep):
            name, _, tag = c["image"].rpartition(":")
            assert name and re.fullmatch(r"\d+\.\d+\.\d+" + flavour, tag), c["image"]


def test_each_pool_scales_on_a_queue_metric_the_project_exports(rendered):
    overlay, docs = rendered
    if overlay == "cpu-planner":
        return  # its HPAs follow the planner instead (the test below)
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())
    exposed = {}
    for rule in rules["rules"]["custom"]:
        series = re.match(r"([a-z_:]+)\{", rule["seriesQuery"]).group(1)
        exposed[rule["name"]["as"]] = series
    ours = {m.name for m in M.ALL}
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in by_kind(docs, "HorizontalPodAutoscaler")
    }
    assert set(hpas) == {"disagg-prefill", "disagg-decode"}
    for hpa in hpas.values():
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        series = exposed[metric["pods"]["metric"]["name"]]
        assert series in ours | TRITON_METRICS, series
    assert exposed["disagg_decode_waiting_sequences"] in ours


def test_with_the_planner_each_hpa_follows_the_planners_count_for_its_pool():
    """The component's planner reads every frontend pod (a headless Service on their metrics
    port), publishes disagg_planner_replicas{pool}, which prometheus-adapter exposes as an
    external metric; each pool's HPA takes it as its desired count (target 1 per replica),
    and the planner's bounds are the HPAs'. Its pod gets no API token: it calls no API."""
    from disagg.planner.autoscale import parser, targets_from

    docs = render("cpu-planner")
    (dep,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "disagg-planner"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    assert c["command"][:4] == ["python3", "-m", "disagg", "planner"]
    a = parser().parse_args(c["command"][4:])
    targets = targets_from(a)
    assert a.observe and a.host == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": a.planner_port}
    (source,) = a.metrics
    name, port = source.removeprefix("dns:").split(":")
    (svc,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == name]
    assert svc["spec"]["clusterIP"] == "None"
    front = next(d for d in servers(docs) if d["metadata"]["name"] == "disagg-frontend")
    labels = front["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (svc_port,) = svc["spec"]["ports"]
    (fc,) = front["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in fc["ports"]}
    assert svc_port["port"] == int(port) == named[svc_port["targetPort"]]
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())
    external = {r["name"]["as"]: r["seriesQuery"] for r in rules["rules"]["external"]}
    hpas = {h["metadata"]["name"]: h for h in by_kind(docs, "HorizontalPodAutoscaler")}
    for pool, most in (("prefill", targets.max_prefill), ("decode", targets.max_decode)):
        hpa = hpas[f"disagg-{pool}"]
        (metric,) = hpa["spec"]["metrics"]
        ext = metric["external"]
        assert metric["type"] == "External" and ext["target"] == {
            "type": "AverageValue", "averageValue": "1",
        }  # fmt: skip
        assert ext["metric"]["selector"] == {"matchLabels": {"pool": pool}}
        assert external[ext["metric"]["name"]].startswith(M.PLANNER_REPLICAS.name + "{")
        assert "pool" in M.PLANNER_REPLICAS.labels
        assert hpa["spec"]["maxReplicas"] == most
