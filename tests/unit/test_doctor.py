"""`disagg doctor` on this CPU machine, with every check's failure simulated through a System
whose probes the test scripts (no GPU, Docker engine or TensorRT-LLM here)."""

from __future__ import annotations

import json

import pytest

from disagg.doctor import checks as C
from disagg.doctor import main, render, run_checks
from disagg.doctor.system import System
from disagg.settings import ServeSettings

pytestmark = pytest.mark.unit
CPU = ServeSettings()


class Scripted(System):
    """A machine described by data: commands -> (rc, output), and a few facts."""

    def __init__(self, **facts) -> None:
        self.tools = facts.pop("tools", set())
        self.commands = facts.pop("commands", {})
        self.facts = facts

    def which(self, name):
        return f"/usr/bin/{name}" if name in self.tools else None

    def run(self, cmd, timeout_s=10):
        return self.commands.get(cmd[0], (127, f"{cmd[0]}: not scripted"))

    def shm_free_bytes(self):
        return self.facts.get("shm", 8 << 30)

    def port_in_use(self, host, port):
        return port in self.facts.get("taken", ())

    def stale_stub_regions(self, older_than_s=60.0):
        return self.facts.get("stale", [])

    def remove_shm(self, name):
        self.facts["stale"] = [r for r in self.facts["stale"] if r[0] != name]
        self.facts.setdefault("removed", []).append(name)

    def http_get(self, url, timeout_s=3):
        return self.facts.get("http", {}).get(url.split("/", 3)[3], None)

    def tensorrt_llm(self):
        return self.facts.get("trtllm")

    def stub_libpython(self):
        return self.facts.get("libpython", "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")

    def ttft_s(self, settings):
        if isinstance(self.facts.get("ttft"), Exception):
            raise self.facts["ttft"]
        return self.facts.get("ttft", 0.2)


def by_name(results):
    return {r.name: r for r in results}


def gpu_settings(tmp_path, prefill="0", decode="1", fractions=(0.85, 0.85), extra=None):
    for pool, f in zip(("prefill", "decode"), fractions, strict=True):
        options = {"kv_cache_config": {"free_gpu_memory_fraction": f}, **(extra or {})}
        (tmp_path / f"{pool}.yaml").write_text(json.dumps(options))
    return ServeSettings(
        engine_backend="tensorrt_llm",
        trtllm_prefill_options=str(tmp_path / "prefill.yaml"),
        trtllm_decode_options=str(tmp_path / "decode.yaml"),
        trtllm_prefill_devices=prefill,
        trtllm_decode_devices=decode,
    )


SMI_OK = (0, "550.54.15")
TWO_GPUS = (0, "0, 81559, 0\n1, 81559, 0")


def test_a_healthy_cpu_machine_passes_and_skips_what_does_not_apply():
    results = by_name(run_checks(CPU, Scripted(http={"v2/health/live": None})))
    assert results["NVIDIA driver"].status == C.SKIP
    assert results["TensorRT-LLM"].status == C.SKIP and results["GPU memory"].status == C.SKIP
    assert results["ports"].status == C.OK and results["/dev/shm"].status == C.OK
    assert results["stub interpreter"].status == C.OK
    assert results["models ready"].status == C.SKIP  # no server: start one and rerun


def test_the_real_machine_is_probed_without_a_crash(capsys):
    """The real System on this CPU machine: no check crashes; the exit status follows."""
    code = main([])
    out = capsys.readouterr().out
    assert "check crashed" not in out and "where to look when:" in out
    assert code == (1 if "[FAIL]" in out else 0)


@pytest.mark.parametrize(
    "smi, tools, status, says",
    [
        (None, set(), C.FAIL, "nvidia-smi not found"),
        ((9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"),
         {"nvidia-smi"}, C.FAIL, "couldn't communicate"),
        (SMI_OK, {"nvidia-smi"}, C.OK, "550.54.15"),
    ],
)  # fmt: skip
def test_the_driver_check(tmp_path, smi, tools, status, says):
    sys_ = Scripted(tools=tools, commands={"nvidia-smi": smi} if smi else {})
    r = C.check_driver(gpu_settings(tmp_path), sys_)
    assert r.status == status and says in r.detail
    if status == C.FAIL and smi:
        assert "dmesg" in r.fix and "lsmod" in r.fix


def test_docker_without_the_nvidia_runtime_is_named(tmp_path):
    s = gpu_settings(tmp_path)
    missing = Scripted(tools={"docker"}, commands={"docker": (0, '{"runc":{"path":"runc"}}')})
    r = C.check_container_toolkit(s, missing)
    assert r.status == C.FAIL and "nvidia-ctk runtime configure" in r.fix
    ok = Scripted(tools={"docker"}, commands={"docker": (0, '{"nvidia":{"path":"x"}}')})
    assert C.check_container_toolkit(s, ok).status == C.OK
    no_engine = Scripted(tools={"docker"}, commands={"docker": (1, "Cannot connect")})
    assert C.check_container_toolkit(s, no_engine).status == C.SKIP


def test_tensorrt_llm_missing_old_or_not_taking_our_options(tmp_path):
    s = gpu_settings(tmp_path, extra={"enable_chunked_prefill": True})
    fields = {"kv_cache_config", "enable_chunked_prefill"}
    assert C.check_tensorrt_llm(s, Scripted()).status == C.FAIL  # import fails
    old = C.check_tensorrt_llm(s, Scripted(trtllm=("0.21.0", fields)))
    assert old.status == C.FAIL and "1.0 or later" in old.fix
    strict = C.check_tensorrt_llm(s, Scripted(trtllm=("1.0.0", {"kv_cache_config"})))
    assert strict.status == C.FAIL and "enable_chunked_prefill" in strict.detail
    assert C.check_tensorrt_llm(s, Scripted(trtllm=("1.0.0", fields))).status == C.OK
    (tmp_path / "build.json").write_text(json.dumps({"tensorrt_llm": "1.1.0"}))
    r = C.check_tensorrt_llm(s, Scripted(trtllm=("1.0.0", fields)))
    assert r.status == C.WARN and "1.1.0" in r.detail  # built for another image


def test_gpu_memory_against_the_pools(tmp_path):
    smi = Scripted(commands={"nvidia-smi": TWO_GPUS})
    assert C.check_gpu_memory(gpu_settings(tmp_path), smi).status == C.OK
    shared = C.check_gpu_memory(gpu_settings(tmp_path, decode="0"), smi)
    assert shared.status == C.FAIL and "add up to 1.70" in shared.detail
    fits = gpu_settings(tmp_path, decode="0", fractions=(0.3, 0.55))
    assert C.check_gpu_memory(fits, smi).status == C.OK
    missing = C.check_gpu_memory(gpu_settings(tmp_path, decode="3"), smi)
    assert missing.status == C.FAIL and "GPU 3" in missing.detail
    busy = Scripted(commands={"nvidia-smi": (0, "0, 81559, 40000\n1, 81559, 0")})
    assert C.check_gpu_memory(gpu_settings(tmp_path), busy).status == C.WARN


def test_ports_taken_by_someone_else_or_by_our_server():
    taken = Scripted(taken={8001})
    r = C.check_ports(CPU, taken)
    assert r.status == C.FAIL and "grpc" in r.detail and "DISAGG_GRPC_PORT" in r.fix
    ours = Scripted(taken={8000, 8001, 8002}, http={"v2/health/live": 200})
    assert C.check_ports(CPU, ours).status == C.OK


def test_a_small_dev_shm_is_caught_with_the_docker_and_kubernetes_fix():
    r = C.check_shm(CPU, Scripted(shm=64 << 20))  # Docker's default
    assert r.status == C.FAIL and "--ipc=host" in r.fix and "medium: Memory" in r.fix


def test_a_venv_from_another_interpreter_is_caught(monkeypatch):
    monkeypatch.setattr(C.sys, "base_prefix", "/root/.pyenv/versions/3.11.7")
    r = C.check_stub_interpreter(CPU, Scripted())
    assert r.status == C.FAIL and "/usr/bin/python3.11 -m venv" in r.fix
    assert C.check_stub_interpreter(CPU, Scripted(libpython=None)).status == C.FAIL


def test_models_and_warm_up_on_a_running_server():
    up = {"v2/health/live": 200, **{f"v2/models/{m}/ready": 200 for m in C.MODELS}}
    assert C.check_models(CPU, Scripted(http=up)).status == C.OK
    assert C.check_ttft(CPU, Scripted(http=up, ttft=0.3)).status == C.OK
    slow = C.check_ttft(CPU, Scripted(http=up, ttft=9.0))
    assert slow.status == C.WARN and "contending" in slow.fix
    broken = C.check_ttft(CPU, Scripted(http=up, ttft=TimeoutError("timed out")))
    assert broken.status == C.FAIL and "load balancer" in broken.fix
    half = {**up, "v2/models/decode/ready": 400}
    r = C.check_models(CPU, Scripted(http=half))
    assert r.status == C.FAIL and "decode" in r.detail


def test_a_probe_that_crashes_is_reported_not_raised():
    class Broken(Scripted):
        def shm_free_bytes(self):
            raise PermissionError("denied")

    results = by_name(run_checks(CPU, Broken()))
    assert results["shm"].status == C.FAIL and "check crashed" in results["shm"].detail
    assert "[FAIL] shm: check crashed: denied" in render(list(results.values()))


def test_regions_killed_servers_left_are_named_and_removed(capsys):
    from disagg.doctor import remove_stale_shm

    sys_ = Scripted(
        stale=[
            ("triton_python_backend_shm_region_a", 64 << 20),
            ("triton_python_backend_shm_region_b", 128 << 20),
        ]
    )
    got = by_name(run_checks(CPU, sys_))["stale stub memory"]
    assert got.status == C.WARN and "2 Python backend regions" in got.detail
    assert "192 MiB" in got.detail and "--remove-stale-shm" in got.fix
    assert remove_stale_shm(sys_) == 0
    assert sys_.facts["removed"] == [
        "triton_python_backend_shm_region_a",
        "triton_python_backend_shm_region_b",
    ]
    assert "2 stale regions removed, 192 MiB freed" in capsys.readouterr().out
    assert by_name(run_checks(CPU, sys_))["stale stub memory"].status == C.OK
