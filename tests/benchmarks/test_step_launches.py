"""benchmarks/step_launches.py counts a GPU-path decode step's launches on the CPU, with the Triton path's
RMSNorm / RoPE / SwiGLU kernels and with the model's torch formulas."""

from __future__ import annotations

import json

from loraplex.kernels import triton_launch, triton_pointwise_kernels
from script_loader import load_script


def test_counts_both_kernel_sets_and_restores_the_launchers(tmp_path):
    bench = load_script("step_launches.py")
    layers = 2
    out = bench.main(["--layers", str(layers), "--batch", "3", "--context", "5", "--adapters", "1", "--steps", "1",
                      "--rounds", "1", "--json", str(tmp_path / "launches.json")])
    kernels, torch_set = out["sets"]["kernels"], out["sets"]["torch"]
    assert out["layout"] == "out_in"  # the GPU's weight layout
    # One launch per norm (the first, two per layer, less the last layer's residual-only add, and the final
    # one), per RoPE and per SwiGLU; the torch formulas launch none of them.
    assert kernels["triton_by_kernel"]["rms_norm_kernel"] == 2 * layers + 1
    assert kernels["triton_by_kernel"]["rope_kernel"] == kernels["triton_by_kernel"]["swiglu_kernel"] == layers
    assert not {"rms_norm_kernel", "rope_kernel", "swiglu_kernel"} & set(torch_set["triton_by_kernel"])
    # SGMV and attention launch the same in both; torch's formulas add many more torch launches than they save.
    assert kernels["triton_by_kernel"]["sgmv_shrink_kernel"] == torch_set["triton_by_kernel"]["sgmv_shrink_kernel"] > 0
    assert torch_set["torch_by_op"].get("aten::rsqrt") == 2 * layers + 1 and "aten::rsqrt" not in kernels["torch_by_op"]
    assert kernels["launches_per_step"] < torch_set["launches_per_step"]
    assert len(kernels["host_ms"]) == len(torch_set["host_ms"]) == 1
    assert json.loads((tmp_path / "launches.json").read_text())["sets"]["kernels"]["triton_by_kernel"] == \
        kernels["triton_by_kernel"]
    # The kernels launch again afterwards (the counters were the script's only).
    assert "on" not in triton_pointwise_kernels.rms_norm_kernel.__dict__
    assert isinstance(triton_pointwise_kernels.rms_norm_kernel, triton_launch.DualKernel)
