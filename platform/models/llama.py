"""Llama-family decoder (Llama, Qwen2, Mistral) over one flattened ragged batch and paged KV.

No padding and no per-request loop over layers: every step runs each layer once over all T
tokens of the batch (prefill chunks and decode tokens of different requests together). The
K/V of every token goes into the unified pool; attention reads it back through block tables;
LoRA deltas are added per token segment by the SGMV kernels, reading adapter rows from the pool
(on the CPU, those of prefill segments inside the projections' GEMMs: kernels/cpu_lora_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from loraplex.errors import ModelLoadError
from loraplex.kernels import AttentionMetadata, KernelOps, LoraBatch, cpu_lora_gemm
from loraplex.kernels.cpu_lora_gemm import ModuleColumns
from loraplex.kernels.pointwise import PointwiseOps, cpu_pointwise
from loraplex.lora.types import MODULE_INDEX

from . import cpu_gemm
from .config import ModelConfig
from .rope import RotaryEmbedding

Q, K, V, O = (MODULE_INDEX[m] for m in ("q_proj", "k_proj", "v_proj", "o_proj"))
GATE, UP, DOWN = (MODULE_INDEX[m] for m in ("gate_proj", "up_proj", "down_proj"))


# On the CPU the projection weights are stored transposed, [in, out], and applied as x @ W: with
# torch 2.13's CPU GEMMs that runs faster than F.linear's x @ W[out, in].T at decode batch sizes
# (float32, 1 thread, all 30 layers of the default model: 92 vs 132 ms at 64 tokens, 66 vs 69 ms
# at 16, 28 vs 29 ms at 1). GPU GEMMs take either layout at the same speed, so there the
# checkpoint layout is kept. The tied lm_head is not transposed: it would be a second copy of the
# embedding, and it measured no faster. Both apply where oneDNN does not (cpu_gemm: prepacked
# weights, faster still where torch has it).
WEIGHTS_IN_OUT_ON_CPU = True


@dataclass(frozen=True)
class LayerWeights:
    """Projection weights are [out, in] (checkpoint layout), [in, out] (LlamaModel.layout "in_out"), or
    a packed form of [out, in] ("packed": cpu_linear.PackedWeight, "onednn": oneDNN's)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q + 2kv, H]  q, k and v fused: one GEMM instead of three
    qkv_bias: torch.Tensor | None  # [q + 2kv]
    o: torch.Tensor  # [H, q]
    o_bias: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H]  gate and up fused
    gate_up_bias: torch.Tensor | None  # [2I]
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None  # [H]


@dataclass(frozen=True)
class _StepLora:
    """One step's adapter segments as the projections add them."""

    in_gemm: LoraBatch | None  # long segments: added in the packed GEMM's epilogue (cpu_lora_gemm)
    rest: LoraBatch | None  # the others: added by ops.apply_lora_group after the GEMM
    pool_rows: torch.Tensor  # [R, D]
    ops: KernelOps


@dataclass(frozen=True)
class StepInputs:
    """One step's flattened batch, as the model runner builds it."""

    input_ids: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    lora: LoraBatch | None  # None when no token of the step uses an adapter
    logits_index: torch.Tensor  # [N] int64, tokens whose logits are wanted (last of each sequence, ...)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    if x.dtype == torch.float32:
        # One call instead of seven Python-level ops (CPU, 1 thread: 11 vs 27 us at 1 token, 14 vs
        # 19 us at 16); in float32 its result is bit-identical to transformers' formula below
        # (tests/models/test_llama_ops.py).
        return F.rms_norm(x, weight.shape, weight, eps)
    # Same numerics as transformers' LlamaRMSNorm: normalise in float32, scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor,  # [T, H] the residual stream
    d: torch.Tensor,  # [T, H] what the layer adds to it
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (h + d, rms_norm(h + d))
    h = h + d
    return h, rms_norm(h, weight, eps)


def rope(
    qkv: torch.Tensor,  # [T, W]: nh q heads, then nkv k heads, from column 0
    heads: tuple[int, int, int],  # (nh, nkv, head_dim)
    cos: torch.Tensor,  # [T, head_dim] in qkv's dtype
    sin: torch.Tensor,  # [T, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # (q [T, nh, hd], k [T, nkv, hd]) rotated
    nh, nkv, hd = heads
    # q and k heads are adjacent in each qkv row: rotate them in one pass, then split views.
    qk = RotaryEmbedding.rotate(qkv[:, : (nh + nkv) * hd].view(qkv.shape[0], nh + nkv, hd), cos[:, None, :],
                                sin[:, None, :])
    return qk[:, :nh], qk[:, nh:]


def swiglu(
    gu: torch.Tensor,  # [T, 2I] gate | up
    inter: int,  # I
) -> torch.Tensor:  # [T, I]
    return F.silu(gu[:, :inter]) * gu[:, inter:]


# transformers' formulas in torch ops: the reference the kernel sets are checked against, and what runs
# where no kernel set applies.
TORCH_POINTWISE = PointwiseOps(name="torch", rms_norm=rms_norm, add_rms_norm=add_rms_norm, rope=rope, swiglu=swiglu)


def linear(
    x: torch.Tensor,  # [T, in]
    w,  # [out, in] ("out_in"), [in, out] ("in_out") or packed ("packed", "onednn")
    b: torch.Tensor | None,  # [out]
    layout: str,
) -> torch.Tensor:  # [T, out]
    if layout in cpu_gemm.PACKED_LAYOUTS:
        return cpu_gemm.linear(x, w, b, layout)
    if layout == "out_in":
        return F.linear(x, w, b)
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


class LlamaModel:
    """Holds the weights and runs the forward pass; the KV cache lives in the pager's pool."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 gemm: str = "auto"):
        """gemm: the CPU projections' backend (cpu_gemm.GEMM_CHOICES); GPUs always take F.linear."""
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.rope = RotaryEmbedding(cfg, device)
        self.scale = cfg.head_dim**-0.5
        self.layout = cpu_gemm.choose(gemm, device, dtype) or (
            "in_out" if WEIGHTS_IN_OUT_ON_CPU and device.type == "cpu" else "out_in")
        packed = self.layout in cpu_gemm.PACKED_LAYOUTS
        # The elementwise steps where the kernel backend brings none of its own (KernelOps.pointwise): the C++
        # kernels where they build (CPU, float32: one pass each, where torch's RMSNorm is ~10 ops), else torch.
        self.pointwise = (cpu_pointwise(TORCH_POINTWISE) if device.type == "cpu" and dtype == torch.float32
                          else TORCH_POINTWISE)

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = weights.get(name)
            if t is None:
                if required:
                    raise ModelLoadError(f"checkpoint has no tensor {name!r}")
                return None
            return t.to(device=device, dtype=dtype).contiguous()

        def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
            return None if any(t is None for t in ts) else torch.cat(ts, dim=0).contiguous()

        def proj(*ts: torch.Tensor) -> torch.Tensor:  # [out, in] pieces -> one weight in the GEMM layout
            w = cat(*ts)
            if packed:
                return cpu_gemm.pack(w, self.layout)
            return w.t().contiguous() if self.layout == "in_out" else w

        self.embed = take("model.embed_tokens.weight")
        if tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ModelLoadError(
                f"embed_tokens has shape {tuple(self.embed.shape)}, config says ({cfg.vocab_size}, {cfg.hidden_size})"
            )
        self.final_norm = take("model.norm.weight")
        lm_head = None if cfg.tie_word_embeddings else take("lm_head.weight", required=False)
        head = lm_head if lm_head is not None else self.embed  # [V, H]
        # Packed (for a tied head, a copy: the packed form cannot serve the embedding lookup): with
        # oneDNN 2-3x faster at decode batch sizes on the dev CPU, for 4 x vocab x hidden bytes more memory.
        self.head_layout = self.layout if packed else "out_in"
        self.lm_head = cpu_gemm.pack(head, self.layout) if packed else head
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = cat(*(take(f"{p}self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")))
            mlp_bias = cfg.mlp_bias
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=proj(*(take(f"{p}self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj"))),
                    qkv_bias=qkv_bias,
                    o=proj(take(p + "self_attn.o_proj.weight")),
                    o_bias=take(p + "self_attn.o_proj.bias") if cfg.o_bias else None,
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=proj(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")),
                    gate_up_bias=cat(take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")) if mlp_bias else None,
                    down=proj(take(p + "mlp.down_proj.weight")),
                    down_bias=take(p + "mlp.down_proj.bias") if mlp_bias else None,
                )
            )
        if self.layout == "packed":  # every packed weight in one buffer of 2 MiB pages
            fields = ("qkv", "o", "gate_up", "down")
            moved = cpu_gemm.on_huge_pages([getattr(lw, f) for lw in self.layers for f in fields] + [self.lm_head])
            self.lm_head = moved.pop()
            n = len(fields)
            self.layers = [replace(lw, **dict(zip(fields, moved[i * n:(i + 1) * n]))) for i, lw in enumerate(self.layers)]
        self.qkv_splits = (cfg.q_size, cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)
        # Which LoRA module owns which output columns of each fused projection (the GEMM's LoRA epilogue).
        h, i2 = cfg.hidden_size, 2 * cfg.intermediate_size
        self.lora_columns = {"qkv": ModuleColumns((Q, K, V), (0, *self.qkv_splits)),
                             "o": ModuleColumns((O,), (0, h)),
                             "gate_up": ModuleColumns((GATE, UP), (0, cfg.intermediate_size, i2)),
                             "down": ModuleColumns((DOWN,), (0, h))}
        self._gemm_lora: dict[int, bool] = {}  # pool row width -> whether the epilogue applies

    def gemm_lora(self, d: int) -> bool:
        """Whether prefill LoRA can go into the packed GEMM's epilogue with pool rows of d elements."""
        hit = self._gemm_lora.get(d)
        if hit is None:
            hit = self.layout == "packed" and cpu_lora_gemm.applies(d, tuple(self.lora_columns.values()))
            self._gemm_lora[d] = hit
        return hit

    def _project(self, x: torch.Tensor, w, b: torch.Tensor | None, layer: int, cols: str,
                 lora: _StepLora | None) -> torch.Tensor:  # x [T, in] -> [T, out] with the adapters' deltas
        c = self.lora_columns[cols]
        if lora is not None and lora.in_gemm is not None:
            y = cpu_lora_gemm.linear_lora(x, w, b, lora.pool_rows, lora.in_gemm, layer, c)
        else:
            y = linear(x, w, b, self.layout)
        if lora is not None and lora.rest is not None:
            # All modules of the fused projection at once: one launch pair on the Triton path, not one per module.
            lora.ops.apply_lora_group(y, x, lora.pool_rows, lora.rest, layer, c.modules, c.bounds)
        return y

    @torch.inference_mode()
    def forward(
        self,
        step: StepInputs,
        kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
        pool_rows: torch.Tensor,  # [R, D], the same pool viewed as adapter rows
        ops: KernelOps,
    ) -> torch.Tensor:  # [N, vocab] float32 logits of the tokens in step.logits_index
        cfg = self.cfg
        T = step.input_ids.shape[0]
        lora = None
        if step.lora is not None:
            lora = _StepLora(None, step.lora, pool_rows, ops)
            if ops.gemm_lora and self.gemm_lora(pool_rows.shape[1]):
                # Long (prefill) segments' deltas inside the projections' GEMMs; the rest through apply_lora_group.
                parts = cpu_lora_gemm.split(step.lora, pool_rows.shape[1])
                lora = _StepLora(parts.fused, parts.rest, pool_rows, ops)
        h = F.embedding(step.input_ids, self.embed)  # [T, H]
        inter = cfg.intermediate_size
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        # Positions are the same in every layer: look up cos/sin once per step.
        cos, sin = self.rope.cos_sin(step.attn.positions, self.dtype)  # [T, hd]
        eps, last = cfg.rms_norm_eps, len(self.layers) - 1
        pw = ops.pointwise or self.pointwise
        x = pw.rms_norm(h, self.layers[0].input_norm, eps)
        for li, w in enumerate(self.layers):
            qkv = self._project(x, w.qkv, w.qkv_bias, li, "qkv", lora)  # [T, q + 2kv]
            q, k = pw.rope(qkv, heads, cos, sin)  # [T, nh, hd], [T, nkv, hd]
            v = qkv[:, self.qkv_splits[1]:].view(T, cfg.num_kv_heads, cfg.head_dim)
            ops.write_kv(kv_pool, k, v, step.attn, li)
            attn = ops.paged_attention(q, kv_pool, step.attn, li, self.scale).reshape(T, cfg.q_size)
            o = self._project(attn, w.o, w.o_bias, li, "o", lora)  # [T, H]
            h, x = pw.add_rms_norm(h, o, w.post_norm, eps)
            gu = self._project(x, w.gate_up, w.gate_up_bias, li, "gate_up", lora)  # [T, 2I]
            act = pw.swiglu(gu, inter)  # [T, I]
            d = self._project(act, w.down, w.down_bias, li, "down", lora)  # [T, H]
            # The next layer's input norm, fused with this residual add.
            if li < last:
                h, x = pw.add_rms_norm(h, d, self.layers[li + 1].input_norm, eps)
            else:
                h = h + d
        h = pw.rms_norm(h.index_select(0, step.logits_index), self.final_norm, eps)
        return linear(h, self.lm_head, None, self.head_layout).float()
