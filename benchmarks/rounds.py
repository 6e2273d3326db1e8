"""The order in which the CPU benchmarks run their paths within a round.

Paths that share their inputs alternate in one process, and the first path of a round meets those inputs colder
than the paths after it: on an Intel Xeon (twenty-second session) one layer's o-projection shrink over 4.7 MB of x,
the same code built twice, took 0.174 ms a call when timed first in each round and 0.152 ms when timed second.
Reversing the order every other round gives each path both places.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

V = TypeVar("V")


def round_order(calls: Mapping[str, V], rep: int) -> list[tuple[str, V]]:
    """calls' items in their order on even rounds, reversed on odd ones."""
    items = list(calls.items())
    return items if rep % 2 == 0 else items[::-1]
