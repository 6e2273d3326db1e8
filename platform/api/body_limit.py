"""An ASGI middleware that caps request bodies before any parser reads them.

FastAPI parses a multipart form before the route runs, so a size check inside the route would come
after a multi-GB upload had been spooled to disk. Here a declared Content-Length over the cap gets 413
at once, and a body sent without one (chunked) is cut off as soon as it passes the cap.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body


class BodyLimit:
    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int]):
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, int(declared), limit)
            return
        received = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    return {"type": "http.disconnect"}  # the app stops reading; we answer below
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # the app's own answer to the cut-off body is replaced by the 413
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except ClientDisconnect:
            if not exceeded:
                raise
        if exceeded and not started:
            await _too_large(send, received, limit)


async def _too_large(send: Send, size: int, limit: int) -> None:
    body = json.dumps(error_body(413, f"the request body is over the limit of {limit:,} bytes (got at least "
                                      f"{size:,})", "invalid_request_error", "request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
