"""How long a fresh machine takes to build the C++ CPU kernels: every build into an empty extensions folder.

    .venv/bin/python benchmarks/kernel_build_bench.py [--baseline-kernels OLD/kernels] [--out FILE.json]

Timed, each in a process of its own with TORCH_EXTENSIONS_DIR set to a new empty folder (nothing cached):
  - "build_all": kernels.cpu_build.build_all(), the builds side by side, as the engine starts on the CPU;
  - "one at a time": load_extension of each kernel in turn;
  - with --baseline-kernels, "baseline one at a time": each cpu_*.cpp of another checkout's kernels folder (e.g.
    `git archive <commit> kernels | tar -x -C /tmp/old`), built in turn with compile_source, its headers its own.
Prints a table and writes JSON (default benchmarks/results/kernel_build.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from loraplex.kernels import cpu_build

_ROOT = Path(__file__).resolve().parent.parent

BUILD_ALL = """
    from loraplex.kernels import cpu_build
    built = cpu_build.build_all()
    assert all(built.values()), {k: cpu_build.build_error(k) for k, ok in built.items() if not ok}
"""
ONE_AT_A_TIME = """
    from loraplex.kernels import cpu_build
    for stem in cpu_build.kernel_stems():
        assert cpu_build.load_extension(stem) is not None, cpu_build.build_error(stem)
"""
BASELINE = """
    from pathlib import Path
    from loraplex.kernels import cpu_build
    for src in sorted(Path({folder!r}).glob("cpu_*.cpp")):
        cpu_build.compile_source(src, "build_bench_" + src.stem)
"""


def timed_build(code: str) -> float:
    """Seconds for `code` in a new Python process whose extensions folder is empty."""
    with tempfile.TemporaryDirectory(prefix="lp-build-bench-") as ext:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": ext}
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd="/", capture_output=True,
                           text=True)
        took = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"build failed:\n{r.stderr[-4000:]}")
    return took


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it (model name, family, model), else platform's word for it."""
    first = cpu_build.cpu_fields()
    if not first:
        return platform.processor() or platform.machine()
    return f"{first.get('model name', platform.machine())} (family {first.get('cpu family', '?')} model " \
           f"{first.get('model', '?')})"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-kernels", type=Path, default=None, help="another checkout's kernels folder")
    ap.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results" / "kernel_build.json")
    args = ap.parse_args(argv)
    runs = {"build_all": BUILD_ALL, "one at a time": ONE_AT_A_TIME}
    if args.baseline_kernels is not None:
        runs["baseline one at a time"] = BASELINE.format(folder=str(args.baseline_kernels.resolve()))
    seconds = {}
    for name, code in runs.items():
        print(f"{name}...", file=sys.stderr, flush=True)
        seconds[name] = timed_build(code)
    kernels = cpu_build.kernel_stems()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": cpu_name(),
              "cpus": os.cpu_count(), "kernels": kernels, "seconds": seconds,
              "baseline_kernels": str(args.baseline_kernels) if args.baseline_kernels else None}
    print("| build | s |\n|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {s:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
