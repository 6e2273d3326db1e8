"""The admission benchmark's flood run on the real engine (admission_bench.py --real-only --real-flood), end to
end on a tiny random Llama: the real-only capacity sweep, both real runs, the fairness figures, the target
check, the JSON and the table. The step cost given is far slower than the tiny model, so the short traces
(3 s of arrivals) are served well within their targets; the figures checked are the ones that must hold
whatever the machine's load: requests, which tenant's requests change, and the rises against their p99s."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import admission_bench as B  # noqa: E402
from factories import make_tiny_model  # noqa: E402
from loraplex.admission.sim_metrics import summarize  # noqa: E402
from loraplex.admission.simulate import OK, SimOutcome  # noqa: E402

WELL_BEHAVED = ("interactive", "standard")
COST = ("0.2", "0.001", "1e-6")  # capacity ~12 req/s on the small requests below: ~45 requests at 0.5x in 3 s


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    # Chat prompts are clipped at 2048 tokens: room for the longest with its output.
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=11, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> tuple[dict, str, Path]:
    out_path = tmp_path_factory.mktemp("admission") / "real.json"
    threads = torch.get_num_threads()
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            out = B.main(["--model", str(tiny_model), "--cost", *COST, "--real-only", "--real-flood",
                          "--real-duration", "3", "--prompt-median", "16", "--output-median", "8",
                          "--adapters", "8", "--ranks", "8", "16", "--out", str(out_path)])
    finally:
        torch.set_num_threads(threads)  # main() sets 1 (--threads)
    return out, stdout.getvalue(), out_path


def test_real_only_skips_the_simulation_and_writes_the_json(run):
    out, _, path = run
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    assert "grid" not in out and "fairness" not in out and "real" not in out
    rf = out["real_fairness"]
    assert rf["capacity_rps"] > 0  # from the short sweep with the given cost
    assert rf["cost"]["fixed_s"] == float(COST[0])
    assert rf["duration_s"] == 3.0 and rf["flood_tenant"] == "batch" and rf["flood"] == 10.0
    assert [(r["base_load"], r["mode"]) for r in rf["runs"]] == [(0.5, "early_abort_vtc")]


def test_both_runs_have_requests_and_only_the_flood_tenant_changes(run):
    r = run[0]["real_fairness"]["runs"][0]
    calm, flooded = r["requests"]
    assert 0 < calm < flooded
    by_tenant = r["requests_by_tenant"]
    assert sum(v[0] for v in by_tenant.values()) == calm and sum(v[1] for v in by_tenant.values()) == flooded
    for t in WELL_BEHAVED:
        assert by_tenant[t][0] == by_tenant[t][1] > 0  # identical requests with and without the flood
    assert by_tenant["batch"][1] > 2 * by_tenant["batch"][0]
    assert all(w > 0 for w in r["wall_s"])


def test_rises_follow_from_the_two_p99s(run):
    r = run[0]["real_fairness"]["runs"][0]
    assert set(r["well_behaved"]) == set(WELL_BEHAVED)
    eps = 5e-5  # the p99s are rounded to 4 digits, the rise is computed before rounding
    for v in r["well_behaved"].values():
        before, after = v["p99_ttft_s"]
        assert 0 < before and 0 < after  # every request is served: the cost's targets are seconds
        lo, hi = (after - eps) / (before + eps) - 1, (after + eps) / (before - eps) - 1
        assert lo - 1e-4 <= v["p99_rise"] <= hi + 1e-4
        assert all(0.0 <= a <= 1.0 for a in v["attainment"])
        assert v["mean_ttft_s"][0] <= before + eps and v["mean_ttft_s"][1] <= after + eps
    assert r["max_p99_rise"] == max(v["p99_rise"] for v in r["well_behaved"].values())
    assert 0.0 <= r["flood_tenant_attainment"] <= 1.0
    assert isinstance(r["simulated_max_p99_rise"], float)


def test_target_and_table(run):
    out, stdout, _ = run
    rise = out["real_fairness"]["runs"][0]["max_p99_rise"]
    verdict = out["targets"]["real engine, flood at 0.5x, early_abort_vtc: max p99 rise (<= +10%)"]
    assert verdict.endswith(": met" if rise <= 0.10 else ": NOT met")
    assert "real engine, flood at 0.5x" in stdout
    assert "Real engine, flood: tenant batch sends 10x its share" in stdout
    assert "| 0.5x | early_abort_vtc |" in stdout


def test_fairness_row_without_a_tenants_requests():
    """A short trace may hold no request of a tenant: no p99, so no rise, and no max rise."""
    def outcome(i: int, tenant: str, ttft: float) -> SimOutcome:
        return SimOutcome(f"r{i}", tenant, 0.0, 1.0, OK, ttft, ttft + 1.0, 8, 4)

    before = {"a": summarize([outcome(0, "a", 0.5)])}
    after = {"a": summarize([outcome(0, "a", 0.6)]), "b": summarize([outcome(1, "b", 0.1)])}
    row = B.fairness_row(before, after, ["a", "c"], "b")
    assert row["well_behaved"]["a"]["p99_rise"] == pytest.approx(0.2)
    assert row["well_behaved"]["c"] == {"p99_ttft_s": [None, None], "p99_rise": None, "mean_ttft_s": [None, None],
                                        "attainment": [0.0, 0.0]}
    assert row["max_p99_rise"] is None and row["flood_tenant_attainment"] == 1.0


def test_real_only_needs_a_real_run_and_keeps_the_simulation_json():
    with pytest.raises(SystemExit):
        B.parse_args(["--real-only"])
    assert B.parse_args([]).out.name == "admission_bench.json"
    assert B.parse_args(["--real-only", "--real-flood"]).out.name == "admission_bench_real.json"
