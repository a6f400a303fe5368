"""One error base: every user-facing error is a `CPCompileError` and keeps the builtin base callers
catch it by (`except ValueError` etc.), and survives pickling (errors cross process boundaries)."""
from __future__ import annotations

import pickle

import pytest

import cpcompile
from cpcompile import errors

BUILTIN_BASE = {
    "PlanError": ValueError,
    "CPConfigError": ValueError,
    "CoverageError": ValueError,
    "CPInputError": ValueError,
    "UnsupportedMaskError": ValueError,
    "UnsupportedError": NotImplementedError,
    "AlreadyCompiledError": RuntimeError,
    "GDNCapabilityError": RuntimeError,
    "VerificationError": RuntimeError,
    "MissingDependencyError": ImportError,
    "NonFiniteError": FloatingPointError,
    "CheckpointError": RuntimeError,
}


@pytest.mark.parametrize("name, builtin", BUILTIN_BASE.items())
def test_every_error_has_the_base_and_its_builtin(name, builtin):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.CPCompileError) and issubclass(cls, builtin)
    assert getattr(cpcompile, name) is cls  # exported at the top level


def test_every_error_class_is_listed():
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.CPCompileError)}
    assert defined == set(BUILTIN_BASE) | {"CPCompileError"}


def test_mask_error_is_an_input_error():
    assert issubclass(errors.UnsupportedMaskError, errors.CPInputError)


@pytest.mark.parametrize("err", [
    errors.PlanError("plan_overrides[0].when", "unsupported value"),
    errors.GDNCapabilityError("device", "no GPU"),
    errors.CPInputError("heads"),
    errors.PlanError("accelerator.cp_size", "x" * 10_000),  # clipped, and still the same after pickling
    errors.VerificationError("train.verify: step 2: off"),
    errors.CheckpointError("checkpoint ckpt/step-4: disk full"),
    errors.MissingDependencyError("pip install cpcompile[train]"),
    errors.NonFiniteError("model.layers.0.linear_attn: the CP region's forward output has NaN or Inf"),
])
def test_errors_pickle(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
