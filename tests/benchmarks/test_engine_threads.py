"""benchmarks/engine_threads.py on a tiny random Llama: every scenario runs in its own process and reports a
decode step time; the JSON holds each round."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import engine_threads  # noqa: E402
from factories import make_tiny_model  # noqa: E402


def test_every_scenario_reports_a_step(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", "llama", seed=3)
    out = tmp_path / "threads.json"
    result = engine_threads.main(["--model", str(model), "--rounds", "1", "--steps", "3", "--batch", "2",
                                  "--context", "8", "--threads", "1", "--work-dir", str(tmp_path / "work"),
                                  "--out", str(out)])
    assert set(result["step_ms"]) == set(engine_threads.SCENARIOS)
    assert all(len(v) == 1 and v[0] > 0 for v in result["step_ms"].values())
    assert json.loads(out.read_text())["step_ms"] == result["step_ms"]
