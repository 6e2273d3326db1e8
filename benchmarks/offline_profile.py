"""Where an offline run's time goes inside the engine's steps: each kind of call, with adapters and without.

The e2e harness (e2e/run.py) gives an offline run's wall and the adapters' loss against the floor; this splits
them by what the model calls. The e2e preset's trace (its requests all at once, as the offline part serves them)
runs on one engine with its adapters (A) and without (B), in rounds A B B A ..., and the calls are timed where the
engine makes them (wall seconds of the calling thread, the kernels' own threads inside them):
- gemm: the packed projections without LoRA, the LM head among them;
- gemm_lora: the projections with the prefill LoRA in the GEMM (cpu_lora_gemm.linear_lora: the shrink of each chunk
  of rows and the expand in the epilogue, one C++ call, so the shrink is not timed apart; cpu_lora_prefill_bench.py
  --paths shrink times it alone);
- apply_lora_group: the LoRA of decode tokens and short prefill segments (the kernel set's);
- paged_attention, write_kv; rms_norm, add_rms_norm, rope, swiglu (the model's pointwise ops);
- step: EngineCore.step as a whole; other: step minus the calls above (scheduling, sampling, Python);
- apply_lora_group_rerun (with --rerun): each apply_lora_group call made again at once on a copy of its output,
  its adapter rows now in cache: what the call costs warm, beside what it cost where the step made it. The copies
  fall in other, and the reruns lengthen the walls, so with --rerun A's wall is not B's to compare.
Each is split by step kind: prefill (a step holding a prompt chunk, with or without decode tokens) and decode.
Per run A and B the medians over rounds, and A minus B: where the adapters' extra time goes. With --baseline-source
OLD.cpp (an earlier kernels/cpu_linear.cpp), a run C with adapters whose prefill LoRA GEMMs come from that build
joins the rounds (A B C C B A ...), and A minus C says what the change did inside the engine's steps.

Sessions had written `/tmp` scripts of this kind again and again (RESULTS.md); this one keeps the split one
command.

    .venv/bin/python benchmarks/offline_profile.py [--preset quick] [--rounds 2] [--work-dir DIR] [--out F]
                                                   [--baseline-source OLD_cpu_linear.cpp] [--rerun]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

_BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH))

import torch  # noqa: E402

from e2e.run import PRESETS, engine_config, main_requests  # noqa: E402
from e2e.systems import LoraplexSystem  # noqa: E402
from e2e.workload import all_at_once, ensure_adapters, used_adapters  # noqa: E402
from loraplex.engine import EngineCore  # noqa: E402
from loraplex.kernels import cpu_lora_gemm  # noqa: E402
from loraplex.kernels.cpu_build import baseline_builds  # noqa: E402
from loraplex.models import llama  # noqa: E402

KINDS = ("prefill", "decode")
CALLS = ("gemm", "gemm_lora", "apply_lora_group", "apply_lora_group_rerun", "paged_attention", "write_kv",
         "rms_norm", "add_rms_norm", "rope", "swiglu")


class Timers:
    """Seconds per (step kind, call name) since the last reset; the kind is the step's being run."""

    def __init__(self) -> None:
        self.kind = "decode"
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.gemm_ext: ModuleType | None = None  # the cpu_linear build linear_lora runs (None: this checkout's)
        self.rerun = False  # each apply_lora_group call again at once, timed apart (--rerun)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[(self.kind, name)] += time.perf_counter() - t
        return timed

    def take(self) -> dict[str, dict[str, float]]:
        """The seconds by kind and call (every call named, 0 where none ran), other added; then reset."""
        out = {k: {c: self.seconds.get((k, c), 0.0) for c in (*CALLS, "step")} for k in KINDS}
        for k in KINDS:
            timed = sum(v for c, v in out[k].items() if c != "step")
            out[k]["other"] = out[k]["step"] - timed
        self.seconds.clear()
        return out


@contextmanager
def _over(obj, name: str, value) -> Iterator[None]:
    """obj.name is value while inside; afterwards what it was: the attribute set back, or, where it came from
    the class (a method), the instance's own removed."""
    own = name in vars(obj)
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, before)
        else:
            delattr(obj, name)


@contextmanager
def timed_engine(engine: EngineCore, timers: Timers) -> Iterator[None]:
    """The engine's calls timed into timers while inside; everything as it was afterwards."""
    ops = engine.runner.ops
    model = engine.model
    pw = ops.pointwise or model.pointwise
    timed_pw = dataclasses.replace(pw, **{n: timers.wrap(n, getattr(pw, n))
                                          for n in ("rms_norm", "add_rms_norm", "rope", "swiglu")})
    timed_ops = dataclasses.replace(ops, pointwise=timed_pw,
                                    **{n: timers.wrap(n, getattr(ops, n))
                                       for n in ("apply_lora_group", "paged_attention", "write_kv")})
    if timers.rerun:
        timed_ops = dataclasses.replace(timed_ops, apply_lora_group=_with_rerun(timed_ops.apply_lora_group,
                                                                                ops.apply_lora_group, timers))
    forward = model.forward

    def forward_of_kind(step, *args, **kwargs):
        # A prefill step runs more tokens than it samples (its prompt chunks); a decode step one per request.
        timers.kind = "prefill" if step.input_ids.shape[0] > step.logits_index.shape[0] else "decode"
        return forward(step, *args, **kwargs)

    step = engine.step
    linear_lora = cpu_lora_gemm.linear_lora

    def gemm_lora(*args):
        return linear_lora(*args, ext=timers.gemm_ext)

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:  # the kind of the step just run, set by its forward
            timers.seconds[(timers.kind, "step")] += time.perf_counter() - t

    with _over(engine.runner, "ops", timed_ops), _over(model, "forward", forward_of_kind), \
            _over(engine, "step", timed_step), _over(llama, "linear", timers.wrap("gemm", llama.linear)), \
            _over(cpu_lora_gemm, "linear_lora", timers.wrap("gemm_lora", gemm_lora)):
        yield


def _with_rerun(timed: Callable, plain: Callable, timers: Timers) -> Callable:
    """apply_lora_group as the step makes it (timed), then again at once on a copy of y, timed apart as
    apply_lora_group_rerun: the adapter rows the first call brought into cache are still there."""
    def call(y, x, *rest):
        timed(y, x, *rest)
        again = y.clone()
        t = time.perf_counter()
        plain(again, x, *rest)
        timers.seconds[(timers.kind, "apply_lora_group_rerun")] += time.perf_counter() - t
    return call


def _medians(runs: list[dict]) -> dict[str, dict[str, float]]:
    return {k: {c: statistics.median(r["seconds"][k][c] for r in runs) for c in runs[0]["seconds"][k]} for k in KINDS}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--model", default="default", help="a checkpoint folder (default: the packaged default model)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of A B (alternating order: A B B A ...)")
    ap.add_argument("--seed", type=int, default=0, help="the trace's (the e2e harness's default)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/lp-offline-profile"),
                    help="where the trace's adapters are written (reused across runs)")
    ap.add_argument("--out", type=Path, default=_BENCH / "results" / "offline_profile.json")
    ap.add_argument("--rerun", action="store_true",
                    help="time each apply_lora_group call again at once, its adapter rows in cache (then A's wall "
                         "and B's are not to be compared)")
    ap.add_argument("--baseline-source", type=Path, default=None,
                    help="an earlier kernels/cpu_linear.cpp: run C, with adapters, takes its prefill LoRA GEMMs")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    p = PRESETS[args.preset]
    engine = EngineCore(engine_config(p, args.model, torch.device("cpu"), "float32"))
    requests = all_at_once(main_requests(p, args.seed, engine)[1])
    for name, path in ensure_adapters(args.work_dir / "adapters", engine.model_config, used_adapters(requests),
                                      args.seed).items():
        engine.load_adapter(name, path)
    systems = {"A": LoraplexSystem("with-adapters", engine, True), "B": LoraplexSystem("without", engine, False)}
    baseline = baseline_builds([args.baseline_source], "baseline_cpu_linear")["baseline"] if args.baseline_source \
        else None
    if baseline is not None:
        systems["C"] = LoraplexSystem("with-adapters-baseline", engine, True)
    timers = Timers()
    timers.rerun = args.rerun
    systems["A"].warmup()
    with timed_engine(engine, timers):
        for label, s in systems.items():  # a first untimed run each: the steps' buffers and the kernels' first calls
            timers.gemm_ext = baseline if label == "C" else None
            s.serve(requests)
    runs: dict[str, list[dict]] = {label: [] for label in systems}
    with timed_engine(engine, timers):
        for r in range(args.rounds):
            for label in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                timers.gemm_ext = baseline if label == "C" else None
                timers.take()
                result = systems[label].serve(requests)
                runs[label].append({"wall_s": result.wall_s, "steps": result.extra["steps"],
                                    "seconds": timers.take()})
                print(f"{label} round {r}: {result.wall_s:.2f} s", file=sys.stderr, flush=True)
    med = {label: _medians(rs) for label, rs in runs.items()}
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "preset": args.preset, "model": args.model, "rerun": args.rerun, "requests": len(requests),
           "distinct_adapters": len(used_adapters(requests)), "rounds": args.rounds, "runs": runs,
           "wall_s_median": {label: statistics.median(r["wall_s"] for r in rs) for label, rs in runs.items()},
           "median_s": med,
           "a_minus_b_s": {k: {c: med["A"][k][c] - med["B"][k][c] for c in med["A"][k]} for k in KINDS}}
    if baseline is not None:
        out["baseline_source"] = str(args.baseline_source)
        out["a_minus_c_s"] = {k: {c: med["A"][k][c] - med["C"][k][c] for c in med["A"][k]} for k in KINDS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    c_wall = f", with the baseline's GEMMs {out['wall_s_median']['C']:.2f} s" if baseline is not None else ""
    print(f"{len(requests)} requests, {out['distinct_adapters']} adapters, {args.rounds} rounds; wall median "
          f"with {out['wall_s_median']['A']:.2f} s, without {out['wall_s_median']['B']:.2f} s{c_wall}")
    c_head = " baseline (C), s | A - C, s |" if baseline is not None else ""
    print(f"| steps | call | with adapters (A), s | without (B), s | A - B, s |{c_head}")
    print("|---|---|---|---|---|" + ("---|---|" if baseline is not None else ""))
    for k in KINDS:
        for c in (*CALLS, "other", "step"):
            a, b = med["A"][k][c], med["B"][k][c]
            cc = med["C"][k][c] if baseline is not None else 0.0
            if a or b or cc:
                c_cols = f" {cc:.3f} | {a - cc:+.3f} |" if baseline is not None else ""
                print(f"| {k} | {c} | {a:.3f} | {b:.3f} | {a - b:+.3f} |{c_cols}")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
