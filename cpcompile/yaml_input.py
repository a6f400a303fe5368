"""A plan or train config as YAML input: `read_yaml` (what `yaml.safe_load` reads, refusing a key
given twice, a file above `MAX_YAML_BYTES` and aliases expanding past `MAX_YAML_NODES` nodes), and
the two checks every section of one uses: `reject_unknown_keys` and `check_size`. Each problem is a
`PlanError` naming the file or the field. The plan (`plan.py`) and the trainer's config
(`trainer/config.py`) read their YAML here.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import yaml

from .errors import PlanError, short_repr

# A plan or a train config is a few hundred bytes and a few dozen nodes; these bounds leave room
# for hundreds of overrides while keeping what a hostile file can cost small.
MAX_YAML_BYTES = 64 * 1024
MAX_YAML_NODES = 10_000  # counted with every alias expanded, as the document would be used
MAX_SIZE = 2**31 - 1  # any size or count in a plan or train config


def read_yaml(path: "str | os.PathLike") -> Any:
    """The YAML document at `path`, read as `yaml.safe_load` does; a `PlanError` naming the file
    for a syntax error, a file above `MAX_YAML_BYTES`, or aliases that expand it past
    `MAX_YAML_NODES` nodes (or into itself), checked before any Python object is built."""
    field = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise PlanError(field, f"the file is larger than {MAX_YAML_BYTES} bytes; "
                               "a plan or train config is a few hundred")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(field, f"not UTF-8 text (byte {exc.start})") from exc
    loader = _UniqueKeyLoader(text)
    loader.field = field
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(field, node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise PlanError(field, f"not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise PlanError(field, "not a plan: its collections are nested too deeply") from exc
    finally:
        loader.dispose()


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping, which YAML resolves by
    keeping the last one silently (a second `steps:` would win unseen). Keys a merge (`<<: *a`)
    brings in may still be overridden: that is what merging is for."""

    field = "<yaml>"

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue  # merges are allowed; a collection as a key is refused by the loader itself
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in seen:
                    raise PlanError(self.field, f"line {line}: the key {short_repr(key)} is given twice in one "
                                                f"mapping (first on line {seen[key]}); YAML would keep the last "
                                                "one silently")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _check_expanded_size(field: str, root: yaml.Node) -> None:
    """Count `root`'s nodes as if every alias were expanded (a shared node once per use, from a
    memo, so a few hundred bytes of nested aliases cost no more than their own nodes here)."""
    expanded: dict[int, int] = {}
    inside: set[int] = set()

    def count(node: yaml.Node) -> int:
        if id(node) in expanded:
            return expanded[id(node)]
        if id(node) in inside:
            raise PlanError(field, "an alias refers to a collection that contains it (a recursive structure)")
        inside.add(id(node))
        children = node.value if isinstance(node, yaml.SequenceNode) else (
            [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else ())
        total = 1
        for child in children:
            total += count(child)
            if total > MAX_YAML_NODES:
                raise PlanError(field, f"has more than {MAX_YAML_NODES} nodes once its aliases (*name) are "
                                       "expanded; a plan or train config has a few dozen")
        inside.discard(id(node))
        expanded[id(node)] = total
        return total

    count(root)


def reject_unknown_keys(path: str, raw: Mapping, allowed: tuple[str, ...]) -> None:
    """A `PlanError` naming `path.key` for the first key of `raw` not in `allowed`."""
    for key in raw:
        if key not in allowed:
            key = key if isinstance(key, str) else short_repr(key)
            where = f"{path}.{key}" if path else key
            raise PlanError(where, f"unknown key; allowed keys: {', '.join(allowed)}")


def check_size(path: str, value: Any) -> None:
    """A `PlanError` naming `path` unless `value` is an int from 1 to `MAX_SIZE` (bool refused)."""
    if type(value) is not int:  # bool is an int subclass; refuse it here
        raise PlanError(path, f"must be an integer >= 1, got {short_repr(value)} ({type(value).__name__})")
    if value < 1:
        raise PlanError(path, f"must be an integer >= 1, got {value}")
    if value > MAX_SIZE:
        raise PlanError(path, f"must be an integer >= 1 and at most {MAX_SIZE}, got {short_repr(value)}")
