"""Model shapes, random adapters and small pools for the pager tests (everything built in-process)."""

from __future__ import annotations

import random

import numpy as np
import torch

from loraplex.lora.types import TARGET_MODULES, LoraAdapter, LoraModuleWeights
from loraplex.models.config import ModelConfig
from loraplex.unified_pager.geometry import PoolGeometry
from loraplex.unified_pager.pager import UnifiedPager


def model_config(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, layers: int
) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=257, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
        tie_word_embeddings=False, attention_bias=False,
    )


# SmolLM2-135M: hidden 576, 9 heads, 3 KV heads, head_dim 64, MLP 1536, 30 layers.
SMOLLM2 = model_config(576, 9, 3, 64, 1536, 30)
# Small shapes that are not powers of two (D = 16 here), for tests that touch every page.
TINY = model_config(48, 3, 1, 16, 80, 3)
# D = 8: q/kv/hidden/MLP widths share only a small factor.
ODD = model_config(96, 6, 2, 16, 200, 2)


def geometry_with_pages(cfg: ModelConfig, num_pages: int, dtype=torch.float32, block_size: int = 4) -> PoolGeometry:
    page_bytes = 2 * block_size * cfg.kv_size * dtype.itemsize
    return PoolGeometry.for_model(cfg, num_pages * page_bytes, dtype, block_size)


def small_pager(num_pages: int, cfg: ModelConfig = TINY, dtype=torch.float32, block_size: int = 4) -> UnifiedPager:
    return UnifiedPager(geometry_with_pages(cfg, num_pages, dtype, block_size), "cpu")


def random_adapter(
    cfg: ModelConfig,
    rng: random.Random,
    ranks: tuple[int, int] = (1, 16),
    name: str = "a",
    layers: list[int] | None = None,
    modules: list[str] | None = None,
) -> LoraAdapter:
    """Random non-zero weights, a random subset of layers and modules, a random rank per module
    (as PEFT's rank_pattern allows)."""
    if layers is None:
        layers = sorted(rng.sample(range(cfg.num_layers), rng.randint(1, cfg.num_layers)))
    if modules is None:
        modules = [m for m in TARGET_MODULES if rng.random() < 0.5] or [rng.choice(TARGET_MODULES)]
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    mods = []
    for layer in layers:
        for module in modules:
            r = rng.randint(*ranks)
            in_f, out_f = cfg.module_shape(module)
            mods.append(LoraModuleWeights(
                layer=layer, module=module, rank=r, scale=rng.uniform(0.1, 4.0),
                a=torch.randn(r, in_f, generator=gen), b=torch.randn(out_f, r, generator=gen),
            ))
    return LoraAdapter(name=name, modules=tuple(mods), max_rank=max(m.rank for m in mods))


def adapter_of_pages(pager, rng, n_pages, name="a"):
    """A random adapter that takes exactly n_pages pages (q_proj on layer 0, rank chosen to fit)."""
    g = pager.geometry
    rows_per_rank = (48 + 48) // g.row_width  # q_proj: A and B^T
    rank = n_pages * g.rows_per_page // rows_per_rank
    adapter = random_adapter(TINY, rng, ranks=(rank, rank), name=name, layers=[0], modules=["q_proj"])
    assert g.adapter_num_pages(adapter) == n_pages
    return adapter


def snapshot(pager):
    return pager.stats(), pager.pool.kind.copy(), pager.pool.owner.copy(), pager.pool.free_pages()


def assert_unchanged(pager, snap):
    stats, kind, owner, free = snap
    assert pager.stats() == stats
    assert np.array_equal(pager.pool.kind, kind) and np.array_equal(pager.pool.owner, owner)
    assert np.array_equal(pager.pool.free_pages(), free)
