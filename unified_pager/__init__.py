"""The unified page pool: one device tensor whose pages hold both KV blocks and LoRA adapter rows.

The scheduler codes against UnifiedPager; the kernels read PagePool views (rows(), kv_view()),
AdapterResidency index tensors and block tables. Geometry and invariants: docs/PAGE_POOL.md.
"""

from .adapter_pages import AdapterResidency, ModuleSlot
from .geometry import PoolGeometry, RowLayout, row_width_for
from .pack_plan import PackPlan, PackPlans
from .packed_rows import PackedRows, load_packed_folder, pack_adapter
from .pager import PoolStats, UnifiedPager
from .pool import PagePool

__all__ = [
    "AdapterResidency",
    "ModuleSlot",
    "PackPlan",
    "PackPlans",
    "PackedRows",
    "PagePool",
    "PoolGeometry",
    "PoolStats",
    "RowLayout",
    "UnifiedPager",
    "load_packed_folder",
    "pack_adapter",
    "row_width_for",
]
