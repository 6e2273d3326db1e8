"""The systems compared, behind one interface: `serve(requests) -> RunResult`.

Each system replays the requests' arrival times on the wall clock (offline mode: every arrival is 0) and
records, per request, the time of every output token it produced for that request. Clock: perf_counter
seconds since the run started; a request's TTFT is its first token time less its arrival time.

    LoraplexSystem        loraplex's EngineCore (adapters as the requests name them, or none)
    HFStaticBatches       transformers (+ PEFT with mixed `adapter_names`): S-LoRA's baseline. Waiting
                          requests are taken in arrival order, up to `batch_size` at a time, left-padded and
                          generated together; the batch runs to the longest output among them (a static
                          batch cannot release a finished row) and each request is credited with its own
                          first `output_tokens` tokens and their times.
    HFContinuousBatching  transformers' own continuous batching (the manager behind `generate_batch`), with
                          each request's own max_new_tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraplex.engine import EngineCore, SamplingParams

from .workload import BenchRequest


@dataclass
class RequestRecord:
    id: str
    arrival_s: float
    output_tokens: int  # asked for
    token_times: list[float] = field(default_factory=list)  # one per output token, seconds since the start
    token_ids: list[int] = field(default_factory=list)


# RunResult.extra's lists with one entry per engine step: used by the floors, left out of the JSON.
PER_STEP = ("steps_adapters", "steps_tokens", "steps_sampled", "steps_s")


@dataclass
class RunResult:
    system: str
    records: list[RequestRecord]
    wall_s: float  # from the start of the run to the last token
    extra: dict = field(default_factory=dict)  # system-specific counters


class System(Protocol):
    name: str

    def warmup(self) -> None: ...

    def serve(self, requests: Sequence[BenchRequest]) -> RunResult: ...


def _sleep_until(t0: float, at_s: float) -> None:
    delay = at_s - (time.perf_counter() - t0)
    if delay > 0:
        time.sleep(delay)


class OwnClock:
    """Seconds since it was made, less the time spent paused: a run suspended between its steps while another
    run steps (serve_interleaved) does not count the other's time."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._paused_at: float | None = None

    def now(self) -> float:
        return (self._paused_at if self._paused_at is not None else time.perf_counter()) - self._t0

    def pause(self) -> None:
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        assert self._paused_at is not None, "resume() without pause()"
        self._t0 += time.perf_counter() - self._paused_at
        self._paused_at = None

    def sleep_until(self, at_s: float) -> None:
        if (delay := at_s - self.now()) > 0:
            time.sleep(delay)


# -- loraplex -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdapterFeed:
    """How requests' adapters reach the engine. `prefetch` is called on the engine thread as a request arrives:
    it either starts the load elsewhere, as the server does (loraplex.api.serving: the host cache's prefetch
    thread), or loads right there and returns a finished future. The request joins the engine once its
    adapter is decoded, and the engine thread installs it (EngineAdapterBridge.install); requests whose
    adapter is still loading wait outside the engine while it steps the others."""

    prefetch: Callable[[str], Future]  # adapter name -> future of the decoded adapter
    install: Callable[[str, object], str]  # (adapter name, decoded adapter) -> engine name; the engine thread


class LoraplexSystem:
    """The engine driven as the async engine's thread drives it: add what has arrived, then one step."""

    def __init__(self, name: str, engine: EngineCore, use_adapters: bool = True,
                 adapter_feed: AdapterFeed | None = None):
        self.name = name
        self.engine = engine
        self.use_adapters = use_adapters
        # None: adapters are already loaded in the engine under the names the requests give.
        self.adapter_feed = adapter_feed

    def warmup(self) -> None:
        # Once per engine, as the server does at start-up: the largest step's memory is faulted in before
        # the first timed run rather than inside it (EngineCore.warmup).
        self.engine.warmup()
        vocab = self.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        # With adapters, two of the loaded ones and a request without any share the steps, so that the LoRA
        # kernels' variants (prefill tiles, decode rows, tokens with no adapter) are compiled here: on an H200
        # the first timed run otherwise took 20.3 s against 2.6 s for its repeat (Triton compiling inside it).
        # A fed system (scaling) loads its adapters as requests arrive, so it warms up without them.
        names = self.engine.adapters.names()[:2] if self.use_adapters and self.adapter_feed is None else []
        for i, adapter in enumerate([*names, None] if names else [None, None]):
            self.engine.add_request([3 + (7 * i + j) % (vocab - 3) for j in range(24)], params, adapter=adapter)
        while self.engine.has_unfinished():
            self.engine.step()

    def serve(self, requests: Sequence[BenchRequest]) -> RunResult:
        return run_steps(self.serve_steps(requests))

    def serve_steps(self, requests: Sequence[BenchRequest]) -> Generator[None, None, RunResult]:
        """serve() one step at a time: yields after each engine step and returns the RunResult. Its clock
        stops while it is suspended at a yield, so two runs stepped in turn (serve_interleaved) each
        count only their own steps and the scheduling between them."""
        eng, feed = self.engine, self.adapter_feed
        pending = sorted(requests, key=lambda r: r.arrival_s)
        recs = {r.id: RequestRecord(r.id, r.arrival_s, r.output_tokens) for r in requests}
        adapter_of: dict[str, str | None] = {}
        steps_adapters: list[tuple[str, ...]] = []  # distinct adapters that produced tokens, per step
        steps_tokens: list[int] = []  # tokens the step ran through the model (prompt chunks and decode tokens)
        steps_sampled: list[int] = []  # requests that got a token (rows of the LM head)
        steps_s: list[float] = []  # each step's wall
        loading: list[tuple[BenchRequest, Future]] = []  # arrived, adapter loading (arrival order)

        def add(r: BenchRequest, adapter: str | None) -> None:
            adapter_of[r.id] = adapter
            eng.add_request(list(r.prompt), SamplingParams(max_tokens=r.output_tokens, temperature=0.0,
                                                           ignore_eos=True), adapter=adapter, request_id=r.id)

        i = 0
        clock = OwnClock()
        while i < len(pending) or loading or eng.has_unfinished():
            now = clock.now()
            while i < len(pending) and pending[i].arrival_s <= now:
                r = pending[i]
                i += 1
                adapter = r.adapter if self.use_adapters else None
                if adapter is not None and feed is not None:
                    loading.append((r, feed.prefetch(adapter)))
                else:
                    add(r, adapter)
            if loading:
                waiting = []
                for r, fut in loading:
                    if fut.done():
                        add(r, feed.install(r.adapter, fut.result()))  # a failed load raises here
                    else:
                        waiting.append((r, fut))
                loading = waiting
            if not eng.has_unfinished():
                if loading:  # nothing to step until a load (or the next arrival) comes
                    timeout = pending[i].arrival_s - clock.now() if i < len(pending) else None
                    wait([f for _, f in loading], timeout=None if timeout is None else max(0.0, timeout),
                         return_when=FIRST_COMPLETED)
                elif i < len(pending):
                    clock.sleep_until(pending[i].arrival_s)
                continue
            before = clock.now()
            tokens_before = eng.num_tokens
            outs = eng.step()
            now = clock.now()
            steps_s.append(now - before)
            steps_tokens.append(eng.num_tokens - tokens_before)
            steps_sampled.append(sum(1 for o in outs if o.new_token_ids))
            for o in outs:
                rec = recs[o.request_id]
                rec.token_times.extend([now] * len(o.new_token_ids))
                if o.finished:
                    rec.token_ids = list(o.token_ids)
            steps_adapters.append(tuple(sorted({a for o in outs if (a := adapter_of.get(o.request_id))})))
            clock.pause()
            yield
            clock.resume()
        wall = max((t for rec in recs.values() for t in rec.token_times[-1:]), default=0.0)
        stats = eng.stats()
        return RunResult(self.name, [recs[r.id] for r in requests], wall,
                         {"steps": len(steps_adapters), "preemptions": stats.num_preemptions,
                          "steps_adapters": steps_adapters, "steps_tokens": steps_tokens,
                          "steps_sampled": steps_sampled, "steps_s": steps_s})


def run_steps(steps: Generator[None, None, RunResult]) -> RunResult:
    """Drive a serve_steps generator to its end without pausing it."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def serve_interleaved(runs: Sequence[tuple[LoraplexSystem, Sequence[BenchRequest]]]) -> list[RunResult]:
    """The runs stepped in turn, one engine step each, in the order given, until all have finished; each
    counts only its own work (serve_steps's clock), so a change of the machine's speed lands on all of them
    alike within a step or two where runs one after the other met it unequally: on a shared AMD EPYC the same
    offline run's loss to its adapters read 0.017 to 0.142 from runs side by side in time, and 0.070 to 0.095
    stepped in turn (RESULTS.md, twenty-seventh session). Each run needs an engine of its own (one engine's
    batch would mix them) with its adapters loaded: a feed may load on another thread, which would go on
    while the other runs step, for free."""
    engines = [id(system.engine) for system, _ in runs]
    if len(set(engines)) != len(engines):
        raise ValueError("runs stepped in turn need an engine each: one engine would batch their requests together")
    if any(system.adapter_feed is not None for system, _ in runs):
        raise ValueError("a run fed adapters as requests arrive cannot be stepped in turn: its loads may go on "
                         "another thread while the other runs step")
    steps = [system.serve_steps(reqs) for system, reqs in runs]
    out: list[RunResult | None] = [None] * len(steps)
    live = list(range(len(steps)))
    while live:
        for k in tuple(live):
            try:
                next(steps[k])
            except StopIteration as done:
                out[k] = done.value
                live.remove(k)
    return out  # type: ignore[return-value]


# -- transformers, static batches --------------------------------------------------------------------

class _StepClock:
    """A generate() streamer that records when each decode step's tokens exist (put #0 is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def greedy_config(max_new_tokens: int, pad_id: int):
    """Greedy, exactly max_new_tokens, EOS never stops a row (as loraplex's ignore_eos)."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                            pad_token_id=pad_id, bos_token_id=None, num_beams=1, temperature=None, top_p=None,
                            top_k=None)


class HFStaticBatches:
    """transformers `generate` over left-padded static batches; with PEFT, one mixed `adapter_names` batch."""

    def __init__(self, name: str, model, batch_size: int, use_adapters: bool, pad_id: int = 0):
        self.name = name
        self.model = model  # a transformers model, or a PeftModel holding every adapter the requests name
        self.batch_size = batch_size
        self.use_adapters = use_adapters
        self.pad_id = pad_id
        self.device = next(model.parameters()).device

    def warmup(self) -> None:
        self._generate([(3, 4, 5, 6, 7, 8, 9, 10)] * 2, None, 2)

    @torch.no_grad()
    def _generate(self, prompts: Sequence[Sequence[int]], adapters: list[str] | None,
                  max_new: int) -> tuple[torch.Tensor, list[float]]:
        """(new tokens [B, max_new], time of each step's tokens)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every row's last prompt token is at the end
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        clock = _StepClock()
        kwargs = {"adapter_names": adapters} if adapters is not None else {}
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=greedy_config(max_new, self.pad_id), streamer=clock, **kwargs)
        return out[:, width:].cpu(), clock.times

    def serve(self, requests: Sequence[BenchRequest]) -> RunResult:
        pending = sorted(requests, key=lambda r: r.arrival_s)
        recs = {r.id: RequestRecord(r.id, r.arrival_s, r.output_tokens) for r in requests}
        batches = 0
        t0 = time.perf_counter()
        while pending:
            now = time.perf_counter() - t0
            if pending[0].arrival_s > now:
                _sleep_until(t0, pending[0].arrival_s)
                continue
            ready = [r for r in pending if r.arrival_s <= now][: self.batch_size]
            taken = {r.id for r in ready}
            pending = [r for r in pending if r.id not in taken]
            max_new = max(r.output_tokens for r in ready)
            adapters = ([r.adapter or "__base__" for r in ready]  # PEFT's name for "no adapter" in a batch
                        if self.use_adapters else None)
            tokens, times = self._generate([r.prompt for r in ready], adapters, max_new)
            batches += 1
            for row, r in enumerate(ready):
                rec = recs[r.id]
                rec.token_ids = tokens[row, : r.output_tokens].tolist()
                rec.token_times = [t - t0 for t in times[: r.output_tokens]]
        wall = max((rec.token_times[-1] for rec in recs.values() if rec.token_times), default=0.0)
        return RunResult(self.name, [recs[r.id] for r in requests], wall, {"batches": batches,
                                                                          "batch_size": self.batch_size})


# -- transformers, continuous batching ---------------------------------------------------------------

class HFContinuousBatching:
    """transformers' continuous-batching manager (what `model.generate_batch` runs), fed on arrival."""

    def __init__(self, name: str, model, pad_id: int = 0):
        self.name = name
        self.model = model
        self.pad_id = pad_id

    def warmup(self) -> None:
        pass  # the manager warms up when it starts, inside serve(), before the clock starts

    @torch.no_grad()
    def serve(self, requests: Sequence[BenchRequest]) -> RunResult:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        pending = sorted(requests, key=lambda r: r.arrival_s)
        recs = {r.id: RequestRecord(r.id, r.arrival_s, r.output_tokens) for r in requests}
        hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in requests),
                              max_generated_length=max(r.output_tokens for r in requests),
                              num_requests=len(requests))
        gen = greedy_config(max(r.output_tokens for r in requests), self.pad_id)
        gen.eos_token_id = -1  # the manager's "no EOS"
        done = 0
        # Its warm-up captures CUDA graphs: on the CPU it only costs time (tens of seconds), outside the clock.
        warm = next(self.model.parameters()).device.type == "cuda"
        with self.model.continuous_batching_context_manager(generation_config=gen, workload_hints=hints,
                                                            block=True, timeout=5, warmup=warm) as manager:
            i = 0
            t0 = time.perf_counter()
            while done < len(requests):
                now = time.perf_counter() - t0
                while i < len(pending) and pending[i].arrival_s <= now:
                    r = pending[i]
                    i += 1
                    manager.add_request(list(r.prompt), request_id=r.id, max_new_tokens=r.output_tokens,
                                        record_timestamps=True, eos_token_id=-1)
                wait = 0.05 if i == len(pending) else max(0.001, min(0.05, pending[i].arrival_s - now))
                result = manager.get_result(timeout=wait)
                if result is None:
                    if i == len(pending) and not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped early")
                    continue
                if result.is_finished():
                    if result.error:
                        raise RuntimeError(f"transformers' continuous batching failed {result.request_id}: "
                                           f"{result.error}")
                    rec = recs[result.request_id]
                    rec.token_ids = list(result.generated_tokens)
                    rec.token_times = [t - t0 for t in (result.timestamps or [])]
                    done += 1
        wall = max((rec.token_times[-1] for rec in recs.values() if rec.token_times), default=0.0)
        return RunResult(self.name, [recs[r.id] for r in requests], wall, {})
