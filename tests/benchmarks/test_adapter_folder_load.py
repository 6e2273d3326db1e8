"""benchmarks/adapter_folder_load.py on a tiny model: the three paths run, pack the same rows, and the JSON is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from factories import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import adapter_folder_load  # noqa: E402


def test_bench_times_the_three_paths_and_writes_json(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", "llama")
    out = tmp_path / "load.json"
    result = adapter_folder_load.main(["--model", str(model), "--work-dir", str(tmp_path / "adapters"),
                                       "--adapters", "2", "--rounds", "2", "--rank", "4", "--threads", "1",
                                       "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["ms"]) == {"load_then_pack", "packed", "planned"}
    assert result["plan_misses"] == 1 and result["plan_hits"] == 1 + (2 + 1) * 2  # every load after the first (warm-up round included)
    assert all(0 < s["median"] <= s["p90"] for s in result["ms"].values())
    assert result["adapter_mb"] > 0
