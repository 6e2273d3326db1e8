"""The dashboard's actions run the HTTP API's own route functions, as the signed-in principal.

Why: an upload, a delete, a new key or a tenant's new limits then follow exactly the API's rules (the
store's validation, the engine forgetting a deleted adapter, the tenant cache refreshed after a change,
"not found" for another tenant's objects) instead of a second copy of them. The route functions are
plain async functions; FastAPI's Depends defaults matter only when FastAPI calls them.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any

from starlette.responses import Response

from loraplex.api.errors import ApiError, from_exception


async def call(action: Awaitable[Any]) -> dict:
    """Await a route function; its JSON answer as a dict (raises ApiError for any refusal)."""
    try:
        result = await action
    except ApiError:
        raise
    except Exception as e:  # domain errors (AdapterError, NotFoundError, ...): the API's status and message
        err = from_exception(e)
        if err.status >= 500:
            raise
        raise err from e
    if isinstance(result, Response):
        return json.loads(bytes(result.body))
    return result
