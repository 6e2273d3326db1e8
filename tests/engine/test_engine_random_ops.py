"""The pool property at engine level: thousands of random requests, aborts and adapter (re)loads on a small pool.

One run on a tiny 2-layer model with a pool far smaller than the work, so that requests are preempted and
idle adapters evicted all the time. Between steps the test adds random requests (prompt lengths, max_tokens,
sampling, adapters of ranks 1..64 or none), aborts random waiting and running ones, and loads, unloads and
re-loads adapters (a re-load under the same name is a new version, with other weights). After every step the
pool's integrity check runs; at the end every request has finished exactly once with a finish reason that its
tokens justify, the pool holds no KV, only named versions are resident, each wasting less than one page, and a
sample of requests is checked against a fresh engine, teacher-forced, to prove they ran on the version they
were admitted with.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from factories import make_peft_adapter, make_tiny_model
from loraplex.config import EngineConfig
from loraplex.engine import EngineCore, SamplingParams
from loraplex.engine.adapters import AdapterKey
from loraplex.engine.request import RequestOutput

CONTEXT = 44  # max_position_embeddings: some requests end on the context, not on max_tokens
VOCAB = 257
EOS = 2
NUM_REQUESTS = 3000
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Ranks 1..64, assorted targets. Pages on the qwen2 tiny model (D=16, 32 rows a page) run from 1 to ~70.
SPECS = [
    dict(r=1, target_modules=("q_proj", "v_proj")),
    dict(r=2, target_modules=ALL),
    dict(r=4, target_modules=("o_proj", "down_proj")),
    dict(r=8, target_modules=("gate_proj", "up_proj")),
    dict(r=16, target_modules=("q_proj", "k_proj", "v_proj"), rank_pattern={"k_proj": 3}),
    dict(r=32, target_modules=("v_proj", "down_proj")),
    dict(r=64, target_modules=("q_proj", "v_proj")),
    dict(r=3, target_modules=ALL, layers_to_transform=[1]),
    dict(r=12, target_modules=("up_proj",), use_rslora=True),
    dict(r=48, target_modules=("k_proj", "o_proj")),
]
# Extra weight sets for re-loads under an existing name and for names added mid-run.
EXTRA_SPECS = [
    dict(r=24, target_modules=("q_proj", "gate_proj")),
    dict(r=5, target_modules=ALL),
    dict(r=64, target_modules=("o_proj",)),
    dict(r=1, target_modules=("down_proj",)),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: intra-op threads only cost synchronisation
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("random-ops")
    model_dir = make_tiny_model(root / "model", "qwen2", max_position_embeddings=CONTEXT)
    dirs = []
    for i, spec in enumerate(SPECS + EXTRA_SPECS):
        spec = dict(spec)
        r = spec.pop("r")
        dirs.append(make_peft_adapter(model_dir, root / f"a{i}", r=r, lora_alpha=2 * r, **spec))
    return model_dir, dirs


@dataclass
class Tracked:
    rid: str
    prompt: list[int]
    params: SamplingParams
    key: AdapterKey | None
    stream: list[int] = field(default_factory=list)
    final: RequestOutput | None = None
    num_finals: int = 0
    aborted: bool = False


def random_params(rng: random.Random, long: bool = False) -> SamplingParams:
    """long: requests that tend to run to max_tokens 5..8, so that running requests keep growing."""
    kind = rng.random()
    kw: dict = dict(max_tokens=rng.randint(5, 8) if long else rng.randint(1, 8),
                    ignore_eos=long or rng.random() < 0.3, return_logits=rng.random() < 0.1)
    if kind < 0.5:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.5, 1.0, 1.5])
        if rng.random() < 0.3:
            kw["top_k"] = rng.randint(1, 50)
        if rng.random() < 0.3:
            kw["top_p"] = rng.uniform(0.2, 1.0)
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(2**32)
    if not long and rng.random() < 0.3:
        kw["stop_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 20))
    if kw["return_logits"]:
        kw["temperature"] = 0.0  # greedy, so that the logits also explain the tokens
    return SamplingParams(**kw)


def check_finish(t: Tracked, seed: int) -> None:
    out, p = t.final, t.params
    where = (f"{t.rid} (seed {seed}): {out.finish_reason} {out.token_ids}, max_tokens {p.max_tokens}, "
             f"prompt {len(t.prompt)}")
    assert t.num_finals == 1, where
    assert out.finished and out.token_ids == t.stream, where
    assert len(out.token_ids) <= p.max_tokens and len(t.prompt) + len(out.token_ids) <= CONTEXT, where
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    first_stop = next((i for i, tok in enumerate(out.token_ids) if tok in stops), None)
    if t.aborted:
        assert out.finish_reason == "abort", where
        assert first_stop is None and len(out.token_ids) < p.max_tokens, where  # it was not finished
        return
    if first_stop is not None:
        assert out.finish_reason == "stop" and first_stop == len(out.token_ids) - 1, where
    else:
        assert out.finish_reason == "length", where
        assert len(out.token_ids) == p.max_tokens or len(t.prompt) + len(out.token_ids) == CONTEXT, where


def test_random_ops_keep_the_pool_exact(setup):
    model_dir, dirs = setup
    seed = int(os.environ.get("LORAPLEX_RANDOM_OPS_SEED", random.randrange(2**32)))  # to replay a failure
    rng = random.Random(seed)

    probe = EngineCore(EngineConfig(model=str(model_dir), kernels="torch", max_lora_rank=64, pool_bytes=1 << 20,
                                    block_size=2))
    geo = probe.pager.geometry
    sizes = []
    for i, d in enumerate(dirs):
        sizes.append(geo.adapter_num_pages(probe.adapters.host(probe.load_adapter(f"x{i}", d))))
    # Room for the largest adapter beside a few full requests, nowhere near all adapters and requests.
    pool_pages = max(sizes) + 12 * geo.kv_pages_for_tokens(CONTEXT)
    assert pool_pages < sum(sizes)
    engine = EngineCore(EngineConfig(
        model=str(model_dir), kernels="torch", max_lora_rank=64, pool_bytes=pool_pages * geo.page_bytes,
        max_num_seqs=128, max_num_batched_tokens=4096, block_size=2,
    ))
    pager = engine.pager
    rpp = pager.geometry.rows_per_page

    version_dir: dict[AdapterKey, Path] = {}

    def load(name: str, d: Path) -> None:
        old = engine.adapters.resolve(name) if name in engine.adapters.names() else None
        key = engine.load_adapter(name, d)
        assert key.name == name and key != old and key not in version_dir
        version_dir[key] = d

    for i in range(len(SPECS)):
        load(f"a{i}", dirs[i])

    tracked: dict[str, Tracked] = {}
    unfinished: set[str] = set()
    submitted = 0
    loads = unloads = 0
    max_step_s = 0.0
    phase_at, kv_heavy = -1, False
    aborted_in = {"waiting": 0, "running": 0, "preempted": 0}
    t0 = time.monotonic()

    def finish(out: RequestOutput) -> None:
        t = tracked[out.request_id]
        assert out.request_id in unfinished, f"output for a finished request {out.request_id} (seed {seed})"
        t.stream += out.new_token_ids
        if out.finished:
            t.final = out
            t.num_finals += 1
            unfinished.discard(out.request_id)
        else:
            assert len(out.new_token_ids) == 1

    while submitted < NUM_REQUESTS or unfinished:
        # New requests, in bursts. Phases alternate: any adapter (the pool churns adapters), or many short
        # prompts on the base model and the smallest adapters, which run to 5..8 tokens: KV fills the pool
        # and grows faster than finished requests free it, so requests are preempted.
        if engine.num_steps // 30 != phase_at:
            phase_at = engine.num_steps // 30
            kv_heavy = phase_at % 2 == 1
        queue_cap = 128 if kv_heavy else 16  # keeps the queue short, so that phases matter
        if submitted < NUM_REQUESTS and len(engine.scheduler.waiting) < queue_cap:
            for _ in range(rng.randint(0, 64 if kv_heavy else 24)):
                if submitted >= NUM_REQUESTS:
                    break
                names = engine.adapters.names()
                if kv_heavy:
                    small = sorted(names, key=lambda n: geo.adapter_num_pages(engine.adapters.host(
                        engine.adapters.resolve(n))))[:2]
                    name = rng.choice(small + [None] * 2)
                    plen = rng.randint(1, 6)
                else:
                    name = rng.choice(names + [None] * max(1, len(names) // 4))
                    plen = rng.randint(1, CONTEXT - 1)
                prompt = [rng.randrange(VOCAB) for _ in range(plen)]
                params = random_params(rng, long=kv_heavy)
                key = engine.adapters.resolve(name) if name is not None else None
                req = engine.add_request(prompt, params, name)
                tracked[req.request_id] = Tracked(req.request_id, prompt, params, key)
                unfinished.add(req.request_id)
                submitted += 1
        # Aborts of waiting, running and preempted requests (and of ids that are already gone: a no-op).
        victims = []
        if unfinished and rng.random() < 0.3:
            victims = rng.sample(sorted(unfinished), min(len(unfinished), rng.randint(1, 4)))
        preempted = [r.request_id for r in engine.scheduler.waiting if r.status.value == "preempted"]
        if preempted and rng.random() < 0.5:
            victims = list(dict.fromkeys(victims + [rng.choice(preempted)]))
        if victims:
            for rid in victims:
                aborted_in[engine.requests[rid].status.value] += 1
                out = engine.abort_request(rid)
                assert out is not None and out.finish_reason == "abort"
                tracked[rid].aborted = True
                finish(out)
            done = [rid for rid in tracked if rid not in unfinished]
            assert not done or engine.abort_request(rng.choice(done)) is None
        # Adapter churn, in turn: unload a name (its requests in flight go on), re-load a name (a new
        # version, often with other weights), add a name; the test of versions comes at the end.
        if rng.random() < 0.06:
            names = engine.adapters.names()
            op = ("unload", "reload", "new")[(loads + unloads) % 3]
            if op == "unload" and len(names) > 3:
                engine.unload_adapter(rng.choice(names))
                unloads += 1
            elif op == "reload" and names:
                load(rng.choice(names), rng.choice(dirs))
                loads += 1
            else:
                load(f"n{loads}", rng.choice(dirs))
                loads += 1
            pager.check_integrity()

        s = time.monotonic()
        outs = engine.step()
        max_step_s = max(max_step_s, time.monotonic() - s)
        for out in outs:
            finish(out)
        pager.check_integrity()
        assert pager.stats().num_sequences == len(engine.scheduler.running)

    elapsed = time.monotonic() - t0
    stats, pstats = engine.stats(), pager.stats()
    print(f"seed {seed}: {submitted} requests in {stats.num_steps} steps, {elapsed:.1f}s (slowest step "
          f"{max_step_s * 1e3:.0f} ms); {stats.num_preemptions} preemptions, {pstats.adapter_evictions} evictions, "
          f"{loads} loads, {unloads} unloads, aborts {aborted_in}; pool {pool_pages} pages, "
          f"adapters {sorted(sizes)} pages")

    # Every request finished exactly once, for a reason its tokens justify.
    assert len(tracked) == NUM_REQUESTS and not unfinished and not engine.requests
    for t in tracked.values():
        check_finish(t, seed)
    reasons = {r: sum(t.final.finish_reason == r for t in tracked.values()) for r in ("stop", "length", "abort")}
    assert all(reasons.values()), reasons

    # The run really squeezed the pool.
    assert stats.num_preemptions > 0 and pstats.adapter_evictions > 0, (stats, pstats)
    assert loads > 0 and unloads > 0
    assert aborted_in["waiting"] > 0 and aborted_in["running"] > 0, aborted_in
    assert aborted_in["preempted"] > 0 or stats.num_preemptions < 20, aborted_in

    # Nothing left behind: no KV, no pins, only current versions resident, each wasting under one page.
    pager.check_integrity()
    assert pstats.kv_pages == 0 and pstats.num_sequences == 0 and pstats.pinned_adapters == 0
    resident = [pager.get_adapter(engine.adapters.resolve(n)) for n in engine.adapters.names()]
    resident = [r for r in resident if r is not None]
    assert pstats.resident_adapters == len(resident), "a retired version is still resident"
    assert pstats.adapter_pages == sum(r.num_pages for r in resident)
    assert pstats.free_pages == pstats.total_pages - pstats.adapter_pages
    # Every current version, placed now (evicting others as needed), wastes under one page.
    for n in engine.adapters.names():
        r = engine.adapters.ensure_resident(engine.adapters.resolve(n))
        assert r is not None, f"adapter {n} does not fit an otherwise idle pool"
        assert 0 <= r.num_pages * rpp - r.num_rows < rpp, (r.key, r.num_pages, r.num_rows)
        pager.check_integrity()
    for n in engine.adapters.names():
        engine.unload_adapter(n)
    assert pager.stats().free_pages == pager.stats().total_pages
    pager.check_integrity()

    # Requests ran on the version they were admitted with: teacher-forced logits on a fresh engine that
    # holds every version under its own name (re-loads used other weights, so a stale version shows).
    checked = [t for t in tracked.values() if t.params.return_logits and not t.aborted and t.final.logits is not None]
    assert len(checked) > 20
    ref = EngineCore(EngineConfig(model=str(model_dir), kernels="torch", max_lora_rank=64, pool_bytes=64 << 20))
    used = {t.key for t in checked if t.key is not None}
    for key in used:
        ref.load_adapter(f"{key.name}@{key.version}", version_dir[key])
    forced = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
    reqs = [ref.add_request(t.prompt + t.final.token_ids[:-1], forced,
                            None if t.key is None else f"{t.key.name}@{t.key.version}") for t in checked]
    finals = {}
    while ref.has_unfinished():
        finals.update({o.request_id: o for o in ref.step() if o.finished})
    for t, r in zip(checked, reqs):
        ours = torch.cat([t.final.prompt_logits, t.final.logits[1:]])
        theirs = finals[r.request_id].prompt_logits
        assert ours.shape == theirs.shape
        err = float((ours - theirs).abs().max() / theirs.abs().max())
        assert err < 1e-4, f"{t.rid} on {t.key} (seed {seed}): relative logits error {err:.2e}"
        assert t.final.logits.argmax(-1).tolist() == t.final.token_ids  # greedy tokens follow the logits
