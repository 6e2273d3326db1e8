"""Paged attention on the CPU through the C++ kernel (cpu_attention.cpp): K/V read in place, and the
new tokens' K/V written into their slots.

Same signature and semantics as torch_attention.paged_attention, which stays the fallback: for
tensors off the CPU or not float32, and where the extension cannot be built (cpu_build).

The kernel takes a list of tiles (sequence, first token, tokens, keys of the first token), the
same in every layer of a step: it is built once per step and cached in meta.plan_cache. A decode
sequence is one tile of one token; a prefill chunk is cut into tiles of PREFILL_ROWS // group tokens.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import torch_attention
from .cpu_build import load_extension
from .metadata import AttentionMetadata

STEM = "cpu_attention"
# Query rows (tokens x query heads of a kv head) of a prefill tile: each K/V row read serves them
# all, and the kernel computes them 16 to a vector; 96 is whole vectors for 1, 2, 3, 4, 6 or 8
# heads a group. Measured (1 thread, SmolLM2 shapes): 48 rows and up run alike, a token a tile
# (3 rows) 2x slower.
PREFILL_ROWS = 96
# Prefill chunks through the kernel (True) or through the torch path's gather + SDPA (False).
# Measured (benchmarks/cpu_attention_bench.py, 2 threads): the kernel 1.3-2.5x faster, from 8
# sequences of 32 tokens to one chunk of 512, and for 256 tokens after 1024 cached.
PREFILL_IN_KERNEL = True


def extension() -> ModuleType | None:
    """The compiled kernel, or None where it cannot be built (cpu_build.build_error says why)."""
    return load_extension(STEM)


def kernel_tiles(meta: AttentionMetadata, group: int, prefill: bool = True) -> torch.Tensor:  # [W, 4] int32
    """The step's tiles (cached): decode tokens, and prefill chunks when prefill is True, in
    tiles of PREFILL_ROWS // group tokens (group: query heads per kv head)."""
    tile = max(1, PREFILL_ROWS // group) if prefill else 0
    key = ("cpu_attention_tiles", tile)
    tiles = meta.plan_cache.get(key)
    if tiles is None:
        tiles = meta.plan_cache[key] = _build_tiles(meta, tile)
    return tiles


def _build_tiles(meta: AttentionMetadata, tile: int) -> torch.Tensor:
    starts, lens = meta.query_start_host, meta.seq_lens_host
    rows: list[tuple[int, int, int, int]] = []
    if tile:
        for s in meta.prefill_seqs:
            qlen = meta.query_lens_host[s]
            ctx = lens[s] - qlen
            for j in range(0, qlen, tile):
                rows.append((s, starts[s] + j, min(tile, qlen - j), ctx + j + 1))
    rows.extend((s, starts[s], 1, lens[s]) for s in meta.decode_seqs)
    # Threads take tiles in this order from a shared counter: the costliest (most keys times
    # tokens) first, so that none is left to run alone at the end.
    rows.sort(key=lambda r: -(r[2] * (r[3] + r[2])))
    return torch.tensor(rows, dtype=torch.int32).view(-1, 4)


def _usable(q: torch.Tensor, kv_pool: torch.Tensor) -> ModuleType | None:
    if not q.is_cpu or q.dtype != torch.float32 or kv_pool.dtype != torch.float32:  # is_cpu: cpu_sgmv._kernel_takes
        return None
    if not kv_pool.is_contiguous():
        return None
    return extension()


def write_kv(
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
) -> None:
    """Store this step's new K/V of every token in its block's page for this layer (torch_attention.write_kv's
    contract): one C++ call for K and V, the torch path where the kernel does not apply."""
    ext = _usable(k, kv_pool)
    if (ext is None or v.dtype != torch.float32 or k.stride(2) != 1 or k.stride(1) != k.shape[2]
            or v.stride(2) != 1 or v.stride(1) != v.shape[2]):
        torch_attention.write_kv(kv_pool, k, v, meta, layer)
        return
    slots = meta.plan_cache.get("cpu_write_kv")
    if slots is None:  # once per step: every layer writes to the same rows of its own pages
        slots = meta.plan_cache["cpu_write_kv"] = (meta.slot_pages.to(torch.int64).contiguous().unbind(0),
                                                   meta.slot_offsets.to(torch.int64).contiguous())
    ext.write_kv(kv_pool, k, v, slots[0][layer], slots[1])


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    ext = _usable(q, kv_pool)
    if ext is None:
        return torch_attention.paged_attention(q, kv_pool, meta, layer, scale)
    tables = meta.block_tables[layer]  # [S, max_blocks]
    if tables.dtype != torch.int32 or not tables.is_contiguous():
        tables = tables.to(torch.int32).contiguous()
    # The kernel reads q through its strides (the model's q is a slice of the fused qkv): only a
    # non-contiguous last dim needs a copy. out is contiguous: the model views it as [T, H * hd].
    qk = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    tiles = kernel_tiles(meta, q.shape[1] // kv_pool.shape[3], PREFILL_IN_KERNEL)
    ext.paged_attention(out, qk, kv_pool, tables, tiles, scale)
    if not PREFILL_IN_KERNEL:
        torch_attention.prefill_attention(out, q, kv_pool, meta, layer, scale)
    return out
