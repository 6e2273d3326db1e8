"""The seam between adapter loading (PEFT folders, the adapter store) and the pager/kernels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the pager builds and reads packed rows; this module only carries them
    from loraplex.unified_pager.packed_rows import PackedRows

# The projections an adapter may target, in the fixed order used by page layouts and kernels.
TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_INDEX: dict[str, int] = {name: i for i, name in enumerate(TARGET_MODULES)}


@dataclass(frozen=True)
class LoraModuleWeights:
    """One LoRA pair on one projection of one layer: delta(x) = scale * (x @ a.T) @ b.T."""

    layer: int
    module: str  # one of TARGET_MODULES
    rank: int
    scale: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with rslora
    a: torch.Tensor  # [rank, in_features]   (PEFT's lora_A.weight)
    b: torch.Tensor  # [out_features, rank]  (PEFT's lora_B.weight)


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter, held on the host, ready to be placed in the page pool."""

    name: str
    # sorted by (layer, MODULE_INDEX[module]); a tuple, or for an adapter packed by a plan the views of its packed
    # rows, made when first read (unified_pager.packed_views)
    modules: Sequence[LoraModuleWeights]
    max_rank: int
    source: str = ""  # where it was read from, for messages
    config: dict = field(default_factory=dict, compare=False, repr=False)  # the raw adapter_config.json
    # The weights already in the page pool's row layout, with every module's a/b a view into them,
    # so that placing the adapter is one page-granular copy. Built by unified_pager.pack_adapter
    # (the adapter store does it when it decodes); None for adapters read straight from a folder.
    packed: PackedRows | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Packed rows are valid only as the storage of these exact modules: a copy made with other
        # modules (dataclasses.replace) must not carry rows that no longer hold its weights.
        if self.packed is not None and self.packed.modules is not self.modules:
            object.__setattr__(self, "packed", None)

    @property
    def nbytes(self) -> int:
        """Host bytes the weights hold (packed modules are views of the packed rows: counted once)."""
        if self.packed is not None:
            return self.packed.nbytes
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules)

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {m.module for m in self.modules}
        return tuple(name for name in TARGET_MODULES if name in present)
