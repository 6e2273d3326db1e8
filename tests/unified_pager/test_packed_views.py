"""A plan-packed adapter's module views (unified_pager/packed_views.py): not made by the load nor by placing the
adapter in the pool, made once when first read, and then the views the full path makes."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

from adapter_files import write_peft_adapter
from loraplex.kernels.cpu_build import load_extension
from loraplex.lora.types import TARGET_MODULES
from loraplex.unified_pager import PackPlans, RowLayout, load_packed_folder
from loraplex.unified_pager.packed_views import PackedModuleViews
from native_kernels import require_built
from pager_testkit import TINY, small_pager

LAYOUT = RowLayout.for_model(TINY, torch.float32)
RANK_LIMIT = 16


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_pack", load_extension("cpu_pack") is not None, "packer")


def _planned(tmp_path, n: int = 2):
    """n adapters of one shape loaded through one PackPlans (all but the first by its plan), and their folders."""
    plans = PackPlans(TINY, RANK_LIMIT, LAYOUT)
    folders = [write_peft_adapter(tmp_path / f"a{i}", TINY, r=8, targets=TARGET_MODULES) for i in range(n)]
    loaded = [load_packed_folder(f"a{i}", f, TINY, RANK_LIMIT, LAYOUT, plans=plans) for i, f in enumerate(folders)]
    assert plans.hits == n - 1
    return loaded, folders


def test_placing_a_planned_adapter_makes_no_views_and_the_first_read_makes_the_full_paths(tmp_path):
    (_, adapter), folders = _planned(tmp_path)
    views = adapter.modules
    assert isinstance(views, PackedModuleViews) and not views.made
    assert len(views) == 3 * len(TARGET_MODULES) and adapter.packed.modules is views  # len makes nothing
    pager = small_pager(1024)
    residency = pager.load_adapter("a1", adapter)
    assert residency is not None and not views.made
    full = load_packed_folder("a1", folders[1], TINY, RANK_LIMIT, LAYOUT)  # no plans: the full path's views
    assert isinstance(full.modules, tuple)
    first = views[0]
    assert views.made and views[0] is first and list(views)[0] is first
    rows = adapter.packed.rows
    for got, want in zip(views, full.modules, strict=True):
        assert (got.layer, got.module, got.rank, got.scale) == (want.layer, want.module, want.rank, want.scale)
        for x, y in ((got.a, want.a), (got.b, want.b)):
            assert torch.equal(x, y) and x.stride() == y.stride() and x.storage_offset() == y.storage_offset()
            assert x.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()  # views of the rows
    assert all(x is y for x, y in zip(adapter.packed.assignment.modules, views, strict=True))


def test_threads_reading_first_get_one_set_of_views(tmp_path):
    (_, adapter), _ = _planned(tmp_path)
    views = adapter.modules
    start = threading.Barrier(8)
    got: list[object] = [None] * 8

    def read(i: int) -> None:
        start.wait()
        got[i] = views[i % 2]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is views[i % 2] for i, g in enumerate(got))


def test_the_views_compare_and_hash_as_the_tuple_of_their_modules(tmp_path):
    loaded, _ = _planned(tmp_path, 3)
    a1, a2 = loaded[1:]
    assert "not made yet" in repr(a2.modules)
    as_tuple = tuple(a1.modules)
    assert a1.modules == as_tuple and as_tuple == a1.modules and hash(a1.modules) == hash(as_tuple)
    assert a1.modules == a1.modules and a1.modules[1:3] == as_tuple[1:3]
    assert hash(a1.modules) != hash(a2.modules)  # other tensors (LoraModuleWeights hash their tensors by identity)


def test_an_adapter_with_views_copies_and_pickles_with_tuples(tmp_path):
    (_, adapter), _ = _planned(tmp_path)
    copied = copy.deepcopy(adapter)
    assert isinstance(copied.modules, tuple) and copied.packed is not None  # one copy serves both references
    assert copied.packed.modules is copied.modules
    back = pickle.loads(pickle.dumps(adapter.modules))
    assert isinstance(back, tuple) and len(back) == len(adapter.modules)
    for got, want in zip(back, adapter.modules, strict=True):
        assert got.module == want.module and torch.equal(got.a, want.a) and torch.equal(got.b, want.b)
