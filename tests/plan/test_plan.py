"""cpcompile.plan: every validation rule, one test each; the message must name field and cause."""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pathlib
import pickle

import pytest

import cpcompile
import cpcompile.methods.names as wrapper_names
from cpcompile.errors import PlanError
from cpcompile.methods import CPMethod
from cpcompile.plan import AcceleratorConfig, Override, Plan, load_plan
from cpcompile.methods import inner_wrapper

DATA = pathlib.Path(__file__).parent.parent / "data"
SDPA_HF = "cpcompile.wrappers.sdpa_hf_cp_wrapper"


_DROP = object()  # marks a key to leave out of the override


def _override(**changes):
    entry = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_wrapper": "sdpa_hf"}
    entry.update(changes)
    return {k: v for k, v in entry.items() if v is not _DROP}


def _plan(*overrides, **accelerator):
    return {"accelerator": {"cp_size": 2, **accelerator}, "plan_overrides": list(overrides)}


def _error(source) -> PlanError:
    with pytest.raises(PlanError) as info:
        load_plan(source)
    return info.value


def _assert_error(source, field: str, *words: str) -> PlanError:
    err = _error(source)
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: "), str(err)
    for word in words:
        assert word in err.reason, f"{word!r} not in {err.reason!r}"
    return err


# Wrappers used by the tests: marked ones may be named by `_target_: test_plan.<name>`, since this
# module allows itself (plans may not name a module nobody allowed: tests/plan/test_hostile_plans.py).
cpcompile.allow_wrapper_module(__name__)


@inner_wrapper
def hybrid_wrapper(ulysses_degree: int) -> CPMethod:
    if ulysses_degree < 2:
        raise ValueError(f"ulysses_degree must be >= 2, got {ulysses_degree}")
    return CPMethod(name="hybrid", core="sdpa", wrapper="hybrid_wrapper", params={"ulysses_degree": ulysses_degree})


@inner_wrapper
def returns_string() -> str:
    return "all_gather"


def unmarked_wrapper() -> CPMethod:
    return CPMethod(name="all_gather", core="sdpa", wrapper="unmarked_wrapper")


# --------------------------------------------------------------------------- sources


def test_yaml_file_is_loaded(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "accelerator:\n  cp_size: 2\n  dp_shard_size: 2\n  sequence_parallel: false\n"
        "plan_overrides:\n"
        "  - match: '*.self_attn'\n    when: cp\n    region_dispatch: false\n"
        "    inner_target: self\n    inner_wrapper: sdpa_hf\n"
    )
    for source in (path, str(path)):
        plan = load_plan(source)
        assert plan.accelerator == AcceleratorConfig(cp_size=2, dp_shard_size=2)
        assert plan.cp_size == 2 and plan.accelerator.world_size == 4
        (o,) = plan.overrides
        assert (o.match, o.when, o.region_dispatch, o.inner_target, o.index) == ("*.self_attn", "cp", False, "self", 0)
        assert o.method.wrapper == "sdpa_hf_cp_wrapper" and o.method.name == "all_gather"
        assert o.local_compute_fn is None


def test_checked_in_yaml_examples_load():
    plan = load_plan(DATA / "plan_all_gather.yaml")
    assert [o.method.wrapper for o in plan.overrides] == ["sdpa_hf_cp_wrapper", "sdpa_qkv_cp_wrapper"]
    assert [o.inner_target for o in plan.overrides] == ["self", "core_attention"]
    assert plan.accelerator.world_size == 4


def test_yaml_uses_safe_load_only(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("accelerator: !!python/object/apply:os.system ['echo pwned']\n")
    _assert_error(path, str(path), "not valid YAML")


def test_empty_yaml_is_rejected(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    _assert_error(path, "<plan>", "empty")


def test_dict_source_and_defaults():
    plan = load_plan({"accelerator": {"cp_size": 4}})
    assert plan.overrides == () and plan.cp_size == 4
    assert load_plan({}).accelerator == AcceleratorConfig()


def test_plan_object_is_returned_after_validation():
    method = wrapper_names.lookup_registered("sdpa_hf")()
    plan = Plan(AcceleratorConfig(cp_size=2), (Override("*.attn", "cp", False, method=method),))
    assert load_plan(plan) is plan


def test_hand_built_plan_is_reindexed_and_validated():
    method = wrapper_names.lookup_registered("sdpa_hf")()
    good = Override("a", "cp", False, method=method, index=7)
    bad = Override("b", "cp", True, method=method, index=7)
    plan = Plan(AcceleratorConfig(cp_size=2), [good, bad])
    assert [o.index for o in plan.overrides] == [0, 1]
    assert plan.overrides[1].field("match") == "plan_overrides[1].match"
    _assert_error(plan, "plan_overrides[1].region_dispatch", "must be exactly false")
    with pytest.raises(PlanError):
        plan.validate()


def test_hand_built_plan_checks_accelerator_and_method():
    method = wrapper_names.lookup_registered("sdpa_hf")()
    _assert_error(Plan(AcceleratorConfig(cp_size=0)), "accelerator.cp_size", ">= 1")
    _assert_error(Plan(AcceleratorConfig(tp_size=True)), "accelerator.tp_size", "integer")
    _assert_error(Plan({"cp_size": 2}), "accelerator", "AcceleratorConfig")
    _assert_error(Plan(AcceleratorConfig(), ("x",)), "plan_overrides[0]", "Override")
    _assert_error(
        Plan(AcceleratorConfig(), (Override("a", "cp", False, method="all_gather"),)),
        "plan_overrides[0].inner_wrapper", "CPMethod",
    )
    _assert_error(
        Plan(AcceleratorConfig(), (Override("a", "cp", False, method=method),
                                   Override("a", "cp", False, method=method))),
        "plan_overrides[1].match", "ambiguous",
    )


def test_unsupported_source_type():
    with pytest.raises(TypeError, match="YAML path, a dict or a Plan"):
        load_plan(["accelerator"])


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "missing.yaml")


def test_plan_error_str_and_pickle():
    err = PlanError("plan_overrides[1].inner_wrapper._target_", "not marked")
    assert str(err) == "plan_overrides[1].inner_wrapper._target_: not marked"
    again = pickle.loads(pickle.dumps(err))
    assert (again.field, again.reason, str(again)) == (err.field, err.reason, str(err))
    assert isinstance(err, ValueError)


# --------------------------------------------------------------------------- top level


def test_top_level_must_be_mapping(tmp_path):
    path = tmp_path / "scalar.yaml"
    path.write_text("cp_size\n")
    _assert_error(path, "<plan>", "must be a mapping", "str")


def test_top_level_unknown_key():
    _assert_error({**_plan(), "trainer": {}}, "trainer", "unknown key", "accelerator, plan_overrides")


def test_top_level_yaml_list_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- accelerator\n")
    _assert_error(path, "<plan>", "must be a mapping", "list")


# --------------------------------------------------------------------------- accelerator


def test_accelerator_must_be_mapping():
    _assert_error({"accelerator": None}, "accelerator", "mapping")


def test_accelerator_unknown_key():
    _assert_error({"accelerator": {"cp_degree": 2}}, "accelerator.cp_degree", "unknown key", "cp_size")


@pytest.mark.parametrize("value", [0, -1, 1.0, "2", None, True])
def test_accelerator_size_must_be_positive_int(value):
    _assert_error({"accelerator": {"dp_shard_size": value}}, "accelerator.dp_shard_size", "integer >= 1")


@pytest.mark.parametrize("value", [1, "false", None])
def test_accelerator_flag_must_be_bool(value):
    _assert_error({"accelerator": {"loss_parallel": value}}, "accelerator.loss_parallel", "true or false")


def test_world_size_excludes_ep():
    acc = AcceleratorConfig(dp_replicate_size=2, dp_shard_size=3, tp_size=2, cp_size=2, ep_size=8, pp_size=1)
    assert acc.world_size == 24
    assert "= 24" in acc.world_size_formula()


@pytest.mark.parametrize("key", ["algorithm", "schedule", "ulysses_degree", "load_balance", "async_fallback"])
def test_legacy_key_under_accelerator(key):
    err = _assert_error({"accelerator": {"cp_size": 2, key: "x"}}, f"accelerator.{key}",
                        "no longer supported", "plan_overrides[].inner_wrapper")
    assert "per module" in err.reason


@pytest.mark.parametrize("key", ["algorithm", "schedule", "ulysses_degree", "load_balance", "async_fallback"])
def test_legacy_key_under_accelerator_cp(key):
    _assert_error({"accelerator": {"cp_size": 2, "cp": {key: 2}}}, f"accelerator.cp.{key}",
                  "no longer supported", "plan_overrides[].inner_wrapper")


def test_legacy_accelerator_cp_mapping():
    _assert_error({"accelerator": {"cp": {"size": 2}}}, "accelerator.cp",
                  "no longer supported", "plan_overrides[].inner_wrapper", "cp_size")


# --------------------------------------------------------------------------- plan_overrides


def test_plan_overrides_may_be_empty():
    assert load_plan(_plan()).overrides == ()
    assert load_plan({"plan_overrides": None}).overrides == ()


def test_plan_overrides_must_be_list():
    _assert_error({"plan_overrides": {"match": "*"}}, "plan_overrides", "must be a list")


def test_override_must_be_mapping():
    _assert_error(_plan(_override(), "*.self_attn"), "plan_overrides[1]", "must be a mapping")


def test_override_unknown_key():
    _assert_error(_plan(_override(algorithm="ulysses")), "plan_overrides[0].algorithm", "unknown key", "inner_wrapper")


def test_match_required():
    _assert_error(_plan(_override(match=_DROP)), "plan_overrides[0].match", "required")


@pytest.mark.parametrize("value", ["", "  ", 3, None])
def test_match_must_be_non_empty_string(value):
    _assert_error(_plan(_override(match=value)), "plan_overrides[0].match", "non-empty string")


def test_when_required():
    _assert_error(_plan(_override(when=_DROP)), "plan_overrides[0].when", "required")


@pytest.mark.parametrize("value", ["tp", "always", True, None])
def test_when_only_cp(value):
    _assert_error(_plan(_override(when=value)), "plan_overrides[0].when", "unsupported value", "cp")


def test_region_dispatch_required():
    _assert_error(_plan(_override(region_dispatch=_DROP)), "plan_overrides[0].region_dispatch",
                  "required", "own their communication")


@pytest.mark.parametrize("value", [True, 0, "false", None])
def test_region_dispatch_must_be_false(value):
    _assert_error(_plan(_override(region_dispatch=value)), "plan_overrides[0].region_dispatch",
                  "exactly false", "own their communication")


def test_inner_target_default_and_dotted_path():
    plan = load_plan(_plan(_override(inner_target=_DROP), _override(match="*.attn", inner_target="inner.core_0")))
    assert [o.inner_target for o in plan.overrides] == ["self", "inner.core_0"]


@pytest.mark.parametrize("value", ["", "a..b", "core attention", "*.core", 1])
def test_inner_target_must_be_self_or_dotted_path(value):
    _assert_error(_plan(_override(inner_target=value)), "plan_overrides[0].inner_target", "dotted submodule path")


def test_wrapper_or_local_compute_fn_required():
    _assert_error(_plan(_override(inner_wrapper=_DROP)), "plan_overrides[0].inner_wrapper",
                  "exactly one of inner_wrapper / local_compute_fn", "neither")


def test_wrapper_and_local_compute_fn_exclusive():
    _assert_error(_plan(_override(local_compute_fn="my.fn")), "plan_overrides[0].inner_wrapper",
                  "exactly one of", "both")


def test_local_compute_fn_must_be_registered():
    _assert_error(_plan(_override(inner_wrapper=_DROP, local_compute_fn="my_project.cp.compute")),
                  "plan_overrides[0].local_compute_fn", "'my_project.cp.compute' is not a registered local compute",
                  "@cpcompile.local_compute_fn")


def test_local_compute_fn_must_be_string():
    _assert_error(_plan(_override(inner_wrapper=_DROP, local_compute_fn=3)),
                  "plan_overrides[0].local_compute_fn", "dotted path string")


def test_unregistered_local_compute_fn_refused_in_python_plan():
    _assert_error(Plan(AcceleratorConfig(), (Override("a", "cp", False, local_compute_fn="m.f"),)),
                  "plan_overrides[0].local_compute_fn", "not a registered local compute function")


def test_duplicate_match_is_ambiguous():
    _assert_error(_plan(_override(), _override(match="*.mlp"), _override(inner_wrapper="sdpa_qkv")),
                  "plan_overrides[2].match", "plan_overrides[0]", "ambiguous")


def test_overlapping_globs_are_left_to_compile_time():
    plan = load_plan(_plan(_override(match="*.self_attn"), _override(match="model.layers.0.*")))
    assert len(plan.overrides) == 2


# --------------------------------------------------------------------------- inner_wrapper


@pytest.mark.parametrize("name", wrapper_names.registered_names())
def test_registered_names_resolve(name):
    (o,) = load_plan(_plan(_override(inner_wrapper=name))).overrides
    assert isinstance(o.method, CPMethod)


def test_unknown_registered_name_lists_names():
    err = _assert_error(_plan(_override(inner_wrapper="sdpa_magic")), "plan_overrides[0].inner_wrapper",
                        "unknown inner wrapper 'sdpa_magic'")
    for name in wrapper_names.registered_names():
        assert name in err.reason


def test_dotted_string_hints_at_target():
    _assert_error(_plan(_override(inner_wrapper=SDPA_HF)), "plan_overrides[0].inner_wrapper",
                  "unknown inner wrapper", "_target_")


def test_target_resolves_marked_wrapper():
    (o,) = load_plan(_plan(_override(inner_wrapper={"_target_": SDPA_HF}))).overrides
    assert o.method.wrapper == "sdpa_hf_cp_wrapper"


@pytest.mark.parametrize("method", ["ulysses", "p2p", "all_gather"])
def test_old_model_adapter_paths_still_resolve(method):
    """The GDN wrappers moved from cpcompile.models to cpcompile.adapters; old plans keep working."""
    name = f"qwen3_5_gdn_{method}_cp_wrapper"
    (old,) = load_plan(_plan(_override(inner_wrapper={"_target_": f"cpcompile.models.qwen3_5.{name}"}))).overrides
    (new,) = load_plan(_plan(_override(inner_wrapper={"_target_": f"cpcompile.adapters.qwen3_5.{name}"}))).overrides
    assert old.method == new.method and old.method.wrapper == name


def test_target_with_parameters():
    spec = {"_target_": f"{__name__}.hybrid_wrapper", "ulysses_degree": 2}
    (o,) = load_plan(_plan(_override(inner_wrapper=spec), cp_size=4)).overrides
    assert o.method.name == "hybrid" and dict(o.method.params) == {"ulysses_degree": 2}


def test_target_required_in_mapping():
    _assert_error(_plan(_override(inner_wrapper={"ulysses_degree": 2})),
                  "plan_overrides[0].inner_wrapper._target_", "required")


def test_target_must_be_string():
    _assert_error(_plan(_override(inner_wrapper={"_target_": 5})),
                  "plan_overrides[0].inner_wrapper._target_", "dotted path string")


def test_unmarked_target_is_refused_and_never_called(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(a))
    _assert_error(_plan(_override(inner_wrapper={"_target_": "os.system", "command": "echo pwned"})),
                  "plan_overrides[0].inner_wrapper._target_",
                  "module 'os' may not provide inner wrappers")
    assert calls == []
    _assert_error(_plan(_override(inner_wrapper={"_target_": "cpcompile.wrappers.CPMethod"})),
                  "plan_overrides[0].inner_wrapper._target_", "not marked with @cpcompile.inner_wrapper")


def test_unmarked_function_in_project_is_refused():
    _assert_error(_plan(_override(inner_wrapper={"_target_": f"{__name__}.unmarked_wrapper"})),
                  "plan_overrides[0].inner_wrapper._target_", "not marked")


@pytest.mark.parametrize("target, cause", [
    ("nowhere_pkg.mod.fn", "module 'nowhere_pkg.mod' may not provide inner wrappers"),
    ("cpcompile.adapters.nowhere.fn", "cannot import module 'cpcompile.adapters.nowhere'"),
    ("cpcompile.wrappers.no_such_wrapper", "has no attribute 'no_such_wrapper'"),
    ("sdpa_hf_cp_wrapper", "not a dotted path"),
])
def test_unresolvable_target(target, cause):
    _assert_error(_plan(_override(inner_wrapper={"_target_": target})),
                  "plan_overrides[0].inner_wrapper._target_", cause)


def test_unknown_wrapper_parameter():
    _assert_error(_plan(_override(inner_wrapper={"_target_": SDPA_HF, "ulysses_degree": 2})),
                  "plan_overrides[0].inner_wrapper", "bad parameters", "ulysses_degree")


def test_missing_wrapper_parameter():
    _assert_error(_plan(_override(inner_wrapper={"_target_": f"{__name__}.hybrid_wrapper"})),
                  "plan_overrides[0].inner_wrapper", "bad parameters", "ulysses_degree")


def test_wrapper_rejects_parameter_value():
    _assert_error(_plan(_override(inner_wrapper={"_target_": f"{__name__}.hybrid_wrapper", "ulysses_degree": 1})),
                  "plan_overrides[0].inner_wrapper", "rejected its parameters", "ulysses_degree=1",
                  "must be >= 2")


def test_wrapper_must_return_cpmethod():
    _assert_error(_plan(_override(inner_wrapper={"_target_": f"{__name__}.returns_string"})),
                  "plan_overrides[0].inner_wrapper", "returned str", "CPMethod")


def test_wrapper_parameter_names_must_be_strings():
    _assert_error(_plan(_override(inner_wrapper={"_target_": SDPA_HF, 2: "x"})),
                  "plan_overrides[0].inner_wrapper", "parameter names must be strings")


def test_callable_object_in_dict_plan():
    (o,) = load_plan(_plan(_override(inner_wrapper=wrapper_names.lookup_registered("sdpa_qkv")))).overrides
    assert o.method.wrapper == "sdpa_qkv_cp_wrapper"
    spec = {"_target_": hybrid_wrapper, "ulysses_degree": 2}
    (o,) = load_plan(_plan(_override(inner_wrapper=spec))).overrides
    assert o.method.params["ulysses_degree"] == 2


def test_unmarked_callable_object_refused():
    _assert_error(_plan(_override(inner_wrapper=unmarked_wrapper)), "plan_overrides[0].inner_wrapper", "not marked")
    _assert_error(_plan(_override(inner_wrapper={"_target_": print})),
                  "plan_overrides[0].inner_wrapper._target_", "not marked")


@pytest.mark.parametrize("value", [3, None, ["sdpa_hf"]])
def test_inner_wrapper_bad_type(value):
    _assert_error(_plan(_override(inner_wrapper=value)), "plan_overrides[0].inner_wrapper",
                  "registered name", "_target_")


# --------------------------------------------------------------------------- when: cp at cp_size=1


def test_when_cp_skipped_at_cp_size_1(caplog):
    plan = load_plan(_plan(_override(), _override(match="*.linear_attn"), cp_size=1))
    with caplog.at_level(logging.INFO, logger="cpcompile"):
        assert plan.active_overrides() == ()
    records = [r for r in caplog.records if r.name == "cpcompile"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "cp_size=1" in records[0].getMessage() and "2 plan_overrides" in records[0].getMessage()


def test_when_cp_active_at_cp_size_2(caplog):
    plan = load_plan(_plan(_override(), cp_size=2))
    with caplog.at_level(logging.INFO, logger="cpcompile"):
        assert plan.active_overrides() == plan.overrides
    assert not [r for r in caplog.records if r.name == "cpcompile"]


def test_loaded_plan_is_immutable():
    plan = load_plan(_plan(_override()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.accelerator.cp_size = 8  # type: ignore[misc]
    assert copy.deepcopy(plan) == plan
