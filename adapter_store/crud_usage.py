"""Usage events: written in batches by the API layer, off the request path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from loraplex.errors import RequestError
from sqlalchemy import insert
from sqlalchemy.orm import Session

from .models import UsageEvent
from .schemas import USAGE_STATUSES, UsageEventCreate
from .timeutil import utcnow


def record_usage(session: Session, events: Sequence[UsageEventCreate]) -> int:
    if not events:
        return 0
    now = utcnow()
    rows = []
    for event in events:
        if event.status not in USAGE_STATUSES:
            raise RequestError(f"usage status {event.status!r} is not one of {', '.join(USAGE_STATUSES)}")
        row = asdict(event)
        row["created_at"] = row["created_at"] or now
        rows.append(row)
    session.execute(insert(UsageEvent), rows)  # one executemany
    return len(rows)
