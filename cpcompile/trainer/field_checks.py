"""One checker for the trainer config's sections, driven by their type hints, and the checks of
single values it calls. Each wrong value is a `PlanError` naming the field path
(`optimizer.warmup_steps: must be an integer >= 0, got -1`).

A section derives from `Section`, whose `__post_init__` calls `check_section`: it reads the
section's annotations (`typing.get_type_hints`) and checks each field against its hint:
- `bool`, `int`, `float` (an int is a number too; bool is neither), `str` (non-empty);
- `Literal[...]`, a closed choice of strings;
- `Optional[X]`: X or null;
- `tuple[X, ...]` and `tuple[X, Y]`: a YAML list, kept as a tuple, each item checked by its hint;
- a `TypedDict`: a mapping of those keys only, each checked by its hint;
- `Annotated[X, Rule(...)]`: the rule alone decides (a bound, a size, a parser): `Size`, `Count`,
  `Positive`, `in_range(...)`.
`describe` says a hint in YAML words, for the messages and the generated reference
(`config_reference.py`).
"""
from __future__ import annotations

import codecs
import functools
import math
import types
from dataclasses import dataclass, fields
from typing import (
    Annotated, Any, Callable, ClassVar, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict,
)

from ..errors import PlanError, short_repr
from ..yaml_input import check_size, reject_unknown_keys


@dataclass(frozen=True)
class Rule:
    """A check a type cannot say: `check(field, value)` raises a `PlanError` naming the field (it
    checks the value's type too); `words` say what it accepts, in messages and the reference."""

    check: Callable[[str, Any], Any]
    words: str


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


def check_count(field: str, value: Any) -> None:
    if type(value) is not int or value < 0:  # type(): True is an int to isinstance
        raise PlanError(field, f"must be an integer >= 0, got {short_repr(value)}")


def in_range(words: str, low: float, high: float | None = None, below: float | None = None) -> Rule:
    """A number from `low`, up to `high` (included) or `below` (excluded)."""
    return Rule(functools.partial(check_number, low=low, high=high, below=below), words)


Size = Annotated[int, Rule(check_size, "an integer >= 1")]
Count = Annotated[int, Rule(check_count, "an integer >= 0")]
Positive = Annotated[float, Rule(check_positive_number, "a number > 0")]


class Section:
    """A config section (a frozen dataclass): built, its fields are checked by their hints
    (`check_section`, as `NAME.field`) and kept as checked, then `check_across` checks what
    depends on several of them."""

    NAME: ClassVar[str]

    def __post_init__(self) -> None:
        for name, value in check_section(self, self.NAME).items():
            object.__setattr__(self, name, value)  # frozen: the checked value (a list as a tuple)
        self.check_across()

    def check_across(self) -> None:
        """The checks across this section's fields, each naming the field it refuses."""


def check_section(section: Any, name: str) -> dict[str, Any]:
    """Every field of the dataclass `section` checked against its hint, named `name.field`: the
    values as the section keeps them (a list as a tuple, an integer given for a float as a float)."""
    hints = _hints(type(section))
    return {f.name: check_value(f"{name}.{f.name}", getattr(section, f.name), hints[f.name])
            for f in fields(section)}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s type hints, read once (a section is built again at each `dataclasses.replace`)."""
    return get_type_hints(cls, include_extras=True)


def check_value(field: str, value: Any, hint: Any) -> Any:
    """`value` checked against `hint` (one the module docstring lists), as the section keeps it."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        for rule in hint.__metadata__:
            rule.check(field, value)
        return float(value) if args[0] is float else value
    if origin in (Union, types.UnionType):
        inner = _optional_of(hint)
        if value is None:
            return None
        if get_origin(inner) is not Annotated and not _fits(value, inner):
            raise _wrong(field, value, hint)  # "... or null"
        return check_value(field, value, inner)
    if not _fits(value, hint):
        raise _wrong(field, value, hint)
    if origin is tuple:
        items = [args[0]] * len(value) if args[-1] is Ellipsis else args
        return tuple(check_value(f"{field}[{i}]", item, item_hint)
                     for i, (item, item_hint) in enumerate(zip(value, items)))
    if is_typeddict(hint):
        keys = get_type_hints(hint, include_extras=True)
        reject_unknown_keys(field, value, tuple(keys))
        return {key: check_value(f"{field}.{key}", item, keys[key]) for key, item in value.items()}
    return float(value) if hint is float else value


def describe(hint: Any) -> str:
    """What `hint` accepts, in YAML words: "an integer >= 1", "one of cpu, cuda, npu", "... or null"."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        return "; ".join(rule.words for rule in hint.__metadata__)
    if origin in (Union, types.UnionType):
        return f"{describe(_optional_of(hint))} or null"
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is tuple:
        if args[-1] is Ellipsis:
            return f"a list, each item {describe(args[0])}"
        if len(set(args)) == 1:
            return f"a list of {len(args)} items, each {describe(args[0])}"
        return "a list [" + ", ".join(map(describe, args)) + "]"
    if is_typeddict(hint):
        keys = get_type_hints(hint, include_extras=True)
        if len(set(keys.values())) == 1:
            return f"a mapping of {', '.join(keys)} (each {describe(next(iter(keys.values())))})"
        return "a mapping of " + ", ".join(f"{key} ({describe(item)})" for key, item in keys.items())
    return SIMPLE_WORDS[hint]


SIMPLE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a non-empty string"}


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` has the shape `hint` asks for (a list's items and a mapping's values aside)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return any(type(value) is type(choice) and value == choice for choice in args)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and (args[-1] is Ellipsis or len(value) == len(args))
    if is_typeddict(hint):
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return type(value) is int  # type(): True is an int to isinstance
    if hint is float:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str) and value != ""
    raise TypeError(f"the config checker reads no hint {hint!r}: declare the field with one it reads")


def _optional_of(hint: Any) -> Any:
    """X of `Optional[X]`; a union of two types or more is no config field's hint."""
    inner = [arg for arg in get_args(hint) if arg is not type(None)]
    if len(inner) != 1 or len(get_args(hint)) != 2:
        raise TypeError(f"the config checker reads Optional[X], not {hint!r}")
    return inner[0]


def _wrong(field: str, value: Any, hint: Any) -> PlanError:
    return PlanError(field, f"must be {describe(hint)}, got {short_repr(value)}")


def check_optional_string(field: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise PlanError(field, f"must be a non-empty string or null, got {short_repr(value)}")


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
