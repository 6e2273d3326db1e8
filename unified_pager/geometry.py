"""The page geometry of the unified pool: how many pages, how wide, and how KV and adapters fit.

One page is ``rows_per_page`` rows of ``row_width`` (D) elements. KV uses a page as one block of
``block_size`` tokens of one layer, laid out [2 (K, V), block_size, num_kv_heads, head_dim];
adapters use pages as a run of D-element rows (see adapter_pages.py). D is the gcd of every width
an adapter matrix or a KV head can have, so every matrix row and every page splits into whole rows.
RowLayout is the part of the geometry that an adapter's rows depend on (not the page size), so
adapters can be packed into rows before anyone knows which pool, or which pages, they will go to.
See docs/PAGE_POOL.md for the worked SmolLM2-135M example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from loraplex.errors import AdapterError, ConfigError
from loraplex.lora.types import MODULE_INDEX, TARGET_MODULES, LoraAdapter, LoraModuleWeights
from loraplex.models.config import ModelConfig


def row_width_for(cfg: ModelConfig) -> int:
    """D = gcd(hidden, q_size, kv_size, intermediate, head_dim): every adapter in/out width and
    every KV page is a whole number of D-element rows."""
    return math.gcd(cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim)


@dataclass(frozen=True)
class RowLayout:
    """What an adapter's logical rows depend on (D, dtype) and are checked against (layers, shapes).

    Page size is not part of it: pages only cut the logical row sequence into pieces. So an adapter
    packed once into rows for a RowLayout (adapter_store's loader does it, off the engine thread)
    goes into any pool whose geometry has this RowLayout with one page-granular copy.
    """

    row_width: int  # D
    dtype: torch.dtype
    num_layers: int
    # (in_features, out_features) per TARGET_MODULES entry, or None when not built from a model.
    module_shapes: tuple[tuple[int, int], ...] | None = None

    @staticmethod
    def for_model(cfg: ModelConfig, dtype: torch.dtype) -> "RowLayout":
        """The layout PoolGeometry.for_model(cfg, ..., dtype, ...) has, whatever its page size."""
        shapes = tuple(cfg.module_shape(m) for m in TARGET_MODULES)
        return RowLayout(row_width_for(cfg), dtype, cfg.num_layers, shapes)

    def module_rows(self, m: LoraModuleWeights) -> tuple[int, int]:
        """(rows of A, rows of B^T) of one module; AdapterError if it does not fit this layout."""
        self.check_module(m)
        in_f, out_f = int(m.a.shape[1]), int(m.b.shape[0])
        return m.rank * in_f // self.row_width, m.rank * out_f // self.row_width

    def check_module(self, m: LoraModuleWeights) -> None:
        where = f"layer {m.layer} {m.module}"
        if m.module not in MODULE_INDEX:
            raise AdapterError(f"{where}: unknown target module (supported: {', '.join(TARGET_MODULES)})")
        if not 0 <= m.layer < self.num_layers:
            raise AdapterError(f"{where}: layer out of range for a {self.num_layers}-layer model")
        if m.rank < 1:
            raise AdapterError(f"{where}: rank must be >= 1, got {m.rank}")
        if m.a.dim() != 2 or m.b.dim() != 2 or m.a.shape[0] != m.rank or m.b.shape[1] != m.rank:
            raise AdapterError(
                f"{where}: expected a [rank, in] and b [out, rank] with rank {m.rank}, "
                f"got a {tuple(m.a.shape)} and b {tuple(m.b.shape)}"
            )
        in_f, out_f = int(m.a.shape[1]), int(m.b.shape[0])
        if self.module_shapes is not None and (in_f, out_f) != self.module_shapes[MODULE_INDEX[m.module]]:
            raise AdapterError(
                f"{where}: shape (in {in_f}, out {out_f}) does not match the base model's "
                f"{self.module_shapes[MODULE_INDEX[m.module]]}"
            )
        if in_f % self.row_width or out_f % self.row_width:
            raise AdapterError(f"{where}: in {in_f} / out {out_f} are not multiples of the pool row width {self.row_width}")


@dataclass(frozen=True)
class PoolGeometry:
    num_pages: int
    row_width: int  # D, elements per row
    rows_per_page: int
    block_size: int  # tokens per KV block (one page per layer per block)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # (in_features, out_features) per TARGET_MODULES entry, when built from a ModelConfig: lets
    # the pager refuse an adapter made for another base model before it takes any page.
    module_shapes: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_pages", "row_width", "rows_per_page", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"PoolGeometry.{name} must be a positive int, got {value!r}")
        if not self.dtype.is_floating_point:
            raise ConfigError(f"the page pool needs a floating-point dtype, got {self.dtype}")
        kv_page = 2 * self.block_size * self.num_kv_heads * self.head_dim
        if self.page_elems != kv_page:
            raise ConfigError(
                f"a page ({self.rows_per_page} rows x {self.row_width}) must hold exactly one KV block "
                f"of {kv_page} elements (2 x {self.block_size} tokens x {self.num_kv_heads} heads x {self.head_dim})"
            )
        if self.module_shapes is not None and len(self.module_shapes) != len(TARGET_MODULES):
            raise ConfigError(f"module_shapes needs one (in, out) per target module, got {len(self.module_shapes)}")

    # -- sizes -------------------------------------------------------------------------------

    @property
    def page_elems(self) -> int:
        return self.rows_per_page * self.row_width

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.dtype.itemsize

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @staticmethod
    def for_model(cfg: ModelConfig, pool_bytes: int, dtype: torch.dtype, block_size: int = 16) -> "PoolGeometry":
        """As many pages as fit in pool_bytes; ConfigError if that is not one KV block for every layer."""
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        d = row_width_for(cfg)
        page_elems = 2 * block_size * cfg.kv_size
        page_bytes = page_elems * dtype.itemsize
        num_pages = int(pool_bytes) // page_bytes
        if num_pages < cfg.num_layers:
            raise ConfigError(
                f"a pool of {pool_bytes} bytes holds {num_pages} pages of {page_bytes} bytes; one KV block "
                f"of {block_size} tokens needs {cfg.num_layers} pages (one per layer)"
            )
        return PoolGeometry(
            num_pages=num_pages,
            row_width=d,
            rows_per_page=page_elems // d,
            block_size=block_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            module_shapes=tuple(cfg.module_shape(m) for m in TARGET_MODULES),
        )

    # -- KV ----------------------------------------------------------------------------------

    def kv_blocks_for_tokens(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def kv_pages_for_tokens(self, n_tokens: int) -> int:
        """Pages a sequence of n_tokens holds: one page per layer per started block."""
        return self.kv_blocks_for_tokens(n_tokens) * self.num_layers

    # -- adapters ----------------------------------------------------------------------------

    @cached_property  # compared on every placement: build it once (frozen dataclasses allow this)
    def row_layout(self) -> RowLayout:
        return RowLayout(self.row_width, self.dtype, self.num_layers, self.module_shapes)

    def module_rows(self, m: LoraModuleWeights) -> tuple[int, int]:
        """(rows of A, rows of B^T) of one module; AdapterError if it does not fit this geometry."""
        return self.row_layout.module_rows(m)

    def adapter_num_rows(self, adapter: LoraAdapter) -> int:
        packed = adapter.packed
        if packed is not None and packed.layout == self.row_layout:
            return packed.num_rows  # checked when it was packed: no pass over the modules
        layout = self.row_layout
        return sum(sum(layout.module_rows(m)) for m in adapter.modules)

    def adapter_num_pages(self, adapter: LoraAdapter) -> int:
        return -(-self.adapter_num_rows(adapter) // self.rows_per_page)

    def check_module(self, m: LoraModuleWeights) -> None:
        self.row_layout.check_module(m)
