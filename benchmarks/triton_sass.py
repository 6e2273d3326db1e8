"""Static cost of the Triton SGMV kernels on a Hopper GPU, without one: compile each variant for sm_90 with the
ptxas inside Triton's wheel and count the SASS instructions and global loads that nvdisasm (same wheel) lists.

A GPU session is 15 minutes; this runs anywhere in seconds, so a change to a kernel's inner loop can be judged
by its instruction count before it is timed. Counts are of the whole kernel: where a kernel branches at run
time (the shrink's per-k and per-element page lookups), both branches are in them; --fast-path-only compiles
with the per-k branch alone, the path that ranks dividing D (or multiples of 16) take.

    .venv/bin/python benchmarks/triton_sass.py [--fast-path-only] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from kernels_gpu import ensure_loraplex_importable  # noqa: E402

ensure_loraplex_importable()

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = {"x_ptr": "*bf16", "pool_ptr": "*bf16", "out_ptr": "*fp32", "s_ptr": "*fp32", "y_ptr": "*bf16",
            "tile_seg_ptr": "*i32", "tile_start_ptr": "*i32", "tile_len_ptr": "*i32", "layout_ptr": "*i32",
            "scales_ptr": "*fp32", "pages_ptr": "*i32"}
# Llama-3-8B's pool rows (D = 128) in 2 MB pages of bf16 rows, as kernels_gpu.py lays them out.
COMMON = dict(D=128, R_CHUNK=16, DOT_PREC="tf32", rows_per_page=8192)


def kernels_module(fast_path_only: bool):
    """The SGMV kernels' module; with fast_path_only, a copy whose shrink always takes the per-k branch."""
    from loraplex.kernels import triton_sgmv_kernels as mod

    if not fast_path_only:
        return mod
    src = Path(mod.__file__).read_text()
    cond = re.compile(r"^    if \(D % rank == 0\).*:$", re.M)
    if not cond.search(src):
        raise SystemExit("the shrink's per-k branch condition was not found")
    src = cond.sub("    if True:", src).replace("from .triton_launch import", "from loraplex.kernels.triton_launch import")
    path = Path(tempfile.mkdtemp()) / "sgmv_fast_only.py"
    path.write_text(src)
    sys.path.insert(0, str(path.parent))
    import sgmv_fast_only  # noqa: E402

    return sgmv_fast_only


def sass_counts(kernel, constexprs: dict) -> dict:
    fn = kernel.compiled
    names = fn.arg_names
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    sig = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast-path-only", action="store_true", help="the shrink's per-k branch alone")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    mod = kernels_module(args.fast_path_only)
    rows = {}
    for bm in (1, 32):
        rows[f"shrink BLOCK_M={bm}"] = sass_counts(mod.sgmv_shrink_kernel, dict(COMMON, BLOCK_M=bm, BLOCK_K=128,
                                                                                USE_DOT=True))
        rows[f"expand BLOCK_M={bm}"] = sass_counts(mod.sgmv_expand_kernel, dict(COMMON, BLOCK_M=bm, BLOCK_N=128,
                                                                                USE_DOT=True))
    print(f"sm_90, bf16, D=128 (triton {triton.__version__}{', shrink per-k branch only' if args.fast_path_only else ''})")
    print("| kernel | SASS instructions | global loads |\n|---|---|---|")
    for name, r in rows.items():
        loads = ", ".join(f"{k} {v}" for k, v in sorted(r["global_loads"].items()))
        print(f"| {name} | {r['sass_instructions']} | {loads} |")
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "fast_path_only": args.fast_path_only,
                                         "kernels": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
