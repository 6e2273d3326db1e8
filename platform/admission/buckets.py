"""Token-bucket arithmetic for the in-process limiter (redis_scripts.py does the same in Lua).

A bucket of capacity C (the per-minute limit) refills continuously at C/60 per second and never holds
more than C; a bucket never written is full. Chosen over a sliding window because its state is two
numbers per tenant and limit (a window needs every admission's timestamp), it is exact under any
interleaving, and "when will enough be back" is one division. Over any interval of t seconds it admits
at most C + C·t/60, which is the budget a per-minute limit promises.
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_MINUTE = 60.0


@dataclass
class Bucket:
    """Mutable on purpose: owned by LocalLimiter and touched only under its lock."""

    capacity: int  # the limit when last written; refill runs at this rate until the next write
    level: float
    updated: float  # clock time (seconds) of `level`


def level_now(bucket: Bucket | None, capacity: int, now: float) -> float:
    """The bucket's level at `now` under a limit of `capacity` (which the operator may have changed)."""
    if bucket is None:
        return float(capacity)
    refilled = bucket.level + (now - bucket.updated) * bucket.capacity / SECONDS_PER_MINUTE
    # Clamp to the old capacity (refill stops when full) and to the new one (a lowered limit applies at once).
    return min(refilled, float(bucket.capacity), float(capacity))


def seconds_until(level: float, need: int, capacity: int) -> float:
    """Seconds until the bucket holds `need` (need <= capacity), refilling at capacity per minute."""
    return max(0.0, (need - level) * SECONDS_PER_MINUTE / capacity)
