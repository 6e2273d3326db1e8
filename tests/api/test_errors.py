"""Every error status of the API, in OpenAI's shape: 400, 401, 403, 404, 409, 413, 429, 503."""

from __future__ import annotations

import io
import zipfile

import httpx
import pytest

from api_server import make_tenant, upload


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.fixture(scope="module")
def admin(live, adapter_dirs):
    _, key = make_tenant(live, "errs")
    assert upload(live, key, "good", adapter_dirs["a8"]).status_code == 201
    return key


def test_401_missing_unknown_and_revoked_keys(live, admin):
    with live.client(None) as c:
        e = _err(c.post("/v1/completions", json={"prompt": "hi"}), 401)
        assert "missing API key" in e["message"] and e["type"] == "authentication_error"
    with live.client("lpx_not-a-key") as c:
        assert "unknown" in _err(c.get("/v1/models"), 401)["message"]
    with live.client(admin) as c:
        made = c.post("/v1/keys", json={"role": "user", "label": "temp"}).json()
        assert c.delete(f"/v1/keys/{made['id']}").json()["revoked"] is True
    with live.client(made["api_key"]) as c:
        _err(c.get("/v1/models"), 401)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "temperature": 3}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 3}, "logprobs"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"prompt": "hi", "stop": [""]}, None),
    ({}, "prompt"),
])
def test_400_bad_parameters(live, admin, body, param):
    with live.client(admin) as c:
        e = _err(c.post("/v1/completions", json=body), 400)
        assert e["type"] == "invalid_request_error"
        if param is not None:
            assert e["param"] == param, e


def test_400_bad_chat_bodies(live, admin):
    with live.client(admin) as c:
        assert _err(c.post("/v1/chat/completions", json={"messages": []}), 400)["param"] == "messages"
        _err(c.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
        _err(c.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
             400)
        e = _err(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                      "tools": [{"type": "function"}]}), 400)
        assert e["param"] == "tools"


def test_400_prompt_over_the_context(live, admin):
    limit = live.state.model.max_model_len
    with live.client(admin) as c:
        e = _err(c.post("/v1/completions", json={"prompt": [5] * limit, "max_tokens": 1}), 400)
        assert e["code"] == "context_length_exceeded" and str(limit) in e["message"]


def test_404_unknown_adapter_and_routes(live, admin):
    with live.client(admin) as c:
        e = _err(c.post("/v1/completions", json={"prompt": "hi", "adapter_id": "nope"}), 404)
        assert e["code"] == "model_not_found" and e["param"] == "adapter_id"
        e = _err(c.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                 404)
        assert e["param"] == "model"
        _err(c.get("/v1/adapters/nope"), 404)
        _err(c.delete("/v1/adapters/nope"), 404)
        _err(c.get("/v1/no-such-route"), 404)


def test_400_and_409_uploads(live, admin, adapter_dirs, tmp_path):
    with live.client(admin) as c:
        e = _err(c.post("/v1/adapters", data={"name": "bad"},
                        files=[("files", ("adapter_model.bin", b"\x80\x02pickle", "application/octet-stream"))]), 400)
        assert e["code"] == "invalid_adapter"
        e = _err(c.post("/v1/adapters", data={"name": "../etc"},
                        files=[("files", ("adapter_config.json", b"{}"))]), 400)
        assert e["param"] == "name"
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("../evil/adapter_config.json", "{}")
        e = _err(c.post("/v1/adapters", data={"name": "zip"}, files=[("files", ("a.zip", buf.getvalue()))]), 400)
        assert ".." in e["message"] or "path" in e["message"]
        names = {a["name"] for a in c.get("/v1/adapters").json()["data"]}
        assert names == {"good"}  # nothing of the refused uploads was kept
    with live.client() as c:  # operator
        _err(c.post("/v1/tenants", json={"name": "errs"}), 409)


def _raw_post(live, path: str, key: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, dict]:
    """Send a request by hand (httpx will not declare a length it does not send); returns (status, body)."""
    import json
    import socket

    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        s.sendall(head.encode())
        try:
            for c in chunks:
                s.sendall(c)
        except OSError:
            pass  # the server may close as soon as it has answered
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 10:
            more = s.recv(65536)
            if not more:
                break
            data += more
    status = int(data.split(b" ", 2)[1])
    body = data.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(body[body.index(b"{"):body.rindex(b"}") + 1])


def test_413_bodies_over_the_cap(live, admin):
    cap = live.state.store.config.max_upload_bytes
    # A declared length over the cap: refused from the header, before any of the body is read.
    status, body = _raw_post(live, "/v1/adapters", admin, {"Content-Length": str(cap + (2 << 20)),
                                                           "Content-Type": "multipart/form-data; boundary=x"},
                             [b"--x\r\n"])
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # A chunked JSON body (no declared length) is cut off once it passes the cap for non-upload routes.
    from loraplex.api.app import MAX_JSON_BODY

    piece = b"x" * (1 << 20)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    n = MAX_JSON_BODY // len(piece) + 2
    status, body = _raw_post(live, "/v1/completions", admin, {"Transfer-Encoding": "chunked",
                                                              "Content-Type": "application/json"}, [chunk] * n)
    assert status == 413, body


def test_403_operator_cannot_infer(live):
    with live.client() as c:
        assert _err(c.post("/v1/completions", json={"prompt": "hi"}), 403)["type"] == "permission_error"


@pytest.fixture(scope="module")
def tight(chat_model_dir, adapter_dirs, tmp_path_factory):
    """A server that runs one sequence at a time and queues at most one more."""
    from dataclasses import replace

    from api_server import server_config, start_server

    config = server_config(chat_model_dir, tmp_path_factory.mktemp("tight-data"), max_waiting_requests=1)
    config = replace(config, engine=replace(config.engine, max_num_seqs=1))
    server = start_server(config)
    yield server
    server.stop()


def test_429_when_the_queue_is_full(tight):
    _, key = make_tenant(tight, "busy")
    state = tight.state
    with tight.client(key) as c, tight.client(key) as c2:
        body = {"prompt": [5, 6, 7], "max_tokens": 150, "stream": True, "temperature": 0}
        with c.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            with c2.stream("POST", "/v1/completions", json=body) as second:
                assert second.status_code == 200
                for _ in range(500):  # until the second request sits in the engine's queue
                    if state.engine.stats.num_waiting >= 1:
                        break
                    import time

                    time.sleep(0.01)
                r = tight.client(key).post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                e = _err(r, 429)
                assert e["type"] == "rate_limit_error" and e["code"] == "overloaded"
                assert int(r.headers["Retry-After"]) >= 1


def test_503_while_draining(live, admin):
    state = live.state
    state.draining = True
    try:
        with live.client(admin) as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert _err(r, 503)["code"] == "draining" and "Retry-After" in r.headers
            ready = c.get("/ready")
            assert ready.status_code == 503 and ready.json()["problems"]["server"] == "draining"
            assert c.get("/health").status_code == 200
    finally:
        state.draining = False
    with live.client(admin) as c:
        assert c.get("/ready").status_code == 200
