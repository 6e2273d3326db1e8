"""Fixtures for the admission tests: the shared Redis on 127.0.0.1:6379 (a unique key prefix per test),
private redis-server processes that a test can kill and restart, and a clock that tests move by hand.

Redis tests skip when Redis (or the redis-server binary) is missing, except under CI (CI set), where they
fail: CI must never pass by skipping them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from loraplex.admission import LocalLimiter, RedisLimiter

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def unavailable(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: the Redis tests must run)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
        client.ping()
        client.close()
    except redis.exceptions.RedisError as e:
        unavailable(f"Redis at {REDIS_URL} is not reachable: {e}")
    return REDIS_URL


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A prefix no other test (or test run) uses; its keys are deleted afterwards."""
    prefix = f"loraplex:test:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


@pytest.fixture
def replicas(redis_url: str, key_prefix: str) -> Iterator[Callable[..., RedisLimiter]]:
    """Makes RedisLimiters on one Redis and prefix: each one stands for a server replica."""
    made: list[RedisLimiter] = []

    def make(**kwargs) -> RedisLimiter:
        limiter = RedisLimiter(redis_url, key_prefix=key_prefix, **kwargs)
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        limiter.close()


@pytest.fixture(params=["local", "redis"])
def make_limiter(request: pytest.FixtureRequest) -> Callable[..., LocalLimiter | RedisLimiter]:
    """Each backend in turn, for the contract tests that both must pass identically."""
    if request.param == "local":
        return LocalLimiter
    return request.getfixturevalue("replicas")


class ManualClock:
    """A monotonic clock that moves only when a test says (exact retry_after values, no sleeping)."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A private redis-server on a spare port, killed and restarted by the test (a real outage)."""

    def __init__(self, binary: str, workdir: Path):
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from e
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to clients."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (commands time out)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=2, socket_timeout=2)

    def cleanup(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not on PATH")
    server = RedisProcess(binary, tmp_path)
    server.start()
    yield server
    server.cleanup()
