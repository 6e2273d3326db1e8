"""benchmarks/kernel_build_bench.py's harness: each timed build runs in a process of its own over an empty
extensions folder, and a failed build stops the benchmark with the build's error (the builds themselves take
minutes: the kernels' tests and CI build them for real)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_build_bench  # noqa: E402


def test_each_build_gets_an_empty_extensions_folder_of_its_own(tmp_path):
    probe = tmp_path / "seen.txt"
    code = f"""
        import os, pathlib
        ext = pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"])
        assert ext.is_dir() and not any(ext.iterdir()), ext
        (ext / "a-build").write_text("x")
        with open({str(probe)!r}, "a") as f:
            f.write(str(ext) + "\\n")
    """
    assert kernel_build_bench.timed_build(code) > 0
    assert kernel_build_bench.timed_build(code) > 0
    first, second = probe.read_text().split()
    assert first != second  # the second did not see the first's build
    assert not Path(first).exists() and not Path(second).exists()  # removed afterwards


def test_a_failed_build_stops_the_bench_with_its_error():
    with pytest.raises(SystemExit, match="no compiler in this test"):
        kernel_build_bench.timed_build("raise RuntimeError('no compiler in this test')")
