"""Pack plans (unified_pager.pack_plan): a folder whose config and weights header match a folder loaded
before is packed by that load's plan, and the result is the full path's, bit for bit, refusals included.

Adapters are written with fresh random weights each run; the full path (load_packed_folder without
plans) is the reference. Where the C++ packer cannot be built the tests skip, except under CI.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_files import write_peft_adapter
from loraplex.errors import AdapterError, ConfigError
from loraplex.kernels.cpu_build import load_extension
from loraplex.lora.peft_loader import CONFIG_FILE, WEIGHTS_FILE
from loraplex.lora.types import TARGET_MODULES
from loraplex.unified_pager import PackPlans, RowLayout, load_packed_folder
from loraplex.unified_pager.pack_plan import folder_key
from native_kernels import require_built
from pager_testkit import TINY

LAYOUT = RowLayout.for_model(TINY, torch.float32)
RANK_LIMIT = 16


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_pack", load_extension("cpu_pack") is not None, "packer")


def _plans(capacity: int = 64) -> PackPlans:
    return PackPlans(TINY, RANK_LIMIT, LAYOUT, capacity)


def _load(name, folder, plans=None):
    return load_packed_folder(name, folder, TINY, RANK_LIMIT, LAYOUT, plans=plans)


def assert_identical(got, want) -> None:
    """The same adapter as the full path gives: rows, module views (strides included), tables, config."""
    assert (got.name, got.max_rank, got.source, got.config) == (want.name, want.max_rank, want.source, want.config)
    gp, wp = got.packed, want.packed
    assert gp is not None and gp.layout == wp.layout
    assert torch.equal(gp.rows, wp.rows)
    assert gp.modules is got.modules and len(got.modules) == len(want.modules)
    for g, w in zip(got.modules, want.modules, strict=True):
        assert (g.layer, g.module, g.rank, g.scale) == (w.layer, w.module, w.rank, w.scale)
        for x, y in ((g.a, w.a), (g.b, w.b)):
            assert torch.equal(x, y) and x.stride() == y.stride() and x.storage_offset() == y.storage_offset()
            assert x.untyped_storage().data_ptr() == gp.rows.untyped_storage().data_ptr()  # views, not copies
    ga, wa = gp.assignment, wp.assignment
    assert (ga.slots, ga.num_rows, ga.max_rank) == (wa.slots, wa.num_rows, wa.max_rank)
    assert (ga.layout == wa.layout).all() and (ga.scales == wa.scales).all()
    assert all(x is y for x, y in zip(ga.modules, got.modules, strict=True))


def test_adapters_of_one_shape_share_a_plan_and_pack_as_the_full_path(tmp_path):
    plans = _plans()
    folders = [write_peft_adapter(tmp_path / f"a{i}", TINY, r=8, targets=TARGET_MODULES) for i in range(4)]
    loaded = [_load(f"a{i}", f, plans) for i, f in enumerate(folders)]
    # Compared after all were loaded: no buffer of one load backs another's rows.
    for i, (got, folder) in enumerate(zip(loaded, folders)):
        assert_identical(got, _load(f"a{i}", folder))
    assert (plans.hits, plans.misses, len(plans)) == (3, 1, 1)


@pytest.mark.parametrize("shape", [
    dict(r=4, targets=("q_proj", "v_proj")),
    dict(r=16, targets=("k_proj", "down_proj", "gate_proj")),
    dict(r=8, targets=TARGET_MODULES, rank_pattern={"model.layers.1.self_attn.q_proj": 3},
         alpha_pattern={"model.layers.2.mlp.up_proj": 5.0}),
    dict(r=1, targets=("o_proj",), use_rslora=True),
])
def test_each_shape_learns_its_own_plan(tmp_path, shape):
    """Shapes interleaved: no plan is ever applied to a file of another shape (rank_pattern included:
    its ranks live in the weights header, its scales in the config)."""
    plans = _plans()
    other = dict(r=2, targets=("q_proj",))
    for i in range(3):
        for j, s in enumerate((shape, other)):
            s = dict(s)
            if "rank_pattern" in s:  # the weights follow the pattern: write the pattern's rank there
                folder = _with_rank_pattern(tmp_path / f"p{i}{j}", s)
            else:
                folder = write_peft_adapter(tmp_path / f"p{i}{j}", TINY, r=s.pop("r"), targets=s.pop("targets"), **s)
            assert_identical(_load("x", folder, plans), _load("x", folder))
    assert (plans.hits, plans.misses, len(plans)) == (4, 2, 2)


def _with_rank_pattern(folder, s):
    """A folder whose layer 1 q_proj has the rank its rank_pattern gives."""
    folder = write_peft_adapter(folder, TINY, r=s["r"], targets=s["targets"], rank_pattern=s["rank_pattern"],
                                alpha_pattern=s["alpha_pattern"])
    weights = load_file(folder / WEIGHTS_FILE)
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    rank = s["rank_pattern"]["model.layers.1.self_attn.q_proj"]
    weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, TINY.hidden_size) * 0.1
    weights[f"{prefix}.lora_B.weight"] = torch.randn(TINY.q_size, rank) * 0.1
    save_file(weights, folder / WEIGHTS_FILE)
    return folder


def test_the_config_is_part_of_the_key(tmp_path):
    """Same weights header, another lora_alpha: not the same plan (the scales come from the config)."""
    plans = _plans()
    _load("a", write_peft_adapter(tmp_path / "a", TINY, r=8, alpha=8), plans)
    folder = write_peft_adapter(tmp_path / "b", TINY, r=8, alpha=32)
    got = _load("b", folder, plans)
    assert_identical(got, _load("b", folder))
    assert {m.scale for m in got.modules} == {4.0}
    assert (plans.hits, len(plans)) == (0, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_planned_load_refuses_non_finite_weights_as_the_full_path_does(tmp_path, bad):
    plans = _plans()
    _load("clean", write_peft_adapter(tmp_path / "clean", TINY, r=8, targets=TARGET_MODULES), plans)
    folder = write_peft_adapter(tmp_path / "a", TINY, r=8, targets=TARGET_MODULES)
    weights = load_file(folder / WEIGHTS_FILE)
    layer = int(torch.randint(TINY.num_layers, ()))
    module, half = TARGET_MODULES[int(torch.randint(7, ()))], ("lora_A", "lora_B")[int(torch.randint(2, ()))]
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    key = f"base_model.model.model.layers.{layer}.{block}.{module}.{half}.weight"
    weights[key].view(-1)[int(torch.randint(weights[key].numel(), ()))] = bad
    save_file(weights, folder / WEIGHTS_FILE)
    with pytest.raises(AdapterError) as full:
        _load("a", folder)
    with pytest.raises(AdapterError) as planned:
        _load("a", folder, plans)
    assert str(planned.value) == str(full.value)
    assert f"model.layers.{layer}.{block}.{module} {half} contains NaN or Inf" in str(planned.value)
    assert plans.hits == 1  # the plan, not the full path, refused it


def test_a_file_that_does_not_read_as_its_plan_gets_the_full_paths_error(tmp_path):
    plans = _plans()
    _load("clean", write_peft_adapter(tmp_path / "clean", TINY, r=8), plans)
    folder = write_peft_adapter(tmp_path / "a", TINY, r=8)
    weights = folder / WEIGHTS_FILE
    raw = weights.read_bytes()
    cases = {"truncated": raw[:-4], "grown": raw + b"\0" * 8, "empty": b""}
    for what, body in cases.items():
        weights.write_bytes(body)
        with pytest.raises(AdapterError) as full:
            _load("a", folder)
        with pytest.raises(AdapterError) as planned:
            _load("a", folder, plans)
        assert str(planned.value) == str(full.value), what
    weights.unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        _load("a", folder, plans)
    assert plans.hits == 0


def test_a_file_that_comes_short_while_packed_is_left_to_the_full_path(tmp_path):
    """The packer reads the data section itself (PackPlan.pack_file): where the file ends before a matrix
    does (it shrank after its header matched), the plan gives None rather than an adapter."""
    plans = _plans()
    folder = write_peft_adapter(tmp_path / "a", TINY, r=8)
    want = _load("a", folder, plans)
    raw = (folder / WEIGHTS_FILE).read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    key = folder_key((folder / CONFIG_FILE).read_bytes(), raw[8:header_end])
    plan = plans.get(key, len(raw) - header_end)
    assert plan is not None
    with (folder / WEIGHTS_FILE).open("rb") as f:
        assert_identical(plan.pack_file("a", f.fileno(), header_end, str(folder)), want)
    (tmp_path / "short").write_bytes(raw[:-4])
    with (tmp_path / "short").open("rb") as f:
        assert plan.pack_file("a", f.fileno(), header_end, str(folder)) is None


def test_weights_needing_a_cast_get_no_plan(tmp_path):
    plans = _plans()
    for i in range(2):
        folder = write_peft_adapter(tmp_path / f"h{i}", TINY, r=8, dtype=torch.float16)
        assert_identical(_load("h", folder, plans), _load("h", folder))
    assert len(plans) == 0


def test_plans_serve_one_model_rank_limit_and_layout(tmp_path):
    folder = write_peft_adapter(tmp_path / "a", TINY, r=8)
    plans = _plans()
    with pytest.raises(ConfigError, match="another model, rank limit or row layout"):
        load_packed_folder("a", folder, TINY, RANK_LIMIT + 1, LAYOUT, plans=plans)
    with pytest.raises(ConfigError, match="another model, rank limit or row layout"):
        load_packed_folder("a", folder, TINY, RANK_LIMIT, RowLayout.for_model(TINY, torch.float16), plans=plans)
    with pytest.raises(ConfigError, match="at least 1"):
        _plans(capacity=0)


def test_the_least_recently_used_plan_goes_first(tmp_path):
    plans = _plans(capacity=2)
    folders = {r: write_peft_adapter(tmp_path / f"r{r}", TINY, r=r) for r in (2, 4, 8)}
    for r in (2, 4, 2, 8):  # 4 is the least recently used when 8 arrives
        _load("x", folders[r], plans)
    assert len(plans) == 2 and plans.hits == 1
    _load("x", folders[2], plans)
    _load("x", folders[4], plans)
    assert plans.hits == 2 and plans.misses == 4
