"""Keep the host memory that steps free inside the process, so that later steps reuse it instead of
asking the kernel for it again, page by page (glibc's malloc, Linux).

Why: every step allocates its activations anew (a 2048-token prefill chunk's gate/up output alone is
25 MB), and glibc gives blocks above its mmap threshold (128 KiB, raised as such blocks are freed) their
own mapping, and returns the top of its heap to the kernel once more than its trim threshold lies free
there. Each reuse of that memory then starts with a page fault per 4 KiB page, and on the dev machines'
VMs a fault costs several microseconds of kernel time. Measured on the e2e quick trace (48 requests,
offline, loraplex alone, AMD EPYC Zen 5; /tmp script counting getrusage's minor faults per run):
without this, 121k faults and 0.86 s of system time in a process's first run, then 42k-106k faults and
0.13-0.36 s in each later run; with it, 34k faults (0.09 s) in the first run and 0-8.5k after.

The price: the process keeps its high-water mark of freed memory instead of handing it back (a serving
process reuses it at the next busy step anyway). EngineConfig.retain_host_memory turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap: glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
# (HEAP_MAX_SIZE / 2); a larger value is refused.
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap that is kept rather than returned: more than a prefill chunk's
# activations at the default token budget.
TRIM_THRESHOLD = 512 << 20


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; True where they were set (Linux with glibc),
    False elsewhere (the process's allocator is then left as it is)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt  # glibc (musl has none)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the mmap or trim threshold: freed host memory goes back to the kernel")
    return ok
