"""EngineCore: step() = schedule, run, postprocess. Synchronous; the async engine drives it."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.config import DEFAULT_CPU_POOL_BYTES, DEFAULT_GPU_POOL_FRACTION, EngineConfig
from loraplex.errors import CapacityError, RequestError
from loraplex.kernels import select_kernels
from loraplex.lora.types import LoraAdapter
from loraplex.models.config import ModelConfig, load_model_config
from loraplex.models.default_model import resolve_model_path
from loraplex.models.llama import LlamaModel
from loraplex.models.loader import load_checkpoint_tensors
from loraplex.unified_pager import PackPlans, PoolGeometry, UnifiedPager, load_packed_folder

from .adapters import AdapterKey, AdapterTable
from .host_memory import retain_freed_memory
from .model_runner import ModelRunner, RunnerOutput
from .output_processor import OutputProcessor
from .queue_policy import make_queue_policy
from .request import Request, RequestOutput, RequestStatus
from .sampler import Sampler, make_generator
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .tokenizer import load_tokenizer
from .warmup_adapter import warmup_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    resident_adapters: int
    num_preemptions: int
    num_steps: int
    num_tokens: int  # tokens run through the model over all steps: prompt chunks and decode tokens
    kv_reserved_pages: int = 0  # of kv_pages, blocks reserved ahead of their tokens (EngineConfig.kv_reserve_tokens)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        device, dtype = config.torch_device, config.torch_dtype
        if config.retain_host_memory and device.type == "cpu":
            retain_freed_memory()
        self.model_path: Path = resolve_model_path(config.model, config.cache_dir)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        weights = load_checkpoint_tensors(self.model_path, dtype)
        self.model = LlamaModel(self.model_config, weights, device, dtype, config.gemm)
        del weights
        self.tokenizer = load_tokenizer(self.model_path)
        self.max_model_len = min(config.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)

        geometry = PoolGeometry.for_model(self.model_config, self._pool_bytes(device), dtype, config.block_size)
        self.pager = UnifiedPager(geometry, device)
        self.adapters = AdapterTable(self.pager)
        # Folders of one adapter shape share a pack plan (unified_pager.pack_plan): 18 -> 5 ms per
        # rank-16 default-model load on the tenth session's AMD EPYC.
        self.pack_plans = PackPlans(self.model_config, config.max_lora_rank, geometry.row_layout)
        self.scheduler = Scheduler(self.pager, self.adapters, config.max_num_seqs, config.max_num_batched_tokens,
                                   make_queue_policy(config.queue_policy), config.kv_reserve_tokens)
        self.ops = select_kernels(device, config.kernels)
        self.runner = ModelRunner(self.model, self.pager, self.ops, Sampler())
        self.outputs = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_tokens = 0
        # SLO early abort and step-cost fitting (loraplex.admission.slo.SloController); None: off.
        self.slo = None
        self._warmed_up = False

    def _pool_bytes(self, device: torch.device) -> int:
        if self.config.pool_bytes is not None:
            return self.config.pool_bytes
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * DEFAULT_GPU_POOL_FRACTION)
        return DEFAULT_CPU_POOL_BYTES

    # -- adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str | Path) -> AdapterKey:
        """Read, validate and pack a PEFT folder now: packing into the pool's rows here, not at the
        adapter's first placement, keeps it off the step loop (a rank-16 default-model adapter packed
        on placement cost ~7 ms of the first step that used it; placed packed, it is one page copy)."""
        adapter = load_packed_folder(name, path, self.model_config, self.config.max_lora_rank,
                                     self.pager.geometry.row_layout, pin_memory=self.config.torch_device.type == "cuda",
                                     plans=self.pack_plans)
        return self.add_adapter(name, adapter)

    def add_adapter(self, name: str, adapter: LoraAdapter, version: str | None = None) -> AdapterKey:
        return self.adapters.add(name, adapter, version)

    def unload_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer files: pass prompts as token-id lists")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
        share: float = 1.0,
        ttft_deadline: float | None = None,
    ) -> Request:
        """Validate and queue a request; raises (changing nothing) if it can never be served.
        `tenant` and `share` feed the fair queue policy (VTC); they change nothing else."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                f"(at least one token must remain for the output)"
            )
        if not share > 0:
            raise RequestError(f"share must be positive, got {share}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need tokenizer files, which this model lacks")
        key = self.adapters.resolve(adapter) if adapter is not None else None
        adapter_pages = self.pager.geometry.adapter_num_pages(self.adapters.host(key)) if key else 0
        # The KV of the longest sequence it can grow to, beside its pinned adapter: a request that
        # fits only its prompt would otherwise hit "can never fit" inside a later step.
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        need = self.pager.geometry.kv_pages_for_tokens(max_len) + adapter_pages
        if not self.pager.can_ever_fit(need):
            raise CapacityError(
                f"the request needs {need} pool pages for {max_len} tokens (prompt + max_tokens) and its "
                f"adapter but the pool has {self.pager.geometry.num_pages}; raise pool_bytes, shorten the "
                f"prompt or lower max_tokens"
            )
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            adapter=adapter,
            max_total_tokens=self.max_model_len,
            generator=make_generator(params.seed) if params.seed is not None else None,
            tenant=tenant,
            share=float(share),
            ttft_deadline=ttft_deadline,
        )
        self.outputs.add(req)
        self.requests[rid] = req
        self.scheduler.add(req, key)
        return req

    def warmup(self) -> float:
        """Serve one throwaway request whose prompt fills the largest step the engine takes
        (max_num_batched_tokens, capped by the context and the pool) and one decode step of it, so that
        the host memory such a step needs is faulted in here, once, not during the first requests served
        (with retain_host_memory the process keeps it). The engine must be idle. Returns the seconds it
        took; later calls do nothing and return 0.

        Measured on the e2e quick trace offline right after loading transformers' models, as the benchmark
        does (AMD EPYC Zen 5, /tmp script): the first run 5.3 and 6.6-6.9 s with 50-53k page faults,
        against 4.9-6.2 s (median 5.3) for the later runs; after this warm-up (2.1-2.2 s) 5.3 and 5.5 s, 9k
        faults."""
        if self._warmed_up:
            return 0.0
        if self.has_unfinished():
            raise RequestError("warmup needs an idle engine: its steps would serve the queued requests too")
        t0 = time.perf_counter()
        vocab = self.model_config.vocab_size
        n = max(1, min(self.config.max_num_batched_tokens, self.max_model_len - 3))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        while True:
            try:
                self.add_request([(3 + i) % vocab for i in range(n)], params, request_id=f"warmup-{id(self)}")
                break
            except CapacityError:  # a small pool: the longest prompt it holds
                if n == 1:
                    raise
                n //= 2
        while self.has_unfinished():
            self.step()
        if self.ops.compiles_at_first_launch:
            self._warmup_lora(params)
        self._warmed_up = True
        return time.perf_counter() - t0

    def _warmup_lora(self, params: SamplingParams) -> None:
        """Triton compiles each kernel variant at its first launch: a GPU server's first request naming an
        adapter would wait for the LoRA kernels' (on an H200 the e2e benchmark's first offline run took 20.3 s,
        its repeat 2.6 s, 2026-12-04). Serve a prefill and a decode through a throwaway rank-16 adapter
        beside a request without one (prefill tiles, decode rows, tokens with no adapter), then drop it.
        Skipped, with a log line, where the pool cannot hold it."""
        name = f"__warmup-{id(self)}"
        rank = min(16, self.config.max_lora_rank)
        adapter = warmup_adapter(name, self.model_config, rank, self.config.torch_dtype)
        if not self.pager.can_ever_fit(self.pager.geometry.adapter_num_pages(adapter)):
            log.info("LoRA warm-up skipped: the pool cannot hold a rank-%d adapter", rank)
            return
        self.add_adapter(name, adapter)
        n = max(1, min(24, self.max_model_len - 3))
        prompt = [(3 + i) % self.model_config.vocab_size for i in range(n)]
        try:
            for i, which in enumerate((name, None)):
                self.add_request(prompt, params, adapter=which, request_id=f"warmup-lora-{i}-{id(self)}")
        except CapacityError as e:  # a small pool: what was added still runs, the rest is skipped
            log.info("LoRA warm-up shortened: %s", e)
        finally:
            while self.has_unfinished():
                self.step()
            self.unload_adapter(name)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its pages are free before the next step runs."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self.outputs.finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        expired = self._abort_unreachable() if self.slo is not None else []
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        if not sched.chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                raise CapacityError("no waiting request fits in the pool even with nothing running")
            return expired
        cached = sum(c.request.num_computed_tokens for c in sched.chunks)  # KV read before this step
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        seconds = time.perf_counter() - t0
        self.num_steps += 1
        self.num_tokens += sched.num_tokens
        outs = self._postprocess(sched, result)
        if self.slo is not None:
            from loraplex.admission.cost_model import StepRecord

            self.slo.after_step(StepRecord(sched.num_tokens, cached, len(sched.chunks), seconds),
                                self.scheduler.view())
        return expired + outs

    def _abort_unreachable(self) -> list[RequestOutput]:
        """S-LoRA's early abort: queued requests that can no longer meet their TTFT deadline leave now."""
        late = self.slo.unreachable(self.scheduler.view(), time.monotonic())
        outs = []
        for rid in late:
            req = self.requests.pop(rid)
            self.scheduler.finish(req, RequestStatus.FINISHED_SLO_MISSED)
            outs.append(self.outputs.finish(req))
        return outs

    def _postprocess(self, sched, result: RunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        outs: list[RequestOutput] = []
        for chunk in sched.chunks:
            req = chunk.request
            new_prompt = req.advance(chunk.num_new_tokens)
            span = result.logits.get(req.request_id)
            if span is not None:
                first, rows = span
                assert first == len(req.logits_rows)
                req.logits_rows.extend(rows.unbind(0))
            token = result.sampled.get(req.request_id)
            self.scheduler.account(req, new_prompt, 0 if token is None else 1)
            if token is None:
                continue  # a prompt chunk that did not reach the end
            req.output_token_ids.append(token)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self.outputs.check_stop(req, token)
            if status is not None:
                self.scheduler.finish(req, status)
                self.requests.pop(req.request_id, None)
                outs.append(self.outputs.finish(req))
            else:
                outs.append(self.outputs.delta(req, [token]))
        return outs

    def stats(self) -> EngineStats:
        p = self.pager.stats()
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            total_pages=p.total_pages,
            free_pages=p.free_pages,
            kv_pages=p.kv_pages,
            adapter_pages=p.adapter_pages,
            resident_adapters=p.resident_adapters,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_tokens=self.num_tokens,
            kv_reserved_pages=p.kv_reserved_pages,
        )
