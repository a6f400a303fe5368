"""The trainer config's sections are declared once (issue 51): each key a dataclass field with a
type, a default and a docstring; one checker reads the type hints; the reference (and the docs'
copy of it) is generated from the dataclasses, so no default is written twice."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import get_args

import pytest
import yaml

from cpcompile.errors import PlanError
from cpcompile.trainer.config_reference import field_docs, render_reference
from cpcompile.trainer.config_sections import (
    SECTIONS, CheckpointSettings, DataSettings, OptimizerSettings, TrainSettings,
)
from cpcompile.trainer.field_checks import check_value
from cpcompile.trainer.sdpa_backend import SDPA_BACKENDS, SDPABackendName

DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"


def test_the_reference_lists_every_key_with_its_docstring_and_default():
    """Read back as YAML, the reference is each section's defaults, key for key."""
    reference = yaml.safe_load(render_reference())
    assert list(reference) == list(SECTIONS)
    for name, cls in SECTIONS.items():
        keys = [field.name for field in dataclasses.fields(cls)]
        assert list(reference[name]) == keys, name
        assert set(field_docs(cls)) == set(keys), name
        assert cls(**reference[name]) == cls(), name


def test_the_docs_hold_the_reference_as_printed():
    text = DOCS.read_text()
    block = re.search(r"<!-- config-reference: start.*?-->\n```yaml\n(.*?)```\n<!-- config-reference: end -->",
                      text, re.S)
    assert block is not None, "docs/trainer.md lost its config-reference block"
    assert block.group(1) == render_reference(), \
        "docs/trainer.md's config reference is stale: paste `python -m cpcompile config-reference` into it"


def test_the_cli_prints_the_reference(capsys):
    from cpcompile.cli import main

    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == render_reference()


def test_closed_choices_are_the_kernels_known():
    assert get_args(SDPABackendName) == tuple(SDPA_BACKENDS)


@pytest.mark.parametrize("cls, values, field, words", [
    (TrainSettings, {"steps": True}, "train.steps", "must be an integer >= 1, got True"),
    (TrainSettings, {"seed": 1.5}, "train.seed", "must be an integer, got 1.5"),
    (TrainSettings, {"lr": float("nan")}, "train.lr", "must be a positive number"),
    (TrainSettings, {"device": "tpu"}, "train.device", "must be one of cpu, cuda, npu, got 'tpu'"),
    (TrainSettings, {"gdn_backend": "fla"}, "train.gdn_backend", "must be one of eager, triton or null"),
    (TrainSettings, {"metrics_file": ""}, "train.metrics_file", "must be a non-empty string or null"),
    (TrainSettings, {"verify": 1}, "train.verify", "must be true or false, got 1"),
    (TrainSettings, {"mixed_precision": ["bfloat16"]}, "train.mixed_precision", "must be a mapping of"),
    (TrainSettings, {"mixed_precision": {"param_dtype": "float8"}}, "train.mixed_precision.param_dtype",
     "must be one of float32, bfloat16, float64 or null"),
    (TrainSettings, {"mixed_precision": {"dtype": "bfloat16"}}, "train.mixed_precision.dtype", "unknown key"),
    (TrainSettings, {"offload_layer_inputs": True}, "train.offload_layer_inputs", "needs activation_checkpointing"),
    (OptimizerSettings, {"betas": 0.9}, "optimizer.betas", "must be a list of 2 items, each a number in [0, 1)"),
    (OptimizerSettings, {"betas": [0.9, "0.99"]}, "optimizer.betas[1]", "must be a number >= 0.0 < 1.0"),
    (OptimizerSettings, {"warmup_steps": 1.0}, "optimizer.warmup_steps", "must be an integer >= 0, got 1.0"),
    (OptimizerSettings, {"schedule": "linear"}, "optimizer.schedule", "must be one of cosine, constant"),
    (DataSettings, {"text_field": None}, "data.text_field", "must be a non-empty string, got None"),
    (DataSettings, {"path": "x.txt"}, "data.path", "synthetic data reads no file"),
    (CheckpointSettings, {"allow_changes": "train.seq_len"}, "checkpoint.allow_changes", "must be a list"),
    (CheckpointSettings, {"allow_changes": ["train.seq_len", "train.vocab"]}, "checkpoint.allow_changes[1]",
     "one of train.seq_len"),
    (CheckpointSettings, {"export": True}, "checkpoint.export", "needs checkpoint.folder"),
])
def test_one_checker_names_the_field(cls, values, field, words):
    with pytest.raises(PlanError) as info:
        cls(**values)
    assert info.value.field == field and words in info.value.reason, info.value


def test_sections_keep_the_checked_values():
    """A YAML list is kept as a tuple, an integer given for a number as a float; a replace checks again."""
    assert OptimizerSettings(betas=[0, 1 / 2]).betas == (0.0, 0.5)
    assert CheckpointSettings(allow_changes=["train.seq_len"]).allow_changes == ("train.seq_len",)
    assert type(TrainSettings(lr=1).lr) is float
    with pytest.raises(PlanError, match="train.steps"):
        dataclasses.replace(TrainSettings(), steps=0)


def test_a_hint_the_checker_does_not_read_is_refused():
    with pytest.raises(TypeError, match="reads no hint"):
        check_value("x", 1, complex)
