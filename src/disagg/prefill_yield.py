"""How much of a shared CPU the prefill processes take: their torch threads and niceness; and
whether decode's process runs one OpenMP pool (engine/omp.py).

Where conditional or disaggregated mode runs both pools in one CPU server, a prefill sent to
the prefill pool computes on the cores decode steps on. With torch's default threads at the
same priority, each of the prefill's parallel regions waits whenever decode preempts one of
its threads, and decode's steps wait on the prefill likewise. One prefill thread at nice 10
takes what decode leaves and never waits on a thread of its own. Measured on 2 cores
(docs/benchmarks.md, "the token rhythm"): four streams ran 4x faster while 1,600-token
prompts arrived (74.7 against 17.6 tok/s), ITL p99/p50 2.36 against 1.62 (target <= 3), the
long prompts' TTFT 10.7 against 7.6 s; 16 chat streams 106.6 against 97.3 tok/s. That count
holds while decode steps; while decode has nothing running a prefill takes every core
(engine/cpu_share.py), so a lone request is not prefilled on one thread.

Elsewhere (a prefill pool on servers of its own, GPUs, co-located mode) nothing changes:
torch's default threads at the niceness the process started with.

Decode's OpenMP workers spin between parallel regions while its process has one pool, and
sleep at once while it has two (libgomp throttles spinning when it manages more threads
than CPUs). Measured on 2 cores (docs/benchmarks.md, "One OpenMP pool"): with the cores its
own, one pool served co-located 16 chat streams 8% faster and one stream 37-57% faster;
beside a prefill pool on the same cores, the spinning starved the prefill (long prompts'
TTFT 11-12 -> 17-19 s, 16 streams 5% slower). So beside a prefill pool decode keeps one pool
and steps on one thread only while a prefill computes (engine/cpu_share.py: in conditional
mode one stream 55 -> 86 tok/s, 16 streams +10%, the rhythm kept); a second decode instance
shares its cores with the first, and there decode keeps two pools.
"""

from __future__ import annotations

from typing import Protocol

from disagg.contracts import CONDITIONAL, DISAGGREGATED


class ServeSettings(Protocol):
    """What this module reads of settings.ServeSettings (a frozen dataclass that imports
    this module, hence read-only properties here and no import of it)."""

    @property
    def role(self) -> str: ...
    @property
    def prefill_replicas(self) -> str: ...
    @property
    def engine_backend(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def prefill_torch_threads(self) -> int: ...
    @property
    def prefill_nice(self) -> int: ...
    @property
    def decode_instances(self) -> int: ...
    def resolved_mode(self) -> tuple[str, str]: ...


SHARED_THREADS = 1
SHARED_NICE = 10


def _prefill_here(s: ServeSettings, modes: tuple[str, ...]) -> bool:
    """Whether this server runs a prefill pool of our CPU engine, in one of `modes`."""
    one_server = s.role == "all" and not s.prefill_replicas
    ours_on_cpu = s.engine_backend == "pytorch" and s.device == "cpu"
    return one_server and ours_on_cpu and s.resolved_mode()[0] in modes


def shares_cores(s: ServeSettings) -> bool:
    """Whether this server runs a prefill pool on decode's CPU cores."""
    return _prefill_here(s, (CONDITIONAL, DISAGGREGATED))


def decode_one_pool(s: ServeSettings) -> bool:
    """Whether decode's process keeps one OpenMP pool (its engine loop's): with one decode
    instance, whether its cores are its own or a prefill pool's too, which it then yields
    to while a prefill computes (engine/cpu_share.py)."""
    return s.decode_instances == 1


def prefill_yield(s: ServeSettings) -> tuple[int, int]:
    """(torch threads, niceness) for the prefill processes: as set where either setting is
    (prefill_torch_threads 2 and prefill_nice 0 give the old default back), else as the
    module says."""
    if s.prefill_torch_threads or s.prefill_nice or not shares_cores(s):
        return s.prefill_torch_threads, s.prefill_nice
    return SHARED_THREADS, SHARED_NICE


def template_values(s: ServeSettings) -> dict[str, str]:
    """The model configs' parameters this module decides."""
    threads, nice = prefill_yield(s)
    return {
        "prefill_torch_threads": str(threads),
        "prefill_nice": str(nice),
        "decode_one_pool": str(decode_one_pool(s)).lower(),
        "cores_shared": str(shares_cores(s)).lower(),
    }
