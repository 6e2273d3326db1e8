"""Schemathesis against the running server's own OpenAPI schema: whatever it sends, never a 5xx.

Requests go out with a tenant admin key (so that generated bodies reach the handlers, not just the
401 check) and, for the operator routes, with the operator key.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from api_server import OPERATOR_KEY, make_tenant, upload


@pytest.fixture(scope="module")
def fuzz_keys(live, adapter_dirs):
    _, admin = make_tenant(live, "fuzz")
    assert upload(live, admin, "fuzz-adapter", adapter_dirs["b4"]).status_code == 201
    return {"admin": admin}


def _shorten(case) -> None:
    if case.path in ("/v1/completions", "/v1/chat/completions") and isinstance(case.body, dict):
        # Keep generation short: the fuzzer's max_tokens can reach a million (a valid, slow request).
        for field in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 4:
                case.body[field] = 4
        case.body.setdefault("max_tokens", 4)
        case.body.pop("ignore_eos", None)


def test_no_server_errors(live, fuzz_keys):
    """Every operation of the schema, fuzzed by hypothesis strategies that schemathesis derives from it.
    (Driven by hand rather than through schemathesis' pytest plugin, which does not load under this
    pytest version.)"""
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    failures: list[str] = []
    calls = [0]
    for op in operations:
        key = OPERATOR_KEY if op.path.startswith("/v1/tenants") else fuzz_keys["admin"]

        @given(case=op.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case) -> None:
            _shorten(case)
            calls[0] += 1
            try:
                case.call_and_validate(base_url=live.url, headers={"Authorization": f"Bearer {key}"},
                                       checks=[not_a_server_error])
            except AssertionError as e:  # schemathesis reports a check failure this way
                failures.append(f"{op.method.upper()} {op.path}: {str(e)[:400]}")
                raise

        try:
            fuzz()
        except Exception as e:  # keep fuzzing the other operations; report everything at the end
            if not failures or op.path not in failures[-1]:
                failures.append(f"{op.method.upper()} {op.path}: {type(e).__name__}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)
    assert calls[0] >= 10 * len(operations)  # the fuzzer really ran
