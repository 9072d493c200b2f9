"""A Llama-architecture decoder written for serving on CPU.

Two entry points, one per phase:
  prefill(token_ids)        one sequence, all prompt tokens at once (compute bound);
                            returns last-position logits and the prompt's K/V.
  decode(tokens, positions) one new token for each of B sequences (memory bound);
                            reads and appends K/V in a `KVCacheSlots`.

Weights are fused per layer (QKV in one matrix, gate+up in one) so each phase makes few,
large matrix products. A quantized checkpoint's layers are served in its own blocks by
default (engine/quant.py: a quarter of the bytes per decode step); dense weights are packed
at load into oneDNN's layout (1.5-3x torch's MKL path at decode's 1-32 rows, no slower for
prefill: benchmarks/engine_bench.py), else plain `F.linear`.

The same code runs on a CUDA device (`device="cuda"`): weights, RoPE tables and the KV cache
live there and linear layers are plain `F.linear` (cuBLAS); the engine samples on the CPU
from logits copied back, so a seed draws the same tokens on every device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from disagg.engine import fused_decode, packed_prefill, quant
from disagg.engine.config import ACTIVATION_SETTINGS, WEIGHTS_FILE, ModelArgs, load_model_args
from disagg.engine.interrupt import Stop, until_stopped
from disagg.engine.kernels import (
    CPU,
    HAS_ONEDNN,
    BlockLinear,
    Linear,
    linear,
    matmul_dtype,
    pack,
    resolve_compute_dtype,
    resolve_device,
)
from disagg.engine.layers import prompt_attention, rms_norm, rope_tables, silu_mul, split_qkv
from disagg.engine.packed_prefill import Chunk
from disagg.engine.prefault import prefault_kv, zeros_kv
from disagg.engine.quant import QuantLinear
from disagg.errors import ConfigError

log = logging.getLogger("disagg.engine.model")
ATTN_BLOCK = 64
WEIGHTS = ("auto", "float32", "bfloat16")


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [dim]
    wqkv: Linear | BlockLinear  # [(H + 2 * H_kv) * D, dim]
    wo: Linear | BlockLinear  # [dim, H * D]
    ffn_norm: torch.Tensor  # [dim]
    w13: Linear | BlockLinear  # [2 * hidden, dim]: gate rows, then up rows
    w2: Linear | BlockLinear  # [dim, hidden]


class KVCacheSlots:
    """Physical K/V storage of a decode engine: one slot of `max_len` positions per sequence.

    k[l], v[l]: [max_slots, H_kv, max_len, D]. Running sequences occupy slots 0..B-1 (the
    scheduler keeps them compact), so a decode step attends over the view k[l][:B, :, :T]
    with no gather. Allocated through numpy's calloc: pages cost memory only once written,
    and unwritten positions read as zeros (never NaN), which masked attention relies on.
    """

    def __init__(
        self,
        args: ModelArgs,
        max_slots: int,
        max_len: int,
        prefault: bool = False,
        device: torch.device = CPU,
    ) -> None:
        shape = (args.n_layers, max_slots, args.n_kv_heads, max_len, args.head_dim)
        self.k, self.v = zeros_kv(shape, device)
        # every page before the first step using it: on a thread of its own where the kernel
        # can (engine/prefault.py), so a restarted decode is READY a second sooner
        self.prefaulted = prefault_kv(self.k, self.v, prefault)
        self.device = device
        self.max_slots = max_slots
        self.max_len = max_len

    def write(
        self,
        slot: int,
        k: npt.NDArray[np.float32] | torch.Tensor,
        v: npt.NDArray[np.float32] | torch.Tensor,
    ) -> None:
        """Store a sequence's K/V ([L, H_kv, S, D]) at positions 0..S-1 of `slot`.
        On the CPU through numpy: a payload's arrays may be read-only views of received
        bytes. Elsewhere one host-to-device copy each (none for K/V already there)."""
        n = k.shape[2]
        if self.device.type == "cpu":
            self.k.numpy()[:, slot, :, :n] = k.numpy() if isinstance(k, torch.Tensor) else k
            self.v.numpy()[:, slot, :, :n] = v.numpy() if isinstance(v, torch.Tensor) else v
            return
        for dst, src in ((self.k, k), (self.v, v)):
            src = src if isinstance(src, torch.Tensor) else torch.from_numpy(np.asarray(src))
            dst[:, slot, :, :n] = src

    def move(self, src: int, dst: int, num_tokens: int) -> None:
        self.k[:, dst, :, :num_tokens] = self.k[:, src, :, :num_tokens]
        self.v[:, dst, :, :num_tokens] = self.v[:, src, :, :num_tokens]


class Llama:
    engine_dir: Path | None = None  # set by load(): its tokenizer's, for guided decoding

    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, torch.Tensor],
        compute_dtype: str = "float32",
        device: str = "cpu",
        onednn: bool | None = None,
        blocks: dict[str, QuantLinear] | None = None,
        activations: str = "float32",
    ) -> None:
        """compute_dtype "bfloat16" ("auto": where the device has native bf16) stores the
        layers' matmul weights in bf16 and feeds them bf16 activations (fp32 accumulation;
        norms, attention, residual stream, KV cache and the LM head stay fp32): 40% fewer
        bytes per decode step, on CPUs with native bf16.
        `onednn` (None: where it helps, the CPU) picks the linear kernels; False on a CPU runs
        the plain path other devices take.
        `blocks` (the checkpoint's quantized tensors, by HF name): those weights are served
        in their blocks (fp32 activations, compute_dtype unused for them); the embedding
        lookup keeps the fp32 table, the LM head takes the embedding's blocks when tied.
        `activations` "int8": a decode step's block products quantize their input rows per
        32 values and multiply in integers (engine/qdot.c); the LM head keeps fp32 ones
        (the argmax is where rounding shows: 10 of 16 greedy replies equal fp32's with it
        fp32, 7 with it int8, for ~1 ms a step). Prefill is unchanged (dense fp32). "bfloat16":
        the layers' block products, prefill's too, in bf16 arithmetic (qbf16.c; AVX512-BF16).
        "auto": bfloat16 where blocks are served and qbf16.c runs on the CPU's own bf16
        instructions, else float32 (self.activations: what was chosen)."""
        if activations not in ACTIVATION_SETTINGS:
            raise ConfigError(
                f"activations must be one of {ACTIVATION_SETTINGS}, got {activations!r}"
            )
        if activations == "auto":  # the CPU's own bf16 products where the blocks are served
            activations = "bfloat16" if blocks and quant.bf16_simd() else "float32"
        self.bf16_blocks = activations == "bfloat16" and bool(blocks) and quant.require_bf16()
        self.args = args
        self.device = resolve_device(device)
        dtype = matmul_dtype(compute_dtype, self.device)
        self.compute_dtype = resolve_compute_dtype(compute_dtype, self.device)
        self.onednn = HAS_ONEDNN and self.device.type == "cpu" if onednn is None else onednn
        # cuBLAS picks GEMM and batched-GEMM kernels by shape, and they round differently
        # (an H200: a row's logits alone and in a batch of 2-64 differed in every case):
        # decode on a GPU runs one shape every step, so a row's bits are its own
        self.fixed_shapes = self.device.type == "cuda"
        self.aligned = self.device.type == "cpu"  # prompt attention by blocks: layers.py
        self.blocks = blocks or {}
        if self.blocks and self.device.type != "cpu":
            raise ConfigError("quantized blocks run on the CPU only: load them with device cpu")
        w = {k: v.to(self.device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # [V, dim]
        head_name = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
        # fp32 (bf16 logits from a bf16 head flipped too many argmaxes), or the file's own
        # blocks: in bf16 arithmetic too with bf16 activations (perplexity +0.07%, 7 ms less;
        hb = self.blocks.get(head_name)  # no fp32 copy packed for it then)
        if hb is not None and self.bf16_blocks:
            self.lm_head: Linear | BlockLinear = BlockLinear(hb, None, "bfloat16")
        else:
            head = pack(w[head_name], onednn=self.onednn)
            self.lm_head = head if hb is None else BlockLinear(hb, head)
        self.norm = w["model.norm.weight"]
        self.layers = [self._fuse(w, i, dtype) for i in range(args.n_layers)]
        # what the matmuls read: "float32", "bfloat16", or the blocks' formats ("q4_1+q8_0")
        used = [lin for layer in self.layers for lin in (layer.wqkv, layer.w13)]
        formats = sorted({lin.fmt for lin in [*used, self.lm_head] if isinstance(lin, BlockLinear)})
        self.weights = "+".join(formats) or self.compute_dtype
        self.fused = fused_decode.supported(self)
        self.attn_in_c = self.fused  # prompt rows as decode rows: layers.prompt_attention
        self.activations = activations if self.fused or self.bf16_blocks else "float32"
        # past this many prompt rows the blocks' dense copy (kernels.linear)
        self.prompt_rows = quant.PROMPT_ROWS if self.fused else quant.DIRECT_ROWS
        if activations != self.activations:
            log.warning("activations %s need quantized blocks served: decoding fp32", activations)
        self.cos, self.sin = (t.to(self.device) for t in rope_tables(args))
        self.scale = args.head_dim**-0.5

    def _fuse(self, w: dict[str, torch.Tensor], i: int, dtype: torch.dtype) -> LayerWeights:
        p = f"model.layers.{i}."

        def lin(*names: str) -> Linear | BlockLinear:
            full = [p + n + ".weight" for n in names]
            dense = torch.cat([w[n] for n in full])
            parts = [self.blocks.get(n) for n in full]  # fused: one format, or dense
            if all(parts) and len({b.fmt for b in parts if b}) == 1:
                blocks = quant.cat_rows([b for b in parts if b])
                if self.bf16_blocks:  # the blocks at every row count, no dense copy
                    return BlockLinear(blocks, None, "bfloat16")
                return BlockLinear(blocks, pack(dense, onednn=self.onednn))  # prefill: dense
            return pack(dense, dtype, self.onednn)

        return LayerWeights(
            attn_norm=w[p + "input_layernorm.weight"],
            wqkv=lin("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            wo=lin("self_attn.o_proj"),
            ffn_norm=w[p + "post_attention_layernorm.weight"],
            w13=lin("mlp.gate_proj", "mlp.up_proj"),
            w2=lin("mlp.down_proj"),
        )

    @classmethod
    def load(
        cls,
        engine_dir: str | Path,
        compute_dtype: str = "float32",
        device: str = "cpu",
        weights: str = "auto",
        activations: str = "float32",
    ) -> Llama:
        """`weights` "auto": the checkpoint's own quantized blocks where the block kernels run
        (a CPU with a C compiler), else dense at `compute_dtype`; "float32" or "bfloat16":
        dense at that dtype (compute_dtype is then not used)."""
        from safetensors.torch import load_file

        if weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        if weights != "auto":
            compute_dtype = weights
        args = load_model_args(engine_dir)
        path = Path(engine_dir) / WEIGHTS_FILE
        if not path.is_file():
            raise ConfigError(f"{path} not found: rebuild the engine")
        dev = resolve_device(device)  # refuse an unusable device or dtype before the weights
        matmul_dtype(compute_dtype, dev)
        blocks = quant.load_blocks(engine_dir) if weights == "auto" and dev.type == "cpu" else None
        dense = {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}
        (model := cls(args, dense, compute_dtype, device, blocks=blocks, activations=activations))
        model.engine_dir = Path(engine_dir)
        return model

    # ------------------------------------------------------------ shared pieces

    def _qkv(
        self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [M, dim] -> q [M, H, D], k/v [M, H_kv, D], with RoPE applied to q and k."""
        h = rms_norm(x, layer.attn_norm, self.args.norm_eps, self.fused)
        qkv = linear(h, layer.wqkv, self.prompt_rows)
        return split_qkv(self.args, qkv, cos, sin, self.fused)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, layer.ffn_norm, self.args.norm_eps, self.fused)
        act = silu_mul(linear(h, layer.w13, self.prompt_rows), self.fused)
        return linear(act, layer.w2, self.prompt_rows)

    # ------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        all_logits: bool = False,
        kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
        stop: Stop = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run a whole prompt. Returns logits ([V], or [S, V] with `all_logits`) and the
        prompt's K/V, each [L, H_kv, S, D]. With `kv_out` (two [L, H_kv, >=S, D] buffers)
        K/V are written there and views of them returned: a server reuses the buffers
        instead of faulting in tens of MB of fresh pages per long prompt (`stop`: interrupt.py)."""
        a = self.args
        s = len(token_ids)
        cos, sin = self.cos[:s, None, :], self.sin[:s, None, :]  # [S, 1, D]
        if kv_out is None:
            k_out = torch.empty(a.n_layers, a.n_kv_heads, s, a.head_dim, device=self.device)
            v_out = torch.empty_like(k_out)
        else:
            k_out, v_out = kv_out[0][:, :, :s], kv_out[1][:, :, :s]
        x = self.embed[torch.tensor(token_ids, device=self.device)]  # [S, dim]
        for i, layer in until_stopped(self.layers, stop):
            q, k, v = self._qkv(layer, x, cos, sin)
            k_out[i], v_out[i] = k.transpose(0, 1), v.transpose(0, 1)
            o = prompt_attention(q, k_out[i], v_out[i], 0, self.scale, self.aligned, self.attn_in_c)
            x = x + linear(o, layer.wo, self.prompt_rows)
            x = x + self._mlp(layer, x)
        last = x if all_logits else x[-1:]
        h = rms_norm(last, self.norm, a.norm_eps, self.fused)
        logits = linear(h, self.lm_head, self.prompt_rows)
        return (logits if all_logits else logits[0]), k_out, v_out

    @torch.inference_mode()
    def prefill_chunk(
        self, token_ids: list[int], start: int, cache: KVCacheSlots, slot: int, stop: Stop = None
    ) -> torch.Tensor:
        """Prefill prompt positions start..start+n-1 of the sequence in `slot`, whose
        positions 0..start-1 are already in the cache: the chunk's K/V go into the cache and
        its queries attend over the prefix and causally within the chunk. Returns the logits
        of the chunk's last position ([V]). Chunk after chunk, this is the whole prefill, in
        a different summation order where products round by their row count (fp32's dense
        copy: logits within ~1e-4 of `prefill`; bf16 dense weights: within ~0.2); the same
        bits with bf16 block products (the same bits at every row count), for any chunks
        where attention runs in C (`attn_in_c`), else wherever chunks start at multiples of
        layers.PROMPT_ATTN_ROWS."""
        a = self.args
        end = start + len(token_ids)
        cos, sin = self.cos[start:end, None, :], self.sin[start:end, None, :]
        x = self.embed[torch.tensor(token_ids, device=self.device)]  # [n, dim]
        for i, layer in until_stopped(self.layers, stop):
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.k[i][slot, :, start:end] = k.transpose(0, 1)
            cache.v[i][slot, :, start:end] = v.transpose(0, 1)
            kc, vc = cache.k[i][slot], cache.v[i][slot]
            o = prompt_attention(q, kc, vc, start, self.scale, self.aligned, self.attn_in_c)
            x = x + linear(o, layer.wo, self.prompt_rows)
            x = x + self._mlp(layer, x)
        return linear(rms_norm(x[-1:], self.norm, a.norm_eps, self.fused), self.lm_head)[0]

    def prefill_chunks(self, chunks: list[Chunk], cache: KVCacheSlots) -> list[torch.Tensor]:
        """`prefill_chunk` of each chunk, bit for bit, their products made together on a CPU
        (engine/packed_prefill.py); one after another elsewhere (cuBLAS picks kernels by
        row count)."""
        if self.device.type != "cpu" or len(chunks) == 1:
            return [self.prefill_chunk(c.token_ids, c.start, cache, c.slot) for c in chunks]
        with torch.inference_mode():
            return packed_prefill.prefill_chunks(self, chunks, cache)

    # ------------------------------------------------------------ decode

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCacheSlots
    ) -> torch.Tensor:
        """One step for B sequences in slots 0..B-1.

        tokens: [B] int64, the newest token of each sequence (not yet in the cache);
        positions: [B] int64, where that token goes (= tokens already cached).
        Returns logits [B, V]."""
        if self.fused:  # the block-quantized CPU engine: the small ops in C too
            return fused_decode.decode(self, tokens, positions, cache)
        a = self.args
        b = tokens.shape[0]
        dev = self.device
        last = int(positions.max())  # before the copy to the device: no sync there
        tokens, positions = tokens.to(dev), positions.to(dev)
        # Attend over positions 0..t-1, t rounded up to a multiple of ATTN_BLOCK: reductions
        # over t then see whole blocks of exact zeros past each sequence's end, so a
        # sequence's result is the same alone or beside longer ones (batch invariance).
        t = min(-(-(last + 1) // ATTN_BLOCK) * ATTN_BLOCK, cache.max_len)
        real = b
        if self.fixed_shapes:  # every step one shape: all slots, the whole cache length
            b, t = cache.max_slots, cache.max_len
            tokens, positions = F.pad(tokens, (0, b - real)), F.pad(positions, (0, b - real))
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [B, 1, D]
        # Row of (slot b, head h, position p) in a layer's cache viewed as [slots*H_kv*len, D]:
        # new K/V go in with one index_copy_ (advanced indexing was 10% of a step).
        heads = torch.arange(a.n_kv_heads, device=dev)
        rows = (
            (torch.arange(real, device=dev)[:, None] * a.n_kv_heads + heads) * cache.max_len
            + positions[:real, None]
        ).reshape(-1)  # [B * H_kv]: padding rows write nothing
        # mask: [B, 1, 1, T], -inf past each sequence's own length
        mask = torch.zeros(b, 1, 1, t, device=dev)
        past_end = torch.arange(t, device=dev) > positions[:, None]
        mask.masked_fill_(past_end[:, None, None, :], float("-inf"))
        x = self.embed[tokens]  # [B, dim]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            kc, vc = cache.k[i], cache.v[i]  # [slots, H_kv, max_len, D]
            kc.view(-1, a.head_dim).index_copy_(0, rows, k[:real].reshape(-1, a.head_dim))
            vc.view(-1, a.head_dim).index_copy_(0, rows, v[:real].reshape(-1, a.head_dim))
            # query heads grouped by KV head; (B, H_kv) merged into one batch dimension: a
            # view of the cache, and 3x faster in bmm than the 4-D strided matmul
            qg = q.reshape(b * a.n_kv_heads, a.n_groups, a.head_dim)  # [B*H_kv, G, D]
            keys = kc[:b, :, :t].reshape(b * a.n_kv_heads, t, a.head_dim)  # [B*H_kv, T, D]
            values = vc[:b, :, :t].reshape(b * a.n_kv_heads, t, a.head_dim)
            scores = torch.bmm(qg, keys.transpose(1, 2)).view(b, a.n_kv_heads, a.n_groups, t)
            probs = torch.softmax(scores * self.scale + mask, dim=-1)  # [B, H_kv, G, T]
            o = torch.bmm(probs.view(-1, a.n_groups, t), values).reshape(b, -1)  # [B, H * D]
            x = x + linear(o, layer.wo)
            x = x + self._mlp(layer, x)
        return linear(rms_norm(x, self.norm, a.norm_eps), self.lm_head)[:real]
