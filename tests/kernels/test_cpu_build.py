"""build_all: every C++ kernel built side by side, each once however many threads ask for it, one kernel's
failure kept to itself; and the CPU engine's kernel set builds them all when it is chosen."""

from __future__ import annotations

import os
import threading
import types

import pytest
import torch
from loraplex.kernels import cpu_build, select_kernels

STEMS = cpu_build.kernel_stems()


@pytest.fixture
def fresh_state(monkeypatch):
    """Module state as in a new process; each test then puts its own `_compile` in place of the compiler."""
    monkeypatch.setattr(cpu_build, "_built", {})
    monkeypatch.setattr(cpu_build, "_errors", {})
    monkeypatch.setattr(cpu_build, "_locks", {})
    monkeypatch.delenv(cpu_build.DISABLE_ENV, raising=False)
    return monkeypatch


def test_builds_run_side_by_side(fresh_state):
    # The first build waits until a second one runs beside it: with one build at a time it would wait alone
    # and give up, and that kernel would count as not built.
    both = threading.Event()
    running = set()
    guard = threading.Lock()

    def compile_(stem):
        with guard:
            running.add(stem)
            if len(running) >= 2:
                both.set()
        met = both.wait(timeout=10)
        with guard:
            running.discard(stem)
        if not met:
            raise RuntimeError(f"{stem} was built alone")
        return types.ModuleType(stem)

    fresh_state.setattr(cpu_build, "_compile", compile_)
    assert len(STEMS) >= 2
    built = cpu_build.build_all(workers=2)
    assert built == {stem: True for stem in STEMS}, {s: cpu_build.build_error(s) for s in STEMS}


def test_one_kernel_builds_once_for_many_callers(fresh_state):
    calls = []
    gate = threading.Event()

    def compile_(stem):
        calls.append(stem)
        gate.wait(timeout=10)  # the other callers arrive while this build runs
        return types.ModuleType(stem)

    fresh_state.setattr(cpu_build, "_compile", compile_)
    mods = []
    threads = [threading.Thread(target=lambda: mods.append(cpu_build.load_extension("cpu_argmax"))) for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(timeout=30)
    assert calls == ["cpu_argmax"]
    assert len(mods) == 4 and all(m is mods[0] and m is not None for m in mods)


def test_a_failed_build_stays_its_own(fresh_state):
    def compile_(stem):
        if stem == "cpu_rope":
            raise RuntimeError("no compiler for this one")
        return types.ModuleType(stem)

    fresh_state.setattr(cpu_build, "_compile", compile_)
    built = cpu_build.build_all()
    assert built == {stem: stem != "cpu_rope" for stem in STEMS}
    assert "no compiler for this one" in cpu_build.build_error("cpu_rope")
    assert cpu_build.load_extension("cpu_rope") is None  # not tried again in this process


def test_the_cpu_kernel_set_builds_every_kernel():
    # The real builds (or the cache): choosing the CPU set leaves no kernel to build in the engine's first step.
    if cpu_build.disabled():
        pytest.skip("the kernels are disabled here")
    try:
        select_kernels(torch.device("cpu"), "cpu")
    except Exception as e:  # ConfigError: the SGMV kernel did not build
        if os.environ.get("CI"):
            pytest.fail(f"the C++ CPU kernels did not build: {e}")
        pytest.skip(f"the C++ CPU kernels did not build here: {e}")
    for stem in STEMS:
        assert stem in cpu_build._built, f"{stem} was not built when the CPU set was chosen"
        assert cpu_build._built[stem] is not None, cpu_build.build_error(stem)
