"""The C++ CPU kernel set behind the dispatcher: chosen by "auto" on the CPU where it builds, asked
for by name, and refused with the reason (the torch path taken by "auto") where it cannot build."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_sgmv, select_kernels
from loraplex.kernels.dispatch import CPU_OPS, TORCH_OPS

OPS = ("write_kv", "paged_attention", "lora_shrink", "lora_expand", "apply_lora")


def test_cpu_kernels_are_chosen_on_the_cpu_and_keep_the_torch_signatures():
    if not cpu_sgmv.available():
        if os.environ.get("CI"):
            pytest.fail("the C++ CPU kernels did not build")
        pytest.skip("the C++ CPU kernels did not build here")
    assert select_kernels(torch.device("cpu"), "cpu") is CPU_OPS
    assert select_kernels(torch.device("cpu"), "auto") is CPU_OPS
    assert select_kernels(torch.device("cpu"), "torch") is TORCH_OPS
    for op in OPS:
        assert list(inspect.signature(getattr(CPU_OPS, op)).parameters) == list(
            inspect.signature(getattr(TORCH_OPS, op)).parameters), op


def test_disabled_cpu_kernels_fall_back_to_torch_and_refuse_by_name():
    code = textwrap.dedent("""
        import torch
        from loraplex.errors import ConfigError
        from loraplex.kernels import select_kernels
        assert select_kernels(torch.device("cpu"), "auto").name == "torch"
        try:
            select_kernels(torch.device("cpu"), "cpu")
        except ConfigError as e:
            assert "LORAPLEX_CPU_KERNELS=0" in str(e), e
        else:
            raise AssertionError("'cpu' was granted with the kernels disabled")
        print("ok")
    """)
    env = {**os.environ, "LORAPLEX_CPU_KERNELS": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_build_names_carry_the_cpu_identity(monkeypatch):
    # A -march=native build of one CPU may hold instructions another lacks: the cached build's name
    # changes with the CPU, as with the source.
    from loraplex.kernels import cpu_build

    ident = cpu_build.cpu_identity()
    assert ident.strip("|")
    if os.path.exists("/proc/cpuinfo"):
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")))
        assert flags.split(":", 1)[1].strip() in ident
    names = []

    def fake_load(name, **kw):
        names.append(name)
        raise RuntimeError("not built in this test")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    for other in ("vendor A|avx2", "vendor B|avx512f"):
        monkeypatch.setattr(cpu_build, "cpu_identity", lambda o=other: o)
        with pytest.raises(RuntimeError):
            cpu_build._compile("cpu_pack")
    assert len(set(names)) == 2 and all(n.startswith("loraplex_cpu_pack_") for n in names)


def test_two_checkouts_of_the_same_sources_build_apart(monkeypatch, tmp_path):
    # torch rebuilds a named extension when its sources' path changes: the same sources in another folder
    # (a fresh clone beside the working checkout) get their own build name, so neither rebuilds the other's.
    import shutil

    from torch.utils import cpp_extension

    from loraplex.kernels import cpu_build

    other = tmp_path / "kernels"
    other.mkdir()
    here = Path(cpu_build.__file__).parent
    for f in [here / "cpu_pack.cpp", *here.glob("*.h")]:
        shutil.copy(f, other / f.name)
    names = []

    def fake_load(name, **kw):
        names.append((name, kw["sources"][0]))
        raise RuntimeError("not built in this test")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with pytest.raises(RuntimeError):
        cpu_build._compile("cpu_pack")
    monkeypatch.setattr(cpu_build, "__file__", str(other / "cpu_build.py"))
    with pytest.raises(RuntimeError):
        cpu_build._compile("cpu_pack")
    (first, src_a), (second, src_b) = names
    assert src_a != src_b and Path(src_b).parent == other
    assert first != second and first.startswith("loraplex_cpu_pack_") and second.startswith("loraplex_cpu_pack_")


def test_a_lock_left_by_a_killed_build_is_cleared_and_the_build_runs(monkeypatch, tmp_path):
    # torch's cpp_extension waits without a timeout while a build folder's lock file exists; a process killed
    # during its build leaves one, and every later start would hang. Builds hold an flock, which dies with its
    # process: while another holder has it the build waits (that holder may be building); once it is free a
    # lock file left behind, however fresh, is a dead build's and is removed, and the real build runs.
    import fcntl

    from torch.utils import cpp_extension

    from loraplex.kernels import cpu_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    names = []
    real_load = cpp_extension.load

    def record(name, **kw):
        names.append(name)
        raise RuntimeError("name only")

    monkeypatch.setattr(cpp_extension, "load", record)
    with pytest.raises(RuntimeError, match="name only"):
        cpu_build._compile("cpu_argmax")
    build_dir = Path(cpp_extension._get_build_directory(names[0], verbose=False))
    assert build_dir.is_relative_to(tmp_path)
    lock = build_dir / "lock"
    lock.touch()
    monkeypatch.setattr(cpp_extension, "load", real_load)
    done = {}
    with open(f"{build_dir}.flock", "a") as other_builder:
        fcntl.flock(other_builder, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: done.setdefault("mod", cpu_build._compile("cpu_argmax")),
                                  daemon=True)
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and lock.exists(), "the build did not wait for the live builder"
    worker.join(timeout=600)  # closing the file released the flock, as a dying process's would be
    assert not worker.is_alive(), "the build waited on the dead build's lock"
    assert not lock.exists() and hasattr(done["mod"], "__file__")
    assert Path(done["mod"].__file__).is_relative_to(tmp_path)


def test_without_flock_only_an_old_lock_is_cleared(tmp_path):
    # Where flock does not exist (Windows) a lock file's age decides: a fresh one may be a live build's.
    from loraplex.kernels import cpu_build

    lock = tmp_path / "lock"
    lock.touch()
    assert not cpu_build.clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - cpu_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert cpu_build.clear_stale_lock(tmp_path) and not lock.exists()
