"""Reading verl-format row files (parquet, JSONL) with errors that name the file, row and column.

Parquet files stay as Arrow tables (columnar, zero-copy slices); a row becomes a Python dict only
when it is used. Column checks use the Arrow schema and null counts, so opening a large file costs
about one pass over the prompt column. JSONL files are parsed line by line (``row`` = line - 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json")


class DataFileError(ValueError):
    """A data file or one of its rows is unusable; the message names the file, row and column."""


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """``value`` if it is a non-empty list of ``{"role": str, "content": str}``, else DataFileError."""
    if not isinstance(value, list | tuple) or len(value) == 0:
        raise DataFileError(f"{where}: expected a non-empty list of chat messages, got {type(value).__name__}")
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise DataFileError(
                f"{where}: message {j} must be a dict with string 'role' and 'content', got {msg!r:.120}"
            )
    return list(value)


class RowFile:
    """One parquet or JSONL file: ``len``, ``columns``, ``column(name)``, ``row(i)``, ``check_column``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {self.path}")
        suffix = self.path.suffix.lower()
        if suffix in PARQUET_SUFFIXES:
            try:
                self._table: pa.Table | None = pq.read_table(self.path)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataFileError(f"{self.path}: not a readable parquet file: {exc}") from exc
            self._rows: list[dict] | None = None
            self.columns = list(self._table.column_names)
        elif suffix in JSONL_SUFFIXES:
            self._table, self._rows = None, _read_jsonl(self.path)
            self.columns = sorted({k for r in self._rows for k in r})
        else:
            raise DataFileError(f"{self.path}: unsupported file type {suffix!r}; use {PARQUET_SUFFIXES + JSONL_SUFFIXES}")
        if len(self) == 0:
            raise DataFileError(f"{self.path}: the file has no rows")

    def __len__(self) -> int:
        return self._table.num_rows if self._table is not None else len(self._rows)

    def column(self, name: str) -> list[Any]:
        """All values of column ``name`` (checked present and non-null first)."""
        self.check_column(name)
        if self._table is not None:
            return self._table.column(name).to_pylist()
        return [r[name] for r in self._rows]

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as a dict of Python values."""
        return self.rows([i])[0]

    def rows(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Rows ``indices`` as dicts of Python values (one Arrow ``take`` for parquet)."""
        if self._table is not None:
            return self._table.take(list(indices)).to_pylist()
        return [dict(self._rows[i]) for i in indices]

    def check_messages_column(self, name: str) -> None:
        """DataFileError naming the first row whose ``name`` is not a list of chat messages.

        Parquet columns typed ``list<struct<role: string, content: string>>`` without nulls or
        empty lists pass in a few vectorised Arrow calls; anything else is checked row by row so
        the error can name the row.
        """
        if self._table is not None and self._arrow_messages_ok(name):
            return
        for row, value in enumerate(self.column(name)):
            check_messages(value, f"{self.path} row {row} column {name!r}")

    def _arrow_messages_ok(self, name: str) -> bool:
        if name not in self.columns:
            return False
        col = self._table.column(name)
        kind = col.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
            return False
        fields = {f.name: f.type for f in kind.value_type}
        is_str = (pa.types.is_string, pa.types.is_large_string)
        if not all(k in fields and any(t(fields[k]) for t in is_str) for k in ("role", "content")):
            return False
        arr = col.combine_chunks()
        if arr.null_count or pc.min(pc.list_value_length(arr)).as_py() == 0:
            return False
        flat = pc.list_flatten(arr)
        return not (flat.null_count or flat.field("role").null_count or flat.field("content").null_count)

    def check_column(self, name: str, kind: type | None = None) -> None:
        """DataFileError naming the first row where ``name`` is missing/null (or not of ``kind``)."""
        if self._table is not None:
            return self._check_arrow_column(name, kind)
        for i, r in enumerate(self._rows):
            if r.get(name) is None:
                raise DataFileError(f"{self.path} row {i}: column {name!r} is missing or null")
            if kind is not None and not isinstance(r[name], kind):
                raise DataFileError(
                    f"{self.path} row {i}: column {name!r} must be {kind.__name__}, got {type(r[name]).__name__}"
                )

    def _check_arrow_column(self, name: str, kind: type | None) -> None:
        if name not in self.columns:
            raise DataFileError(f"{self.path} row 0: column {name!r} is missing; columns are {self.columns}")
        col = self._table.column(name)
        if col.null_count:
            first = pc.index(pc.is_null(col), True).as_py()
            raise DataFileError(f"{self.path} row {first}: column {name!r} is null")
        want = {str: (pa.types.is_string, pa.types.is_large_string), dict: (pa.types.is_struct, pa.types.is_map)}
        if kind in want and not any(test(col.type) for test in want[kind]):
            raise DataFileError(
                f"{self.path} row 0: column {name!r} must hold {kind.__name__} values, but its type is {col.type}"
            )


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFileError(f"{path} row {len(rows)} (line {line_no}): invalid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise DataFileError(f"{path} row {len(rows)} (line {line_no}): expected a JSON object per line")
            rows.append(row)
    return rows


def open_files(files: str | Path | Sequence[str | Path]) -> list[RowFile]:
    """``files`` (one path or several) opened as :class:`RowFile`s."""
    paths = [files] if isinstance(files, str | Path) else list(files)
    if not paths:
        raise DataFileError("no data files given")
    return [RowFile(p) for p in paths]
