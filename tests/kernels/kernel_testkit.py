"""What every kernel test shares: the device, scattered pages, and the error measure."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

# Compiled kernels where a GPU is at hand, the interpreter otherwise (CPU tensors always run there).
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|, in float64; inf when ours has a NaN."""
    ours, ref = ours.double(), ref.double()
    if not torch.isfinite(ours).all():
        return math.inf
    scale = ref.abs().max().item()
    return (ours - ref).abs().max().item() / (scale if scale > 0 else 1.0)


class PageDealer:
    """Hands out distinct pages in random order, so an adapter's pages are scattered and unordered."""

    def __init__(self, num_pages: int, rng: random.Random):
        self.free = list(range(num_pages))
        rng.shuffle(self.free)

    def take(self, n: int) -> np.ndarray:
        if n > len(self.free):
            raise AssertionError(f"test pool too small: {n} pages wanted, {len(self.free)} left")
        out, self.free = self.free[:n], self.free[n:]
        return np.array(out, dtype=np.int64)
