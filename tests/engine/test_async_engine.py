"""AsyncEngine: concurrent streams, clients that hang up, refusals, shutdown; checked against LLM.generate.

Each test drives the engine with asyncio.run (no pytest-asyncio). The step loop runs in its own thread; the
tests read the engine's pager and request table from the event loop's thread only to poll for effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from factories import make_peft_adapter, make_tiny_model
from loraplex.config import EngineConfig
from loraplex.engine import LLM, AsyncEngine, EngineCore, EngineDeadError, SamplingParams
from loraplex.engine.request import RequestOutput
from loraplex.errors import AdapterNotFoundError, ModelLoadError, RequestError

VOCAB = 257
CONTEXT = 512
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {"r2": dict(r=2, target_modules=ALL), "r8": dict(r=8, target_modules=("q_proj", "v_proj")),
            "r32": dict(r=32, target_modules=("o_proj", "down_proj")), "r64": dict(r=64, target_modules=("k_proj",))}
NAMES = [None, *ADAPTERS]
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)  # runs for hundreds of steps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: intra-op threads only cost synchronisation
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("async")
    model_dir = make_tiny_model(root / "model", "mistral", max_position_embeddings=CONTEXT)
    adapters = {name: make_peft_adapter(model_dir, root / name, lora_alpha=2 * spec["r"], **spec)
                for name, spec in ADAPTERS.items()}
    return model_dir, adapters


@pytest.fixture(scope="module")
def reference(dirs) -> LLM:
    model_dir, adapters = dirs
    llm = LLM(str(model_dir), kernels="torch", max_lora_rank=64, pool_bytes=16 << 20)
    for name, d in adapters.items():
        llm.load_adapter(name, d)
    return llm


@pytest.fixture
def engine(dirs):
    """An AsyncEngine over its own EngineCore (adapters loaded); shut down after the test."""
    model_dir, adapters = dirs
    core = EngineCore(EngineConfig(model=str(model_dir), kernels="torch", max_lora_rank=64, pool_bytes=16 << 20))
    for name, d in adapters.items():
        core.load_adapter(name, d)
    ae = AsyncEngine(engine=core)
    assert ae.built_on is None  # built by the caller
    yield ae
    ae.shutdown()
    assert not ae._thread.is_alive()


def rand_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]


def rand_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.7:
        return SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0, ignore_eos=rng.random() < 0.5)
    return SamplingParams(max_tokens=rng.randint(1, 16), temperature=1.0, seed=rng.randrange(2**63), ignore_eos=True)


async def collect(ae: AsyncEngine, prompt, params, adapter=None, request_id=None) -> list[RequestOutput]:
    outs = []
    async for out in ae.generate(prompt, params, adapter, request_id):
        outs.append(out)
    return outs


def check_stream(outs: list[RequestOutput]) -> RequestOutput:
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    assert all(len(o.new_token_ids) == 1 for o in outs[:-1])
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    return final


async def poll(cond, what: str, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def gone(ae: AsyncEngine, rid: str) -> bool:
    """The request has left the engine and holds no KV."""
    return rid not in ae.engine.requests and ae.engine.pager.kv_num_blocks(rid) == 0


# --- many streams ------------------------------------------------------------------------------------------------


def test_concurrent_streams_match_llm_generate(engine, reference):
    rng = random.Random()
    reqs = [(rand_prompt(rng), rand_params(rng), rng.choice(NAMES)) for _ in range(40)]
    expected = reference.generate([r[0] for r in reqs], [r[1] for r in reqs], adapters=[r[2] for r in reqs])

    async def main():
        async def one(i, r):
            await asyncio.sleep(rng.random() * 0.02)  # staggered arrivals: requests join running batches
            return await collect(engine, *r, request_id=f"s{i}")
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))

    results = asyncio.run(main())
    for r, exp, outs in zip(reqs, expected, results):
        final = check_stream(outs)
        assert (final.token_ids, final.finish_reason) == (exp.token_ids, exp.finish_reason), r
        assert final.adapter == r[2]
    assert engine.alive
    engine.engine.pager.check_integrity()
    assert engine.engine.stats().kv_pages == 0 and not engine.engine.requests


# --- clients that hang up ----------------------------------------------------------------------------------------


async def hang_up(ae: AsyncEngine, how: str, rid: str, prompt: list[int], adapter: str | None) -> None:
    """Start a long stream, read a few outputs, then stop in one of several ways; return once the request
    is gone from the engine, checking that it ran for at most a few steps more."""
    k = random.randint(1, 5)
    seen = 0
    if how == "break":  # the generator object is referenced by nothing else: dropped at the break
        async for _ in ae.generate(prompt, LONG, adapter, rid):
            seen += 1
            if seen == k:
                req = ae.engine.requests[rid]
                n = len(req.output_token_ids)
                break
    elif how == "aclose":  # a held generator, closed explicitly
        gen = ae.generate(prompt, LONG, adapter, rid)
        async with contextlib.aclosing(gen):
            async for _ in gen:
                seen += 1
                if seen == k:
                    req = ae.engine.requests[rid]
                    n = len(req.output_token_ids)
                    break
    else:  # "cancel": the consuming task is cancelled while it waits for the next output
        started = asyncio.Event()

        async def consume():
            nonlocal seen
            async for _ in ae.generate(prompt, LONG, adapter, rid):
                seen += 1
                if seen == k:
                    started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        req = ae.engine.requests[rid]
        n = len(req.output_token_ids)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await poll(lambda: gone(ae, rid), f"{rid} to be aborted")
    extra = len(req.output_token_ids) - n
    assert req.status.value == "abort"
    assert extra <= 3, f"{how}: the request ran {extra} steps after the client hung up"


@pytest.mark.parametrize("how", ["break", "aclose", "cancel"])
def test_client_that_hangs_up_is_aborted_and_freed(engine, reference, how):
    rng = random.Random()
    others = [(rand_prompt(rng), rand_params(rng), rng.choice(NAMES)) for _ in range(8)]
    expected = reference.generate([r[0] for r in others], [r[1] for r in others], adapters=[r[2] for r in others])

    async def main():
        quitters = [hang_up(engine, how, f"quit{i}", rand_prompt(rng), rng.choice(NAMES)) for i in range(4)]
        stayers = [collect(engine, *r) for r in others]
        return await asyncio.gather(*stayers, *quitters)

    results = asyncio.run(main())
    for exp, outs in zip(expected, results[: len(others)]):
        final = check_stream(outs)
        assert (final.token_ids, final.finish_reason) == (exp.token_ids, exp.finish_reason)
    core = engine.engine
    assert engine.alive and not core.requests and core.stats().kv_pages == 0
    core.pager.check_integrity()


def test_event_loops_that_close_with_streams_open(engine, reference):
    """Callers whose event loop ends while their stream is open (asyncio.run closes their generators, and
    outputs may still be on their way to the closed loop) must not take the engine down."""
    rng = random.Random()

    async def leave_open(i):
        gen = engine.generate(rand_prompt(rng), LONG, rng.choice(NAMES), f"open{i}")
        async for _ in gen:
            break
        return gen  # still referenced: only the loop's shutdown closes it

    for i in range(6):
        held = asyncio.run(leave_open(i))
        time.sleep(0.01)  # the engine keeps stepping: outputs for the closed loop are produced meanwhile
        del held
    deadline = time.monotonic() + 10
    while engine.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.alive, engine.error
    assert not engine.engine.requests and engine.engine.stats().kv_pages == 0
    # Still serving, correctly.
    r = (rand_prompt(rng), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), rng.choice(NAMES))
    final = check_stream(asyncio.run(collect(engine, *r)))
    assert final.token_ids == reference.generate([r[0]], r[1], adapters=[r[2]])[0].token_ids


# --- refusals ----------------------------------------------------------------------------------------------------


def test_refused_request_raises_in_the_caller_only(engine, reference):
    rng = random.Random()
    others = [(rand_prompt(rng), rand_params(rng), rng.choice(NAMES)) for _ in range(10)]
    expected = reference.generate([r[0] for r in others], [r[1] for r in others], adapters=[r[2] for r in others])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    bad = [
        (rand_prompt(rng), params, "nope", AdapterNotFoundError, "'nope'"),
        ([5] * CONTEXT, params, None, RequestError, "context"),
        ([5, VOCAB + 3], params, "r8", RequestError, "vocabulary"),
        ("text without a tokenizer", params, None, RequestError, "tokenizer"),
        (rand_prompt(rng), SamplingParams(max_tokens=4, stop=["x"]), None, RequestError, "stop strings"),
    ]

    async def main():
        async def refused(prompt, p, adapter, error, fragment):
            await asyncio.sleep(rng.random() * 0.01)
            with pytest.raises(error, match=fragment):
                await collect(engine, prompt, p, adapter)
            return "refused"
        return await asyncio.gather(*(collect(engine, *r) for r in others), *(refused(*b) for b in bad))

    results = asyncio.run(main())
    assert results[len(others):] == ["refused"] * len(bad)
    for exp, outs in zip(expected, results[: len(others)]):
        final = check_stream(outs)
        assert (final.token_ids, final.finish_reason) == (exp.token_ids, exp.finish_reason)
    core = engine.engine
    assert engine.alive and not core.requests and core.stats().kv_pages == 0


def test_duplicate_request_id_is_refused_without_touching_the_first(engine, reference):
    rng = random.Random()
    prompt, adapter = rand_prompt(rng), rng.choice(NAMES)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main():
        first = asyncio.create_task(collect(engine, prompt, params, adapter, "same"))
        await poll(lambda: "same" in engine.engine.requests, "the first request")
        with pytest.raises(RequestError, match="already in use"):
            await collect(engine, rand_prompt(rng), params, None, "same")
        return await first

    final = check_stream(asyncio.run(main()))
    assert final.token_ids == reference.generate([prompt], params, adapters=[adapter])[0].token_ids


# --- shutdown ----------------------------------------------------------------------------------------------------


def test_shutdown_when_idle(engine):
    asyncio.run(collect(engine, [5, 6, 7], SamplingParams(max_tokens=3)))
    t0 = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - t0 < 2.0
    assert not engine.alive and not engine._thread.is_alive()

    async def late():
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(collect(engine, [5, 6, 7], SamplingParams(max_tokens=3)), 5)

    asyncio.run(late())


def test_shutdown_ends_open_streams(engine):
    rng = random.Random()

    async def main():
        tasks = [asyncio.create_task(collect(engine, rand_prompt(rng), LONG, rng.choice(NAMES))) for _ in range(5)]
        await poll(lambda: engine.engine.stats().num_running == 5, "the streams to run")
        await asyncio.to_thread(engine.shutdown)
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)  # never a hang
        assert all(isinstance(r, EngineDeadError) and "shut down" in str(r) for r in done), done

    asyncio.run(main())
    core = engine.engine
    assert not engine.alive and not core.requests and core.stats().kv_pages == 0
    core.pager.check_integrity()


# --- built on its own thread ---------------------------------------------------------------------------------------


def test_built_from_a_config_on_the_loop_thread(dirs, reference):
    """From a config, the engine is built by the thread that steps it (one OpenMP team on the CPU,
    kernels/cpu_threads.py); it serves as any other, and the model's first load happened there."""
    model_dir, _ = dirs
    ae = AsyncEngine(EngineConfig(model=str(model_dir), kernels="torch", max_lora_rank=64, pool_bytes=16 << 20))
    try:
        assert ae.built_on == ae._thread.ident != threading.get_ident()
        prompt = [5, 6, 7, 8]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        final = check_stream(asyncio.run(collect(ae, prompt, params)))
        assert final.token_ids == reference.generate([prompt], params)[0].token_ids
    finally:
        ae.shutdown()


def test_a_config_that_cannot_build_raises_in_the_caller(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        AsyncEngine(EngineConfig(model=str(tmp_path), kernels="torch"))
