"""`loraplex tenants create`, `loraplex keys create`, and ServerConfig from flags and LORAPLEX_* variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.adapter_store.registry import Registry
from loraplex.api.settings import ServerConfig
from loraplex.errors import ConfigError


def _cli(*args: str, data_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("LORAPLEX_DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args, "--data-dir", str(data_dir)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_tenants_and_keys_from_the_command_line(tmp_path: Path):
    made = _cli("tenants", "create", "cli-co", "--json", data_dir=tmp_path)
    assert made.returncode == 0, made.stderr
    body = json.loads(made.stdout)
    assert body["tenant"]["name"] == "cli-co" and body["api_key"].startswith("lpx_")
    key = _cli("keys", "create", "--tenant", "cli-co", "--role", "user", "--json", data_dir=tmp_path)
    assert key.returncode == 0, key.stderr
    user = json.loads(key.stdout)
    registry = Registry.open(f"sqlite:///{tmp_path / 'registry.db'}")
    try:
        admin = registry.authenticate(body["api_key"])
        assert admin.role == "admin" and admin.tenant_id == body["tenant"]["id"]
        assert registry.authenticate(user["api_key"]).role == "user"
    finally:
        registry.close()
    # Refusals: a duplicate tenant, an unknown tenant; exit status 2 and a message, nothing created.
    dup = _cli("tenants", "create", "cli-co", data_dir=tmp_path)
    assert dup.returncode == 2 and "already exists" in dup.stderr
    missing = _cli("keys", "create", "--tenant", "nobody", data_dir=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_server_config_from_env_and_flags(tmp_path: Path):
    env = {"LORAPLEX_PORT": "9100", "LORAPLEX_MODEL": "/models/x", "LORAPLEX_DATABASE_URL": "sqlite:///x.db",
           "LORAPLEX_OBJECT_STORE_URL": "s3://bucket/prefix", "LORAPLEX_REDIS_URL": "redis://127.0.0.1:6379/0",
           "LORAPLEX_POOL_BYTES": "1000000", "LORAPLEX_MAX_LORA_RANK": "32", "LORAPLEX_DATA_DIR": str(tmp_path)}
    config = ServerConfig.from_env({"port": 9200}, environ=env)
    assert config.port == 9200  # the flag wins
    assert config.engine.model == "/models/x" and config.engine.pool_bytes == 1_000_000
    assert config.store.database_url == "sqlite:///x.db" and config.store.object_store_url == "s3://bucket/prefix"
    assert config.redis_url == "redis://127.0.0.1:6379/0"
    assert config.store.max_lora_rank == 32 and config.store.dtype == config.engine.dtype
    defaults = ServerConfig.from_env(environ={})
    assert defaults.engine.model == "default" and defaults.store.database_url is None
    assert defaults.store.resolved_database_url.startswith("sqlite:///")
    with pytest.raises(ConfigError, match="LORAPLEX_PORT"):
        ServerConfig.from_env(environ={"LORAPLEX_PORT": "eighty"})
    with pytest.raises(ConfigError, match="unknown server setting"):
        ServerConfig.from_env({"prot": 1}, environ={})


def test_the_checkout_root_leaves_sys_path(tmp_path: Path, monkeypatch):
    # `python -m loraplex.cli` in the checkout puts its root on sys.path (as "" or the full path), where kernels/
    # hides the `kernels` distribution transformers imports. Only that root goes; a root without the checkout's
    # layout (site-packages, for a wheel) is left alone.
    from loraplex import cli

    root = Path(cli.__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    path = ["", str(root), str(root / "benchmarks"), "/usr/lib/python3.11"]
    assert cli.drop_checkout_root(path) == [str(root / "benchmarks"), "/usr/lib/python3.11"]
    monkeypatch.chdir(tmp_path)
    assert cli.drop_checkout_root(["", str(tmp_path)], root=tmp_path) == ["", str(tmp_path)]


def test_the_kernels_distribution_is_found_after_the_drop(tmp_path: Path):
    # Started in the checkout (`python -c`, as `python -m`, puts the working folder first on sys.path), `kernels`
    # is first the checkout's folder; after the drop it is the distribution transformers 5 imports, and
    # loraplex.kernels still comes from the checkout.
    from loraplex import cli

    root = Path(cli.__file__).resolve().parent.parent
    probe = ("import importlib.util, sys; from loraplex import cli; "
             "print(importlib.util.find_spec('kernels').origin); "
             "sys.path[:] = cli.drop_checkout_root(sys.path); "
             "import kernels, loraplex.kernels; print(kernels.__file__); print(loraplex.kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, ours = out.stdout.split()
    assert Path(before) == root / "kernels" / "__init__.py"  # the shadow this guards against
    assert "site-packages" in after and Path(ours) == root / "kernels" / "__init__.py"
