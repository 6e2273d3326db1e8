"""benchmarks/offline_profile.py splits an offline run's step time by call, with adapters and without, on a tiny
random Llama and the e2e harness's tiny preset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import offline_profile  # noqa: E402
from factories import make_tiny_model  # noqa: E402
from loraplex.kernels import cpu_lora_gemm  # noqa: E402
from loraplex.models import llama  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("offline-profile")
    model = make_tiny_model(tmp / "model", "llama", seed=5)
    return offline_profile.main(["--preset", "tiny", "--model", str(model), "--rounds", "2", "--work-dir",
                                 str(tmp / "work"), "--out", str(tmp / "profile.json")]) | {"tmp": tmp}


def test_rounds_alternate_and_the_json_is_written(result):
    assert [len(result["runs"][label]) for label in "AB"] == [2, 2]
    saved = json.loads((result["tmp"] / "profile.json").read_text())
    assert saved["median_s"] == result["median_s"] and saved["distinct_adapters"] == result["distinct_adapters"] > 0


def test_calls_are_split_by_step_kind_and_add_up_to_the_steps(result):
    for label in "AB":
        for run in result["runs"][label]:
            s = run["seconds"]
            # the trace's prompts are prefilled and its outputs decoded: both kinds of step ran, each with its GEMMs
            assert s["prefill"]["step"] > 0 and s["decode"]["step"] > 0
            assert s["prefill"]["gemm"] + s["prefill"]["gemm_lora"] > 0 and s["decode"]["gemm"] > 0
            assert s["prefill"]["paged_attention"] > 0 and s["decode"]["paged_attention"] > 0
            for kind in offline_profile.KINDS:
                timed = sum(v for c, v in s[kind].items() if c not in ("step", "other"))
                assert s[kind]["other"] == pytest.approx(s[kind]["step"] - timed)
                assert 0 < timed <= s[kind]["step"]
            assert sum(s[k]["step"] for k in offline_profile.KINDS) <= run["wall_s"] * 1.01 + 0.05


def test_only_the_run_with_adapters_calls_the_lora_kernels(result):
    lora_calls = ("gemm_lora", "apply_lora_group")
    for run in result["runs"]["B"]:
        assert all(run["seconds"][k][c] == 0 for k in offline_profile.KINDS for c in lora_calls)
    for run in result["runs"]["A"]:
        assert run["seconds"]["decode"]["apply_lora_group"] > 0  # the trace's decode steps carry adapters
        assert run["seconds"]["prefill"]["gemm_lora"] + run["seconds"]["prefill"]["apply_lora_group"] > 0


def test_the_engine_and_modules_are_left_as_they_were(tmp_path):
    engine_calls = (llama.linear, cpu_lora_gemm.linear_lora)
    model = make_tiny_model(tmp_path / "model", "llama", seed=6)
    from loraplex.config import EngineConfig
    from loraplex.engine import EngineCore

    engine = EngineCore(EngineConfig(model=str(model), dtype="float32", device="cpu", pool_bytes=8 << 20))
    ops = engine.runner.ops
    with offline_profile.timed_engine(engine, offline_profile.Timers()):
        assert engine.runner.ops is not ops and llama.linear is not engine_calls[0]
    assert engine.runner.ops is ops
    assert (llama.linear, cpu_lora_gemm.linear_lora) == engine_calls
    assert "forward" not in vars(engine.model) and "step" not in vars(engine)


def test_a_baseline_build_runs_as_a_third_system(tmp_path):
    """--baseline-source: run C, with adapters, in the same rounds as A and B (here with the kernel's own source
    built under another name; the tiny preset's prompts are too short for the GEMM's LoRA, the next test routes it)."""
    from loraplex.kernels import cpu_linear

    model = make_tiny_model(tmp_path / "model", "llama", seed=7)
    src = Path(cpu_linear.__file__).with_suffix(".cpp")
    out = offline_profile.main(["--preset", "tiny", "--model", str(model), "--rounds", "2", "--work-dir",
                                str(tmp_path / "work"), "--out", str(tmp_path / "p.json"), "--baseline-source",
                                str(src)])
    assert [len(out["runs"][label]) for label in "ABC"] == [2, 2, 2]
    assert out["baseline_source"] == str(src) and set(out["a_minus_c_s"]) == set(offline_profile.KINDS)
    for run in out["runs"]["C"]:
        assert run["seconds"]["decode"]["apply_lora_group"] > 0  # C serves the adapters as A does


def test_the_timers_build_runs_the_engines_lora_gemms(tmp_path, monkeypatch):
    """Inside timed_engine the engine's cpu_lora_gemm.linear_lora calls (seven arguments, llama.py) run the build that
    Timers.gemm_ext names, and are timed as gemm_lora."""
    from loraplex.config import EngineConfig
    from loraplex.engine import EngineCore

    engine = EngineCore(EngineConfig(model=str(make_tiny_model(tmp_path / "model", "llama", seed=8)), dtype="float32",
                                     device="cpu", pool_bytes=8 << 20))
    got = []
    monkeypatch.setattr(cpu_lora_gemm, "linear_lora", lambda *a, ext=None: got.append((a, ext)) or "y")
    timers = offline_profile.Timers()
    build = object()  # stands for a compiled module: only passed on
    with offline_profile.timed_engine(engine, timers):
        assert cpu_lora_gemm.linear_lora(*range(7)) == "y"
        timers.gemm_ext = build
        assert cpu_lora_gemm.linear_lora(*range(7)) == "y"
    assert got == [(tuple(range(7)), None), (tuple(range(7)), build)]
    assert timers.take()["decode"]["gemm_lora"] > 0


def test_rerun_times_each_lora_call_again_on_a_copy(tmp_path):
    """--rerun: every apply_lora_group call of the runs with adapters is made again at once on a copy of its output
    and timed apart; the runs without adapters make none, and without --rerun there is no rerun time."""
    import torch

    model = make_tiny_model(tmp_path / "model", "llama", seed=9)
    out = offline_profile.main(["--preset", "tiny", "--model", str(model), "--rounds", "1", "--work-dir",
                                str(tmp_path / "work"), "--out", str(tmp_path / "p.json"), "--rerun"])
    assert out["rerun"] is True
    for run in out["runs"]["A"]:
        assert run["seconds"]["decode"]["apply_lora_group_rerun"] > 0
    for run in out["runs"]["B"]:
        assert all(run["seconds"][k]["apply_lora_group_rerun"] == 0 for k in offline_profile.KINDS)

    timers = offline_profile.Timers()
    calls = []

    def lora_group(y, x, *rest):  # stands for the kernel set's: adds 1 where it runs
        calls.append(y)
        y += 1

    wrapped = offline_profile._with_rerun(timers.wrap("apply_lora_group", lora_group), lora_group, timers)
    y = torch.zeros(2, 3)
    wrapped(y, torch.ones(2, 4))
    assert torch.equal(y, torch.ones(2, 3))  # the step's output took the call once, not twice
    assert len(calls) == 2 and calls[1] is not y
    seconds = timers.take()["decode"]
    assert seconds["apply_lora_group"] > 0 and seconds["apply_lora_group_rerun"] > 0


def test_without_rerun_no_call_is_made_twice(result):
    assert result["rerun"] is False
    for label in "AB":
        for run in result["runs"][label]:
            assert all(run["seconds"][k]["apply_lora_group_rerun"] == 0 for k in offline_profile.KINDS)
