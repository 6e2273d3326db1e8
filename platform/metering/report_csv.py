"""Report rows as CSV (a header row, then one line per row) and back.

Cells: datetimes in ISO 8601 with their offset (+00:00), None as an empty cell, floats as Python's
shortest round-tripping repr, so rows_from_csv(rows_to_csv(rows), type) == rows.
"""

from __future__ import annotations

import csv
import io
import typing
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from typing import TypeVar

from .report_types import LatencyRow, UsageRow

Row = TypeVar("Row", UsageRow, LatencyRow)


def rows_to_csv(rows: Sequence[UsageRow] | Sequence[LatencyRow], row_type: type | None = None) -> str:
    """CSV text with a header. An empty list gives only the header when row_type is given, else ""."""
    row_type = row_type or (type(rows[0]) if rows else None)
    if row_type is None:
        return ""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    names = [f.name for f in fields(row_type)]
    writer.writerow(names)
    for row in rows:
        writer.writerow([_cell(getattr(row, n)) for n in names])
    return out.getvalue()


def rows_from_csv(text: str, row_type: type[Row]) -> list[Row]:
    """Parse rows_to_csv's output back into rows of row_type (the header must name its fields)."""
    hints = typing.get_type_hints(row_type)
    reader = csv.DictReader(io.StringIO(text))
    names = [f.name for f in fields(row_type)]
    if reader.fieldnames is not None and list(reader.fieldnames) != names:
        raise ValueError(f"CSV header {reader.fieldnames} does not match {row_type.__name__} {names}")
    return [row_type(**{n: _parse(line[n], hints[n]) for n in names}) for line in reader]


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _parse(cell: str, hint: object) -> object:
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if cell == "" and optional:
        return None
    if base is datetime:
        return datetime.fromisoformat(cell)
    if base is int:
        return int(cell)
    if base is float:
        return float(cell)
    return cell
