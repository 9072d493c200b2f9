"""prefill: prompt ids -> first token + KV payload. Each instance is one process of the pool.

engine_backend "pytorch": disagg's engine, the payload is the prompt's K/V. "tensorrt_llm":
a context_only request, the payload is the serialised DisaggregatedParams (the K/V itself
moves through TensorRT-LLM's cache transceiver)."""

import os
import time
from pathlib import Path

import numpy as np
import torch

from disagg import heartbeat, kvshm
from disagg.cancel import CancelRegistry
from disagg.engine import cpu_share
from disagg.engine.llm_engine import PrefillEngine
from disagg.engine.model import Llama
from disagg.engine.sequence import SamplingParams
from disagg.engine.tokenizer import eos_token_ids
from disagg.errors import RequestCancelledError
from disagg.model_params import PrefillParams
from disagg.triton import bls, pb, pb_metrics, prefill_side


class TritonPythonModel:
    def initialize(self, args):
        pb.configure_logging()
        p = pb.model_parameters(args).typed(PrefillParams)
        self.pid = os.getpid()
        self.cancels = CancelRegistry(Path(p.run_dir) / "cancel")
        self.metrics = pb_metrics.PrefillMetrics(args["model_instance_name"])
        self.trtllm = None
        self.activity = None
        if p.engine_backend == "tensorrt_llm":
            from disagg.trtllm.runtime import prefill_engine

            self.trtllm = prefill_engine(p)
            heartbeat.start(Path(p.run_dir) / "heartbeat")  # last, as below
            return
        # decode on the same cores steps on one thread while this computes, and this on
        # prefill_torch_threads while decode steps, on every core while it idles (cpu_share.py)
        if p.cores_shared:
            full = torch.get_num_threads()  # torch's default: every core
            shared = p.prefill_torch_threads or full
            self.activity = cpu_share.PrefillThreads(p.run_dir, full, shared)
        pb.set_nice(p.prefill_nice)  # before torch makes its threads (they inherit it)
        pb.set_torch_threads(p.prefill_torch_threads)
        self.engine = PrefillEngine(
            Llama.load(p.engine_dir, p.compute_dtype, p.device, p.weights, p.decode_activations),
            p.engine_config(),
            reuse_kv_buffers=True,
            eos_token_ids=eos_token_ids(p.engine_dir),  # for min_tokens
        )
        # Payload buffers, one per request of an execute() call, reused across calls: their
        # pages are faulted in once instead of once per long prompt.
        self.buffers: list[np.ndarray] = []
        self.engine.prefill("warm-up", [1, 2, 3, 4], SamplingParams(max_tokens=1))
        self.prefix_metrics = pb_metrics.PrefixCacheMetrics("prefill", args["model_instance_name"])
        # decode on other servers: payloads are leased here and pulled by them (kvnet.py)
        self.kv = None
        if p.kv_pull:
            self.kv = prefill_side.KVLeaseServer.start(p, args, self.metrics.leased_bytes)
        # decode in this server: payloads in shared-memory files, a reference in the reply
        # (kvshm.py: the bytes skip tritonserver's threads that carry decode's tokens)
        self.shm = None if p.kv_pull else kvshm.ShmHandoffs.open(p.kv_lease_mb << 20, p.kv_lease_s)
        # frontends elsewhere follow what its prefix cache holds (kvevents.py)
        self.kv_events = prefill_side.publish_kv_events(p, args, self.engine)
        heartbeat.start(Path(p.run_dir) / "heartbeat")  # last: a stub still loading is not judged

    def finalize(self):
        for server in (getattr(self, n, None) for n in ("kv", "kv_events", "shm", "activity")):
            if server is not None:
                server.close()
        pb_metrics.close_metrics()  # before the stub exits (see pb_metrics.close_metrics)

    def execute(self, requests):
        return [self._prefill(r, i) for i, r in enumerate(requests)]

    def _payload(self, kv, i: int):
        """(the reply's payload: the bytes or a reference to them, how to free what it
        references or None)."""
        if self.shm is not None and (ref := self.shm.write(kv.packed_size(), kv.pack)):
            return np.frombuffer(ref.to_bytes(), np.uint8), lambda: self.shm.drop(ref)
        payload = kv.pack(self._buffer(i, kv.packed_size()))
        if self.kv is None:
            return payload, None
        payload = self.kv.lease(payload)
        return payload, lambda: self.kv.drop(payload)

    def _buffer(self, i: int, size: int) -> np.ndarray:
        while len(self.buffers) <= i:
            self.buffers.append(np.empty(0, np.uint8))
        if self.buffers[i].size < size:
            self.buffers[i] = np.empty(size, np.uint8)
        return self.buffers[i]

    def _prefill(self, request, i: int):
        try:
            bls.check_internal(request, "prefill")
            call = prefill_side.read_prefill_call(request)
            prompt, params = call.prompt_ids, call.params
            start, start_wall_ns = time.perf_counter(), time.time_ns()
            rid = request.request_id()
            # the client left: over BLS the router marks it (cancel.py); over gRPC (a
            # frontend elsewhere) the call's cancellation reaches this request
            cancelled = prefill_side.cancel_check(request, self.cancels)
            kv_start = 0  # TensorRT-LLM's payload names the whole prompt's K/V (its skip: 0)
            drop = None  # frees what the payload references, if it references anything
            if self.trtllm is not None:
                from disagg.trtllm.payload import to_bytes

                result, handoff = self.trtllm.prefill(rid, prompt, params, cancelled)
                payload = np.frombuffer(to_bytes(handoff), np.uint8)
            else:
                if self.activity is None:
                    result = self.engine.prefill(rid, prompt, params, call.skip_tokens, cancelled)
                else:  # the count follows decode's stepping layer by layer (cpu_share.py)
                    with self.activity.computing():
                        stop = self.activity.between_layers(cancelled)
                        result = self.engine.prefill(rid, prompt, params, call.skip_tokens, stop)
                kv_start = result.kv.start
                if self.engine.kv_reuse is not None:
                    self.prefix_metrics.update(self.engine.kv_reuse.index.stats)
            compute_us = int((time.perf_counter() - start) * 1e6)  # the hand-off starts here
            if self.trtllm is None:
                payload, drop = self._payload(result.kv, i)
                # a caller that left while the last layers ran or the payload was packed
                # (100+ ms for a long prompt) never gets this reply, nor the reference in
                # it: its lease or file would wait for the TTL (a CI failure showed 83 MB
                # held), so it is dropped here
                if drop is not None and cancelled.now():
                    drop()
                    raise RequestCancelledError(f"prefill of {rid}: the caller went away")
            try:
                return prefill_side.prefill_response(
                    result, payload, self.pid, compute_us, start_wall_ns, kv_start
                )
            except Exception:
                if drop is not None:  # nobody will get the reference
                    drop()
                raise
        except RequestCancelledError as e:  # its client left: the worker takes the next one
            self.metrics.prefill_cancelled()
            return pb.error_response(e)
        except Exception as e:
            return pb.error_response(e)
