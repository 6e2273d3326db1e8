"""The end-to-end benchmark harness (benchmarks/e2e) on a tiny random Llama: every system serves the same
requests, greedy outputs agree where they must, metrics and counters are sane, files are written."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from e2e import run as e2e_run  # noqa: E402
from e2e.ceiling import decode_flops_per_token, linear_params, request_matmul_flops  # noqa: E402
from e2e.offline import adapter_pair_losses, interleaved, interleaved_name, repeat_name, repeats, \
    typical_run  # noqa: E402
from e2e.online import at_rate  # noqa: E402
from e2e.systems import LoraplexSystem, OwnClock, RunResult, serve_interleaved  # noqa: E402
from e2e.targets import adapter_extra_by_phase  # noqa: E402
from e2e.workload import BenchRequest, adapter_elements, write_random_adapter  # noqa: E402
from factories import make_tiny_model  # noqa: E402
from loraplex.kernels import cpu_linear  # noqa: E402
from loraplex.lora.peft_loader import load_peft_adapter  # noqa: E402
from loraplex.models.config import load_model_config  # noqa: E402

SYSTEMS = {"loraplex", "peft-static", "transformers-static", "transformers-continuous", "loraplex-no-adapters"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=11)


@pytest.fixture(scope="module")
def result(tiny_model, tmp_path_factory) -> dict:
    """One --tiny run of the entry point on the tiny model (1 thread: on a shared 2-core machine two threads
    can stall). The host cache (0.4 MiB: about two of its adapters) is outgrown; it is smaller than the
    scaling pool, so adapters leave the pool when the host cache drops them (the bridge unloads them)."""
    work = tmp_path_factory.mktemp("e2e")
    threads = torch.get_num_threads()
    try:
        return e2e_run.main(["--tiny", "--model", str(tiny_model), "--work-dir", str(work), "--out",
                             str(work / "e2e.json"), "--host-cache-mib", "0.4", "--scaling-pool-mib", "1.5",
                             "--threads", "1"])
    finally:
        torch.set_num_threads(threads)


def test_written_adapter_is_a_valid_peft_adapter(tiny_model, tmp_path):
    cfg = load_model_config(tiny_model)
    a = load_peft_adapter("x", write_random_adapter(tmp_path / "x", cfg, 8, seed=1), cfg, 16)
    b = load_peft_adapter("y", write_random_adapter(tmp_path / "y", cfg, 8, seed=2), cfg, 16)
    assert a.max_rank == 8 and len(a.modules) == 7 * cfg.num_layers
    assert a.nbytes == adapter_elements(cfg, 8) * 4
    assert not torch.equal(a.modules[0].b, b.modules[0].b)  # distinct content per seed
    assert a.modules[0].b.abs().sum() > 0  # B is not PEFT's zero init: the adapter changes outputs


def test_every_system_serves_every_request_and_outputs_agree(result):
    off = result["offline"]
    # offline, loraplex with and without adapters run twice (A B B A), then once stepped in turn, for the
    # adapters' loss
    assert set(off["metrics"]) == SYSTEMS | {"loraplex#2", "loraplex-no-adapters#2", "loraplex~1",
                                             "loraplex-no-adapters~1"}
    n, tokens = result["trace"]["requests"], None
    assert n == e2e_run.PRESETS["tiny"].requests
    for name, m in off["metrics"].items():
        assert m["requests"] == n
        tokens = tokens or m["output_tokens"]
        assert m["output_tokens"] == tokens  # each request credited exactly its own output tokens
        assert m["throughput_rps"] == pytest.approx(n / m["wall_s"], rel=1e-2)
        assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"] <= m["wall_s"]
        assert 0 <= m["slo_attainment"] <= 1
    matches = {(x["a"], x["b"]): x for x in off["matches"]}
    # fp32 on a tiny model: ragged (ours) and left-padded (transformers) batches agree token for token.
    assert matches[("loraplex", "peft-static")]["exact_prefix_share"] == 1.0
    assert matches[("loraplex-no-adapters", "transformers-static")]["exact_prefix_share"] == 1.0
    assert matches[("loraplex-no-adapters", "transformers-continuous")]["exact_prefix_share"] == 1.0
    # ... and the adapters do change the outputs, so the first agreement is not vacuous.
    assert matches[("loraplex", "loraplex-no-adapters")]["exact_prefix_share"] < 1.0
    assert off["base_choice"] in ("transformers-static", "transformers-continuous")


def test_online_replays_arrivals_and_reports_slo(result):
    on = result["online"]
    assert on["rate_rps"] > 0
    assert set(on["metrics"]) == SYSTEMS - {"transformers-static", "transformers-continuous"} | {on["base_choice"]}
    for m in on["metrics"].values():
        assert m["slo_ttft_s"] == e2e_run.PRESETS["tiny"].ttft_target_s
        assert 0 <= m["slo_attainment"] <= 1 and m["ttft_p50_s"] > 0
        # arrivals are spread over time: the run lasts at least as long as the arrivals do
        assert m["wall_s"] >= (m["requests"] - 1) / on["rate_rps"] * 0.99
    assert {(x["a"], x["b"]): x for x in on["matches"]}[("loraplex", "peft-static")]["exact_prefix_share"] == 1.0


def test_decode_share_and_roofline(result):
    c = result["ceilings"]
    assert c["read_gbps"] > 0 and c["matmul_gflops"] > 0
    # The read rate stands for memory as allocated: the median over fresh buffers of each one's best pass.
    assert len(c["read_gbps_by_buffer"]) == 5 and c["read_gbps"] == statistics.median(c["read_gbps_by_buffer"])
    # The ceiling is the best GEMM here, not MKL's alone (roofline.py); the engine's packed kernel is one.
    rates = c["matmul_by_backend"]
    assert "mm" in rates and c["matmul_gflops"] == max(rates.values())
    assert "packed" in rates or not cpu_linear.available()
    base, lora = result["decode"]
    assert base["adapters"] == "none" and "distinct" in lora["adapters"]
    for d in (base, lora):
        assert d["tokens_per_s"] == pytest.approx(d["batch"] / d["step_s"])
        # Against the matmul rate measured beside the timed steps; the run's opening one is kept beside it.
        assert d["share_of_compute_ceiling"] == pytest.approx(d["achieved_gflops"] / d["ceiling_gflops"])
        assert d["ceiling_gflops"] > 0 and d["run_ceiling_gflops"] == c["matmul_gflops"]
        assert 0 < d["share_of_compute_ceiling"]
    assert lora["flops_per_token"] > base["flops_per_token"]


def test_scaling_outgrows_the_host_cache(result):
    s = result["scaling"]
    assert s["adapter_loads"] == "engine thread"  # the CPU's default (scaling.py)
    points = s["points"]
    assert [p["adapters"] for p in points] == list(e2e_run.PRESETS["tiny"].scaling_counts)
    assert points[0]["relative_throughput"] == 1.0 and points[0]["distinct_used"] == 1
    assert points[-1]["distinct_used"] > 2
    last = points[-1]
    hc = last["host_cache"]
    # every distinct adapter is loaded into the host cache at least once; it holds ~2, so some leave
    assert hc["misses"] >= last["distinct_used"] and hc["evictions"] > 0
    assert last["pool_loads"] >= last["distinct_used"]
    for p in points:
        assert p["predicted_loss"] >= 0 and p["step_adapter_bytes"] > 0
        # the host cache's loads, timed, beside the floor's price for their bytes (one pass at the read rate)
        host_bytes = p["load_bytes"] - p["pool_load_bytes"]
        assert p["host_load_s"] > 0 and p["host_load_floor_s"] == pytest.approx(
            host_bytes / (result["ceilings"]["read_gbps"] * 1e9))
        # two sweeps (the second in reverse order); the point is their mean
        assert len(p["walls"]) == 2 and p["wall_s"] == pytest.approx(sum(p["walls"]) / 2)
        assert p["throughput_rps"] == pytest.approx(e2e_run.PRESETS["tiny"].scaling_requests / p["wall_s"])
    assert Path(s["plot"]).stat().st_size > 1000  # a PNG was drawn
    written = json.loads(Path(s["plot"]).with_suffix(".json").read_text())
    assert written["scaling"]["points"] == points


def test_flops_per_token_and_at_rate(tiny_model):
    cfg = load_model_config(tiny_model)
    h, i, kv, L, V = 96, 200, 32, 3, 257  # the tiny Llama's shapes
    linear = L * (h * h + 2 * h * kv + h * h + 3 * h * i) + V * h
    assert linear_params(cfg) == linear
    assert decode_flops_per_token(cfg, 10, 0.0) == 2 * linear + 4 * L * 10 * h
    assert decode_flops_per_token(cfg, 10, 8.0) - decode_flops_per_token(cfg, 10, 0.0) == 2 * adapter_elements(cfg, 8)
    # A request's matmul floor: every token through the layers (and its LoRA), the LM head per output token.
    layers = linear - V * h
    assert request_matmul_flops(cfg, 7, 3) == 2 * (10 * layers + 3 * V * h)
    assert request_matmul_flops(cfg, 7, 3, 8) - request_matmul_flops(cfg, 7, 3) == 2 * 10 * adapter_elements(cfg, 8)
    reqs = [BenchRequest(f"r{k}", t, (3,), None, 1, 1.0) for k, t in enumerate([5.0, 5.5, 9.0])]
    scaled = at_rate(reqs, 4.0)
    assert [r.arrival_s for r in scaled] == pytest.approx([0.0, 0.0625, 0.5])  # 2 gaps in 0.5 s; shape kept


def test_targets_are_checked_on_the_run_figures(result):
    targets = {t["name"]: t for t in result["targets"]}
    m = result["offline"]["metrics"]
    # loraplex (and its no-adapter run) stand by their median run: of two, the slower one
    typical = result["offline"]["typical"]
    for name in ("loraplex", "loraplex-no-adapters"):
        runs = [name, name + "#2"]
        assert typical[name] == max(runs, key=lambda r: (m[r]["wall_s"], r))
    ours = m[typical["loraplex"]]
    peft = targets["offline output tok/s, loraplex / transformers+PEFT"]
    assert peft["measured"] == pytest.approx(ours["throughput_tok_s"] / m["peft-static"]["throughput_tok_s"])
    assert peft["bound"] == 10.0 and peft["met"] == (peft["measured"] >= 10.0)
    # The reachable ratio at the matmul floor is stated beside it (PEFT's time over the floor's).
    floor_s = float(peft["detail"].split("matmul floor ")[1].split(" s")[0])
    at_floor = float(peft["detail"].split("would be ")[1].split(";")[0])
    assert floor_s > 0 and at_floor == pytest.approx(m["peft-static"]["wall_s"] / floor_s, rel=0.02)
    # And at the roofline of loraplex's own steps: each step takes at least its weights' bytes over the read
    # bandwidth (float32 here), and all of them less than the run itself.
    steps_s = float(peft["detail"].split("whichever take longer) ")[1].split(" s")[0])
    at_steps = float(peft["detail"].rsplit("would be ", 1)[1])
    assert at_steps == pytest.approx(m["peft-static"]["wall_s"] / steps_s, rel=0.02)
    steps = result["offline"]["extra"][typical["loraplex"]]["steps"]
    cfg, c = load_model_config(result["model"]), result["ceilings"]
    assert steps_s >= steps * linear_params(cfg) * 4 / (c["read_gbps"] * 1e9) * 0.99
    assert steps_s < ours["wall_s"]
    # The same floors split by kind of step, beside the steps' walls, for both loraplex systems' median runs.
    for name in ("loraplex", "loraplex-no-adapters"):
        r = result["offline"]["step_roofline"][name]
        assert r["prefill_steps"] >= 1 and r["decode_steps"] >= 1
        assert r["prefill_steps"] + r["decode_steps"] == result["offline"]["extra"][typical[name]]["steps"]
        assert 0 < r["prefill_floor_s"] < r["prefill_s"] and 0 < r["decode_floor_s"] < r["decode_s"]
        assert r["prefill_s"] + r["decode_s"] <= m[typical[name]]["wall_s"]
    r = result["offline"]["step_roofline"]["loraplex"]
    assert r["prefill_floor_s"] + r["decode_floor_s"] == pytest.approx(steps_s, rel=0.01)
    loss = targets["loss against loraplex without adapters / the floor's predicted loss"]
    assert loss["bound"] == 1.3 and "predicted" in loss["detail"] and "stepped in turn" in loss["detail"]
    walls = {k: v["wall_s"] for k, v in m.items()}
    # tiny: one pair stepped in turn carries the measured loss; the A B B A pairs (one block) stand beside it
    stepped = 1 - walls["loraplex-no-adapters~1"] / walls["loraplex~1"]
    measured = float(loss["detail"].split("measured ")[1].split(" ")[0])
    assert measured == pytest.approx(stepped, abs=1e-3)
    pairs = [1 - walls["loraplex-no-adapters"] / walls["loraplex"],
             1 - walls["loraplex-no-adapters#2"] / walls["loraplex#2"]]
    side_by_side = loss["detail"].split("pairs side by side in time: ")[1]
    assert f"{pairs[0]:.3f}" in side_by_side and f"{pairs[1]:.3f}" in side_by_side
    # Where the adapters' extra time went, by kind of step: the pair took the same steps, every one of them in
    # one phase or the other, and the floor's share of each is priced from the bytes and FLOPs.
    phases = {x["phase"]: x for x in result["offline"]["adapter_extra_by_phase"]}
    assert set(phases) == {"prefill", "decode"}
    assert phases["prefill"]["steps"] + phases["decode"]["steps"] == result["offline"]["extra"]["loraplex~1"]["steps"]
    assert all(x["floor_bytes_s"] > 0 and x["floor_flops_s"] > 0 for x in phases.values())
    assert any(n.startswith("online p99 TTFT") for n in targets)
    decode = [t for n, t in targets.items() if n.startswith("decode B=")]
    assert len(decode) == 1 and decode[0]["measured"] == pytest.approx(result["decode"][0]["share_of_compute_ceiling"])
    for t in targets.values():
        assert t["met"] == (t["measured"] >= t["bound"] if t["at_least"] else t["measured"] <= t["bound"])


def test_a_repeated_system_stands_by_its_median_run_and_pairs_compare_neighbours():
    """Two blocks A B B A (the quick preset's): run names, the median run, the pairs' losses."""
    walls = {"A": [10.0, 14.0, 9.0, 11.0], "B": [8.0, 9.0, 12.0, 9.5]}
    runs = {repeat_name(name, i): RunResult(name, [], w) for name, ws in walls.items() for i, w in enumerate(ws, 1)}
    assert list(runs)[:4] == ["A", "A#2", "A#3", "A#4"]
    assert [r.wall_s for r in repeats(runs, "A")] == walls["A"] and repeats(runs, "C") == []
    assert typical_run(runs, "A") == "A#4"  # 9, 10, 11, 14: the slower middle one
    assert typical_run(runs, "B") == "B#4"  # 8, 9, 9.5 (the fourth run), 12
    assert typical_run({"A": RunResult("A", [], 3.0)}, "A") == "A"
    pairs = adapter_pair_losses(runs, "A", "B")
    assert pairs == pytest.approx([0.2, 1 - 9 / 14, 1 - 12 / 9, 1 - 9.5 / 11])


def test_own_clock_leaves_out_the_time_it_was_paused():
    clock = OwnClock()
    clock.pause()
    paused = clock.now()
    time.sleep(0.05)
    assert clock.now() == paused  # frozen while paused
    clock.resume()
    assert clock.now() < paused + 0.04
    with pytest.raises(AssertionError):
        clock.resume()


def test_adapter_extra_by_phase_from_pairs_stepped_in_turn(tiny_model):
    """Two pairs on given steps: one prefill step (4 prompt tokens, 2 sampled), then two decode steps; the
    measured extra is the median over the pairs of the phase's summed differences."""
    from e2e.ceiling import Ceilings

    cfg = load_model_config(tiny_model)
    steps = {"steps_tokens": [4, 2, 1], "steps_sampled": [2, 2, 1], "steps_adapters": [("a-r8",), ("a-r8",), ()]}
    run = lambda walls: RunResult("x", [], sum(walls), {**steps, "steps_s": walls})  # noqa: E731
    with_runs = [run([1.0, 0.5, 0.4]), run([1.2, 0.6, 0.4])]
    without = [run([0.9, 0.4, 0.4]), run([1.0, 0.4, 0.3])]
    reqs = [BenchRequest("r0", 0.0, (3, 4, 5), "a-r8", 2, 1.0), BenchRequest("r1", 0.0, (3,), None, 2, 1.0)]
    c = Ceilings("cpu", "float32", read_gbps=10.0, copy_gbps=10.0, matmul_gflops=100.0, threads=1)
    pre, dec = adapter_extra_by_phase(with_runs, without, reqs, cfg, c, 4)
    assert (pre.steps, dec.steps) == (1, 2)
    assert pre.measured_s == pytest.approx((0.1 + 0.2) / 2) and dec.measured_s == pytest.approx((0.1 + 0.3) / 2)
    per_token = 2.0 * adapter_elements(cfg, 8)
    assert pre.floor_flops_s == pytest.approx(3 * per_token / 100e9)  # r0's three prompt tokens
    assert dec.floor_flops_s == pytest.approx(1 * per_token / 100e9)  # r0's second output token
    one = adapter_elements(cfg, 8) * 4 / 10e9
    assert pre.floor_bytes_s == pytest.approx(one) and dec.floor_bytes_s == pytest.approx(one)
    # Pairs whose steps differ cannot be compared step by step.
    other = RunResult("x", [], 1.0, {**steps, "steps_tokens": [4, 3], "steps_s": [0.5, 0.5]})
    assert adapter_extra_by_phase([with_runs[0]], [other], reqs, cfg, c, 4) is None
    assert adapter_extra_by_phase([], [], reqs, cfg, c, 4) is None


def test_runs_stepped_in_turn_serve_what_they_serve_alone(tiny_model, tmp_path):
    """Two engines stepped in turn: each run's greedy tokens and steps are those of the same run alone (neither
    engine's batch took in the other's requests), and each wall counts its own steps only."""
    from loraplex.config import EngineConfig
    from loraplex.engine import EngineCore

    cfg = load_model_config(tiny_model)
    conf = EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", pool_bytes=1 << 23, max_lora_rank=8)
    engines = [EngineCore(conf), EngineCore(conf)]
    for e in engines:
        e.load_adapter("a-r8", write_random_adapter(tmp_path / "a", cfg, 8, seed=3))
    rng = torch.Generator().manual_seed(int(time.time()))
    reqs = [BenchRequest(f"r{k}", 0.0, tuple(int(t) for t in torch.randint(3, cfg.vocab_size, (n,), generator=rng)),
                         "a-r8" if k % 2 else None, m, 1.0) for k, (n, m) in enumerate([(9, 5), (4, 7), (13, 3)])]
    systems = [LoraplexSystem("with", engines[0], True), LoraplexSystem("without", engines[1], False)]
    alone = [s.serve(reqs) for s in systems]
    t0 = time.perf_counter()
    both = serve_interleaved([(s, reqs) for s in systems])
    elapsed = time.perf_counter() - t0
    for a, b in zip(alone, both):
        assert [r.token_ids for r in a.records] == [r.token_ids for r in b.records]
        assert a.extra["steps_tokens"] == b.extra["steps_tokens"]
        assert all(len(r.token_times) == r.output_tokens for r in b.records)
    assert [r.token_ids for r in both[0].records] != [r.token_ids for r in both[1].records]  # the adapter acted
    assert 0 < both[0].wall_s and 0 < both[1].wall_s and both[0].wall_s + both[1].wall_s <= elapsed
    # One engine for both would batch their requests together: refused before any request goes in.
    with pytest.raises(ValueError, match="an engine each"):
        serve_interleaved([(systems[0], reqs), (LoraplexSystem("again", engines[0], False), reqs)])
    assert not engines[0].has_unfinished()


def test_the_finished_run_is_written_complete(result):
    written = json.loads(Path(result["scaling"]["plot"]).with_suffix(".json").read_text())
    assert written["complete"] is True and written["parts_done"] == ["offline", "online", "decode", "scaling"]
    assert written["offline"] == result["offline"] and written["targets"] == result["targets"]
    # Each part's wall time (the quick run's bound is on the whole): they add up to the run, which also
    # writes the JSON and plots between them.
    parts = written["part_s"]
    assert list(parts) == ["setup", "offline", "online", "decode", "scaling"]
    assert all(s > 0 for s in parts.values()) and sum(parts.values()) <= written["elapsed_s"] + 0.5


def test_a_run_stopped_midway_keeps_the_parts_it_finished(tiny_model, tmp_path, monkeypatch):
    # The full run takes hours: a stop in its online part must not lose the offline part's figures.
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt("stopped during the online part")

    monkeypatch.setattr(e2e_run, "run_online", stopped)
    out = tmp_path / "e2e.json"
    out.write_text('{"from": "an earlier run"}')
    threads = torch.get_num_threads()
    try:
        with pytest.raises(KeyboardInterrupt):
            e2e_run.main(["--tiny", "--model", str(tiny_model), "--work-dir", str(tmp_path / "work"), "--out", str(out),
                          "--skip", "decode", "scaling", "cb", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    written = json.loads(out.read_text())
    assert written["complete"] is False and written["parts_done"] == ["offline"]
    assert {"loraplex", "peft-static", "loraplex-no-adapters"} <= set(written["offline"]["metrics"])
    assert any(t["name"].startswith("offline output tok/s") for t in written["targets"])
    assert "online" not in written and not out.with_name(out.name + ".tmp").exists()


def test_a_failing_part_is_recorded_and_the_next_part_runs():
    """On a lent GPU the benchmark is one call: a part that raises is logged and recorded under "errors"
    (the run then ends not complete, exit status 1), and the parts after it still run."""
    result: dict = {}
    logged: list[str] = []
    ran: list[str] = []

    def broken() -> None:
        raise ValueError("no such kernel")

    e2e_run.run_part("online", broken, result, logged.append)
    e2e_run.run_part("decode", lambda: ran.append("decode"), result, logged.append)
    assert result["errors"] == {"online": "ValueError: no such kernel"} and ran == ["decode"]
    assert list(result["part_s"]) == ["online", "decode"]  # the failed part's time too
    assert logged[0] == "online: FAILED ValueError: no such kernel"
    assert [line.split(":")[0] for line in logged[1:]] == ["online", "decode"]


def test_the_tiny_run_has_no_errors(result):
    assert "errors" not in result and result["complete"] is True


def test_the_floor_prices_loads_where_they_go():
    """On the CPU every extra byte is priced at the read bandwidth; on a GPU the step reads at the device's,
    host-cache loads at the host's and pool loads at the host-to-device rate."""
    from e2e.ceiling import Ceilings
    from e2e.scaling import ScalingPoint, extra_seconds, host_load_floor_seconds, with_predictions

    def point(step: int, load: int, pool: int, flops: float) -> ScalingPoint:
        return ScalingPoint(adapters=1, distinct_used=1, throughput_rps=1.0, throughput_tok_s=1.0, wall_s=1.0,
                            relative_throughput=1.0, host_cache={}, pool_loads=0, pool_evictions=0, pool_pages=0,
                            adapter_pages_at_end=0, step_adapter_bytes=step, load_bytes=load, lora_flops=flops,
                            pool_load_bytes=pool)

    ref, p = point(1e9, 2e9, 1e9, 1e9), point(5e9, 10e9, 4e9, 3e9)
    cpu = Ceilings("cpu", "float32", read_gbps=40.0, copy_gbps=30.0, matmul_gflops=500.0, threads=2)
    assert extra_seconds(p, ref, cpu) == pytest.approx((4e9 + 8e9) / 40e9 + 2e9 / 500e9)
    gpu = Ceilings("cuda", "bfloat16", read_gbps=4000.0, copy_gbps=4000.0, matmul_gflops=7e5, threads=16,
                   host_read_gbps=20.0, h2d_gbps=50.0)
    # host-cache load bytes: 6e9 - 1e9 = 5e9 more; pool load bytes 3e9 more
    assert extra_seconds(p, ref, gpu) == pytest.approx(4e9 / 4000e9 + 5e9 / 20e9 + 3e9 / 50e9 + 2e9 / 7e14)
    # the host-cache loads' own floor, which the scaling table prints beside their measured seconds
    assert host_load_floor_seconds(p, cpu) == pytest.approx(6e9 / 40e9)
    assert host_load_floor_seconds(p, gpu) == pytest.approx(6e9 / 20e9)
    assert [q.host_load_floor_s for q in with_predictions([ref, p], cpu)] == pytest.approx([1e9 / 40e9, 6e9 / 40e9])


def test_a_scaling_point_takes_the_median_of_its_runs_loads():
    from e2e.scaling import ScalingPoint, _median_point

    runs = [ScalingPoint(adapters=10, distinct_used=3, throughput_rps=4.0 / w, throughput_tok_s=40.0 / w, wall_s=w,
                         relative_throughput=1.0, host_cache={"misses": 3}, pool_loads=3, pool_evictions=0,
                         pool_pages=8, adapter_pages_at_end=3, step_adapter_bytes=1, load_bytes=1, lora_flops=1.0,
                         host_load_s=load) for w, load in ((2.0, 0.30), (1.0, 0.10), (4.0, 0.20))]
    point = _median_point(runs)
    assert point.wall_s == 2.0 and point.walls == [2.0, 1.0, 4.0] and point.host_load_s == 0.20
    assert point.throughput_rps == pytest.approx(2.0) and point.host_cache == {"misses": 3}
