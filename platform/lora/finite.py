"""Which of many weight tensors holds a NaN or an Inf, at the cost of about one pass over them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def first_nonfinite(tensors: Sequence[torch.Tensor]) -> int | None:
    """The index of the first tensor holding a NaN or an Inf, else None. One fused reduction over
    all of them first (a NaN or an Inf makes its tensor's norm non-finite); only when some norm is
    not finite (or overflowed) is each one checked exactly."""
    if not tensors:
        return None
    norms = torch._foreach_norm([t if t.dtype in _NORM_DTYPES else t.float() for t in tensors])
    if bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):
        return None
    return next((k for k, t in enumerate(tensors) if not torch.isfinite(t).all()), None)
