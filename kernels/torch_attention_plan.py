"""Per-step index plans for the torch attention path, built once per step and reused by every layer.

A step's block tables, lengths and slots are the same in all layers except for the page ids, so
everything the layers need (pool rows to gather, rows to write, the length mask, the stale slots
to clear) is derived here in one go, for all layers at once, instead of ~15 small ops per layer.

Row spaces used below, all views of the same contiguous pool (no copy):
- block rows: the pool as [num_pages * 2, block_size * kv_heads * head_dim]; row 2p is page p's
  K block, row 2p + 1 its V block.
- token rows: the pool as [num_pages * 2 * block_size, kv_heads * head_dim]; one row per token
  slot, (2p + c) * block_size + offset for c = 0 (K) or 1 (V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metadata import AttentionMetadata


@dataclass(frozen=True)
class DecodePlan:
    """How the decode sequences of a step (one new token each) gather their K/V."""

    tok: torch.Tensor | None  # [B] int64 token index of each decode sequence; None when it is 0..B-1 = all tokens
    rows: torch.Tensor  # [L, 2*B*nb] int64 block rows: all K blocks of the batch, then all V blocks
    stale: torch.Tensor | None  # [Z] int64 rows of the gathered [2*B*N, kvh*hd] past each length; None if none
    mask: torch.Tensor  # [B, 1, 1, N] in q's dtype: 0 where a slot holds one of the sequence's tokens, -inf past it
    num_seqs: int  # B
    num_slots: int  # N = nb * block_size, slots gathered per sequence


def decode_plan(meta: AttentionMetadata, device: torch.device, dtype: torch.dtype) -> DecodePlan | None:
    """The step's decode plan (cached in meta.plan_cache), or None when no sequence decodes."""
    key = ("torch_decode", dtype)
    plan = meta.plan_cache.get(key, False)
    if plan is False:
        plan = meta.plan_cache[key] = _build_decode_plan(meta, device, dtype)
    return plan


def _build_decode_plan(meta: AttentionMetadata, device: torch.device, dtype: torch.dtype) -> DecodePlan | None:
    idx = list(meta.decode_seqs)
    if not idx:
        return None
    bs = meta.block_size
    b = len(idx)
    lens_host = [meta.seq_lens_host[i] for i in idx]
    nb = (max(lens_host) + bs - 1) // bs
    n = nb * bs
    all_tokens = b == meta.num_tokens  # every token of the step decodes: sequence i is token i
    starts = meta.query_start_host
    tok = None if all_tokens else torch.tensor([starts[i] for i in idx], dtype=torch.long, device=device)
    sel = slice(None) if b == meta.num_seqs else torch.tensor(idx, dtype=torch.long, device=device)
    pages = meta.block_tables[:, sel, :nb].to(device=device, dtype=torch.long)  # [L, B, nb]
    rows = torch.stack((pages * 2, pages * 2 + 1), dim=1).reshape(pages.shape[0], 2 * b * nb)
    lens = torch.tensor(lens_host, dtype=torch.long, device=device)
    valid = torch.arange(n, device=device)[None, :] < lens[:, None]  # [B, N]
    # Slots past a sequence's length hold whatever the page's last owner left (and the padding
    # entries of a short block table point at some page). A masked score still multiplies its V row, and SDPA adds the mask to the score,
    # so a stale non-finite K or V would turn the output into NaN: those rows are zeroed after the
    # gather. They are few (under one block per sequence plus padding blocks).
    stale_tok = (~valid).view(-1).nonzero().view(-1)  # [Z/2] in [B*N]
    stale = torch.cat((stale_tok, stale_tok + b * n)) if stale_tok.numel() else None
    # An additive mask in q's dtype: SDPA would otherwise convert a bool mask in every layer.
    mask = torch.zeros(b, 1, 1, n, dtype=dtype, device=device).masked_fill_(~valid[:, None, None, :], float("-inf"))
    return DecodePlan(tok=tok, rows=rows, stale=stale, mask=mask, num_seqs=b, num_slots=n)


def write_rows(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:  # [L, 2, T] int64
    """Token rows that receive each new token's K (index 0) and V (index 1), per layer (cached)."""
    rows = meta.plan_cache.get("torch_write")
    if rows is None:
        bs = meta.block_size
        k_rows = meta.slot_pages.to(device=device, dtype=torch.long) * (2 * bs) + meta.slot_offsets.to(device)
        rows = meta.plan_cache["torch_write"] = torch.stack((k_rows, k_rows + bs), dim=1)
    return rows
