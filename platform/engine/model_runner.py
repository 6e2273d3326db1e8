"""Turns a SchedulerOutput into one flattened batch, runs the model, samples.

The batch is ordered by adapter so that tokens of one adapter are contiguous: each run becomes
one SGMV segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels import AttentionMetadata, KernelOps, LoraBatch, LoraSegment
from loraplex.models.llama import LlamaModel, StepInputs
from loraplex.unified_pager import UnifiedPager

from .sampler import Sampler
from .scheduler import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token, for requests whose known tokens are all computed
    # request id -> (first position, logits [n, V] of positions first..first+n-1), with return_logits
    logits: dict[str, tuple[int, torch.Tensor]]


class ModelRunner:
    def __init__(self, model: LlamaModel, pager: UnifiedPager, ops: KernelOps, sampler: Sampler):
        self.model = model
        self.pager = pager
        self.ops = ops
        self.sampler = sampler
        self.device = model.device
        self.kv_pool = pager.pool.kv_view()
        self.pool_rows = pager.pool.rows()
        # The previous step's adapter segments: while the same requests decode, every step has the same
        # segments, and reusing the batch keeps the kernels' per-(layer, module) plans (index tensors
        # gathered from 7 x layers x adapters page tables) instead of rebuilding them every step.
        self._last_lora: LoraBatch | None = None

    def _lora_batch(self, segments: tuple[LoraSegment, ...], num_tokens: int) -> LoraBatch | None:
        """This step's LoraBatch: the previous step's when the segments are the same ones (same tokens,
        same residencies: a residency never changes its pages, a reload is a new object)."""
        if not segments:
            return None
        prev = self._last_lora
        if prev is None or prev.num_tokens != num_tokens or prev.segments != segments:
            prev = self._last_lora = LoraBatch(segments, num_tokens)
        return prev

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        chunks = sorted(sched.chunks, key=lambda c: (c.adapter is not None, str(c.adapter)))
        step, samplers, logit_spans = self._build(chunks)
        logits = self.model.forward(step, self.kv_pool, self.pool_rows, self.ops)  # [N, V]

        out_logits: dict[str, tuple[int, torch.Tensor]] = {}
        for rid, (first_pos, row0, n) in logit_spans.items():
            out_logits[rid] = (first_pos, logits[row0 : row0 + n])
        sampled: dict[str, int] = {}
        if samplers:
            rows = [r for _, r in samplers]
            reqs = [c.request for c, _ in samplers]
            # In a plain decode step every logits row samples, in order: no need to copy them.
            if rows != list(range(logits.shape[0])):
                logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
            tokens = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
            sampled = {r.request_id: t for r, t in zip(reqs, tokens)}
        return RunnerOutput(sampled, out_logits)

    def _build(self, chunks: list[ScheduledChunk]):
        bs = self.pager.geometry.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seq_of_token: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_index: list[int] = []
        samplers: list[tuple[ScheduledChunk, int]] = []  # (chunk, row in logits)
        logit_spans: dict[str, tuple[int, int, int]] = {}
        segments: list[LoraSegment] = []

        for s, c in enumerate(chunks):
            req = c.request
            start_tok = len(input_ids)
            first = req.num_computed_tokens
            last = first + c.num_new_tokens
            input_ids.extend(req.token_ids_slice(first, last))
            positions.extend(range(first, last))
            seq_of_token.extend([s] * c.num_new_tokens)
            query_lens.append(c.num_new_tokens)
            seq_lens.append(last)
            if req.params.return_logits:
                # Record each position once, even when a preempted request recomputes it.
                lo = max(first, len(req.logits_rows))
                if lo < last:
                    logit_spans[req.request_id] = (lo, len(logits_index), last - lo)
                    logits_index.extend(range(start_tok + lo - first, start_tok + c.num_new_tokens))
            if last == req.num_tokens:  # caught up: this step samples its next token
                row = len(logits_index) - 1 if req.params.return_logits and lo < last else None
                if row is None:
                    logits_index.append(start_tok + c.num_new_tokens - 1)
                    row = len(logits_index) - 1
                samplers.append((c, row))
            if c.adapter is not None:
                res = self.pager.get_adapter(c.adapter)
                prev = segments[-1] if segments else None
                if prev is not None and prev.adapter is res and prev.start + prev.length == start_tok:
                    segments[-1] = LoraSegment(prev.start, prev.length + c.num_new_tokens, res)
                else:
                    segments.append(LoraSegment(start_tok, c.num_new_tokens, res))

        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        seq_t = torch.tensor(seq_of_token, dtype=torch.long, device=dev)
        tables = self.pager.block_tables([c.request.request_id for c in chunks]).to(dev)  # [L, S, B]
        slot_pages = tables[:, seq_t, pos_t // bs].long()  # [L, T]
        qs = [0]
        for q in query_lens:
            qs.append(qs[-1] + q)
        attn = AttentionMetadata(
            block_size=bs,
            positions=pos_t,
            query_start=torch.tensor(qs, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables,
            slot_pages=slot_pages,
            slot_offsets=pos_t % bs,
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )
        lora = self._lora_batch(tuple(segments), len(input_ids))
        step = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            attn=attn,
            lora=lora,
            logits_index=torch.tensor(logits_index, dtype=torch.long, device=dev),
        )
        return step, samplers, logit_spans
