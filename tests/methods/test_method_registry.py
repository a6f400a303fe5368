"""The method registry: every built-in wrapper's method is registered once, with what compile,
the passes and the schedule ask of it (finder, rewrite, layout, sub-groups, sync counterpart)."""
from __future__ import annotations

import inspect

import pytest

from cpcompile import wrappers
from cpcompile.adapters import qwen3_5
from cpcompile.methods import (
    CPMethod, MethodSpec, is_inner_wrapper, method_spec, methods_of_core, region_for, register_method,
)

PARAMS = {"ulysses_degree": 2}


def _builtin_methods() -> list[CPMethod]:
    methods = []
    for module in (wrappers, qwen3_5):
        for _, fn in inspect.getmembers(module, is_inner_wrapper):
            wanted = inspect.signature(fn).parameters
            methods.append(fn(**{k: v for k, v in PARAMS.items() if k in wanted}))
    return methods


@pytest.mark.parametrize("method", _builtin_methods(), ids=lambda m: m.wrapper)
def test_every_builtin_wrapper_names_a_registered_method(method):
    spec = method_spec(method)
    assert (spec.core, spec.name, spec.asynchronous) == (method.core, method.name, method.asynchronous)
    assert spec.layout == method.layout and callable(spec.find) and callable(spec.rewrite)
    assert hasattr(region_for(method), "prepare_call")
    if method.asynchronous:  # its sync counterpart is a marked wrapper of the same method, not async
        sync = getattr(wrappers, spec.sync_wrapper)
        assert is_inner_wrapper(sync)
        twin = sync(**{k: v for k, v in PARAMS.items() if k in inspect.signature(sync).parameters})
        assert (twin.core, twin.name, twin.asynchronous) == (method.core, method.name, False)


def test_hybrid_asks_for_its_subgroups_others_for_none():
    degrees = {m.wrapper: method_spec(m).subgroups(m.params) for m in _builtin_methods()}
    assert degrees["sdpa_hf_hybrid_cp_wrapper"] == degrees["sdpa_hf_async_hybrid_cp_wrapper"] == (2,)
    assert all(not d for w, d in degrees.items() if "hybrid" not in w)


def test_sdpa_and_gdn_have_head_tail_methods():
    """GDN's in Head-Tail order (issue 49) keep the layout's fixed chunks for a packed batch."""
    assert {s.layout for s in methods_of_core("sdpa")} == {"contiguous", "head_tail"}
    assert {s.layout for s in methods_of_core("gdn")} == {"contiguous", "head_tail"}
    assert {s.name for s in methods_of_core("gdn") if s.layout == "head_tail"} == {"p2p_head_tail",
                                                                                   "all_gather_head_tail"}
    assert all(s.fixed_chunks == (s.layout == "head_tail") for s in methods_of_core("gdn"))


def test_unregistered_method_and_conflicting_registration_are_refused():
    with pytest.raises(NotImplementedError, match="no CP method is registered for sdpa:ring"):
        method_spec(CPMethod(name="ring", core="sdpa", wrapper="ring_wrapper"))
    spec = method_spec(wrappers.sdpa_hf_cp_wrapper())
    assert register_method(spec) is spec  # registering the same spec again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_method(MethodSpec(core=spec.core, name=spec.name, find=spec.find, rewrite=lambda *a: None))
