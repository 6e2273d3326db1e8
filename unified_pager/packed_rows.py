"""Adapters packed into pool rows ahead of placement, so that placing one is a single page copy.

Placing an unpacked adapter writes every A and every B^T into rows one matrix at a time (the B
transposes dominate): ~9 ms for a rank-16 SmolLM2 adapter on the dev CPU, on the engine thread.
pack_adapter does that work once, where the adapter is decoded (the adapter store's loader, on a
prefetch thread), into one [num_rows, D] buffer in the pool's logical row order; the adapter's
a/b tensors become views of that buffer, so the host holds the weights once. UnifiedPager then
copies whole pages from the buffer (adapter_pages.write_pages) and reuses the row assignment
made here instead of re-checking every module.

The rows depend only on the RowLayout (D, dtype; layers and shapes for the checks), never on the
page size or the pages: an adapter packed for a layout fits every pool with that layout. A pool
with another layout ignores the packed rows and packs the modules itself, as for any adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loraplex.errors import AdapterError
from loraplex.lora.peft_config import llama_module_name
from loraplex.lora.peft_loader import read_peft_folder
from loraplex.lora.types import MODULE_INDEX, LoraAdapter, LoraModuleWeights
from loraplex.models.config import ModelConfig

from .adapter_rows import RowAssignment, assign_rows, write_rows
from .geometry import RowLayout
from .pack_plan import PackPlans, folder_key, header_matrices, learn_plan, load_planned_folder
from .packed_views import slot_module


@dataclass(frozen=True, eq=False)  # eq=False: identity semantics; tensors have no boolean ==
class PackedRows:
    """An adapter's weights in pool row layout. Built by pack_adapter only: `modules` must be the
    adapter's own modules tuple, whose a/b tensors are views of `rows` (LoraAdapter drops packed
    rows whose modules are not its own, so a copy with other weights never carries stale rows)."""

    layout: RowLayout
    rows: torch.Tensor  # [num_rows, D] host, layout.dtype: A then B^T of each module, packing order
    modules: Sequence[LoraModuleWeights]  # the adapter's modules (its order); a/b are views of rows
    assignment: RowAssignment  # checked against layout; its modules are these, in packing order

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


def pack_adapter(adapter: LoraAdapter, layout: RowLayout, pin_memory: bool = False,
                 check_finite: bool = False) -> LoraAdapter:
    """The adapter with its weights packed for `layout` (cast to layout.dtype), its modules' a/b
    views of the packed rows. AdapterError if a module does not fit the layout, or (check_finite)
    if a packed matrix holds a NaN or an Inf: the packing copy is checked while in cache, which
    costs far less than a separate pass over the adapter. Returns the adapter itself if it is
    already packed for this layout (and pinned, when pin_memory asks for it): its rows were checked
    when they were packed, if ever."""
    old = adapter.packed
    if old is not None and old.layout == layout and (old.rows.is_pinned() or not pin_memory):
        return adapter
    d = layout.row_width
    asg = assign_rows(layout, adapter.name, adapter.modules)
    # Page-locked when asked: a CUDA pool then copies it without a staging copy, asynchronously.
    rows = torch.empty(asg.num_rows, d, dtype=layout.dtype, pin_memory=pin_memory)  # [num_rows, D]
    bad = write_rows(asg.modules, d, rows, check_finite)
    if bad is not None:
        m = asg.modules[bad // 2]
        raise AdapterError(f"adapter {adapter.name!r}: {llama_module_name(m.layer, m.module)} "
                           f"{('lora_A', 'lora_B')[bad % 2]} contains NaN or Inf values")
    views = {key: slot_module(rows, s) for key, s in asg.slots.items()}
    modules = tuple(views[(m.layer, MODULE_INDEX[m.module])] for m in adapter.modules)
    ordered = tuple(views[(m.layer, MODULE_INDEX[m.module])] for m in asg.modules)
    packed = PackedRows(layout, rows, modules, asg._replace(modules=ordered))
    return replace(adapter, modules=modules, packed=packed)


def load_packed_folder(name: str, folder: str | Path, model: ModelConfig, max_lora_rank: int, layout: RowLayout,
                       pin_memory: bool = False, plans: PackPlans | None = None) -> LoraAdapter:
    """A PEFT adapter folder read, validated and packed for `layout`, with every check of
    load_peft_adapter; the NaN/Inf check of the weights rides on the packing copy instead of a
    scan of its own (6 of 38 ms of a rank-16 default-model load on the AMD dev CPU, measured by
    benchmarks/adapter_folder_load.py). With `plans` (made for this model, rank limit and layout), a
    folder whose config and weights header are those of one loaded before is packed by that load's
    plan (pack_plan.py), and a folder loaded in full teaches its plan."""
    if plans is not None:
        plans.check(model, max_lora_rank, layout)
        planned = load_planned_folder(plans, name, folder, pin_memory)
        if planned is not None:
            return planned
    read = read_peft_folder(name, folder, model, max_lora_rank, layout.dtype, check_finite=False)
    adapter = pack_adapter(read.adapter, layout, pin_memory=pin_memory, check_finite=True)
    if plans is not None:
        matrices = header_matrices(read.weights.header)
        if matrices is not None:
            plans.learn(folder_key(read.config_bytes, read.weights.header_bytes),
                        learn_plan(adapter, matrices, read.weights.data.numel()))
    return adapter
