"""Offline mode: every request available at once; throughput. Also where outputs are checked to agree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .metrics import Metrics, OutputMatch, compare_outputs, summarize
from .systems import PER_STEP, LoraplexSystem, RunResult, System, serve_interleaved
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
    metrics: dict[str, Metrics]  # by run name (a repeated system's runs: name, name#2, ...)
    matches: list[OutputMatch]
    base_choice: str  # which (c) candidate stands for "transformers base model"
    typical: dict[str, str] = field(default_factory=dict)  # repeated system -> the run that stands for it

    @property
    def headline(self) -> dict[str, Metrics]:
        """Metrics by system: a repeated system's typical run (typical_run) stands for it."""
        return {**self.metrics, **{name: self.metrics[run] for name, run in self.typical.items()}}

    def as_dict(self) -> dict:
        return {"mode": self.mode, "metrics": {k: m.as_dict() for k, m in self.metrics.items()},
                "matches": [m.as_dict() for m in self.matches], "base_choice": self.base_choice,
                "typical": dict(self.typical),
                "extra": {k: {x: y for x, y in r.extra.items() if x not in PER_STEP}
                          for k, r in self.runs.items()}}


def repeat_name(name: str, i: int) -> str:
    """The i-th run of a system (from 1): its name, then name#2, name#3, ..."""
    return name if i == 1 else f"{name}#{i}"


def interleaved_name(name: str, i: int) -> str:
    """The i-th run (from 1) of a system stepped in turn with the other's (serve_interleaved)."""
    return f"{name}~{i}"


def serve_pairs_interleaved(with_adapters: tuple[LoraplexSystem, Sequence[BenchRequest]],
                            without: tuple[LoraplexSystem, Sequence[BenchRequest]], pairs: int,
                            log=print) -> dict[str, RunResult]:
    """`pairs` runs of loraplex with and without adapters stepped in turn (systems.serve_interleaved), which of
    the two steps first alternating from pair to pair; named by interleaved_name."""
    runs: dict[str, RunResult] = {}
    for i in range(1, pairs + 1):
        order = [with_adapters, without] if i % 2 else [without, with_adapters]
        log(f"  {' and '.join(s.name for s, _ in order)} stepped in turn, pair {i}...")
        for system, _ in order:
            system.warmup()
        for (system, _), run in zip(order, serve_interleaved(order)):
            runs[interleaved_name(system.name, i)] = run
            log(f"    {system.name}: {run.wall_s:.2f} s of its own steps")
    return runs


def serve_all(systems: Systems, requests: Sequence[BenchRequest], base_candidates: Sequence[System],
              log=print, pair_blocks: int = 0, interleaved_pairs: int = 0) -> dict[str, RunResult]:
    """Every system on the same requests (the base-model systems on the same requests without adapters).
    pair_blocks > 0: loraplex with and without adapters run first, in pair_blocks blocks of the order A B B A
    (the repeats named by repeat_name), so that their comparison (the adapters' loss) cancels a linear drift of
    the CPU's speed, which on the AMD dev machine moved by up to 1.4x over minutes, and each system's i-th run
    has the other's i-th run beside it (adapter_pair_losses). interleaved_pairs > 0: then that many pairs of
    the two stepped in turn (serve_pairs_interleaved; the two systems need an engine each), from which the
    adapters' loss is taken where they ran."""
    plain = without_adapters(requests)
    runs: dict[str, RunResult] = {}
    a, b = (systems.loraplex, requests), (systems.loraplex_base, plain)
    order = []
    for block in range(pair_blocks):
        i = 2 * block + 1
        order += [(*a, i), (*b, i), (*b, i + 1), (*a, i + 1)]
    if not pair_blocks:
        order.append((*a, 1))
    order += [(systems.peft, requests, 1), *[(c, plain, 1) for c in base_candidates]]
    if not pair_blocks:
        order.append((*b, 1))
    blocks_end = 4 * pair_blocks  # the A B B A blocks, then the pairs stepped in turn, then the rest
    for k, (system, reqs, i) in enumerate(order):
        if k == blocks_end and interleaved_pairs:
            runs.update(serve_pairs_interleaved(a, b, interleaved_pairs, log))
        name = repeat_name(system.name, i)
        log(f"  {name}: {len(reqs)} requests...")
        system.warmup()
        runs[name] = system.serve(reqs)
        log(f"    {runs[name].wall_s:.1f} s")
    return runs


def _numbered(runs: dict[str, RunResult], name: str, naming) -> list[RunResult]:
    """A system's runs named naming(name, 1), naming(name, 2), ..., in the order they ran."""
    out, i = [], 1
    while (n := naming(name, i)) in runs:
        out.append(runs[n])
        i += 1
    return out


def repeats(runs: dict[str, RunResult], name: str) -> list[RunResult]:
    """A system's runs in the order they ran."""
    return _numbered(runs, name, repeat_name)


def typical_run(runs: dict[str, RunResult], name: str) -> str:
    """The name of the run that stands for a repeated system: the median wall, the slower of the two middle
    ones for an even count. One run in a few on a shared machine is disturbed by a third or more (RESULTS.md),
    and the first one alone was as likely as any to be it."""
    reps = sorted(((r.wall_s, i) for i, r in enumerate(repeats(runs, name), 1)))
    return repeat_name(name, reps[len(reps) // 2][1])


def interleaved(runs: dict[str, RunResult], name: str) -> list[RunResult]:
    """A system's runs stepped in turn with the other's (serve_pairs_interleaved), in the order they ran."""
    return _numbered(runs, name, interleaved_name)


def adapter_pair_losses(runs: dict[str, RunResult], with_name: str, without_name: str,
                        stepped_in_turn: bool = False) -> list[float]:
    """1 - wall without / wall with for each i-th pair of runs: neighbours in time (serve_all's A B B A), or,
    stepped_in_turn, the pairs stepped in turn."""
    pick = interleaved if stepped_in_turn else repeats
    return [1.0 - b.wall_s / a.wall_s for a, b in zip(pick(runs, with_name), pick(runs, without_name))]


def check_outputs(systems: Systems, runs: dict[str, RunResult], base_names: Sequence[str],
                  sample: int, prefix_tokens: int) -> list[OutputMatch]:
    """(a) against (b), (d) against every (c) candidate run, and, last, (a) against (d): the adapters' effect
    (expected low: had the adapters changed nothing, the first check would prove nothing)."""
    out = [compare_outputs(runs[systems.loraplex.name], runs[systems.peft.name], sample, prefix_tokens)]
    out += [compare_outputs(runs[systems.loraplex_base.name], runs[n], sample, prefix_tokens) for n in base_names]
    out.append(compare_outputs(runs[systems.loraplex.name], runs[systems.loraplex_base.name], sample, prefix_tokens))
    return out


def run_offline(systems: Systems, requests: Sequence[BenchRequest], sample: int = 16, prefix_tokens: int = 16,
                log=print, pair_blocks: int = 1, interleaved_pairs: int = 0) -> ModeResult:
    """pair_blocks: blocks of A B B A runs of loraplex with and without adapters; interleaved_pairs: pairs of
    them stepped in turn (serve_all)."""
    reqs = all_at_once(requests)
    runs = serve_all(systems, reqs, systems.base_candidates, log, pair_blocks=pair_blocks,
                     interleaved_pairs=interleaved_pairs)
    metrics = {name: summarize(run) for name, run in runs.items()}
    names = [c.name for c in systems.base_candidates]
    best = max(names, key=lambda n: metrics[n].throughput_tok_s)
    typical = {s.name: typical_run(runs, s.name) for s in (systems.loraplex, systems.loraplex_base)}
    return ModeResult("offline", runs, metrics, check_outputs(systems, runs, names, sample, prefix_tokens), best,
                      typical)
