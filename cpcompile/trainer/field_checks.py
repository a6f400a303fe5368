"""Checks of single config fields, each a `PlanError` naming the field path: positive numbers,
bounded numbers, closed choices, flags, optional strings, a torch.compile backend this torch knows,
and a data file that is UTF-8 text (a binary file is said here, not as a decode error later)."""
from __future__ import annotations

import codecs
import math
from typing import Any

from ..errors import PlanError, short_repr


def check_positive_number(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        hint = " (YAML reads 1e-3 as a string: write 1.0e-3)" if isinstance(value, str) else ""
        raise PlanError(field, f"must be a positive number, got {short_repr(value)}{hint}")


def check_number(field: str, value: Any, low: float, high: float | None = None, below: float | None = None) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= low
    ok = ok and (high is None or value <= high) and (below is None or value < below)
    if not ok:
        bound = f"<= {high}" if high is not None else (f"< {below}" if below is not None else "")
        raise PlanError(field, f"must be a number >= {low} {bound}".rstrip() + f", got {short_repr(value)}")


def check_choice(field: str, value: Any, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise PlanError(field, f"must be one of {', '.join(choices)}, got {short_repr(value)}")


def check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PlanError(field, f"must be true or false, got {short_repr(value)}")


def check_compile_backend(field: str, name: str) -> None:
    """A `torch.compile` backend this torch knows (registered ones included): an unknown name
    would fail only when the first layer compiles, after the model was built."""
    import torch._dynamo  # noqa: F401  (registers the backends; imported only when one is asked for)

    if name not in torch.compiler.list_backends(exclude_tags=()):
        raise PlanError(field, f"{short_repr(name)} is not a torch.compile backend; known: "
                               f"{', '.join(torch.compiler.list_backends())}")


# How much of a data file the config reads to tell text from binary (the loader reads it all later).
TEXT_CHECK_BYTES = 1 << 16


def check_text_file(field: str, path: str) -> None:
    """The file starts as UTF-8 text without NUL bytes: a binary file (an archive, a tokenized
    .bin) is said here, naming the field, rather than as a decode error at the first batch."""
    with open(path, "rb") as handle:
        head = handle.read(TEXT_CHECK_BYTES)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut last character is fine
    except UnicodeDecodeError as exc:
        raise PlanError(field, f"{short_repr(path)} is not UTF-8 text (byte {exc.start}): the text and jsonl "
                               "sources read text files") from exc
    nul = head.find(bytes(1))
    if nul >= 0:
        raise PlanError(field, f"{short_repr(path)} holds NUL bytes (byte {nul}): a binary file, not text; the "
                               "text and jsonl sources read text files")


def check_optional_string(field: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise PlanError(field, f"must be a non-empty string or null, got {short_repr(value)}")
