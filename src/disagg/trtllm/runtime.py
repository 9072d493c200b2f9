"""Building the TensorRT-LLM engines of the prefill and decode models from their parameters:
`trtllm_<pool>_model` (a Hugging Face checkpoint), `trtllm_<pool>_options` (the LLM-API options
build_engines/build_trtllm_engine.py wrote for that pool: batch sizes, KV cache fraction, cache
transceiver, parallelism) and `trtllm_<pool>_devices` (the GPUs the pool may use).

Each pool's model instance is a KIND_CPU process that picks its GPUs itself, as upstream's
LLM-API Triton model does (triton_backend/all_models/llmapi): CUDA_VISIBLE_DEVICES is set
before tensorrt_llm is first imported in the stub, so the pools never share a device by
accident and TensorRT-LLM's own workers (tensor/pipeline parallel) inherit the choice."""

from __future__ import annotations

import os
import typing
from collections.abc import MutableMapping
from pathlib import Path

from disagg.errors import ConfigError
from disagg.model_params import TrtllmDecodeParams, TrtllmPrefillParams
from disagg.trtllm import gpus
from disagg.trtllm.engines import TrtllmDecodeEngine, TrtllmPrefillEngine
from disagg.trtllm.kv_events import RequestFeatures
from disagg.trtllm.sampling import TrtllmApi

if typing.TYPE_CHECKING:
    from tensorrt_llm import LLM

Options = dict[str, typing.Any]  # LLM-API options, as YAML gives them


def read_options(options_file: str) -> Options:
    import yaml

    if not options_file:
        return {}
    try:
        options: object = yaml.safe_load(Path(options_file).read_text()) or {}
    except OSError as e:
        raise ConfigError(f"TensorRT-LLM options {options_file}: {e}") from e
    if not isinstance(options, dict):
        raise ConfigError(f"TensorRT-LLM options {options_file}: expected a mapping")
    return options


def transceiver_backends() -> tuple[str, ...]:
    """The cache transceiver backends the installed TensorRT-LLM accepts, in its spelling
    (the Literal of CacheTransceiverConfig.backend: lowercase in 1.0, uppercase later)."""
    from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig

    annotation = CacheTransceiverConfig.model_fields["backend"].annotation
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return tuple(typing.get_args(arg))
    return ()


def spell_transceiver(options: Options, accepted: tuple[str, ...]) -> Options:
    """`options` with cache_transceiver_config.backend in the case the library accepts."""
    cfg = options.get("cache_transceiver_config")
    if not isinstance(cfg, dict) or cfg.get("backend") is None or not accepted:
        return options
    wanted = str(cfg["backend"])
    match = next((a for a in accepted if a.upper() == wanted.upper()), None)
    if match is None:
        raise ConfigError(f"cache transceiver backend {wanted!r}: this TensorRT-LLM has {accepted}")
    return {**options, "cache_transceiver_config": {**cfg, "backend": match}}


def check_devices(devices: str, options: Options, pool: str) -> list[int]:
    """A pool's parallelism must match the GPUs it is given; its GPU indexes, parsed."""
    ids = gpus.parse_devices(devices, f"trtllm_{pool}_devices")
    if not ids:
        return ids
    world = int(options.get("tensor_parallel_size", 1)) * int(
        options.get("pipeline_parallel_size", 1)
    )
    if world != len(ids):
        raise ConfigError(
            f"the {pool} pool runs on {world} GPU(s) (tensor x pipeline parallel) but "
            f"trtllm_{pool}_devices names {len(ids)}: {devices}"
        )
    return ids


def check_token_budget(options: Options, max_model_len: int, pool: str) -> None:
    """TensorRT-LLM refuses a prompt over max_num_tokens (unless generation-only or chunked
    prefill is on): each pool must fit the longest prompt it may prefill itself."""
    limit = options.get("max_num_tokens")
    if limit and not options.get("enable_chunked_prefill") and int(limit) < max_model_len:
        raise ConfigError(
            f"the {pool} pool's max_num_tokens {limit} is under max_model_len {max_model_len}: "
            "a longer prompt would be refused; raise it or set enable_chunked_prefill"
        )


# Variables of an MPI job this process may have inherited (disagg serve started under mpirun
# or srun): with them the pool's MPI_Init would join that job instead of starting its own
# world, from which TensorRT-LLM spawns its worker. Upstream's LLM-API Triton model drops the
# same job variables (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py); settings
# such as OMPI_MCA_* and PMIX_MCA_* stay.
MPI_JOB_VARIABLES = frozenset(
    {"OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS"}
    | {f"PMI_{v}" for v in ("RANK", "SIZE", "FD", "SPAWNED", "APPNUM")}
)
MPI_JOB_PREFIXES = ("OMPI_COMM_WORLD_", "OMPI_MCA_orte_", "ORTE_", "PMIX_")


def isolate_from_mpi_job(env: MutableMapping[str, str]) -> list[str]:
    """Drop the inherited MPI job variables from `env`; which ones."""
    dropped = [
        k
        for k in env
        if k in MPI_JOB_VARIABLES
        or (k.startswith(MPI_JOB_PREFIXES) and not k.startswith("PMIX_MCA_"))
    ]
    for k in dropped:
        del env[k]
    return sorted(dropped)


def prepare_process(devices: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Before the first import of tensorrt_llm (and torch, mpi4py) in the pool's process:
    its GPUs, numbered as nvidia-smi numbers them, and a fresh MPI world of its own.

    A single-GPU LLM() starts its executor worker through mpi4py (MPIPoolExecutor, an
    MPI_Comm_spawn from this process's own MPI world: tensorrt_llm/executor/proxy.py with
    mpi_session None), as upstream's Triton model does in a tritonserver started by
    `launch_triton_server.py --no-mpi`; TLLM_WORKER_USE_SINGLE_PROCESS=1 in the server's
    environment keeps the worker in this process instead (docs/gpu.md)."""
    isolate_from_mpi_job(env)
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if devices:  # inherited by TensorRT-LLM's spawned workers (tensor/pipeline parallel)
        env["CUDA_VISIBLE_DEVICES"] = devices


def transceiver_fields() -> set[str]:
    from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig

    return set(CacheTransceiverConfig.model_fields)


def with_transfer_timeout(options: Options, fields: set[str], timeout_s: float) -> Options:
    """A context whose generation half never comes (prefill timed out, fallback, a client
    gone) holds its KV blocks on the prefill GPU until the transfer ends: bound that wait
    where the installed TensorRT-LLM can (CacheTransceiverConfig.kv_transfer_timeout_ms,
    after 1.0). TensorRT-LLM 1.0 cannot: it has no such field, and an abort does not reach a
    finished context request (pyexecutor moves it out of active_requests into
    ctx_in_transmission_requests, which _handle_canceled_requests never looks at)."""
    cfg = options.get("cache_transceiver_config")
    if (
        not isinstance(cfg, dict)
        or timeout_s <= 0
        or "kv_transfer_timeout_ms" not in fields
        or "kv_transfer_timeout_ms" in cfg
    ):
        return options
    timeout = {"kv_transfer_timeout_ms": int(timeout_s * 1000)}
    return {**options, "cache_transceiver_config": {**cfg, **timeout}}


def llm_args(options: Options) -> Options:
    """The options as LLM() takes them, through the function upstream's own Triton model and
    trtllm-serve's --extra_llm_api_options use (nested configs that need building, e.g.
    speculative_config, are built; kv_cache_config and cache_transceiver_config stay dicts,
    which TorchLlmArgs' pydantic fields validate, extra fields forbidden)."""
    from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

    return dict(update_llm_args_with_extra_dict({}, dict(options)))


def load_llm(
    model: str,
    options_file: str,
    devices: str,
    pool: str,
    max_model_len: int,
    transfer_timeout_s: float = 0.0,
) -> tuple[LLM, TrtllmApi, Options]:
    if not model:
        raise ConfigError(f"engine_backend tensorrt_llm needs trtllm_{pool}_model (a checkpoint)")
    options = read_options(options_file)
    ids = check_devices(devices, options, pool)
    check_token_budget(options, max_model_len, pool)
    gpus.check_exist(
        ids,
        gpus.count_gpus() if ids else None,
        f"trtllm_{pool}_devices",
        f"rebuild with --{pool}-devices naming GPUs that exist "
        "(build_engines/build_trtllm_engine.py), or set DISAGG_TRTLLM_"
        f"{pool.upper()}_DEVICES",
    )
    prepare_process(devices)
    api = TrtllmApi.load()
    options = spell_transceiver(options, transceiver_backends())
    options = with_transfer_timeout(options, transceiver_fields(), transfer_timeout_s)
    return api.LLM(model=model, **llm_args(options)), api, options


def prefill_engine(p: TrtllmPrefillParams) -> TrtllmPrefillEngine:
    llm, api, options = load_llm(
        p.trtllm_prefill_model,
        p.trtllm_prefill_options,
        p.trtllm_prefill_devices,
        "prefill",
        p.max_model_len,
        transfer_timeout_s=p.kv_lease_s,  # as long as disagg keeps an unpulled CPU payload
    )
    features = RequestFeatures.of(llm, api.SamplingParams, options)
    return TrtllmPrefillEngine(llm, api, max_prompt_tokens=p.max_model_len - 1, features=features)


def decode_engine(p: TrtllmDecodeParams) -> TrtllmDecodeEngine:
    llm, api, options = load_llm(
        p.trtllm_decode_model,
        p.trtllm_decode_options,
        p.trtllm_decode_devices,
        "decode",
        p.max_model_len,
    )
    features = RequestFeatures.of(llm, api.SamplingParams, options)
    return TrtllmDecodeEngine(llm, api, max_num_seqs=p.decode_max_num_seqs, features=features)
