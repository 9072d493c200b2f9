#!/usr/bin/env python3
"""Engine speed: disagg's CPU engine against Hugging Face transformers, in one run.

Measures, on this machine and in this process:
  - memory read/copy bandwidth and fp32 GEMM rate (the ceilings)
  - cold start to first token (a fresh `disagg generate` process)
  - prefill tokens/s at several prompt lengths
  - decode tokens/s at several numbers of concurrent sequences (continuous-batching engine)
  - the same prefill/decode figures for transformers on the same weights
Prints a table, writes results/engine_bench.json and results/engine_bench.png.

    python benchmarks/engine_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from disagg.engine.config import EngineConfig, ModelArgs
from disagg.engine.kernels import bf16_supported
from disagg.engine.llm_engine import DecodeEngine
from disagg.engine.model import Llama
from disagg.engine.sequence import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine_ceilings() -> dict:
    a = torch.ones(64 * 2**20)  # 256 MB: far past the caches
    b = torch.empty_like(a)
    read = a.numel() * 4 / median_time(lambda: a.sum(), 10) / 1e9
    copy = 2 * a.numel() * 4 / median_time(lambda: b.copy_(a), 10) / 1e9
    x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = 2 * 2048**3 / median_time(lambda: x @ y, 5) / 1e9
    return {"read_GBps": read, "copy_GBps": copy, "gemm_GFLOPs": gemm}


def weight_bytes_per_step(a: ModelArgs) -> int:
    """Bytes of weights one decode step reads: every linear layer plus the LM head."""
    per_layer = (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * a.dim + a.dim * a.dim
    per_layer += 3 * a.hidden_dim * a.dim
    return 4 * (a.n_layers * per_layer + a.vocab_size * a.dim)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


# ------------------------------------------------------------------ disagg


def ours_prefill(model: Llama, n: int, reps: int) -> float:
    ids = prompt(n, n)
    return n / median_time(lambda: model.prefill(ids), reps)


def ours_decode(model: Llama, batch: int, steps: int, prompt_len: int) -> float:
    """Tokens/s of DecodeEngine.step() with `batch` sequences running (sampling and
    scheduling included), prompts prefilled before the clock starts."""
    cfg = EngineConfig(
        max_num_seqs=max(batch, 1), max_model_len=model.args.max_context, prefault_kv=True
    )  # as the served decode model does
    engine = DecodeEngine(model, cfg, eos_token_ids=set())
    engine.cache.prefaulted.wait()
    params = SamplingParams(max_tokens=steps + 3, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), params, prompt_ids=prompt(prompt_len, 1000 + i))
    engine.step()  # admits and prefills everyone, then one decode step
    engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return batch * steps / (time.perf_counter() - t)


def cold_start(engine_dir: str) -> float:
    t = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "disagg",
            "generate",
            "--engine-dir",
            engine_dir,
            "--prompt",
            "Hi",
            "--max-tokens",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t


# ------------------------------------------------------------------ transformers


def hf_model(engine_dir: str, a: ModelArgs):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=a.dim,
        intermediate_size=a.hidden_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        vocab_size=a.vocab_size,
        rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_context,
        tie_word_embeddings=a.tie_embeddings,
    )
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(load_file(str(Path(engine_dir) / "model.safetensors")), strict=False)
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def hf_prefill(model, n: int, reps: int) -> float:
    ids = torch.tensor([prompt(n, n)])
    return n / median_time(lambda: model(ids, logits_to_keep=1), reps)


@torch.inference_mode()
def hf_decode(model, batch: int, steps: int, prompt_len: int) -> float:
    ids = torch.tensor([prompt(prompt_len, 1000 + i) for i in range(batch)])
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)  # warm-up
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t = time.perf_counter()
    for _ in range(steps):
        out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return batch * steps / (time.perf_counter() - t)


# ------------------------------------------------------------------ report


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in results["prefill_tok_s"]:
        pf = results["prefill_tok_s"][name]
        ax1.plot([int(k) for k in pf], list(pf.values()), marker="o", label=name)
        dc = results["decode_tok_s"][name]
        ax2.plot([int(k) for k in dc], list(dc.values()), marker="o", label=name)
    ax1.set(title="Prefill", xlabel="prompt tokens", ylabel="tokens/s", xscale="log", xticks=[])
    ax1.set_xticks(
        [int(k) for k in results["prefill_tok_s"]["disagg"]],
        labels=list(results["prefill_tok_s"]["disagg"]),
    )
    ax2.set(title="Decode (continuous batch)", xlabel="concurrent sequences", ylabel="tokens/s")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default=str(ROOT / "engines" / "smollm2-135m-instruct"))
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--no-transformers", action="store_true")
    a = p.parse_args()
    prefill_sizes = [128, 512] if a.quick else [128, 512, 1024, 2048]
    batches = [1, 4] if a.quick else [1, 4, 16, 32]
    reps, steps, prompt_len = (2, 8, 128) if a.quick else (5, 32, 128)

    res: dict = {
        "command": " ".join(sys.argv),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "processor": platform.processor(),
    }
    print("measuring machine ceilings ...", flush=True)
    res["machine"] = machine_ceilings()
    print("cold start to first token ...", flush=True)
    res["cold_start_s"] = cold_start(a.engine_dir)
    model = Llama.load(a.engine_dir)
    model_bf16 = Llama.load(a.engine_dir, "bfloat16") if bf16_supported() else None
    hf = None if a.no_transformers else hf_model(a.engine_dir, model.args)
    names = ["disagg"] + (["disagg-bf16"] if model_bf16 else [])
    names += [] if hf is None else ["transformers"]
    res["prefill_tok_s"] = {n: {} for n in names}
    res["decode_tok_s"] = {n: {} for n in names}
    for n in prefill_sizes:  # side by side per size: noise hits both alike
        print(f"prefill {n} tokens ...", flush=True)
        res["prefill_tok_s"]["disagg"][str(n)] = ours_prefill(model, n, reps)
        if model_bf16 is not None:
            res["prefill_tok_s"]["disagg-bf16"][str(n)] = ours_prefill(model_bf16, n, reps)
        if hf is not None:
            res["prefill_tok_s"]["transformers"][str(n)] = hf_prefill(hf, n, reps)
    for b in batches:
        print(f"decode {b} sequences ...", flush=True)
        res["decode_tok_s"]["disagg"][str(b)] = ours_decode(model, b, steps, prompt_len)
        if model_bf16 is not None:
            res["decode_tok_s"]["disagg-bf16"][str(b)] = ours_decode(
                model_bf16, b, steps, prompt_len
            )
        if hf is not None:
            res["decode_tok_s"]["transformers"][str(b)] = hf_decode(hf, b, steps, prompt_len)

    wb = weight_bytes_per_step(model.args)
    bound_ms = wb / (res["machine"]["read_GBps"] * 1e9) * 1e3
    step_ms = 1e3 / res["decode_tok_s"]["disagg"]["1"]
    res["batch1"] = {
        "weight_MB": wb / 1e6,
        "bandwidth_bound_ms": bound_ms,
        "step_ms": step_ms,
        "ratio_to_bound": step_ms / bound_ms,
    }

    m = res["machine"]
    print(
        f"\nmachine: read {m['read_GBps']:.1f} GB/s, copy {m['copy_GBps']:.1f} GB/s, "
        f"fp32 GEMM {m['gemm_GFLOPs']:.0f} GFLOP/s, {res['threads']} threads"
    )
    print(f"cold start to first token: {res['cold_start_s']:.1f} s")
    header = (
        "| engine | "
        + " | ".join(f"prefill@{n}" for n in prefill_sizes)
        + " | "
        + " | ".join(f"decode@{b}" for b in batches)
        + " |"
    )
    print(header)
    print("|" + "---|" * (1 + len(prefill_sizes) + len(batches)))
    for n in names:
        cells = [f"{res['prefill_tok_s'][n][str(s)]:.0f}" for s in prefill_sizes]
        cells += [f"{res['decode_tok_s'][n][str(b)]:.1f}" for b in batches]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if hf is not None:
        pf, dc = res["prefill_tok_s"], res["decode_tok_s"]
        ratios = [pf["disagg"][str(s)] / pf["transformers"][str(s)] for s in prefill_sizes]
        ratios += [dc["disagg"][str(b)] / dc["transformers"][str(b)] for b in batches]
        print("| ratio | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
        res["ratios"] = ratios
    b1 = res["batch1"]
    print(
        f"batch-1 decode step {b1['step_ms']:.1f} ms; weights {b1['weight_MB']:.0f} MB / read "
        f"bandwidth = {b1['bandwidth_bound_ms']:.1f} ms; ratio {b1['ratio_to_bound']:.2f}x"
    )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_bench.json").write_text(json.dumps(res, indent=2))
    plot(res, out / "engine_bench.png")
    print(f"wrote {out / 'engine_bench.json'} and {out / 'engine_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
