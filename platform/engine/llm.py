"""The offline Python API: LLM(...).generate(prompts, params, adapters=[...])."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from loraplex.config import EngineConfig
from loraplex.errors import RequestError

from .adapters import AdapterKey
from .engine_core import EngineCore
from .request import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str = "default",
        dtype: str = "float32",
        device: str = "cpu",
        pool_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_lora_rank: int = 256,
        **kwargs,
    ):
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            pool_bytes=pool_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_lora_rank=max_lora_rank,
            **kwargs,
        ).with_env()
        self.engine = EngineCore(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str | Path) -> AdapterKey:
        """Read and validate a PEFT adapter folder; a bad adapter raises AdapterError and changes nothing."""
        return self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        n = len(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        adapter_list = list(adapters) if adapters is not None else [None] * n
        if len(params_list) != n or len(adapter_list) != n:
            raise RequestError(f"got {n} prompts, {len(params_list)} sampling params and {len(adapter_list)} adapters")
        # Validate everything before queueing anything, so a bad prompt leaves the engine unchanged.
        for a in adapter_list:
            if a is not None:
                self.engine.adapters.resolve(a)
        ids = []
        try:
            for p, sp, a in zip(prompts, params_list, adapter_list):
                ids.append(self.engine.add_request(p, sp, a).request_id)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < n:
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            # Leave no request of this call behind in the engine (and none of its pages).
            for rid in ids:
                if rid not in finals:
                    self.engine.abort_request(rid)
            raise
        return [finals[rid] for rid in ids]
