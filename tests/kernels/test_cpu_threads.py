"""kernels.cpu_threads: a thread beside the engine's runs its torch work (and the C++ packer's) alone,
without starting an OpenMP team of its own, and without changing any other thread's team size."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from loraplex.kernels.cpu_build import load_extension
from loraplex.kernels.cpu_threads import confine_to_one_thread
from native_kernels import require_built


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(quiet_s: float = 0.05, limit_s: float = 5.0) -> int:
    """os_threads() once it has held for quiet_s: the OpenMP workers of a pool thread that just ended may
    still be exiting, and one that exits while a new team starts would hide the new thread from the count
    (two runs of the kernel tests in a row, 2026-12-04: 6 threads before and after a new team of 2)."""
    deadline = time.monotonic() + limit_s
    n, since = os_threads(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        m = os_threads()
        if m != n:
            n, since = m, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return n


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of 2 wherever a thread runs a parallel op unconfined
    yield
    torch.set_num_threads(n)


def parallel_work(ext) -> torch.Tensor:
    """What a loader thread runs: the packing copy (a parallel loop over matrices) and large torch ops."""
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(256, 64, generator=g) for _ in range(64)]
    out = torch.empty(64 * 256 * 64)
    offsets = torch.arange(64, dtype=torch.int64) * (256 * 64)
    assert ext.transpose_into(srcs, out, offsets, 0) == -1
    x = torch.randn(2_000_000, generator=g)
    assert torch.isfinite((x * 2 + 1).sum())
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_confined_thread_starts_no_team_and_leaves_the_others(two_threads):
    ext = load_extension("cpu_pack")
    require_built("cpu_pack", ext is not None, "packer")
    ref = parallel_work(ext)  # this thread's own team exists from here on

    def confined() -> tuple[bool, int, int, int, torch.Tensor]:
        ok = confine_to_one_thread()
        before = settled_threads()
        out = parallel_work(ext)
        return ok, torch.get_num_threads(), before, os_threads(), out

    def unconfined() -> tuple[int, int, int]:
        torch.get_num_threads()
        before = settled_threads()
        parallel_work(ext)
        return torch.get_num_threads(), before, os_threads()

    with ThreadPoolExecutor(1) as pool:
        ok, n, before, after, out = pool.submit(confined).result()
    assert ok and n == 1
    assert after == before, "a confined thread's parallel work started threads of its own"
    assert torch.equal(out, ref)  # the same packed rows, on one thread
    assert torch.get_num_threads() == 2  # this thread's team size and torch's default are untouched
    # A thread started afterwards adopts torch's default as before: its parallel work takes a team of 2.
    with ThreadPoolExecutor(1) as pool:
        n, before, after = pool.submit(unconfined).result()
    assert n == 2 and after == before + 1
