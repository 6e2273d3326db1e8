"""The physical floor, measured in the same run: bandwidth and matmul rate, FLOPs per decode token, and
our decode throughput at batch 64 as a share of the compute ceiling."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from loraplex.engine import EngineCore
from loraplex.lora.types import TARGET_MODULES
from loraplex.models.config import ModelConfig

from decode_step import time_ours
from roofline import matmul_gflops, measure_roofline

from .workload import FIRST_PROMPT_ID, adapter_elements


@dataclass(frozen=True)
class Ceilings:
    device: str
    dtype: str  # of the matmul measured (the model's dtype)
    read_gbps: float  # on the CPU the median over fresh buffers (roofline.measure_roofline)
    copy_gbps: float  # bytes read + bytes written
    matmul_gflops: float  # the best of matmul_by_backend on the CPU (roofline.py: one library is not a ceiling)
    threads: int
    matmul_by_backend: dict[str, float] = field(default_factory=dict)
    # On a GPU: where adapter loads go (the floor prices them there); None on the CPU.
    host_read_gbps: float | None = None  # host memory, read (a CPU tensor's sum)
    h2d_gbps: float | None = None  # pinned host memory to the device
    read_gbps_by_buffer: list[float] = field(default_factory=list)  # the CPU's: each fresh buffer's best read

    def as_dict(self) -> dict:
        return asdict(self)


def _best_cuda(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def measure_ceilings(device: torch.device, dtype: torch.dtype, mib: int = 512, reps: int = 5,
                     n: int = 2048) -> Ceilings:
    if device.type != "cuda":
        if dtype != torch.float32:
            raise ValueError("the CPU roofline measures float32 matmuls; run the CPU benchmark in float32")
        r = measure_roofline(mib=mib, n=n, reps=reps)
        return Ceilings("cpu", "float32", r.read_gbps, r.copy_gbps, r.matmul_gflops_fp32, r.threads,
                        r.matmul_by_backend, read_gbps_by_buffer=r.read_gbps_by_buffer)
    x = torch.ones(4 * mib * (1 << 20) // 4, device=device)  # 4x larger than the CPU's: caches are larger
    y = torch.empty_like(x)
    read = x.numel() * 4 / _best_cuda(lambda: x.sum(), reps) / 1e9
    copy = 2 * x.numel() * 4 / _best_cuda(lambda: y.copy_(x), reps) / 1e9
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / _best_cuda(lambda: a @ b, reps) / 1e9
    host = torch.ones(mib * (1 << 20) // 4)  # [mib MiB] float32
    host_read = host.numel() * 4 / _best_cuda(lambda: host.sum(), reps) / 1e9
    pinned = host.pin_memory()
    dev = torch.empty_like(pinned, device=device)
    h2d = pinned.numel() * 4 / _best_cuda(lambda: dev.copy_(pinned), reps) / 1e9
    return Ceilings(str(device), str(dtype).removeprefix("torch."), read, copy, flops, torch.get_num_threads(),
                    host_read_gbps=host_read, h2d_gbps=h2d)


def linear_params(cfg: ModelConfig) -> int:
    """Weights that take part in matmuls per token: the 7 projections of every layer and the LM head."""
    per_layer = sum(i * o for i, o in (cfg.module_shape(m) for m in TARGET_MODULES))
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def decode_flops_per_token(cfg: ModelConfig, context: int, mean_rank: float = 0.0) -> float:
    """2 x matmul weights + attention over `context` cached tokens (QK^T and PV) + LoRA shrink/expand."""
    attention = 2 * 2 * cfg.num_layers * context * cfg.num_heads * cfg.head_dim
    lora = 2 * adapter_elements(cfg, 1) * mean_rank
    return 2 * linear_params(cfg) + attention + lora


def request_matmul_flops(cfg: ModelConfig, prompt_tokens: int, output_tokens: int, rank: int = 0) -> float:
    """Matmul FLOPs any engine spends on one request, at the least: every prompt and output token through
    the 7 projections of every layer (and its LoRA at `rank`), the LM head once per output token.
    Attention is left out, so this is a floor."""
    tokens = prompt_tokens + output_tokens
    layers = linear_params(cfg) - cfg.vocab_size * cfg.hidden_size
    return 2.0 * (tokens * (layers + adapter_elements(cfg, rank)) + output_tokens * cfg.vocab_size * cfg.hidden_size)


@dataclass(frozen=True)
class DecodeShare:
    batch: int
    context: int
    adapters: str  # "none" or "k distinct, mean rank r"
    step_s: float  # fastest decode step of `batch` requests
    tokens_per_s: float
    flops_per_token: float
    achieved_gflops: float
    share_of_compute_ceiling: float  # of ceiling_gflops
    # The matmul rate measured just before each timed step (the best of them): on a CPU whose speed drifts
    # over minutes (the AMD dev machine: 40-60 GFLOP/s), the run's opening roofline may not hold here.
    ceiling_gflops: float
    run_ceiling_gflops: float  # the run's opening roofline, for comparison

    def as_dict(self) -> dict:
        return asdict(self)


def decode_share(engine: EngineCore, ceilings: Ceilings, adapters: Sequence[str | None], ranks: dict[str, int],
                 batch: int = 64, context: int = 128, steps: int = 4, matmul_n: int = 2048) -> DecodeShare:
    """Time `steps` decode steps of `batch` requests (each at `context` tokens) and compare with the ceiling.
    `adapters` are cycled over the batch (None: the base model)."""
    cfg = engine.model_config
    g = torch.Generator().manual_seed(64)
    prompts = torch.randint(FIRST_PROMPT_ID, cfg.vocab_size, (batch, context), generator=g).tolist()
    names = [adapters[i % len(adapters)] for i in range(batch)]
    adjacent: list[float] = []
    on_cpu = engine.config.torch_device.type == "cpu"
    before = (lambda: adjacent.append(matmul_gflops(matmul_n, reps=1))) if on_cpu else None
    step = time_ours(engine, prompts, names, steps, before)
    ceiling = max(adjacent) if adjacent else ceilings.matmul_gflops
    used = [ranks[n] for n in names if n is not None]
    mean_rank = sum(used) / batch if used else 0.0
    flops = decode_flops_per_token(cfg, context, mean_rank)
    tok_s = batch / step
    label = "none" if not used else f"{len(set(n for n in names if n))} distinct, mean rank {mean_rank:.1f}"
    return DecodeShare(batch, context, label, step, tok_s, flops, tok_s * flops / 1e9,
                       tok_s * flops / (ceiling * 1e9), ceiling, ceilings.matmul_gflops)
