"""benchmarks/triton_host_overhead.py times the SGMV wrappers with no-op launches and puts the kernels back."""

from __future__ import annotations

from script_loader import load_script


def test_times_both_entry_points_and_restores_the_launchers():
    module = load_script("triton_host_overhead.py")
    before = [k.on for k in module.KERNELS]
    out = module.main(["--calls", "20"])
    assert set(out) == {"apply_lora_group (q|k|v)", "apply_lora (q)", "write_kv + paged_attention (4 splits)"}
    assert all(v > 0 for v in out.values())
    assert [k.on for k in module.KERNELS] == before
