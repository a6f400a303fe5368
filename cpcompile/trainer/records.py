"""The records of a data file: one JSON object a line, or the rows of a Parquet file.

A `data.path` ending in `.parquet` is read with pyarrow (in the `train` extra), any other one as
JSON lines. Each record comes with where it is (`line 3`, `row 2`), so an error names it; every
error names `data.path`.
"""
from __future__ import annotations

import json

from ..errors import MissingDependencyError, PlanError, short_repr

PARQUET_SUFFIX = ".parquet"
PARQUET_MAGIC = b"PAR1"  # the first (and last) four bytes of every Parquet file


def is_parquet(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIX)


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError as exc:  # past the part the config checked (field_checks.check_text_file)
        raise PlanError("data.path", f"{path} is not UTF-8 text (byte {exc.start})") from exc


def read_records(path: str, columns: tuple[str, ...]) -> list[tuple[str, dict]]:
    """[(where, record)]: the file's records; of a Parquet file only `columns`, which it must have."""
    if is_parquet(path):
        return _parquet_rows(path, columns)
    records = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise PlanError("data.path", f"line {number} is not a JSON object ({exc})") from exc
        if not isinstance(record, dict):
            raise PlanError("data.path", f"line {number} is not a JSON object, it is a {type(record).__name__}")
        records.append((f"line {number}", record))
    return records


def string_field(record: dict, key: str, where: str) -> str:
    """`record[key]`, which must be a string."""
    if key not in record:
        raise PlanError("data.path", f"{where} is not a JSON object with a string {key!r} (its keys: "
                                     f"{short_repr(sorted(record))})")
    value = record[key]
    if not isinstance(value, str):
        raise PlanError("data.path", f"{where}: {key!r} is of type {type(value).__name__}, not a string")
    return value


def check_parquet_file(field: str, path: str) -> None:
    """pyarrow is there and `path` starts as a Parquet file: said by field before any process starts."""
    parquet_module()
    with open(path, "rb") as handle:
        head = handle.read(len(PARQUET_MAGIC))
    if head != PARQUET_MAGIC:
        raise PlanError(field, f"{short_repr(path)} ends in {PARQUET_SUFFIX} but is not a Parquet file (it does "
                               f"not start with {PARQUET_MAGIC!r})")


def parquet_module():
    """`pyarrow.parquet`, or a `MissingDependencyError` naming the extra that installs it."""
    try:
        import pyarrow.parquet
    except ImportError as exc:
        raise MissingDependencyError(f"data.path: reading a Parquet file needs pyarrow, which cannot be imported "
                                     f"({exc}): pip install \"cpcompile[train]\"") from exc
    return pyarrow.parquet


def _parquet_rows(path: str, columns: tuple[str, ...]) -> list[tuple[str, dict]]:
    parquet = parquet_module()
    names = _parquet_call(parquet.read_schema, path).names
    missing = [column for column in columns if column not in names]
    if missing:
        raise PlanError("data.path", f"{path} has no column {missing[0]!r} (its columns: {short_repr(names)})")
    table = _parquet_call(parquet.read_table, path, columns=list(columns))
    return [(f"row {index}", row) for index, row in enumerate(table.to_pylist())]


def _parquet_call(function, path: str, **kwargs):
    try:
        return function(path, **kwargs)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid / ArrowIOError derive from these
        raise PlanError("data.path", f"pyarrow cannot read {path}: {exc}") from exc
