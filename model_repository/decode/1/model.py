"""decode (decoupled): continuous batching over every request reaching this instance, one
response per new token. Takes a KV payload from prefill, or prompt ids (then it prefills
itself: the co-located mode, and the fallback when the prefill pool fails)."""

import os
from pathlib import Path

from disagg import contracts as C
from disagg import heartbeat
from disagg.cancel import CancelRegistry
from disagg.engine import cpu_share, omp
from disagg.engine.config import load_model_args
from disagg.engine.llm_engine import DecodeEngine
from disagg.engine.model import Llama
from disagg.engine.tokenizer import eos_token_ids
from disagg.model_params import DecodeParams
from disagg.pipeline.decode_service import DecodeService
from disagg.triton import bls, decode_side, pb, pb_metrics


class TritonPythonModel:
    def initialize(self, args):
        pb.configure_logging()
        p = pb.model_parameters(args).typed(DecodeParams)
        self.one_pool = False
        self.threads = None
        self.metrics = pb_metrics.DecodeMetrics(args["model_name"], args["model_instance_name"])
        if p.engine_backend == "tensorrt_llm":
            from disagg.trtllm.runtime import decode_engine

            engine = decode_engine(p)  # same DecodeEngine interface, TensorRT-LLM underneath
        else:
            pb.set_torch_threads(p.decode_torch_threads)
            # the engine loop's OpenMP pool alone: its workers spin between parallel regions
            # (engine/omp.py); beside a prefill pool on its cores, its steps run on one
            # thread while a prefill computes (engine/cpu_share.py); where a second decode
            # instance shares the cores, a second pool (this thread's) makes them sleep, and
            # decode only tells the prefill pool that it steps
            self.one_pool = p.decode_one_pool
            if p.cores_shared:
                self.threads = cpu_share.DecodeThreads(
                    p.run_dir, on_shared_step=self.metrics.on_shared_step, yields=self.one_pool
                )
            if self.one_pool:
                omp.serial_here()
            else:
                omp.pool_here()
            eos = eos_token_ids(p.engine_dir)
            engine = DecodeEngine(
                Llama.load(
                    p.engine_dir, p.compute_dtype, p.device, p.weights, p.decode_activations
                ),
                p.engine_config(),
                eos,
                on_admit=self.metrics.on_admit,
            )
        self.max_num_seqs = p.decode_max_num_seqs
        self.last_load = (0, 0)
        self.kv_bytes_per_token = max(load_model_args(p.engine_dir).kv_bytes_per_token, 1)
        cancels = CancelRegistry(Path(p.run_dir) / "cancel")
        self.service = DecodeService(
            engine,
            cancels,
            on_step=self._on_step,
            before_step=self.threads.before_step if self.threads is not None else None,
            on_idle=self.threads.idle if self.threads is not None else None,
            stream_interval=p.decode_stream_interval,
            batch_slots=p.decode_max_num_seqs,
        ).start()
        self.pid = os.getpid()
        # frontends elsewhere follow what its prefix cache holds, and its load (kvevents.py)
        self.kv_events = decode_side.publish_kv_events(p, args, engine, self.kv_bytes_per_token)
        heartbeat.start(Path(p.run_dir) / "heartbeat")  # last: a stub still loading is not judged

    def _on_step(self, stats) -> None:
        self.metrics.on_step(stats)
        load = (stats.num_running, stats.num_waiting)
        if getattr(self, "kv_events", None) is not None and load != self.last_load:
            self.last_load = load
            self.kv_events.nudge()  # the frontends hear of it now, not a heartbeat later

    def _load(self) -> tuple[int, int, int, int]:
        s = self.service.engine.stats()
        free_kv = -1  # unknown (TensorRT-LLM's engine does not say)
        if s.kv_bytes_capacity is not None and s.kv_bytes_reserved is not None:
            free_kv = (s.kv_bytes_capacity - s.kv_bytes_reserved) // self.kv_bytes_per_token
        return s.num_running, s.num_waiting, max(self.max_num_seqs - s.num_running, 0), free_kv

    def execute(self, requests):
        if self.one_pool:
            omp.serial_here()  # (whichever thread the stub calls this on: see initialize)
        for request in requests:
            sink = decode_side.SenderSink(
                request.get_response_sender(),
                self.pid,
                bls.is_bls_caller(request),
                bls.CallerWatch.of(request),
                load=self._load if C.DECODE_LOAD in request.requested_output_names() else None,
            )
            try:
                bls.check_internal(request, "decode")
                rid = request.request_id() or C.new_request_id()
                params, prefill, prompt_ids = decode_side.read_decode_call(request, rid)
                self.service.submit(rid, params, sink, prefill=prefill, prompt_ids=prompt_ids)
            except Exception as e:
                sink.fail(e)
        return None

    def finalize(self):
        if self.kv_events is not None:
            self.kv_events.close()
        self.service.stop()
        if self.threads is not None:
            self.threads.close()
        pb_metrics.close_metrics()  # before the stub exits (see pb_metrics.close_metrics)
