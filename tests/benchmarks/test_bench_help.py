"""Every benchmark script with command-line options prints its --help and exits 0 (a '%' in a help string once
made argparse raise instead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One child process runs them all: torch is imported once, and the scripts' sys.path edits stay out of pytest's.
CHILD = r"""
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[path] = "ran past --help"
    except SystemExit as e:
        results[path] = "ok" if e.code in (0, None) and "usage:" in out.getvalue() else f"exit {e.code!r}"
    except Exception as e:
        results[path] = repr(e)
print(json.dumps(results))
"""


def scripts_with_options() -> list[str]:
    paths = sorted(ROOT.glob("benchmarks/*.py")) + sorted(ROOT.glob("benchmarks/e2e/*.py"))
    return [str(p.relative_to(ROOT)) for p in paths
            if "argparse" in (text := p.read_text()) and '__name__ == "__main__"' in text]


def test_every_benchmark_prints_its_help():
    scripts = scripts_with_options()
    assert "benchmarks/cpu_lora_decode_bench.py" in scripts and "benchmarks/e2e/run.py" in scripts
    done = subprocess.run([sys.executable, "-c", CHILD, *scripts], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {s: "ok" for s in scripts}
