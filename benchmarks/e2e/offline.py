"""Offline mode: every request available at once; throughput. Also where outputs are checked to agree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .metrics import Metrics, OutputMatch, compare_outputs, summarize
from .systems import PER_STEP, RunResult, System
from .workload import BenchRequest, all_at_once, without_adapters


@dataclass
class Systems:
    """The four systems of the issue; (c) has candidates and the better one (offline) stands for it."""

    loraplex: System  # (a) with the requests' adapters
    peft: System  # (b) transformers + PEFT, static batches
    base_candidates: list[System]  # (c) transformers base model alone: static batches, continuous batching
    loraplex_base: System  # (d) no adapters


@dataclass
class ModeResult:
    mode: str
    runs: dict[str, RunResult]
    metrics: dict[str, Metrics]
    matches: list[OutputMatch]
    base_choice: str  # which (c) candidate stands for "transformers base model"

    def as_dict(self) -> dict:
        return {"mode": self.mode, "metrics": {k: m.as_dict() for k, m in self.metrics.items()},
                "matches": [m.as_dict() for m in self.matches], "base_choice": self.base_choice,
                "extra": {k: {x: y for x, y in r.extra.items() if x not in PER_STEP}
                          for k, r in self.runs.items()}}


REPEAT = "#2"  # suffix of a repeated run's name


def serve_all(systems: Systems, requests: Sequence[BenchRequest], base_candidates: Sequence[System],
              log=print, repeat_pair: bool = False) -> dict[str, RunResult]:
    """Every system on the same requests (the base-model systems on the same requests without adapters).
    repeat_pair: loraplex with and without adapters run first, in the order A B B A (the repeats named
    with REPEAT), so that their comparison (the adapters' loss) cancels a linear drift of the CPU's
    speed, which on the AMD dev machine moved by up to 1.4x over minutes."""
    plain = without_adapters(requests)
    runs: dict[str, RunResult] = {}
    pair = [(systems.loraplex, requests, ""), (systems.loraplex_base, plain, "")]
    if repeat_pair:
        order = [*pair, *[(s, r, REPEAT) for s, r, _ in reversed(pair)]]
    else:
        order = pair[:1]
    order += [(systems.peft, requests, ""), *[(c, plain, "") for c in base_candidates]]
    if not repeat_pair:
        order.append(pair[1])
    for system, reqs, suffix in order:
        name = system.name + suffix
        log(f"  {name}: {len(reqs)} requests...")
        system.warmup()
        runs[name] = system.serve(reqs)
        log(f"    {runs[name].wall_s:.1f} s")
    return runs


def mean_wall(runs: dict[str, RunResult], name: str) -> RunResult:
    """The run of `name` with its wall the mean over it and its repeat (if any)."""
    reps = [runs[n] for n in (name, name + REPEAT) if n in runs]
    return replace(reps[0], wall_s=sum(r.wall_s for r in reps) / len(reps))


def check_outputs(systems: Systems, runs: dict[str, RunResult], base_names: Sequence[str],
                  sample: int, prefix_tokens: int) -> list[OutputMatch]:
    """(a) against (b), (d) against every (c) candidate run, and, last, (a) against (d): the adapters' effect
    (expected low: had the adapters changed nothing, the first check would prove nothing)."""
    out = [compare_outputs(runs[systems.loraplex.name], runs[systems.peft.name], sample, prefix_tokens)]
    out += [compare_outputs(runs[systems.loraplex_base.name], runs[n], sample, prefix_tokens) for n in base_names]
    out.append(compare_outputs(runs[systems.loraplex.name], runs[systems.loraplex_base.name], sample, prefix_tokens))
    return out


def run_offline(systems: Systems, requests: Sequence[BenchRequest], sample: int = 16, prefix_tokens: int = 16,
                log=print) -> ModeResult:
    reqs = all_at_once(requests)
    runs = serve_all(systems, reqs, systems.base_candidates, log, repeat_pair=True)
    metrics = {name: summarize(run) for name, run in runs.items()}
    names = [c.name for c in systems.base_candidates]
    best = max(names, key=lambda n: metrics[n].throughput_tok_s)
    return ModeResult("offline", runs, metrics, check_outputs(systems, runs, names, sample, prefix_tokens), best)
