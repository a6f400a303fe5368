"""The trainer config's reference, generated from the sections' dataclasses (`config_sections.py`):
every key of `train:`, `optimizer:`, `data:` and `checkpoint:` with its docstring, what it takes
(its type hint in YAML words, `field_checks.describe`) and its default, printed as a YAML file of
the defaults. `python -m cpcompile config-reference` prints it; docs/trainer.md holds that print,
and a test keeps the two the same.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any, get_type_hints

import yaml

from .config_sections import SECTIONS
from .field_checks import describe

WIDTH = 100
HEADER = ("The trainer's sections, every key with its default (`python -m cpcompile config-reference`, generated "
          "from cpcompile/trainer/config_sections.py). `model:` and the CP plan (`accelerator:`, "
          "`plan_overrides:`) are described in docs/trainer.md and docs/plans.md.")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `cls`, read from its source with `ast`
    (Python keeps no docstring of an attribute)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {node.target.id: inspect.cleandoc(after.value.value) for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)}


def render_reference() -> str:
    """The reference: a YAML file of every section's defaults, each key under its docstring and
    what it takes, as comments."""
    lines = _comment(HEADER, "")
    for name, cls in SECTIONS.items():
        docs, hints = field_docs(cls), get_type_hints(cls, include_extras=True)
        lines += ["", *_comment(inspect.getdoc(cls), ""), f"{name}:"]
        for field in dataclasses.fields(cls):
            if field.name not in docs:
                raise TypeError(f"{cls.__name__}.{field.name} has no docstring: say what it means under it")
            lines += _comment(docs[field.name], "  ")
            lines += _comment(f"takes {describe(hints[field.name])}", "  ")
            lines.append(f"  {field.name}: {_yaml(field.default)}")
    return "\n".join(lines) + "\n"


def _comment(text: str, indent: str) -> list[str]:
    prefix = f"{indent}# "
    return [line for paragraph in text.split("\n\n")
            for line in textwrap.wrap(" ".join(paragraph.split()), WIDTH, initial_indent=prefix,
                                      subsequent_indent=prefix, break_on_hyphens=False)]


def _yaml(value: Any) -> str:
    """`value` as YAML reads it back (a tuple as a list; `off` quoted, which bare is false)."""
    if value is dataclasses.MISSING:
        raise TypeError("every config key has a default")
    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True,
                          width=float("inf"))
    return text.split("\n")[0]
