"""benchmarks/step_profile.py profiles decode steps (host functions, torch ops, kernels) on a tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import step_profile  # noqa: E402
from factories import make_tiny_model  # noqa: E402


def test_profiles_both_cases_and_writes_json(tmp_path):
    model = make_tiny_model(tmp_path / "model", "llama", seed=3)
    out = step_profile.main(["--model", str(model), "--batch", "4", "--context", "12", "--adapters", "2",
                             "--steps", "2", "--top", "60", "--pool-mib", "16", "--out", str(tmp_path)])
    none, distinct = out["cases"]
    assert (none["adapters"], distinct["adapters"]) == (0, 2)
    for case in out["cases"]:
        assert case["step_ms_median"] > 0 and len(case["step_ms_all"]) == 2
        assert case["device_busy_ms_per_step"] is None  # no GPU here
        assert case["top_python"] and all(f["own_ms_per_step"] >= 0 for f in case["top_python"])
        assert case["top_torch_ops_cpu"]
    # the adapters' LoRA calls are among what the second case's steps run, and only there
    assert any("apply_lora" in f["function"] for f in distinct["top_python"])
    assert not any("apply_lora" in f["function"] for f in none["top_python"])
    assert json.loads((tmp_path / "step_profile.json").read_text())["cases"][1]["adapters"] == 2


def test_triton_path_is_profiled_with_and_without_its_pointwise_kernels(tmp_path):
    """With a backend that brings RMSNorm / RoPE / SwiGLU kernels (Triton, interpreted here), both cases run
    again with the model's torch formulas, and the engine keeps its own kernel set afterwards."""
    model = make_tiny_model(tmp_path / "model", "llama", seed=4)
    out = step_profile.main(["--model", str(model), "--batch", "2", "--context", "5", "--adapters", "1",
                             "--steps", "1", "--top", "100000", "--pool-mib", "16", "--kernels", "triton"])
    assert [(c["pointwise"], c["adapters"]) for c in out["cases"]] == [("triton", 0), ("triton", 1), ("model", 0),
                                                                       ("model", 1)]
    # The Triton wrappers run in the first two cases only; the model's own set (on a CPU in float32, the C++
    # kernels) in the other two only.
    funcs = [" ".join(f["function"] for f in c["top_python"]) for c in out["cases"]]
    assert [("triton_pointwise.py" in f, "_cpu_add_rms_norm" in f) for f in funcs] == [
        (True, False), (True, False), (False, True), (False, True)]
