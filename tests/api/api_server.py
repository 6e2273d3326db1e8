"""Helpers of the API tests: a real loraplex server (uvicorn on 127.0.0.1, a free port) in a thread of the
test process, and the calls most tests start with. Imported by name (`from api_server import ...`):
`conftest` is ambiguous when the whole suite runs, since every test folder has one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
from loraplex.adapter_store.config import StoreConfig
from loraplex.api.app import create_app
from loraplex.api.server import LoraplexServer
from loraplex.api.settings import ServerConfig
from loraplex.api.state import ServerState
from loraplex.config import EngineConfig
from loraplex.kernels import cpu_build

OPERATOR_KEY = "lpx_test-operator-key-0123456789"


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Imported by the API and dashboard conftests: the server's tiny ops gain nothing from threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add waiting on a busy 2-core machine
    yield
    torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(model_dir: Path, data_dir: Path, **changes) -> ServerConfig:
    engine = EngineConfig(model=str(model_dir), pool_bytes=64 << 20, max_num_seqs=128, max_num_batched_tokens=512,
                          max_lora_rank=64, kernels="torch", queue_policy="vtc")
    store = StoreConfig(data_dir=data_dir, host_cache_bytes=256 << 20)
    config = ServerConfig(engine=engine, store=store, port=free_port(), operator_key=OPERATOR_KEY,
                          metering_flush_s=0.1)
    return replace(config, **changes)


@dataclass
class LiveServer:
    url: str
    server: LoraplexServer
    thread: threading.Thread

    @property
    def state(self) -> ServerState:
        return self.server._state()

    def client(self, key: str | None = OPERATOR_KEY, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def start_server(config: ServerConfig, wait_ready: bool = True) -> LiveServer:
    import uvicorn

    if config.engine.device == "cpu":
        # The first start on a machine builds the C++ kernels (minutes on 2 cores, more beside other builds);
        # that belongs to no test's readiness deadline below.
        cpu_build.build_all()
    app = create_app(config)
    uv = uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning", lifespan="on",
                        timeout_graceful_shutdown=2)
    server = LoraplexServer(uv, config.drain_timeout_s)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{config.port}", server, thread)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("the server thread exited during start-up")
        try:
            r = httpx.get(f"{live.url}/ready", timeout=2)
            if r.status_code == 200 or (not wait_ready and r.status_code == 503):
                return live
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    live.stop()
    raise RuntimeError("the server did not become ready within 120 s")


def make_tenant(live: LiveServer, name: str) -> tuple[str, str]:
    """(tenant id, admin key) of a new tenant, made through the operator API."""
    with live.client() as c:
        r = c.post("/v1/tenants", json={"name": name})
        assert r.status_code == 201, r.text
        body = r.json()
        return body["tenant"]["id"], body["api_key"]


def upload(live: LiveServer, key: str, name: str, folder: Path) -> httpx.Response:
    files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in sorted(folder.iterdir())]
    with live.client(key) as c:
        return c.post("/v1/adapters", data={"name": name}, files=files)
