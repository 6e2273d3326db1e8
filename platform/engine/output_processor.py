"""Per-request output state: incremental text, stop conditions, and the RequestOutput objects."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .request import Request, RequestOutput, RequestStatus
from .stop_checker import StopChecker


@dataclass
class _TextState:
    detok: IncrementalDetokenizer | None
    stops: StopChecker
    pending: str = ""  # text released by the last check, not yet reported in a RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self._state: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids) if self.tokenizer is not None else None
        self._state[req.request_id] = _TextState(detok, StopChecker(req.params.stop))

    def check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """After a new token: the finishing status, or None if the request goes on."""
        st = self._state[req.request_id]
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            # The stop token stays in token_ids; special tokens never reach the text.
            if st.detok is not None:
                st.pending += st.stops.push(st.detok.push([token])).emit
            return RequestStatus.FINISHED_STOPPED
        if st.detok is not None:
            update = st.stops.push(st.detok.push([token]))
            st.pending += update.emit
            if update.stopped:
                return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def delta(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        st = self._state[req.request_id]
        new_text, st.pending = st.pending, ""
        return self._output(req, new_tokens, new_text, st.stops.text, finished=False)

    def finish(self, req: Request) -> RequestOutput:
        """The final output of a finished request (stopped, length or aborted); forgets its state."""
        st = self._state.pop(req.request_id)
        new_text = st.pending
        if st.detok is not None and not st.stops.stopped:
            new_text += st.stops.push(st.detok.flush()).emit
            new_text += st.stops.finish()
        new_tokens = req.output_token_ids[-1:] if req.status != RequestStatus.FINISHED_ABORTED else []
        return self._output(req, new_tokens, new_text, st.stops.text, finished=True)

    def _output(self, req: Request, new_tokens: list[int], new_text: str, text: str, finished: bool) -> RequestOutput:
        prompt_logits = logits = None
        if finished and req.params.return_logits and req.logits_rows:
            rows = torch.stack(req.logits_rows)
            p = len(req.prompt_token_ids)
            prompt_logits = rows[:p]
            logits = rows[p - 1 : p - 1 + len(req.output_token_ids)]
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=text,
            new_token_ids=list(new_tokens),
            new_text=new_text,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            adapter=req.adapter,
            prompt_logits=prompt_logits,
            logits=logits,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
        )
