"""benchmarks/triton_host_overhead.py times the SGMV wrappers with no-op launches and puts the kernels back."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_host_overhead.py"


def test_times_both_entry_points_and_restores_the_launchers():
    spec = importlib.util.spec_from_file_location("triton_host_overhead_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    before = [k.on for k in module.KERNELS]
    out = module.main(["--calls", "20"])
    assert set(out) == {"apply_lora_group (q|k|v)", "apply_lora (q)", "write_kv + paged_attention (4 splits)"}
    assert all(v > 0 for v in out.values())
    assert [k.on for k in module.KERNELS] == before
