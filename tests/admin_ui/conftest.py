"""Fixtures of the dashboard tests: a real loraplex server on 127.0.0.1 (the API tests' helpers) on a tiny
random Llama with a tokenizer, PEFT adapters made here with peft, and headless Debian Chromium driven by
Playwright. Under CI a missing Chromium or Playwright fails the run instead of skipping it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "api"))  # api_server: the live-server helpers
sys.path.insert(0, str(Path(__file__).parent))  # admin_browser

from api_server import LiveServer, one_torch_thread, server_config, start_server  # noqa: E402,F401 (autouse fixture)
from factories import make_chat_model, make_peft_adapter  # noqa: E402

CHROMIUM = Path(os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium"))


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI: `.ci/run` installs it with apt-get install -y chromium)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where page screenshots go: $LORAPLEX_SCREENSHOTS (CI keeps them as artifacts), else a temp folder."""
    folder = Path(os.environ["LORAPLEX_SCREENSHOTS"]) if os.environ.get("LORAPLEX_SCREENSHOTS") \
        else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")  # Playwright's sync API holds an event loop in this thread: stop it after the module
def browser():
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e .[dev])")
    with sync_playwright() as pw:
        # --no-sandbox: CI and these machines run as root, where Chromium's sandbox cannot start.
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("admin-model"))


@pytest.fixture(scope="session")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("admin-adapters")
    return {
        "good": make_peft_adapter(model_dir, root / "good", r=8, seed=1,
                                  target_modules=("q_proj", "v_proj", "o_proj", "down_proj")),
        "other": make_peft_adapter(model_dir, root / "other", r=4, seed=2, target_modules=("q_proj", "k_proj")),
        # Made by peft too, but DoRA, which the store refuses with a message naming it.
        "dora": make_peft_adapter(model_dir, root / "dora", r=4, seed=3, target_modules=("q_proj", "v_proj"),
                                  use_dora=True),
    }


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(server_config(model_dir, tmp_path_factory.mktemp("admin-data")))
    yield server
    server.stop()
