"""Adapters for the simulation: real LoraAdapter objects of the trace's ranks (so pool pressure and eviction
are real), built as cheaply as possible, and an AdapterTable that counts the bytes it places in the pool.

The weights are zeros: nothing reads them, only their size matters. One packed template per rank is built
and every adapter of that rank shares its tensors (dataclasses.replace keeps the packed rows because the
modules are the same objects), so a thousand adapters cost a few templates of host memory, and placing one
is the same single page-granular copy as for a real adapter from the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from loraplex.engine.adapters import AdapterKey, AdapterTable
from loraplex.lora.types import LoraAdapter, LoraModuleWeights
from loraplex.models.config import ModelConfig
from loraplex.unified_pager import AdapterResidency, RowLayout, UnifiedPager, pack_adapter

# PEFT's default targets: the cheapest adapters that still put rank-proportional pages in the pool.
DEFAULT_SIM_MODULES: tuple[str, ...] = ("q_proj", "v_proj")


class SimAdapterFactory:
    def __init__(self, cfg: ModelConfig, layout: RowLayout, modules: Sequence[str] = DEFAULT_SIM_MODULES):
        self.cfg = cfg
        self.layout = layout
        self.modules = tuple(modules)
        self._templates: dict[int, LoraAdapter] = {}

    def make(self, name: str, rank: int) -> LoraAdapter:
        template = self._templates.get(rank)
        if template is None:
            mods = []
            for layer in range(self.cfg.num_layers):
                for m in self.modules:
                    in_f, out_f = self.cfg.module_shape(m)
                    mods.append(LoraModuleWeights(layer, m, rank, 1.0, torch.zeros(rank, in_f), torch.zeros(out_f, rank)))
            template = pack_adapter(LoraAdapter(f"rank-{rank}", tuple(mods), rank), self.layout)
            self._templates[rank] = template
        return dataclasses.replace(template, name=name)


class MeteredAdapterTable(AdapterTable):
    """An AdapterTable that adds up the bytes copied into the pool. The real engine places adapters inside
    schedule(), on the step's critical path; the simulation charges that copy to the step's virtual time."""

    def __init__(self, pager: UnifiedPager):
        super().__init__(pager)
        self.pager = pager
        self.loaded_bytes = 0
        self.loads = 0

    def ensure_resident(self, key: AdapterKey) -> AdapterResidency | None:
        was_resident = self.pager.is_resident(key)
        res = super().ensure_resident(key)
        if res is not None and not was_resident:
            g = self.pager.geometry
            self.loaded_bytes += g.adapter_num_rows(self.host(key)) * g.row_width * g.dtype.itemsize
            self.loads += 1
        return res
