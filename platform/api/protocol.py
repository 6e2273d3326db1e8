"""Request bodies of the OpenAI-compatible endpoints (pydantic: they also make the OpenAPI schema).

Unknown fields are ignored, as OpenAI's other servers do; fields we know but do not support with the
given value (n > 1, logprobs, echo, penalties, ...) are refused by `unsupported()` with a message that
names them. `adapter_id` is loraplex's extension; `model` may name an adapter instead.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 16  # stop sequences per request, as OpenAI allows at most 4 and vLLM more


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=256, description="the base model's id, or an adapter name")
    adapter_id: str | None = Field(None, max_length=256, description="the adapter to apply (loraplex extension)")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=1_000_000, description="0 or -1: off (vLLM extension)")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence (vLLM extension)")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Union[bool, int, None] = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field whose value we cannot honour, else None."""
        if self.n != 1:
            return "n", f"n={self.n} is not supported: loraplex returns one choice per request (n=1)"
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return param, f"{param} is not supported (only 0)"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported yet"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            return "stop", f"at most {MAX_STOP} stop sequences, got {len(self.stop)}"
        return None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="one prompt: text or token ids (a list of one prompt is accepted too)")
    max_tokens: int | None = Field(16, ge=1, le=1_000_000)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported (only 1)"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    tools: list[dict] | None = None
    response_format: dict | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only response_format {'type': 'text'} is supported"
        return super().unsupported()


class TenantSettingsBody(BaseModel):
    """A tenant's admission settings; null limits mean the server's defaults."""

    model_config = ConfigDict(extra="forbid")
    ttft_target_ms: int | None = Field(None, ge=1, le=3_600_000)
    requests_per_minute: int | None = Field(None, ge=1, le=10**9)
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12)
    max_concurrent: int | None = Field(None, ge=1, le=10**6)
    share: float = Field(1.0, gt=0, le=1000, description="weight under fair queueing (VTC)")


class TenantCreateBody(TenantSettingsBody):
    name: str = Field(..., min_length=1, max_length=64)


class TenantPatchBody(TenantSettingsBody):
    """Only the fields sent change (send null to go back to the server default)."""

    share: float | None = Field(None, gt=0, le=1000)


class KeyCreateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "admin"] = "user"
    label: str | None = Field(None, max_length=128)
    tenant: str | None = Field(None, max_length=64, description="operator only: the tenant's name")
