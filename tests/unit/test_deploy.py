"""docker-compose.yml and the files it mounts, checked without Docker (no engine here): the
compose file by a real Compose-spec parser (the `compose_spec` Rust crate's bindings), and
disagg's own rules: loopback ports, no secrets in files, GPU reservation, a dashboard that
only plots metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from compose_spec import PyCompose

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_the_compose_file_is_valid_compose():
    parsed = PyCompose.from_yaml(COMPOSE.read_text())
    assert set(parsed.service_names()) == {
        "triton-gpu", "gpu-smoke", "triton-cpu", "gateway", "prometheus", "grafana",
        "frontend", "prefill-1", "prefill-2", "decode-1", "decode-2",
    }  # fmt: skip


def test_a_broken_compose_file_is_caught_by_the_same_parser():
    text = COMPOSE.read_text().replace("    ports:\n", "    portz:\n", 1)
    with pytest.raises(ValueError, match="portz"):
        PyCompose.from_yaml(text)


def test_profiles_pick_the_gpu_or_the_cpu_stack(compose):
    services = compose["services"]
    assert services["triton-gpu"]["profiles"] == ["gpu"]
    assert services["triton-cpu"]["profiles"] == ["cpu"]
    for name in ("gateway", "prometheus", "grafana"):
        assert set(services[name]["profiles"]) == {"gpu", "cpu"}
    gpu = services["triton-gpu"]
    assert gpu["build"]["args"]["BASE_IMAGE"].endswith("-trtllm-python-py3")
    assert services["triton-cpu"]["build"]["args"]["BASE_IMAGE"].endswith("-py3")
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    for name in ("triton-gpu", "triton-cpu"):  # the gateway finds either as "triton"
        assert services[name]["networks"]["default"]["aliases"] == ["triton"]
    assert services["gateway"]["environment"]["DISAGG_GATEWAY_TRITON_URL"] == "triton:8001"


def test_every_port_binds_loopback_and_no_secret_is_written_down(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        env = service.get("environment", {})
        for key, value in env.items():
            if re.search(r"KEY|TOKEN|SECRET|PASSWORD", key) and not key.endswith("_FILE"):
                assert str(value).startswith("${"), f"{name}: {key} must come from the environment"
    assert compose["secrets"]["disagg_api_keys"] == {"environment": "DISAGG_API_KEYS"}


def test_dockerfile_copies_what_exists():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / src).exists(), src
    lines = (ROOT / "deploy" / "requirements-serve.txt").read_text().splitlines()
    pins = [x for x in lines if x and not x.startswith("#")]
    assert not any(x.startswith("torch") for x in pins)  # the image's own (CUDA) or CPU build


def _defined_metrics() -> set[str]:
    """Every sample name disagg exports (a histogram's _bucket, _sum and _count included)."""
    from disagg import metrics as M

    return {name for m in M.ALL for name in M.series_names(m)}


def test_prometheus_scrapes_triton_and_the_dashboard_plots_real_metrics():
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert targets == {"triton": ["triton:8002"], "gateway": ["gateway:9000"]}
    dash = json.loads((ROOT / "deploy/grafana/dashboards/disagg.json").read_text())
    triton = {
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_queue_duration_us",
    }  # noqa: E501
    known = _defined_metrics() | triton
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:disagg|nv)_[a-z0-9_]+)", e)}
    assert used and used <= known, used - known
    # every metric disagg defines is on the dashboard (the status view covers the rest)
    plotted = {re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    from disagg import metrics as M

    assert {m.name for m in M.ALL} - plotted == set()
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/disagg.yml").read_text()
    )  # noqa: E501
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_the_serving_image_pins_every_third_party_module_the_served_code_imports():
    import sys

    served = [ROOT / "model_repository"] + [
        ROOT / "src/disagg" / d for d in ("gateway", "triton", "routing", "serve", "trtllm")
    ]
    modules = set()
    for folder in served:
        for path in folder.rglob("*.py"):
            modules |= set(re.findall(r"^(?:from|import) ([a-z_0-9]+)", path.read_text(), re.M))
    provided = {"disagg", "torch", "triton_python_backend_utils", "tensorrt_llm", "__future__"}
    distribution = {"grpc": "tritonclient", "yaml": "pyyaml"}  # module -> what installs it
    third_party = {
        distribution.get(m, m) for m in modules - set(sys.stdlib_module_names) - provided
    }
    lines = (ROOT / "deploy" / "requirements-serve.txt").read_text().splitlines()
    pins = {re.split(r"[=\[<>]", x)[0].replace("-", "_") for x in lines if x and x[0] != "#"}
    assert third_party and third_party <= pins, third_party - pins


def test_the_gpu_service_sees_what_serve_toml_names_and_runs_with_upstreams_limits(compose):
    gpu = compose["services"]["triton-gpu"]
    assert gpu["working_dir"] == "/opt/disagg"  # serve.toml's relative paths resolve here
    mounts = {v.split(":")[0]: v.split(":")[1] for v in gpu["volumes"]}
    assert mounts["./engines"] == "/opt/disagg/engines"
    assert mounts["./checkpoints"] == "/opt/disagg/checkpoints"
    config = gpu["command"][gpu["command"].index("--config") + 1]
    assert config.startswith("engines/") and config.endswith("/serve.toml")
    assert gpu["ipc"] == "host" and "shm_size" not in gpu  # shm_size does nothing with ipc: host
    assert gpu["ulimits"] == {"memlock": -1, "stack": 67108864}


def test_the_image_keeps_its_own_versions_of_what_it_already_has():
    """TensorRT-LLM 1.0's transformers (4.53) wants tokenizers>=0.21,<0.22 and checks it on
    import: our tokenizers pin must give way to the image's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("imgreq", ROOT / "deploy/image_requirements.py")
    imgreq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(imgreq)
    ours = (ROOT / "deploy" / "requirements-serve.txt").read_text()
    freeze = "tokenizers==0.21.4\nTritonClient==2.59.0\nnumpy @ file:///wheels/numpy.whl\n"
    out = imgreq.adapt(ours, freeze).splitlines()
    assert "tokenizers==0.21.4  # the image's" in out
    assert "tritonclient[grpc,http]==2.59.0  # the image's" in out  # extras kept
    assert "numpy  # the image's" in out  # from a URL: no pin of ours either
    assert "starlette==1.10.0" in out  # not in the image: our pin
    assert len(out) == len([x for x in ours.splitlines() if x and not x.startswith("#")])


def test_a_client_the_image_lacks_gets_a_range_that_resolves_beside_its_protobuf():
    """tritonclient 2.73 requires grpcio>=1.81.1 and protobuf>=6.30,<7 (its wheel's
    metadata): with an image's protobuf 4 or 5 as constraints pip fails (ResolutionImpossible,
    checked with pip --dry-run once); the range resolves to 2.51 / 2.66 there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("imgreq", ROOT / "deploy/image_requirements.py")
    imgreq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(imgreq)
    ours = (ROOT / "deploy" / "requirements-serve.txt").read_text()
    out = imgreq.adapt(ours, "protobuf==5.29.3\ngrpcio==1.67.1\n").splitlines()
    assert "tritonclient[grpc,http]>=2.51  # what resolves beside the image's" in out
    assert "tritonclient[grpc,http]==2.73.0" in ours  # the dev pin stays exact


def test_the_documented_smoke_run_works_in_the_image_through_compose(compose):
    """docker compose --profile gpu-smoke run --rm gpu-smoke: the script and what it runs are
    in the image, and the service runs it with GPUs and the checkpoint, in the checkout."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = {p for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for p in line.split()}
    for needed in ("deploy/gpu_smoke.sh", "deploy/smoke_check.py", "build_engines", "src"):
        assert needed in copied, needed
    smoke, gpu = compose["services"]["gpu-smoke"], compose["services"]["triton-gpu"]
    assert smoke["command"] == ["bash", "deploy/gpu_smoke.sh"]
    assert smoke["image"] == gpu["image"] and smoke["working_dir"] == "/opt/disagg"
    assert smoke["volumes"] == gpu["volumes"] and smoke["deploy"] == gpu["deploy"]
    assert smoke["environment"]["SMOKE_CHECKPOINT"].startswith("${SMOKE_CHECKPOINT")
    assert "ports" not in smoke  # it serves on loopback inside its own container
    assert smoke["profiles"] == ["gpu-smoke"]


def test_the_smoke_script_serves_the_same_way_on_both_halves():
    """Whatever its environment says (compose's services disable the gateway, bind 0.0.0.0;
    `auto` picks conditional on one GPU and keeps short prompts co-located), the script
    serves its own gateway on loopback with every prompt through prefill, before it branches
    into its CPU or GPU half: so the CPU run checks the hand-off the GPU run needs."""
    script = (ROOT / "deploy" / "gpu_smoke.sh").read_text()
    common = script[: script.index('if [ "${SMOKE_CPU:-0}" = 1 ]')]
    for setting in ("DISAGG_MODE=disaggregated", "DISAGG_GATEWAY_ENABLED=true",
                    "DISAGG_HOST=127.0.0.1"):  # fmt: skip
        assert setting in common, setting
        assert script.count(setting) == 1, f"{setting} set in one half only"
    assert not re.search(r"^[^#]*\bcurl ", script, re.M)  # the image need not have curl


def test_the_gpu_services_carry_the_transceivers_environment(compose):
    for name in ("triton-gpu", "gpu-smoke"):
        env = compose["services"][name]["environment"]
        assert env["UCX_MM_ERROR_HANDLING"] == "y" and env["UCX_CUDA_IPC_ENABLE_MNNVL"] == "n"


def test_the_multinode_profile_wires_a_frontend_to_two_prefill_and_two_decode_servers(compose):
    from disagg.settings import ServeSettings

    services = {n: s for n, s in compose["services"].items() if "multinode" in s["profiles"]}
    assert set(services) == {"frontend", "prefill-1", "prefill-2", "decode-1", "decode-2"}
    images = {s["image"] for s in services.values()}
    assert images == {"disagg-triton:cpu"}  # one image, every role
    roles = {}
    for name, svc in services.items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        env = {k: ("x" * 32 if v.startswith("${") else v) for k, v in env.items()}
        s = ServeSettings.load(None, env=env)  # what the node's serve will run with
        roles[name] = s.role
        assert s.path("engine_dir").parts[-2] == name  # its own engine: builds never race
        if s.role == "prefill":
            assert s.advertise_host == name and s.kv_port == 8105
    assert roles == {"frontend": "frontend", "prefill-1": "prefill", "prefill-2": "prefill",
                     "decode-1": "decode", "decode-2": "decode"}  # fmt: skip
    front = ServeSettings.load(None, env={k: str(v) for k, v in
                                          services["frontend"]["environment"].items()})  # fmt: skip
    for role in ("prefill", "decode"):
        hosts = {a.split(":")[0] for a in getattr(front, f"{role}_replicas").split(",")}
        assert hosts == {f"{role}-1", f"{role}-2"}  # the service names resolve in compose
    assert set(services["frontend"]["depends_on"]) == set(services) - {"frontend"}
    token = {svc["environment"]["DISAGG_INTERNAL_TOKEN"] for svc in services.values()}
    assert len(token) == 1 and token.pop().startswith("${DISAGG_INTERNAL_TOKEN:?")
