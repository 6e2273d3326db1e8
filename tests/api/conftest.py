"""A real loraplex server (uvicorn on 127.0.0.1, a free port) in a thread of the test process, on a
tiny random Llama with a trained byte-level tokenizer; PEFT adapters made here with peft.

Running it in a thread (not a subprocess) lets tests look inside: the engine's requests and pages
after clients hang up, the usage rows after a flush. The SIGTERM test starts `loraplex serve` as a
real subprocess instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api_server import LiveServer, one_torch_thread, server_config, start_server  # noqa: F401 (autouse fixture)
from factories import make_chat_model, make_peft_adapter


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("api-model"))


@pytest.fixture(scope="session")
def adapter_dirs(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("api-adapters")
    return {
        "a8": make_peft_adapter(chat_model_dir, root / "a8", r=8, seed=1,
                                target_modules=("q_proj", "v_proj", "o_proj", "down_proj")),
        "b4": make_peft_adapter(chat_model_dir, root / "b4", r=4, seed=2,
                                target_modules=("q_proj", "k_proj", "gate_proj", "up_proj")),
    }


@pytest.fixture(scope="module")
def live(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(server_config(chat_model_dir, tmp_path_factory.mktemp("api-data")))
    yield server
    server.stop()


