"""The one entry point of the end-to-end benchmark (issue 7).

    .venv/bin/python benchmarks/e2e/run.py --quick          # < 10 minutes on the 2-core CPU machine
    .venv/bin/python benchmarks/e2e/run.py --full           # larger trace, 1000 adapters touched more
    .venv/bin/python benchmarks/e2e/run.py --tiny           # a smoke run in about a minute
    .venv/bin/python benchmarks/e2e/run.py --quick --gpu    # CUDA, bf16, random Qwen2.5-1.5B-shaped model

One run: the roofline, then offline and online runs of (a) loraplex with the trace's adapters, (b)
transformers + PEFT (static batches, mixed adapter_names), (c) transformers base model (the better of
static batches and its continuous batching), (d) loraplex without adapters, on the same requests; greedy
outputs compared before times; decode at batch 64 against the compute ceiling; the adapter-scaling sweep.
Writes JSON (--out) and a PNG of the scaling curve beside it, and prints a table. The JSON is rewritten
after each part (offline, online, decode, scaling) with "complete": false and the parts done so far, so a
run stopped midway keeps what it measured; the last write sets "complete": true.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1]
if str(_BENCH) not in sys.path:  # traces, roofline and decode_step live one folder up
    sys.path.insert(0, str(_BENCH))

import torch  # noqa: E402

import traces as T  # noqa: E402
from e2e.ceiling import decode_share, measure_ceilings  # noqa: E402
from e2e.offline import ModeResult, Systems, adapter_pair_losses, interleaved, repeats, run_offline  # noqa: E402
from e2e.online import run_online  # noqa: E402
from e2e.plot import plot_scaling  # noqa: E402
from e2e.scaling import ScalingPoint, run_scaling  # noqa: E402
from e2e.systems import HFContinuousBatching, HFStaticBatches, LoraplexSystem  # noqa: E402
from e2e.targets import FloorLoss, adapter_extra_by_phase, decode_checks, floor_loss, matmul_floor_s, \
    offline_checks, online_checks, print_checks, scaling_checks, step_roofline  # noqa: E402
from e2e.workload import BenchRequest, adapter_rank, ensure_adapters, requests_from_trace, used_adapters  # noqa: E402
from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine import EngineCore  # noqa: E402

MiB = 1 << 20


@dataclass(frozen=True)
class Preset:
    """Everything a run's size depends on."""

    requests: int  # of the main trace (offline and online use the same requests)
    prompt_median: float
    prompt_max: int
    output_median: float
    output_max: int
    num_adapters: int  # popularity law of the main trace (only adapters some request names are built)
    peft_batch: int  # static batch size of the transformers systems
    online_load: float  # online arrival rate as a share of loraplex's offline request rate
    ttft_target_s: float
    scaling_counts: tuple[int, ...]
    scaling_requests: int
    host_cache_mib: float  # of the scaling runs: small enough that the adapters outgrow it
    pool_mib: float  # of the main loraplex engine (holds a decode batch of 64 with its adapters)
    scaling_pool_mib: float  # of the scaling engines: small enough that the adapters outgrow it
    decode_batch: int
    decode_steps: int
    continuous_batching: bool  # run transformers' continuous batching as a (c) candidate
    sample: int = 16  # requests whose outputs are compared
    prefix_tokens: int = 16
    scaling_repeats: int = 1  # sweeps, in alternating order (scaling.py): a drifting CPU speed cancels out
    adapter_blocks: int = 1  # offline blocks A B B A of loraplex with (A) and without (B) adapters
    # offline pairs of A and B stepped in turn on an engine each (offline.serve_pairs_interleaved): where there
    # are any, the adapters' loss is theirs
    interleaved_pairs: int = 0


PRESETS = {
    "tiny": Preset(8, 16, 48, 6, 12, 4, 4, 0.5, 2.0, (1, 4, 16), 8, 64, 512, 256, 8, 2, True, 8, 6, 2,
                   interleaved_pairs=1),
    # online_load 0.7: the online runs last as long as their arrivals (48 / rate), which keeps quick under 10 min
    # scaling: mirrored sweeps of 32 requests (one of 64 before): a drifting CPU speed cancels out
    # decode_steps 8 (3 before): the fastest of 3 steps read 127 ms on a shared AMD EPYC where the same step
    # measured 74 ms minutes earlier; each step costs ~0.1 s more
    # scaling_repeats 4 (2 before; scaling.py takes the median): one disturbed run in a pair moved a point by 20%
    # adapter_blocks 2 (1 before): on an Intel Xeon the same offline run took 5.3 to 8.3 s within minutes, and
    # the loss from one block (two pairs) read 0.22 where six pairs' median read 0.09 (RESULTS.md)
    # interleaved_pairs 3 and adapter_blocks 1 (2 before): on an AMD EPYC pairs side by side in time read the
    # loss at 0.017-0.142, stepped in turn at 0.070-0.095 (RESULTS.md, twenty-seventh session); a pair costs two
    # offline runs (about 15 s there), and the run took 610 s with two blocks and three pairs
    "quick": Preset(48, 64, 256, 24, 48, 100, 16, 0.7, 2.0, (1, 10, 100, 1000), 32, 160, 2048, 1024, 64, 8, True,
                    scaling_repeats=4, adapter_blocks=1, interleaved_pairs=3),
    # full: scaling_repeats 2 (1 before): one sweep on an Intel Xeon ran 1000 adapters faster than 1 (181.6 against
    # 191.7 s, RESULTS.md, twenty-sixth session); a mirrored pair cancels a drift and halves a lone disturbance
    # full: adapter_blocks 1 (2 before) beside 2 pairs stepped in turn, which carry the loss: two runs more in all
    "full": Preset(192, 128, 1024, 64, 256, 100, 32, 0.5, 2.0, (1, 10, 100, 1000), 512, 320, 3072, 1024, 64, 6,
                   True, 32, 32, scaling_repeats=2, adapter_blocks=1, interleaved_pairs=2),
}


def trace_spec(p: Preset, seed: int, num_adapters: int, requests: int) -> T.TraceSpec:
    """A chat-like trace (bursty gamma arrivals, rate 1/s) long enough for `requests` requests."""
    return T.TraceSpec(rate=1.0, duration_s=3.0 * requests + 30, arrivals="gamma", cv=2.0, lengths="chat",
                       prompt_median=p.prompt_median, prompt_max=p.prompt_max, output_median=p.output_median,
                       output_max=p.output_max, num_adapters=num_adapters, alpha=1.0, ranks=(8, 16),
                       tenants=(T.TenantSpec("all", 1.0, p.ttft_target_s * 1e3),), seed=seed)


def engine_config(p: Preset, model: str, device: torch.device, dtype_name: str) -> EngineConfig:
    """The main loraplex engine's config (offline_profile.py builds the same engine)."""
    return EngineConfig(model=model, dtype=dtype_name, device=device.type, pool_bytes=int(p.pool_mib * MiB),
                        max_lora_rank=64, kernels="auto")


def scaling_engine_config(p: Preset, main: EngineConfig) -> EngineConfig:
    """The scaling engines' config: the main engine's, with the preset's scaling pool, small enough that the
    adapters outgrow it (scaling_profile.py builds the same engines)."""
    return dataclasses.replace(main, pool_bytes=int(p.scaling_pool_mib * MiB))


def main_requests(p: Preset, seed: int, engine: EngineCore) -> tuple[list[T.TraceRequest], list[BenchRequest]]:
    """The main trace and its requests (offline and online serve the same ones), clipped to the engine's length."""
    trace = T.generate(trace_spec(p, seed, p.num_adapters, p.requests))[: p.requests]
    return trace, requests_from_trace(trace, engine.model_config.vocab_size, seed, max_len=engine.max_model_len)


def load_hf(path: Path, dtype: torch.dtype, device: torch.device, adapters: dict[str, Path]):
    """(base model, PEFT model holding every adapter), both eval, on device."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    names = list(adapters)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device),
                                     adapters[names[0]], adapter_name=names[0])
    for n in names[1:]:
        peft.load_adapter(adapters[n], adapter_name=n)
    return base, peft.eval()


def print_step_rooflines(rooflines: dict) -> None:
    """Where each loraplex run's time goes against its steps' floors (targets.step_roofline)."""
    if not rooflines:
        return
    print("\n| run | prefill steps: s (floor s) | decode steps: s (floor s) |\n|---|---|---|")
    for name, r in rooflines.items():
        print(f"| {name} | {r.prefill_steps}: {r.prefill_s:.2f} ({r.prefill_floor_s:.2f}) | "
              f"{r.decode_steps}: {r.decode_s:.2f} ({r.decode_floor_s:.2f}) |")


def adapter_loss(offline: ModeResult, requests: list, cfg, ceilings, itemsize: int) -> FloorLoss:
    """The adapters' loss against the floor's prediction: from the pairs stepped in turn where there are any (the
    A B B A pairs' losses beside them), else from the A B B A pairs, each compared within a minute or two."""
    runs, a, b = offline.runs, "loraplex", "loraplex-no-adapters"
    block_losses = adapter_pair_losses(runs, a, b)
    if stepped := interleaved(runs, a):
        return floor_loss(stepped[0], [r.wall_s for r in interleaved(runs, b)],
                          adapter_pair_losses(runs, a, b, stepped_in_turn=True), requests, cfg, ceilings, itemsize,
                          "stepped in turn", block_losses)
    return floor_loss(runs[a], [r.wall_s for r in repeats(runs, b)], block_losses, requests, cfg, ceilings, itemsize)


def print_phases(phases: list) -> None:
    """Where the adapters' extra time goes (targets.adapter_extra_by_phase)."""
    print("\n| adapters' extra, stepped in turn | steps | measured s | floor s (bytes + FLOPs) | / floor |\n"
          "|---|---|---|---|---|")
    for x in phases:
        ratio = f"{x.measured_s / x.floor_s:.2f}" if x.floor_s > 0 else "-"
        print(f"| {x.phase} | {x.steps} | {x.measured_s:.3f} | {x.floor_s:.3f} ({x.floor_bytes_s:.3f} + "
              f"{x.floor_flops_s:.3f}) | {ratio} |")


def write_result(result: dict, checks: list, out: Path, t_start: float, parts: list[str], complete: bool) -> None:
    """The JSON as it stands: written after each part, so that a run stopped later (the full run takes hours)
    keeps what it measured. `complete` is false until the last part is done; written to a temporary file
    and renamed over `out`, so a stop during the write leaves the previous version whole."""
    result["parts_done"] = list(parts)
    result["complete"] = complete
    result["targets"] = [c.as_dict() for c in checks]
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)


def run_part(name: str, part, result: dict, log) -> None:
    """Run one optional part (online, decode, scaling); an exception in it is logged and recorded under
    result["errors"] and the next part still runs: on a lent GPU the whole benchmark is one call, and a
    failure late in it should not cost the parts that work. `complete` then stays false. Its wall time goes
    into result["part_s"] either way."""
    t0 = time.perf_counter()
    try:
        part()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON and the exit status
        import traceback

        traceback.print_exc()
        log(f"{name}: FAILED {type(e).__name__}: {e}")
        result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
    finally:
        record_part(result, name, time.perf_counter() - t0, log)


def record_part(result: dict, name: str, seconds: float, log) -> None:
    """A part's wall time (setup, offline, online, decode, scaling) into result["part_s"], logged: the quick
    run's bound (under 10 minutes) is checked against these."""
    result.setdefault("part_s", {})[name] = round(seconds, 1)
    log(f"{name}: {seconds:.1f} s")


def print_mode(r: ModeResult) -> None:
    print(f"\n{r.mode}: | system | req/s | out tok/s | TTFT p50 s | TTFT p99 s | ITL p99 s | SLO att. | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in r.metrics.items():
        print(f"| {name} | {m.throughput_rps:.3f} | {m.throughput_tok_s:.1f} | {m.ttft_p50_s:.2f} | "
              f"{m.ttft_p99_s:.2f} | {m.itl_p99_s:.3f} | {m.slo_attainment:.2f} | {m.wall_s:.1f} |")
    for name, run in r.typical.items():
        print(f"  {name} stands by its median run, {run}")
    for x in r.matches:
        print(f"  outputs {x.a} vs {x.b}: {x.exact_prefix_share:.2f} of {x.sampled} requests identical over the "
              f"first {x.prefix_tokens} tokens; mean leading agreement {x.leading_agreement:.2f}")


def print_scaling(points: list[ScalingPoint]) -> None:
    # joined: requests whose adapter was already loading for another (the feed prefetches on arrival)
    print("\n| adapters | used | req/s | relative | predicted | loss ratio | host hits/joined/misses/evict | "
          "host loads s (floor s) | pool loads/evict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in points:
        ratio = "-" if p.loss_ratio is None else f"{p.loss_ratio:.2f}"
        hc = p.host_cache
        print(f"| {p.adapters} | {p.distinct_used} | {p.throughput_rps:.3f} | {p.relative_throughput:.3f} | "
              f"{1 - (p.predicted_loss or 0):.3f} | {ratio} | {hc['hits']}/{hc['joined']}/{hc['misses']}/{hc['evictions']} | "
              f"{p.host_load_s:.3f} ({p.host_load_floor_s or 0:.3f}) | {p.pool_loads}/{p.pool_evictions} |")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    for name in PRESETS:
        size.add_argument(f"--{name}", dest="preset", action="store_const", const=name)
    ap.add_argument("--gpu", action="store_true", help="CUDA, bfloat16, a random model of Qwen2.5-1.5B's shape")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the default model; --gpu: built)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every system")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["online", "decode", "scaling", "cb"],
                    help="parts to leave out (cb: transformers' continuous batching)")
    ap.add_argument("--work-dir", type=Path, default=None, help="adapters are written here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/e2e_<preset>.json)")
    ap.add_argument("--host-cache-mib", type=float, default=None, help="override the preset's scaling host cache")
    ap.add_argument("--scaling-pool-mib", type=float, default=None, help="override the preset's scaling pool")
    ap.add_argument("--scaling-repeats", type=int, default=None, help="override the preset's scaling sweeps")
    args = ap.parse_args(argv)
    preset_name = args.preset or "quick"
    p = PRESETS[preset_name]
    if args.host_cache_mib is not None:
        p = dataclasses.replace(p, host_cache_mib=args.host_cache_mib)
    if args.scaling_pool_mib is not None:
        p = dataclasses.replace(p, scaling_pool_mib=args.scaling_pool_mib)
    if args.scaling_repeats is not None:
        p = dataclasses.replace(p, scaling_repeats=args.scaling_repeats)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or _BENCH / "results" / f"e2e_{preset_name}{'_gpu' if args.gpu else ''}.json"
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="lp-e2e-"))
    device = torch.device("cuda" if args.gpu else "cpu")
    dtype_name = "bfloat16" if args.gpu else "float32"
    dtype = getattr(torch, dtype_name)
    model = args.model
    if args.gpu and model is None:
        from e2e.gpu_model import make_qwen25_15b_shape
        model = str(make_qwen25_15b_shape(work / "qwen25-1.5b-shape"))
    model = model or "default"
    t_start = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    log("roofline...")
    tiny = preset_name == "tiny"  # a smoke run: a rough roofline is enough
    ceilings = measure_ceilings(device, dtype, mib=64 if tiny else 512, reps=2 if tiny else 5,
                                n=1024 if tiny else 2048)
    econf = engine_config(p, model, device, dtype_name)
    engine = EngineCore(econf)
    # Pairs stepped in turn need the no-adapter runs on an engine of their own: the same config, the same adapters
    # loaded (so the same pages left for the KV cache and the same steps), the weights loaded again.
    engine_b = EngineCore(econf) if p.interleaved_pairs else engine
    cfg = engine.model_config
    trace, requests = main_requests(p, args.seed, engine)
    adapters = ensure_adapters(work / "adapters", cfg, used_adapters(requests), args.seed)
    for name, path in adapters.items():
        for e in [engine] if engine_b is engine else [engine, engine_b]:
            e.load_adapter(name, path)
    hf_base, hf_peft = load_hf(engine.model_path, dtype, device, adapters)
    base_candidates = [HFStaticBatches("transformers-static", hf_base, p.peft_batch, use_adapters=False)]
    if p.continuous_batching and "cb" not in args.skip:
        base_candidates.append(HFContinuousBatching("transformers-continuous", hf_base))
    systems = Systems(loraplex=LoraplexSystem("loraplex", engine, True),
                      peft=HFStaticBatches("peft-static", hf_peft, p.peft_batch, use_adapters=True),
                      base_candidates=base_candidates,
                      loraplex_base=LoraplexSystem("loraplex-no-adapters", engine_b, False))

    setup_s = time.perf_counter() - t_start  # roofline, engine, adapters, transformers' models
    log(f"offline: {len(requests)} requests, {len(adapters)} distinct adapters...")
    t_offline = time.perf_counter()
    offline = run_offline(systems, requests, p.sample, p.prefix_tokens, log, p.adapter_blocks, p.interleaved_pairs)
    offline_s = time.perf_counter() - t_offline
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "preset": preset_name, "preset_values": dataclasses.asdict(p),
        "device": str(device), "dtype": dtype_name, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model": str(engine.model_path), "ceilings": ceilings.as_dict(), "trace": T.describe(trace),
        "distinct_adapters": len(adapters), "pool_bytes": int(p.pool_mib * MiB),
        "notes": ["static batches run to the longest output of the batch; each request is credited with its "
                  "own output_tokens tokens and their times",
                  "(c) is the better of the candidates by offline output tok/s; online replays only that one",
                  "offline, loraplex with and without adapters run in blocks A B B A; each stands by its median "
                  "run (the slower middle one of an even count: offline.typical) in the targets",
                  "offline, runs named name~i: the i-th pair of loraplex with and without adapters stepped in turn, "
                  "each on its own engine, each wall the time of its own steps; where there are any, the adapters' "
                  "loss is the median of these pairs' (offline.adapter_extra_by_phase: where it goes)"],
        "offline": offline.as_dict(),
    }
    record_part(result, "setup", setup_s, log)
    record_part(result, "offline", offline_s, log)
    print_mode(offline)
    rooflines = {name: r for name, run in offline.typical.items()
                 if (r := step_roofline(offline.runs[run], cfg, ceilings, dtype.itemsize)) is not None}
    result["offline"]["step_roofline"] = {name: r.as_dict() for name, r in rooflines.items()}
    print_step_rooflines(rooflines)
    loss = adapter_loss(offline, requests, cfg, ceilings, dtype.itemsize)
    phases = adapter_extra_by_phase(interleaved(offline.runs, "loraplex"),
                                    interleaved(offline.runs, "loraplex-no-adapters"), requests, cfg, ceilings,
                                    dtype.itemsize)
    if phases is not None:
        result["offline"]["adapter_extra_by_phase"] = [x.as_dict() for x in phases]
        print_phases(phases)
    checks = offline_checks(offline.headline, offline.base_choice, loss, matmul_floor_s(requests, cfg, ceilings),
                            rooflines["loraplex"].floor_s if "loraplex" in rooflines else None)
    parts = ["offline"]
    write_result(result, checks, out, t_start, parts, complete=False)
    def online_part() -> None:
        rate = p.online_load * offline.headline["loraplex"].throughput_rps
        log(f"online: {rate:.3f} req/s ({p.online_load} x loraplex's offline rate), TTFT target "
            f"{p.ttft_target_s} s...")
        online = run_online(systems, requests, rate, p.ttft_target_s, offline.base_choice, p.sample,
                            p.prefix_tokens, log)
        result["online"] = {"rate_rps": rate, **online.as_dict()}
        print_mode(online)
        checks.extend(online_checks(online.metrics))
        parts.append("online")
        write_result(result, checks, out, t_start, parts, complete=False)

    if "online" not in args.skip:
        run_part("online", online_part, result, log)
    # the transformers models' and the second engine's memory go before decode and scaling
    hf_base = hf_peft = systems = engine_b = None

    def decode_part() -> None:
        log(f"decode at batch {p.decode_batch}...")
        ranks = {n: adapter_rank(n) for n in adapters}
        n = 1024 if tiny else 2048
        shares = [decode_share(engine, ceilings, [None], ranks, p.decode_batch, steps=p.decode_steps, matmul_n=n),
                  decode_share(engine, ceilings, list(adapters), ranks, p.decode_batch, steps=p.decode_steps,
                               matmul_n=n)]
        result["decode"] = [s.as_dict() for s in shares]
        checks.extend(decode_checks(shares[:1]))  # the target is on the decode step itself (no adapters)
        parts.append("decode")
        write_result(result, checks, out, t_start, parts, complete=False)
        for s in shares:
            print(f"\ndecode B={s.batch} ctx={s.context} adapters {s.adapters}: {s.step_s * 1e3:.1f} ms/step, "
                  f"{s.tokens_per_s:.0f} tok/s, {s.achieved_gflops:.0f} GFLOP/s = "
                  f"{s.share_of_compute_ceiling:.2f} of the {s.ceiling_gflops:.0f} GFLOP/s measured beside the steps "
                  f"(the run's opening roofline: {s.run_ceiling_gflops:.0f})")

    if "decode" not in args.skip:
        run_part("decode", decode_part, result, log)
    engine = None  # its pool and weights go before the scaling engines are built

    def scaling_part() -> None:
        # A GPU's steps leave the CPU free for loads beside them; on the CPU they share its cores (scaling.py).
        prefetch_loads = args.gpu
        loads = "prefetch thread" if prefetch_loads else "engine thread"
        log(f"scaling: {p.scaling_counts} adapters x {p.scaling_repeats}, {p.scaling_requests} requests, host cache "
            f"{p.host_cache_mib} MiB, pool {p.scaling_pool_mib} MiB, loads on the {loads}...")
        spec = trace_spec(p, args.seed, 1, p.scaling_requests)
        points = run_scaling(scaling_engine_config(p, econf), spec,
                             p.scaling_counts, p.scaling_requests, work / "adapters", ceilings,
                             int(p.host_cache_mib * MiB), args.seed, log, p.scaling_repeats, prefetch_loads)
        result["scaling"] = {"host_cache_bytes": int(p.host_cache_mib * MiB),
                             "pool_bytes": int(p.scaling_pool_mib * MiB),
                             "adapter_loads": loads,
                             "points": [pt.as_dict() for pt in points]}
        print_scaling(points)
        checks.extend(scaling_checks(points))
        png = out.with_suffix(".png")
        plot_scaling(points, png, f"loraplex adapter scaling ({preset_name}, {device.type}, {dtype_name}; host "
                                  f"cache {p.host_cache_mib} MiB, pool {p.scaling_pool_mib} MiB)")
        result["scaling"]["plot"] = str(png)
        parts.append("scaling")

    if "scaling" not in args.skip:
        run_part("scaling", scaling_part, result, log)
    print_checks(checks)
    write_result(result, checks, out, t_start, parts, complete="errors" not in result)
    by_buffer = ceilings.read_gbps_by_buffer
    print(f"\nroofline: read {ceilings.read_gbps:.1f} GB/s"
          + (f" (the median of {len(by_buffer)} buffers: {', '.join(f'{x:.1f}' for x in by_buffer)})" if by_buffer
             else "") + f", copy {ceilings.copy_gbps:.1f} GB/s, matmul "
          f"{ceilings.matmul_gflops:.0f} GFLOP/s ({ceilings.dtype}, {ceilings.threads} threads; by backend: "
          f"{', '.join(f'{k} {v:.0f}' for k, v in ceilings.matmul_by_backend.items()) or '-'})"
          + (f"; host read {ceilings.host_read_gbps:.1f} GB/s, host to device {ceilings.h2d_gbps:.1f} GB/s"
             if ceilings.h2d_gbps is not None else "") + "; "
          f"{result['elapsed_s']} s in all; wrote {out}")
    return result


if __name__ == "__main__":
    raise SystemExit(1 if "errors" in main() else 0)
