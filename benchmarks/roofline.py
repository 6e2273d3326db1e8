"""Ceilings of this machine, measured in the same run as the benchmark that uses them.

The matmul ceiling is the best rate of every float32 GEMM this machine has: torch's mm (MKL) and, where
they run, oneDNN with a prepacked weight and loraplex's packed C++ kernel (models/cpu_gemm.py). One
library is not a ceiling: on an AMD EPYC with AVX-512 (Zen 5) MKL's sgemm ran the 2048-square product at
154-188 GFLOP/s where oneDNN and the packed kernel reached 400 (the engine's decode then measured at
1.10 "of the ceiling").
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class Roofline:
    read_gbps: float  # streaming read bandwidth (sum over a large fp32 tensor): the median of read_gbps_by_buffer
    copy_gbps: float  # copy bandwidth, counting bytes read + bytes written (the median over the same buffers)
    matmul_gflops_fp32: float  # the best of matmul_by_backend
    threads: int
    matmul_by_backend: dict[str, float] = field(default_factory=dict)  # "mm", "onednn", "packed"
    read_gbps_by_buffer: list[float] = field(default_factory=list)  # each fresh buffer's best read

    def as_dict(self) -> dict:
        return asdict(self)


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_roofline(mib: int = 512, n: int = 2048, reps: int = 5, buffers: int = 5) -> Roofline:
    """The read and copy rates are each the median over `buffers` fresh allocations of `mib` MiB of the best of
    `reps` passes over it. On a shared AMD EPYC (Zen 4) VM one allocation read at 31-36 GB/s and the next at
    47-55 within seconds, and the best pass over one buffer kept whichever it drew (RESULTS.md, twenty-seventh
    session); the engine's weights, pool and K/V cache are allocations like these, so the median stands for
    memory as a process gets it."""
    reads, copies = [], []
    for _ in range(buffers):
        x = torch.ones(mib * (1 << 20) // 4)
        y = torch.empty_like(x)
        reads.append(x.numel() * 4 / _best(lambda: x.sum(), reps) / 1e9)
        copies.append(2 * x.numel() * 4 / _best(lambda: y.copy_(x), reps) / 1e9)
        del x, y
    rates = matmul_rates(n, reps)
    return Roofline(statistics.median(reads), statistics.median(copies), max(rates.values()), torch.get_num_threads(),
                    rates, reads)


@functools.lru_cache(maxsize=2)
def _products(n: int) -> dict[str, object]:
    """n x n float32 products, one per backend that runs here: packing a weight is not part of a call."""
    from loraplex.models import cpu_gemm  # lazily: the roofline's bandwidth part needs no loraplex
    from loraplex.kernels import cpu_linear

    a, w = torch.randn(n, n), torch.randn(n, n)  # x [n, n], w [out, in]
    calls: dict[str, object] = {"mm": lambda: a @ w.t()}
    usable = {"onednn": cpu_gemm.onednn_available(), "packed": cpu_linear.available()}
    for layout in cpu_gemm.PACKED_LAYOUTS:
        if usable[layout]:
            pw = cpu_gemm.pack(w, layout)
            calls[layout] = functools.partial(cpu_gemm.linear, a, pw, None, layout)
    return calls


def matmul_rates(n: int = 2048, reps: int = 5) -> dict[str, float]:
    """float32 GFLOP/s of each GEMM backend: the best of `reps` n x n products (after one untimed)."""
    return {name: 2 * n**3 / _best(fn, reps) / 1e9 for name, fn in _products(n).items()}


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    """The float32 matmul ceiling: the best rate over matmul_rates' backends."""
    return max(matmul_rates(n, reps).values())


if __name__ == "__main__":
    print(measure_roofline())
