"""Tiny random base models shared by the LoRA tests (made once per session; adapters are made per test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from factories import make_tiny_model
from loraplex.models.config import ModelConfig, load_model_config


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral")


@pytest.fixture(scope="session")
def llama_config(llama_dir: Path) -> ModelConfig:
    return load_model_config(llama_dir)
