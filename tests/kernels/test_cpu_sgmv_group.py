"""cpu_sgmv.apply_lora_group (the C++ kernel over the modules of one fused projection in one call) against
float64 and against one cpu_sgmv.apply_lora per module, on the grouped Triton tests' scenarios (CPU tensors):
mixed ranks 1-64 (long segments of ranks the blocked path does not take go to the torch path per module),
adapters lacking some modules, tokens without an adapter, pools NaN-poisoned outside the adapters' rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from kernel_testkit import rel_err
from loraplex.kernels import cpu_sgmv
from loraplex.kernels.cpu_build import load_extension
from loraplex.kernels.dispatch import CPU_OPS
from native_kernels import require_built
from test_triton_sgmv_group import QKV, GroupSpec, assert_untouched_kept, build_group_case, group_specs, in_wide_output

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")


def check(spec: GroupSpec) -> None:
    case = build_group_case(spec, torch.float32)
    rows, lora, layer, mods, bounds = case.pool.rows(), case.lora, spec.layer, spec.modules, spec.bounds
    N = bounds[-1]
    wide, y, pad = in_wide_output(spec, case)  # y: a column slice of a wider output, as the model's
    before = wide.clone()
    CPU_OPS.apply_lora_group(y, case.x, rows, lora, layer, mods, bounds)
    assert rel_err(y, case.y0.double() + case.delta_ref) < 1e-5
    assert_untouched_kept(spec, case, y)
    assert torch.equal(wide[:, :pad], before[:, :pad]) and torch.equal(wide[:, pad + N:], before[:, pad + N:])
    per_module = case.y0.clone()
    for m, lo, hi in zip(mods, bounds, bounds[1:]):
        cpu_sgmv.apply_lora(per_module[:, lo:hi], case.x, rows, lora, layer, m)
    assert torch.equal(y, per_module)  # the same sums in the same order: bit for bit


@FAST
@given(spec=group_specs(d_choices=(16, 32, 48)))
def test_group_matches_float64_and_the_per_module_calls(spec):
    check(spec)


def test_bad_groups_are_refused_and_change_nothing():
    # Every module of the group is checked before any is applied: a bad last module leaves y as it was.
    spec = GroupSpec(d=16, rows_per_page=4, in_features=48, modules=QKV, widths=(48, 16, 16), layer=1,
                     ranks=((16, 8, 0), (4, 16, 16)), req_lens=(1, 1, 3, 20), popularity="distinct",
                     no_adapter_share=0.0, sort=False, empty_segments=0, seed=3)
    case = build_group_case(spec, torch.float32)
    ext, t = load_extension("cpu_sgmv"), case.lora.device_tensors
    rpp = case.lora.segments[0].adapter.rows_per_page
    for modules, bounds, why in (((0, 1, 2), (0, 48, 64), "one column range per module"),
                                 ((0, 1, 2), (0, 48, 64, 96), "module columns outside y"),
                                 ((0, 1, 2), (0, 48, 48, 80), "empty module columns"),
                                 ((0, 1, 99), (0, 48, 64, 80), "module out of range")):
        y = case.y0.clone()
        with pytest.raises(RuntimeError, match=why):
            ext.apply_lora_group(y, case.x, case.pool.rows(), t.seg_start, t.seg_len, t.layout, t.scales, t.pages,
                                 rpp, spec.layer, list(modules), list(bounds), cpu_sgmv.LONG_SEGMENT)
        assert torch.equal(y, case.y0)
