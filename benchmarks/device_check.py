#!/usr/bin/env python3
"""disagg's engine on another device against the CPU, in one run: logits within tolerance,
the same greedy tokens in a continuous batch, and prefill / decode tokens per second.

    python benchmarks/device_check.py --devices cpu,cuda,cuda@bfloat16 [--engine-dir DIR]

A device may name its compute dtype after '@' (default float32). The first device is the
reference; fp32 rows pass within 1e-2 of its logits, bf16 rows are reported, not gated.

With the engine's weights (DIR/model.safetensors) it runs the real model; without them (a GPU
machine reached without the 514 MB weights file) random weights of the same shape, which is
enough for numerics and speed. Prints a table and writes <out>/device_check.json. Needs only
torch and numpy (run with PYTHONPATH=src where disagg is not installed).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from disagg.engine.config import WEIGHTS_FILE, EngineConfig, ModelArgs, load_model_args
from disagg.engine.llm_engine import DecodeEngine, PrefillEngine
from disagg.engine.model import Llama
from disagg.engine.sequence import SamplingParams

SMOLLM2 = ModelArgs(
    dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=49152,
    rope_theta=100000.0, max_context=2048, tie_embeddings=True,
)  # fmt: skip


def weights_for(args: ModelArgs, engine_dir: Path | None) -> tuple[dict, str]:
    if engine_dir is not None and (engine_dir / WEIGHTS_FILE).is_file():
        from safetensors.torch import load_file

        return {k: v.float() for k, v in load_file(str(engine_dir / WEIGHTS_FILE)).items()}, "real"
    g = torch.Generator().manual_seed(0)
    kv = args.n_kv_heads * args.head_dim
    shapes = {"model.embed_tokens.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (args.dim, args.dim),
            p + "self_attn.k_proj.weight": (kv, args.dim),
            p + "self_attn.v_proj.weight": (kv, args.dim),
            p + "self_attn.o_proj.weight": (args.dim, args.dim),
            p + "mlp.gate_proj.weight": (args.hidden_dim, args.dim),
            p + "mlp.up_proj.weight": (args.hidden_dim, args.dim),
            p + "mlp.down_proj.weight": (args.dim, args.hidden_dim),
        })  # fmt: skip
    w = {k: torch.randn(s, generator=g) * s[-1] ** -0.5 for k, s in shapes.items()}
    for i in range(args.n_layers):
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[f"model.layers.{i}.{n}.weight"] = torch.ones(args.dim)
    w["model.norm.weight"] = torch.ones(args.dim)
    return w, "random"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_device(model: Llama, prompt: list[int], batch: int, steps: int) -> dict:
    dev = model.device
    config = EngineConfig(max_num_seqs=batch, max_model_len=len(prompt) + steps + 8)
    logits, _, _ = model.prefill(prompt)  # warm-up, and the logits compared across devices
    sync(dev)
    t = time.perf_counter()
    for _ in range(3):
        model.prefill(prompt)
    sync(dev)
    prefill_tps = 3 * len(prompt) / (time.perf_counter() - t)
    engine = DecodeEngine(model, config, eos_token_ids=set())
    prefill = PrefillEngine(model, config)
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i in range(batch):
        r = prefill.prefill(f"s{i}", prompt[: len(prompt) - i], params)
        engine.add_request(f"s{i}", params, prefill=r)
        tokens[f"s{i}"] = [r.first_token]
    t, n, timed = time.perf_counter(), 0, False
    while engine.has_unfinished:
        for o in engine.step():
            if o.token_id is not None:
                tokens[o.request_id].append(o.token_id)
                n += timed
        if not timed:  # the first step admits the batch: time the steps after it
            sync(dev)
            t, timed = time.perf_counter(), True
    sync(dev)
    return {
        "logits": logits.float().cpu(),
        "tokens": tokens,
        "prefill_tok_s": prefill_tps,
        "decode_tok_s": n / (time.perf_counter() - t),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="cpu,cuda")
    p.add_argument("--engine-dir", type=Path, default=None)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("results"))
    a = p.parse_args(argv)
    args = load_model_args(a.engine_dir) if a.engine_dir else SMOLLM2
    weights, kind = weights_for(args, a.engine_dir)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab_size, (a.prompt_len,), generator=g).tolist()
    results = {}
    for name in a.devices.split(","):
        device, _, dtype = name.partition("@")
        print(f"[{name}] loading ({kind} weights)", file=sys.stderr, flush=True)
        model = Llama(args, weights, compute_dtype=dtype or "float32", device=device)
        results[name] = run_device(model, prompt, a.batch, a.steps)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    ref_name = a.devices.split(",")[0]
    ref = results[ref_name]
    rows = []
    for name, r in results.items():
        diff = float((r["logits"] - ref["logits"]).abs().max())
        same = sum(r["tokens"][k] == ref["tokens"][k] for k in ref["tokens"])
        rows.append({
            "device": name,
            "torch_device": torch.cuda.get_device_name() if name.startswith("cuda") else "cpu",
            "prefill_tok_s": round(r["prefill_tok_s"], 1),
            "decode_tok_s": round(r["decode_tok_s"], 1),
            "max_abs_logit_diff_vs_" + ref_name: diff,
            "greedy_sequences_equal_to_" + ref_name: f"{same}/{len(ref['tokens'])}",
        })  # fmt: skip
    print(f"weights: {kind}; prompt {a.prompt_len} tokens; decode batch {a.batch} x {a.steps}")
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"weights": kind, "torch": torch.__version__, "machine": platform.machine()}
    (a.out / "device_check.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    gated = [r for r in rows if "@" not in r["device"] or r["device"].endswith("@float32")]
    worst = max((r["max_abs_logit_diff_vs_" + ref_name] for r in gated), default=0.0)
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
