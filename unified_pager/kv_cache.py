"""Per-sequence KV block tables: which page holds block b of layer l of each sequence.

A block of block_size tokens takes one page per layer. Each sequence keeps a host array
[num_layers, capacity] int32 that grows by doubling, so appending a block is O(num_layers)
amortised and a decode step that stays inside its last block costs a dict lookup.

A sequence may hold blocks past the tokens asked for so far (UnifiedPager.allocate_kv's reserve):
`used` counts the blocks that hold asked-for tokens, `num_blocks` all it holds; the blocks between
are reserved, and trim() gives them back when the pool runs short.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import numpy as np
import torch


class SeqBlocks:
    """One sequence's page table; owner is the id its pages carry in PagePool.owner."""

    __slots__ = ("owner", "table", "num_blocks", "used")

    def __init__(self, owner: int, num_layers: int) -> None:
        self.owner = owner
        self.table = np.zeros((num_layers, 4), dtype=np.int32)  # [L, capacity] int32
        self.num_blocks = 0
        self.used = 0  # blocks [0, used) hold tokens asked for; [used, num_blocks) are reserved

    def append(self, pages: np.ndarray) -> None:
        """Add blocks; pages: [L, n] int64, column j is the new block j's page per layer."""
        n = pages.shape[1]
        need = self.num_blocks + n
        if need > self.table.shape[1]:
            grown = np.zeros((self.table.shape[0], max(need, 2 * self.table.shape[1])), dtype=np.int32)
            grown[:, : self.num_blocks] = self.table[:, : self.num_blocks]
            self.table = grown
        self.table[:, self.num_blocks : need] = pages
        self.num_blocks = need

    def pages(self) -> np.ndarray:
        """[L * num_blocks] int64, every page the sequence holds."""
        return self.table[:, : self.num_blocks].astype(np.int64).ravel()


class KvBlockTables:
    """The block tables of every sequence that holds KV."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._seqs: dict[Hashable, SeqBlocks] = {}
        self._next_owner = 0
        self.num_pages = 0  # pages held by all sequences together
        self.reserved_pages = 0  # of them, pages of reserved blocks (past each sequence's used ones)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def get(self, seq_id: Hashable) -> SeqBlocks | None:
        return self._seqs.get(seq_id)

    def items(self) -> Iterator[tuple[Hashable, SeqBlocks]]:
        return iter(self._seqs.items())

    def next_owner(self) -> int:
        """The owner id the next new sequence will get (ids are never reused)."""
        return self._next_owner

    def add(self, seq_id: Hashable) -> SeqBlocks:
        seq = SeqBlocks(self._next_owner, self.num_layers)
        self._next_owner += 1
        self._seqs[seq_id] = seq
        return seq

    def grow(self, seq: SeqBlocks, pages: np.ndarray) -> None:
        """pages: [n_blocks * L] int64 as taken from the pool, laid out layer-major: the new blocks of
        layer 0 first, then layer 1's, ... so that a fresh pool's ascending runs give each layer of a
        prefill chunk its blocks in adjacent pages, and a decode step's attention, which reads one layer's
        blocks of a sequence in turn, reads one run of memory instead of one page every num_layers pages.
        The decode attention of 64 sequences (benchmarks/cpu_attention_bench.py's shapes, the same kernel
        alternating over the two layouts in one process; RESULTS.md, forty-fifth session, Intel Xeon):
        128 cached tokens 0.681 -> 0.598 ms a layer call, 512 tokens 2.652 -> 2.020."""
        seq.append(pages.reshape(self.num_layers, -1))
        self.num_pages += len(pages)
        self.reserved_pages += len(pages)  # until use() counts them

    def use(self, seq: SeqBlocks, blocks: int) -> None:
        """Blocks [0, blocks) of seq now hold asked-for tokens (used never shrinks; blocks <= num_blocks)."""
        if blocks > seq.used:
            self.reserved_pages -= (blocks - seq.used) * self.num_layers
            seq.used = blocks

    def trim(self, seq: SeqBlocks) -> np.ndarray:
        """Drop seq's reserved blocks; returns their pages ([n] int64, layer-major) for the pool to take back."""
        pages = seq.table[:, seq.used : seq.num_blocks].astype(np.int64).ravel()
        seq.num_blocks = seq.used
        self.num_pages -= len(pages)
        self.reserved_pages -= len(pages)
        return pages

    def remove(self, seq_id: Hashable) -> np.ndarray | None:
        """Forget the sequence; returns its pages ([n] int64) for the pool to take back."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        pages = seq.pages()
        self.num_pages -= len(pages)
        self.reserved_pages -= (seq.num_blocks - seq.used) * self.num_layers
        return pages

    def block_tables(self, seq_ids: list, device: torch.device) -> torch.Tensor:
        """[L, S, max_blocks] int32, padded with 0. KeyError for a sequence that holds no KV:
        a padded row would point attention at page 0, which someone else owns."""
        seqs = [self._seqs[s] for s in seq_ids]
        max_blocks = max((s.num_blocks for s in seqs), default=0)
        out = np.zeros((self.num_layers, len(seq_ids), max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            if s.num_blocks:
                out[:, i, : s.num_blocks] = s.table[:, : s.num_blocks]
        return torch.from_numpy(out).to(device)
