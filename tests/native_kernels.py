"""One rule for tests of the C++ CPU kernels: where a kernel did not build, skip with the build error,
except under CI, where the build is part of what is tested and its absence is a failure."""

from __future__ import annotations

import os

import pytest
from loraplex.kernels.cpu_build import build_error


def skip_or_fail(reason: str) -> None:
    """pytest.fail under CI (CI set), pytest.skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def require_built(stem: str, built: bool, what: str) -> None:
    """Skip or fail (skip_or_fail) unless kernels/<stem>.cpp built; `what` names it in the message."""
    if not built:
        skip_or_fail(f"the C++ {what} did not build: {build_error(stem)}")
