"""examples/finetune_qwen3_5_chat.yaml stays a config the trainer accepts, over the folder
examples/make_tiny_checkpoint.py writes (weights, tokenizer and chat template checked as a run
checks them before starting; the run itself is the walk-through of docs/trainer.md, ~40 s on CPU)."""
from __future__ import annotations

import importlib.util
import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _make_tiny_checkpoint():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint",
                                                  os.path.join(ROOT, "examples", "make_tiny_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fine_tuning_example_loads_over_the_tiny_checkpoint(tmp_path, monkeypatch):
    from cpcompile.trainer import load_train_config

    folder = _make_tiny_checkpoint().write_checkpoint(str(tmp_path / "tiny_qwen3_5"))
    with open(os.path.join(ROOT, "examples", "finetune_qwen3_5_chat.yaml"), encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    assert raw["model"]["path"] == raw["data"]["tokenizer"] == "examples/tiny_qwen3_5"
    raw["model"]["path"] = raw["data"]["tokenizer"] = folder
    monkeypatch.chdir(ROOT)  # the example's data path is relative to the repository root
    config = load_train_config(raw)
    assert config.data.source == "chat" and config.checkpoint.export
    assert config.model.get("weights", "pretrained") == "pretrained", config.model
