"""Ask Linux to back the page pool with 2 MiB pages (transparent huge pages, madvise mode).

Why: the CPU kernels read K/V blocks and adapter rows scattered over a pool of hundreds of MiB to
GiB; with 4 KiB pages nearly every block read is also a TLB miss. On the dev machine (THP set to
`madvise`, so nothing is huge unless asked) a huge-page pool made the C++ decode attention about
25% faster at 2k context and 8% at 128 (measured with torch's THP_MEM_ALLOC_ENABLE=1, which does
the same for every allocation).

The advice must come before the memory is first touched, so the pool is allocated empty, advised,
then zeroed. Where THP is off, or the platform is not Linux, the call changes nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB-aligned pages inside t's memory; True if advised."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    last = end & ~(HUGE_PAGE - 1)
    if last <= first:
        return False  # under one aligned huge page: nothing to advise
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def fresh_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:  # [numel], zeros: untouched until filled
    """A flat CPU buffer that starts on a 2 MiB boundary, not yet advised nor touched. On Linux it is a private
    anonymous mapping of its own (freed with the last tensor that views it), so its pages are fresh whatever the
    process allocated and freed before: from torch's allocator a buffer could reuse heap memory already touched
    with 4 KiB pages, which the huge-page advice does not turn huge. That happened to buffers of 40 MiB and more
    once glibc kept freed memory in the heap (engine/host_memory.py's trim threshold) and earlier engines of the
    same process had freed theirs. Costs at most 2 MiB of address space more than numel elements. A buffer under
    2 MiB (no whole huge page to give it) or off Linux is a plain torch.empty, on no particular boundary."""
    nbytes = numel * dtype.itemsize
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.empty(numel, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until no tensor views it
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset:offset + nbytes].view(dtype)


def huge_page_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:  # [numel], zeros: untouched until filled
    """fresh_buffer, advised (advise_huge_pages) before anything touches it: every whole 2 MiB page of it can be a
    huge one, where a tensor of its own gets only the aligned pages inside it."""
    buf = fresh_buffer(numel, dtype)
    advise_huge_pages(buf)
    return buf
