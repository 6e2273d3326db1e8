"""The one preallocated device tensor, its free list, and who owns each page.

Ownership lives in two host-side numpy arrays (kind and owner id per page) so that taking and
returning pages costs O(pages moved), and the integrity check is one O(num_pages) pass. The
free list is a stack (a numpy array and a top index): the pages freed last are reused first,
which keeps recently touched memory warm. take() returns pages in the order they are popped and
release() pushes them so that they pop again in the same order: a fresh pool hands out ascending
runs (0, 1, 2, ...), and pages freed together come back as the same runs, which lets an adapter's
rows go in with a few large copies instead of one per page (adapter_pages.write_pages).
"""

from __future__ import annotations

import numpy as np
import torch

from .geometry import PoolGeometry
from .huge_pages import advise_huge_pages, fresh_buffer

# Page kinds in PagePool.kind.
FREE = 0
KV = 1
ADAPTER = 2
KIND_NAMES = {FREE: "free", KV: "kv", ADAPTER: "adapter"}

NO_OWNER = -1


class PagePool:
    """pool.tensor [num_pages, page_elems] and the free list; owners are ids the pager hands out."""

    def __init__(self, geometry: PoolGeometry, device: torch.device | str = "cpu") -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        # Zeroed, not empty: attention over a partly filled block multiplies unused slots by a zero
        # weight, and 0 * NaN from uninitialised memory would still poison the output. Advised to
        # use huge pages before the zeroing touches it (huge_pages.py), on a mapping of its own there.
        # A fresh mapping already reads as zeros; zeroing it anyway faults its pages in now, huge where the
        # advice holds, rather than page by page in the first steps that write KV or adapters.
        shape = (geometry.num_pages, geometry.page_elems)
        if self.device.type == "cpu":
            self.tensor = fresh_buffer(shape[0] * shape[1], geometry.dtype).view(shape)
        else:
            self.tensor = torch.empty(shape, dtype=geometry.dtype, device=self.device)
        self.huge_pages = advise_huge_pages(self.tensor)
        self.tensor.zero_()
        n = geometry.num_pages
        self.kind = np.full(n, FREE, dtype=np.int8)  # [num_pages] int8
        self.owner = np.full(n, NO_OWNER, dtype=np.int64)  # [num_pages] int64
        # Reversed so that page 0 is taken first: low page ids first makes small tests readable.
        self._free = np.arange(n - 1, -1, -1, dtype=np.int64)  # [num_pages] int64, stack; valid up to _top
        self._top = n

    # -- views -------------------------------------------------------------------------------

    def rows(self) -> torch.Tensor:
        """[num_pages * rows_per_page, D]: the adapter kernels' view."""
        g = self.geometry
        return self.tensor.view(g.num_pages * g.rows_per_page, g.row_width)

    def kv_view(self) -> torch.Tensor:
        """[num_pages, 2, block_size, num_kv_heads, head_dim]: the attention kernels' view."""
        g = self.geometry
        return self.tensor.view(g.num_pages, 2, g.block_size, g.num_kv_heads, g.head_dim)

    # -- free list ---------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.geometry.num_pages

    @property
    def num_free(self) -> int:
        return self._top

    def free_pages(self) -> np.ndarray:
        """[num_free] int64, a copy of the free list."""
        return self._free[: self._top].copy()

    def take(self, n: int, kind: int, owner: int) -> np.ndarray:
        """Pop n pages (in pop order) and mark them owned; the caller has checked n <= num_free."""
        if n > self._top:
            raise AssertionError(f"take({n}) with only {self._top} free pages: callers must check first")
        pages = self._free[self._top - n : self._top][::-1].copy()  # [n] int64, the top of the stack first
        self._top -= n
        self.kind[pages] = kind
        self.owner[pages] = owner
        return pages

    def release(self, pages: np.ndarray) -> None:
        """Push pages back on the free list (pages: [n] int64, all owned, none repeated), pages[0] on
        top: a take of the same size pops them in the same order."""
        n = len(pages)
        if self._top + n > self.num_pages:
            raise AssertionError(f"release of {n} pages would overfill the free list: a page was released twice")
        self.kind[pages] = FREE
        self.owner[pages] = NO_OWNER
        self._free[self._top : self._top + n] = pages[::-1]
        self._top += n
