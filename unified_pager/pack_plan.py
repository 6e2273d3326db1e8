"""Packing many adapters of one shape: a plan learnt from the first file, reused for every file whose
header is byte for byte the same.

Why: every adapter of one base model with the same ranks and target modules has the same safetensors
header (keys, shapes, dtypes, offsets), and a folder load spent ~12 of its ~18 ms (rank 16, default
model, the tenth session's AMD EPYC) in Python over its ~420 tensors: parsing the header and the keys,
a view per tensor, the shape checks per module, the row assignment, the views of the packed rows. A
plan keeps what those steps concluded for bytes that passed every check, keyed by exactly those bytes
(a folder's adapter_config.json and weights header; a stored blob's header, which holds its config).
A later file with the same bytes passes the same checks with the same result, so it is packed by one
C++ call (kernels/cpu_pack.cpp): a stored blob, already fetched whole, straight from its buffer
(transpose_from_buffer); a folder's file read by the packing threads, each matrix into a buffer that
stays in cache until transposed (transpose_from_file). Only the values differ between such files, and
every one of them is still checked for NaN and Inf, on the packing copy, as load_packed_folder does.
The packed adapter's module views are made when first read (packed_views.py): placing it in the pool
reads none of them.

A plan holds for one base model, rank limit and row layout (the checks' other inputs): PackPlans is
made for one and refuses to serve another. Files whose tensors need a cast (another dtype than the
layout's) or sit at unaligned offsets get no plan and always take the full path.
"""

from __future__ import annotations

import copy
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.errors import AdapterError, ConfigError
from loraplex.lora.peft_config import llama_module_name
from loraplex.lora.peft_loader import CONFIG_FILE, WEIGHTS_FILE, parse_weights_key
from loraplex.lora.safetensors_views import DTYPES, read_exact
from loraplex.lora.types import TARGET_MODULES, LoraAdapter
from loraplex.models.config import ModelConfig

from .adapter_rows import _EXPONENT_MASK, ModuleSlot, RowAssignment
from .geometry import RowLayout
from .packed_views import PackedModuleViews

# (layer, module name, "lora_A" | "lora_B") -> (dtype, first byte in the data section, shape)
Matrices = Mapping[tuple[int, str, str], tuple[torch.dtype, int, tuple[int, ...]]]


@dataclass(frozen=True, eq=False)  # eq=False: holds tensors
class PackPlan:
    """What the checks and the row assignment concluded for one header, as the tables of one C++ copy."""

    layout: RowLayout
    data_bytes: int  # length of the data section the header describes
    byte_offsets: torch.Tensor  # [2M] int64: first byte of A_0, B_0, A_1, B_1, ... (packing order) in the data
    shapes: torch.Tensor  # [2M, 2] int64: A [rank, in], B [out, rank]
    row_offsets: torch.Tensor  # [2M] int64: first element of A_k^T and B_k^T in the flat packed rows
    slots: tuple[ModuleSlot, ...]  # packing order, which is also the adapter's (layer, module) order
    assignment: RowAssignment  # modules=() here: each packed adapter gets its own
    max_rank: int
    config: dict  # the adapter_config the checks ran on (each adapter gets a copy)

    def pack(self, name: str, data, base: int, source: str, pin_memory: bool = False) -> LoraAdapter | None:
        """The adapter whose data section starts at byte `base` of the buffer `data` (bytes, bytearray or a
        uint8 array; the caller checked its length against data_bytes), packed; AdapterError naming the
        first matrix holding a NaN or an Inf; None where the buffer's alignment rules out the direct copy."""
        return self._pack(name, source, pin_memory, lambda ext, rows: ext.transpose_from_buffer(
            data, base, self.byte_offsets, self.shapes, rows.view(-1), self.row_offsets,
            _EXPONENT_MASK[self.layout.dtype]))

    def pack_file(self, name: str, fd: int, base: int, source: str, pin_memory: bool = False) -> LoraAdapter | None:
        """pack, with the data section read from the open file `fd` from byte `base` on (the caller checked its
        length against data_bytes) by the threads that transpose it (cpu_pack.cpp, transpose_from_file);
        None where a read came short (the file changed while read) or the packer is not built."""
        return self._pack(name, source, pin_memory, lambda ext, rows: ext.transpose_from_file(
            fd, base, self.byte_offsets, self.shapes, rows.view(-1), self.row_offsets,
            _EXPONENT_MASK[self.layout.dtype]))

    def _pack(self, name: str, source: str, pin_memory: bool, copy_rows) -> LoraAdapter | None:
        """copy_rows(ext, rows) fills rows [R, D] and returns the packer's answer: -1 done, k >= 0 matrix k
        holds a NaN or an Inf, any other value: not packed (the caller takes its full path)."""
        from loraplex.kernels.cpu_build import load_extension  # lazily: the pager never needs the kernels

        ext = load_extension("cpu_pack")
        if ext is None:
            return None
        rows = torch.empty(self.assignment.num_rows, self.layout.row_width, dtype=self.layout.dtype,
                           pin_memory=pin_memory)  # [R, D]
        bad = copy_rows(ext, rows)
        if bad < -1:
            return None
        if bad >= 0:
            s = self.slots[bad // 2]
            raise AdapterError(f"adapter {name!r}: {llama_module_name(s.layer, TARGET_MODULES[s.module])} "
                               f"{('lora_A', 'lora_B')[bad % 2]} contains NaN or Inf values")
        # The views pack_adapter makes (A [rank, in] over A^T's rows, b [out, rank] over B^T's), made when first
        # read: placing the adapter copies its rows and reads none of them (packed_views.py).
        modules = PackedModuleViews(rows, self.slots)
        from .packed_rows import PackedRows  # packed_rows imports this module

        packed = PackedRows(self.layout, rows, modules, self.assignment._replace(modules=modules))
        return LoraAdapter(name=name, modules=modules, max_rank=self.max_rank, source=source,
                           config=copy.deepcopy(self.config), packed=packed)


def header_matrices(header: Mapping[str, object]) -> Matrices | None:
    """The adapter matrices a (checked) safetensors header names, or None if any entry is not one."""
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            layer, module, half, _ = parse_weights_key(key)
            dtype = DTYPES[entry["dtype"]]
            begin = int(entry["data_offsets"][0])
            shape = tuple(int(n) for n in entry["shape"])
        except (AdapterError, KeyError, TypeError, ValueError, IndexError):
            return None
        out[(layer, module, half)] = (dtype, begin, shape)
    return out


def learn_plan(adapter: LoraAdapter, matrices: Matrices, data_bytes: int) -> PackPlan | None:
    """The plan of a packed adapter that passed every check, read from a file whose header names
    `matrices`; None where the file cannot be packed by the direct copy (a cast, an unaligned offset)
    or the header and the adapter do not describe the same matrices."""
    packed = adapter.packed
    if packed is None:
        return None
    layout, asg = packed.layout, packed.assignment
    if len(matrices) != 2 * len(asg.modules):
        return None
    itemsize = layout.dtype.itemsize
    byte_offsets, shapes, row_offsets, slots = [], [], [], []
    for m, s in zip(asg.modules, asg.slots.values()):
        for half, shape, row in (("lora_A", (s.rank, s.in_features), s.a_row),
                                 ("lora_B", (s.out_features, s.rank), s.b_row)):
            got = matrices.get((m.layer, m.module, half))
            if got is None or got[0] != layout.dtype or got[1] % itemsize or got[2] != shape:
                return None
            byte_offsets.append(got[1])
            shapes.append(shape)
            row_offsets.append(row * layout.row_width)
        slots.append(s)
    if len(packed.modules) != len(asg.modules) or any(a is not b for a, b in zip(packed.modules, asg.modules)):
        return None  # the adapter's module order is not the packing order: a plan rebuilds only the latter
    return PackPlan(layout, data_bytes, torch.tensor(byte_offsets, dtype=torch.int64),
                    torch.tensor(shapes, dtype=torch.int64).view(-1, 2), torch.tensor(row_offsets, dtype=torch.int64),
                    tuple(slots), asg._replace(modules=()), asg.max_rank, copy.deepcopy(adapter.config))


class PackPlans:
    """The plans one loader learnt, for one base model, rank limit and row layout; least recently used
    first out past `capacity` (one plan per adapter shape: ranks and target modules). Thread-safe: the
    host cache's prefetch threads share one."""

    def __init__(self, model: ModelConfig, max_lora_rank: int, layout: RowLayout, capacity: int = 64):
        if capacity < 1:
            raise ConfigError(f"plan capacity must be at least 1, got {capacity}")
        self.model, self.max_lora_rank, self.layout = model, max_lora_rank, layout
        self.capacity = capacity
        self._plans: OrderedDict[object, PackPlan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def check(self, model: ModelConfig, max_lora_rank: int, layout: RowLayout) -> None:
        if (model, max_lora_rank, layout) != (self.model, self.max_lora_rank, self.layout):
            raise ConfigError("these pack plans were made for another model, rank limit or row layout")

    def get(self, key: object, data_bytes: int) -> PackPlan | None:
        """The plan learnt for `key`, if its data section has this length (else the file is not what the
        plan expects, and the full path must judge it)."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is None or plan.data_bytes != data_bytes:
                self.misses += 1
                return None
            self._plans.move_to_end(key)
            self.hits += 1
            return plan

    def learn(self, key: object, plan: PackPlan | None) -> None:
        if plan is None or plan.layout != self.layout:
            return
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)


def folder_key(config_bytes: bytes, header_bytes: bytes) -> tuple[str, bytes, bytes]:
    return ("folder", config_bytes, header_bytes)


def load_planned_folder(plans: PackPlans, name: str, folder: str | Path, pin_memory: bool = False
                        ) -> LoraAdapter | None:
    """The folder's adapter packed by a plan learnt from the same config and header bytes; None where
    there is none (or the file does not read as that plan expects): the caller then takes the full path,
    which gives whatever error the folder deserves. AdapterError where the plan packed it and found a
    NaN or an Inf. The data section is read by the packer itself (PackPlan.pack_file), not here."""
    folder = Path(folder)
    try:
        config_bytes = (folder / CONFIG_FILE).read_bytes()
        f = (folder / WEIGHTS_FILE).open("rb", buffering=0)
    except OSError:
        return None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            (header_len,) = struct.unpack("<Q", read_exact(f, 8))
            if header_len > size - 8:
                return None
            plan = plans.get(folder_key(config_bytes, read_exact(f, header_len)), size - 8 - header_len)
        except (OSError, AdapterError, struct.error):
            return None
        if plan is None:
            return None
        return plan.pack_file(name, f.fileno(), 8 + header_len, str(folder), pin_memory)
