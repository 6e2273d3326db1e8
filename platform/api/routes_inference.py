"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models (OpenAI's shapes)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from loraplex.engine.request import RequestOutput

from .auth import Principal, principal
from loraplex.admission.slo import SLO_MISSED

from .errors import ApiError, bad_request, error_body, from_exception, too_many, unavailable
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from .serving import Generation, InferenceService
from .state import get_state

router = APIRouter(tags=["inference"])
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")


def _params(body: _Sampling, max_tokens: int | None) -> dict:
    bad = body.unsupported()
    if bad is not None:
        raise bad_request(bad[1], param=bad[0])
    return dict(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)


def _completion_prompt(prompt: object):
    """One prompt as text or ids; a list holding exactly one prompt is accepted too."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]

    def make(tokenizer) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as token ids", param="prompt")
            return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        vocab = len(tokenizer) if tokenizer is not None else None
        ids = [int(t) for t in prompt]
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise bad_request("prompt token ids must lie inside the vocabulary", param="prompt")
        return ids

    return make


def _chat_prompt(body: ChatCompletionRequest):
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]

    def make(tokenizer) -> list[int]:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may refuse a role order (e.g. two system messages)
            raise bad_request(f"the chat template refused these messages: {e}", param="messages") from None
        # The template writes any BOS itself: adding special tokens again would double it.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return make


def _usage(out: RequestOutput | None, gen: Generation) -> dict:
    completion = len(out.token_ids) if out is not None else 0
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(gen.prompt_ids) + completion}


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(service: InferenceService, gen: Generation, request: Request) -> RequestOutput | None:
    """Run to the end; a client that hangs up first aborts the request (its pages free at once) and
    gets None."""

    async def run() -> RequestOutput:
        last = None
        async for out in service.run(gen):
            last = out
        return last

    task = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if not task.done() or task.cancelled():
        try:
            await task  # let the abort and the usage record happen before the handler returns
        except asyncio.CancelledError:
            pass
        return None
    return task.result()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _stream(service: InferenceService, gen: Generation, chat: bool, include_usage: bool
                  ) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": gen.request_id, "object": obj, "created": created, "model": gen.model_name}

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = dict(head, choices=[choice])
        if include_usage:
            body["usage"] = None
        return body

    runner = service.run(gen)
    last = None
    try:
        if chat:
            yield _sse(chunk(None, None, first=True))
        async for out in runner:
            last = out
            if out.finished and out.finish_reason == SLO_MISSED:
                err = too_many("the request waited past the point where its TTFT target could be met",
                               retry_after_s=1, code=SLO_MISSED)
                yield _sse(error_body(err.status, err.message, err.type, err.code, err.param))
                break
            if out.finished:
                yield _sse(chunk(out.new_text, _finish_reason(out)))
            elif out.new_text:
                yield _sse(chunk(out.new_text, None))
        if include_usage:
            yield _sse(dict(head, choices=[], usage=_usage(last, gen)))
    except Exception as e:  # the status line has gone out: report the failure in the stream
        err = from_exception(e)
        yield _sse(error_body(err.status, err.message, err.type, err.code, err.param))
    finally:
        await runner.aclose()
    yield _sse("[DONE]")


async def _serve(request: Request, p: Principal, body: _Sampling, make_prompt, max_tokens: int | None,
                 chat: bool, prompt_param: str):
    service: InferenceService = request.app.state.inference
    gen = await service.admit(p, body.adapter_id, body.model, make_prompt, lambda: _params(body, max_tokens),
                              prompt_param)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(service, gen, chat, include), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": gen.request_id})
    out = await _collect(service, gen, request)
    if out is None:  # the client hung up: nobody reads this
        return Response(status_code=499)
    if not out.finished:
        raise unavailable("the request ended without output")
    if out.finish_reason == SLO_MISSED:  # aborted while queued: no token was ever produced
        raise too_many("the request waited past the point where its TTFT target could be met; retry later",
                       retry_after_s=1, code=SLO_MISSED)
    choice: dict
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": _finish_reason(out)}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": _finish_reason(out)}
    return JSONResponse({
        "id": gen.request_id, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": gen.model_name, "choices": [choice], "usage": _usage(out, gen),
    }, headers={"X-Request-Id": gen.request_id})


@router.post("/v1/completions", summary="Complete a prompt with the base model or an adapter")
async def completions(body: CompletionRequest, request: Request, p: Principal = Depends(principal)):
    return await _serve(request, p, body, _completion_prompt(body.prompt), body.max_tokens, False, "prompt")


@router.post("/v1/chat/completions", summary="Answer a conversation with the base model or an adapter")
async def chat_completions(body: ChatCompletionRequest, request: Request, p: Principal = Depends(principal)):
    max_tokens = body.max_completion_tokens or body.max_tokens
    return await _serve(request, p, body, _chat_prompt(body), max_tokens, True, "messages")


@router.get("/v1/models", summary="The base model and the caller's adapters")
async def models(request: Request, p: Principal = Depends(principal)):
    state = get_state(request)
    if state.model is None:
        raise unavailable("the model is still loading; retry shortly", code="loading")
    data = [{"id": state.model.name, "object": "model", "created": state.model.created, "owned_by": "loraplex",
             "root": state.model.name, "parent": None}]
    if p.tenant_id is not None:
        cursor = None
        while True:  # every ready adapter name once, newest version
            page = await run_in_threadpool(state.registry.list_adapters, p.tenant_id, 1000, cursor, ("ready",))
            latest: dict[str, object] = {}
            for a in page.items:
                latest[a.name] = a
            for a in latest.values():
                data.append({"id": a.name, "object": "model", "created": int(a.created_at.timestamp()),
                             "owned_by": "tenant", "root": a.id, "parent": state.model.name})
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    # A name split over two pages appears twice above; keep the newest entry.
    seen: dict[str, dict] = {}
    for m in data:
        seen[m["id"]] = m
    return {"object": "list", "data": list(seen.values())}


__all__ = ["router", "ApiError"]
