"""Every name the package exports resolves (they are imported lazily)."""

from __future__ import annotations

import pytest

import loraplex.adapter_store as store_pkg


def test_every_export_resolves():
    for name in store_pkg.__all__:
        assert getattr(store_pkg, name) is not None, name
    with pytest.raises(AttributeError):
        store_pkg.NoSuchThing  # noqa: B018
