"""benchmarks/triton_host_overhead.py times the SGMV wrappers with no-op launches and puts the kernels back."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from loraplex.kernels import triton_sgmv_kernels as kernels

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_host_overhead.py"


def test_times_both_entry_points_and_restores_the_launchers():
    spec = importlib.util.spec_from_file_location("triton_host_overhead_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    before = (kernels.sgmv_shrink_kernel.on, kernels.sgmv_expand_kernel.on)
    out = module.main(["--calls", "20"])
    assert set(out) == {"apply_lora_group (q|k|v)", "apply_lora (q)"} and all(v > 0 for v in out.values())
    assert (kernels.sgmv_shrink_kernel.on, kernels.sgmv_expand_kernel.on) == before
