"""Decode step time on the default model: loraplex against transformers + PEFT, and the floor.

For B in {1, 16, 64} requests at 128 tokens of context, three cases: no adapters, one rank-16
adapter on all 7 projections shared by the batch, and B distinct rank-16 adapters. Both systems run
the same cases in the same run; the floor is

    our base step + adapter bytes read / measured read bandwidth + LoRA FLOPs / measured FLOP/s

Every timed step of ours decodes exactly B requests (checked): the pool (--pool-gib) holds all B
adapters and their KV, and no request finishes inside the timed steps.

Writes JSON (--out) and prints a table. Usage:
    python benchmarks/decode_step.py [--batches 1 16 64] [--steps 5] [--threads N] [--pool-gib 3] [--kernels auto|torch|cpu]
                                     [--out benchmarks/results/decode_step.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from loraplex.config import EngineConfig
from loraplex.engine import EngineCore, SamplingParams
from loraplex.lora.types import TARGET_MODULES

from roofline import measure_roofline

CONTEXT = 128
RANK = 16
PREFILL_STEPS_ROOM = 32  # output tokens of headroom for the decodes that run during prefill


def make_adapters(model_dir: Path, out: Path, n: int) -> list[Path]:
    """n random rank-16 PEFT adapters on all 7 projections, saved as PEFT folders."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGET_MODULES), lora_dropout=0.0)
    model = get_peft_model(base, cfg, adapter_name="a0")
    paths = []
    for i in range(n):
        name = f"a{i}"
        if i:
            model.add_adapter(name, cfg)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if f".{name}." in pname and ("lora_A" in pname or "lora_B" in pname):
                    p.normal_(0.0, 0.02)
        path = out / name
        model.save_pretrained(path, selected_adapters=[name])
        # save_pretrained puts non-default adapters in a subfolder named after them
        paths.append(path / name if (path / name).exists() else path)
    return paths


def adapter_cost(model_cfg, batch_adapters: int, tokens: int) -> tuple[int, int]:
    """(bytes of adapter weights read, LoRA FLOPs) of one decode step."""
    per_adapter_elems = 0
    for m in TARGET_MODULES:
        i, o = model_cfg.module_shape(m)
        per_adapter_elems += RANK * (i + o)
    per_adapter_elems *= model_cfg.num_layers
    return batch_adapters * per_adapter_elems * 4, 2 * tokens * per_adapter_elems


def time_ours(engine: EngineCore, prompts, adapters, steps: int, before_step=None) -> float:
    """Fastest of `steps` decode steps of the batch; before_step() (untimed) runs before each one."""
    # Requests prefilled in the first chunks decode while later prompts prefill (B=64 takes several
    # steps): max_tokens leaves room for those tokens, so no request finishes inside the timed steps.
    params = SamplingParams(max_tokens=steps + PREFILL_STEPS_ROOM, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params, a) for p, a in zip(prompts, adapters)]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
        engine.step()  # prefill
    times = []
    for _ in range(steps):
        if before_step is not None:
            before_step()
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        # Every timed step must be one decode token for each of the B requests, as transformers runs.
        if len(outs) != len(reqs) or any(o.finished for o in outs):
            raise RuntimeError(
                f"a timed step decoded {len(outs)} of {len(reqs)} requests: the pool is too small "
                f"for the batch and its adapters (raise --pool-gib)"
            )
    for r in reqs:
        engine.abort_request(r.request_id)
    return min(times)


def time_peft(model, prompts, adapter_names, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    kwargs = {"adapter_names": adapter_names} if adapter_names is not None else {}
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, **kwargs)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True, **kwargs)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every system (default: torch's)")
    ap.add_argument("--pool-gib", type=float, default=3.0,
                    help="page pool size: B distinct rank-16 adapters (19.5 MB each) and their KV must all fit")
    ap.add_argument("--kernels", default="auto", help="kernel backend of ours (auto: the C++ kernels on the CPU)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_step.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    roof = measure_roofline()

    engine = EngineCore(EngineConfig(model="default", dtype="float32", kernels=args.kernels, max_lora_rank=64,
                                     pool_bytes=int(args.pool_gib * (1 << 30))))
    cfg = engine.model_config
    nmax = max(args.batches)
    tmp = Path(tempfile.mkdtemp(prefix="lp-bench-"))
    paths = make_adapters(engine.model_path, tmp, nmax)
    for i, p in enumerate(paths):
        engine.load_adapter(f"a{i}", p)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32), paths[0], adapter_name="a0"
    )
    for i, p in enumerate(paths[1:], start=1):
        peft.load_adapter(p, adapter_name=f"a{i}")
    peft.eval()

    rows = []
    g = torch.Generator().manual_seed(1)
    for b in args.batches:
        prompts = torch.randint(10, cfg.vocab_size, (b, CONTEXT), generator=g).tolist()
        cases = {
            "base": ([None] * b, None, 0),
            "shared": (["a0"] * b, ["a0"] * b, 1),
            "distinct": ([f"a{i}" for i in range(b)], [f"a{i}" for i in range(b)], b),
        }
        base_ours = time_ours(engine, prompts, [None] * b, args.steps)
        for case, (ours_adapters, peft_names, n_adapters) in cases.items():
            ours = base_ours if case == "base" else time_ours(engine, prompts, ours_adapters, args.steps)
            ref = time_peft(hf if case == "base" else peft, prompts, peft_names, args.steps)
            nbytes, flops = adapter_cost(cfg, n_adapters, b)
            floor = base_ours + nbytes / (roof.read_gbps * 1e9) + flops / (roof.matmul_gflops_fp32 * 1e9)
            rows.append(
                dict(batch=b, case=case, ours_ms=ours * 1e3, peft_ms=ref * 1e3, floor_ms=floor * 1e3,
                     ours_vs_peft=ref / ours, ours_over_floor=ours / floor, adapter_mb=nbytes / 1e6)
            )
            print(f"B={b:3d} {case:9s} ours {ours*1e3:8.1f} ms  {'transformers' if case == 'base' else 'peft':12s} "
                  f"{ref*1e3:8.1f} ms  floor {floor*1e3:8.1f} ms  x{ref/ours:5.2f} vs peer  {ours/floor:5.2f} of floor",
                  flush=True)

    result = dict(
        date=time.strftime("%Y-%m-%d"), machine="CPU", torch=torch.__version__, roofline=roof.as_dict(),
        kernels=engine.ops.name, context=CONTEXT, rank=RANK, model="SmolLM2-135M-Instruct (float32)", rows=rows,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nroofline: read {roof.read_gbps:.1f} GB/s, copy {roof.copy_gbps:.1f} GB/s, "
          f"matmul {roof.matmul_gflops_fp32:.0f} GFLOP/s ({roof.threads} threads)")
    print(f"| B | case | loraplex ms | peer ms | floor ms | speed-up vs peer | of floor |")
    print(f"|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['case']} | {r['ours_ms']:.1f} | {r['peft_ms']:.1f} | {r['floor_ms']:.1f} | "
              f"{r['ours_vs_peft']:.2f}x | {r['ours_over_floor']:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
