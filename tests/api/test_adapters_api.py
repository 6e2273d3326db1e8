"""Adapter management over HTTP: upload as files or one archive, versions, listing with pagination,
and delete while a request using the adapter is in flight (it finishes; new requests get 404)."""

from __future__ import annotations

import io
import threading
import zipfile

from api_server import make_tenant, upload


def test_archive_upload_versions_and_pagination(live, adapter_dirs):
    _, key = make_tenant(live, "adm")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for p in sorted(adapter_dirs["b4"].iterdir()):
            z.write(p, p.name)
    with live.client(key) as c:
        r = c.post("/v1/adapters", data={"name": "zipped"}, files=[("files", ("adapter.zip", buf.getvalue()))])
        assert r.status_code == 201, r.text
        first = r.json()
        assert first["version"] == 1 and first["rank"] == 4 and first["object"] == "adapter"
        second = upload(live, key, "zipped", adapter_dirs["a8"]).json()
        assert second["version"] == 2 and second["id"] != first["id"] and second["rank"] == 8
        detail = c.get("/v1/adapters/zipped").json()
        assert detail["id"] == second["id"] and [v["version"] for v in detail["versions"]] == [1, 2]
        # Requests use the newest ready version: the engine serves rank 8 now.
        assert c.post("/v1/completions", json={"adapter_id": "zipped", "prompt": "hi", "max_tokens": 2}
                      ).status_code == 200
        for i in range(3):
            assert upload(live, key, f"pg-{i}", adapter_dirs["b4"]).status_code == 201
        seen, cursor = [], None
        while True:
            params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
            page = c.get("/v1/adapters", params=params).json()
            seen += [(a["name"], a["version"]) for a in page["data"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == [("pg-0", 1), ("pg-1", 1), ("pg-2", 1), ("zipped", 1), ("zipped", 2)]


def test_delete_lets_requests_in_flight_finish(live, adapter_dirs):
    _, key = make_tenant(live, "deleter")
    assert upload(live, key, "doomed", adapter_dirs["a8"]).status_code == 201
    started = threading.Event()
    result: dict = {}

    def stream():
        with live.client(key) as c:
            body = {"adapter_id": "doomed", "prompt": [5, 6], "max_tokens": 60, "stream": True, "ignore_eos": True,
                    "temperature": 0}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                    lines.append(line)
                result["status"], result["lines"] = r.status_code, lines

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    with live.client(key) as c:
        assert c.delete("/v1/adapters/doomed").json() == {"id": "doomed", "object": "adapter", "deleted": True,
                                                          "versions": 1}
        r = c.post("/v1/completions", json={"adapter_id": "doomed", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        assert c.get("/v1/adapters/doomed").status_code == 404
        assert "doomed" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
    t.join(120)
    lines = [line for line in result["lines"] if line]
    assert result["status"] == 200 and lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(result["lines"])
    assert not [line for line in result["lines"] if '"error"' in line]
