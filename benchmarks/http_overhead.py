"""HTTP overhead: the same requests through `loraplex serve` (OpenAI-style SSE streams) and through the
in-process AsyncEngine, on the default model, in one run.

1. One client, requests one after another: added p50/p99 end-to-end latency per request (HTTP minus
   in-process) and TTFT.
2. 64 concurrent streaming clients: output tokens/s through HTTP as a share of in-process
   (target: at least 95%).
3. 256 concurrent streaming clients held at once: every stream must end with [DONE] and no error.

Every request is greedy with ignore_eos, so both paths produce exactly max_tokens tokens; the text of
each HTTP stream is checked against the in-process output of the same prompt. The server runs in its
own process (as deployed) and the clients in this one; both share this machine's cores, so the
client's own parsing is part of the measured overhead. Writes JSON (--out) and prints a table:

    python benchmarks/http_overhead.py [--tokens 32] [--seq-requests 12] [--out benchmarks/results/http_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.sampling_params import SamplingParams

OPERATOR_KEY = "lpx_bench-operator-key"


@dataclass(frozen=True)
class Result:
    text: str
    tokens: int
    ttft_s: float
    e2e_s: float


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def make_prompts(tokenizer, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("the model serves many adapters in one batch over a unified page pool while tenants upload "
             "their own weights and read usage reports about latency and tokens").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(12, 40))) for _ in range(n)]


# -- in-process ----------------------------------------------------------------------------------------
async def inproc_one(engine: AsyncEngine, prompt: str, tokens: int) -> Result:
    t0 = time.perf_counter()
    first = None
    last = None
    async for out in engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
        if first is None and out.new_token_ids:
            first = time.perf_counter()
        last = out
    return Result(last.text, len(last.token_ids), first - t0, time.perf_counter() - t0)


async def inproc_run(engine: AsyncEngine, prompts: list[str], tokens: int, concurrent: bool) -> tuple[list[Result], float]:
    t0 = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(inproc_one(engine, p, tokens) for p in prompts))
    else:
        results = [await inproc_one(engine, p, tokens) for p in prompts]
    return list(results), time.perf_counter() - t0


# -- HTTP ----------------------------------------------------------------------------------------------
async def http_one(client: httpx.AsyncClient, prompt: str, tokens: int) -> Result:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    text = []
    n = 0
    done = False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk["choices"]:
                piece = chunk["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter()
                text.append(piece)
            elif chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return Result("".join(text), n, (first or time.perf_counter()) - t0, time.perf_counter() - t0)


async def http_run(url: str, key: str, prompts: list[str], tokens: int, concurrent: bool
                   ) -> tuple[list[Result], float, list[str]]:
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600,
                                 limits=limits) as client:
        t0 = time.perf_counter()
        if concurrent:
            raw = await asyncio.gather(*(http_one(client, p, tokens) for p in prompts), return_exceptions=True)
        else:
            raw = []
            for p in prompts:
                try:
                    raw.append(await http_one(client, p, tokens))
                except Exception as e:
                    raw.append(e)
        wall = time.perf_counter() - t0
    errors = [f"{type(r).__name__}: {r}" for r in raw if isinstance(r, BaseException)]
    return [r for r in raw if isinstance(r, Result)], wall, errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, LORAPLEX_OPERATOR_KEY=OPERATOR_KEY, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
           "--max-num-seqs", str(args.max_num_seqs), "--torch-threads", str(args.torch_threads),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def summarise(results: list[Result], wall: float) -> dict:
    tokens = sum(r.tokens for r in results)
    return {"requests": len(results), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "e2e_p50_ms": 1e3 * pct([r.e2e_s for r in results], 50),
            "e2e_p99_ms": 1e3 * pct([r.e2e_s for r in results], 99),
            "ttft_p50_ms": 1e3 * pct([r.ttft_s for r in results], 50),
            "ttft_p99_ms": 1e3 * pct([r.ttft_s for r in results], 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--seq-requests", type=int, default=12, help="requests of the one-client run")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--hold", type=int, default=256, help="concurrent streams of the hold test")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                    help="for both the in-process engine and the server (the server's default)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating in-process / HTTP rounds (pooled)")
    ap.add_argument("--out", default="benchmarks/results/http_overhead.json")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.torch_threads)
    print(f"in-process engine: loading the default model ({args.torch_threads} torch threads) ...", flush=True)
    engine = AsyncEngine(EngineConfig(max_num_seqs=args.max_num_seqs))
    tok = engine.engine.tokenizer
    seq_prompts = make_prompts(tok, args.seq_requests, args.seed)
    conc_prompts = make_prompts(tok, args.clients, args.seed + 1)
    hold_prompts = make_prompts(tok, args.hold, args.seed + 2)

    with tempfile.TemporaryDirectory(prefix="loraplex-http-bench-") as tmp:
        # Both paths stay up for the whole run and their measurements alternate round by round, so a
        # change in this shared machine's load hits both alike (an in-process phase followed by an
        # HTTP phase measured the load's drift as HTTP overhead).
        proc, url = start_server(Path(tmp), args)
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {OPERATOR_KEY}"}) as c:
                key = c.post("/v1/tenants", json={"name": "bench"}).json()["api_key"]

            async def interleaved() -> dict:
                await inproc_run(engine, seq_prompts[:2], args.tokens, False)  # warm-up
                await http_run(url, key, seq_prompts[:2], args.tokens, False)
                runs: dict = {"seq_in": [], "seq_http": [], "conc_in": [], "conc_http": []}
                for _ in range(args.rounds):
                    runs["seq_in"].append(await inproc_run(engine, seq_prompts, args.tokens, False))
                    runs["seq_http"].append(await http_run(url, key, seq_prompts, args.tokens, False))
                    runs["conc_in"].append(await inproc_run(engine, conc_prompts, args.tokens, True))
                    runs["conc_http"].append(await http_run(url, key, conc_prompts, args.tokens, True))
                runs["hold"] = await http_run(url, key, hold_prompts, 16, True)
                return runs

            runs = asyncio.run(interleaved())
        finally:
            proc.send_signal(signal.SIGTERM)
            exit_code = proc.wait(120)
            engine.shutdown()

    mismatches = 0
    for name, prompts in (("seq", seq_prompts), ("conc", conc_prompts)):
        for results, *_ in runs[f"{name}_in"] + runs[f"{name}_http"]:
            want = {p: r.text for p, r in zip(prompts, runs[f"{name}_in"][0][0])}
            mismatches += sum(want[p] != r.text for p, r in zip(prompts, results))
    http_errors = [e for _, _, errs in runs["seq_http"] + runs["conc_http"] for e in errs]

    def pooled(key: str) -> dict:
        """All rounds of one path together: their results, and their walls summed."""
        return summarise([r for res, *_ in runs[key] for r in res], sum(w for _, w, *_ in runs[key]))

    s_in, s_http = pooled("seq_in"), pooled("seq_http")
    c_in, c_http = pooled("conc_in"), pooled("conc_http")
    per_round = [summarise(h[0], h[1])["tokens_per_s"] / summarise(*i)["tokens_per_s"]
                 for i, h in zip(runs["conc_in"], runs["conc_http"])]
    hold_results, hold_wall, hold_errors = runs["hold"]
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "model": "default (SmolLM2-135M-Instruct, float32)", "tokens_per_request": args.tokens,
        "one_client": {"in_process": s_in, "http": s_http,
                       "added_e2e_p50_ms": s_http["e2e_p50_ms"] - s_in["e2e_p50_ms"],
                       "added_e2e_p99_ms": s_http["e2e_p99_ms"] - s_in["e2e_p99_ms"],
                       "added_ttft_p50_ms": s_http["ttft_p50_ms"] - s_in["ttft_p50_ms"]},
        f"{args.clients}_clients": {"in_process": c_in, "http": c_http,
                                    "throughput_ratio": c_http["tokens_per_s"] / c_in["tokens_per_s"],
                                    "throughput_ratio_per_round": per_round,
                                    "added_e2e_p50_ms": c_http["e2e_p50_ms"] - c_in["e2e_p50_ms"],
                                    "added_e2e_p99_ms": c_http["e2e_p99_ms"] - c_in["e2e_p99_ms"]},
        "hold": {"clients": args.hold, "completed": len(hold_results), "errors": hold_errors[:10],
                 "num_errors": len(hold_errors), "wall_s": hold_wall},
        "rounds": args.rounds, "http_errors": http_errors, "text_mismatches": mismatches,
        "server_exit_code": exit_code,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("\n| run | in-process | HTTP | HTTP vs in-process |\n|---|---|---|---|")
    print(f"| 1 client, e2e p50 / p99 ms | {s_in['e2e_p50_ms']:.1f} / {s_in['e2e_p99_ms']:.1f} | "
          f"{s_http['e2e_p50_ms']:.1f} / {s_http['e2e_p99_ms']:.1f} | +{report['one_client']['added_e2e_p50_ms']:.1f}"
          f" / +{report['one_client']['added_e2e_p99_ms']:.1f} ms |")
    print(f"| {args.clients} clients, output tok/s | {c_in['tokens_per_s']:.1f} | {c_http['tokens_per_s']:.1f} | "
          f"{report[f'{args.clients}_clients']['throughput_ratio']:.3f}x |")
    print(f"| {args.hold} streams held | | {len(hold_results)} completed, {len(hold_errors)} errors | |")
    print(f"text mismatches: {mismatches}; server exit code after SIGTERM: {exit_code}; JSON: {args.out}")
    print(f"per-round HTTP/in-process throughput at {args.clients} clients: "
          + ", ".join(f"{x:.3f}" for x in per_round))
    return 0 if not mismatches and not hold_errors and not report["http_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
