"""Fit the step-cost model (loraplex.admission.cost_model) from real EngineCore steps of a model.

The engine fits its own cost online when core.slo is set (SloController.after_step); this drives a mix of
steps through it (prefill chunks up to the token budget, decode batches up to max_num_seqs, long and short
contexts) and returns the controller's fit, a fit to the fastest repeat of each step shape, and every
measured step, so that the fits' errors can be stated.

    python benchmarks/step_cost_fit.py [--repeats 2]      # prints the fits, their errors and the steps
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import numpy as np

from loraplex.admission.cost_model import StepCost, StepCostModel, StepRecord
from loraplex.admission.sim_adapters import DEFAULT_SIM_MODULES, SimAdapterFactory
from loraplex.admission.slo import SloController
from loraplex.config import EngineConfig
from loraplex.engine import EngineCore, SamplingParams

# (requests, prompt tokens, output tokens): each phase runs to completion. Together: prefill steps from a
# handful of tokens to the full budget, decode steps from batch 1 to 64, with from 16 to ~19,000 cached tokens.
PHASES = ((1, 16, 3), (8, 64, 3), (32, 24, 3), (1, 512, 2), (64, 12, 3), (4, 256, 3), (16, 128, 3),
          (1, 1500, 2), (48, 48, 3), (2, 700, 3))
# A full batch of chat requests reads ~20,000 cached tokens per step: 64 requests whose outputs outlast the
# 32 steps that prefill them all, so the batch fills up and then decodes. Without it the per-cached-token
# cost would be extrapolated far past the steps it was fitted on. Recorded passes only (it warms itself up).
FULL_BATCH = (64, 256, 40)
RANKS = (8, 16, 32, 64)  # the benchmark traces' ranks


@dataclass(frozen=True)
class CostFit:
    online: StepCost  # the engine's own online fit (recursive least squares, as in production)
    floor: StepCost  # least squares on the fastest of the repeats of each step shape
    records: tuple[StepRecord, ...]
    online_error: float  # mean |predicted - measured| / measured over all recorded steps
    floor_error: float  # the same for `floor`, over the fastest of each shape
    wall_s: float

    def as_dict(self) -> dict:
        return {"online": asdict(self.online), "floor": asdict(self.floor), "steps": len(self.records),
                "online_mean_abs_rel_error": round(self.online_error, 4),
                "floor_mean_abs_rel_error": round(self.floor_error, 4), "wall_s": round(self.wall_s, 1),
                "records": [asdict(r) for r in self.records]}


class _RecordingSlo(SloController):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[StepRecord] = []

    def after_step(self, record, view, now=None) -> None:
        self.records.append(record)
        super().after_step(record, view, now)


def _run_phases(core: EngineCore, rng: random.Random, phases, adapters: list[str]) -> None:
    cfg, vocab = core.config, core.model_config.vocab_size
    for n, prompt, out in phases:
        for i in range(min(n, cfg.max_num_seqs)):
            ids = [rng.randrange(3, vocab) for _ in range(min(prompt, core.max_model_len - out - 1))]
            adapter = adapters[i % len(adapters)] if adapters else None
            core.add_request(ids, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0), adapter=adapter)
        while core.has_unfinished():
            core.step()


def _error(cost: StepCost, recs) -> float:
    return float(np.mean([abs(cost.predict(r.new_tokens, r.cached_tokens) - r.seconds) / r.seconds for r in recs]))


def add_fit_adapters(core: EngineCore, n: int, ranks=RANKS, modules=DEFAULT_SIM_MODULES) -> list[str]:
    """n zero adapters of mixed ranks (the kernels do the same work for zeros): a batch of requests spread
    over them costs what a multi-adapter batch of the benchmark's traces costs."""
    factory = SimAdapterFactory(core.model_config, core.pager.geometry.row_layout, modules)
    names = [f"fit-lora-{i}" for i in range(n)]
    for i, name in enumerate(names):
        if name not in core.adapters.names():
            core.add_adapter(name, factory.make(name, ranks[i % len(ranks)]))
    return names


def fit_from_engine(core: EngineCore, repeats: int = 2, seed: int = 0, adapters: int = 16) -> CostFit:
    """Run PHASES once unrecorded (the first steps of each shape are several times slower: allocator and
    kernel warm-up, which no serving step pays), then `repeats` times with the engine fitting its cost
    online. The same phases give the same step shapes each time, so the fastest of each shape is also
    fitted: on a shared machine other processes only ever make a step slower. Requests are spread over
    `adapters` adapters of mixed ranks (0: base model only). core.slo is restored."""
    cfg = core.config
    saved = core.slo
    names = add_fit_adapters(core, adapters) if adapters else []
    t0 = time.perf_counter()
    slo = _RecordingSlo(cfg.max_num_batched_tokens, cfg.max_num_seqs, StepCostModel(min_samples=4))
    try:
        core.slo = None
        _run_phases(core, random.Random(seed), PHASES, names)
        core.slo = slo
        for i in range(repeats):
            _run_phases(core, random.Random(seed + 1 + i), PHASES + (FULL_BATCH,), names)
    finally:
        core.slo = saved
    wall = time.perf_counter() - t0
    recs = tuple(slo.records)
    fastest: dict[tuple[int, int, int], StepRecord] = {}
    for r in recs:
        k = (r.new_tokens, r.cached_tokens, r.num_seqs)
        if k not in fastest or r.seconds < fastest[k].seconds:
            fastest[k] = r
    floor_recs = list(fastest.values())
    x = np.array([[1.0, r.new_tokens, r.cached_tokens] for r in floor_recs])
    y = np.array([r.seconds for r in floor_recs])
    theta = np.maximum(np.linalg.lstsq(x, y, rcond=None)[0], 0.0)
    floor = StepCost(float(theta[0]), float(theta[1]), float(theta[2]), len(floor_recs))
    return CostFit(slo.cost, floor, recs, _error(slo.cost, recs), _error(floor, floor_recs), wall)


def main() -> None:
    ap = argparse.ArgumentParser(description="fit the step cost from real steps of the default model")
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=16, help="zero adapters of mixed ranks the requests use")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (on a shared 2-core machine one thread is faster and far steadier than two)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    core = EngineCore(EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens))
    fit = fit_from_engine(core, args.repeats, adapters=args.adapters)
    print(json.dumps(fit.as_dict(), indent=1))


if __name__ == "__main__":
    main()
