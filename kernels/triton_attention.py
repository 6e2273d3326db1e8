"""Paged attention on the Triton path: write_kv and paged_attention with torch_attention's signatures.

Per step the host cuts the batch into tiles once (cached on the AttentionMetadata and reused by
every layer): each decode sequence is one tile of one token; each prefill chunk is cut into tiles
of BLOCK_M // GROUP tokens (GROUP query heads per K/V head share a tile's rows). Decode tiles and
prefill tiles are separate launches, so decode programs use small row blocks and may split their
keys across programs, while prefill programs use large row blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .metadata import AttentionMetadata
from .triton_attention_kernels import (
    LOG2E,
    attention_combine_kernel,
    paged_attention_kernel,
    write_kv_kernel,
)
from .triton_launch import dot_precision, parallel_slots

PREFILL_BLOCK_M = 64  # rows (token x query head) per prefill program
# Keys per inner step and warps per program. Decode: 64 keys at 4 warps measured fastest on an H200
# (benchmarks/kernels_gpu.py sweep, Llama-3-8B heads, 2k context, CUDA-graph replays, 2026-12-04): 18.8 us
# against 22.7 for 32 keys at batch 1, 143 against 165 us at batch 64 (8 and 16 warps slower), although
# ahead-of-time compiles for sm_90 showed 64 keys spilling registers where 32 fit. Prefill 64 rows: ~180
# registers at 8 warps without spills; not yet swept on a GPU.
DECODE_BLOCK_N = 64
DECODE_WARPS = 4
PREFILL_BLOCK_N = 32
PREFILL_WARPS = 8
MIN_KEYS_PER_SPLIT = 256  # a split-KV program below this many keys costs more than it saves


@dataclass(frozen=True)
class AttentionTiles:
    """Tiles of one launch: tile i is tokens start[i] .. start[i] + length[i] of sequence seq[i]."""

    tiles: torch.Tensor  # [3, NT] int32 on the device: seq, start, length
    num_tiles: int
    block_m: int  # rows per program; tokens per tile <= block_m // group
    max_seq_len: int  # longest sequence among the tiles (sizes the split-KV choice)

    @property
    def seq(self) -> torch.Tensor:
        return self.tiles[0]

    @property
    def start(self) -> torch.Tensor:
        return self.tiles[1]

    @property
    def length(self) -> torch.Tensor:
        return self.tiles[2]


def _block_m_for(tokens_per_tile: int, group: int) -> int:
    return max(16, triton.next_power_of_2(tokens_per_tile * group))


def build_tiles(
    meta: AttentionMetadata, group: int, prefill_block_m: int, device: torch.device
) -> tuple[AttentionTiles | None, AttentionTiles | None]:
    """(decode tiles, prefill tiles) of the batch; None where there are none."""
    starts = meta.query_start_host
    dec = [(s, starts[s], 1) for s in meta.decode_seqs]
    pre: list[tuple[int, int, int]] = []
    block_m = max(prefill_block_m, _block_m_for(1, group))
    per_tile = max(1, block_m // group)
    for s in meta.prefill_seqs:
        q = meta.query_lens_host[s]
        for t in range(starts[s], starts[s] + q, per_tile):
            pre.append((s, t, min(per_tile, starts[s] + q - t)))

    def table(rows: list[tuple[int, int, int]], bm: int) -> AttentionTiles | None:
        if not rows:
            return None
        t = torch.tensor(rows, dtype=torch.int32).t().contiguous().to(device)
        return AttentionTiles(t, len(rows), bm, max(meta.seq_lens_host[r[0]] for r in rows))

    return table(dec, _block_m_for(1, group)), table(pre, block_m)


def _tiles(meta: AttentionMetadata, group: int, prefill_block_m: int, device: torch.device):
    key = ("triton_attn_tiles", group, prefill_block_m)
    cached = meta.plan_cache.get(key)
    if cached is None:
        cached = meta.plan_cache[key] = build_tiles(meta, group, prefill_block_m, device)
    return cached


def choose_num_splits(device: torch.device, programs: int, max_seq_len: int) -> int:
    """Split the keys of decode programs until the launch about fills the device."""
    slots = parallel_slots(device)
    splits = 1
    while programs * splits < slots and max_seq_len // (splits * 2) >= MIN_KEYS_PER_SPLIT:
        splits *= 2
    return splits


def write_kv(
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
) -> None:
    """Store this step's new K/V of every token in its block's page for this layer."""
    T, kvh, hd = k.shape
    if T == 0:
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    key = ("triton_write_kv", T, kvh, hd, kv_pool.data_ptr())
    plan = meta.plan_cache.get(key)
    if plan is None:  # the same at every layer of the step (see _AttentionPlan)
        assert kv_pool.stride(4) == 1
        plan = meta.plan_cache[key] = (
            write_kv_kernel.on(k.device)[(T,)],
            (kv_pool, kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3)),
            dict(BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(hd)))
    kernel, pool_args, consts = plan
    kernel(k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *pool_args,
           meta.slot_pages[layer], meta.slot_offsets, kvh, hd, **consts)


class _AttentionPlan:
    """One tile table's launches for a step, built at its first layer and reused by the others: on a GPU the
    wrappers' host time is what a decode step waits for (write_kv + paged_attention with 4 splits: 23.8 us
    per layer before, launches not counted), and only the layer's block tables and the activations change
    from layer to layer. The split-KV partials are one set of buffers for the step, in stream order."""

    def __init__(self, q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata, tiles: AttentionTiles,
                 group: int, num_splits: int, block_n: int, num_warps: int):
        kvh, hd = kv_pool.shape[3], kv_pool.shape[4]
        block_d = max(16, triton.next_power_of_2(hd))  # tl.dot needs K >= 16 on a GPU
        dev = q.device
        if num_splits > 1:
            part_m = torch.empty(tiles.num_tiles, kvh, num_splits, tiles.block_m, dtype=torch.float32, device=dev)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty(*part_m.shape, block_d, dtype=torch.float32, device=dev)
            self.parts: tuple | None = (part_m, part_l, part_acc)
        else:
            self.parts = None  # the kernel takes out in their place and never touches them
        self.attention = paged_attention_kernel.on(dev)[(tiles.num_tiles, kvh, num_splits)]
        self.pool_args = (kv_pool, kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3))
        self.tile_args = (meta.query_start, meta.seq_lens, tiles.seq, tiles.start, tiles.length)
        self.hd = hd
        self.consts = dict(GROUP=group, BLOCK_SIZE=meta.block_size, BLOCK_M=tiles.block_m, BLOCK_N=block_n,
                           BLOCK_D=block_d, NUM_SPLITS=num_splits, DOT_PREC=dot_precision(q.dtype),
                           num_warps=num_warps)
        if num_splits > 1:
            self.combine = attention_combine_kernel.on(dev)[(tiles.num_tiles, kvh)]
            self.combine_consts = dict(GROUP=group, BLOCK_M=tiles.block_m, BLOCK_D=block_d, NUM_SPLITS=num_splits)
            self.combine_tiles = (tiles.start, tiles.length)

    def launch(self, q: torch.Tensor, out: torch.Tensor, tables: torch.Tensor, scale: float) -> None:
        parts = self.parts if self.parts is not None else (out, out, out)
        query_start, seq_lens, seq, start, length = self.tile_args
        self.attention(
            q, q.stride(0), q.stride(1), *self.pool_args, out, out.stride(0), out.stride(1), *parts,
            tables, tables.stride(0), query_start, seq_lens, seq, start, length, scale * LOG2E, self.hd,
            **self.consts,
        )
        if self.parts is not None:
            self.combine(out, out.stride(0), out.stride(1), *self.parts, *self.combine_tiles, self.hd,
                         **self.combine_consts)


def _launch(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
    tiles: AttentionTiles,
    group: int,
    num_splits: int,
    block_n: int,
    num_warps: int,
) -> None:
    key = ("triton_attn_plan", id(tiles), tuple(q.shape), q.dtype, kv_pool.data_ptr(), num_splits, block_n,
           num_warps)
    plan = meta.plan_cache.get(key)
    if plan is None:
        plan = meta.plan_cache[key] = _AttentionPlan(q, kv_pool, meta, tiles, group, num_splits, block_n, num_warps)
    plan.launch(q, out, meta.block_tables[layer], scale)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]; every element written
    decode_splits: int | None = None,  # split-KV factor for decode tiles (None: by occupancy)
    prefill_block_m: int = PREFILL_BLOCK_M,
    decode_block_n: int = DECODE_BLOCK_N,
    decode_warps: int = DECODE_WARPS,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    kvh = kv_pool.shape[3]
    group = q.shape[1] // kvh
    q = q if q.stride(2) == 1 else q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert kv_pool.stride(4) == 1 and out.stride(2) == 1
    decode, prefill = _tiles(meta, group, prefill_block_m, q.device)
    if decode is not None:
        splits = decode_splits or choose_num_splits(q.device, decode.num_tiles * kvh, decode.max_seq_len)
        _launch(q, kv_pool, out, meta, layer, scale, decode, group, splits, decode_block_n, decode_warps)
    if prefill is not None:
        _launch(q, kv_pool, out, meta, layer, scale, prefill, group, 1, PREFILL_BLOCK_N, PREFILL_WARPS)
    return out
