"""Request traces for serving benchmarks: arrivals, lengths, adapters and tenants, saved as JSON lines.

    spec = TraceSpec(rate=2.0, duration_s=600, arrivals="gamma", cv=2.0, tenants=THREE_TENANTS, seed=0)
    trace = generate(spec)                  # list[TraceRequest], sorted by arrival
    save_jsonl(trace, "trace.jsonl"); trace == load_jsonl("trace.jsonl")

- Arrivals: Poisson (exponential gaps) or a gamma renewal process whose gaps have coefficient of variation
  `cv` (burstiness: cv=1 is Poisson, cv>1 clusters arrivals into bursts).
- Lengths: "chat", lognormal prompt and output lengths clipped to a range (heavy right tail, as in
  ShareGPT/LMSYS chat logs), or "uniform", S-LoRA's setting: prompt and output uniform in 8..512.
- Adapters: `num_adapters` adapters with ranks drawn from `ranks`, popularity following a power law
  p(i) ∝ (i+1)^-alpha (S-LoRA's α; alpha=0 is uniform); num_adapters=0: every request uses the base model.
- Tenants: each has a share (its fraction of the traffic, and its weight under fair scheduling), a TTFT
  target and a `load` multiplier (10 = the tenant sends 10x its share: the flood run).

Each tenant's requests come from its own random stream (seeded by the trace seed and the tenant's name), so
changing one tenant's load leaves every other tenant's requests exactly as they were: a flood run and its
baseline differ only in the flooding tenant's requests.

CLI: python benchmarks/traces.py --rate 2 --duration 600 --arrivals gamma --cv 2 --out trace.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARRIVALS = ("poisson", "gamma")
LENGTHS = ("chat", "uniform")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; every system replays these fields and nothing else."""

    id: str
    arrival_s: float  # seconds from the start of the trace
    tenant: str
    adapter: str | None  # adapter name, None for the base model
    rank: int  # the adapter's rank (0 for the base model)
    prompt_tokens: int
    output_tokens: int  # generated exactly this many (EOS ignored)
    ttft_target_ms: float  # the tenant's TTFT target when the request was made


@dataclass(frozen=True)
class TenantSpec:
    name: str
    share: float = 1.0  # relative: fraction of the traffic, and the tenant's weight under VTC
    ttft_target_ms: float = 1000.0
    load: float = 1.0  # multiplier on the tenant's traffic (10.0: it sends 10x its share)


THREE_TENANTS = (
    TenantSpec("interactive", 1.0, 2000.0),
    TenantSpec("standard", 1.0, 5000.0),
    TenantSpec("batch", 1.0, 15000.0),
)


@dataclass(frozen=True)
class TraceSpec:
    rate: float  # requests/s of all tenants together at load 1
    duration_s: float
    arrivals: str = "poisson"
    cv: float = 1.0  # gamma only: coefficient of variation of the gaps between arrivals
    lengths: str = "chat"
    # "chat": lognormal, median and sigma (of the log), clipped to [min, max]
    prompt_median: float = 128.0
    prompt_sigma: float = 1.0
    prompt_min: int = 8
    prompt_max: int = 2048
    output_median: float = 64.0
    output_sigma: float = 1.0
    output_min: int = 4
    output_max: int = 512
    # "uniform" (S-LoRA): both lengths uniform in [uniform_low, uniform_high]
    uniform_low: int = 8
    uniform_high: int = 512
    num_adapters: int = 100
    alpha: float = 1.0
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    tenants: tuple[TenantSpec, ...] = THREE_TENANTS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {ARRIVALS}, got {self.arrivals!r}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {LENGTHS}, got {self.lengths!r}")
        if not (self.rate > 0 and self.duration_s > 0 and self.cv > 0):
            raise ValueError("rate, duration_s and cv must be positive")
        if self.num_adapters < 0 or (self.num_adapters and not self.ranks) or any(r < 1 for r in self.ranks):
            raise ValueError("num_adapters must be >= 0 and ranks positive")
        if not self.tenants or len({t.name for t in self.tenants}) != len(self.tenants):
            raise ValueError("tenants must be non-empty with distinct names")
        if any(t.share <= 0 or t.load < 0 or t.ttft_target_ms <= 0 for t in self.tenants):
            raise ValueError("tenant shares and TTFT targets must be positive, loads non-negative")

    def with_rate(self, rate: float) -> "TraceSpec":
        return dataclasses.replace(self, rate=rate)

    def with_load(self, tenant: str, load: float) -> "TraceSpec":
        """The same trace with one tenant sending `load` times its share."""
        if tenant not in {t.name for t in self.tenants}:
            raise ValueError(f"no tenant {tenant!r}")
        tenants = tuple(dataclasses.replace(t, load=load) if t.name == tenant else t for t in self.tenants)
        return dataclasses.replace(self, tenants=tenants)

    @property
    def shares(self) -> dict[str, float]:
        return {t.name: t.share for t in self.tenants}


# -- generation ------------------------------------------------------------------------------------

def _stream(seed: int, label: str) -> np.random.Generator:
    """A random stream per (seed, label); crc32, unlike hash(), is the same in every process."""
    return np.random.default_rng([seed, zlib.crc32(label.encode())])


def arrival_times(rng: np.random.Generator, rate: float, duration_s: float, kind: str, cv: float) -> np.ndarray:
    """Arrival times in [0, duration_s) of a renewal process with mean rate `rate`."""
    if rate <= 0:
        return np.empty(0)
    times: list[np.ndarray] = []
    t = 0.0
    chunk = max(16, int(rate * duration_s * 1.2) + 16)
    while t < duration_s:
        if kind == "poisson":
            gaps = rng.exponential(1.0 / rate, chunk)
        else:  # gamma with shape k = 1/cv^2 has mean k*theta = 1/rate and CV = cv
            shape = 1.0 / (cv * cv)
            gaps = rng.gamma(shape, 1.0 / (rate * shape), chunk)
        arr = t + np.cumsum(gaps)
        times.append(arr)
        t = float(arr[-1])
    out = np.concatenate(times)
    return out[out < duration_s]


def lengths(rng: np.random.Generator, n: int, spec: TraceSpec) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_tokens, output_tokens), each [n] int64."""
    if spec.lengths == "uniform":
        return (rng.integers(spec.uniform_low, spec.uniform_high + 1, n),
                rng.integers(spec.uniform_low, spec.uniform_high + 1, n))

    def lognormal(median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
        return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(n))), lo, hi).astype(np.int64)

    return (lognormal(spec.prompt_median, spec.prompt_sigma, spec.prompt_min, spec.prompt_max),
            lognormal(spec.output_median, spec.output_sigma, spec.output_min, spec.output_max))


def adapter_ranks(spec: TraceSpec) -> list[int]:
    """Rank of adapter i (drawn once per trace seed, shared by all tenants)."""
    rng = _stream(spec.seed, "adapter-ranks")
    return [int(spec.ranks[i]) for i in rng.integers(0, len(spec.ranks), spec.num_adapters)]


def adapter_popularity(num_adapters: int, alpha: float) -> np.ndarray:
    """p(i) ∝ (i+1)^-alpha: adapter 0 is the most popular."""
    w = np.arange(1, num_adapters + 1, dtype=np.float64) ** -alpha
    return w / w.sum()


def adapter_name(i: int) -> str:
    return f"lora-{i:04d}"


def generate(spec: TraceSpec) -> list[TraceRequest]:
    total_share = sum(t.share for t in spec.tenants)
    ranks = adapter_ranks(spec)
    popularity = adapter_popularity(spec.num_adapters, spec.alpha) if spec.num_adapters else None
    rows: list[tuple[float, str, int | None, int, int, float]] = []
    for tenant in spec.tenants:
        rng = _stream(spec.seed, "tenant:" + tenant.name)
        rate = spec.rate * tenant.share / total_share * tenant.load
        times = arrival_times(rng, rate, spec.duration_s, spec.arrivals, spec.cv)
        prompts, outputs = lengths(rng, len(times), spec)
        picks = rng.choice(spec.num_adapters, len(times), p=popularity) if popularity is not None else None
        for j, t in enumerate(times):
            a = int(picks[j]) if picks is not None else None
            rows.append((float(t), tenant.name, a, int(prompts[j]), int(outputs[j]), tenant.ttft_target_ms))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [TraceRequest(id=f"r{i:06d}", arrival_s=round(t, 6), tenant=name,
                         adapter=adapter_name(a) if a is not None else None, rank=ranks[a] if a is not None else 0,
                         prompt_tokens=p, output_tokens=o, ttft_target_ms=target)
            for i, (t, name, a, p, o, target) in enumerate(rows)]


def offline(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The same requests all arriving at once (offline mode: throughput)."""
    return [dataclasses.replace(r, arrival_s=0.0) for r in trace]


# -- files -----------------------------------------------------------------------------------------

_FIELDS = tuple(f.name for f in dataclasses.fields(TraceRequest))


def save_jsonl(trace: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(dataclasses.asdict(r), separators=(",", ":")) + "\n")


def load_jsonl(path: str | Path) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if set(row) != set(_FIELDS):
                raise ValueError(f"{path}:{n}: expected fields {_FIELDS}, got {tuple(row)}")
            out.append(TraceRequest(**row))
    return out


def describe(trace: Sequence[TraceRequest]) -> dict:
    """A summary for logs and result files."""
    if not trace:
        return {"requests": 0}
    p = np.array([r.prompt_tokens for r in trace])
    o = np.array([r.output_tokens for r in trace])
    span = max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace)
    return {
        "requests": len(trace),
        "span_s": round(span, 3),
        "rate": round(len(trace) / span, 4) if span > 0 else None,
        "prompt_tokens": {"mean": round(float(p.mean()), 1), "p50": int(np.median(p)), "p99": int(np.percentile(p, 99))},
        "output_tokens": {"mean": round(float(o.mean()), 1), "p50": int(np.median(o)), "p99": int(np.percentile(o, 99))},
        "tenants": dict(Counter(r.tenant for r in trace)),
        "distinct_adapters": len({r.adapter for r in trace if r.adapter is not None}),
    }


# -- CLI -------------------------------------------------------------------------------------------

def parse_tenant(text: str) -> TenantSpec:
    """name:share:ttft_target_ms[:load]"""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"tenant {text!r} is not name:share:ttft_ms[:load]")
    return TenantSpec(parts[0], float(parts[1]), float(parts[2]), float(parts[3]) if len(parts) == 4 else 1.0)


def add_spec_args(ap: argparse.ArgumentParser) -> None:
    d = TraceSpec(rate=1.0, duration_s=1.0)
    ap.add_argument("--arrivals", choices=ARRIVALS, default=d.arrivals)
    ap.add_argument("--cv", type=float, default=d.cv, help="gamma arrivals: CV of the gaps (burstiness)")
    ap.add_argument("--lengths", choices=LENGTHS, default=d.lengths)
    ap.add_argument("--prompt-median", type=float, default=d.prompt_median)
    ap.add_argument("--output-median", type=float, default=d.output_median)
    ap.add_argument("--adapters", type=int, default=d.num_adapters, help="number of distinct adapters (0: none)")
    ap.add_argument("--alpha", type=float, default=d.alpha, help="power-law exponent of adapter popularity")
    ap.add_argument("--ranks", type=int, nargs="+", default=list(d.ranks))
    ap.add_argument("--tenant", type=parse_tenant, action="append", dest="tenants",
                    help="name:share:ttft_ms[:load], repeatable (default: three tenants)")
    ap.add_argument("--seed", type=int, default=d.seed)


def spec_from_args(args: argparse.Namespace, rate: float, duration_s: float) -> TraceSpec:
    return TraceSpec(rate=rate, duration_s=duration_s, arrivals=args.arrivals, cv=args.cv, lengths=args.lengths,
                     prompt_median=args.prompt_median, output_median=args.output_median,
                     num_adapters=args.adapters, alpha=args.alpha, ranks=tuple(args.ranks),
                     tenants=tuple(args.tenants) if args.tenants else THREE_TENANTS, seed=args.seed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, required=True, help="requests/s, all tenants at load 1")
    ap.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    add_spec_args(ap)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    trace = generate(spec_from_args(args, args.rate, args.duration))
    save_jsonl(trace, args.out)
    print(json.dumps(describe(trace), indent=2))


if __name__ == "__main__":
    main()
