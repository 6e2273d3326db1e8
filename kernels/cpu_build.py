"""Builds the C++ CPU kernels (cpu_*.cpp beside this file) on first use, once per machine.

Why C++ on the CPU: the torch path has to express "each token's adapter" and "each sequence's
pages" with a handful of torch ops per segment, rank group or sequence, and on this CPU those ops'
fixed costs (3-10 us each, hundreds per layer) and the copies they need (a gather of every K/V
block before attention) cost more than the arithmetic. One C++ loop per (layer, module) reads the
pool in place, as the Triton kernels do on a GPU.

torch.utils.cpp_extension compiles each source with the compiler that built nothing else here
(g++ from the system) into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) and reuses
the build while the source is unchanged. The first engine start on a machine builds all eight, side by
side (build_all): 56.9 s on an AMD EPYC Zen 4 with 2 cores, where one at a time with torch/extension.h
took 200.5 s (benchmarks/kernel_build_bench.py; torch_ext.h says why the headers matter).
A machine without a compiler (or where the build fails) gets None and the torch path, with the
reason logged once: the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger(__name__)

# -march=native: the build happens on the machine that runs it (and is cached per machine), so it
# may use every vector unit there (AVX-512 on the dev machine). OpenMP backs at::parallel_for.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]
DISABLE_ENV = "LORAPLEX_CPU_KERNELS"  # "0": never build, use the torch path

_locks_lock = threading.Lock()  # guards _locks
_locks: dict[str, threading.Lock] = {}  # one per kernel: two kernels build at once, one kernel once
_built: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def load_extension(stem: str) -> ModuleType | None:
    """The compiled module of kernels/<stem>.cpp, or None where it cannot be built (see build_error)."""
    # Without the lock once built: the kernels' wrappers call this on every call (a decode step makes ~420),
    # and an entry, once set under the lock, never changes.
    if stem in _built:
        return _built[stem]
    with _locks_lock:
        lock = _locks.setdefault(stem, threading.Lock())
    with lock:
        if stem in _built:
            return _built[stem]
        mod = None
        if disabled():
            _errors[stem] = f"{DISABLE_ENV}=0"
        else:
            try:
                mod = _compile(stem)
            except Exception as e:  # a missing compiler, ninja, headers: the torch path still works
                _errors[stem] = f"{type(e).__name__}: {e}".strip()[:2000]
                log.warning("C++ CPU kernel %s could not be built, using the torch path: %s", stem, _errors[stem])
        _built[stem] = mod
        return mod


def kernel_stems() -> list[str]:
    """The kernels beside this file, by stem (cpu_argmax, cpu_attention, ...), in name order."""
    return [src.stem for src in sorted(Path(__file__).parent.glob("cpu_*.cpp"))]


def build_all(workers: int | None = None) -> dict[str, bool]:
    """Build (or load from the cache) every kernel beside this file: {stem: whether it built}. For callers that
    want the first build on a machine done before a clock starts: the engine on the CPU (dispatch._cpu_ops), the
    tests' live servers before they wait for readiness.

    The builds run side by side, `workers` at a time (default: one per CPU): each is a compiler process of its
    own, bound by one core, and a kernel's build does not wait on another's. Loads from the cache take well
    under a second each either way."""
    stems = kernel_stems()
    workers = workers or max(1, min(len(stems), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kernel-build") as pool:
        mods = list(pool.map(load_extension, stems))
    return {stem: mod is not None for stem, mod in zip(stems, mods)}


def build_error(stem: str) -> str | None:
    """Why load_extension(stem) returned None (None if it was not tried or succeeded)."""
    return _errors.get(stem)


def _compile(stem: str) -> ModuleType:
    return compile_source(Path(__file__).with_name(f"{stem}.cpp"), f"loraplex_{stem}")


def compile_source(src: Path, prefix: str, extra_cflags: Sequence[str] = ()) -> ModuleType:
    """Build (or load from the cache) one C++ source with the kernels' flags, as module <prefix>_<key>. Besides
    the kernels here, benchmarks build an earlier version of a kernel with it, to time both in one process.
    extra_cflags go after the kernels' own (the tests build the AVX2 variants on an AVX-512 CPU with
    -mno-avx512f, so that both vector widths are checked on any x86 machine)."""
    from torch.utils import cpp_extension

    # The name carries the source's hash: a changed kernel never loads a stale build. It also carries the
    # CPU's identity: a build for -march=native of one CPU can hold instructions another lacks (AVX-512
    # on the dev machine, not on an AVX2 one), and a home folder may move between machines. And the
    # source's folder: torch records a build's source paths and rebuilds when the same name comes from
    # another path, so two checkouts of the same sources (a fresh clone for CI beside the working one)
    # rebuilt each other's kernels, ~4 minutes on 2 cores each time they alternated.
    # The headers beside the kernels (cpu_pool_tables.h) are part of every build's key: a changed
    # header rebuilds the kernels that may include it.
    here = Path(__file__).parent
    headers = b"".join(h.read_bytes() for h in sorted(here.glob("*.h")))
    cflags = [*CFLAGS, *extra_cflags]
    key = (src.read_bytes() + headers + " ".join(cflags).encode() + cpu_identity().encode()
           + str(src.parent.resolve()).encode())
    digest = hashlib.sha256(key).hexdigest()[:12]
    name = f"{prefix}_{digest}"
    # A source from elsewhere (an earlier version of a kernel) still finds the headers here.
    include = [] if src.parent.resolve() == here.resolve() else [str(here)]
    with build_guard(Path(cpp_extension._get_build_directory(name, verbose=False))):
        return cpp_extension.load(name=name, sources=[str(src)], extra_cflags=cflags, extra_ldflags=LDFLAGS,
                                  extra_include_paths=include, verbose=False)


def baseline_builds(sources: Sequence[Path], prefix: str) -> dict[str, ModuleType]:
    """Earlier versions of one kernel, built with compile_source, by the name a benchmark times them under:
    "baseline" for a single source, else each file's stem (two sources with one stem are refused)."""
    names = ["baseline"] if len(sources) == 1 else [Path(s).stem for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"baseline sources need distinct file names: {[str(s) for s in sources]}")
    return {name: compile_source(Path(src), prefix) for name, src in zip(names, sources)}


@contextmanager
def build_guard(build_dir: Path) -> Iterator[None]:
    """Held around one kernel's build (or load from the cache): an advisory lock (flock) on <build_dir>.flock,
    which the operating system releases when its process dies, however it dies. Holding it, this process is
    the only loraplex process building there, so a lock file of torch's (created with O_EXCL, waited on
    without a timeout, never removed by a killed build) can only be a dead build's and is removed at once.
    Where flock does not exist the age rule of clear_stale_lock stands in."""
    if fcntl is None:
        clear_stale_lock(build_dir)
        yield
        return
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{build_dir}.flock", "a") as guard:  # closing it releases the flock
        fcntl.flock(guard, fcntl.LOCK_EX)  # another process building this kernel: wait for it, as torch would
        clear_stale_lock(build_dir, max_age_s=0.0)
        yield


STALE_LOCK_S = 900.0  # a build takes about a minute; a lock this old outlived the process that took it


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove a build folder's lock file left by a process killed while it built (torch's cpp_extension takes
    the lock with O_EXCL and waits, without a timeout, while it exists: a server killed during its first-start
    build would hang every later start) once it is max_age_s old. Returns whether a lock was removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False  # another process may be building now: wait for it as torch does
    log.warning("removing the kernel build lock %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "cpu family", "flags", ...); empty where there
    is no such file (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor describes them all
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    return fields


def cpu_identity() -> str:
    """The CPU's model and instruction-set flags (Linux: /proc/cpuinfo), or the platform's names."""
    fields = cpu_fields()
    wanted = [fields.get(k, "") for k in ("vendor_id", "model name", "flags", "Features", "CPU part")]
    ident = "|".join(wanted)
    return ident if ident.strip("|") else f"{platform.machine()}|{platform.processor()}"
