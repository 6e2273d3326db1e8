"""The Triton kernels on a CUDA GPU: build, check and time them in one command (under 5 minutes on an H200).

1. Ceilings: device-to-device copy bandwidth and the bf16 matrix rate, measured first.
2. SGMV at Llama-3-8B shapes (hidden 4096, KV 1024, MLP 14336; one layer's 7 projections) for a
   decode batch of 1, 16, 64 and 256 tokens, ranks 8 / 16 / 64 / mixed 8-16-64, adapters distinct
   per token or zipf-popular: the base GEMMs of the layer (fused qkv, o, fused gate_up, down), our
   SGMV (7 apply_lora calls, adapters read in place from the page pool), our grouped SGMV (4
   apply_lora_group calls, as the model makes them: q/k/v and gate/up one launch pair each), a gather-then-bmm baseline
   (each token's adapter rows copied out of the pool, then one bmm per rank) and a loop over adapters
   (contiguous weights, two matmuls per adapter and module). Each is checked against the others.
3. Paged decode attention at 2k context (32 heads over 8 KV heads, head_dim 128, blocks of 16): our
   kernel against the torch path, and the KV bytes it reads per second.

Timings are CUDA-event medians with L2 flushed before each repetition: "eager" includes Python launch
gaps, "graph" replays a CUDA graph of the same calls (kernel time alone). Writes JSON and a markdown
table; bandwidth fractions compare bytes read per second with the copy's (read + write) bytes per second.

    python3 benchmarks/kernels_gpu.py --out DIR          # on the GPU machine (needs torch with CUDA, triton)
    python3 benchmarks/kernels_gpu.py --dry-run          # anywhere: tiny shapes, CPU, Triton's interpreter

On the device machine of this workplace: `PYTHONUNBUFFERED=1 python3 benchmarks/kernels_gpu.py --out $OUT`
(torch and triton are in its image; a run that outlasts --budget-s skips the remaining SGMV cases).

loraplex need not be installed: the script maps the repository's folders to their import names itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def ensure_loraplex_importable() -> None:
    """Import loraplex from this checkout even where it is not installed (the GPU machine): a temporary
    folder of symbolic links gives the folders their import names (platform/ -> loraplex, ...)."""
    try:
        import loraplex.kernels  # noqa: F401
        return
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="loraplex-path-"))
    pkg = root / "loraplex"
    pkg.mkdir()
    for entry in (REPO / "platform").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for sub in ("kernels", "unified_pager", "adapter_store"):
        (pkg / sub).symlink_to(REPO / sub)
    sys.path.insert(0, str(root))


ensure_loraplex_importable()

from loraplex.kernels import (
    AttentionMetadata,
    LoraBatch,
    LoraSegment,
    torch_attention,
)
from loraplex.lora.types import TARGET_MODULES, LoraAdapter, LoraModuleWeights
from loraplex.unified_pager.adapter_pages import (
    AdapterResidency,
    place_adapter,
    plan_adapter,
)
from loraplex.unified_pager.geometry import PoolGeometry
from loraplex.unified_pager.pool import PagePool


@dataclass(frozen=True)
class Shapes:
    hidden: int
    kv_size: int
    mlp: int
    num_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    batches: tuple[int, ...]
    rank_sets: dict[str, tuple[int, ...]] = field(hash=False)  # name -> ranks cycled over adapters
    popularity: tuple[str, ...]
    context: int  # tokens in each sequence at the decode step (attention)
    dtype: torch.dtype
    reps: int
    copy_bytes: int
    matmul_n: int
    # Where the tuning knobs are swept: SGMV (popularity, rank set, batch) with the shrink's K-split
    # forced, and attention batches with decode block_n x warps x splits.
    sgmv_sweep: tuple[tuple[str, str, int], ...] = ()
    attention_sweep: tuple[int, ...] = ()

    @property
    def row_width(self) -> int:
        return math.gcd(self.hidden, self.kv_size, self.mlp, self.head_dim)

    def module_shape(self, module: str) -> tuple[int, int]:
        h, kv, i = self.hidden, self.kv_size, self.mlp
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


LLAMA3_8B = Shapes(
    hidden=4096, kv_size=1024, mlp=14336, num_heads=32, kv_heads=8, head_dim=128, block_size=16,
    batches=(1, 16, 64, 256), rank_sets={"r16": (16,), "r8": (8,), "r64": (64,), "mixed": (8, 16, 64)},
    popularity=("distinct", "zipf"), context=2048, dtype=torch.bfloat16, reps=20,
    copy_bytes=2 << 30, matmul_n=8192,
    sgmv_sweep=(("distinct", "r16", 64), ("distinct", "r16", 1)), attention_sweep=(1, 64),
)
# Tiny shapes for --dry-run (D = 16, widths not powers of two), float32 for the interpreter.
DRY = Shapes(
    hidden=64, kv_size=32, mlp=80, num_heads=4, kv_heads=2, head_dim=16, block_size=4,
    batches=(1, 5), rank_sets={"r8": (8,), "mixed": (8, 16, 64)}, popularity=("distinct", "zipf"),
    context=40, dtype=torch.float32, reps=1, copy_bytes=1 << 20, matmul_n=128,
    sgmv_sweep=(("zipf", "mixed", 5),), attention_sweep=(5,),
)


# -- timing ------------------------------------------------------------------------------------


class Timer:
    """Median time of fn in microseconds: CUDA events with L2 flushed first, or wall time on the CPU."""

    def __init__(self, device: torch.device, reps: int):
        self.device = device
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()  # warm-up (and compile)
        if self.device.type != "cuda":
            t = time.perf_counter()
            for _ in range(self.reps):
                fn()
            return (time.perf_counter() - t) / self.reps * 1e6
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def best(self, fn: Callable[[], object]) -> float:
        """Graph replay where it can be captured, else eager."""
        t = self.graph(fn)
        return t if t is not None else self(fn)

    def graph(self, fn: Callable[[], object]) -> float | None:
        """The same, replaying a CUDA graph of fn (None on the CPU or if capture fails)."""
        if self.device.type != "cuda":
            return None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
        except Exception as e:  # a failed capture is reported, not fatal
            print(f"  (graph capture failed: {type(e).__name__}: {e})")
            return None
        return self(g.replay)


def ceilings(shapes: Shapes, device: torch.device, timer: Timer) -> dict:
    n = shapes.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src))
    m = shapes.matmul_n
    dt = shapes.dtype
    a = torch.randn(m, m, device=device).to(dt)
    b = torch.randn(m, m, device=device).to(dt)
    mm_us = timer(lambda: a @ b)
    out = {
        "copy_bytes": n,
        "copy_us": copy_us,
        "copy_gbps_read_plus_write": 2 * n / copy_us / 1e3,
        "matmul_n": m,
        "matmul_dtype": str(dt),
        "matmul_us": mm_us,
        "matmul_tflops": 2 * m**3 / mm_us / 1e6,
    }
    print(f"copy {out['copy_gbps_read_plus_write']:.0f} GB/s (read+write), matmul {out['matmul_tflops']:.1f} TFLOP/s")
    return out


# -- adapters in a page pool -------------------------------------------------------------------


class PageDealer:
    """Distinct pages in random order: adapters and KV blocks land on scattered, unordered pages."""

    def __init__(self, num_pages: int, seed: int = 0):
        self.free = np.random.default_rng(seed).permutation(num_pages).astype(np.int64)
        self.top = 0

    def take(self, n: int) -> np.ndarray:
        if self.top + n > len(self.free):
            raise RuntimeError(f"benchmark pool too small: {n} more pages wanted")
        out = self.free[self.top : self.top + n]
        self.top += n
        return out


def template_adapter(shapes: Shapes, rank: int, seed: int) -> LoraAdapter:
    """Rank-r LoRA on all 7 projections of layer 0, random weights in the pool dtype (placed many times)."""
    gen = torch.Generator().manual_seed(seed)
    mods = []
    for name in TARGET_MODULES:
        in_f, out_f = shapes.module_shape(name)
        a = (torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)).to(shapes.dtype)
        b = (torch.randn(out_f, rank, generator=gen) / math.sqrt(rank)).to(shapes.dtype)
        mods.append(LoraModuleWeights(0, name, rank, 2.0, a, b))
    return LoraAdapter(name=f"r{rank}", modules=tuple(mods), max_rank=rank)


def adapter_pages(shapes: Shapes, geometry: PoolGeometry, rank: int) -> int:
    rows = sum(rank * (i + o) // geometry.row_width for i, o in map(shapes.module_shape, TARGET_MODULES))
    return -(-rows // geometry.rows_per_page)


def pool_geometry(shapes: Shapes, num_pages: int) -> PoolGeometry:
    d = shapes.row_width
    page_elems = 2 * shapes.block_size * shapes.kv_heads * shapes.head_dim
    return PoolGeometry(num_pages=num_pages, row_width=d, rows_per_page=page_elems // d, block_size=shapes.block_size,
                        num_layers=1, num_kv_heads=shapes.kv_heads, head_dim=shapes.head_dim, dtype=shapes.dtype)


@dataclass
class AdapterSet:
    """max(batches) distinct adapters per rank set (adapter i of set "mixed" has rank ranks[i % 3])."""

    by_set: dict[str, list[AdapterResidency]]
    bytes_of: dict[int, int]  # pool bytes of the weights of one adapter (all modules), by id


def place_adapters(shapes: Shapes, pool: PagePool, dealer: PageDealer) -> AdapterSet:
    n = max(shapes.batches)
    ranks = sorted({r for rs in shapes.rank_sets.values() for r in rs})
    templates = {r: template_adapter(shapes, r, seed=r) for r in ranks}
    plans = {r: plan_adapter(pool.geometry, templates[r]) for r in ranks}
    # One placement per (rank, index): the single-rank sets and the mixed set share them.
    placed: dict[tuple[int, int], AdapterResidency] = {}
    by_set: dict[str, list[AdapterResidency]] = {}
    bytes_of: dict[int, int] = {}
    elem = shapes.dtype.itemsize
    for name, rs in shapes.rank_sets.items():
        lst = []
        for i in range(n):
            r = rs[i % len(rs)]
            key = (r, i)
            if key not in placed:
                res = place_adapter(pool, f"r{r}-{i}", plans[r], dealer.take(plans[r].num_pages))
                placed[key] = res
                bytes_of[id(res)] = res.num_rows * pool.geometry.row_width * elem
            lst.append(placed[key])
        by_set[name] = lst
    return AdapterSet(by_set, bytes_of)


def assign(popularity: str, batch: int, rng: random.Random) -> list[int]:
    """Adapter index of each token of a decode batch, sorted as the model runner orders a batch."""
    if popularity == "distinct":
        idx = list(range(batch))
    elif popularity == "zipf":
        weights = [1.0 / (i + 1) ** 1.5 for i in range(batch)]
        idx = rng.choices(range(batch), weights=weights, k=batch)
    else:
        raise ValueError(popularity)
    return sorted(idx)


def runner_batch(adapters: list[AdapterResidency], token_adapter: list[int]) -> LoraBatch:
    """One segment per run of tokens with the same adapter (what the model runner builds)."""
    segs: list[LoraSegment] = []
    for t, a in enumerate(token_adapter):
        res = adapters[a]
        if segs and segs[-1].adapter is res:
            segs[-1] = LoraSegment(segs[-1].start, segs[-1].length + 1, res)
        else:
            segs.append(LoraSegment(t, 1, res))
    return LoraBatch(tuple(segs), len(token_adapter))


@dataclass(frozen=True)
class GatherGroup:
    """Tokens of one rank, with the physical pool rows of each token's A^T and B^T of one module."""

    rank: int
    module: int
    tokens: torch.Tensor  # [n] int64
    a_index: torch.Tensor  # [n * in * rank / D] int64
    b_index: torch.Tensor  # [n * rank * out / D] int64
    scales: torch.Tensor  # [n, 1, 1] float32


def gather_groups(adapters: list[AdapterResidency], token_adapter: list[int], modules, device) -> list[GatherGroup]:
    """The baseline's gather plan, made before timing (only the copies and products are timed)."""
    groups = []
    for m in modules:
        by_rank: dict[int, list[int]] = {}
        for t, a in enumerate(token_adapter):
            slot = adapters[a].slots.get((0, m))
            if slot is not None:
                by_rank.setdefault(slot.rank, []).append(t)
        for rank, toks in by_rank.items():
            res = [adapters[token_adapter[t]] for t in toks]
            groups.append(GatherGroup(
                rank, m, torch.tensor(toks, device=device),
                torch.cat([r.a_index(0, m) for r in res]), torch.cat([r.b_index(0, m) for r in res]),
                torch.tensor([r.slots[(0, m)].scale for r in res], device=device).view(-1, 1, 1)))
    return groups


def gather_bmm_apply(targets, rows: torch.Tensor, groups: list[GatherGroup]) -> None:
    """y[t] += scale * (x[t] @ A^T) @ B^T per token, each token's rows copied out of the pool
    (rows: [R, D]) into a [n, in, r] / [n, r, out] batch first: what reading in place avoids."""
    by_module = {m: (y, x) for m, y, x in targets}
    for g in groups:
        y, x = by_module[g.module]
        n = g.tokens.numel()
        at = rows.index_select(0, g.a_index).view(n, -1, g.rank)  # [n, in, r]
        bt = rows.index_select(0, g.b_index).view(n, g.rank, -1)  # [n, r, out]
        s = torch.bmm(x[g.tokens].unsqueeze(1), at) * g.scales.to(x.dtype)  # [n, 1, r]
        y.index_add_(0, g.tokens, torch.bmm(s, bt).squeeze(1))


# -- one layer's projections -------------------------------------------------------------------


@dataclass
class Layer:
    w_qkv: torch.Tensor  # [q + 2kv, H]
    w_o: torch.Tensor  # [H, q]
    w_gu: torch.Tensor  # [2I, H]
    w_down: torch.Tensor  # [H, I]


def make_layer(shapes: Shapes, device: torch.device) -> Layer:
    h, kv, i = shapes.hidden, shapes.kv_size, shapes.mlp

    def w(o: int, n: int) -> torch.Tensor:
        return (torch.randn(o, n, device=device) / math.sqrt(n)).to(shapes.dtype)

    return Layer(w(h + 2 * kv, h), w(h, h), w(2 * i, h), w(h, i))


@dataclass
class Acts:
    x: torch.Tensor  # [T, H]  input of q/k/v/gate/up and o
    xi: torch.Tensor  # [T, I]  input of down
    qkv: torch.Tensor  # [T, q + 2kv]
    o: torch.Tensor  # [T, H]
    gu: torch.Tensor  # [T, 2I]
    down: torch.Tensor  # [T, H]

    def zero_(self) -> Acts:
        for t in (self.qkv, self.o, self.gu, self.down):
            t.zero_()
        return self


def make_acts(shapes: Shapes, batch: int, device: torch.device) -> Acts:
    h, kv, i, dt = shapes.hidden, shapes.kv_size, shapes.mlp, shapes.dtype
    return Acts(
        x=torch.randn(batch, h, device=device).to(dt),
        xi=torch.randn(batch, i, device=device).to(dt),
        qkv=torch.zeros(batch, h + 2 * kv, device=device, dtype=dt),
        o=torch.zeros(batch, h, device=device, dtype=dt),
        gu=torch.zeros(batch, 2 * i, device=device, dtype=dt),
        down=torch.zeros(batch, h, device=device, dtype=dt),
    )


def lora_targets(shapes: Shapes, acts: Acts) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(module index, output slice, input) of the 7 projections, one apply_lora call each."""
    h, kv, i = shapes.hidden, shapes.kv_size, shapes.mlp
    return [
        (0, acts.qkv[:, :h], acts.x), (1, acts.qkv[:, h : h + kv], acts.x), (2, acts.qkv[:, h + kv :], acts.x),
        (3, acts.o, acts.x), (4, acts.gu[:, :i], acts.x), (5, acts.gu[:, i:], acts.x), (6, acts.down, acts.xi),
    ]


def lora_groups(shapes: Shapes, acts: Acts) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, torch.Tensor]]:
    """(modules, column bounds, fused output, input) of the layer's 4 projections, as the model calls
    apply_lora_group: q/k/v and gate/up each share x and one fused output."""
    h, kv, i = shapes.hidden, shapes.kv_size, shapes.mlp
    return [
        ((0, 1, 2), (0, h, h + kv, h + 2 * kv), acts.qkv, acts.x), ((3,), (0, h), acts.o, acts.x),
        ((4, 5), (0, i, 2 * i), acts.gu, acts.x), ((6,), (0, h), acts.down, acts.xi),
    ]


def layer_bytes(layer: Layer) -> int:
    return sum(w.numel() * w.element_size() for w in (layer.w_qkv, layer.w_o, layer.w_gu, layer.w_down))


def base_gemms(layer: Layer, acts: Acts) -> None:
    torch.mm(acts.x, layer.w_qkv.t(), out=acts.qkv)
    torch.mm(acts.x, layer.w_o.t(), out=acts.o)
    torch.mm(acts.x, layer.w_gu.t(), out=acts.gu)
    torch.mm(acts.xi, layer.w_down.t(), out=acts.down)


def contiguous_weights(pool_rows: torch.Tensor, batch: LoraBatch, shapes: Shapes) -> dict:
    """(adapter id, module) -> (A [r, in], B^T [r, out], scale), copied out of the pool once."""
    out = {}
    for seg in batch.segments:
        res = seg.adapter
        for (layer, m), slot in res.slots.items():
            if (id(res), m) in out:
                continue
            a = pool_rows.index_select(0, res.a_index(layer, m)).view(-1, slot.rank).t().contiguous()  # A^T -> A
            b = pool_rows.index_select(0, res.b_index(layer, m)).view(slot.rank, -1).contiguous()
            out[(id(res), m)] = (a, b, slot.scale)
    return out


def loop_over_adapters(targets, batch: LoraBatch, weights: dict) -> None:
    for seg in batch.segments:
        rows = slice(seg.start, seg.start + seg.length)
        for m, y, x in targets:
            a, b, scale = weights[(id(seg.adapter), m)]
            y[rows] += ((x[rows] @ a.t()) * scale) @ b


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    if not torch.isfinite(ours).all():
        return math.inf
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@dataclass
class SgmvBench:
    """What every SGMV case shares: the pool with its adapters, the layer's weights, the ceilings."""

    shapes: Shapes
    device: torch.device
    timer: Timer
    ops: object  # KernelOps
    rows: torch.Tensor  # [R, D], the pool's adapter view
    adapters: AdapterSet
    layer: Layer
    copy_gbps: float

    @property
    def tol(self) -> float:
        return 1e-4 if self.shapes.dtype == torch.float32 else 3e-2


def adapter_half_bytes(shapes: Shapes, res: AdapterResidency, half: str) -> int:
    """Bytes of one placed adapter's A matrices (half "a": rank x in per module) or B matrices ("b": rank x out)."""
    total = 0
    for name in TARGET_MODULES:
        in_f, out_f = shapes.module_shape(name)
        total += res.max_rank * (in_f if half == "a" else out_f)
    return total * shapes.dtype.itemsize


@dataclass
class GroupHalves:
    """The layer's 4 grouped calls' step plans (triton_sgmv's, with the partials buffer and K-split
    apply_lora_group uses), whose shrink and expand launches are timed apart."""

    calls: list  # (plan, y, x)

    @staticmethod
    def of(b: SgmvBench, batch: LoraBatch, grouped_targets) -> GroupHalves:
        from loraplex.kernels import triton_sgmv

        calls = []
        for mods, bounds, y, x in grouped_targets:
            rank = triton_sgmv._group_rank(batch, 0, mods)
            calls.append((triton_sgmv._group_plan(batch, b.rows, x, mods, bounds, rank, None), y, x))
        return GroupHalves(calls)

    def shrink(self) -> None:
        for plan, _, x in self.calls:
            plan.shrink(x, 0)

    def expand(self) -> None:
        for plan, y, _ in self.calls:
            plan.expand(y, 0)


def sgmv_case(b: SgmvBench, popularity: str, set_name: str, batch: int, rng: random.Random) -> dict:
    """Check and time one (popularity, ranks, batch) case."""
    token_adapter = assign(popularity, batch, rng)
    res_list = b.adapters.by_set[set_name]
    ours_batch = runner_batch(res_list, token_adapter)
    acts = make_acts(b.shapes, batch, b.device)
    targets = lora_targets(b.shapes, acts)
    weights = contiguous_weights(b.rows, ours_batch, b.shapes)

    def ours(split: int | None = None) -> None:
        for m, y, x in targets:
            b.ops.apply_lora(y, x, b.rows, ours_batch, 0, m, split=split)

    grouped_targets = lora_groups(b.shapes, acts)

    def ours_grouped() -> None:
        for mods, bounds, y, x in grouped_targets:
            b.ops.apply_lora_group(y, x, b.rows, ours_batch, 0, mods, bounds)

    halves = GroupHalves.of(b, ours_batch, grouped_targets)
    groups = gather_groups(res_list, token_adapter, [m for m, _, _ in targets], b.device)

    def gather_bmm() -> None:
        gather_bmm_apply(targets, b.rows, groups)

    def loop() -> None:
        loop_over_adapters(targets, ours_batch, weights)

    def base() -> None:
        base_gemms(b.layer, acts)

    # Check: each method's deltas against the gather baseline's.
    deltas = {}
    for name, fn in (("ours", ours), ("ours_grouped", ours_grouped), ("gather_bmm", gather_bmm), ("loop", loop)):
        acts.zero_()
        fn()
        deltas[name] = torch.cat([acts.qkv, acts.o, acts.gu, acts.down], dim=1).float()
    err = {k: rel_err(v, deltas["gather_bmm"]) for k, v in deltas.items() if k != "gather_bmm"}

    rec = {
        "popularity": popularity, "ranks": set_name, "batch": batch,
        "distinct_adapters": len(set(token_adapter)), "segments": len(ours_batch.segments),
        "check_rel_err": err, "check_ok": all(e < b.tol for e in err.values()),
        "base_us": b.timer(base), "base_graph_us": b.timer.graph(base),
        "ours_us": b.timer(ours), "ours_graph_us": b.timer.graph(ours),
        "ours_grouped_us": b.timer(ours_grouped), "ours_grouped_graph_us": b.timer.graph(ours_grouped),
        "ours_grouped_rel_err": err["ours_grouped"],
        "gather_bmm_us": b.timer(gather_bmm), "loop_us": b.timer(loop),
    }
    # The two halves of the grouped calls apart (graph replay where captured): shrink reads A, expand B; each
    # half's rate is its own matrices' bytes over its time, so the slow half shows.
    rec["shrink_us"] = b.timer.best(halves.shrink)
    rec["expand_us"] = b.timer.best(halves.expand)
    used = [res_list[a] for a in set(token_adapter)]
    a_bytes, b_bytes = (sum(adapter_half_bytes(b.shapes, r, half) for r in used) for half in ("a", "b"))
    rec["shrink_gbps"] = a_bytes / rec["shrink_us"] / 1e3
    rec["expand_gbps"] = b_bytes / rec["expand_us"] / 1e3
    rec["adapter_bytes"] = sum(b.adapters.bytes_of[id(res_list[a])] for a in set(token_adapter))
    rec["base_bytes"] = layer_bytes(b.layer)
    # Both sides memory-bound at decode: reading the adapters can cost no less than this share of
    # reading the base weights.
    rec["floor_over_base"] = rec["adapter_bytes"] / rec["base_bytes"]
    kernel_us = rec["ours_graph_us"] or rec["ours_us"]
    rec["ours_over_base"] = kernel_us / (rec["base_graph_us"] or rec["base_us"])
    rec["adapter_read_gbps"] = rec["adapter_bytes"] / kernel_us / 1e3
    rec["adapter_read_vs_copy"] = rec["adapter_read_gbps"] / b.copy_gbps
    if (popularity, set_name, batch) in b.shapes.sgmv_sweep:
        rec["split_sweep_us"] = {split: b.timer.best(lambda split=split: ours(split)) for split in (1, 2, 4, 8, 16, 32)}
        print(f"  split sweep: {rec['split_sweep_us']}")
    print(f"  sgmv {popularity:8s} {set_name:5s} B={batch:3d}: base {rec['base_us']:8.1f} us, ours "
          f"{rec['ours_us']:8.1f} (graph {fmt(rec['ours_graph_us'])}), grouped {rec['ours_grouped_us']:8.1f} "
          f"(graph {fmt(rec['ours_grouped_graph_us'])}), gather+bmm {rec['gather_bmm_us']:8.1f}, "
          f"loop {rec['loop_us']:8.1f}; shrink {rec['shrink_us']:.1f} ({rec['shrink_gbps']:.0f} GB/s), expand "
          f"{rec['expand_us']:.1f} ({rec['expand_gbps']:.0f} GB/s); "
          f"ours/base {rec['ours_over_base']:.2f} (floor {rec['floor_over_base']:.2f}); "
          f"{rec['adapter_read_gbps']:.0f} GB/s; check {'ok' if rec['check_ok'] else 'FAILED'} {err}")
    return rec


def guarded(label: str, case: Callable[[], dict]) -> dict:
    """One case's record, or its error: the GPU run is a single call on a lent machine, so a case that
    fails (a compile error at one shape, say) is recorded and printed, and the others still run."""
    try:
        return case()
    except Exception as e:  # noqa: BLE001 - reported in the table and the exit status
        traceback.print_exc()
        print(f"  {label}: ERROR {type(e).__name__}: {e}")
        return {"case": label, "error": f"{type(e).__name__}: {e}", "check_ok": False}


def bench_sgmv(shapes: Shapes, device: torch.device, timer: Timer, ops, deadline: float, ceil: dict) -> list[dict]:
    n = max(shapes.batches)
    ranks = {r for rs in shapes.rank_sets.values() for r in rs}
    probe = pool_geometry(shapes, 1)
    geometry = pool_geometry(shapes, n * sum(adapter_pages(shapes, probe, r) for r in ranks) + 16)
    pool = PagePool(geometry, device)
    t0 = time.time()
    adapters = place_adapters(shapes, pool, PageDealer(geometry.num_pages))
    print(f"placed adapters in {time.time() - t0:.1f} s ({pool.tensor.numel() * shapes.dtype.itemsize / 1e9:.2f} GB pool)")
    bench = SgmvBench(shapes, device, timer, ops, pool.rows(), adapters, make_layer(shapes, device),
                      ceil["copy_gbps_read_plus_write"])
    rng = random.Random(0)
    results = []
    for popularity in shapes.popularity:
        for set_name in shapes.rank_sets:
            for batch in shapes.batches:
                if time.time() > deadline:
                    print(f"  time budget spent: skipping sgmv {popularity} {set_name} batch {batch}")
                    continue
                label = f"sgmv {popularity} {set_name} batch {batch}"
                results.append(guarded(label, lambda: sgmv_case(bench, popularity, set_name, batch, rng)))
    return results


# -- paged decode attention --------------------------------------------------------------------


def decode_meta(shapes: Shapes, batch: int, dealer: PageDealer, device: torch.device) -> AttentionMetadata:
    bs = shapes.block_size
    n = shapes.context
    nb = -(-n // bs)
    tables = torch.from_numpy(np.stack([dealer.take(nb) for _ in range(batch)]).astype(np.int32))[None]  # [1, B, nb]
    pos = torch.full((batch,), n - 1, dtype=torch.long)
    return AttentionMetadata(
        block_size=bs,
        positions=pos.to(device),
        query_start=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), n, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_pages=tables[0, torch.arange(batch), (pos // bs)][None].long().to(device),
        slot_offsets=(pos % bs).to(device),
        query_lens_host=(1,) * batch,
        seq_lens_host=(n,) * batch,
    )


def attention_case(shapes: Shapes, timer: Timer, ops, kv: torch.Tensor, meta: AttentionMetadata, copy_gbps: float) -> dict:
    """Check and time decode attention of one batch (and sweep the launch knobs where asked)."""
    from loraplex.kernels import triton_attention

    batch = meta.num_seqs
    scale = shapes.head_dim**-0.5
    q = torch.randn(batch, shapes.num_heads, shapes.head_dim, device=kv.device).to(shapes.dtype)

    def ours() -> None:
        ops.paged_attention(q, kv, meta, 0, scale)

    def reference() -> None:
        torch_attention.paged_attention(q, kv, meta, 0, scale)

    def tuned(block_n: int, warps: int, splits: int | None) -> None:
        triton_attention.paged_attention(q, kv, meta, 0, scale, decode_block_n=block_n, decode_warps=warps,
                                         decode_splits=splits)

    err = rel_err(ops.paged_attention(q, kv, meta, 0, scale).float(),
                  torch_attention.paged_attention(q, kv, meta, 0, scale).float())
    kv_bytes = batch * shapes.context * 2 * shapes.kv_heads * shapes.head_dim * shapes.dtype.itemsize
    rec = {
        "batch": batch, "context": shapes.context, "kv_bytes": kv_bytes,
        "check_rel_err": err, "check_ok": err < (1e-4 if shapes.dtype == torch.float32 else 3e-2),
        "ours_us": timer(ours), "ours_graph_us": timer.graph(ours), "torch_us": timer(reference),
    }
    if batch in shapes.attention_sweep:
        splits_options = (None, 1) if batch > 1 else (None, 4, 16)
        rec["config_sweep_us"] = {
            f"n{n}-w{w}-s{sp}": timer.best(lambda n=n, w=w, sp=sp: tuned(n, w, sp))
            for n in (16, 32, 64) for w in (4, 8) for sp in splits_options
        }
        print(f"  attention sweep B={batch}: {rec['config_sweep_us']}")
    kernel_us = rec["ours_graph_us"] or rec["ours_us"]
    rec["kv_read_gbps"] = kv_bytes / kernel_us / 1e3
    rec["kv_read_vs_copy"] = rec["kv_read_gbps"] / copy_gbps
    print(f"  attention B={batch:3d} ctx={shapes.context}: ours {rec['ours_us']:8.1f} us (graph "
          f"{fmt(rec['ours_graph_us'])}), torch {rec['torch_us']:8.1f}; {rec['kv_read_gbps']:.0f} GB/s "
          f"({100 * rec['kv_read_vs_copy']:.0f}% of copy); check {'ok' if rec['check_ok'] else 'FAILED'} {err:.1e}")
    return rec


def bench_attention(shapes: Shapes, device: torch.device, timer: Timer, ops, deadline: float, ceil: dict) -> list[dict]:
    nb = -(-shapes.context // shapes.block_size)
    geometry = pool_geometry(shapes, nb * max(shapes.batches) + 16)
    pool = PagePool(geometry, device)
    kv = pool.kv_view()
    kv.copy_(torch.randn(tuple(kv.shape), device=device).to(shapes.dtype))
    results = []
    for batch in shapes.batches:
        if time.time() > deadline:
            print(f"  time budget spent: skipping attention batch {batch}")
            continue
        # A fresh dealer per batch: the pool holds the largest batch's pages, not the sum of every batch's.
        dealer = PageDealer(geometry.num_pages, seed=1)
        results.append(guarded(f"attention batch {batch}", lambda: attention_case(
            shapes, timer, ops, kv, decode_meta(shapes, batch, dealer, device), ceil["copy_gbps_read_plus_write"])))
    return results


# -- report ------------------------------------------------------------------------------------


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def markdown(report: dict) -> str:
    c = report["ceilings"]
    lines = [
        f"# Triton kernels on {report['device']} ({report['date']})",
        "",
        f"Ceilings: copy {c['copy_gbps_read_plus_write']:.0f} GB/s (read + write), {c['matmul_dtype']} matmul "
        f"{c['matmul_tflops']:.1f} TFLOP/s ({c['matmul_n']}^3). Shapes: {report['shapes']}.",
        "",
        "## SGMV, one layer's 7 projections (decode batch)",
        "",
        "ours/base: our kernel time (graph replay where captured) over the base GEMMs'; floor: adapter bytes over "
        "base-weight bytes, the least ours/base can be when both read their weights at the same bandwidth. "
        "ours grouped: the same deltas in 4 apply_lora_group calls (q/k/v and gate/up one shrink and one expand launch each); "
        "shrink and expand: those calls' two halves timed apart, each with the rate at which it reads its own matrices "
        "(A for the shrink, B for the expand).",
        "",
        "| adapters | ranks | batch | distinct | base us | ours us (graph) | ours grouped us (graph) | shrink us (A GB/s) | expand us (B GB/s) | gather+bmm us | loop us | ours/base | floor | adapter GB/s | % of copy | check |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in ok_rows(report["sgmv"]):
        lines.append(
            f"| {r['popularity']} | {r['ranks']} | {r['batch']} | {r['distinct_adapters']} | {r['base_us']:.1f} "
            f"| {r['ours_us']:.1f} ({fmt(r['ours_graph_us'])}) | {r['ours_grouped_us']:.1f} ({fmt(r['ours_grouped_graph_us'])}) "
            f"| {r['shrink_us']:.1f} ({r['shrink_gbps']:.0f}) | {r['expand_us']:.1f} ({r['expand_gbps']:.0f}) "
            f"| {r['gather_bmm_us']:.1f} | {r['loop_us']:.1f} "
            f"| {r['ours_over_base']:.2f} | {r['floor_over_base']:.2f} | {r['adapter_read_gbps']:.0f} | {100 * r['adapter_read_vs_copy']:.0f} "
            f"| {'ok' if r['check_ok'] else 'FAILED'} |")
    lines += [
        "",
        f"## Paged decode attention ({report['shapes']['num_heads']} heads, {report['shapes']['kv_heads']} KV heads, "
        f"head_dim {report['shapes']['head_dim']})",
        "",
        "| batch | context | ours us (graph) | torch us | KV GB/s | % of copy | check |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in ok_rows(report["attention"]):
        lines.append(f"| {r['batch']} | {r['context']} | {r['ours_us']:.1f} ({fmt(r['ours_graph_us'])}) | "
                     f"{r['torch_us']:.1f} | {r['kv_read_gbps']:.0f} | {100 * r['kv_read_vs_copy']:.0f} | "
                     f"{'ok' if r['check_ok'] else 'FAILED'} |")
    errors = [r for r in report["sgmv"] + report["attention"] if "error" in r]
    if errors:
        lines += ["", "## Cases that failed to run", ""] + [f"- {r['case']}: {r['error']}" for r in errors]
    lines.append("")
    return "\n".join(lines)


def ok_rows(records: list[dict]) -> list[dict]:
    return [r for r in records if "error" not in r]


def run(shapes: Shapes, device: torch.device, out_dir: Path, budget_s: float, dry_run: bool) -> dict:
    """Measure everything (attention first: it is quick, and the SGMV cases are skipped past the budget)."""
    start = time.time()
    deadline = start + budget_s
    from loraplex.kernels import select_kernels

    ops = select_kernels(device, "triton")
    timer = Timer(device, shapes.reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter, dry run)"
    print(f"{name}; torch {torch.__version__}; dtype {shapes.dtype}")
    ceil = ceilings(shapes, device, timer)
    attention = bench_attention(shapes, device, timer, ops, deadline, ceil)
    sgmv = bench_sgmv(shapes, device, timer, ops, deadline, ceil)

    shape_info = {k: v for k, v in asdict(shapes).items() if k != "dtype"}
    shape_info["dtype"] = str(shapes.dtype)
    import triton

    report = {
        "device": name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "dry_run": dry_run, "shapes": shape_info, "ceilings": ceil,
        "sgmv": sgmv, "attention": attention, "wall_s": time.time() - start,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels_gpu.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (out_dir / "kernels_gpu.md").write_text(md)
    print(md)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out", help="folder for kernels_gpu.{json,md}")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip remaining cases after this many seconds")
    args = parser.parse_args(argv)
    if args.dry_run:
        shapes, device = DRY, torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    else:
        shapes, device = LLAMA3_8B, torch.device("cuda")
    report = run(shapes, device, args.out, args.budget_s, args.dry_run)
    failed = [r for r in report["sgmv"] + report["attention"] if not r["check_ok"]]
    print(f"done in {report['wall_s']:.0f} s; {len(failed)} failed checks; wrote {args.out}/kernels_gpu.{{json,md}}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
