"""The pool asks for transparent huge pages before its memory is first touched, and is still all zeros."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loraplex.unified_pager.huge_pages import HUGE_PAGE, advise_huge_pages, huge_page_buffer
from loraplex.unified_pager.pool import PagePool
from pager_testkit import TINY, geometry_with_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _huge_kib_of(ptr: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds address ptr."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_small_tensors_and_other_devices_are_left_alone():
    assert advise_huge_pages(torch.empty(1024)) is False  # under one aligned 2 MiB page
    if torch.cuda.is_available():
        assert advise_huge_pages(torch.empty(HUGE_PAGE, device="cuda")) is False


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="transparent huge pages are not available here")
def test_advised_memory_is_backed_by_huge_pages_once_touched():
    t = torch.empty(64 * HUGE_PAGE // 4, dtype=torch.float32)  # 64 MiB
    assert advise_huge_pages(t)
    t.zero_()
    assert _huge_kib_of(t.data_ptr() + 32 * HUGE_PAGE) > 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="transparent huge pages are not available here")
def test_huge_page_buffer_starts_on_a_huge_page_and_gets_them():
    # 40 MiB and a bit: above glibc's largest mmap threshold (32 MiB), so fresh pages, as a model's weights get
    buf = huge_page_buffer(20 * HUGE_PAGE // 4 + 123, torch.float32)
    assert buf.numel() == 20 * HUGE_PAGE // 4 + 123 and buf.is_contiguous()
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(1.0)
    assert _huge_kib_of(buf.data_ptr()) > 0


def test_pool_is_zeroed_after_the_advice():
    pool = PagePool(geometry_with_pages(TINY, 4096))
    assert isinstance(pool.huge_pages, bool)
    assert torch.count_nonzero(pool.tensor) == 0
