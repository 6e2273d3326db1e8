"""Ceilings of this machine, measured in the same run as the benchmark that uses them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Roofline:
    read_gbps: float  # streaming read bandwidth (sum over a large fp32 tensor)
    copy_gbps: float  # copy bandwidth, counting bytes read + bytes written
    matmul_gflops_fp32: float
    threads: int

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


def measure_roofline(mib: int = 512, n: int = 2048, reps: int = 5) -> Roofline:
    x = torch.ones(mib * (1 << 20) // 4)
    y = torch.empty_like(x)
    read = x.numel() * 4 / _best(lambda: x.sum(), reps) / 1e9
    copy = 2 * x.numel() * 4 / _best(lambda: y.copy_(x), reps) / 1e9
    return Roofline(read, copy, matmul_gflops(n, reps), torch.get_num_threads())


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    """float32 rate of the best of `reps` n x n matmuls (after one untimed)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best(lambda: a @ b, reps) / 1e9


if __name__ == "__main__":
    print(measure_roofline())
