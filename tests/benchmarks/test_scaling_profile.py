"""benchmarks/scaling_profile.py splits the adapter-scaling sweep's runs by call, on a tiny random Llama and the e2e
harness's tiny preset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import scaling_profile  # noqa: E402
from factories import make_tiny_model  # noqa: E402
from loraplex.kernels import cpu_lora_gemm  # noqa: E402
from loraplex.models import llama  # noqa: E402
from offline_profile import KINDS  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("scaling-profile")
    model = make_tiny_model(tmp / "model", "llama", seed=8)
    calls = (llama.linear, cpu_lora_gemm.linear_lora)
    out = scaling_profile.main(["--preset", "tiny", "--model", str(model), "--counts", "1", "16", "--rounds", "2",
                                "--work-dir", str(tmp / "work"), "--out", str(tmp / "profile.json")])
    return out | {"tmp": tmp, "calls_after": (llama.linear, cpu_lora_gemm.linear_lora), "calls_before": calls}


def test_each_count_runs_every_round_and_the_json_is_written(result):
    assert result["counts"] == [1, 16] and [len(result["runs"][n]) for n in (1, 16)] == [2, 2]
    saved = json.loads((result["tmp"] / "profile.json").read_text())
    assert saved["paired_minus_first"]["16"] == json.loads(json.dumps(result["paired_minus_first"][16]))
    assert result["distinct_used"][1] == 1 < result["distinct_used"][16]


def test_calls_add_up_to_the_steps_and_the_steps_to_the_wall(result):
    for n in (1, 16):
        for run in result["runs"][n]:
            s = run["seconds"]
            assert s["prefill"]["step"] > 0 and s["decode"]["step"] > 0
            for kind in KINDS:
                timed = sum(v for c, v in s[kind].items() if c not in ("step", "other"))
                assert s[kind]["other"] == pytest.approx(s[kind]["step"] - timed)
            assert sum(s[k]["step"] for k in KINDS) <= run["wall_s"] * 1.01 + 0.05


def test_the_adapters_are_loaded_through_the_host_cache_in_every_run(result):
    # every run starts from an empty cache and pool (e2e/scaling.run_one): each adapter used is loaded again
    for n in (1, 16):
        for run in result["runs"][n]:
            assert run["host_loads"] == result["distinct_used"][n] and run["host_load_s"] > 0
            assert run["pool_loads"] >= result["distinct_used"][n]


def test_the_paired_differences_are_those_of_the_rounds(result):
    runs, paired = result["runs"], result["paired_minus_first"][16]
    walls = sorted(a["wall_s"] - b["wall_s"] for a, b in zip(runs[16], runs[1]))
    assert paired["wall_s"] == pytest.approx(sum(walls) / 2)  # the median of two
    decode = sorted(a["seconds"]["decode"]["step"] - b["seconds"]["decode"]["step"] for a, b in zip(runs[16], runs[1]))
    assert paired["seconds"]["decode"]["step"] == pytest.approx(sum(decode) / 2)


def test_the_engine_modules_are_left_as_they_were(result):
    assert result["calls_after"] == result["calls_before"]


def test_counts_must_be_two_or_more_distinct(tmp_path):
    with pytest.raises(SystemExit):
        scaling_profile.main(["--preset", "tiny", "--counts", "4", "--work-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        scaling_profile.main(["--preset", "tiny", "--counts", "4", "4", "--work-dir", str(tmp_path)])
