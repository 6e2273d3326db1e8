"""The issue's targets, checked against the figures of one run: each a TargetCheck (measured, bound, met).

- loraplex >= 10x the output throughput of transformers + PEFT, at equal or better p99 TTFT (offline and
  online); beside the ratio, what it would be at two floors: the trace's matmul FLOPs at the measured rate
  (matmul_floor_s), and loraplex's own steps each at the longer of their FLOPs and the weight and adapter bytes
  they read (step_floors, StepRoofline.floor_s);
- offline, loraplex with its adapters >= 100% of the better transformers base-model-only system (c);
- loraplex's loss against its own no-adapter run <= 1.3x the loss the floor predicts: the extra time is
  the adapter bytes the steps read (each step reads the distinct adapters it serves) over the measured read
  bandwidth plus the LoRA FLOPs (2 x rank x (in + out) per token, module and layer) over the measured
  matmul rate, added to the no-adapter run's time;
- adapter scaling: the loss from 1 to 100 and to 1,000 adapters <= 1.3x the floor's (scaling.py);
- decode at batch 64 >= 60% of the measured compute ceiling.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from loraplex.models.config import ModelConfig

from .ceiling import Ceilings, DecodeShare, linear_params, request_matmul_flops
from .metrics import Metrics
from .scaling import ScalingPoint
from .systems import RunResult
from .workload import BenchRequest, adapter_elements, adapter_rank


@dataclass(frozen=True)
class TargetCheck:
    name: str
    measured: float
    bound: float
    at_least: bool  # met when measured >= bound (else when measured <= bound)
    detail: str = ""

    @property
    def met(self) -> bool:
        return self.measured >= self.bound if self.at_least else self.measured <= self.bound

    def as_dict(self) -> dict:
        return {**asdict(self), "met": self.met}


@dataclass(frozen=True)
class FloorLoss:
    extra_bytes: int  # adapter bytes read over the run (each step: its distinct adapters)
    extra_flops: float  # LoRA FLOPs of every token that went through an adapter
    extra_s: float
    predicted_loss: float  # 1 - t_without / (t_without + extra_s), t_without the median no-adapter wall
    measured_loss: float  # the median of pair_losses
    pair_losses: tuple[float, ...] = ()  # 1 - t_without / t_with of each pair of runs
    pairs: str = "side by side in time"  # how the pairs ran: side by side in time (A B B A), or stepped in turn
    other_losses: tuple[float, ...] = ()  # stepped in turn: the A B B A pairs' losses, for comparison

    @property
    def ratio(self) -> float:
        return self.measured_loss / self.predicted_loss if self.predicted_loss > 1e-9 else float("inf")


def step_adapter_bytes(cfg: ModelConfig, adapters: Sequence[str], itemsize: int) -> int:
    """The bytes of the distinct adapters one step serves: each is read once in the step."""
    return sum(adapter_elements(cfg, adapter_rank(a)) * itemsize for a in adapters)


def floor_loss(with_adapters: RunResult, without_walls: Sequence[float], pair_losses: Sequence[float],
               requests: Sequence[BenchRequest], cfg: ModelConfig, ceilings: Ceilings, itemsize: int,
               pairs: str = "side by side in time", other_losses: Sequence[float] = ()) -> FloorLoss:
    """What the floor predicts the adapters cost over the no-adapter runs of the same requests (without_walls),
    beside what pairs of runs measured (offline.adapter_pair_losses): the median of the pairs' losses, which one
    disturbed run moves less than it moves a mean of walls. pairs: how the pairs ran (stated with the figure)."""
    nbytes = sum(step_adapter_bytes(cfg, step, itemsize) for step in with_adapters.extra["steps_adapters"])
    flops = sum(2.0 * (len(r.prompt) + r.output_tokens) * adapter_elements(cfg, adapter_rank(r.adapter))
                for r in requests if r.adapter)
    extra_s = nbytes / (ceilings.read_gbps * 1e9) + flops / (ceilings.matmul_gflops * 1e9)
    t0 = statistics.median(without_walls)
    return FloorLoss(nbytes, flops, extra_s, 1.0 - t0 / (t0 + extra_s), statistics.median(pair_losses),
                     tuple(pair_losses), pairs, tuple(other_losses))


def prefill_steps(run: RunResult) -> list[bool]:
    """Whether each of the run's steps ran prompt tokens: a decode-only step samples one token per token it runs, a
    step with prompt tokens runs more than it samples."""
    return [t > s for t, s in zip(run.extra["steps_tokens"], run.extra["steps_sampled"])]


@dataclass(frozen=True)
class PhaseExtra:
    """What the adapters add to one kind of step (prefill: the steps that ran prompt tokens; decode: the others),
    measured from pairs of runs stepped in turn, whose steps are the same ones in both runs: the median over the
    pairs of the phase's step walls with adapters less those without. Beside it the floor's share: the adapter
    bytes the phase's steps read over the read bandwidth, and the LoRA FLOPs of its tokens over the matmul rate
    (prefill: the prompt tokens; decode: every output token but the first, which its prompt's last step
    samples; a decode row inside a prefill step is counted with decode)."""

    phase: str
    steps: int
    measured_s: float
    floor_bytes_s: float
    floor_flops_s: float

    @property
    def floor_s(self) -> float:
        return self.floor_bytes_s + self.floor_flops_s

    def as_dict(self) -> dict:
        return {**asdict(self), "floor_s": self.floor_s}


def adapter_extra_by_phase(with_runs: Sequence[RunResult], without_runs: Sequence[RunResult],
                           requests: Sequence[BenchRequest], cfg: ModelConfig, ceilings: Ceilings,
                           itemsize: int) -> list[PhaseExtra] | None:
    """PhaseExtra of prefill and decode from the i-th runs of each (stepped in turn). None where there are no
    pairs, or a pair's two runs did not take the same steps (then step k of one is not step k of the other)."""
    pairs = list(zip(with_runs, without_runs))
    if not pairs or any(a.extra.get("steps_tokens") is None or a.extra["steps_tokens"] != b.extra.get("steps_tokens")
                        or a.extra["steps_sampled"] != b.extra["steps_sampled"] for a, b in pairs):
        return None
    first = pairs[0][0].extra
    prefill = prefill_steps(pairs[0][0])
    lora_flops = {True: 0.0, False: 0.0}
    for r in requests:
        if r.adapter:
            per_token = 2.0 * adapter_elements(cfg, adapter_rank(r.adapter))
            lora_flops[True] += per_token * len(r.prompt)
            lora_flops[False] += per_token * max(r.output_tokens - 1, 0)
    out = []
    for phase, want in (("prefill", True), ("decode", False)):
        ks = [k for k, p in enumerate(prefill) if p == want]
        extra = [sum(a.extra["steps_s"][k] - b.extra["steps_s"][k] for k in ks) for a, b in pairs]
        nbytes = sum(step_adapter_bytes(cfg, first["steps_adapters"][k], itemsize) for k in ks)
        out.append(PhaseExtra(phase, len(ks), statistics.median(extra), nbytes / (ceilings.read_gbps * 1e9),
                              lora_flops[want] / (ceilings.matmul_gflops * 1e9)))
    return out


def matmul_floor_s(requests: Sequence[BenchRequest], cfg: ModelConfig, ceilings: Ceilings) -> float:
    """The least time any engine needs for `requests` at the measured matmul rate (request_matmul_flops)."""
    flops = sum(request_matmul_flops(cfg, len(r.prompt), r.output_tokens, adapter_rank(r.adapter) if r.adapter else 0)
                for r in requests)
    return flops / (ceilings.matmul_gflops * 1e9)


def step_floors(run: RunResult, cfg: ModelConfig, ceilings: Ceilings, itemsize: int) -> list[float] | None:
    """The least time each of the run's steps takes at the roofline: the longer of its matmul FLOPs over the measured
    matmul rate and the bytes it must read over the measured read bandwidth. A step reads every weight of the
    projections and the LM head once (the default model's 538 MB in float32 do not fit a CPU's L3) and the distinct
    adapters it serves; its FLOPs are its tokens through the layers and its sampled rows through the LM head. LoRA
    FLOPs, attention and the KV cache's bytes are left out, so these stay floors. None: the run did not record its
    steps' tokens."""
    tokens, sampled = run.extra.get("steps_tokens"), run.extra.get("steps_sampled")
    if tokens is None or sampled is None:
        return None
    head = cfg.vocab_size * cfg.hidden_size
    layers = linear_params(cfg) - head
    weight_bytes = linear_params(cfg) * itemsize
    floors = []
    for t, s, adapters in zip(tokens, sampled, run.extra["steps_adapters"]):
        flops = 2.0 * (t * layers + s * head)
        nbytes = weight_bytes + step_adapter_bytes(cfg, adapters, itemsize)
        floors.append(max(flops / (ceilings.matmul_gflops * 1e9), nbytes / (ceilings.read_gbps * 1e9)))
    return floors


@dataclass(frozen=True)
class StepRoofline:
    """A run's steps against their floors (step_floors), split where the two kinds of step are bound differently:
    steps that ran prompt tokens (prefill; FLOPs bind) and decode-only steps (the weights' bytes bind at small
    batches)."""

    prefill_steps: int
    prefill_s: float
    prefill_floor_s: float
    decode_steps: int
    decode_s: float
    decode_floor_s: float

    @property
    def floor_s(self) -> float:
        """The least time the run's steps take at the roofline, all of them."""
        return self.prefill_floor_s + self.decode_floor_s

    def as_dict(self) -> dict:
        return asdict(self)


def step_roofline(run: RunResult, cfg: ModelConfig, ceilings: Ceilings, itemsize: int) -> StepRoofline | None:
    """None where the run did not record its steps (walls, tokens)."""
    floors, walls = step_floors(run, cfg, ceilings, itemsize), run.extra.get("steps_s")
    if floors is None or walls is None:
        return None
    prefill = prefill_steps(run)
    pick = lambda xs, want: [x for x, p in zip(xs, prefill) if p == want]  # noqa: E731
    return StepRoofline(sum(prefill), sum(pick(walls, True)), sum(pick(floors, True)),
                        len(prefill) - sum(prefill), sum(pick(walls, False)), sum(pick(floors, False)))


def offline_checks(metrics: dict[str, Metrics], base_choice: str, loss: FloorLoss,
                   floor_s: float | None = None, steps_floor_s: float | None = None) -> list[TargetCheck]:
    """floor_s (matmul_floor_s of the trace) and steps_floor_s (StepRoofline.floor_s of loraplex's run): bound the
    reachable ratio against transformers + PEFT at PEFT's time over them, stated in the ratio's detail."""
    ours, peft, base = metrics["loraplex"], metrics["peft-static"], metrics[base_choice]
    bound = ""
    if floor_s:
        # Both serve the same output tokens, so the throughput ratio is PEFT's time over ours.
        bound = (f"matmul floor {floor_s:.3g} s against loraplex's {ours.wall_s:.1f} s: at the floor the ratio "
                 f"would be {peft.wall_s / floor_s:.3g}")
    if steps_floor_s:
        bound += (f"{'; ' if bound else ''}its steps at the roofline (each step's FLOPs or its weight and adapter "
                  f"bytes, whichever take longer) {steps_floor_s:.3g} s: there the ratio would be "
                  f"{peft.wall_s / steps_floor_s:.3g}")
    return [
        TargetCheck("offline output tok/s, loraplex / transformers+PEFT", ours.throughput_tok_s / peft.throughput_tok_s,
                    10.0, True, bound),
        TargetCheck("offline p99 TTFT s, loraplex (bound: transformers+PEFT's)", ours.ttft_p99_s, peft.ttft_p99_s,
                    False),
        TargetCheck(f"offline output tok/s, loraplex with adapters / {base_choice} (base model only)",
                    ours.throughput_tok_s / base.throughput_tok_s, 1.0, True),
        TargetCheck("loss against loraplex without adapters / the floor's predicted loss", loss.ratio, 1.3, False,
                    f"measured {loss.measured_loss:.3f} (the median of {len(loss.pair_losses)} pairs of runs "
                    f"{loss.pairs}: {', '.join(f'{x:.3f}' for x in loss.pair_losses)}"
                    + (f"; pairs side by side in time: {', '.join(f'{x:.3f}' for x in loss.other_losses)}"
                       if loss.other_losses else "") + "), "
                    f"predicted {loss.predicted_loss:.3f} "
                    f"({loss.extra_bytes / 1e9:.2f} GB read, {loss.extra_flops / 1e9:.1f} GFLOP)"),
    ]


def online_checks(metrics: dict[str, Metrics]) -> list[TargetCheck]:
    ours, peft = metrics["loraplex"], metrics["peft-static"]
    return [TargetCheck("online p99 TTFT s, loraplex (bound: transformers+PEFT's)", ours.ttft_p99_s,
                        peft.ttft_p99_s, False)]


def scaling_checks(points: Sequence[ScalingPoint]) -> list[TargetCheck]:
    return [TargetCheck(f"scaling 1 -> {p.adapters} adapters: loss / the floor's predicted loss",
                        p.loss_ratio if p.loss_ratio is not None else float("inf"), 1.3, False,
                        f"measured {p.measured_loss:.3f}, predicted {p.predicted_loss:.3f}, "
                        f"{p.distinct_used} adapters used; host-cache loads {p.host_load_s:.3f} s against "
                        f"{p.host_load_floor_s or 0:.3f} s at the floor")
            for p in points if p.adapters >= 100]


def decode_checks(shares: Sequence[DecodeShare]) -> list[TargetCheck]:
    return [TargetCheck(f"decode B={s.batch} ({s.adapters}) share of the compute ceiling",
                        s.share_of_compute_ceiling, 0.6, True) for s in shares]


def print_checks(checks: Sequence[TargetCheck]) -> None:
    print("\n| target | measured | bound | met |\n|---|---|---|---|")
    for c in checks:
        rel = ">=" if c.at_least else "<="
        detail = f" ({c.detail})" if c.detail else ""
        print(f"| {c.name}{detail} | {c.measured:.3f} | {rel} {c.bound:.3f} | {'yes' if c.met else 'no'} |")
