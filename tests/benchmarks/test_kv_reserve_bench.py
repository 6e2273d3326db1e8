"""benchmarks/kv_reserve.py steps two engines in turn (KV blocks one at a time, and reserved ahead) on a tiny model:
the same tokens, the reserving engine holding reserved pages, every quarter timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import kv_reserve  # noqa: E402
from factories import make_tiny_model  # noqa: E402


def test_steps_both_engines_to_the_same_tokens_and_writes_json(tmp_path):
    model = make_tiny_model(tmp_path / "model", "llama", seed=5)
    out = kv_reserve.main(["--model", str(model), "--batch", "3", "--prompt", "5", "--steps", "8", "--reserve", "20",
                           "--pool-mib", "8", "--out", str(tmp_path / "kv.json")])
    assert out["same_tokens"] and [q["steps"] for q in out["quarters"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert all(len(v) == 8 and min(v) > 0 for v in out["step_ms"].values())
    held = out["kv_reserved_pages_at_end"]
    assert held["one at a time"] == 0 and held["reserve 20"] > 0
    assert json.loads((tmp_path / "kv.json").read_text())["reserve"] == 20
