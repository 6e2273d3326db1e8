"""benchmarks/cpu_linear_bench.py's stream mode: the packed weights placed on huge pages as the engine holds them,
the same products as where they were packed, and a pass timed for every backend either way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_linear
from loraplex.models import cpu_gemm
from native_kernels import require_built

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_linear_bench  # noqa: E402


def test_on_huge_pages_keeps_the_layers_order_in_one_buffer():
    require_built("cpu_linear", cpu_linear.available(), "packed GEMM")
    g = torch.Generator().manual_seed(1)
    shapes = [(96, 64), (64, 64), (160, 64)]  # [out, in]
    ws = [[torch.randn(*s, generator=g) for s in shapes] for _ in range(2)]
    head_w = torch.randn(128, 64, generator=g)
    layers, head = [[cpu_linear.pack(w) for w in layer] for layer in ws], cpu_linear.pack(head_w)
    moved_layers, moved_head = cpu_linear_bench.on_huge_pages((layers, head))
    flat = [w for layer in moved_layers for w in layer] + [moved_head]
    assert [len(layer) for layer in moved_layers] == [3, 3]
    assert len({w.panels.untyped_storage().data_ptr() for w in flat}) == 1  # one buffer
    assert all(a.panels.data_ptr() + a.panels.numel() * 4 == b.panels.data_ptr() for a, b in zip(flat, flat[1:]))
    x = torch.randn(5, 64, generator=g)
    for old, new, w in zip([w for layer in layers for w in layer] + [head], flat,
                           [w for layer in ws for w in layer] + [head_w]):
        assert new.out_features == old.out_features and torch.equal(new.panels, old.panels)
        assert torch.equal(cpu_linear.linear(x, new, None), cpu_linear.linear(x, old, None))
        torch.testing.assert_close(cpu_linear.linear(x, new, None), x @ w.t(), rtol=1e-4, atol=1e-4)


def test_a_stream_pass_is_timed_for_every_backend_on_either_pages():
    require_built("cpu_linear", cpu_linear.available(), "packed GEMM")
    if not cpu_gemm.onednn_available():  # the stream compares against oneDNN, as main() says where it refuses
        pytest.skip("this torch has no oneDNN: the stream pass times it beside the kernel")
    for huge in (True, False):
        flops, times, diff = cpu_linear_bench.time_stream(3, 1, reps=1, huge_pages=huge)
        assert flops > 0 and diff is None
        assert set(times) == {"packed", "onednn", "mm"} and all(len(ts) == 1 and ts[0] > 0 for ts in times.values())


def test_a_baseline_build_is_paired_with_the_kernel_round_by_round(tmp_path, monkeypatch):
    require_built("cpu_linear", cpu_linear.available(), "packed GEMM")
    if not cpu_gemm.onednn_available():
        pytest.skip("this torch has no oneDNN: the stream pass times it beside the kernel")
    out = tmp_path / "stream.json"
    # The kernel's own source built again as the baseline: the same sums bit for bit, and every round paired.
    src = Path(cpu_linear.__file__).with_name("cpu_linear.cpp")
    monkeypatch.setattr(sys, "argv", ["cpu_linear_bench.py", "--stream", "--rows", "2", "--layers", "1", "--reps",
                                      "3", "--baseline-source", str(src), "--out", str(out)])
    cpu_linear_bench.main()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["baseline_max_abs_diff"] == 0.0 and row["packed_on_huge_pages"] is True
    assert 0 <= row["packed_faster_rounds"] <= 3 and isinstance(row["baseline_minus_packed_ms_paired_median"], float)
