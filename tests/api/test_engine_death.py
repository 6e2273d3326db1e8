"""A crash inside the engine step (a fault injected into the real engine): the request in flight gets an
error, new requests get 503, /ready says why, and the server stops with exit status 1."""

from __future__ import annotations


from api_server import make_tenant, server_config, start_server


def test_a_dead_engine_stops_the_server_with_status_1(chat_model_dir, tmp_path):
    live = start_server(server_config(chat_model_dir, tmp_path))
    try:
        _, key = make_tenant(live, "crash")
        core = live.state.engine.engine
        real_step = core.step
        calls = {"n": 0}

        def failing_step():
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("injected fault in the engine step")
            return real_step()

        core.step = failing_step
        with live.client(key) as c:
            r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 50, "ignore_eos": True})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
            assert "injected fault" in r.json()["error"]["message"]
        live.thread.join(30)
        assert not live.thread.is_alive()
        assert live.server.exit_code == 1
        # The failed request was metered as an error before the server went down.
        from sqlalchemy import text

        with _registry(tmp_path) as conn:  # the server closed its own connections at shutdown
            statuses = [r[0] for r in conn.execute(text("SELECT status FROM usage_events"))]
        assert statuses == ["error"], statuses
    finally:
        if live.thread.is_alive():
            live.stop()


def _registry(tmp_path):
    from sqlalchemy import create_engine

    return create_engine(f"sqlite:///{tmp_path / 'registry.db'}").connect()
