"""`loraplex serve` as a real process: first start prints an operator key once (only its hash is
stored); SIGTERM drains (503 for new requests, requests in flight finish), flushes metering, exits 0;
a model that cannot load makes the process exit non-zero."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from api_server import free_port

LOG_LIMIT = 4000


def _spawn(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    env.pop("LORAPLEX_OPERATOR_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


class _Reader:
    """Collects a process's output on a thread, so that reading never blocks the test."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._run, args=(proc,), daemon=True)
        self._t.start()

    def _run(self, proc):
        for line in proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)[-LOG_LIMIT:]


def _wait_ready(url: str, proc: subprocess.Popen, out: _Reader, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited early:\n{out.text}"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout} s:\n{out.text}")


def test_first_start_key_sigterm_drain_and_exit_0(tmp_path: Path):
    """README's main command: `loraplex serve` with no model flag serves the default model."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn(["--port", str(port), "--data-dir", str(tmp_path), "--drain-timeout-s", "120"])
    out = _Reader(proc)
    try:
        _wait_ready(url, proc, out)
        found = re.findall(r"operator API key \(shown once[^)]*\): (lpx_\S+)", out.text)
        assert len(found) == 1, out.text
        operator = found[0]
        # Only the hash is stored.
        db = (tmp_path / "registry.db").read_bytes()
        assert operator.encode() not in db
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {operator}"}, timeout=60) as c:
            admin = c.post("/v1/tenants", json={"name": "proc"}).json()["api_key"]
        auth = {"Authorization": f"Bearer {admin}"}
        # A long request in flight when SIGTERM arrives must finish.
        result: dict = {}

        def long_request():
            with httpx.Client(base_url=url, headers=auth, timeout=120) as c:
                # ~100 decode steps of the default model on one thread: seconds, long enough to be
                # in flight when SIGTERM arrives.
                result["r"] = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 100,
                                                              "temperature": 0, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(50):
            try:
                r = httpx.post(f"{url}/v1/completions", headers=auth, json={"prompt": "hi", "max_tokens": 1},
                               timeout=10)
            except httpx.TransportError:
                break
            if r.status_code == 503:
                refused = r
                break
            time.sleep(0.05)
        t.join(120)
        assert proc.wait(60) == 0, out.text
        assert refused is not None and refused.json()["error"]["code"] == "draining", out.text
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 100
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Metering was flushed: the finished request and the refused one are both in the database.
    import sqlite3

    con = sqlite3.connect(tmp_path / "registry.db")
    statuses = sorted(r[0] for r in con.execute("SELECT status FROM usage_events"))
    con.close()
    assert "ok" in statuses and "refused" in statuses, statuses


def test_a_model_that_cannot_load_exits_non_zero(tmp_path: Path):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    proc = _spawn(["--model", str(bad), "--port", str(free_port()), "--data-dir", str(tmp_path / "data")],
                  {"LORAPLEX_OPERATOR_KEY": ""})
    out = _Reader(proc)
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0, out.text
