"""Predict when a queued request gets its first token, from a snapshot of the engine's queue and the
fitted step cost: the engine runs running requests first (one decode token each), then waiting prompts
in queue order, in chunks under the token budget (vLLM V1's rule). The prediction plays those steps
forward without running them.

Running requests are assumed to keep decoding through the horizon (their finishing frees budget only
later than predicted: the estimate errs on the late side, which is the safe side for an SLO refusal);
when the sequence limit is reached, a new request waits for the running request closest to its
max_tokens to finish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost_model import StepCost


@dataclass(frozen=True)
class RunningSeq:
    context: int  # tokens in its KV now
    remaining: int  # output tokens it may still generate (max_tokens - generated)


@dataclass(frozen=True)
class QueueSnapshot:
    """What the engine thread publishes after each step (read by admission on the HTTP side)."""

    running: tuple[RunningSeq, ...]
    waiting_prompt_tokens: tuple[int, ...]  # remaining prompt tokens of each waiting request, queue order
    max_num_batched_tokens: int
    max_num_seqs: int
    taken_at: float  # time.monotonic()

    @staticmethod
    def empty(max_num_batched_tokens: int, max_num_seqs: int) -> "QueueSnapshot":
        return QueueSnapshot((), (), max_num_batched_tokens, max_num_seqs, 0.0)


def predict_first_token_s(snap: QueueSnapshot, cost: StepCost, prompt_tokens: int,
                          ahead_prompt_tokens: int | None = None, ahead_requests: int | None = None,
                          extra_s: float = 0.0) -> float:
    """Seconds from the snapshot until a request with this prompt gets its first token, if it were
    queued behind `ahead_prompt_tokens` of waiting prompts (default: all of them) in `ahead_requests`
    requests. extra_s adds what must happen first (e.g. loading its adapter)."""
    if ahead_prompt_tokens is None:
        ahead_prompt_tokens = sum(snap.waiting_prompt_tokens)
    if ahead_requests is None:
        ahead_requests = len(snap.waiting_prompt_tokens)
    decoding = len(snap.running)
    context = sum(r.context for r in snap.running)
    wait_s = 0.0
    # A full batch: the request cannot start before enough running ones finish.
    over = decoding + ahead_requests + 1 - snap.max_num_seqs
    if over > 0 and snap.running:
        finishing = sorted(r.remaining for r in snap.running)[: min(over, len(snap.running))]
        steps = finishing[-1]
        wait_s += steps * cost.predict(decoding, context)
        context += decoding * steps
        decoding = max(0, decoding - len(finishing))
    budget_for_prompts = max(1, snap.max_num_batched_tokens - decoding)
    todo = ahead_prompt_tokens + prompt_tokens
    steps = max(1, math.ceil(todo / budget_for_prompts))
    for i in range(steps):
        chunk = min(budget_for_prompts, todo - i * budget_for_prompts)
        # Prompt chunks read the KV already written for their own prompt: about half a chunk's worth
        # on average over the prefill; decoding sequences read their whole context.
        wait_s += cost.predict(decoding + chunk, context + decoding * i + (i * budget_for_prompts) // 2)
    return wait_s + extra_s
