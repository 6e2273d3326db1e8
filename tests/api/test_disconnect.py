"""Clients that hang up mid-stream: their requests are aborted, their KV pages freed, and each leaves
one usage record with status "cancelled"."""

from __future__ import annotations

import asyncio
import time

import httpx

from api_server import make_tenant, upload


def _engine_idle(state, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = state.engine.stats
        if s.num_waiting == 0 and s.num_running == 0 and s.kv_pages == 0 and state.in_flight == 0:
            return True
        time.sleep(0.05)
    return False


def test_hundred_streaming_clients_hang_up(live, adapter_dirs):
    tenant_id, key = make_tenant(live, "hangups")
    assert upload(live, key, "ad", adapter_dirs["a8"]).status_code == 201
    state = live.state
    assert _engine_idle(state)
    before = state.recorder.stats().written + state.recorder.stats().pending

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, bool]:
        body = {"prompt": [3 + i % 50, 9, 12], "max_tokens": 200, "stream": True, "temperature": 0,
                "adapter_id": "ad" if i % 2 else None}
        got, finished = 0, False
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    got += 1
                    # A random model may emit EOS at once: such a request finished before we hung up.
                    finished = finished or '"finish_reason":"' in line
                    if got >= 2:  # a token or two, then hang up mid-stream
                        break
        return got, finished

    async def main() -> list[tuple[int, bool]]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {key}"},
                                     timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    got = asyncio.run(main())
    assert all(g >= 1 for g, _ in got)
    cut = sum(not f for _, f in got)
    assert cut >= 90  # EOS within two tokens is rare
    assert _engine_idle(state), f"left behind: {state.engine.stats}"
    core = state.engine.engine
    assert not core.requests
    core.pager.check_integrity()
    state.recorder.flush(30)
    assert state.recorder.stats().written - before >= 100
    from sqlalchemy import text

    with state.registry.engine.connect() as conn:
        rows = conn.execute(text("SELECT status, count(*) FROM usage_events WHERE tenant_id = :t GROUP BY status"),
                            {"t": tenant_id}).all()
    counts = dict(rows)
    assert counts.get("cancelled", 0) == cut and counts.get("ok", 0) == 100 - cut, counts
