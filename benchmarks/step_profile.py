"""Where one decode step's time goes: host work (Python functions, torch ops, launches) against device work.

The H200 run of 2026-12-04 found the engine's decode step host-bound (29.6 ms for a batch of 64 on a
Qwen2.5-1.5B-shaped model whose weights stream in 0.75 ms). This profiles such steps, without and with
distinct adapters, so that the next change goes where the time is:

- step wall time (median of unprofiled steps);
- device busy time per step (sum of the kernels' durations) and kernel launches per step (torch.profiler);
- the Python functions with the most own time per step (cProfile), which is where a host-bound step goes;
- where the kernel backend brings its own RMSNorm / RoPE / SwiGLU kernels (Triton), the same cases again with
  the model's torch formulas in their place.

    python3 benchmarks/step_profile.py --gpu [--batch 64] [--context 128] [--adapters 64] [--out DIR]
    .venv/bin/python benchmarks/step_profile.py --model DIR     # CPU, any checkpoint (the tests use a tiny one)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH))

import torch  # noqa: E402

from e2e.workload import write_random_adapter  # noqa: E402
from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine import EngineCore, SamplingParams  # noqa: E402

RANK = 16


def _decode_batch(engine: EngineCore, batch: int, context: int, adapters: list[str | None], steps: int) -> list:
    """Requests of `context` prompt tokens, prefilled; they then decode for `steps` more steps at least."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, vocab, (batch, context), generator=g).tolist()
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params, adapters[i % len(adapters)]) for i, p in enumerate(prompts)]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
        engine.step()
    return reqs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_case(engine: EngineCore, batch: int, context: int, adapters: list[str | None], steps: int,
                 top: int) -> dict:
    device = engine.config.torch_device
    reqs = _decode_batch(engine, batch, context, adapters, 3 * steps)
    walls = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        outs = engine.step()
        _sync(device)
        walls.append(time.perf_counter() - t)
        if len(outs) != batch:
            raise RuntimeError(f"a step decoded {len(outs)} of {batch} requests: raise the pool size")
    # Device view: kernels and their durations.
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA] if device.type == "cuda" else []
    device_us = sum(e.self_device_time_total for e in kernels) / steps
    launches = sum(e.count for e in kernels) / steps
    top_kernels = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    top_ops = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda e: -e.self_cpu_time_total)[:top]
    # Host view: Python functions by own time.
    pr = cProfile.Profile()
    _sync(device)
    t = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        engine.step()
    _sync(device)
    pr.disable()
    profiled_wall = (time.perf_counter() - t) / steps
    stats = pstats.Stats(pr).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    funcs = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for r in reqs:
        engine.abort_request(r.request_id)
    used = [a for a in adapters if a is not None]
    return {
        "batch": batch, "context": context, "adapters": len(set(used)),
        "step_ms_median": statistics.median(walls) * 1e3, "step_ms_all": [w * 1e3 for w in walls],
        "device_busy_ms_per_step": device_us / 1e3 if device.type == "cuda" else None,
        "kernel_launches_per_step": launches if device.type == "cuda" else None,
        "top_kernels": [{"name": e.key[:120], "ms_per_step": e.self_device_time_total / steps / 1e3,
                         "calls_per_step": e.count / steps} for e in top_kernels],
        "top_torch_ops_cpu": [{"name": e.key, "ms_per_step": e.self_cpu_time_total / steps / 1e3,
                               "calls_per_step": e.count / steps} for e in top_ops],
        "cprofile_step_ms": profiled_wall * 1e3,
        "top_python": [{"function": f"{Path(f).name}:{line}({name})", "own_ms_per_step": v[2] / steps * 1e3,
                        "calls_per_step": v[1] / steps} for (f, line, name), v in funcs],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, a random model of Qwen2.5-1.5B's shape")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the default model; --gpu: built)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=64, help="distinct rank-16 adapters of the second case")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--pool-mib", type=float, default=None)
    ap.add_argument("--kernels", default="auto", help="kernel backend (EngineConfig.kernels): auto, torch, cpu, triton")
    ap.add_argument("--out", type=Path, default=None, help="folder for step_profile.json")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the --gpu model and the adapters are written (e2e/run.py --work-dir reuses the model)")
    args = ap.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="lp-step-"))
    model = args.model
    if args.gpu and model is None:
        from e2e.gpu_model import make_qwen25_15b_shape

        model = str(make_qwen25_15b_shape(work / "qwen25-1.5b-shape"))
    pool = int((args.pool_mib or (4096 if args.gpu else 512)) * (1 << 20))
    econf = EngineConfig(model=model or "default", dtype="bfloat16" if args.gpu else "float32",
                         device="cuda" if args.gpu else "cpu", pool_bytes=pool, max_lora_rank=RANK,
                         max_num_seqs=max(args.batch, 1), kernels=args.kernels)
    engine = EngineCore(econf)
    names = []
    for i in range(args.adapters):
        name = f"p{i}"
        engine.load_adapter(name, write_random_adapter(work / "profile-adapters" / name, engine.model_config, RANK,
                                                        seed=i))
        names.append(name)
    engine.warmup()
    cases = [profile_case(engine, args.batch, args.context, [None], args.steps, args.top)]
    if names:
        cases.append(profile_case(engine, args.batch, args.context, names, args.steps, args.top))
    if engine.ops.pointwise is not None:
        # The same steps with the model's own RMSNorm / RoPE / SwiGLU (torch ops) in place of the backend's kernels:
        # one Triton launch against 2 to 9 torch launches each, whose host costs differ.
        with_kernels = engine.runner.ops
        engine.runner.ops = dataclasses.replace(with_kernels, pointwise=None)
        try:
            for adapters in ([None], names) if names else ([None],):
                case = profile_case(engine, args.batch, args.context, adapters, args.steps, args.top)
                cases.append(dict(case, pointwise="model"))
        finally:
            engine.runner.ops = with_kernels
    for c in cases:
        c.setdefault("pointwise", engine.ops.pointwise.name if engine.ops.pointwise else "model")
    result = {"device": str(econf.torch_device), "gpu": torch.cuda.get_device_name() if args.gpu else None,
              "torch": torch.__version__, "kernels": engine.ops.name, "model": str(engine.model_path),
              "cases": cases}
    for c in cases:
        dev = "" if c["device_busy_ms_per_step"] is None else (
            f", device busy {c['device_busy_ms_per_step']:.2f} ms, {c['kernel_launches_per_step']:.0f} kernels")
        print(f"\nB={c['batch']} ctx={c['context']} adapters {c['adapters']} pointwise {c['pointwise']}: "
              f"step {c['step_ms_median']:.2f} ms"
              f"{dev}; under cProfile {c['cprofile_step_ms']:.2f} ms")
        print("| Python function (own time) | ms/step | calls/step |\n|---|---|---|")
        for f in c["top_python"]:
            print(f"| {f['function']} | {f['own_ms_per_step']:.3f} | {f['calls_per_step']:.0f} |")
        if c["top_kernels"]:
            print("| kernel | ms/step | calls/step |\n|---|---|---|")
            for k in c["top_kernels"]:
                print(f"| {k['name'][:80]} | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_profile.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
