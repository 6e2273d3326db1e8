"""Static cost of the Triton SGMV kernels on a Hopper GPU, without one: compile each variant for sm_90 with the
ptxas inside Triton's wheel and count the SASS instructions and global loads (by width) that nvdisasm (same
wheel) lists.

A GPU session is 15 minutes; this runs anywhere in seconds, so a change to a kernel's inner loop can be judged
by its instructions and the width of its loads before it is timed. The kernels are compiled as a real launch
compiles them: the launches are those the engine's plan builds (triton_sgmv's q|k|v group, Llama-3-8B shapes,
bf16, D = 128, rank 16), recorded on the CPU instead of run, and each argument is specialised as Triton's JIT
specialises it on a GPU (a pointer or an integer divisible by 16 is marked so, an integer equal to 1 becomes a
constant). Without the pointers' alignment no load can be wider than one element, whatever the kernel says.
Counts are of the whole kernel: where a kernel branches at run time (the shrink's per-k and per-element page
lookups), all branches are in them; --shrink-branch compiles one alone: wide (rank 8 and the multiples of 16,
16-byte loads), per-k (the other ranks dividing D), per-element (the rest).

    .venv/bin/python benchmarks/triton_sass.py [--shrink-branch wide|per-k|per-element] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import kernels_gpu as kg  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loraplex.kernels import triton_sgmv  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# Few adapters, alternating token by token: every token is its own segment (the decode variant) as with 64
# distinct adapters, and the arguments a kernel is specialised on (strides, widths, offsets) are the same.
ADAPTERS = 4
SHAPES = dataclasses.replace(kg.LLAMA3_8B, batches=(ADAPTERS,), rank_sets={"r16": (16,)})


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: what it was called with, by parameter name."""

    kind: str  # "shrink" or "expand"
    args: dict  # parameter name -> value (tensors, ints, constexprs)


class _Recorder:
    """Stands in for a kernel's launcher: `recorder[grid](*args, **consts)` records instead of running."""

    def __init__(self, kind: str, params: list[str], sink: list[Launch]):
        self.kind, self.params, self.sink = kind, params, sink

    def __getitem__(self, grid):
        def launch(*args, **consts):
            self.sink.append(Launch(self.kind, dict(zip(self.params, args), **consts)))

        return launch


def recorded_launches(tokens_per_segment: int, batch: int = 64) -> list[Launch]:
    """The q|k|v group's shrink and expand launches, as the step plan makes them, for `batch` tokens in
    segments of `tokens_per_segment` tokens (1: decode; 64: one prefill tile table of BLOCK_M tokens)."""
    probe = kg.pool_geometry(SHAPES, 1)
    geometry = kg.pool_geometry(SHAPES, ADAPTERS * kg.adapter_pages(SHAPES, probe, 16) + 16)
    pool = kg.PagePool(geometry, torch.device("cpu"))
    adapters = kg.place_adapters(SHAPES, pool, kg.PageDealer(geometry.num_pages)).by_set["r16"]
    token_adapter = [(t // tokens_per_segment) % ADAPTERS for t in range(batch)]
    lora = kg.runner_batch(adapters, token_adapter)
    acts = kg.make_acts(SHAPES, batch, torch.device("cpu"))
    modules, bounds, y, x = kg.lora_groups(SHAPES, acts)[0]
    sink: list[Launch] = []
    kernels = {"shrink": triton_sgmv.sgmv_shrink_kernel, "expand": triton_sgmv.sgmv_expand_kernel}
    for kind, kernel in kernels.items():
        params = list(inspect.signature(kernel.fn).parameters)
        kernel.on = lambda device, kind=kind, params=params: _Recorder(kind, params, sink)
    try:
        triton_sgmv.apply_lora_group(y, x, pool.rows(), lora, 0, modules, bounds)
    finally:
        for kernel in kernels.values():
            del kernel.on
    return sink


def specialised_source(fn, args: dict) -> ASTSource:
    """fn compiled for these arguments as Triton's JIT would compile it on a GPU."""
    names = fn.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = args[name]
        if fn.params[i].is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if ty == "constexpr":  # an integer equal to 1
            signature[name] = "constexpr"
            constexprs[(i,)] = spec
            continue
        signature[name] = ty
        if spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    return ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)


def sass_counts(src: ASTSource) -> dict:
    compiled = triton.compile(src, target=HOPPER, options={"num_warps": 4})
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ins = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    loads: dict[str, int] = {}
    for line in ins:
        m = re.search(r"\bLDG\.[A-Z0-9.]+", line)
        if m:
            loads[m.group(0)] = loads.get(m.group(0), 0) + 1
    return {"sass_instructions": len(ins), "global_loads": loads}


# The shrink's run-time branches of _a_tile, by the lines that open them: a --shrink-branch compile keeps one.
_BRANCH_LINES = ("    if ((rank % R_CHUNK == 0) & (D % R_CHUNK == 0)) | ((rank == 8) & (D % 8 == 0)):", "    elif D % rank == 0:")
SHRINK_BRANCHES = {"wide": ("if True:", "elif False:"), "per-k": ("if False:", "elif True:"),
                   "per-element": ("if False:", "elif False:")}


def kernels_module(shrink_branch: str | None):
    """The SGMV kernels' module; with shrink_branch, a copy whose shrink always takes that branch of _a_tile."""
    from loraplex.kernels import triton_sgmv_kernels as mod

    if shrink_branch is None:
        return mod
    src = Path(mod.__file__).read_text()
    for line, forced in zip(_BRANCH_LINES, SHRINK_BRANCHES[shrink_branch]):
        if src.count(line + "\n") != 1:
            raise SystemExit(f"the shrink's branch line {line.strip()!r} was not found once in {mod.__file__}")
        src = src.replace(line + "\n", "    " + forced + "\n")
    src = src.replace("from .triton_launch import", "from loraplex.kernels.triton_launch import")
    name = "sgmv_" + shrink_branch.replace("-", "_")
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    sys.path.insert(0, str(path.parent))
    return importlib.import_module(name)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shrink-branch", choices=sorted(SHRINK_BRANCHES), default=None,
                    help="compile the shrink with this branch of its A loads alone (default: all branches)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    mod = kernels_module(args.shrink_branch)
    compiled = {"shrink": mod.sgmv_shrink_kernel.compiled, "expand": mod.sgmv_expand_kernel.compiled}
    rows = {}
    for tokens_per_segment in (1, 64):
        for launch in recorded_launches(tokens_per_segment):
            name = f"{launch.kind} BLOCK_M={launch.args['BLOCK_M']}"
            rows[name] = sass_counts(specialised_source(compiled[launch.kind], launch.args))
    print(f"sm_90, bf16, D=128, q|k|v of Llama-3-8B at rank 16 (triton {triton.__version__}"
          f"{f', shrink branch {args.shrink_branch} only' if args.shrink_branch else ''})")
    print("| kernel | SASS instructions | global loads |\n|---|---|---|")
    for name, r in rows.items():
        loads = ", ".join(f"{k} {v}" for k, v in sorted(r["global_loads"].items()))
        print(f"| {name} | {r['sass_instructions']} | {loads} |")
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "shrink_branch": args.shrink_branch,
                                         "kernels": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
