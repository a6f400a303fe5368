"""Plans from untrusted YAML: no module is imported because a YAML named it, and no error grows
with the input (issue 12, items 6 and 7)."""
from __future__ import annotations

import sys
import textwrap
import tracemalloc
import uuid

import pytest

import cpcompile
from cpcompile.errors import PlanError
from cpcompile.plan import load_plan
from cpcompile.yaml_input import MAX_YAML_BYTES, MAX_YAML_NODES

FIELD = "plan_overrides[0].inner_wrapper._target_"


def _yaml_plan(tmp_path, wrapper: str, cp_size: int = 2):
    path = tmp_path / "plan.yaml"
    path.write_text(textwrap.dedent(f"""\
        accelerator: {{cp_size: {cp_size}}}
        plan_overrides:
          - match: "*.self_attn"
            when: cp
            region_dispatch: false
            inner_wrapper:
        """) + textwrap.indent(wrapper, " " * 6))
    return path


def _side_effect_module(tmp_path, monkeypatch) -> tuple[str, object]:
    """A module on sys.path whose import writes a file, holding a marked wrapper."""
    name = f"cp_side_effect_{uuid.uuid4().hex[:8]}"
    imported = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""\
        import pathlib
        pathlib.Path({str(imported)!r}).write_text("imported")
        from cpcompile import inner_wrapper
        from cpcompile.wrappers import sdpa_hf_cp_wrapper

        @inner_wrapper
        def wrapper():
            return sdpa_hf_cp_wrapper()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name, imported


# --------------------------------------------------------------------------- item 6: foreign code


def test_target_in_a_module_nobody_allowed_is_never_imported(tmp_path, monkeypatch):
    name, imported = _side_effect_module(tmp_path, monkeypatch)
    with pytest.raises(PlanError) as info:
        load_plan(_yaml_plan(tmp_path, f"_target_: {name}.wrapper\n"))
    assert info.value.field == FIELD, info.value
    assert "allow_wrapper_module" in info.value.reason and "not imported" in info.value.reason, info.value
    assert not imported.exists() and name not in sys.modules


def test_a_module_allowed_in_code_may_be_named(tmp_path, monkeypatch):
    name, imported = _side_effect_module(tmp_path, monkeypatch)
    cpcompile.allow_wrapper_module(name)
    (override,) = load_plan(_yaml_plan(tmp_path, f"_target_: {name}.wrapper\n")).overrides
    assert override.method.wrapper == "sdpa_hf_cp_wrapper" and imported.exists()


def test_a_name_registered_in_code_may_be_named_by_name_and_path(tmp_path, monkeypatch):
    name, imported = _side_effect_module(tmp_path, monkeypatch)
    cpcompile.register_inner_wrapper(f"{name}_short", f"{name}.wrapper")
    (by_path,) = load_plan(_yaml_plan(tmp_path, f"_target_: {name}.wrapper\n")).overrides
    (by_name,) = load_plan(_yaml_plan(tmp_path, f"{name}_short\n")).overrides
    assert by_path.method == by_name.method and by_name.method.name == "all_gather" and imported.exists()


def test_an_allowed_module_does_not_allow_its_lookalikes(tmp_path, monkeypatch):
    name, imported = _side_effect_module(tmp_path, monkeypatch)
    cpcompile.allow_wrapper_module(name[:-2])  # a prefix of the name, not a parent package
    with pytest.raises(PlanError) as info:
        load_plan(_yaml_plan(tmp_path, f"_target_: {name}.wrapper\n"))
    assert info.value.field == FIELD and not imported.exists()


@pytest.mark.parametrize("target", [
    "cpcompile.wrappers.sdpa_hf_cp_wrapper",
    "cpcompile.adapters.qwen3_5.qwen3_5_gdn_p2p_cp_wrapper",
    "cpcompile.models.qwen3_5.qwen3_5_gdn_ulysses_cp_wrapper",
])
def test_builtin_paths_keep_working(tmp_path, target):
    (override,) = load_plan(_yaml_plan(tmp_path, f"_target_: {target}\n")).overrides
    assert override.method.wrapper == target.rpartition(".")[2]


@pytest.mark.parametrize("target", ["os.system", "cpcompile.plan.load_plan", ".wrappers.x", "cpcompile..x"])
def test_other_paths_are_refused_naming_the_field(tmp_path, target):
    with pytest.raises(PlanError) as info:
        load_plan(_yaml_plan(tmp_path, f"_target_: {target!r}\n"))
    assert info.value.field == FIELD, info.value


@pytest.mark.parametrize("module", ["", "a..b", "a.b.", 3, "os system"])
def test_allow_wrapper_module_checks_its_argument(module):
    with pytest.raises((TypeError, ValueError)):
        cpcompile.allow_wrapper_module(module)


# --------------------------------------------------------------------------- item 7: bounded errors


def _laughs(levels: int) -> str:
    """Nested aliases: `levels` lists of nine references each, 465 bytes expanding to 9**levels leaves."""
    names = [f"a{i}" for i in range(levels)]
    items = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    items += [f"&{names[i]} [{', '.join([f'*{names[i - 1]}'] * 9)}]" for i in range(1, levels)]
    return "_target_: cpcompile.wrappers.sdpa_hf_hybrid_cp_wrapper\nulysses_degree: [" + ", ".join(items) + "]\n"


def test_nested_aliases_give_a_short_error_and_little_memory(tmp_path):
    path = _yaml_plan(tmp_path, _laughs(7), cp_size=4)
    tracemalloc.start()
    try:
        with pytest.raises(PlanError) as info:
            load_plan(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(str(info.value)) < 1000, len(str(info.value))
    assert peak < 20 * 2**20, peak
    assert info.value.field == str(path) and "aliases" in info.value.reason, info.value


def test_an_alias_used_a_few_times_is_fine(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(textwrap.dedent("""\
        accelerator: {cp_size: 2}
        plan_overrides:
          - {match: "*.self_attn", when: cp, region_dispatch: false, inner_wrapper: &w sdpa_hf}
          - {match: "*.cross_attn", when: cp, region_dispatch: false, inner_wrapper: *w}
        """))
    assert len(load_plan(path).overrides) == 2


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("accelerator: &a {cp_size: 2, x: *a}\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.field == str(path) and "recursive" in info.value.reason


def test_a_yaml_file_above_the_size_bound_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("accelerator: {cp_size: 2}\n" + "#" * MAX_YAML_BYTES + "\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.field == str(path) and "bytes" in info.value.reason and len(str(info.value)) < 500


def test_many_nodes_without_aliases_are_refused(tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text("accelerator: {cp_size: [" + ", ".join(["1"] * (MAX_YAML_NODES + 1)) + "]}\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.field == str(path) and "nodes" in info.value.reason


def test_values_in_errors_are_truncated():
    """A dict plan from Python may hold anything: the values an error shows are cut short."""
    shared = ["x" * 100] * 10
    for _ in range(6):
        shared = [shared] * 10  # 10**7 leaves, one list per level
    plans = [
        {"accelerator": {"cp_size": "9" * 100_000}},
        {"accelerator": {"cp_size": shared}},
        {"accelerator": {"cp_size": 2}, "plan_overrides": [{"match": "*", "when": "cp", "region_dispatch": False,
            "inner_wrapper": {"_target_": "cpcompile.wrappers.sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": shared}}]},
        {"accelerator": {"cp_size": 2}, "plan_overrides": [{"match": "*", "when": "cp", "region_dispatch": False,
            "inner_wrapper": {"_target_": "cpcompile.wrappers." + "x" * 100_000}}]},
        {"accelerator": {"cp_size": 2, "k" * 100_000: 1}},
        {"accelerator": {"cp_size": 10 ** 5000}},
    ]
    for plan in plans:
        with pytest.raises(PlanError) as info:
            load_plan(plan)
        assert len(str(info.value)) < 1000, str(info.value)[:300]


@pytest.mark.parametrize("text, line", [
    ("accelerator: {cp_size: 2}\naccelerator: {cp_size: 4}\n", 2),  # a whole section twice
    ("accelerator:\n  cp_size: 2\n  dp_shard_size: 1\n  cp_size: 4\n", 4),
])
def test_a_key_given_twice_is_refused(tmp_path, text, line):
    """YAML keeps the last of two equal keys, silently; a plan or train config refuses them."""
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.field == str(path) and f"line {line}" in info.value.reason and "twice" in info.value.reason


def test_a_merge_may_still_override_what_it_brings(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(textwrap.dedent("""\
        accelerator: {cp_size: 2}
        plan_overrides:
          - &o {match: "*.self_attn", when: cp, region_dispatch: false, inner_wrapper: sdpa_hf}
          - {<<: *o, match: "*.cross_attn"}
        """))
    assert [o.match for o in load_plan(path).overrides] == ["*.self_attn", "*.cross_attn"]
