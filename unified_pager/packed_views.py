"""A plan-packed adapter's modules: views of its packed rows, made when first read.

Why lazily: placing an adapter in the pool copies its packed rows as they are (adapter_pages.py) and the
kernels read the pool, so a server that loads an adapter on a cache miss and serves it from the pool never
reads its per-module tensors. Made at once they were a third of a planned load: 420 as_strided views and 210
LoraModuleWeights for the default model. The e2e trace's folders loaded by their plans, each load beside the same
load with its views made at once, alternating (a /tmp script, 120 pairs a rank; AMD EPYC Zen 4, RESULTS.md,
forty-fourth session): rank 8 1.29 against 2.04 ms, rank 16 2.22 against 3.00 (paired -0.77 and -0.78 ms, faster in
118 and 115 of 120). The torch path, the PEFT reference and the tests read them as before: the first read makes
them all, once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import overload

import torch

from loraplex.lora.types import TARGET_MODULES, LoraModuleWeights

from .adapter_rows import ModuleSlot


def slot_module(rows: torch.Tensor, s: ModuleSlot) -> LoraModuleWeights:
    """Slot s's module over the packed rows [R, D]: a [rank, in] a view of its A^T rows, b [out, rank] (PEFT's
    lora_B) a view of its B^T rows. The constructor, not dataclasses.replace: a third of the cost for 210 modules."""
    d = rows.shape[1]
    return LoraModuleWeights(s.layer, TARGET_MODULES[s.module], s.rank, s.scale,
                             rows.as_strided((s.rank, s.in_features), (1, s.rank), s.a_row * d),
                             rows.as_strided((s.out_features, s.rank), (1, s.out_features), s.b_row * d))


class PackedModuleViews(Sequence[LoraModuleWeights]):
    """slots' modules (packing order) over rows [R, D]: module i's a [rank, in] is a view of its A^T rows and b
    [out, rank] of its B^T rows (slot_module, as pack_adapter makes them). Compares and hashes as the tuple of its modules."""

    __slots__ = ("_rows", "_slots", "_modules", "_lock")

    def __init__(self, rows: torch.Tensor, slots: tuple[ModuleSlot, ...]):
        self._rows = rows  # [R, D]
        self._slots = slots
        self._modules: tuple[LoraModuleWeights, ...] | None = None
        self._lock = threading.Lock()  # one set of views, whichever thread reads first

    def _all(self) -> tuple[LoraModuleWeights, ...]:
        made = self._modules
        if made is not None:
            return made
        with self._lock:
            if self._modules is None:
                self._modules = tuple(slot_module(self._rows, s) for s in self._slots)
            return self._modules

    @property
    def made(self) -> bool:
        """Whether the views exist yet (for tests and benchmarks)."""
        return self._modules is not None

    def __len__(self) -> int:
        return len(self._slots)

    @overload
    def __getitem__(self, i: int) -> LoraModuleWeights: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[LoraModuleWeights, ...]: ...
    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self) -> Iterator[LoraModuleWeights]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedModuleViews):
            return other is self or self._all() == other._all()
        if isinstance(other, tuple):
            return self._all() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __reduce__(self):
        # Pickled and copied as the tuple of its modules (the lock does not travel).
        return (tuple, (self._all(),))

    def __repr__(self) -> str:
        return f"PackedModuleViews({len(self._slots)} modules, {'made' if self.made else 'not made yet'})"
