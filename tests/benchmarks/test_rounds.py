"""benchmarks/rounds.py: every path runs once per round, first and last in turn."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from rounds import round_order  # noqa: E402


def test_order_reverses_every_other_round():
    calls = {"base": 1, "fused": 2, "baseline": 3}
    assert round_order(calls, 0) == [("base", 1), ("fused", 2), ("baseline", 3)]
    assert round_order(calls, 1) == [("baseline", 3), ("fused", 2), ("base", 1)]
    assert round_order(calls, 2) == round_order(calls, 0)
