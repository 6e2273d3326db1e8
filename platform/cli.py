"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from loraplex.errors import LoraplexError


def _generate(args: argparse.Namespace) -> int:
    from loraplex.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        pool_bytes=args.pool_bytes,
        max_lora_rank=args.max_lora_rank,
    )
    adapter = None
    if args.adapter:
        adapter = "cli-adapter"
        llm.load_adapter(adapter, args.adapter)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            raise LoraplexError("--chat needs a tokenizer with a chat template")
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    t1 = time.perf_counter()
    out = llm.generate([prompt], params, adapters=[adapter])[0]
    t2 = time.perf_counter()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
        print(
            f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, load {t1 - t0:.1f}s, "
            f"generate {t2 - t1:.2f}s]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt with the base model or an adapter")
    g.add_argument("prompt")
    g.add_argument("--model", default="default", help='checkpoint folder, or "default" (SmolLM2-135M-Instruct)')
    g.add_argument("--adapter", help="PEFT adapter folder")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--pool-bytes", type=int, default=None)
    g.add_argument("--max-lora-rank", type=int, default=256)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=_generate)
    # The adapter store's verbs: db upgrade, gc, adapters upload.
    from loraplex.adapter_store.cli_commands import add_store_commands

    add_store_commands(sub)
    from loraplex.api.cli_commands import add_server_commands

    add_server_commands(sub)
    return p


def drop_checkout_root(path: list[str], root: Path = Path(__file__).resolve().parent.parent) -> list[str]:
    """sys.path without the checkout's root, where this file runs from one (an editable install).

    Why: `python -m loraplex.cli` started in the checkout puts its root first on sys.path, and the root's
    kernels/ folder (installed as loraplex.kernels) then hides the `kernels` distribution that transformers 5
    imports while it loads any model or tokenizer ("cannot import name 'CUDAProperties' from 'kernels'").
    loraplex itself is imported through its installed package mapping, never from the root. Installed from
    a wheel, this file's grandparent is site-packages, which has no platform/cli.py, and nothing is dropped."""
    if not (root / "platform" / "cli.py").is_file() or not (root / "kernels" / "__init__.py").is_file():
        return path
    return [p for p in path if Path(p or ".").resolve() != root]


def main(argv: Sequence[str] | None = None) -> int:
    sys.path[:] = drop_checkout_root(sys.path)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LoraplexError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
